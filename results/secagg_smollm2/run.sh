#!/bin/bash
# SmolLM2 on Flower's Ray simulation: the same 3 rounds with SecAgg+ and in the clear; then the adapters compared.
cd /work/main
export FEDLORA_DATA=/work/shared/data/commonsense HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 RAY_USAGE_STATS_ENABLED=0
COMMON='data.n_clients=3 method.q=full training.rounds=3 data.train_limit=40 data.eval_limit=50 data.eval_tasks=["arc-e"] training.eval_every=3 model.threads=1 model.device=cpu output.progress=false'
for mode in secure plain; do
  extra=""; [ $mode = secure ] && extra="privacy.secure_aggregation=true privacy.secagg_threshold=2"
  echo "== $mode $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg)"
  /usr/bin/time -v .venv/bin/fedlora flower simulate --config configs/demo.toml --out runs/secagg-smollm2-$mode --overwrite --num-cpus 1 $COMMON $extra 2>&1 | grep -v "^\s*$" | tail -25
done
.venv/bin/python /work/notes/secagg/compare.py runs/secagg-smollm2-secure runs/secagg-smollm2-plain
