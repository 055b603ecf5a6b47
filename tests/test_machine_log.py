"""machine.jsonl: which machine computed which rounds of a run (hand-written cpuinfo and
hand-computed stretches)."""

from __future__ import annotations

import json

import torch

from fedlora.federation.machine_log import (
    MACHINE_FILE,
    cpu_model,
    describe_machines,
    kernel_flags,
    machine_facts,
    machine_kind,
    read_machine_lines,
    record_stretch,
    simd_level,
    stretches,
)

EPYC_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu sse sse2 avx fma avx2 bmi2
"""
XEON_AMX = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu avx avx2 fma avx512f avx512_vnni avx512_bf16 amx_tile amx_bf16
"""
ARM = """processor\t: 0
Features\t: fp asimd evtstrm sve
CPU part\t: 0xd40
"""


def test_cpu_facts_from_cpuinfo_text():
    assert cpu_model(EPYC_AVX2) == "AMD EPYC"
    assert cpu_model(ARM) == "0xd40"
    assert cpu_model("") == ""
    assert simd_level({"avx", "fma", "avx2"}) == "avx2"
    assert simd_level({"avx2", "avx512f", "amx_bf16"}) == "amx"
    assert simd_level({"asimd", "sve"}) == "sve"
    assert simd_level({"asimd"}) == "neon"
    assert simd_level(set()) == "unknown"
    assert kernel_flags({"bmi2", "avx2", "fpu", "avx", "fma"}) == ["avx", "avx2", "fma"]


def test_machine_facts_read_the_given_cpuinfo_and_torch():
    facts = machine_facts("cpu", cpuinfo=XEON_AMX)
    assert facts["cpu_model"] == "Intel(R) Xeon(R) Platinum 8480+"
    assert facts["simd"] == "amx"
    assert facts["cpu_flags"] == [
        "avx", "avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16",
    ]  # fmt: skip
    assert facts["gpu"] is None and facts["device"] == "cpu" and facts["trains"] == "here"
    assert facts["torch"] == torch.__version__
    assert facts["torch_threads"] == torch.get_num_threads()
    assert machine_facts("cpu", trains_here=False, cpuinfo=ARM)["trains"] == "remote"


def test_stretches_a_later_resume_supersedes_what_it_recomputed():
    a, b, c = (
        {"from_round": r, "simd": s} for r, s in ((0, "avx2"), (400, "avx512"), (300, "amx"))
    )
    # 0 -> ran to ~404, resumed at 400 on avx512, ran on, then resumed at 300 on amx
    assert stretches([a, b, c]) == [(1, 300, a), (301, None, c)]
    assert stretches([a, b]) == [(1, 400, a), (401, None, b)]
    assert stretches([]) == []


def test_record_read_describe(tmp_path):
    record_stretch(tmp_path, 0, {"cpu_model": "AMD EPYC", "simd": "avx2"}, fresh=True)
    record_stretch(tmp_path, 400, {"cpu_model": "AMD EPYC", "simd": "avx512"}, fresh=False)
    assert describe_machines(tmp_path) == (
        "rounds 1-400 AMD EPYC (avx2); rounds 401- AMD EPYC (avx512)"
    )
    # a torn last line (a run killed mid-write) is dropped
    with (tmp_path / MACHINE_FILE).open("a") as f:
        f.write('{"from_round": 9')
    assert [x["from_round"] for x in read_machine_lines(tmp_path)] == [0, 400]
    # a fresh start replaces the file
    record_stretch(tmp_path, 0, {"gpu": "NVIDIA H200", "device": "cuda:0"}, fresh=True)
    lines = (tmp_path / MACHINE_FILE).read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["at"].endswith("Z")
    assert describe_machines(tmp_path) == "rounds 1- NVIDIA H200 (cuda)"


def test_describe_a_run_whose_first_stretches_were_not_recorded(tmp_path):
    assert describe_machines(tmp_path) == ""  # no machine.jsonl: nothing to say
    record_stretch(tmp_path, 1300, {"cpu_model": "AMD EPYC", "simd": "avx512"}, fresh=False)
    assert describe_machines(tmp_path) == (
        "rounds 1-1300 unrecorded; rounds 1301- AMD EPYC (avx512)"
    )
    # a resume on the same kind of machine joins the stretch before it
    record_stretch(tmp_path, 1375, {"cpu_model": "AMD EPYC", "simd": "avx512"}, fresh=False)
    assert describe_machines(tmp_path) == (
        "rounds 1-1300 unrecorded; rounds 1301- AMD EPYC (avx512)"
    )
    record_stretch(tmp_path, 1400, {"cpu_model": "AMD EPYC", "simd": "avx2"}, fresh=False)
    record_stretch(tmp_path, 1450, {"cpu_model": "AMD EPYC", "simd": "avx512"}, fresh=False)
    assert describe_machines(tmp_path) == (
        "rounds 1-1300 unrecorded; rounds 1301-1400 AMD EPYC (avx512); "
        "rounds 1401-1450 AMD EPYC (avx2); rounds 1451- AMD EPYC (avx512)"
    )
    assert machine_kind({"device": "mps", "cpu_model": ""}) == "Apple (mps)"
    assert machine_kind({}) == "unknown CPU (unknown)"


def test_admit_to_manifest_only_fedlora_names_and_only_with_a_marker(tmp_path):
    import pytest

    from fedlora.federation.runmarker import admit_to_manifest

    assert admit_to_manifest(tmp_path, MACHINE_FILE) is False  # no marker: nothing written
    assert not any(tmp_path.iterdir())
    with pytest.raises(ValueError, match="notes.txt"):
        admit_to_manifest(tmp_path, "notes.txt")
