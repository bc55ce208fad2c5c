import importlib.util
import os

import pytest


def pytest_configure(config):
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return  # the pytest-xdist controller runs no test: its workers start sooner without these imports
    import torch

    from seeupo_gym.integrations import import_openenv_core

    # Under pytest-xdist (`make test` runs two workers on a 2-core machine) each worker gets its share
    # of the cores, in its own torch and in the processes it starts: oversubscribed torch threads spin.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        share = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
        os.environ["OMP_NUM_THREADS"] = str(share)
        torch.set_num_threads(share)
    # Tests import openenv directly too: once, the way our servers and clients do (no web playground).
    if importlib.util.find_spec("openenv") is not None:  # the serve extra may be missing
        import_openenv_core()


def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist: a test file's tests run on one worker (module fixtures load once), and
    every AppWorld test on one worker, in turn: several of them look at the machine as a whole
    (processes left, IPC objects, the sandbox's counters). xdist's own `loadgroup` does not see
    group marks under this pytest, so the grouping is by node id."""
    from xdist.scheduler import LoadScopeScheduling

    class AppWorldTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "appworld" if "appworld" in nodeid.lower() else nodeid.split("::", 1)[0]

    return AppWorldTogether(config, log)


def pytest_collection_modifyitems(config, items):
    # The scheduler above finds AppWorld tests by name: one marked but not so named is a mistake.
    misnamed = [item.nodeid for item in items
                if item.get_closest_marker("appworld") is not None and "appworld" not in item.nodeid.lower()]
    if misnamed:
        raise pytest.UsageError(f"tests marked appworld must have 'appworld' in their file or test name: {misnamed}")


@pytest.fixture(scope="module")
def one_torch_thread():
    # The tiny model's ops are too small to gain from threads; on a shared 2-core machine the
    # threads' spin-waiting made these tests several times slower.
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny():
    from seeupo_gym.agents.models import load_model

    return load_model("tiny", seed=0)


def appworld_mini():
    """The offline AppWorld task set and its task ids, or (None, []) when it is not built.

    Looked up without raising, so `pytest -m "not appworld"` collects on a machine without it;
    tests marked appworld then fail at setup saying how to build it (`pytest_runtest_setup`).
    """
    from seeupo_gym.appworld import find_data_dir
    from seeupo_gym.appworld.paths import AppWorldSetupError, read_split

    try:
        folder = find_data_dir("mini")
        return folder, read_split(folder, "mini")
    except (AppWorldSetupError, OSError):
        return None, []


def pytest_runtest_setup(item):
    if item.get_closest_marker("appworld") is not None and appworld_mini()[0] is None:
        pytest.fail("the AppWorld mini task set is missing: run `make appworld-mini` (part of `make test`)")
