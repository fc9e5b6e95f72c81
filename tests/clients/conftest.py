"""Tests against the real training libraries (transformers' Trainer, PEFT, TRL, torchtitan): tiny models built from
configs, a few steps on the CPU, no network. Each module skips, with the reason, when its library is missing
(``pip install -e ".[test,clients]"`` installs them; CI does)."""

import pytest
import torch

import cce_inductor


@pytest.fixture
def cce_enabled():
    """The pass installed for every plain ``torch.compile``, as ``CCE_INDUCTOR=1`` does (``cce_inductor.enable()``),
    with Inductor's caches off so that its decisions are seen; removed afterwards."""
    from tests.support.compare import inductor_caches_off

    torch._dynamo.reset()
    with inductor_caches_off():
        cce_inductor.enable()
        try:
            yield
        finally:
            cce_inductor.disable()
            torch._dynamo.reset()


@pytest.fixture
def stock():
    """Plain ``torch.compile`` without the pass (the reference runs)."""
    cce_inductor.disable()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
