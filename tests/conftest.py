"""GPU tests carry the `gpu` marker and skip cleanly on a machine without CUDA; each runs under a
watchdog, so a deadlocked kernel (the hand-scheduled ones wait on mbarriers) fails the run with a
traceback instead of hanging it."""

import faulthandler

import pytest
import torch

GPU_TEST_WATCHDOG_S = 600  # far above any GPU test's time, compile included


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def poisoned_empty():
    """Make torch.empty fill with NaN, so an output element a kernel never writes fails."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(was)


@pytest.fixture(autouse=True)
def gpu_watchdog(request):
    """Exit the process, dumping every thread's stack, if a GPU test runs past the watchdog
    (a Python exception could not interrupt a thread blocked in a CUDA synchronize)."""
    if "gpu" not in request.keywords:
        yield
        return
    faulthandler.dump_traceback_later(GPU_TEST_WATCHDOG_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()
