#!/usr/bin/env bash
# Soak (issue 8 item 9): open-loop load through usher at half the knee rate for
# 10 minutes, sampling RSS, open fds and threads every 10 s; see benches/README.md.
#
#   benches/soak.sh                     600 s at half the knee found by the last run.sh
#   RATE=8000 DURATION=60 benches/soak.sh
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-benches/out/soak-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
DURATION=${DURATION:-600}
if [ -z "${RATE:-}" ]; then
  KNEE=$(cat "$OUT/knee.txt" 2>/dev/null || ls -t benches/out/*/knee.txt 2>/dev/null | head -1 | xargs -r cat || true)
  KNEE=${KNEE%.*}
  RATE=$(( ${KNEE:-10000} / 2 ))
  [ "$RATE" -gt 0 ] || RATE=5000
fi

source benches/lib.sh

PIN=()
ARGS=()
if [ "$(nproc)" -ge 2 ] && command -v taskset >/dev/null; then
  PIN=(taskset -c "${LOAD_CPU:-1}")
  ARGS=(--proxy-cpu "${PROXY_CPU:-0}")
fi

cargo bench --locked --no-run --bench e2e
echo "soak: $DURATION s at $RATE req/s through usher; load average $(cut -d' ' -f1-3 /proc/loadavg)"
timeout --kill-after=10 $(( DURATION + 120 )) "${PIN[@]}" cargo bench --locked --bench e2e -- \
  --soak "$DURATION" --soak-rate "$RATE" "${ARGS[@]}" --out "$OUT" > "$OUT/soak.md" &
TOOL_PID=$!
wait "$TOOL_PID"
TOOL_PID=
echo "- load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/soak.md"
cat "$OUT/soak.md"
