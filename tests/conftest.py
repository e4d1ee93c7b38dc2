"""Fixtures every test directory may use."""
import pytest
import torch


@pytest.fixture
def one_torch_thread():
    """One torch thread for the test: tiny models run no faster on more, the suite shares 2 cores, and on a shared
    machine a second thread's barrier waits dominate."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
