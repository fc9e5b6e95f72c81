"""Robustness: the rewritten model behaves as eager PyTorch at the edges, not only on friendly inputs.

* bad input: out-of-range targets raise eager's ``IndexError: Target X is out of bounds.`` (direct op and
  compiled); NaN / Inf in the inputs propagate exactly where eager puts them; empty batches (N = 0);
* dynamic shapes: ``dynamic=True`` and ``torch._dynamo.mark_dynamic`` compile once across batch / sequence sizes;
* modes: ``no_grad``, ``inference_mode``, activation checkpointing, CPU autocast (bf16) on and off,
  ``cce_inductor.enable()`` with ``mode="max-autotune-no-cudagraphs"``;
* caches: every ``CCEOptions`` field is part of ``CCEGraphPass.uuid()``;
* determinism: the CPU path is bitwise reproducible.

Compiled runs through the real backend turn Inductor's caches off (the ``no_inductor_caches`` fixture): a cache hit
skips the pass, so ``cce_inductor.stats()`` would not see the rewrite.

Regressions of bugs found here keep a test each: int32 targets (eager raises, compiled computed), a softcap held in a
float attribute under ``dynamic=True``, a head under ``no_grad`` with the loss outside it, and in-place updates of
the hidden states / weight (also through ``weight.T``) between the head and the loss.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch._inductor.config as inductor_config
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import cce_inductor
from cce_inductor.graph_pass import CCEGraphPass
from cce_inductor.options import CCEOptions

from tests.support.compare import assert_same_run, assert_same_values, run
from tests.support.graphs import PassCapture

lce = cce_inductor.linear_cross_entropy

V, D = 13, 7  # not multiples of anything
REDUCTIONS = ["mean", "sum", "none"]


def head_loss(hidden, weight, labels, bias=None, softcap=None, ignore_index=-100, reduction="mean"):
    """Eager reference: linear -> [softcap] -> cross_entropy."""
    logits = F.linear(hidden, weight, bias)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=ignore_index,
                           reduction=reduction)  # fmt: skip


def make_fn(softcap=None, ignore_index=-100, reduction="mean", bias=False):
    """A model snippet with the constants baked in (as model code has them)."""
    if bias:
        def fn(hidden, weight, labels, b):
            return head_loss(hidden, weight, labels, b, softcap, ignore_index, reduction)
    else:
        def fn(hidden, weight, labels):
            return head_loss(hidden, weight, labels, None, softcap, ignore_index, reduction)
    return fn


def inputs(n=6, *, dtype=torch.float32, seed=0, bias=False, ignore_index=-100, lead=None):
    gen = torch.Generator().manual_seed(seed)
    lead = (n,) if lead is None else lead
    hidden = torch.randn(*lead, D, generator=gen).to(dtype).requires_grad_()
    weight = torch.randn(V, D, generator=gen).div(D**0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, V, lead, generator=gen)
    if labels.numel() > 2:
        labels.view(-1)[1] = ignore_index
    out = [hidden, weight, labels]
    if bias:
        out.append(torch.randn(V, generator=gen).to(dtype).requires_grad_())
    return out


def compile_capture(fn, **kwargs):
    capture = PassCapture()
    return torch.compile(fn, backend=capture, fullgraph=True, **kwargs), capture


# ----------------------------------------------------------------------------------------------------------------
# Bad input: targets out of range
# ----------------------------------------------------------------------------------------------------------------

BAD_TARGETS = [  # (bad target, ignore_index): never the ignore_index, outside [0, V)
    (V, -100),
    (V + 5, -100),
    (-5, -100),
    (-1, -100),
    (-100, 0),  # -100 is not ignored when ignore_index is 0
    (-100, 5),  # ... nor when ignore_index is inside the vocabulary
    (V + 1, V),  # ignore_index == V is fine, V + 1 is not
]


def _eager_error(fn, args) -> BaseException:
    with pytest.raises(Exception) as info:
        fn(*args)
    return info.value


def _with_bad_target(bad, ignore_index, reduction, dtype=torch.float32):
    hidden, weight, labels = inputs(6, dtype=dtype, ignore_index=ignore_index)
    labels[3] = bad
    return hidden, weight, labels


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("bad,ignore_index", BAD_TARGETS)
def test_out_of_range_target_direct_op_raises_like_eager(bad, ignore_index, reduction):
    hidden, weight, labels = _with_bad_target(bad, ignore_index, reduction)
    want = _eager_error(make_fn(ignore_index=ignore_index, reduction=reduction), (hidden, weight, labels))
    assert type(want) is IndexError and str(want) == f"Target {bad} is out of bounds."  # eager's contract
    with pytest.raises(IndexError) as got:
        lce(hidden, weight, labels, ignore_index=ignore_index, reduction=reduction)
    assert str(got.value) == str(want)


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("bad,ignore_index", BAD_TARGETS[:1] + BAD_TARGETS[2:5])
def test_out_of_range_target_compiled_raises_like_eager(bad, ignore_index, reduction, softcap):
    hidden, weight, labels = _with_bad_target(bad, ignore_index, reduction)
    fn = make_fn(softcap=softcap, ignore_index=ignore_index, reduction=reduction)
    want = _eager_error(fn, (hidden, weight, labels))
    compiled, capture = compile_capture(fn)
    with pytest.raises(type(want)) as got:
        compiled(hidden, weight, labels)
    assert capture.rewrites == [1]
    assert str(got.value) == str(want)


@pytest.mark.slow
@pytest.mark.parametrize("bad,ignore_index", [(V, -100), (-100, 0)])
def test_out_of_range_target_through_inductor_raises_like_eager(no_inductor_caches, bad, ignore_index):
    hidden, weight, labels = _with_bad_target(bad, ignore_index, "mean")
    fn = make_fn(ignore_index=ignore_index)
    want = _eager_error(fn, (hidden, weight, labels))
    compiled = torch.compile(fn, backend=cce_inductor.backend, fullgraph=True)
    good = labels.clone()
    good[3] = 0
    assert_same_run(run(compiled, (hidden, weight, good)), run(fn, (hidden, weight, good)))  # compiles, works
    with pytest.raises(type(want)) as got:
        compiled(hidden, weight, labels)  # the same compiled code, now with a bad target
    assert str(got.value) == str(want)
    assert cce_inductor.stats()["rewritten"] == 1


def test_int32_targets_raise_like_eager():
    hidden, weight, labels = inputs(6)
    labels = labels.int()
    fn = make_fn()
    want = _eager_error(fn, (hidden, weight, labels))
    assert type(want) is RuntimeError and "expected target dtype to be Long" in str(want)
    compiled, capture = compile_capture(fn)
    try:
        compiled(hidden, weight, labels)
    except RuntimeError as got:
        assert "expected target dtype to be Long" in str(got)
    else:
        raise AssertionError(f"eager raises {want!r}; the compiled model (rewrites: {capture.rewrites}) does not")


# ----------------------------------------------------------------------------------------------------------------
# Bad input: NaN and Inf
# ----------------------------------------------------------------------------------------------------------------

POISON = {  # where, what: a NaN/Inf in one place of the inputs
    "hidden_nan": ("hidden", (1, 2), float("nan")),
    "hidden_inf": ("hidden", (1, 2), float("inf")),
    "hidden_-inf": ("hidden", (2, 0), float("-inf")),
    "hidden_inf_and_-inf": ("hidden", [(1, 2), (1, 3)], [float("inf"), float("-inf")]),
    "ignored_row_nan": ("hidden", (1, 0), float("nan")),  # row 1 is ignored
    "weight_nan": ("weight", (4, 1), float("nan")),
    "weight_inf": ("weight", (4, 1), float("inf")),
    "bias_inf": ("bias", (4,), float("inf")),
    "bias_-inf": ("bias", (4,), float("-inf")),
    "bias_-inf_target": ("bias", "target", float("-inf")),  # -inf logit exactly at a target
}


def _poisoned(case: str, seed=0):
    hidden, weight, labels, bias = inputs(6, bias=True, seed=seed)
    which, index, value = POISON[case]
    tensor = {"hidden": hidden, "weight": weight, "bias": bias}[which]
    with torch.no_grad():
        if index == "target":
            index = (int(labels[0]),)
        for i, v in zip(index if isinstance(index, list) else [index], value if isinstance(value, list) else [value]):
            tensor[i] = v
    return hidden, weight, labels, bias


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", list(POISON))
def test_nan_inf_propagate_as_in_eager_direct_op(case, reduction, softcap):
    hidden, weight, labels, bias = _poisoned(case)
    want = run(make_fn(softcap=softcap, reduction=reduction, bias=True), (hidden, weight, labels, bias))
    got = run(lambda h, w, y, b: lce(h, w, y, bias=b, softcap=softcap, reduction=reduction),
              (hidden, weight, labels, bias))  # fmt: skip
    assert_same_run(got, want)


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", list(POISON))
def test_nan_inf_propagate_as_in_eager_compiled(case, reduction, softcap):
    hidden, weight, labels, bias = _poisoned(case)
    fn = make_fn(softcap=softcap, reduction=reduction, bias=True)
    want = run(fn, (hidden, weight, labels, bias))
    compiled, capture = compile_capture(fn)
    got = run(compiled, (hidden, weight, labels, bias))
    assert capture.rewrites == [1]
    assert_same_run(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("case,reduction", [("hidden_nan", "none"), ("hidden_inf_and_-inf", "mean")])
def test_nan_inf_propagate_as_in_eager_through_inductor(no_inductor_caches, case, reduction):
    hidden, weight, labels, bias = _poisoned(case)
    fn = make_fn(softcap=3.0, reduction=reduction, bias=True)
    want = run(fn, (hidden, weight, labels, bias))
    got = run(torch.compile(fn, backend=cce_inductor.backend, fullgraph=True), (hidden, weight, labels, bias))
    assert cce_inductor.stats()["rewritten"] == 1
    assert_same_run(got, want)


# ----------------------------------------------------------------------------------------------------------------
# Empty batches
# ----------------------------------------------------------------------------------------------------------------

EMPTY_EXPECTED = {"mean": "nan", "sum": 0.0, "none": (0,)}


def _check_empty_result(out: torch.Tensor, reduction: str):
    expected = EMPTY_EXPECTED[reduction]
    if expected == "nan":
        assert out.shape == () and out.isnan(), out
    elif reduction == "sum":
        assert out.shape == () and out.item() == 0.0, out
    else:
        assert out.shape == expected, out.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_empty_batch_direct_op(reduction, dtype):
    hidden, weight, labels = inputs(0, dtype=dtype)
    want = run(make_fn(reduction=reduction), (hidden, weight, labels))
    _check_empty_result(want[0], reduction)
    got = run(lambda h, w, y: lce(h, w, y, reduction=reduction).to(want[0].dtype), (hidden, weight, labels))
    assert_same_run(got, want)


@pytest.mark.parametrize("softcap", [None, 7.0])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("lead", [(0,), (2, 0), (0, 3)])
def test_empty_batch_compiled(lead, reduction, softcap):
    hidden, weight, labels = inputs(dtype=torch.float32, lead=lead)
    fn = make_fn(softcap=softcap, reduction=reduction)
    want = run(fn, (hidden, weight, labels))
    _check_empty_result(want[0], reduction)
    compiled, capture = compile_capture(fn)
    got = run(compiled, (hidden, weight, labels))
    assert capture.rewrites == [1]
    assert_same_run(got, want)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_empty_after_label_shift_compiled(reduction):
    """Sequence length 1: the HF shift leaves no token at all."""

    def fn(hidden, weight, labels):
        logits = F.linear(hidden, weight)[..., :-1, :].contiguous()
        return F.cross_entropy(logits.view(-1, V), labels[..., 1:].contiguous().view(-1), reduction=reduction)

    hidden, weight, labels = inputs(lead=(3, 1))
    want = run(fn, (hidden, weight, labels))
    _check_empty_result(want[0], reduction)
    compiled, capture = compile_capture(fn)
    got = run(compiled, (hidden, weight, labels))
    assert capture.rewrites == [1]
    assert_same_run(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_empty_batch_through_inductor(no_inductor_caches, reduction):
    hidden, weight, labels = inputs(0)
    fn = make_fn(reduction=reduction)
    want = run(fn, (hidden, weight, labels))
    got = run(torch.compile(fn, backend=cce_inductor.backend, fullgraph=True), (hidden, weight, labels))
    assert_same_run(got, want)
    assert cce_inductor.stats()["rewritten"] == 1


# ----------------------------------------------------------------------------------------------------------------
# Dynamic shapes
# ----------------------------------------------------------------------------------------------------------------


def _hf_shift_fn():
    """Gemma-2 style: upcast, softcap written as a literal (a softcap held in a Python float attribute has a test of
    its own below), HF label shift."""
    head = nn.Linear(D, V, bias=False)

    def fn(hidden, labels):
        logits = head(hidden).float()
        logits = torch.tanh(logits / 30.0) * 30.0
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        return F.cross_entropy(shift_logits.view(-1, V), shift_labels.view(-1))

    return fn, head


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


@pytest.mark.parametrize("fn", [_mutate_hidden_after_head, _mutate_weight_after_head,
                                _mutate_weight_through_its_transpose_after_head],
                         ids=["hidden", "weight", "weight_through_T"])  # fmt: skip
@pytest.mark.parametrize("backend", ["capture", pytest.param("inductor", marks=pytest.mark.slow)])
def test_in_place_update_after_the_head(no_inductor_caches, fn, backend):
    x, weight, labels = (t.detach() for t in inputs(6))
    want = fn(x.clone(), weight.clone(), labels)
    compiled = torch.compile(fn, backend=PassCapture() if backend == "capture" else cce_inductor.backend,
                             fullgraph=True)  # fmt: skip
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


AUTOCAST_TOL = dict(rtol=2e-2, atol=2e-2)  # eager rounds the logits to bf16; the op accumulates in fp32


@pytest.mark.parametrize("inside", [False, True], ids=["autocast_outside", "autocast_inside"])
@pytest.mark.parametrize("enabled", [True, False], ids=["on", "off"])
def test_autocast_cpu_bf16_capture(enabled, inside):
    inner = make_fn(softcap=20.0, bias=True)
    if inside:
        def fn(*args):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
                return inner(*args)
    else:
        fn = inner
    args = inputs(10, bias=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled and not inside):
        want = run(fn, args)
        compiled, capture = compile_capture(fn)
        got = run(compiled, args)
    assert capture.rewrites == [1]
    assert want[0].dtype == torch.float32  # cross_entropy runs in fp32 under autocast
    assert_same_run(got, want, **(AUTOCAST_TOL if enabled else {}))


@pytest.mark.slow
@pytest.mark.parametrize("enabled", [True, False], ids=["on", "off"])
def test_autocast_cpu_bf16_through_inductor(no_inductor_caches, enabled):
    fn = make_fn(softcap=20.0, bias=True)
    args = inputs(10, bias=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
        want = run(fn, args)
        got = run(torch.compile(fn, backend=cce_inductor.backend, fullgraph=True), args)
    assert cce_inductor.stats()["rewritten"] == 1
    assert_same_run(got, want, **(AUTOCAST_TOL if enabled else dict(rtol=1e-5, atol=1e-5)))


_MAX_AUTOTUNE_SCRIPT = textwrap.dedent(
    """
    import torch, torch.nn.functional as F
    import cce_inductor
    torch._inductor.config.force_disable_caches = True
    cce_inductor.enable()
    torch.manual_seed(0)
    V, D = 13, 7
    head = torch.nn.Linear(D, V)
    def fn(hidden, labels):
        logits = torch.tanh(head(hidden) / 9.0) * 9.0
        return F.cross_entropy(logits[..., :-1, :].reshape(-1, V), labels[..., 1:].reshape(-1))
    hidden = torch.randn(2, 6, D, requires_grad=True)
    labels = torch.randint(0, V, (2, 6))
    compiled = torch.compile(fn, mode="max-autotune-no-cudagraphs", fullgraph=True)
    results = []
    for f in (fn, compiled):
        loss = f(hidden, labels)
        grads = torch.autograd.grad(loss, [hidden, head.weight, head.bias])
        results.append((loss, grads))
    torch.testing.assert_close(results[1][0], results[0][0])
    for g, w in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(g, w)
    print("REWRITTEN", cce_inductor.stats()["rewritten"])
    """
)


@pytest.mark.slow
def test_enable_with_max_autotune_no_cudagraphs():
    """``cce_inductor.enable()`` + ``torch.compile(mode="max-autotune-no-cudagraphs")`` (a subprocess: ``enable``
    is process-global). Skipped when it takes longer than 60 s on this machine."""
    env = dict(os.environ, CCE_INDUCTOR="0")
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _MAX_AUTOTUNE_SCRIPT], capture_output=True, text=True, timeout=60, env=env
        )
    except subprocess.TimeoutExpired:
        pytest.skip("max-autotune-no-cudagraphs compile took longer than 60 s")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "REWRITTEN 1" in proc.stdout, proc.stdout + proc.stderr[-2000:]


# ----------------------------------------------------------------------------------------------------------------
# Caches: every option is part of the pass's uuid
# ----------------------------------------------------------------------------------------------------------------


def _alternatives(field: dataclasses.Field) -> list:
    """Values other than the default for one CCEOptions field; unknown field types fail loudly."""
    default = field.default
    if isinstance(default, bool):
        return [not default]
    if field.name == "products":
        return ["triton"]
    if field.name == "backward_row_chunk":
        return [0, 2048]
    if field.name == "scratch_mb":
        return [256, 1024]
    raise AssertionError(f"new CCEOptions field {field.name!r} ({field.type}): add its values to this test")


def test_every_option_changes_the_uuid():
    fields = dataclasses.fields(CCEOptions)
    assert {f.name for f in fields} >= {"drop_logits", "exact", "products", "backward_row_chunk"}
    base = CCEOptions()
    variants = {"default": base}
    for field in fields:
        for value in _alternatives(field):
            variants[f"{field.name}={value!r}"] = dataclasses.replace(base, **{field.name: value})
    # every pair of one-field changes as well (no two options may cancel out in the key)
    for a in fields:
        for b in fields:
            if a.name < b.name:
                variants[f"{a.name}+{b.name}"] = dataclasses.replace(
                    base, **{a.name: _alternatives(a)[0], b.name: _alternatives(b)[0]}
                )
    uuids = {name: CCEGraphPass(options).uuid() for name, options in variants.items()}
    assert all(isinstance(u, str) and u for u in uuids.values()), uuids
    by_uuid: dict = {}
    for name, u in uuids.items():
        by_uuid.setdefault(u, []).append(name)
    clashes = [names for names in by_uuid.values() if len(names) > 1]
    assert not clashes, f"options sharing one uuid: {clashes}"
    # and the uuid is a function of the options: equal options, equal uuid
    for name, options in variants.items():
        assert CCEGraphPass(dataclasses.replace(options)).uuid() == uuids[name], name


ENV_OPTIONS = {
    "CCE_INDUCTOR_DROP_LOGITS": "1",
    "CCE_INDUCTOR_EXACT": "1",
    "CCE_INDUCTOR_PRODUCTS": "triton",
    "CCE_INDUCTOR_BACKWARD_ROW_CHUNK": "2048",
    "CCE_INDUCTOR_SCRATCH_MB": "1024",
}


@pytest.mark.parametrize("variable", list(ENV_OPTIONS))
def test_every_environment_option_changes_the_uuid(monkeypatch, variable):
    for name in ENV_OPTIONS:
        monkeypatch.delenv(name, raising=False)
    base = CCEGraphPass(CCEOptions.from_env()).uuid()
    monkeypatch.setenv(variable, ENV_OPTIONS[variable])
    assert CCEGraphPass(CCEOptions.from_env()).uuid() != base


def test_environment_covers_every_field(monkeypatch):
    """Each CCEOptions field has an environment variable (so the table above is exhaustive)."""
    for name in ENV_OPTIONS:
        monkeypatch.delenv(name, raising=False)
    base = CCEOptions.from_env()
    changed = set()
    for variable, value in ENV_OPTIONS.items():
        monkeypatch.setenv(variable, value)
        options = CCEOptions.from_env()
        changed |= {f.name for f in dataclasses.fields(CCEOptions) if getattr(options, f.name) != getattr(base, f.name)}
        monkeypatch.delenv(variable)
    assert changed == {f.name for f in dataclasses.fields(CCEOptions)}


@pytest.mark.slow
def test_backend_options_reach_the_pass(no_inductor_caches):
    """make_backend(...) compiles with a pass carrying exactly its options (what Inductor's cache key sees)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    seen = []

    class Spy(CustomGraphPass):  # chained before ours by the backend: sees the pass installed for this compile
        def __call__(self, graph):
            seen.append(inductor_config.pre_grad_custom_pass)

        def uuid(self):
            return "spy"

    options = CCEOptions(drop_logits=True, exact=True, products="triton", backward_row_chunk=1024)
    fn = make_fn()
    with inductor_config.patch(pre_grad_custom_pass=Spy()):
        torch.compile(fn, backend=cce_inductor.make_backend(options), fullgraph=True)(*inputs(4))
    assert len(seen) == 1 and isinstance(seen[0], CCEGraphPass)
    assert seen[0].options == options
    assert seen[0].uuid() == CCEGraphPass(options, chained=seen[0].chained).uuid() != CCEGraphPass(
        CCEOptions(), chained=seen[0].chained
    ).uuid()


# ----------------------------------------------------------------------------------------------------------------
# Determinism
# ----------------------------------------------------------------------------------------------------------------


def _bitwise_equal(a, b):
    assert torch.equal(a[0], b[0]) or (a[0].isnan().all() and b[0].isnan().all()), (a[0], b[0])
    for x, y in zip(a[1], b[1]):
        assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_direct_op_is_bitwise_deterministic(dtype, reduction):
    args = inputs(lead=(3, 11), dtype=dtype, bias=True)

    def f(h, w, y, b):
        return lce(h, w, y, bias=b, softcap=4.0, reduction=reduction, ignore_index=-100)

    _bitwise_equal(run(f, args), run(f, args))


def test_direct_op_is_bitwise_deterministic_with_tiny_chunks(monkeypatch):
    """Several row and vocabulary chunks (the online log-sum-exp and the dC accumulation): same bits twice."""
    from cce_inductor import _chunked

    for fn in (_chunked.forward, _chunked.backward):  # ops.py relies on the keyword-only defaults
        monkeypatch.setitem(fn.__kwdefaults__, "row_chunk", 4)
        monkeypatch.setitem(fn.__kwdefaults__, "vocab_chunk", 5)
    args = inputs(lead=(3, 11), bias=True)

    def f(h, w, y, b):
        return lce(h, w, y, bias=b, softcap=4.0)

    first, second = run(f, args), run(f, args)
    _bitwise_equal(first, second)
    monkeypatch.undo()
    torch.testing.assert_close(run(f, args)[0], first[0])  # and chunking does not change the result


@pytest.mark.slow
def test_compiled_is_bitwise_deterministic(no_inductor_caches):
    fn, head = _hf_shift_fn()
    hidden, _, labels = inputs(lead=(3, 9))
    results = []
    for _ in range(2):
        torch._dynamo.reset()  # two independent compilations
        compiled = torch.compile(fn, backend=cce_inductor.backend, fullgraph=True)
        for _ in range(2):  # and two runs of each
            out = run(compiled, (hidden, labels))
            out[1].append(head.weight.grad.clone())
            head.weight.grad = None
            results.append(out)
    for other in results[1:]:
        _bitwise_equal(results[0], other)


@pytest.mark.parametrize(
    "variable, value, error",
    [("CCE_INDUCTOR_EXACT", "maybe", "is not a boolean"), ("CCE_INDUCTOR_BACKWARD_ROW_CHUNK", "8k", "not an integer"),
     ("CCE_INDUCTOR_BACKWARD_ROW_CHUNK", "-1", "must be >= 0"), ("CCE_INDUCTOR_PRODUCTS", "cutlass", "'cublas' or")],
)
def test_bad_environment_options_fail_loudly(monkeypatch, variable, value, error):
    monkeypatch.setenv(variable, value)
    with pytest.raises((ValueError, TypeError), match=error):
        CCEOptions.from_env()


@pytest.mark.parametrize(
    "kwargs, error",
    [(dict(exact=1), "must be a bool"), (dict(products="TRITON"), "'cublas' or"), (dict(backward_row_chunk=2.0), "int"),
     (dict(backward_row_chunk=True), "int"), (dict(scratch_mb=-1), ">= 0"), (dict(scratch_mb=0.5), "int"),
     (dict(filter_eps=0.1), "unknown cce_inductor option")],
)
def test_bad_keyword_options_fail_loudly(kwargs, error):
    with pytest.raises((ValueError, TypeError), match=error):
        cce_inductor.make_backend(**kwargs)


@pytest.mark.parametrize("variable", ["CCE_INDUCTOR_FILTER_EPS", "CCE_INDUCTOR_VOCAB_SORT"])
def test_retired_environment_options_say_so(monkeypatch, variable):
    """Gradient filtering was retired: a leftover setting is reported, and the options are the exact defaults."""
    monkeypatch.setenv(variable, "auto")
    with pytest.warns(FutureWarning, match=f"{variable} is ignored"):
        assert CCEOptions.from_env() == CCEOptions()


def test_encoded_options_round_trip():
    for options in (CCEOptions(), CCEOptions(exact=True, products="triton", backward_row_chunk=0, scratch_mb=512)):
        assert CCEOptions.decode(options.encode()) == options
    with pytest.raises(ValueError, match="not an encoded cce_inductor option"):
        CCEOptions.decode("filter_eps=0.1")
