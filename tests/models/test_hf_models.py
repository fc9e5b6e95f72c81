"""Hugging Face causal LMs built from tiny configs (``tests/support/hf.py``), unmodified: each case checks that the loss
site is rewritten (or, where expected, left alone with the right reason) and that the loss and every parameter
gradient equal eager PyTorch.
"""

from __future__ import annotations

import pytest
import torch

import cce_inductor
from cce_inductor.options import CCEOptions
from tests.support.compare import inductor_caches_off
from tests.support.graphs import PassCapture

transformers = pytest.importorskip("transformers")

from tests.support.hf import FAMILIES, VOCAB, hf_batch, hf_model  # noqa: E402 (after the skip without transformers)


def _grads(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_same_training_step(model, compiled, inputs, atol=2e-5, rtol=1e-4):
    model.zero_grad(set_to_none=True)
    expected = model(**inputs)
    expected.loss.backward()
    expected_grads = _grads(model)
    model.zero_grad(set_to_none=True)
    actual = compiled(**inputs)
    actual.loss.backward()
    actual_grads = _grads(model)
    torch.testing.assert_close(actual.loss, expected.loss, atol=atol, rtol=rtol)
    assert actual_grads.keys() == expected_grads.keys()
    for name in expected_grads:
        torch.testing.assert_close(actual_grads[name], expected_grads[name], atol=atol, rtol=rtol, msg=name)
    return actual


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_family_rewritten_with_drop_logits(family):
    model = hf_model(family)
    input_ids, labels = hf_batch()
    capture = PassCapture(CCEOptions(drop_logits=True))
    compiled = torch.compile(model, backend=capture)
    out = _assert_same_training_step(model, compiled, dict(input_ids=input_ids, labels=labels))
    assert sum(capture.rewrites) == 1, cce_inductor.stats()["reasons"]
    # the logits' placeholder: their shape and dtype, raising on use (tests/test_dropped_logits.py)
    assert isinstance(out.logits, cce_inductor.DroppedLogits)
    assert out.logits.shape == (2, 12, VOCAB) and out.logits.dtype == torch.float32
    with pytest.raises(RuntimeError, match="CCE_INDUCTOR_DROP_LOGITS"):
        out.logits.softmax(-1)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2"])
def test_hf_without_opt_in_says_logits_escape(family):
    model = hf_model(family)
    input_ids, labels = hf_batch()
    capture = PassCapture(CCEOptions(lazy_logits=False))  # (the default, lazy logits: tests/clients)
    compiled = torch.compile(model, backend=capture)
    out = _assert_same_training_step(model, compiled, dict(input_ids=input_ids, labels=labels))
    assert sum(capture.rewrites) == 0
    assert out.logits.shape == (2, 12, VOCAB)
    (reason,) = cce_inductor.stats()["reasons"]
    assert "logits escape" in reason and "CCE_INDUCTOR_DROP_LOGITS=1" in reason and "CCE_INDUCTOR_LAZY_LOGITS" in reason


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_hf_num_items_in_batch_and_logits_to_keep(family):
    model = hf_model(family)
    input_ids, labels = hf_batch()
    num_items = (labels[:, 1:] != -100).sum() + 5  # gradient accumulation: a count over several micro-batches
    capture = PassCapture(CCEOptions(drop_logits=True))
    compiled = torch.compile(model, backend=capture)
    inputs = dict(input_ids=input_ids, labels=labels, num_items_in_batch=num_items, logits_to_keep=0)
    _assert_same_training_step(model, compiled, inputs)
    assert sum(capture.rewrites) == 1
    (site,) = cce_inductor.stats()["sites"]
    assert "reduction=sum" in site["reason"]


def test_hf_frozen_lm_head_lora_style():
    model = hf_model("llama")
    model.lm_head.weight.requires_grad_(False)
    input_ids, labels = hf_batch()
    capture = PassCapture(CCEOptions(drop_logits=True))
    compiled = torch.compile(model, backend=capture)
    _assert_same_training_step(model, compiled, dict(input_ids=input_ids, labels=labels))
    assert sum(capture.rewrites) == 1
    assert model.lm_head.weight.grad is None


def test_hf_gpt2_tied_embeddings_get_both_gradients():
    model = hf_model("gpt2")
    assert model.lm_head.weight is model.transformer.wte.weight
    input_ids, labels = hf_batch()
    capture = PassCapture(CCEOptions(drop_logits=True))
    _assert_same_training_step(model, torch.compile(model, backend=capture), dict(input_ids=input_ids, labels=labels))
    assert sum(capture.rewrites) == 1


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_hf_through_inductor(family):
    model = hf_model(family)
    input_ids, labels = hf_batch()
    compiled = torch.compile(model, backend=cce_inductor.make_backend(drop_logits=True))
    with inductor_caches_off():
        _assert_same_training_step(model, compiled, dict(input_ids=input_ids, labels=labels), atol=1e-4, rtol=1e-3)
    assert cce_inductor.stats()["rewritten"] == 1


def test_hf_num_items_in_batch_computes_the_gradients_at_its_scale():
    """Hugging Face's loss given ``num_items_in_batch`` (the Trainer's) is ``cross_entropy(..., reduction="sum") /
    num_items_in_batch``: an upstream gradient that is not a power of two, which would round the balanced path's
    plain 16-bit dC sum once more, past the error budget. A bf16 model's site is given the division as its
    ``grad_scale`` and keeps the plain sum, and stats() names it; the same model without it (the mean) has none. The
    training step's parity with eager: ``test_hf_num_items_in_batch_and_logits_to_keep``."""
    model = hf_model("llama").to(torch.bfloat16)
    input_ids, labels = hf_batch()
    num_items = (labels[:, 1:] != -100).sum() + 5
    for inputs, scaled in (
        (dict(input_ids=input_ids, labels=labels, num_items_in_batch=num_items), True),
        (dict(input_ids=input_ids, labels=labels), False),
    ):
        torch._dynamo.reset()
        cce_inductor.reset_stats()
        capture = PassCapture(CCEOptions(drop_logits=True, path="balanced"))
        torch.compile(model, backend=capture)(**inputs).loss.backward()
        (site,) = cce_inductor.stats()["sites"]
        assert site["path"] == "balanced", site["reason"]
        assert "in its own 16-bit dtype" in site["reason"], site["reason"]
        assert ("computed at the loss's scale after the cross-entropy (" in site["reason"]) == scaled, site["reason"]
        assert ("(truediv) by num_items_in_batch)" in site["reason"]) == scaled, site["reason"]
        assert "grad_scale" in capture.after[0] if scaled else "grad_scale" not in capture.after[0]
