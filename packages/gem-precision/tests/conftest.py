import pytest
import torch


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """Small CPU kernels run ~100x slower with 2 OpenMP threads on a shared, loaded 2-core machine
    (spinning threads); one thread is faster for every shape these tests use."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
