import os

import torch

# Triton kernels run in the interpreter on machines without a GPU; triton.jit reads this at decoration time,
# so it must be set before cce_inductor.kernels is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import cce_inductor  # noqa: E402
from _compare import inductor_caches_off  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_dynamo_and_stats():
    torch._dynamo.reset()
    cce_inductor.reset_stats()
    yield
    torch._dynamo.reset()


@pytest.fixture
def no_inductor_caches():
    """Compile from scratch in this process (see ``_compare.inductor_caches_off``)."""
    with inductor_caches_off():
        yield


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device")
    config.addinivalue_line("markers", "slow: runs subprocesses or full Inductor compiles")
