"""Shared test set-up: CPU device, fixture paths, and a GRAPH/PYNATIVE mode switch."""
import os

import mindqwen  # noqa: F401  first, as users should: it sets what MindSpore reads when it loads
import mindspore as ms
import numpy as np
import pytest

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
MODELS = ("qwen2_tiny", "qwen3_tiny")
MOE_MODELS = ("qwen2_moe_tiny", "qwen3_moe_tiny")
MODES = {"graph": ms.GRAPH_MODE, "pynative": ms.PYNATIVE_MODE}

ms.set_device("CPU")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under ``-n 2`` two workers share two cores: one op thread each (measured on
    # test_trainer + test_generation: 208 s against 230 s with MindSpore's default).
    ms.device_context.cpu.op_tuning.threads_num(1)
    # And a core each, for every thread of the worker and of the processes it starts: MindSpore's
    # runtime hands each kernel from an actor thread to a kernel thread that spin-wait for each
    # other, so beside another busy process a demo-sized train step took 171-205 ms instead of 66 ms
    # (alone it keeps 1.8 cores busy); pinned to one core it takes 85 ms, busy neighbour or not
    # (benchmarks/cpu_neighbours.py).
    # With more cores than workers, each gets every count-th core; a lone worker (-n 1) stays free.
    _count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    _cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if 2 <= _count <= len(_cores) and os.path.isdir("/proc/self/task"):
        _mine = set(_cores[int(os.environ["PYTEST_XDIST_WORKER"].lstrip("gw")) % _count::_count])
        for _thread in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(_thread), _mine)
            except ProcessLookupError:  # the thread ended meanwhile
                pass


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: an end-to-end run of minutes (the README's command runs them too; "
                                       "`pytest -m 'not slow' tests` skips them while iterating)")


def pytest_collection_modifyitems(config, items):
    """The slow end-to-end runs first: with ``-n 2`` each worker takes one early instead of one
    worker ending the suite alone on a long run. Otherwise collection order."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def fixture_path(*parts: str) -> str:
    return os.path.join(FIXTURES, *parts)


def reference(model_name: str):
    """The HF golden outputs for a tiny model (see fixtures/REF_README.md)."""
    return np.load(fixture_path(model_name, "reference.npz"))


@pytest.fixture(params=list(MODES))
def mode(request):
    """Run the test once in GRAPH_MODE and once in PYNATIVE_MODE."""
    ms.set_context(mode=MODES[request.param])
    yield request.param
    ms.set_context(mode=ms.PYNATIVE_MODE)


@pytest.fixture(scope="session", autouse=True)
def _in_tmp_cwd(tmp_path_factory):
    """Graph compile failures write rank_0/ and CPU fusion writes akg_kernel_meta/ into the cwd:
    keep them out of the checkout. One folder for the session: MindSpore finds the fused kernels
    it built under the cwd of their first compile (after a chdir it fails to compile a graph
    that reuses one)."""
    os.chdir(tmp_path_factory.mktemp("cwd"))


@pytest.fixture(autouse=True)
def _pynative_after():
    """fit() selects its own mode: every test starts again from PyNative."""
    yield
    ms.set_context(mode=ms.PYNATIVE_MODE)
