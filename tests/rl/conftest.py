import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """RL tests run many tiny ops; on a shared 2-core machine each OpenMP barrier can wait
    milliseconds for a descheduled thread. Tests that check thread counts set their own."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
