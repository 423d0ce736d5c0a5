#!/usr/bin/env bash
# Every usher benchmark in one command; see benches/README.md.
#
#   benches/run.sh            full run (about 30 minutes after the build)
#   benches/run.sh --quick    short shake-out (about 3 minutes)
#   benches/run.sh --soak     also the 10-minute soak (benches/soak.sh)
#
# Results go to $OUT (default benches/out/<UTC time>): machine.md, e2e.md,
# https.md, h2.md, idle.md, keys.md, server.md, scale.md, micro.txt, latency.png, and
# summary.md which gathers them.
set -euo pipefail
cd "$(dirname "$0")/.."

QUICK=0
SOAK=0
for a in "$@"; do
  case "$a" in
    --quick) QUICK=1 ;;
    --soak) SOAK=1 ;;
    -h|--help) sed -n 2,9p "$0"; exit 0 ;;
    *) echo "unknown option $a" >&2; exit 64 ;;
  esac
done

OUT=${OUT:-benches/out/$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PROXY_CPU=${PROXY_CPU:-0}
LOAD_CPU=${LOAD_CPU:-1}

# cleanup (the trap that stops what the tools started) and bounded (a time limit).
source benches/lib.sh

if ! command -v nginx >/dev/null && [ ! -x /usr/sbin/nginx ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing nginx (Debian package) ..."
    DEBIAN_FRONTEND=noninteractive apt-get install -y nginx >/dev/null \
      || { apt-get update >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y nginx >/dev/null; }
  else
    echo "nginx is missing: run 'sudo apt-get install nginx' for the nginx comparison; continuing without it" >&2
  fi
fi
if [ "$(nproc)" -lt 2 ] || ! command -v taskset >/dev/null; then
  echo "warning: fewer than 2 cores or no taskset; running unpinned" >&2
  PIN=()
  PROXY_ARGS=()
  SERVER_ARGS=()
else
  PIN=(taskset -c "$LOAD_CPU")
  PROXY_ARGS=(--proxy-cpu "$PROXY_CPU")
  SERVER_ARGS=(--server-cpu "$PROXY_CPU")
fi

machine() {
  echo "- when: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "- nproc: $(nproc); CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')"
  echo "- kernel: $(uname -sr); $(rustc --version)"
  echo "- nginx: $( (nginx -v 2>&1 || /usr/sbin/nginx -v 2>&1) | head -1)"
  echo "- load average: $(cut -d' ' -f1-3 /proc/loadavg)"
}
{ echo "## Machine (at the start)"; machine; } > "$OUT/machine.md"
cat "$OUT/machine.md"

echo "building (release) ..."
# cargo bench builds the usher binary the tools start (CARGO_BIN_EXE_usher) with the bench
# profile; a separate `cargo build --release` would only compile the crate a second time (the
# dev-dependencies unify other features).
cargo bench --locked --no-run --bench e2e --bench server_load --bench limit --bench algorithm

if [ "$QUICK" = 1 ]; then
  E2E=(--quick)
  SERVER_RUNS=("8 3")
  CRIT=(--warm-up-time 0.5 --measurement-time 1)
  E2E_LIMIT=300
else
  E2E=()
  SERVER_RUNS=("8 10" "16 10" "64 10")
  CRIT=(--warm-up-time 1 --measurement-time 3)
  E2E_LIMIT=1500
fi

echo "== end-to-end: direct vs usher vs nginx, accuracy (proxies on cpu $PROXY_CPU, load + upstream on cpu $LOAD_CPU)"
# E2E_ARGS adds e2e options, e.g. E2E_ARGS="--variant=before:bin=/tmp/usher-old" for a before/after run.
# VARIANTS (default: usher with --http1 hyper, the general path) are further usher targets in the
# same rounds; VARIANTS= leaves them out.
VARIANTS=${VARIANTS-"--variant=hyper:USHER_HTTP1=hyper"}
bounded "$E2E_LIMIT" "${PIN[@]}" cargo bench --locked --bench e2e -- "${E2E[@]}" "${PROXY_ARGS[@]}" $VARIANTS ${E2E_ARGS:-} --out "$OUT" \
  > "$OUT/e2e.md" 2> >(tee "$OUT/e2e.log" >&2)

echo "== instructions per request under callgrind (usher, nginx)"
: > "$OUT/instructions.md"
if command -v valgrind >/dev/null && command -v callgrind_control >/dev/null; then
  bounded 300 "${PIN[@]}" cargo bench --locked --bench e2e -- --callgrind 5 $VARIANTS ${E2E_ARGS:-} --out "$OUT" \
    > "$OUT/instructions.md" 2>> "$OUT/e2e.log" || true
else
  echo "valgrind is missing (apt-get install valgrind): skipping the instruction counts" | tee "$OUT/instructions.md" >&2
fi

echo "== HTTPS upstream (TLS 1.3, ALPN http/1.1): usher vs nginx, each with its own TLS upstream"
# Shorter than the plain comparison: two rates, a sweep to where the proxies saturate, no accuracy
# (the limiters are the same whatever the upstream speaks).
if [ "$QUICK" = 1 ]; then TLS_E2E=(--quick --rates 2000 --sweep 5000,15000); else TLS_E2E=(--rounds 3 --sweep 5000,10000,15000,20000,25000,30000 --sweep-rounds 2); fi
mkdir -p "$OUT/https" "$OUT/h2"
bounded "$E2E_LIMIT" "${PIN[@]}" cargo bench --locked --bench e2e -- "${TLS_E2E[@]}" --upstream https --no-accuracy "${PROXY_ARGS[@]}" ${E2E_ARGS:-} --out "$OUT/https" \
  > "$OUT/https.md" 2>> "$OUT/e2e.log" || true
if command -v valgrind >/dev/null && command -v callgrind_control >/dev/null; then
  bounded 300 "${PIN[@]}" cargo bench --locked --bench e2e -- --callgrind 5 --upstream https ${E2E_ARGS:-} --out "$OUT/https" \
    >> "$OUT/https.md" 2>> "$OUT/e2e.log" || true
fi

echo "== HTTP/2 upstream (TLS 1.3, ALPN h2): usher multiplexing vs usher in HTTP/1.1 (http2: false) vs nginx"
bounded "$E2E_LIMIT" "${PIN[@]}" cargo bench --locked --bench e2e -- "${TLS_E2E[@]}" --upstream h2 --no-accuracy --variant=http1:h2=off "${PROXY_ARGS[@]}" ${E2E_ARGS:-} --out "$OUT/h2" \
  > "$OUT/h2.md" 2>> "$OUT/e2e.log" || true
if command -v valgrind >/dev/null && command -v callgrind_control >/dev/null; then
  bounded 300 "${PIN[@]}" cargo bench --locked --bench e2e -- --callgrind 5 --upstream h2 --variant=http1:h2=off ${E2E_ARGS:-} --out "$OUT/h2" \
    >> "$OUT/h2.md" 2>> "$OUT/e2e.log" || true
fi

echo "== idle cost: CPU, wake-ups, RSS and threads of each proxy left alone (usher, nginx)"
# Measured from 125 s after the traffic: the pools' idle connections (90 s) are closed by then.
IDLE_SECONDS=$([ "$QUICK" = 1 ] && echo 20 || echo 600)
IDLE_SETTLE=$([ "$QUICK" = 1 ] && echo 3 || echo 125)
bounded $((IDLE_SECONDS + IDLE_SETTLE + 120)) "${PIN[@]}" cargo bench --locked --bench e2e -- --idle "$IDLE_SECONDS" --idle-settle "$IDLE_SETTLE" "${PROXY_ARGS[@]}" ${E2E_ARGS:-} --out "$OUT" \
  > "$OUT/idle.md" 2>> "$OUT/e2e.log" || true

echo "== many tenant keys: new and known tenants through usher and nginx"
KEYS=$([ "$QUICK" = 1 ] && echo 1000,10000 || echo 1000,10000,100000)
bounded 900 "${PIN[@]}" cargo bench --locked --bench e2e -- --keys "$KEYS" "${PROXY_ARGS[@]}" ${E2E_ARGS:-} --out "$OUT" \
  > "$OUT/keys.md" 2>> "$OUT/e2e.log" || true

echo "== capacity server: GetCapacity/s with 10,000 clients"
: > "$OUT/server.md"
for run in "${SERVER_RUNS[@]}"; do
  set -- $run
  bounded 120 "${PIN[@]}" cargo bench --locked --bench server_load -- --concurrency "$1" --seconds "$2" "${SERVER_ARGS[@]}" \
    | tee -a "$OUT/server.md"
done

echo "== the capacity server at scale: CPU and memory per client, refresh load; the tree's root in usher sim"
SCALE=()
[ "$QUICK" = 1 ] && SCALE=(--quick)
OUT="$OUT" bounded 1800 benches/scale.sh "${SCALE[@]}" || true

echo "== micro-benchmarks (criterion)"
{
  bounded 300 cargo bench --locked --bench limit -- "${CRIT[@]}"
  bounded 300 cargo bench --locked --bench algorithm -- "${CRIT[@]}"
} 2>/dev/null | grep -E '^[a-zA-Z].*|time:' > "$OUT/micro.txt" || true

# usher::plot writes stored (uncompressed) PNGs; recompress for the repository if python3 is here.
if [ -f "$OUT/latency.png" ] && command -v python3 >/dev/null; then
  python3 benches/pngz.py "$OUT/latency.png"
fi

{ echo "## Machine (at the end)"; machine; } >> "$OUT/machine.md"
cat "$OUT/machine.md" "$OUT/e2e.md" "$OUT/instructions.md" > "$OUT/summary.md"
{ echo; echo "## HTTPS upstream"; echo; cat "$OUT/https.md"; echo; echo "## HTTP/2 upstream"; echo; cat "$OUT/h2.md"; } >> "$OUT/summary.md"
cat "$OUT/idle.md" "$OUT/keys.md" >> "$OUT/summary.md"
{ echo; echo "### Capacity server"; echo; echo '```'; cat "$OUT/server.md"; echo '```'; echo; cat "$OUT/scale.md"; echo; echo "### Micro-benchmarks"; echo; echo '```'; cat "$OUT/micro.txt"; echo '```'; } >> "$OUT/summary.md"
echo "results: $OUT/summary.md"

if [ "$SOAK" = 1 ]; then
  OUT="$OUT" benches/soak.sh
fi
