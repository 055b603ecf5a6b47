"""Hostile inputs outside the CLI table (tests/reliability_cases.py holds the exit-2 cases):
values cut in error messages, the bounded read of user files, the generated channel's SNR
range, the server optimizer's refusal of a non-finite step, no non-finite checkpoint kept,
and `fedlora eval --harness` kept quiet."""

from __future__ import annotations

import logging
import math
import os
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from fedlora.config import load_config
from fedlora.config.checks import check_snr_range
from fedlora.config.toml_io import MAX_FILE_BYTES, read_user_file
from fedlora.errors import SHOWN_CHARS, ConfigError, DataError, FedloraError, bad_value, shown
from fedlora.federation.checkpoints import load_checkpoint, save_checkpoint
from fedlora.federation.methods.server_opt import ServerOptimizer, ServerStepDiverged
from fedlora.llm.lm_eval_bridge import quiet_libraries


def test_a_value_is_cut_to_200_characters():
    value = "x" * 10_000_000
    assert shown("abc") == "'abc'"
    assert shown(value) == "'" + "x" * (SHOWN_CHARS - 1) + "... (10,000,002 characters)"
    msg = str(bad_value("training.lr", value, "must be a number"))
    assert msg.startswith("training.lr = 'xx") and msg.endswith("is invalid: must be a number")
    assert len(msg) < SHOWN_CHARS + 100


def test_a_message_built_without_shown_is_cut_too():
    word = "y" * 5000  # one long word: cut to 200 characters
    msg = str(FedloraError(f"data.tasks: task {word!r} is unknown: allowed: arc-e"))
    assert msg.startswith("data.tasks: task 'yyy") and msg.endswith("is unknown: allowed: arc-e")
    assert "(5,002 characters)" in msg and len(msg) < 300
    spaced = "a " * 1_000_000  # many short words: the middle goes, the field and the end stay
    msg = str(ConfigError(f"data.tasks = {spaced} is invalid: allowed: arc-e"))
    assert msg.startswith("data.tasks = a a") and msg.endswith("is invalid: allowed: arc-e")
    assert len(msg) < 5000 and "characters cut" in msg
    assert str(ConfigError("short")) == "short"


def test_a_10_mb_config_value_gives_a_short_error(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[method]\nname = "z-' + "z" * 10_000_000 + '"\n')
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value).startswith("method.name = 'z-zz") and len(str(e.value)) < 400


def test_user_files_must_be_regular_and_bounded(tmp_path):
    (tmp_path / "ok.toml").write_bytes(b"a = 1\n")
    assert read_user_file(tmp_path / "ok.toml", "config file") == b"a = 1\n"
    (tmp_path / "zero").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "fifo")  # opening it must not wait for a writer
    for name in ("zero", "fifo"):
        with pytest.raises(ConfigError, match=r"^--config: '.*' is not a regular file \(a device"):
            read_user_file(tmp_path / name, "--config")
    big = tmp_path / "big.csv"
    with open(big, "wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)  # sparse: no disk used
    with pytest.raises(ConfigError, match=r"is 67,108,865 bytes: at most 64 MiB is read"):
        read_user_file(big, "method.q")
    with pytest.raises(FileNotFoundError):  # the caller words it
        read_user_file(tmp_path / "none", "method.q")
    q = tmp_path / "q.json"
    q.symlink_to("/dev/zero")
    cfg = load_config(None, [f'method.q="{q}"', "data.n_clients=2"])
    from fedlora.federation.preflight import check_clients

    with pytest.raises(ConfigError, match=r"^method.q = '.*q.json': '.*' is not a regular file"):
        check_clients(cfg)


def test_the_generated_channel_stays_within_its_snr_range():
    noise = -174.0 + 10 * math.log10(20e6)  # the defaults: 2.5 to 37.5 dB
    check_snr_range(20.0, noise, 38.0, 3.5, (20.0, 200.0))
    with pytest.raises(ConfigError, match=r"SNR of -161.5 to -126.5 dB: allowed: within \[-150"):
        check_snr_range(-144.0, noise, 38.0, 3.5, (20.0, 200.0))
    with pytest.raises(ConfigError, match=r"SNR of 2\.454 to 258 dB"):
        check_snr_range(20.0, noise, 38.0, 3.5, (1e-5, 200.0))
    for override, field in [
        ("network.tx_power_dbm=1e300", "network.tx_power_dbm = 1e+300"),
        ("network.noise_psd_dbm_hz=1e300", "network.noise_psd_dbm_hz = 1e+300"),
        ("network.path_loss_exponent=1e300", "network.path_loss_exponent = 1e+300"),
        ("network.step_time_sigma=1e3", "network.step_time_sigma = 1000.0"),
    ]:
        with pytest.raises(ConfigError, match=f"^{re.escape(field)} is invalid"):
            load_config(None, [override])
    # a profiles file replaces the generated channel: its settings are not checked together
    load_config(None, ['network.profiles_file="p.csv"', "network.tx_power_dbm=-100"])


def test_a_server_step_to_a_non_finite_adapter_is_refused():
    opt = ServerOptimizer(kind="avg", lr=1000.0)
    x = {"a": np.full(3, 1e36, dtype=np.float32)}
    new = {"a": np.full(3, 2e36, dtype=np.float32)}  # finite Δ = 1e36; X + 1000 Δ overflows
    with pytest.raises(ServerStepDiverged, match=r"method.server_lr = 1000 made the global"):
        opt.step(x, new)
    ok = ServerOptimizer(kind="adam", lr=0.1).step(x, new)  # adam's step is about η
    assert np.isfinite(ok["a"]).all()
    nan = {"a": np.array([np.nan, 0, 0], dtype=np.float32)}  # the clients' own divergence
    assert np.isnan(ServerOptimizer(kind="avg", lr=0.5).step(x, nan)["a"][0])


def test_a_non_finite_state_is_never_checkpointed(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")

    def state(r, value):
        return {
            "round": r,
            "global": {"w": torch.full((2,), value)},
            "progress": {"metrics_lines": 0, "sim_time_s": 1.0},
        }

    save_checkpoint(tmp_path, state(1, 1.0))
    with pytest.raises(DataError, match=r"round 2: .* non-finite value in global.w: it diverged"):
        save_checkpoint(tmp_path, state(2, math.inf))
    assert load_checkpoint(tmp_path)["round"] == 1  # the last good one, still there


def test_quiet_libraries_silences_logs_bars_warnings_and_child_processes(capfd):
    from tqdm import tqdm

    with quiet_libraries():
        logging.getLogger("lm_eval").warning("lm-eval says")
        for _ in tqdm(range(3), desc="bar"):
            pass
        warnings.warn("a library warns", UserWarning, stacklevel=1)
        print("python stderr", file=sys.stderr)
        subprocess.run(["sh", "-c", "echo child stderr >&2"], check=True)
    print("after", file=sys.stderr)
    out, err = capfd.readouterr()
    assert out == "" and err == "after\n"
    with pytest.raises(ValueError), quiet_libraries():  # an error still comes out
        raise ValueError("x")
    assert logging.getLogger("lm_eval").level == logging.NOTSET
