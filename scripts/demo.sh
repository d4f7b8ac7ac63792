#!/usr/bin/env bash
# The main job, end to end on the bundled tiny ChatGLM3 model, with a real Triton server on CPU:
# set up .venv/ -> build-engine (converts the HF weights, torch engine) -> verify the checkpoint
# against transformers' GlmForCausalLM -> patch-repo -> launch --detach -> ask the generate
# endpoint with curl -> curl test suite -> the OpenAI-compatible API with curl -> stop.
# Ports: HTTP_PORT (8000), GRPC_PORT (8001), METRICS_PORT (8002), OPENAI_PORT (8003).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

MODEL=tests/fixtures/tiny-chatglm3
ENGINE=engines/demo/engine
REPO=engines/demo/model_repo
HTTP_PORT=${HTTP_PORT:-8000}
GRPC_PORT=${GRPC_PORT:-8001}
METRICS_PORT=${METRICS_PORT:-8002}
OPENAI_PORT=${OPENAI_PORT:-8003}
URL=http://127.0.0.1:$HTTP_PORT
TRTGLM=.venv/bin/trtglm
export PATH="$PWD/.venv/bin:$PATH"  # the python backend's stub runs the first python3 on PATH

step() { printf '\n== %s\n' "$*"; }

step "build-engine: configs/tiny.yaml -> $ENGINE"
$TRTGLM build-engine --config configs/tiny.yaml --output-dir "$ENGINE" --force

step "verify the converted checkpoint against transformers' GlmForCausalLM"
$TRTGLM verify --checkpoint "$ENGINE/checkpoint" --hf-model "$MODEL"

step "patch-repo: $ENGINE -> $REPO"
$TRTGLM patch-repo --engine-dir "$ENGINE" --output-repo "$REPO" --force

step "launch (detached) on $URL"
$TRTGLM launch --repo "$REPO" --detach --http-port "$HTTP_PORT" --grpc-port "$GRPC_PORT" \
  --metrics-port "$METRICS_PORT" --openai-port "$OPENAI_PORT"
trap '$TRTGLM stop --repo "$REPO"' EXIT

ask() {  # ask MODEL TEXT_INPUT: POST /generate and print the JSON answer
  local body
  body=$(python3 -c 'import json, sys; print(json.dumps({"text_input": sys.argv[1], "max_tokens": 64}, ensure_ascii=False))' "$2")
  printf "\n$ curl -s %s/v2/models/%s/generate -d '%s'\n" "$URL" "$1" "$body"
  curl -s --fail-with-body "$URL/v2/models/$1/generate" -d "$body"
  echo
}
step "answers from the generate endpoint"
ask ensemble "What is the capital of France?"
ask ensemble "三个水是什么字？"
ask tensorrt_llm_bls '[{"role": "user", "content": "My name is Bob."}, {"role": "assistant", "content": "Nice to meet you, Bob."}, {"role": "user", "content": "What is my name?"}]'

step "streamed: trtglm generate over HTTP server-sent events, then gRPC"
$TRTGLM generate --url "$URL" --prompt "中国的首都是哪里？" --stream
$TRTGLM generate --grpc "127.0.0.1:$GRPC_PORT" --prompt "三个金是什么字？" --stream

step "curl test suite"
METRICS_URL=http://127.0.0.1:$METRICS_PORT/metrics bash scripts/curl_tests.sh "$URL"

step "the OpenAI-compatible API (http://127.0.0.1:$OPENAI_PORT/v1)"
OPENAI_URL=http://127.0.0.1:$OPENAI_PORT/v1
printf '\n$ curl -s %s/models\n' "$OPENAI_URL"
curl -s --fail-with-body "$OPENAI_URL/models"
echo
body='{"model": "tiny", "temperature": 0, "messages": [{"role": "user", "content": "What do bees make?"}]}'
printf "\n$ curl -s %s/chat/completions -H 'Content-Type: application/json' -d '%s'\n" "$OPENAI_URL" "$body"
curl -s --fail-with-body "$OPENAI_URL/chat/completions" -H 'Content-Type: application/json' -d "$body"
echo
