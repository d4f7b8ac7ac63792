#!/usr/bin/env bash
# Create .venv/ in the repository root and install trtglm with its test dependencies.
# Safe to re-run: it does nothing when the installed set is already current.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.trtglm-setup

log() { printf '[setup] %s\n' "$*"; }

# System package: Open MPI's mpirun runs multi-rank servers (trtglm launch --world-size N).
if ! command -v mpirun >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "installing openmpi-bin (mpirun)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin >/dev/null
  else
    log "warning: mpirun not found; install Open MPI (Debian/Ubuntu: apt-get install openmpi-bin) for multi-rank launches"
  fi
fi

wanted=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$wanted" ]; then
  log "environment is current ($VENV)"
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
LOG=$VENV/setup.log
# pip's output goes to $LOG and is shown only if an install fails.
pip_install() {
  if ! "$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off "$@" >>"$LOG" 2>&1; then
    tail -n 40 "$LOG" >&2
    log "pip install $* failed (full log: $LOG)"
    exit 1
  fi
}
: >"$LOG"
pip_install --upgrade pip
# Install the pinned CPU build of torch first so that resolving the project does not pull a
# multi-GB CUDA build (on GPU machines, install the torch you want before running this).
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  log "installing torch==2.13.0"
  pip_install "torch==2.13.0"
fi
log "installing trtglm and its test dependencies (log: $LOG)"
pip_install -e ".[test]"
# For tests/serve/test_stub_python.py: numpy 2 in a side folder, and this numpy's wheel for an offline pip
# (the python stubs under numpy 2, as on machines whose Python ships it).
pip_install --target "$VENV/numpy2" --upgrade "numpy>=2,<2.3"
"$VENV/bin/python" -m pip download --disable-pip-version-check --quiet --no-deps --only-binary=:all: \
  -d "$VENV/wheels" "numpy==$("$VENV/bin/python" -c 'import numpy; print(numpy.__version__)')" >>"$LOG" 2>&1 \
  || { tail -n 20 "$LOG" >&2; log "pip download numpy failed (full log: $LOG)"; exit 1; }
echo "$wanted" > "$STAMP"
log "done: $("$VENV/bin/python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
