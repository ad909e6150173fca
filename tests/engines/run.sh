#!/usr/bin/env bash
# The engine-conformance stage: build (or reuse) the engines' venvs, then run the suite in each.
# Usage: tests/engines/run.sh [pytest args...]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="${KVROUTE_ENGINES_CACHE:-$HOME/.cache/kvroute-engines}"
"$here/setup.sh"
status=0
for venv in vllm-0.33.0 vllm-0.34.0; do
  echo "== engine suite: $venv"
  (cd "$here" && "$root/$venv/bin/python" -m pytest -q --confcutdir=. test_vllm.py "$@") || status=1
done
exit $status
