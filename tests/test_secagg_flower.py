"""Secure aggregation end to end: fedlora's ServerApp loop (`run_server`) against fedlora's
ClientApp with Flower's SecAgg+ mod on tiny random-init models, through an in-process grid;
and once through `fedlora flower simulate` (Ray, loopback)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from fedlora.config import load_config
from fedlora.federation.flower.common import FlowerOptions
from flower_cases import engine_run, final_global, needs_data, read_metrics, write_config
from test_secagg import LoopGrid, _task_identity  # noqa: F401 (the fixture)

from flwr.app import Context, RecordDict  # isort: skip

SECURE = "\n[privacy]\nsecure_aggregation = true\nsecagg_threshold = {t}\n"


def _secure_config(tmp_path: Path, rounds: int, q: str, threshold: int) -> Path:
    path = write_config(tmp_path, rounds=rounds, q=q)
    secure = tmp_path / "secure.toml"
    secure.write_text(path.read_text() + SECURE.format(t=threshold), encoding="utf-8")
    return secure


def _run_in_process(config: Path, out: Path, availability: str = "none") -> dict:
    """`run_server` over nodes 101, 102 that run fedlora's ClientApp in this process."""
    from fedlora.federation.flower import server_app
    from fedlora.federation.flower.client_app import app

    cfg = load_config(config)
    n = cfg.data.n_clients
    contexts = {
        101 + i: Context(1, 101 + i, {"partition-id": i, "num-partitions": n}, RecordDict(), {})
        for i in range(n)
    }
    grid = LoopGrid(contexts, app)
    opts = FlowerOptions(
        out_dir=str(out),
        round_timeout_s=5,
        connect_timeout_s=5,
        poll_interval_s=0.01,
        availability=availability,
    )
    return server_app.run_server(grid, cfg, opts, log=lambda _: None)


@needs_data
@pytest.mark.parametrize("availability", ["none", "observed"])
def test_a_secure_run_is_the_engine_run_within_the_quantization_error(
    tmp_path: Path, availability: str
) -> None:
    # Prepare: both clients every round (no round below the threshold; every node answers,
    # so the observed answer rates are 1)
    config = _secure_config(tmp_path, rounds=2, q="[1.0, 1.0]", threshold=2)
    # Execute
    summary = _run_in_process(config, tmp_path / "secure", availability)
    # Assert: the engine's adapter (plain aggregation), within SecAgg+'s quantization
    # (2 clients x 2c / 2^22 = 1e-6 per entry per round, c = 1)
    ref = engine_run(write_config(tmp_path, rounds=2, q="[1.0, 1.0]"), tmp_path)
    got, want = final_global(tmp_path / "secure"), final_global(ref)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=2e-5, err_msg=name)
    assert any(not np.allclose(v, 0) for k, v in got.items() if k.endswith("lora_B"))
    lines = read_metrics(tmp_path / "secure")[1:]
    assert [x["secagg_skipped"] for x in lines] == [False, False]
    assert summary["secagg_skipped_rounds"] == 0
    # a sketched client sends all γ components: (γ − k_n)(out + in) more parameters each
    assert all(x["secagg_padding_bits"] > 0 for x in lines if min(x["k"]) < 4)
    assert [x["train_loss"] for x in lines] == pytest.approx(
        [x["train_loss"] for x in read_metrics(ref)[1:]], rel=1e-4
    )


@needs_data
def test_a_round_below_the_threshold_is_skipped_and_counted(tmp_path: Path) -> None:
    # Prepare: FedAvg on 2 of 3 clients per round, a threshold of 3
    config = _secure_config(tmp_path, rounds=2, q="[1.0, 1.0]", threshold=3)
    text = config.read_text().replace("n_clients = 2", "n_clients = 3")
    text = text.replace('q = [1.0, 1.0]\nk = "uniform"', 'name = "fedavg"\nclients_per_round = 2')
    config.write_text(text, encoding="utf-8")
    # Execute
    summary = _run_in_process(config, tmp_path / "secure")
    # Assert: no round aggregated (LoRA's B starts at 0 and stays there), each counted
    got = final_global(tmp_path / "secure")
    assert all(np.all(v == 0) for k, v in got.items() if k.endswith("lora_B"))
    lines = read_metrics(tmp_path / "secure")[1:]
    assert [x["secagg_skipped"] for x in lines] == [True, True]
    assert [x["secagg_skipped_rounds"] for x in lines] == [1, 2]
    assert [x["dropouts"] for x in lines] == [[], []] and summary["secagg_skipped_rounds"] == 2


@pytest.mark.slow
@needs_data
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")
def test_flower_simulate_with_secure_aggregation_on_loopback(tmp_path: Path) -> None:
    from test_flower_simulation import _is_loopback, _simulate

    # Prepare: seed 3 samples client 1 alone in round 1 (below the threshold), both in round 2
    config = _secure_config(tmp_path, rounds=2, q="[0.7, 0.9]", threshold=2)
    out = tmp_path / "sim"
    # Execute
    seen, _ = _simulate(["--config", str(config), "--out", str(out)], tmp_path / "sim.log")
    # Assert: only loopback; round 1 skipped (B still 0), round 2 securely aggregated
    assert seen and all(_is_loopback(ip) for ip in seen), seen
    lines = read_metrics(out)[1:]
    assert [x["n_participants"] for x in lines] == [1, 2]
    assert [x["secagg_skipped"] for x in lines] == [True, False]
    assert json.loads((out / "summary.json").read_text())["secagg_skipped_rounds"] == 1
    got = final_global(out)
    assert any(not np.allclose(v, 0) for k, v in got.items() if k.endswith("lora_B"))
