"""torchtitan: ``CCELoss`` as ``Trainer.Config.loss``, against torchtitan's own code.

torchtitan's llama3 debug model (from its model registry; two of its six layers, and ``F.scaled_dot_product_attention``
in place of FlexAttention, which has no backward on the CPU) trains a few steps through torchtitan's own
``Trainer._forward_backward_body``, with the loss wired as ``Trainer.__init__`` wires a ``ChunkedLossWrapper``
(``set_lm_head``, ``model._skip_lm_head = True``): once with torchtitan's default loss (``ChunkedLossWrapper`` over
``CrossEntropyLoss``), once with ``CCELoss``. Losses and every parameter's gradient are equal at each step (SGD
steps: Adam would turn rounding noise in near-zero gradients into full-size updates).
"""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e '.[clients]')")

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import model_registry
from torchtitan.trainer import Trainer

import cce_inductor
from cce_inductor.integrations.torchtitan import CCELoss
from tests.support.compare import rel_l2


def _model(tied: bool):
    config = model_registry("debugmodel").model
    config.layers = config.layers[:2]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.enable_weight_tying = tied
    torch.manual_seed(0)
    model = config.build()
    model.init_weights(buffer_device=None)
    return model


def _train(loss_config, tied: bool, steps: int = 3):
    model = _model(tied)
    loss_fn = loss_config.build()
    # as Trainer.__init__ does for a ChunkedLossWrapper (torchtitan/trainer.py)
    assert isinstance(loss_fn, ChunkedLossWrapper)
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    trainer = types.SimpleNamespace(train_context=contextlib.nullcontext, model_parts=[model], loss_fn=loss_fn)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(0)
    losses, grads = [], []
    for _ in range(steps):
        tokens = torch.randint(0, 2048, (2, 16), generator=generator)
        labels = torch.randint(0, 2048, (2, 16), generator=generator)
        labels[:, :4] = -100  # torchtitan's IGNORE_INDEX
        optimizer.zero_grad()
        loss = Trainer._forward_backward_body(trainer, tokens, labels, (labels != -100).sum(), {})
        grads.append({name: p.grad.detach().clone() for name, p in model.named_parameters()})
        optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses), grads


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_cce_loss_equals_torchtitan_default(tied):
    want_losses, want_grads = _train(ChunkedLossWrapper.Config(num_chunks=2, loss_fn=CrossEntropyLoss.Config()), tied)
    cce_inductor.reset_stats()
    got_losses, got_grads = _train(CCELoss.Config(), tied)
    assert cce_inductor.stats()["executions"]["linear_cross_entropy"] == 3
    torch.testing.assert_close(got_losses, want_losses, rtol=1e-5, atol=1e-6)
    for step, (got, want) in enumerate(zip(got_grads, want_grads)):
        assert got.keys() == want.keys()
        for name in want:  # fp32 gradients: relative L2 at fp32's rounding level
            assert rel_l2(got[name], want[name]) < 1e-5, (step, name, rel_l2(got[name], want[name]))


def test_cce_loss_needs_the_head_and_validates():
    loss_fn = CCELoss.Config().build()
    with pytest.raises(RuntimeError, match="set_lm_head"):
        loss_fn(torch.randn(1, 2, 4), torch.zeros(1, 2, dtype=torch.long))
    model = _model(False)
    loss_fn.set_lm_head(model.lm_head)
    with torch.no_grad():  # validation: no gradient, same loss
        hidden = torch.randn(1, 3, model.lm_head.weight.shape[1])
        labels = torch.tensor([[1, -100, 5]])
        loss, metrics = loss_fn(hidden, labels, torch.tensor(2))
        want = (
            torch.nn.functional.cross_entropy(
                model.lm_head(hidden).flatten(0, 1).float(), labels.flatten(), reduction="sum"
            )
            / 2
        )
    torch.testing.assert_close(loss, want)
    assert metrics == {} and "forward" not in vars(model.lm_head)  # the head's forward is its own again
