import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy machine OpenMP threads competing with other
    processes for few cores slow every small op many times over. Use with pytest.mark.usefixtures."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
