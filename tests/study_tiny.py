"""A tiny study config for tests/test_study_planner.py: the planner study's stages on a
random-init model in seconds (two fixed rules, three arms, two seeds)."""

from __future__ import annotations

from tiny_runs import DATA

TINY_STUDY = f"""
[study]
protocol_fixed = true
seeds = [0, 1]
pilot_seed = 5
metric = "arc-e/loss"
budget_round_s = 0.0
pilot_eval_every_s = 0.3
grid_points = 4

[study.arms]
fslora = ["method.name=fslora"]
proposed-separate = ["method.name=proposed", "planner.calibration=separate",
                     "planner.replan_every=0"]

[study.fixed_rules]
fixed-full = ["method.name=sketched", "method.q=full", "method.k=full"]
"fixed-0.5" = ["method.name=sketched", "method.q=fixed", "method.q_fixed=0.5", "method.k=full"]

[model]
name = "tiny-llama"
dtype = "fp32"
threads = 1

[lora]
rank = 4
layers = 1

[data]
data_dir = "{DATA}"
tasks = ["arc-e"]
eval_tasks = ["arc-e"]
train_limit = 80
eval_limit = 10
max_seq_len = 96
n_clients = 8
min_client_examples = 2

[training]
rounds = 6
local_steps = 1
batch_size = 2
lr = 0.05

[method]
clients_per_round = 2

[planner]
probe_rounds = 1
replan_every = 2
calibration_rounds = 6

[output]
progress = false
"""
