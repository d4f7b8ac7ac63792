#!/usr/bin/env bash
# Checks of a served ChatGLM3 model repository with nothing but curl (and python3 to read JSON).
#
#   scripts/curl_tests.sh [BASE_URL]          (default http://127.0.0.1:8000)
#
# Prints one line per check, "PASS name" or "FAIL name: reason", and exits 1 if any failed.
# Checks: /v2/health/ready; ensemble /generate answers EXPECT; ensemble /generate_stream sends
# events whose text joins to the same answer; tensorrt_llm_bls /generate and /generate_stream;
# the Prometheus metrics count the requests; and errors for a request without text_input,
# max_tokens -1, a prompt over max_input_len and malformed JSON.
#
# Environment: PROMPT (default "What is the capital of France?", the test fixture's question),
# EXPECT (default "The capital of France is Paris."; empty: any non-empty answer), MAX_TOKENS
# (64), METRICS_URL (default: the metrics URL of the trtglm launch serving BASE_URL), LONG_PROMPT_WORDS
# (40000: words in the too-long prompt), CURL_TIMEOUT (seconds per request, 120).

set -u

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    sed -n '2,16s/^# \{0,1\}//p' "$0"
    exit 0
fi

BASE_URL="${1:-http://127.0.0.1:8000}"
BASE_URL="${BASE_URL%/}"
PROMPT="${PROMPT:-What is the capital of France?}"
EXPECT="${EXPECT-The capital of France is Paris.}"
MAX_TOKENS="${MAX_TOKENS:-64}"
LONG_PROMPT_WORDS="${LONG_PROMPT_WORDS:-40000}"
CURL_TIMEOUT="${CURL_TIMEOUT:-120}"
export PROMPT EXPECT MAX_TOKENS LONG_PROMPT_WORDS

failures=0
pass() { echo "PASS $1"; }
fail() { echo "FAIL $1: $2"; failures=$((failures + 1)); }

for tool in curl python3; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        fail "setup" "$tool is not installed"
        exit 1
    fi
done

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

# --- helpers --------------------------------------------------------------------------------------

# body FILE KIND: write a request body (KIND: plain, stream, no-text, negative, long, malformed).
body() {
    python3 - "$1" "$2" <<'EOF'
import json, os, sys
path, kind = sys.argv[1], sys.argv[2]
text, tokens = os.environ["PROMPT"], int(os.environ["MAX_TOKENS"])
bodies = {
    "plain": {"text_input": text, "max_tokens": tokens},
    "stream": {"text_input": text, "max_tokens": tokens, "stream": True},
    "no-text": {"max_tokens": tokens},
    "negative": {"text_input": text, "max_tokens": -1},
    "long": {"text_input": "hi " * int(os.environ["LONG_PROMPT_WORDS"]), "max_tokens": tokens},
}
with open(path, "w", encoding="utf-8") as f:
    if kind == "malformed":  # cut off in the middle of the object
        f.write(json.dumps(bodies["plain"], ensure_ascii=False)[:-5])
    else:
        json.dump(bodies[kind], f, ensure_ascii=False)
EOF
}

# post PATH BODY_FILE NAME: POST to BASE_URL/PATH; the answer lands in $WORK/NAME.out, curl's
# complaints in $WORK/NAME.err; prints "STATUS CONTENT_TYPE" (status 000: no answer).
post() {
    curl -sS -N --max-time "$CURL_TIMEOUT" -o "$WORK/$3.out" -w '%{http_code} %{content_type}' \
        -H 'Content-Type: application/json' --data-binary "@$2" "$BASE_URL/$1" 2>"$WORK/$3.err"
}

# field FILE NAME: print a JSON object's field; exit 1 (printing why) when there is none.
field() {
    python3 - "$1" "$2" <<'EOF'
import json, sys
try:
    value = json.load(open(sys.argv[1], encoding="utf-8"))
except ValueError:
    print("the answer is not JSON: " + open(sys.argv[1], "rb").read(200).decode("utf-8", "replace"))
    sys.exit(1)
if not isinstance(value, dict) or sys.argv[2] not in value:
    print(f"no {sys.argv[2]} in the answer: " + json.dumps(value, ensure_ascii=False)[:200])
    sys.exit(1)
text = value[sys.argv[2]]
sys.stdout.write("".join(text) if isinstance(text, list) else str(text))
EOF
}

# stream_text FILE: the text_output of every server-sent event, joined; exit 1 (printing why)
# when there are no events or an event is an error.
stream_text() {
    python3 - "$1" <<'EOF'
import json, sys
events = [line[5:].strip() for line in open(sys.argv[1], encoding="utf-8").read().splitlines()
          if line.startswith("data:")]
if not events:
    print("no events in the stream")
    sys.exit(1)
pieces = []
for data in events:
    event = json.loads(data)
    if "error" in event:
        print(f"error event after {len(pieces)} piece(s): {event['error']}")
        sys.exit(1)
    text = event.get("text_output", "")
    pieces.append("".join(text) if isinstance(text, list) else text)
print(f"{len(events)} events", file=sys.stderr)
sys.stdout.write("".join(pieces))
EOF
}

# reason NAME STATUS: why a request did not get an answer.
reason() {
    if [[ "$2" == 000* ]]; then
        echo "no answer ($(head -c 200 "$WORK/$1.err" | tr '\n' ' ' | sed 's/ *$//'))"
    else
        echo "HTTP ${2%% *}: $(head -c 300 "$WORK/$1.out" | tr '\n' ' ' | sed 's/ *$//')"
    fi
}

# answer_matches TEXT: the answer is EXPECT (or, with EXPECT empty, not empty).
answer_matches() {
    if [[ -n "$EXPECT" ]]; then [[ "$1" == "$EXPECT" ]]; else [[ -n "$1" ]]; fi
}

# --- checks ---------------------------------------------------------------------------------------

check_ready() {
    local status
    status="$(curl -sS --max-time "$CURL_TIMEOUT" -o /dev/null -w '%{http_code}' "$BASE_URL/v2/health/ready" \
        2>"$WORK/ready.err")"
    if [[ "$status" == 200 ]]; then pass "health ready"; else fail "health ready" "$(reason ready "$status")"; fi
}

# check_generate MODEL: sets ANSWER to the reply.
check_generate() {
    local name="$1 generate" status text
    ANSWER=""
    body "$WORK/plain.json" plain
    status="$(post "v2/models/$1/generate" "$WORK/plain.json" "$1-generate")"
    if [[ "$status" != 200* ]]; then fail "$name" "$(reason "$1-generate" "$status")"; return; fi
    if ! text="$(field "$WORK/$1-generate.out" text_output)"; then fail "$name" "$text"; return; fi
    ANSWER="$text"
    if answer_matches "$text"; then pass "$name"; else fail "$name" "answer '$text', expected '$EXPECT'"; fi
}

# check_stream MODEL WHOLE: the streamed pieces join to WHOLE (the /generate answer).
check_stream() {
    local name="$1 generate_stream" status text
    body "$WORK/stream.json" stream
    status="$(post "v2/models/$1/generate_stream" "$WORK/stream.json" "$1-stream")"
    if [[ "$status" != 200* ]]; then fail "$name" "$(reason "$1-stream" "$status")"; return; fi
    if [[ "$status" != *text/event-stream* ]]; then
        fail "$name" "content type '${status#* }', expected text/event-stream"; return
    fi
    if ! text="$(stream_text "$WORK/$1-stream.out" 2>/dev/null)"; then fail "$name" "$text"; return; fi
    if ! answer_matches "$text"; then fail "$name" "joined text '$text', expected '$EXPECT'"; return; fi
    if [[ "$text" != "$2" ]]; then fail "$name" "joined text '$text' differs from /generate's '$2'"; return; fi
    pass "$name"
}

# check_error NAME MODEL BODY_KIND WORD: the request is refused with {"error": …} naming WORD.
check_error() {
    local name="error: $1" status message
    body "$WORK/$3.json" "$3"
    status="$(post "v2/models/$2/generate" "$WORK/$3.json" "error-$3")"
    if [[ "$status" == 000* ]]; then fail "$name" "$(reason "error-$3" "$status")"; return; fi
    if [[ "${status%% *}" -lt 400 ]]; then fail "$name" "HTTP ${status%% *}, expected an error status"; return; fi
    if ! message="$(field "$WORK/error-$3.out" error)"; then fail "$name" "$message"; return; fi
    if [[ -n "$4" && "$message" != *"$4"* ]]; then fail "$name" "error does not mention $4: $message"; return; fi
    pass "$name (HTTP ${status%% *}: ${message:0:120})"
}

# metrics_url: $METRICS_URL, else the metrics URL of the trtglm launch serving BASE_URL (its state.json, in
# $TRTGLM_STATE_DIR or $XDG_CACHE_HOME/trtglm/launches, default ~/.cache/trtglm/launches); fails without one.
metrics_url() {
    if [[ -n "${METRICS_URL:-}" ]]; then echo "$METRICS_URL"; return; fi
    python3 - "$BASE_URL" <<'EOF'
import json, os, sys
from pathlib import Path
from urllib.parse import urlsplit

def netloc(url):
    parts = urlsplit(url if "://" in url else "http://" + url)
    host = {"localhost": "127.0.0.1", "0.0.0.0": "127.0.0.1"}.get(parts.hostname or "", parts.hostname)
    return host, parts.port

cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
root = Path(os.environ.get("TRTGLM_STATE_DIR") or Path(cache) / "trtglm" / "launches")
for state_file in sorted(root.glob("*/state.json")):
    try:
        urls = json.loads(state_file.read_text()).get("urls", {})
    except (OSError, ValueError):
        continue
    if urls.get("metrics") and netloc(urls.get("http", "")) == netloc(sys.argv[1]):
        print(urls["metrics"])
        sys.exit(0)
sys.exit(f"no trtglm launch serves {sys.argv[1]} (state in {root}): set METRICS_URL")
EOF
}

check_metrics() {
    local url status count
    if ! url="$(metrics_url 2>"$WORK/metrics-url.err")"; then fail "metrics" "$(cat "$WORK/metrics-url.err")"; return; fi
    status="$(curl -sS --max-time "$CURL_TIMEOUT" -o "$WORK/metrics.out" -w '%{http_code}' "$url" \
        2>"$WORK/metrics.err")"
    if [[ "$status" != 200 ]]; then fail "metrics" "$url: $(reason metrics "$status")"; return; fi
    count="$(grep -E '^nv_inference_request_success\{[^}]*model="ensemble"' "$WORK/metrics.out" \
        | awk '{print $NF}' | head -n 1)"
    if [[ -z "$count" ]]; then fail "metrics" "$url has no nv_inference_request_success for the ensemble"; return; fi
    if ! awk -v n="$count" 'BEGIN { exit !(n >= 1) }'; then
        fail "metrics" "nv_inference_request_success of the ensemble is $count after a successful request"; return
    fi
    pass "metrics ($url: ensemble requests succeeded: $count)"
}

check_ready
check_generate ensemble
ENSEMBLE_ANSWER="$ANSWER"
check_stream ensemble "$ENSEMBLE_ANSWER"
check_generate tensorrt_llm_bls
check_stream tensorrt_llm_bls "$ANSWER"
check_metrics
check_error "missing text_input" ensemble no-text text_input
check_error "max_tokens -1" ensemble negative max_tokens
check_error "prompt over max_input_len" ensemble long max_input_len
check_error "malformed JSON" ensemble malformed ""

if ((failures > 0)); then
    echo "$failures check(s) failed against $BASE_URL" >&2
    exit 1
fi
echo "all checks passed against $BASE_URL" >&2
