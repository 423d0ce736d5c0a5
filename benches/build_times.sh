#!/usr/bin/env bash
# Build times of two checkouts side by side, one after the other in one run:
#
#   benches/build_times.sh BEFORE_DIR AFTER_DIR LIMIT_FILE_BEFORE PROXY_FILE_BEFORE LIMIT_FILE_AFTER PROXY_FILE_AFTER
#
# For each checkout (its own target/):
#   1. release: `cargo build --release --locked --bin usher` from a clean
#      target/release (the registry's crates compiled too);
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
    rm -rf "$dir/target/release"
    echo "$which release_build_s $(cd "$dir" && secs cargo build --release --locked --bin usher)"
    (cd "$dir" && cargo test --no-run --locked >/dev/null 2>&1)
    echo "$which tests_after_limit_edit_s $(edit_and_time "$dir" "${LIMIT[$which]}")"
    echo "$which tests_after_proxy_edit_s $(edit_and_time "$dir" "${PROXY[$which]}")"
done
