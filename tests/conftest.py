"""Shared test fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import fedlora.llm.device
import fedlora.llm.disk_cache


@pytest.fixture(autouse=True, scope="session")
def _bf16_probe_says_fp32(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """`model.dtype = "auto"` must not depend on the machine's speed in tests: the bf16 probe
    reports bf16 2x slower (so auto = fp32 on every CPU, as before auto existed) and keeps its
    figures in a temporary directory (or the `cache_dir` a test names). Session-wide, so that
    module-scoped fixtures see it too. Tests of auto pass their own flags and probe."""
    probe_dir = tmp_path_factory.mktemp("probe")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            fedlora.llm.device,
            "bf16_probe",
            lambda **_: {"fp32_s": 1.0, "bf16_s": 2.0, "bf16_speedup": 0.5},
        )
        mp.setattr(
            fedlora.llm.device,
            "probe_file",
            lambda cache_dir=None: (cache_dir or probe_dir) / "bf16_probe.json",
        )
        yield


@pytest.fixture(autouse=True, scope="session")
def _no_disk_cache() -> Iterator[None]:
    """The frozen-layer disk store stays off in tests (no files under ~/.cache, no entry one
    test leaves for another); tests of the store turn it on in a temporary directory."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fedlora.llm.disk_cache, "ENABLED", False)
        yield
