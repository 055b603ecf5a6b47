"""pilot_section.py: the rule document's "The pilot so far" section regenerated from the run
directories (the fake v2 study of test_study_status), the rest of the document kept."""

from __future__ import annotations

import pytest

from fedlora.federation.machine_log import record_stretch
from research.study_planner.pilot_section import main, replace_section, section_text
from research.study_planner.study_runner import pilot_stage
from research.study_planner.study_status import render_status
from study_tiny import TINY_STUDY
from test_study_status import fake
from test_study_v2 import V2_KEYS, v2_spec

DOC = "# Rule\n\n## Results\n\n### The pilot so far (old)\n\nold table\n\n## Appendix\n\nkept\n"


def test_replace_section_keeps_everything_around_it():
    new = replace_section(DOC, "### The pilot so far (new)\n\nnew table\n")
    assert (
        new
        == "# Rule\n\n## Results\n\n### The pilot so far (new)\n\nnew table\n\n## Appendix\n\nkept\n"
    )
    at_end = replace_section(
        "# R\n\n### The pilot so far\n\nold\n", "### The pilot so far\n\nnew\n"
    )
    assert at_end == "# R\n\n### The pilot so far\n\nnew\n"
    # a level-4 heading inside the section belongs to it
    nested = replace_section("### The pilot so far\n\n#### detail\n\nx\n", "### The pilot so far\n")
    assert nested == "### The pilot so far\n"
    with pytest.raises(ValueError, match="The pilot so far"):
        replace_section("# R\n\nno section\n", "x")


def test_section_holds_the_status_table_summary_machines_and_reading(tmp_path):
    spec = v2_spec()
    pilot_stage(spec, tmp_path, run_fn=fake, log=lambda _: None)
    run = tmp_path / "pilot" / "fixed-full-seed5"
    record_stretch(run, 0, {"cpu_model": "AMD EPYC", "simd": "avx2"}, fresh=True)
    status = render_status(spec, tmp_path)
    text = section_text(
        status, park="abc1234", when="2026-11-28 20:40", seed=5, figure="f.png", extra="Reading.\n"
    )
    assert text.startswith("### The pilot so far (seed 5; updated 2026-11-28 20:40 UTC)\n")
    assert "the park commit abc1234 holds them" in text
    rows = [x for x in status.splitlines() if x.startswith("| pilot/")]
    assert len(rows) == 6 and all(row in text for row in rows)
    assert "6 of 6 known pilot jobs finished. " in text  # the summary lines joined
    assert "- pilot/fixed-full-seed5: rounds 1- AMD EPYC (avx2)\n- 5 started run(s)" in text
    assert "## Analysed runs" not in text and "--figure f.png" in text
    assert text.endswith("\nReading.\n")


def test_main_rewrites_the_doc_and_refuses_bad_arguments(tmp_path, capsys):
    spec_dir = tmp_path / "study"
    pilot_stage(v2_spec(), spec_dir, run_fn=fake, log=lambda _: None)
    doc, extra = tmp_path / "rule.md", tmp_path / "reading.md"
    doc.write_text(DOC)
    extra.write_text("Read from these rows: nothing yet.\n")
    config = tmp_path / "v2.toml"
    config.write_text(TINY_STUDY.replace('metric = "arc-e/loss"', 'metric = "arc-e/acc"' + V2_KEYS))
    common = ["--park", "abc1234", "--extra", str(extra), "--doc", str(doc)]
    common += ["--config", str(config), "--out", str(spec_dir)]
    assert main([*common, "--when", "yesterday"]) == 2
    assert "--when 'yesterday'" in capsys.readouterr().err and doc.read_text() == DOC
    assert main([*common, "--out", str(tmp_path / "typo"), "--when", "2026-11-28 20:40"]) == 2
    assert "not a study directory" in capsys.readouterr().err and not (tmp_path / "typo").exists()
    assert main([*common, "--when", "yesterday"]) == 2
    assert "--when 'yesterday'" in capsys.readouterr().err and doc.read_text() == DOC
    assert main([*common, "--when", "2026-11-28 20:40"]) == 0
    text = doc.read_text()
    assert text.startswith("# Rule\n\n## Results\n\n### The pilot so far (seed 5; updated 2026")
    assert text.endswith("Read from these rows: nothing yet.\n\n## Appendix\n\nkept\n")
    assert (spec_dir / "pilot_curves.png").is_file()


def test_run_queue_stops_before_its_first_job_when_the_stop_file_exists(tmp_path):
    import os
    import subprocess
    from pathlib import Path

    script = Path(__file__).parents[1] / "research" / "study_planner" / "run_queue.sh"
    stop = tmp_path / "stop"
    stop.touch()
    env = {**os.environ, "STUDY_STOP": str(stop), "STUDY_LOG_DIR": str(tmp_path)}
    done = subprocess.run(["bash", str(script), "0", "p:fslora", "r:fslora:0"], env=env)
    assert done.returncode == 0
    log = (tmp_path / "queue_core0.log").read_text()
    assert "leaving before p:fslora" in log and "start" not in log
    stop.unlink()
    subprocess.run(["bash", str(script), "0", "x:nothing"], env=env, check=True)
    assert "not an item: x:nothing" in (tmp_path / "queue_core0.log").read_text()
