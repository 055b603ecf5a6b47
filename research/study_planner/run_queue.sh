#!/usr/bin/env bash
# One core's queue of the planner study's jobs, one after another (one queue per core):
#   research/study_planner/run_queue.sh CORE ITEM...
# ITEM: p:LABEL   that arm's pilot (its run at the protocol's step, then its step grid when
#                 that run does not learn: `pilot --only LABEL`)
#       r:ARM:SEED an analysed run (`run --arms ARM --seeds SEED`)
# Each job runs pinned to CPU CORE, one torch thread, at nice 5, and commits what it finishes
# (`--commit`). Between jobs the queue stops when the file $STUDY_STOP exists (default
# /tmp/study_stop); stop a running job by its PID after stopping the queue (it resumes from
# its checkpoint), then `study_planner.py park`. Log: $STUDY_LOG_DIR/queue_coreCORE.log.
# The data: $FEDLORA_DATA (default ../shared/data/commonsense, as the Makefile's).
set -u
core=$1
shift
cd "$(dirname "$0")/../.."
stop=${STUDY_STOP:-/tmp/study_stop}
log=${STUDY_LOG_DIR:-/tmp}/queue_core$core.log
config=${STUDY_CONFIG:-research/study_planner/study_planner_v2.toml}
out=${STUDY_OUT:-results/study_planner_v2}
export FEDLORA_DATA=${FEDLORA_DATA:-../shared/data/commonsense}  # as `make test`'s DATA
for item in "$@"; do
  if [ -e "$stop" ]; then
    echo "$(date -u '+%F %T') stop file $stop: leaving before $item" >>"$log"
    break
  fi
  case $item in
    p:*) args=(pilot --only "${item#p:}") ;;
    r:*:*) rest=${item#r:}; args=(run --arms "${rest%%:*}" --seeds "${rest##*:}") ;;
    *) echo "$(date -u '+%F %T') not an item: $item (p:LABEL or r:ARM:SEED)" >>"$log"; continue ;;
  esac
  echo "$(date -u '+%F %T') start $item" >>"$log"
  OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 HF_HUB_OFFLINE=1 \
    nice -n 5 taskset -c "$core" .venv/bin/python research/study_planner/study_planner.py \
    "${args[@]}" --config "$config" --out "$out" --commit >>"$log" 2>&1
  echo "$(date -u '+%F %T') end $item rc=$?" >>"$log"
done
