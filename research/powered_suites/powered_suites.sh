#!/usr/bin/env bash
# The three powered suites in two 1-thread lanes (the suite files set model.threads = 1:
# two 1-thread processes side by side outrun one 2-thread process on 2 shared cores, see
# research/powered_suites/powered_table1.toml). Each suite's pilot seed runs before its main seeds.
#   lane 1: table1 pilot, table1 main, ranks' proposed-k, ranks' full
#   lane 2: sampling pilot, ranks pilot, sampling main, ranks' normal and uniform
# (ranks' "full" is sampling's "fixed-0.2", same config and seed: those runs are copied, not
# re-run; `fedlora compare` runs of one suite with disjoint --methods share its --out)
# Every command resumes (finished runs are skipped, partial ones continue from their last
# checkpoint): re-run this script after an interruption. Log lines with UTC times and the
# 1-minute load go to runs/powered.log; /usr/bin/time adds each command's wall and CPU time.
#
#   nohup setsid bash research/powered_suites/powered_suites.sh > runs/powered.out 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root
export HF_HUB_OFFLINE=1
# this checkout's code, even when .venv is an editable install of another checkout
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
DATA=${FEDLORA_DATA:-../shared/data/commonsense}
FL=.venv/bin/fedlora
mkdir -p runs
log() { echo "$(date -u +%FT%TZ) load $(cut -d' ' -f1 /proc/loadavg) $*" >> runs/powered.log; }
step() {  # step NAME fedlora-args...
  log "start $1"
  /usr/bin/time -f "$1: %e s wall, %U s user, %S s sys" -a -o runs/powered.log "$FL" "${@:2}"
  log "end $1"
}
suite() {  # suite NAME [compare args...]: compare in runs/powered_NAME
  local s=$1
  shift
  step "$s $*" compare --suite "$s" -c "research/powered_suites/powered_$s.toml" --out "runs/powered_$s" \
    --data-dir "$DATA" -q "$@"
}
copy_full() {  # ranks' "full" runs from sampling's finished "fixed-0.2" runs
  mkdir -p runs/powered_ranks/pilot
  local src dst
  for seed in "$@"; do
    if [ "$seed" = 100 ]; then
      src=runs/powered_sampling/pilot/fixed-0.2-seed100 dst=runs/powered_ranks/pilot/full-seed100
    else
      src=runs/powered_sampling/fixed-0.2-seed$seed dst=runs/powered_ranks/full-seed$seed
    fi
    if [ ! -e "$dst" ] && [ -e "$src/summary.json" ]; then cp -r "$src" "$dst"; fi
  done
}
pilot() {  # a suite's pilot seed, once (its targets.toml is written last)
  [ -e "runs/powered_$1/targets.toml" ] || suite "$1" --pilot
}
wait_for() { until [ -e "$1" ]; do sleep 30; done; }
lane1() {
  pilot table1
  suite table1
  wait_for runs/powered_ranks/targets.toml
  suite ranks --methods proposed-k
  copy_full 1 2 3  # those sampling has finished by now; "full" runs the others itself
  suite ranks --methods full
}
lane2() {
  pilot sampling
  copy_full 100
  pilot ranks
  suite sampling
  suite ranks --methods normal uniform
}
lane1 > runs/powered-lane1.out 2>&1 &
lane2 > runs/powered-lane2.out 2>&1 &
wait
for s in table1 sampling ranks; do
  step "$s exact" report "runs/powered_$s" --comm-cost exact --comp-cost affine -o "runs/powered_$s/exact"
done
log "all done"
