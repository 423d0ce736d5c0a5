#!/usr/bin/env bash
# Runs `usher sim` over seeds 1..N for each scenario and prints one row per
# scenario: utilisation after start-up (mean, min–max over seeds), start-up,
# max overshoot (mean, worst), convergence after mishaps (mean of the seeds'
# means, worst), capacity RPCs/s, and for scenario files with mishaps the
# utilisation per kind. The figures in benches/RESULTS.md come from it.
#
#   benches/sim.sh [USHER] [SEEDS] [SCENARIO...]   e.g. benches/sim.sh target/release/usher 10 seven one
set -euo pipefail
usher=${1:-target/release/usher}
seeds=${2:-10}
shift 2 || true
scenarios=("$@")
[ ${#scenarios[@]} -eq 0 ] && scenarios=(one two three four five six seven)
printf '| scenario | utilisation (min–max) | start-up | max overshoot (worst) | convergence mean (worst) | RPC/s | per kind: utilisation, convergence mean |\n'
printf '|---|---|---|---|---|---|---|\n'
for sc in "${scenarios[@]}"; do
  if [ -f "$sc" ]; then arg=("$sc"); name=$(basename "$sc" .yaml); else arg=(--scenario "$sc"); name=$sc; fi
  for s in $(seq 1 "$seeds"); do
    "$usher" sim "${arg[@]}" --seed "$s" --json 2>/dev/null
  done | jq -rs --arg name "$name" '
    def pct: . * 10000 | round / 100;
    def r1: . * 10 | round / 10;
    def mean(f): (map(f) | add / length);
    ( [.[].mishaps | to_entries[]] | group_by(.key)
      | map("\(.[0].key) \(mean(.value.utilisation) | pct)%, \(mean(.value.convergence_mean_s) | r1) s") | join("; ") ) as $kinds
    | "| \($name) | \(mean(.utilisation) | pct)% (\(map(.utilisation) | min | pct)–\(map(.utilisation) | max | pct)) | \(mean(.startup_s) | r1) s | \(mean(.max_overshoot) | pct)% (\(map(.max_overshoot) | max | pct)%) | \(mean(.convergence_mean_s) | r1) s (\(map(.convergence_worst_s) | max | r1) s) | \(mean(.rpcs_per_s) | r1) | \($kinds) |"'
done
