#!/usr/bin/env bash
# Issue #14's three powered suites, in order, each pilot seed before its main seeds.
# Every command resumes (finished runs are skipped, partial ones continue from their last
# checkpoint): re-run this script after an interruption. Log lines with UTC times and the
# 1-minute load go to runs/powered.log; /usr/bin/time adds each command's wall and CPU time.
#
#   nohup setsid bash bench/powered_suites.sh > runs/powered.out 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
# this checkout's code, even when .venv is an editable install of another checkout
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
DATA=${FEDLORA_DATA:-../shared/data/commonsense}
FL=.venv/bin/fedlora
mkdir -p runs
log() { echo "$(date -u +%FT%TZ) load $(cut -d' ' -f1 /proc/loadavg) $*" | tee -a runs/powered.log; }
step() {  # step NAME fedlora-args...
  log "start $1"
  /usr/bin/time -f "$1: %e s wall, %U s user, %S s sys" -a -o runs/powered.log "$FL" "${@:2}"
  log "end $1"
}
for s in table1 sampling ranks; do
  out=runs/powered_$s
  if [ "$s" = ranks ]; then  # ranks' "full" (k = γ, q = 0.2) is sampling's "fixed-0.2"
    mkdir -p "$out/pilot"
    for seed in 1 2 3; do
      [ -e "$out/full-seed$seed" ] || cp -r "runs/powered_sampling/fixed-0.2-seed$seed" "$out/full-seed$seed"
    done
    [ -e "$out/pilot/full-seed100" ] || cp -r runs/powered_sampling/pilot/fixed-0.2-seed100 "$out/pilot/full-seed100"
  fi
  step "$s pilot" compare --suite "$s" -c "configs/powered_$s.toml" --out "$out" --data-dir "$DATA" -q --pilot
  step "$s main" compare --suite "$s" -c "configs/powered_$s.toml" --out "$out" --data-dir "$DATA" -q
  step "$s exact" report "$out" --comm-cost exact --comp-cost affine -o "$out/exact"
done
log "all done"
