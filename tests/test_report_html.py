"""Readable report figures and report.html (issue 25): pooled chance/majority, the
diverged-seed rule, y-limits that show every mean, the paired-difference plot, and the HTML
page checked in a real headless Chromium."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from fedlora.errors import ConfigError
from fedlora.studies.figures import (
    diverged,
    fit_ylim,
    mean_band,
    paired_differences,
    pooled_constant,
    pyplot,
)
from fedlora.studies.html import markdown_to_html
from fedlora.studies.runs import collect_runs
from fedlora.studies.suite_report import report_suite
from powered_cases import write_run


def _suite(root: Path) -> Path:
    """Two methods × three seeds; fslora's seed 3 eval_loss diverges (2.0 -> 9.0)."""
    for seed in (1, 2, 3):
        write_run(root, "fslora", seed, [(0, 0.20, 2.0), (10, 0.22, 1.9), (20, 0.24, 1.8)])
        ends = 9.0 if seed == 3 else 1.7
        write_run(root, "proposed", seed, [(0, 0.20, 2.0), (10, 0.30, 1.8), (20, 0.40, ends)])
    (root / "suite.toml").write_text(
        'suite = "t"\nlabels = ["proposed", "fslora"]\n[targets]\n"arc-e" = 0.6\n'
        '[target_losses]\n"arc-e" = 1.75\n'
    )
    return root


def test_pooled_chance_and_majority_weight_each_seed_by_its_questions(tmp_path):
    for seed, (n, maj) in {1: (100, 0.30), 2: (300, 0.50)}.items():
        run = write_run(tmp_path, "a", seed, [(0, 0.2, 2.0)])
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        lines[0]["eval_n"] = {"arc-e": n}
        lines[0]["eval_majority"] = {"arc-e": maj}
        (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    runs, _ = collect_runs([tmp_path / "a-seed1", tmp_path / "a-seed2"])
    assert pooled_constant(runs, "arc-e", "eval_majority") == pytest.approx(
        (100 * 0.30 + 300 * 0.50) / 400
    )  # 0.45 over all 400 questions, not seed 1's 0.30
    assert pooled_constant(runs, "arc-e", "eval_chance") == pytest.approx(0.25)


def test_diverged_rule_and_y_limits_show_every_value(tmp_path):
    runs, _ = collect_runs([_suite(tmp_path)])
    by = {(r.label, r.seed): r for r in runs}
    assert diverged(by["proposed", 3], "arc-e", "loss")  # 9.0 > 2 × 2.0
    assert not diverged(by["proposed", 1], "arc-e", "loss")
    assert not diverged(by["proposed", 3], "arc-e", "accuracy")  # bounded: never
    plt = pyplot()
    fig, ax = plt.subplots()
    lo, hi = fit_ylim(ax, [18.0, 25.0, 60.0])  # a mean below chance and a target above
    plt.close(fig)
    assert lo < 18.0 and hi > 60.0


def test_report_writes_paired_plots_and_a_self_contained_html(tmp_path):
    suite = _suite(tmp_path / "s")
    report = report_suite([suite], tmp_path / "out")
    out = report.parent
    text = report.read_text()
    for name in ("accuracy_paired.png", "eval_loss_paired.png", "accuracy_bands.png"):
        assert (out / name).stat().st_size > 0 and f"]({name})" in text
    page = (out / "report.html").read_text()
    srcs = re.findall(r'<img[^>]* src="([^"]+)"', page)
    assert len(srcs) == text.count("![") and srcs
    assert all(s.startswith("data:image/png;base64,") for s in srcs)  # nothing to fetch
    assert "<table>" in page and "<th>method</th>" in page
    assert "http://" not in page and "https://" not in page


def test_unknown_reference_is_a_config_error_naming_the_labels(tmp_path):
    with pytest.raises(ConfigError, match="--reference.*fslora, proposed"):
        report_suite([_suite(tmp_path / "s")], tmp_path / "out", reference="nope")
    assert not (tmp_path / "out").exists()


def test_markdown_subset_to_html(tmp_path):
    page = markdown_to_html(
        "# T\n\nsome `code` and **bold** <x>\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n"
        "- one\n- two\n\n```\nfedlora report\n```\n\n![missing](nope.png)\n",
        tmp_path,
    )
    assert "<h1>T</h1>" in page
    assert "<code>code</code>" in page and "<strong>bold</strong>" in page
    assert "&lt;x&gt;" in page
    assert "<thead><tr><th>a</th><th>b</th></tr></thead><tbody><tr><td>1</td>" in page
    assert "<ul><li>one</li><li>two</li></ul>" in page
    assert "<pre><code>fedlora report</code></pre>" in page
    assert "missing figure: nope.png" in page


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if path := shutil.which(name):
            return path
    return None


@pytest.mark.skipif(
    _chromium() is None,
    reason="no chromium binary on PATH (Debian: apt-get install chromium; `make install` "
    "tries it when run as root)",
)
def test_every_figure_renders_in_headless_chromium(tmp_path):
    report = report_suite([_suite(tmp_path / "s")], tmp_path / "out")
    page = report.with_suffix(".html")
    n = page.read_text().count("<img ")
    done = subprocess.run(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=10000",
         "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    found = re.search(r'data-figures-rendered="(\d+)/(\d+)"', done.stdout)
    assert found, "the page's load script did not run: " + done.stdout[:500]
    assert (int(found.group(1)), int(found.group(2))) == (n, n) and n >= 4


def test_collected_runs_gzipped_predictions_are_read(tmp_path):
    import gzip

    from fedlora.studies.predictions import read_predictions

    line = {"round": 3, "task": "arc-e", "ids": [1, 2], "correct": [1, 0]}
    (tmp_path / "predictions.jsonl.gz").write_bytes(gzip.compress(json.dumps(line).encode()))
    assert read_predictions(tmp_path) == {"arc-e": line}


def test_paired_differences_by_hand(tmp_path):
    runs, _ = collect_runs([_suite(tmp_path)])
    by = {(r.label, r.seed): r for r in runs}
    a = [by["proposed", s] for s in (1, 2, 3)]
    b = [by["fslora", s] for s in (1, 2, 3)]
    grid = [0.0, 5.0, 10.0, 20.0, 25.0]
    curves, flagged = paired_differences(a, b, "arc-e", "accuracy", grid, 100.0)
    assert not flagged and len(curves) == 3
    # step curves: at 10 s 30% − 22%, at 20 s 40% − 24%; past both clocks (20 s): None
    assert curves[0] == pytest.approx([0.0, 0.0, 8.0, 16.0, None])
    xs, mean, lo, hi = mean_band(curves, grid)
    assert xs == [0.0, 5.0, 10.0, 20.0] and mean == pytest.approx([0.0, 0.0, 8.0, 16.0])
    assert hi == pytest.approx(mean)  # identical seeds: a zero-width interval
    curves, flagged = paired_differences(a, b, "arc-e", "loss", grid)
    assert [seed for seed, _ in flagged] == [3] and len(curves) == 2  # 9.0 > 2 × 2.0
    assert flagged[0][1][3] == pytest.approx(9.0 - 1.8)
