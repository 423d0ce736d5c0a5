#!/usr/bin/env bash
# Build times of two checkouts side by side, one after the other in one run:
#
#   benches/build_times.sh BEFORE_DIR AFTER_DIR LIMIT_FILE_BEFORE PROXY_FILE_BEFORE LIMIT_FILE_AFTER PROXY_FILE_AFTER
#
# For each checkout (its own target/):
#   1. release: `cargo build --release --locked --bin usher` after
#      `cargo clean --release` of the checkout's own packages (the registry's
#      crates already built: what a change to usher's code costs);
#   2. the tests rebuilt after an edit: with every test binary up to date
#      (`cargo test --no-run --locked`), a comment line is appended to one
#      file of the limiters and then to one file of the sidecar, and
#      `cargo test --no-run --locked` is timed after each (the edit is undone,
#      and the tests rebuilt untimed, before the next).
# Prints one line per measurement, in seconds. Wall-clock times on a shared
# machine: compare the two checkouts' figures from the same run only.
set -euo pipefail
[ $# -eq 6 ] || { sed -n 2,16p "$0"; exit 64; }
BEFORE=$1 AFTER=$2
declare -A LIMIT=([before]=$3 [after]=$5) PROXY=([before]=$4 [after]=$6)

secs() { local t0 t1; t0=$(date +%s.%N); "$@" >/dev/null 2>&1; t1=$(date +%s.%N); echo "$t1 - $t0" | bc; }

edit_and_time() { # DIR FILE
    local dir=$1 file=$2 t
    cp "$dir/$file" "$dir/$file.orig"
    echo "// edited by benches/build_times.sh" >>"$dir/$file"
    t=$(cd "$dir" && secs cargo test --no-run --locked)
    mv "$dir/$file.orig" "$dir/$file"
    (cd "$dir" && cargo test --no-run --locked >/dev/null 2>&1)
    echo "$t"
}

for which in before after; do
    dir=$BEFORE; [ $which = after ] && dir=$AFTER
    (cd "$dir" && cargo build --release --locked --bin usher >/dev/null 2>&1)
    own=$(cd "$dir" && cargo metadata --format-version 1 --no-deps --locked |
        python3 -c 'import json,sys; print(" ".join("-p " + p["name"] for p in json.load(sys.stdin)["packages"]))')
    (cd "$dir" && cargo clean --release $own >/dev/null 2>&1)
    echo "$which release_build_s $(cd "$dir" && secs cargo build --release --locked --bin usher)"
    (cd "$dir" && cargo test --no-run --locked >/dev/null 2>&1)
    echo "$which tests_after_limit_edit_s $(edit_and_time "$dir" "${LIMIT[$which]}")"
    echo "$which tests_after_proxy_edit_s $(edit_and_time "$dir" "${PROXY[$which]}")"
done
