#!/usr/bin/env bash
# The main job, end to end on the bundled tiny ChatGLM3 model:
# set up .venv/ -> convert HF weights to a tp-2 TensorRT-LLM checkpoint -> verify it against
# transformers' GlmForCausalLM -> answer chat prompts from the checkpoint with trtglm's runtime.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

MODEL=tests/fixtures/tiny-chatglm3
OUT=engines/demo
TRTGLM=.venv/bin/trtglm

step() { printf '\n== %s\n' "$*"; }

step "convert $MODEL -> $OUT/checkpoint (bfloat16, tensor parallel 2)"
$TRTGLM convert --model-dir "$MODEL" --output-dir "$OUT/checkpoint" --dtype bfloat16 --tp-size 2 --force

step "verify the checkpoint against transformers' GlmForCausalLM"
$TRTGLM verify --checkpoint "$OUT/checkpoint" --hf-model "$MODEL"

ask() {
  printf '\n> %s\n' "$1"
  $TRTGLM chat --checkpoint "$OUT/checkpoint" --tokenizer-dir "$MODEL" --prompt "$1"
}
step "answers from the checkpoint (trtglm runtime, greedy)"
ask "What is the capital of France?"
ask "三个水是什么字？"
ask '[{"role": "user", "content": "My name is Bob."}, {"role": "assistant", "content": "Nice to meet you, Bob."}, {"role": "user", "content": "What is my name?"}]'
