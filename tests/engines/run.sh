#!/usr/bin/env bash
# The engine-conformance stage: build (or reuse) the engines' venvs, then run the suite in each.
# Usage: tests/engines/run.sh [pytest args...]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="${KVROUTE_ENGINES_CACHE:-$HOME/.cache/kvroute-engines}"
# The venvs are shared between checkouts: this checkout's kvroute comes first on the path.
export PYTHONPATH="$(cd "$here/../.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
"$here/setup.sh"
status=0
# pytest's 5 is "no test selected": a -k expression may name configurations one engine lacks.
ok() { [ "$1" -eq 5 ] || status=1; }
for venv in vllm-0.33.0 vllm-0.34.0; do
  echo "== engine suite: $venv"
  (cd "$here" && PATH="$root/$venv/bin:$PATH" "$root/$venv/bin/python" -m pytest -q --confcutdir=. test_vllm.py test_golden.py "$@") || ok $?
done
echo "== engine suite: sglang-0.5.23"
# The venv's bin on PATH, as an activated venv has it: SGLang's RadixCache compiles its HiCache hash
# extension with torch's cpp_extension on first use, which runs the venv's `ninja`.
(cd "$here" && PATH="$root/sglang-0.5.23/bin:$PATH" "$root/sglang-0.5.23/bin/python" -m pytest -q --confcutdir=. test_sglang.py test_golden.py "$@") || ok $?
exit $status
