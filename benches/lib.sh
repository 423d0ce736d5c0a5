# Sourced by the bench scripts (run.sh, scale.sh, soak.sh); needs $OUT set.
#
# Anything the tools started (they list their children's pids in $OUT/pids, or
# in a pids file of a directory under it)
# is stopped on exit, whatever way the script ends.
cleanup() {
  find "$OUT" -name pids -type f 2>/dev/null | while read -r f; do
    while read -r pid; do kill "$pid" 2>/dev/null || true; done < "$f"
  done
  if [ -n "${TOOL_PID:-}" ]; then kill "$TOOL_PID" 2>/dev/null || true; fi
}
trap cleanup EXIT INT TERM

# Runs a command with a time limit, in the background so the trap can stop it.
bounded() {
  local limit=$1; shift
  timeout --kill-after=10 "$limit" "$@" &
  TOOL_PID=$!
  wait "$TOOL_PID"
  TOOL_PID=
}
