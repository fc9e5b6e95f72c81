"""Tests of the walk from a loss back to its head (``cce_inductor/fx_passes/head_chain.py``) on the graphs
torch.compile's settings give it, through the cross-entropy pass:

* dynamic shapes: ``dynamic=True`` and ``torch._dynamo.mark_dynamic`` compile once across batch / sequence sizes
  (symbolic vocabulary and hidden sizes too), a softcap held in a float attribute;
* grad mode: ``no_grad``, ``inference_mode``, activation checkpointing, a head under ``no_grad`` with the loss
  outside it (must stay non-differentiable) and the reverse;
* in-place updates of the hidden states / weight (also through ``weight.T``) between the head and the loss, and of
  the logits themselves.

Compiled runs through the real backend turn Inductor's caches off (the ``no_inductor_caches`` fixture): a cache hit
skips the pass, so ``cce_inductor.stats()`` would not see the rewrite. Regressions of bugs found here keep a test
each (a softcap in a float attribute under ``dynamic=True``, a head under ``no_grad``, the in-place updates).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import cce_inductor
from tests.support.compare import assert_same_run, assert_same_values, run
from tests.support.graphs import PassCapture
from tests.support.head import D, V, _hf_shift_fn, compile_capture, inputs, make_fn

# ----------------------------------------------------------------------------------------------------------------
# Dynamic shapes
# ----------------------------------------------------------------------------------------------------------------


def _pad_shift_fn():
    head = nn.Linear(D, V, bias=True)

    def fn(hidden, labels):
        logits = head(hidden)
        labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / 2.0

    return fn, head


SHAPES = [(2, 5), (3, 9), (4, 12), (2, 17)]


def _check_dynamic(fn, head, compiled, mark: bool):
    for k, (batch, seq) in enumerate(SHAPES):
        hidden, _, labels = inputs(lead=(batch, seq), seed=k)
        if mark:
            for tensor in (hidden, labels):
                torch._dynamo.mark_dynamic(tensor, 0)
                torch._dynamo.mark_dynamic(tensor, 1)
        want = run(lambda h, y: fn(h, y), (hidden, labels))
        want_w = head.weight.grad.clone()
        head.weight.grad = None
        got = run(compiled, (hidden, labels))
        got_w = head.weight.grad.clone()
        head.weight.grad = None
        assert_same_run(got, want, rtol=1e-5, atol=1e-5)
        assert_same_values(got_w, want_w, "weight grad", rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("make", [_hf_shift_fn, _pad_shift_fn])
@pytest.mark.parametrize("how", ["dynamic=True", "mark_dynamic"])
def test_dynamic_shapes_rewrite_once_capture(make, how):
    """The rewrite with symbolic batch and sequence sizes (PassCapture: cheap), one graph for all sizes."""
    fn, head = make()
    capture = PassCapture()
    compiled = torch.compile(fn, backend=capture, fullgraph=True, dynamic=True if how == "dynamic=True" else None)
    torch._dynamo.utils.counters.clear()
    _check_dynamic(fn, head, compiled, mark=how == "mark_dynamic")
    assert capture.rewrites == [1], capture.rewrites
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("how", ["dynamic=True", "mark_dynamic"])
def test_dynamic_shapes_compile_once_through_inductor(no_inductor_caches, how):
    from torch._dynamo.testing import CompileCounterWithBackend

    fn, head = _hf_shift_fn()
    counter = CompileCounterWithBackend(cce_inductor.backend)
    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True if how == "dynamic=True" else None)
    torch._dynamo.utils.counters.clear()
    _check_dynamic(fn, head, compiled, mark=how == "mark_dynamic")
    assert counter.frame_count == 1, f"{counter.frame_count} compilations for {len(SHAPES)} shapes"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert cce_inductor.stats()["rewritten"] == 1


class GemmaLikeHead(nn.Module):
    """The softcap and a logit scale are Python float attributes, as in HF configs (final_logit_softcapping)."""

    def __init__(self):
        super().__init__()
        self.lm_head = nn.Linear(D, V, bias=False)
        self.final_logit_softcapping = 30.0

    def forward(self, hidden, labels):
        logits = self.lm_head(hidden)
        logits = torch.tanh(logits / self.final_logit_softcapping) * self.final_logit_softcapping
        return F.cross_entropy(logits.view(-1, V), labels.view(-1))


@pytest.mark.parametrize("how", ["dynamic=True", "mark_dynamic"])
def test_softcap_attribute_dynamic_shapes_numbers(how):
    """Whatever the pass decides, a softcap held in a float attribute keeps eager's numbers with dynamic shapes."""
    model = GemmaLikeHead()
    compiled, capture = compile_capture(model, dynamic=True if how == "dynamic=True" else None)
    for k, (batch, seq) in enumerate(SHAPES):
        hidden, _, labels = inputs(lead=(batch, seq), seed=k)
        if how == "mark_dynamic":
            for tensor in (hidden, labels):
                torch._dynamo.mark_dynamic(tensor, 0)
                torch._dynamo.mark_dynamic(tensor, 1)
        assert_same_run(run(compiled, (hidden, labels)), run(model, (hidden, labels)), rtol=1e-5, atol=1e-5)
    assert len(capture.rewrites) == 1


def test_softcap_attribute_mark_dynamic_is_rewritten():
    model = GemmaLikeHead()
    compiled, capture = compile_capture(model)
    hidden, _, labels = inputs(lead=(2, 6))
    torch._dynamo.mark_dynamic(hidden, 1)
    torch._dynamo.mark_dynamic(labels, 1)
    compiled(hidden, labels)
    assert capture.rewrites == [1]


def test_dynamic_true_softcap_attribute_is_rewritten():
    model = GemmaLikeHead()
    compiled, capture = compile_capture(model, dynamic=True)
    hidden, _, labels = inputs(lead=(2, 6))
    compiled(hidden, labels)
    assert capture.rewrites == [1], cce_inductor.stats()["reasons"]


def test_dynamic_vocabulary_and_hidden_size_capture():
    """dynamic=True with the weight as an input: V and D are symbolic too; numbers stay eager's."""

    def fn(hidden, weight, labels):
        logits = hidden @ weight.T
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-1)

    compiled, capture = compile_capture(fn, dynamic=True)
    for k, (n, vocab, hid) in enumerate([(5, 11, 6), (9, 17, 4), (7, 23, 9)]):
        gen = torch.Generator().manual_seed(k)
        hidden = torch.randn(n, hid, generator=gen, requires_grad=True)
        weight = torch.randn(vocab, hid, generator=gen, requires_grad=True)
        labels = torch.randint(-1, vocab, (n,), generator=gen)
        assert_same_run(run(compiled, (hidden, weight, labels)), run(fn, (hidden, weight, labels)))
    assert capture.rewrites == [1]  # one graph for every size, rewritten with symbolic V and D


# ----------------------------------------------------------------------------------------------------------------
# Modes
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_no_grad_and_inference_mode(no_inductor_caches, mode):
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]
    fn = make_fn(softcap=10.0, bias=True, ignore_index=-100)
    hidden, weight, labels, bias = inputs(8, bias=True)
    want = fn(hidden, weight, labels, bias)
    compiled = torch.compile(fn, backend=cce_inductor.backend, fullgraph=True)
    with context():
        got = compiled(hidden, weight, labels, bias)
        want_ctx = fn(hidden, weight, labels, bias)
    assert not got.requires_grad
    assert cce_inductor.stats()["rewritten"] == 1
    assert_same_values(got, want_ctx)
    assert_same_values(got, want.detach())


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_no_grad_and_inference_mode_capture(mode):
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]
    fn = make_fn(softcap=10.0, reduction="none")
    hidden, weight, labels = inputs(8)
    compiled, capture = compile_capture(fn)
    with context():
        got, want = compiled(hidden, weight, labels), fn(hidden, weight, labels)
    assert capture.rewrites == [1]
    assert_same_values(got, want)


@pytest.mark.slow
def test_activation_checkpoint_around_head_and_loss(no_inductor_caches):
    """checkpoint(use_reentrant=False) around head + loss: Dynamo makes it a higher-order op with a subgraph."""
    head = nn.Linear(D, V)

    def head_and_loss(hidden, labels):
        logits = torch.tanh(head(hidden) / 5.0) * 5.0
        return F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-1)

    def fn(hidden, labels):
        return checkpoint(head_and_loss, torch.relu(hidden), labels, use_reentrant=False)

    hidden, _, labels = inputs(lead=(2, 5), ignore_index=-1)
    params = list(head.parameters())

    def loss_and_grads(f):
        loss = f(hidden, labels)
        return loss.detach(), torch.autograd.grad(loss, [hidden] + params)

    want = loss_and_grads(fn)
    got = loss_and_grads(torch.compile(fn, backend=cce_inductor.backend, fullgraph=True))
    assert_same_values(got[0], want[0], "loss")
    for g, w in zip(got[1], want[1]):
        assert_same_values(g, w, "grad")
    assert cce_inductor.stats()["rewritten"] == 1


def test_activation_checkpoint_capture_numbers():
    """Through PassCapture the checkpointed body is a subgraph the pass does not enter: still eager's numbers."""
    fn_inner = make_fn(softcap=5.0)

    def fn(hidden, weight, labels):
        return checkpoint(fn_inner, hidden, weight, labels, use_reentrant=False)

    hidden, weight, labels = inputs(6)
    compiled, capture = compile_capture(fn)
    assert_same_run(run(compiled, (hidden, weight, labels)), run(fn, (hidden, weight, labels)))


def _head_under_no_grad(hidden, weight, labels):
    """A loss on logits computed under no_grad (a teacher, a logged metric): it must not be differentiable."""
    with torch.no_grad():
        logits = F.linear(hidden, weight)
    return F.cross_entropy(logits, labels)


def test_loss_under_no_grad_on_logits_with_grad_capture():
    """The reverse (head with grad, loss under no_grad) is fine: the op lands where the loss is, under no_grad."""

    def fn(hidden, weight, labels):
        logits = F.linear(hidden, weight)
        with torch.no_grad():
            return F.cross_entropy(logits, labels)

    hidden, weight, labels = inputs(6)
    compiled, capture = compile_capture(fn)
    got, want = compiled(hidden, weight, labels), fn(hidden, weight, labels)
    assert capture.rewrites == [1]
    assert got.requires_grad == want.requires_grad is False
    assert_same_values(got, want)


@pytest.mark.parametrize("backend", ["capture", pytest.param("inductor", marks=pytest.mark.slow)])
def test_head_under_no_grad_stays_non_differentiable(no_inductor_caches, backend):
    hidden, weight, labels = inputs(6)
    want = _head_under_no_grad(hidden, weight, labels)
    assert not want.requires_grad
    compiled = torch.compile(
        _head_under_no_grad, backend=PassCapture() if backend == "capture" else cce_inductor.backend, fullgraph=True
    )
    got = compiled(hidden, weight, labels)
    assert_same_values(got.detach(), want)
    # as a side loss next to a real one: eager gives the head no gradient from it
    assert not got.requires_grad, "the compiled loss requires grad: it would train the no_grad head"


# ----------------------------------------------------------------------------------------------------------------
# In-place updates between the head and the loss
# ----------------------------------------------------------------------------------------------------------------


def _mutate_hidden_after_head(x, weight, labels):
    hidden = x * 2.0
    logits = F.linear(hidden, weight)
    hidden.add_(100.0)  # the buffer is reused after the head: the logits already hold the old values
    return F.cross_entropy(logits, labels)


def _mutate_weight_after_head(x, weight, labels):
    logits = F.linear(x, weight)
    weight.mul_(3.0)  # e.g. an in-place renormalisation of the head after its use
    return F.cross_entropy(logits, labels)


def _mutate_weight_through_its_transpose_after_head(x, weight, labels):
    logits = F.linear(x, weight)
    weight.T.mul_(3.0)  # a view of the weight: Dynamo records `.T` as getattr up to torch 2.13, aten.numpy_T from 2.14
    return F.cross_entropy(logits, labels)


@pytest.mark.parametrize(
    "fn",
    [_mutate_hidden_after_head, _mutate_weight_after_head, _mutate_weight_through_its_transpose_after_head],
    ids=["hidden", "weight", "weight_through_T"],
)
@pytest.mark.parametrize("backend", ["capture", pytest.param("inductor", marks=pytest.mark.slow)])
def test_in_place_update_after_the_head(no_inductor_caches, fn, backend):
    x, weight, labels = (t.detach() for t in inputs(6))
    want = fn(x.clone(), weight.clone(), labels)
    compiled = torch.compile(
        fn, backend=PassCapture() if backend == "capture" else cce_inductor.backend, fullgraph=True
    )
    got = compiled(x.clone(), weight.clone(), labels)
    assert_same_values(got, want)


def test_in_place_update_of_the_logits_is_left_alone():
    """An in-place edit of the logits themselves is another user of the logits: refused, eager's numbers."""

    def fn(hidden, weight, labels):
        logits = F.linear(hidden, weight)
        logits[:, 0] = -1e4  # e.g. masking a padding token
        return F.cross_entropy(logits, labels)

    hidden, weight, labels = (t.detach() for t in inputs(6))
    compiled, capture = compile_capture(fn)
    assert_same_values(compiled(hidden, weight, labels), fn(hidden, weight, labels))
    assert capture.rewrites == [0]
