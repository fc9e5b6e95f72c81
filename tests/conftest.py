"""Settings and fixtures for every test file: the Triton interpreter without a GPU, a fresh Dynamo and ``stats()``
for each test, Inductor's caches off on request, a clean ``CCE_INDUCTOR*`` environment, Inductor's pre-grad hook
restored, and the markers (``gpu``, ``slow``)."""

import os

import torch

# Triton kernels run in the interpreter on machines without a GPU; triton.jit reads this at decoration time,
# so it must be set before cce_inductor.kernels is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch._inductor.config as inductor_config

import cce_inductor
from tests.support.compare import inductor_caches_off


@pytest.fixture(autouse=True)
def _fresh_dynamo_and_stats():
    torch._dynamo.reset()
    cce_inductor.reset_stats()
    yield
    torch._dynamo.reset()


@pytest.fixture
def no_inductor_caches():
    """Compile from scratch in this process (see ``tests.support.compare.inductor_caches_off``)."""
    with inductor_caches_off():
        yield


@pytest.fixture
def clean_env(monkeypatch):
    """No ``CCE_INDUCTOR*`` variable set for this test."""
    for name in list(os.environ):
        if name.startswith("CCE_INDUCTOR"):
            monkeypatch.delenv(name)


@pytest.fixture
def restore_hook():
    """Whatever a test does to pre_grad_custom_pass, put the original back."""
    saved = inductor_config.pre_grad_custom_pass
    yield
    inductor_config.pre_grad_custom_pass = saved


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device")
    config.addinivalue_line("markers", "slow: runs subprocesses or full Inductor compiles")
