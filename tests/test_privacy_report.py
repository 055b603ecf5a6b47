"""`fedlora report` with client-level DP: the privacy table (mode, σ, clip bound, δ, final
largest ε) in report.md and report.html for runs with privacy; none for runs without."""

from __future__ import annotations

import json
from pathlib import Path

from fedlora.cli import main

PRIVACY = {"mode": "central", "clip_norm": 0.05, "noise_multiplier": 1.537, "delta": 1e-5}


def _run(root: Path, name: str, method: str, privacy: dict | None = None) -> Path:
    d = root / name
    d.mkdir(parents=True)
    lines = [
        {"round": 0, "sim_time_s": 0.0, "train_loss": None, "eval": {"arc-e": 0.3}},
        {"round": 1, "sim_time_s": 5.0, "train_loss": 1.0, "eval": {"arc-e": 0.4}},
    ]
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (d / "config.toml").write_text(f'[method]\nname = "{method}"\n[training]\nseed = 0\n')
    summary = {"method": method, "seed": 0, **({"privacy": privacy} if privacy else {})}
    (d / "summary.json").write_text(json.dumps(summary))
    return d


def test_the_report_shows_each_private_runs_final_epsilon_and_settings(tmp_path, capsys):
    dp = _run(tmp_path, "sketched-seed0", "sketched", {**PRIVACY, "largest_epsilon": 7.9961})
    no_noise = {**PRIVACY, "noise_multiplier": 0.0, "largest_epsilon": None}
    clip = _run(tmp_path, "ffalora-seed0", "ffalora", no_noise)
    bare = {**PRIVACY, "largest_epsilon": None, "unprotected_rounds": 4}  # none -> central
    resumed = _run(tmp_path, "fedavg-seed0", "fedavg", bare)
    older = _run(tmp_path, "rolora-seed0", "rolora", {**PRIVACY, "max_epsilon": 3.25})
    plain = _run(tmp_path, "fslora-seed0", "fslora")
    runs = [str(d) for d in (dp, clip, resumed, older, plain)]
    assert main(["report", *runs, "-o", str(tmp_path / "o")]) == 0
    text = (tmp_path / "o" / "report.md").read_text()
    assert "## Privacy" in text
    assert "| sketched | 0 | central | 1.537 | 0.05 | 1e-05 | 7.996 |" in text
    assert "| ffalora | 0 | central | 0 | 0.05 | 1e-05 | ∞ (σ = 0: no guarantee) |" in text
    assert "| fedavg | 0 | central | 1.537 | 0.05 | 1e-05 | ∞ (4 rounds without noise) |" in text
    assert "| rolora | 0 | central | 1.537 | 0.05 | 1e-05 | 3.25 |" in text  # older summary
    assert "| fslora | 0 |" not in text.split("## Privacy")[1].split("##")[0]  # no privacy
    html = (tmp_path / "o" / "report.html").read_text()
    assert "final max ε" in html and "7.996" in html

    assert main(["report", str(plain), "-o", str(tmp_path / "p")]) == 0  # without privacy
    assert "Privacy" not in (tmp_path / "p" / "report.md").read_text()


def test_a_mistyped_privacy_in_summary_json_exits_2_naming_it(tmp_path, capsys):
    bad = _run(tmp_path, "sketched-seed0", "sketched", {**PRIVACY, "largest_epsilon": "high"})
    assert main(["report", str(bad), "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "privacy.largest_epsilon" in err and "Traceback" not in err
