#!/usr/bin/env bash
# Builds the engines' venvs for the conformance suite, once: ~/.cache/kvroute-engines/<engine>-<version>/.
# Idempotent: a venv whose stamp matches what builds it (the build function, the engine, its package list)
# is reused as is; an edit to one engine's list rebuilds that engine's venv only.
# Each venv gets torch 2.13.0 from the package index (a CUDA build that runs on the CPU, 4.7 GB with its nvidia-*
# libraries; each venv downloads it again: this machine's index answers are not kept in pip's HTTP cache, so
# ~/.cache/pip stays empty — the built venvs themselves are the cache), the engine with --no-deps and only
# the packages its cache, request and event-publisher modules import, and kvroute itself (editable), so
# one process drives the engine's cache code and kvroute's subscriber side by side.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
root="${KVROUTE_ENGINES_CACHE:-$HOME/.cache/kvroute-engines}"
mkdir -p "$root"

# Pinned: what the engines' cache-side imports need, resolved once against vLLM 0.33.0 / SGLang 0.5.23.
VLLM_DEPS=(packaging==26.4 numpy==2.4.6 msgspec==0.23.0 pyzmq==27.3.0 cbor2==6.3.0 pydantic==2.14.4
  cachetools==8.0.2 psutil==7.2.2 regex==2026.11.19 transformers==5.20.2 pillow==13.0.0 urllib3==2.8.0
  aiohttp==3.14.5 requests==2.34.2 openai-harmony==0.0.8 openai==3.57.0 pybase64==1.5.1
  cloudpickle==3.1.3 uvloop==0.23.0 py-cpuinfo==9.0.0 prometheus_client==0.26.0 xgrammar==0.2.9
  fastapi==0.165.0 partial-json-parser==0.2.1.1.post7 llguidance==1.9.1)
SGLANG_DEPS=(packaging==26.4 numpy==2.4.6 msgspec==0.23.0 pyzmq==27.3.0 psutil==7.2.2 orjson==3.13.0
  pybase64==1.5.1 requests==2.34.2 pillow==13.0.0 starlette==1.10.0 pydantic==2.14.4 tqdm==4.70.1
  ipython==9.18.1 aiohttp==3.14.5 transformers==5.20.2 dill==0.4.1 triton==3.8.0
  ninja==1.13.0)  # RadixCache's HiCache hash is a C++ extension torch compiles on first use, with ninja

build() {  # build <name> <engine requirement> <deps...>
  local name="$1" req="$2"; shift 2
  local venv="$root/$name"
  local stamp_of_script
  stamp_of_script="$( (declare -f build; echo "$name $req $*") | sha256sum | cut -c1-16)"
  if [[ -f "$venv/.stamp" && "$(cat "$venv/.stamp")" == "$stamp_of_script" ]]; then
    echo "[setup] $name: up to date"; return
  fi
  echo "[setup] $name: building"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  # torch first, then the engine without its dependencies (the engines pin a different torch).
  "$venv/bin/pip" install -q torch==2.13.0
  "$venv/bin/pip" install -q "$@"
  "$venv/bin/pip" install -q -e "$repo" 'pytest>=8' pytest-timeout 'trio>=0.25'  # kvroute + the runner
  "$venv/bin/pip" install -q --no-deps "$req"
  "$venv/bin/python" -c "import torch; assert torch.__version__.split('+')[0] == '2.13.0', torch.__version__"
  echo "$stamp_of_script" > "$venv/.stamp"
}

want="${1:-all}"
[[ "$want" == all || "$want" == vllm-0.33.0 ]] && build vllm-0.33.0 vllm==0.33.0 "${VLLM_DEPS[@]}"
[[ "$want" == all || "$want" == vllm-0.34.0 ]] && build vllm-0.34.0 vllm==0.34.0 "${VLLM_DEPS[@]}"
[[ "$want" == all || "$want" == sglang-0.5.23 ]] && build sglang-0.5.23 sglang==0.5.23 "${SGLANG_DEPS[@]}"
echo "[setup] done"
