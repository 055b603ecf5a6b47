"""Shared test fixtures."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

import fedlora.llm.device
import fedlora.llm.disk_cache

# test files that start Flower or Ray processes, or kill processes they started: under
# pytest-xdist (`make test`: -n 2 --dist loadgroup) they run on one worker, one after another,
# so two Ray clusters or two superlinks never start side by side
PROCESS_FILES = ("flower", "secagg", "reliability", "ray")
# files those words match that start no Flower or Ray process and kill nothing (their
# subprocesses are a Python that exports or imports, or a CLI refusal before anything starts):
# they run beside the group, which is the suite's longest path on 2 cores
NO_PROCESS_FILES = (
    "test_flower_common.py",
    "test_reliability.py",
    "test_reliability_adapter.py",
    "test_reliability_disk.py",
    "test_reliability_inputs.py",
    "test_reliability_reads.py",
    "test_reliability_rundir.py",
    "test_reliability_usage.py",
    "test_secagg.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        name = item.path.name
        if name not in NO_PROCESS_FILES and any(word in name for word in PROCESS_FILES):
            item.add_marker(pytest.mark.xdist_group("processes"))


@pytest.fixture(autouse=True, scope="session")
def _bf16_probe_says_fp32() -> Iterator[None]:
    """`model.dtype = "auto"` must not depend on the machine's speed in tests: the timings
    (a run's training step, the matmul probe of `fedlora eval`) report bf16 2x slower, so
    auto = fp32 on every CPU, as before auto existed. Session-wide, so that module-scoped
    fixtures see it too. Tests of auto pass their own flags and timings."""
    slower = {"fp32_s": 1.0, "bf16_s": 2.0, "what": "test timings"}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fedlora.llm.device, "bf16_probe", lambda **_: dict(slower))
        mp.setattr(fedlora.llm.device, "run_step_probe", lambda cfg: dict(slower))
        yield


@pytest.fixture(autouse=True, scope="session")
def _no_disk_cache() -> Iterator[None]:
    """The frozen-layer disk store stays off in tests (no files under ~/.cache, no entry one
    test leaves for another): a run gets no store (`Run.disk` None) unless its config names
    its own model.cache_dir, as the tests of the store do (a temporary directory). Tests that
    build a cache themselves pass the store they want (`disk=`)."""
    real = fedlora.llm.disk_cache.disk_store_for

    def only_in_a_named_dir(model_cfg):
        return real(model_cfg) if model_cfg.cache_dir else None

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fedlora.llm.disk_cache, "disk_store_for", only_in_a_named_dir)
        yield


@pytest.fixture
def method_registry() -> Iterator[Callable[..., None]]:
    """Methods registered for one test: call it with ``name=class`` pairs (or let a module the
    test imports register its own); the registry is as it was once the test is done."""
    from fedlora.federation.methods import registry

    saved = dict(registry._REGISTRY)

    def register(**classes: type) -> None:
        for name, cls in classes.items():
            registry.register_method(name)(cls)

    yield register
    registry._REGISTRY.clear()
    registry._REGISTRY.update(saved)


@pytest.fixture(autouse=True)
def _no_render_thread_left_running() -> Iterator[None]:
    """No test leaves a chat-template rendering running: a thread left spinning holds a share
    of the GIL and of a core for the rest of the session (one such thread once made the whole
    suite several times slower, and Flower's niced Ray workers starved beside it)."""
    yield
    import threading
    import time

    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        left = [
            t for t in threading.enumerate() if t.name == "fedlora-chat-render" and t.is_alive()
        ]
        if not left:
            return
        time.sleep(0.05)
    pytest.fail(f"{len(left)} chat-template rendering thread(s) left running after the test")
