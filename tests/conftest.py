import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny tensors on a shared 2-core box: one intra-op thread is fastest (two OpenMP threads
    contend for one free core and run several times slower) and deterministic."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
