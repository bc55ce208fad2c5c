import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    # The tiny model's ops are too small to gain from threads; on a shared 2-core machine the
    # threads' spin-waiting made these tests several times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny():
    from seeupo_gym.agents.models import load_model

    return load_model("tiny", seed=0)
