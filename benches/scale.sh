#!/usr/bin/env bash
# The capacity server at scale (issue 17, part 5); run by benches/run.sh, or alone:
#
#   benches/scale.sh            1k, 10k and 100k clients (about 6 minutes after the build)
#   benches/scale.sh --quick    1k and 10k, short (under a minute after the build)
#
# A real `usher server` under benches/server_load.rs: GetCapacity/s, its CPU per
# 1,000 GetCapacity and RSS per client; then every client refreshing at the
# interval the server hands out (refresh RPC/s and CPU). And `usher sim`: RPCs
# per second at the root with every client on it (scale-flat.yaml) against a
# root, 100 intermediates and the clients shared among them (scale-tree.yaml).
# Writes $OUT/scale.md (the tables) and $OUT/scale.log (every raw line).
set -euo pipefail
cd "$(dirname "$0")/.."

QUICK=0
for a in "$@"; do
  case "$a" in
    --quick) QUICK=1 ;;
    -h|--help) sed -n 2,12p "$0"; exit 0 ;;
    *) echo "unknown option $a" >&2; exit 64 ;;
  esac
done
OUT=${OUT:-benches/out/scale-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

# The servers server_load starts are listed in $OUT/pids; the trap stops them.
source benches/lib.sh

PIN=()
SERVER_ARGS=()
if [ "$(nproc)" -ge 2 ] && command -v taskset >/dev/null; then
  PIN=(taskset -c "${LOAD_CPU:-1}")
  SERVER_ARGS=(--server-cpu "${PROXY_CPU:-0}")
fi

if [ "$QUICK" = 1 ]; then
  # clients, GetCapacity seconds, refresh interval, refresh seconds
  RUNS=("1000 2 2 4" "10000 2 2 4")
  SIM_CLIENTS=(1000 10000)
  SIM_DURATION=40s
else
  RUNS=("1000 10 10 20" "10000 10 10 20" "100000 10 10 20")
  SIM_CLIENTS=(1000 10000 100000)
  SIM_DURATION=120s
fi

cargo bench --locked --no-run --bench server_load
USHER=${CARGO_TARGET_DIR:-target}/release/usher

# One field of a `key=value ...` line, units dropped.
field() { printf '%s\n' "$1" | tr ' ' '\n' | sed -n "s/^$2=//p" | tr -d '/su%'; }
: > "$OUT/scale.log"
{
  echo "### The capacity server at scale"
  echo
  echo "- load average at the start: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo
  echo "A real server (pinned apart from its load generator), one FAIR_SHARE resource 4x oversubscribed:"
  echo "GetCapacity as fast as 64 callers go once every client is registered; then, on a fresh server,"
  echo "every client refreshing when its interval runs out (measured after registration and two intervals)."
  echo
  echo "| clients | GetCapacity/s | p99 (µs) | CPU ms per 1k GetCapacity | RSS before (MB) | RSS after | bytes per client | registering (s) | refresh interval (s) | refresh RPC/s | clients ÷ interval | full interval | refresh late p99 (µs) | CPU ms per s (refresh) | CPU ms per 1k refreshes |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
} > "$OUT/scale.md"
for run in "${RUNS[@]}"; do
  set -- $run
  g=$(bounded 300 "${PIN[@]}" cargo bench --locked --bench server_load -- --clients "$1" --seconds "$2" \
    "${SERVER_ARGS[@]}" --pids "$OUT/pids" | tee -a "$OUT/scale.log" | grep '^server_load:' || true)
  r=$(bounded 400 "${PIN[@]}" cargo bench --locked --bench server_load -- --clients "$1" --refresh "$4" \
    --refresh-interval "$3" "${SERVER_ARGS[@]}" --pids "$OUT/pids" | tee -a "$OUT/scale.log" | grep '^server_refresh:' || true)
  echo "| $1 | $(field "$g" rate) | $(field "$g" p99) | $(field "$g" cpu_ms_per_1k) | $(field "$g" rss_before_mb) | $(field "$g" rss_after_mb) | $(field "$g" bytes_per_client) | $(field "$g" register_s) | $3 | $(field "$r" rate) | $(field "$r" clients_per_interval) | $(field "$r" full_interval)% | $(field "$r" late_p99) | $(field "$r" cpu_ms_per_s) | $(field "$r" cpu_ms_per_1k) |" >> "$OUT/scale.md"
done

{
  echo
  echo "\`usher sim\` ($SIM_DURATION simulated, seed 1, refresh interval 8 s, RPCs per second over the last half):"
  echo "every client on the root (scale-flat.yaml) against a root, 100 intermediates and the clients"
  echo "shared among them (scale-tree.yaml), side by side at each count."
  echo
  echo "| clients | flat: RPC/s at the root | tree: RPC/s at the root | tree: at the intermediates | tree root ÷ flat root | flat: wall time (s) | tree: wall time (s) |"
  echo "|---|---|---|---|---|---|---|"
} >> "$OUT/scale.md"
# From `usher sim`'s text report: RPC/s at the root, at level 1 (- for none), wall time.
simfig() {
  awk '/simulated in/ { w = $(NF-1) } /at the root/ { r = $(NF-1) } /at level 1/ { l = $(NF-1) }
       END { print (r == "" ? "-" : r), (l == "" ? "-" : l), (w == "" ? "-" : w) }'
}
for n in "${SIM_CLIENTS[@]}"; do
  flat=$(bounded 900 "$USHER" sim deploy/examples/sim/scale-flat.yaml --clients "$n" --duration "$SIM_DURATION" \
    | tee -a "$OUT/scale.log" | simfig || true)
  tree=$(bounded 900 "$USHER" sim deploy/examples/sim/scale-tree.yaml --clients "$n" --duration "$SIM_DURATION" \
    | tee -a "$OUT/scale.log" | simfig || true)
  set -- $flat $tree
  ratio=$(awk -v a="$4" -v b="$1" 'BEGIN { if (b + 0 > 0) printf "%.4f", a / b; else print "-" }')
  echo "| $n | $1 | $4 | $5 | $ratio | $3 | $6 |" >> "$OUT/scale.md"
done
echo >> "$OUT/scale.md"
echo "- load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/scale.md"
cat "$OUT/scale.md"
