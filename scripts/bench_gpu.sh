#!/usr/bin/env bash
# The GPU benchmark set: trtglm's fast runtime (bf16, int8, int4) against Hugging Face generate() and
# the bandwidth floor, on random ChatGLM3-6B-shaped weights, then the decode matmuls on their own,
# decode with and without programmatic dependent launch, what each kind of small kernel costs a
# step, and Nsight Compute on the one-row kernels
# (docs/benchmarks.md, "Runtime on GPU", records its results).
#
#   [PARTS="runtime kernels"] scripts/bench_gpu.sh [DEST] [extra `bench runtime` flags]
#
# PARTS picks the halves (each takes five to seven minutes on an H200): `runtime` (bench runtime)
# and `kernels` (bench_matmul, bench_pdl, bench_prefill, bench_step_parts, Nsight Compute). DEST defaults to $OUT
# when set (the lent GPU machine's result folder), else out/bench-gpu. Needs python3 with torch (CUDA), triton,
# transformers and matplotlib; `fire` comes from .whl/ when python3 lacks it (the GPU machine's
# image has no fire: see docs/benchmarks.md).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-${OUT:-out/bench-gpu}}
shift || true
PARTS=${PARTS:-runtime kernels}
mkdir -p "$DEST"
if ! python3 -c "import fire" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/trtglm-site \
        .whl/fire-*.whl .whl/termcolor-*.whl
    export PYTHONPATH=/tmp/trtglm-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$DEST/nvidia-smi.txt"
if [[ " $PARTS " == *" runtime "* ]]; then
    python3 -m trtglm.bench.cli_commands runtime --preset 6b --dtype bf16 --weight-only none,int8,int4 \
        --batch 1,8,32,64 --prompt-len 128 --new-tokens 128 --baseline hf --long-prompt 512 \
        --requests 256 --concurrency 64 --prefill-chunk 1024 --out "$DEST" "$@" 2>&1 | tee "$DEST/log.txt"
fi
if [[ " $PARTS " == *" kernels "* ]]; then
    # The decode matmuls on their own (1 and 8 rows): every block shape; int8/int4 in Gluon against plain Triton.
    python3 scripts/bench_matmul.py --portable --rows 1,8 --out "$DEST/matmul.json" 2>&1 | grep -v '^{' \
        | tee "$DEST/matmul.txt"
    # Decode steps with and without programmatic dependent launch, in one process.
    python3 scripts/bench_pdl.py --out "$DEST/pdl.json" 2>&1 | tee "$DEST/pdl.txt"
    # One prompt's time to first token with the prefill graphs and launched eagerly, in one process.
    python3 scripts/bench_prefill.py --out "$DEST/prefill.json" 2>&1 | grep -v Warning | tee "$DEST/prefill.txt"
    # What each kind of small kernel costs a batch-1 step (the step captured without it; timing only).
    python3 scripts/bench_step_parts.py --kinds none,int4 --out "$DEST/step-parts.json" 2>&1 \
        | grep -v Warning | tee "$DEST/step-parts.txt"
    # Where the one-row matmuls spend their time (Nsight Compute; skipped where ncu is missing).
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1 || true)
    if [ -n "$NCU" ]; then
        "$NCU" --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis --section Occupancy \
            --section WarpStateStats --section SchedulerStats -k regex:gemv \
            python3 -c "import logging; logging.basicConfig(level=logging.INFO); \
from trtglm.bench.runtime import gemv_probe; gemv_probe()" > "$DEST/ncu.txt" 2>&1 || echo "ncu failed (see $DEST/ncu.txt)"
    fi
fi
