"""The training mix, the Dirichlet partition, the federated data and client batches."""

from __future__ import annotations

import hashlib
import json
import zlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from data_cases import CharTok, mc_record, small_layout
from fedlora.config import DataConfig
from fedlora.errors import ConfigError, DataError
from fedlora.llm.data import (
    FederatedData,
    build_federated_data,
    client_batches,
    load_eval_sets,
    seeded_subset,
    stream_rng,
    training_mix,
)
from fedlora.llm.partition import client_weights, dirichlet_partition
from fedlora.llm.tasks import load_task

# ----------------------------------------------------------------------------- partition


def test_dirichlet_partition_covers_every_index_once_and_respects_min_size() -> None:
    keys = ["a"] * 300 + ["b"] * 200 + ["c"] * 100
    parts = dirichlet_partition(keys, 20, 0.1, 8, np.random.default_rng(0))
    assert len(parts) == 20
    allidx = np.concatenate(parts)
    assert sorted(allidx.tolist()) == list(range(600))
    assert min(len(p) for p in parts) >= 8
    a = client_weights(parts)
    assert a.sum() == pytest.approx(1.0)
    assert a[3] == pytest.approx(len(parts[3]) / 600)
    again = dirichlet_partition(keys, 20, 0.1, 8, np.random.default_rng(0))
    assert all(np.array_equal(x, y) for x, y in zip(parts, again))


def test_dirichlet_partition_is_the_split_every_earlier_run_used() -> None:
    # 400 clients, 3,000 examples, min_size 3 at α = 0.1: most clients are topped up by the
    # redistribution loop (made O(N) per move for 10,000-client cohorts). The fingerprint was taken with the
    # code before that change: a faster split must be the same split, or no run resumes.
    keys = [f"k{i % 5}" for i in range(3000)]
    parts = dirichlet_partition(keys, 400, 0.1, 3, np.random.default_rng(11))
    digest = hashlib.sha256(b"".join(p.tobytes() + b"|" for p in parts)).hexdigest()
    assert digest[:16] == "84686990c665cd62"
    assert min(len(p) for p in parts) == 3


def test_dirichlet_alpha_controls_heterogeneity() -> None:
    keys = np.repeat(["a", "b", "c", "d"], 500).tolist()
    arr = np.asarray(keys)

    def dominant_share(alpha: float) -> float:
        parts = dirichlet_partition(keys, 10, alpha, 1, np.random.default_rng(1))
        shares = [np.unique(arr[p], return_counts=True)[1].max() / len(p) for p in parts]
        return float(np.mean(shares))

    assert dominant_share(0.05) > 0.9  # almost every client sees one key
    assert dominant_share(1000.0) < 0.3  # every client sees all four keys about equally (0.25)


def test_dirichlet_partition_bad_input() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(DataError, match=r"n_clients = 5 with min_size = 3 needs >= 15 examples"):
        dirichlet_partition(["a"] * 14, 5, 0.5, 3, rng)
    with pytest.raises(DataError, match=r"alpha = 0.0 is invalid: must be > 0"):
        dirichlet_partition(["a"] * 14, 2, 0.0, 1, rng)
    with pytest.raises(DataError, match=r"n_clients = 0 is invalid"):
        dirichlet_partition(["a"] * 14, 0, 0.5, 1, rng)


# ----------------------------------------------------------------------------- mixes


def test_training_mix_uses_present_tasks_limits_and_task_files(tmp_path: Path) -> None:
    root = small_layout(tmp_path / "cs")
    extra = tmp_path / "extra.json"
    extra.write_text(json.dumps([mc_record(f"e{i}", ["a", "b"], i % 2) for i in range(7)]))
    cfg = DataConfig(
        data_dir=str(root), tasks=("arc-e", "arc-c", "siqa", "obqa"), task_files=(str(extra),)
    )
    mix = training_mix(cfg, seed=0)  # arc-c absent, siqa has no train split: both skipped
    assert [sum(e.task == t for e in mix) for t in ("arc-e", "obqa")] == [30, 20]
    assert len(mix) == 57
    cfg5 = DataConfig(data_dir=str(root), tasks=("arc-e", "obqa"), train_limit=5)
    a, b = training_mix(cfg5, seed=3), training_mix(cfg5, seed=3)
    assert len(a) == 10 and a == b
    assert a != training_mix(cfg5, seed=4)
    with pytest.raises(DataError, match=r"none has a train split"):
        training_mix(DataConfig(data_dir=str(root), tasks=("siqa",)), seed=0)


def test_build_federated_data_and_client_batches(tmp_path: Path) -> None:
    root = small_layout(tmp_path / "cs")
    cfg = DataConfig(
        data_dir=str(root),
        tasks=("arc-e", "obqa"),
        eval_tasks=("arc-e", "siqa"),
        eval_limit=4,
        n_clients=5,
        min_client_examples=6,
        max_seq_len=64,
    )
    fed = build_federated_data(cfg, CharTok(), seed=0)
    assert isinstance(fed, FederatedData)
    assert len(fed.train) == len(fed.examples) == 50
    assert sorted(np.concatenate(fed.client_indices).tolist()) == list(range(50))
    assert fed.a.sum() == pytest.approx(1.0)
    assert {k: len(v) for k, v in fed.eval_sets.items()} == {"arc-e": 4, "siqa": 4}
    assert all(len(ids) <= 64 for ids in fed.train.input_ids)

    small = int(np.argmin([len(c) for c in fed.client_indices]))
    own = fed.client_indices[small]
    b = 3 if len(own) % 3 == 0 else 2
    steps = len(own) // b
    batches = client_batches(fed, small, steps, b, np.random.default_rng(0), pad_id=0)
    assert len(batches) == steps
    seen = []
    for batch in batches:
        assert batch["input_ids"].shape[0] == b
        for row, m in zip(batch["input_ids"], batch["attention_mask"]):
            seen.append(tuple(row[m.bool()].tolist()))
    # one epoch: every example of the client exactly once
    assert sorted(seen) == sorted(tuple(fed.train.input_ids[i].tolist()) for i in own)
    with pytest.raises(DataError, match=r"client = 5 is invalid: must be in 0..4"):
        client_batches(fed, 5, 1, 1, np.random.default_rng(0), pad_id=0)


# ----------------------------------------------------------------------------- eval questions


def test_eval_questions_default_is_the_training_seed_subset(tmp_path: Path) -> None:
    root = small_layout(tmp_path / "cs")
    test = load_task("arc-e", str(root), "test")  # 12 questions
    cfg = DataConfig(data_dir=str(root), eval_tasks=("arc-e",), eval_limit=4)
    # eval_seed = -1: the stream of the training seed, exactly as before the setting existed
    assert load_eval_sets(cfg, seed=3)["arc-e"] == seeded_subset(
        test, 4, stream_rng(3, "eval", "arc-e")
    )
    fixed = replace(cfg, eval_seed=5)  # a fixed eval seed: the same questions for any seed
    assert load_eval_sets(fixed, seed=0) == load_eval_sets(fixed, seed=9)
    assert load_eval_sets(fixed, seed=0)["arc-e"] == seeded_subset(
        test, 4, stream_rng(5, "eval", "arc-e")
    )


def test_eval_exclude_draws_questions_disjoint_from_the_excluded_subsets(tmp_path: Path) -> None:
    root = small_layout(tmp_path / "cs")
    test = load_task("arc-e", str(root), "test")
    seed0 = seeded_subset(test, 4, stream_rng(0, "eval", "arc-e"))
    seed1 = seeded_subset(test, 4, stream_rng(1, "eval", "arc-e"))
    cfg = DataConfig(
        data_dir=str(root),
        eval_tasks=("arc-e", "obqa"),
        eval_limit=4,
        eval_seed=1,
        eval_exclude=("arc-e:0",),
    )
    fresh = load_eval_sets(cfg, seed=0)
    assert len(fresh["arc-e"]) == 4 and not set(map(id, fresh["arc-e"])) & set(map(id, seed0))
    # by hand: the 8 questions left after seed 0's, in order, then the seed-1 draw among them
    left = [e for e in test if e not in seed0]
    rng = np.random.default_rng([1, zlib.crc32(b"eval"), zlib.crc32(b"arc-e")])
    keep = np.sort(rng.choice(8, size=4, replace=False))
    assert fresh["arc-e"] == [left[i] for i in keep]
    assert fresh["arc-e"] != seed1  # not merely the seed-1 subset
    # obqa is not excluded: its usual seed-1 subset
    assert fresh["obqa"] == seeded_subset(
        load_task("obqa", str(root), "test"), 4, stream_rng(1, "eval", "obqa")
    )
    # two exclusions: disjoint from both subsets
    seed2 = seeded_subset(test, 4, stream_rng(2, "eval", "arc-e"))
    two = load_eval_sets(replace(cfg, eval_exclude=("arc-e:0", "arc-e:2")), seed=0)["arc-e"]
    assert len(two) == 4 and all(e not in seed0 and e not in seed2 for e in two)
    # too few left for the limit: refused, the fields named
    with pytest.raises(ConfigError, match=r"data\.eval_exclude = .* fewer than data\.eval_limit"):
        load_eval_sets(replace(cfg, eval_limit=7), seed=0)  # 12 - 7 = 5 < 7


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("eval_exclude", ("arc-e",), r"data\.eval_exclude = 'arc-e' is invalid: \"TASK:SEED\""),
        ("eval_exclude", ("arc-e:x",), r"data\.eval_exclude = 'arc-e:x'"),
        ("eval_exclude", ("obqa:0",), r"a task of data\.eval_tasks \['arc-e'\]"),
        ("eval_seed", -2, r"data\.eval_seed = -2"),
    ],
)
def test_eval_selection_settings_are_checked(field: str, value: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        DataConfig(**{field: value})
