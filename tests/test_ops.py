"""Tests of the fused ops (``cce_inductor/ops.py``): ``torch.ops.cce_inductor.linear_cross_entropy`` and its backward,
``linear_cross_entropy_with_grads`` (the balanced path's op), and ``cce_inductor.linear_cross_entropy``, against eager
PyTorch (``F.linear`` + optional softcap ``tanh(x / c) * c`` + ``F.cross_entropy``).

CPU only: everything here runs the chunked PyTorch path (``cce_inductor._chunked``, tested on its own in
``tests/test_chunked.py``). The eager reference and its tolerances: ``tests/support/reference.py``; bad input:
``tests/test_checks.py``.

Tests with a ``Regression`` comment reproduce bugs found while writing them (fixed in the package since).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import cce_inductor
from cce_inductor import CCEOptions, balanced_op, ops
from tests.support.compare import rel_l2 as rel_err
from tests.support.inputs import BALANCED, IGNORE, make_balanced_inputs, make_op_inputs
from tests.support.reference import (
    DTYPES,
    LOSS_RTOL,
    UNIT_ROUNDOFF,
    check_against_eager,
    eager_loss,
    grad_rtol,
    run_fresh,
)

lce = cce_inductor.linear_cross_entropy
OPTIONS = CCEOptions().encode()  # the op's options argument, as the pass and the public wrapper pass it


# ----------------------------------------------------------------------------------------------------------------
# Against eager
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("softcap", [None, 4.0], ids=["nocap", "cap"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_eager(dtype, bias, softcap, reduction):
    check_against_eager((37,), 53, 24, dtype, bias=bias, softcap=softcap, reduction=reduction)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("label_smoothing", [0.1, 1.0])
@pytest.mark.parametrize("ignore", ["some", "all"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_label_smoothing_matches_eager(dtype, label_smoothing, ignore, reduction):
    check_against_eager(
        (5, 7),
        53,
        24,
        dtype,
        bias=True,
        softcap=4.0,
        reduction=reduction,
        ignore=ignore,
        ignore_index=2,
        label_smoothing=label_smoothing,
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("ignore_index", [-100, 0])
@pytest.mark.parametrize("ignore", ["none", "some", "all"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_ignore_index(dtype, ignore_index, ignore, reduction):
    out = check_against_eager(
        (29,), 41, 16, dtype, bias=True, softcap=None, reduction=reduction, ignore=ignore, ignore_index=ignore_index
    )
    if ignore == "all":
        # No target counts: every gradient is zero (as in eager), even when the mean loss is NaN.
        for grad in out[1:]:
            assert torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_ignored_rows_contribute_nothing(reduction):
    """Changing the hidden state of an ignored row changes neither the loss nor other rows' gradients."""
    e, c, t, _ = make_op_inputs((16,), 23, 8, torch.float64, ignore="some")
    assert t[0] == -100
    e2 = e.clone()
    e2[0] += 10.0
    a, b_ = run_fresh(lce, e, c, t, None, reduction=reduction), run_fresh(lce, e2, c, t, None, reduction=reduction)
    torch.testing.assert_close(a[0], b_[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(a[2], b_[2], rtol=0, atol=1e-12)
    assert torch.equal(a[1][0], torch.zeros_like(a[1][0]))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty_batch(dtype, reduction):
    """N = 0 behaves as eager: NaN mean, 0 sum, empty none; zero gradients of the right shapes."""
    e, c, t, b = make_op_inputs((0,), 11, 5, dtype, bias=True, ignore="none")
    out = run_fresh(lce, e, c, t, b, reduction=reduction)
    ref = run_fresh(eager_loss, e, c, t, b, reduction=reduction)
    torch.testing.assert_close(out[0], ref[0].to(out[0].dtype), equal_nan=True)
    for grad, ref_grad in zip(out[1:], ref[1:]):
        assert grad.shape == ref_grad.shape and grad.dtype == ref_grad.dtype
        assert torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore", ["none", "all"])
def test_single_row(reduction, ignore):
    check_against_eager((1,), 17, 8, torch.float64, bias=True, softcap=3.0, reduction=reduction, ignore=ignore)
    check_against_eager((1,), 17, 8, torch.float32, bias=False, softcap=None, reduction=reduction, ignore=ignore)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_leading_dims(dtype, reduction):
    """e (B, T, D) with targets (B, T); reduction='none' returns (B, T)."""
    out = check_against_eager((3, 7), 31, 16, dtype, bias=True, softcap=5.0, reduction=reduction)
    if reduction == "none":
        assert out[0].shape == (3, 7)
    assert out[1].shape == (3, 7, 16)


def test_leading_dims_3d():
    check_against_eager((2, 3, 4), 19, 8, torch.float64, bias=False, softcap=None, reduction="none")


def test_int32_targets():
    check_against_eager(
        (4, 9),
        29,
        8,
        torch.float32,
        bias=True,
        softcap=None,
        reduction="mean",
        transform=lambda e, c, t, b: (e, c, t.to(torch.int32), b),
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_non_contiguous_inputs(dtype):
    """c given as a transposed view of a (D, V) tensor, e as a strided view, bias as a strided view."""

    def transform(e, c, t, b):
        c_t = c.t().contiguous().t()  # (V, D) with strides (1, V)
        assert not c_t.is_contiguous()
        e_wide = torch.stack([e, torch.zeros_like(e)], dim=-1).flatten(-2)  # (N, 2D)
        e_strided = e_wide[:, ::2]
        assert not e_strided.is_contiguous() and torch.equal(e_strided, e)
        b_strided = torch.stack([b, b], dim=-1)[:, 0]
        assert not b_strided.is_contiguous()
        return e_strided, c_t, t, b_strided

    for reduction in ("mean", "none"):
        check_against_eager((21,), 27, 12, dtype, bias=True, softcap=2.5, reduction=reduction, transform=transform)


def test_reduction_none_with_expanded_grad_output():
    """``loss.sum().backward()`` hands the op a stride-0 (expanded) gradient."""
    e, c, t, b = make_op_inputs((3, 5), 19, 8, torch.float64, bias=True)

    def grads(fn):
        leaves = [x.clone().requires_grad_(True) for x in (e, c, b)]
        fn(leaves[0], leaves[1], t, bias=leaves[2], reduction="none").sum().backward()
        return [x.grad for x in leaves]

    for got, want in zip(grads(lce), grads(eager_loss)):
        assert rel_err(got, want) <= 1e-12


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_large_logits_are_stable(dtype):
    """Logits in the hundreds: the online log-sum-exp must not overflow."""
    check_against_eager(
        (17,),
        29,
        8,
        dtype,
        bias=False,
        softcap=None,
        reduction="mean",
        transform=lambda e, c, t, b: (e * 300.0, c, t, b),
    )


# ----------------------------------------------------------------------------------------------------------------
# Weights: frozen, tied
# ----------------------------------------------------------------------------------------------------------------


class RecordBackward:
    """Wraps ``ops.linear_cross_entropy_backward_op`` (looked up at call time by the autograd formula)."""

    def __init__(self, monkeypatch):
        self.calls = []
        original = ops.linear_cross_entropy_backward_op

        def wrapper(*args, **kwargs):
            self.calls.append(kwargs)
            return original(*args, **kwargs)

        monkeypatch.setattr(ops, "linear_cross_entropy_backward_op", wrapper)


def _frozen_weight_case(monkeypatch, with_bias: bool):
    e, c, t, b = make_op_inputs((13,), 19, 8, torch.float32, bias=with_bias)
    e.requires_grad_(True)
    if b is not None:
        b.requires_grad_(True)
    assert not c.requires_grad
    recorder = RecordBackward(monkeypatch)
    loss = lce(e, c, t, bias=b)
    loss.backward()
    assert c.grad is None
    assert len(recorder.calls) == 1
    call = recorder.calls[0]
    assert call["need_e"] is True and call["need_c"] is False
    assert call["need_bias"] is with_bias

    e_ref = e.detach().clone().requires_grad_(True)
    b_ref = None if b is None else b.detach().clone().requires_grad_(True)
    eager_loss(e_ref, c, t, b_ref).backward()
    torch.testing.assert_close(e.grad, e_ref.grad, rtol=1e-5, atol=1e-6)
    if b is not None:
        torch.testing.assert_close(b.grad, b_ref.grad, rtol=1e-5, atol=1e-6)


def test_frozen_weight_with_bias(monkeypatch):
    _frozen_weight_case(monkeypatch, with_bias=True)


def test_frozen_weight_without_bias(monkeypatch):
    # Regression: the backward op used to return the same `empty` tensor for two gradients not asked for, which
    # custom ops reject ("may not alias any inputs ... or other returns"): backward failed for a frozen head.
    _frozen_weight_case(monkeypatch, with_bias=False)


def test_detached_hidden_without_bias(monkeypatch):
    # Regression for the aliasing bug of test_frozen_weight_without_bias, hit when only c needs a gradient.
    e, c, t, _ = make_op_inputs((13,), 19, 8, torch.float32)
    c.requires_grad_(True)
    recorder = RecordBackward(monkeypatch)
    lce(e, c, t).backward()
    assert recorder.calls[0]["need_e"] is False and recorder.calls[0]["need_c"] is True
    c_ref = c.detach().clone().requires_grad_(True)
    eager_loss(e, c_ref, t).backward()
    torch.testing.assert_close(c.grad, c_ref.grad, rtol=1e-5, atol=1e-6)


def test_backward_op_gradients_not_needed_are_empty_and_distinct():
    # Regression (see test_frozen_weight_without_bias): the op itself, called with need_c=False and no bias.
    e, c, t, _ = make_op_inputs((6,), 10, 4, torch.float64, ignore="none")
    lse = torch.logsumexp(e @ c.T, dim=1)
    for need_e, need_c, need_bias in [(True, False, False), (False, True, False), (False, False, False)]:
        grads = ops.linear_cross_entropy_backward_op(
            torch.tensor(1.0, dtype=torch.float64),
            e,
            c,
            t,
            None,
            lse,
            None,
            None,
            None,
            None,
            -100,
            "mean",
            0.0,
            OPTIONS,
            need_e,
            need_c,
            need_bias,
        )
        for grad, needed, full in zip(grads, (need_e, need_c, False), (e, c, None)):
            assert grad.shape == (full.shape if needed else (0,))


def test_tied_weights():
    """The same parameter as embedding and head: both gradient contributions accumulate."""
    vocab, dim, batch, seq = 37, 16, 3, 8
    gen = torch.Generator().manual_seed(0)
    weight0 = torch.randn(vocab, dim, generator=gen, dtype=torch.float64) * 0.5
    mix0 = torch.randn(dim, dim, generator=gen, dtype=torch.float64) / math.sqrt(dim)
    tokens = torch.randint(0, vocab, (batch, seq), generator=gen)
    targets = torch.roll(tokens, -1, dims=1)
    targets[:, -1] = -100

    def loss_fn(fn):
        weight = weight0.clone().requires_grad_(True)
        mix = mix0.clone().requires_grad_(True)
        hidden = torch.tanh(F.embedding(tokens, weight) @ mix)
        loss = fn(hidden, weight, targets, softcap=6.0)
        loss.backward()
        return loss.detach(), weight.grad, mix.grad

    out, ref = loss_fn(lce), loss_fn(eager_loss)
    torch.testing.assert_close(out[0], ref[0], rtol=1e-12, atol=0)
    torch.testing.assert_close(out[1], ref[1], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out[2], ref[2], rtol=1e-10, atol=1e-12)
    # both uses contribute: the gradient differs from the head's contribution alone
    weight = weight0.clone().requires_grad_(True)
    hidden = torch.tanh(F.embedding(tokens, weight.detach()) @ mix0)
    eager_loss(hidden, weight, targets, softcap=6.0).backward()
    assert (out[1] - weight.grad).abs().max() > 1e-6


def test_double_backward_is_not_silently_wrong():
    """create_graph=True: the op does not claim to support double backward; it must not return wrong numbers."""
    e, c, t, _ = make_op_inputs((5,), 7, 3, torch.float64, ignore="none")
    e.requires_grad_(True)
    loss = lce(e, c, t)
    (g,) = torch.autograd.grad(loss, e, create_graph=True)
    try:
        g.sum().backward()
    except RuntimeError:
        return  # an error is fine
    e_ref = e.detach().clone().requires_grad_(True)
    (g_ref,) = torch.autograd.grad(eager_loss(e_ref, c, t), e_ref, create_graph=True)
    g_ref.sum().backward()
    torch.testing.assert_close(e.grad, e_ref.grad)


# ----------------------------------------------------------------------------------------------------------------
# Autocast
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_autocast_cpu_bf16_matches_eager(bias):
    """Under CPU autocast the op matches eager F.linear + cross_entropy under autocast within bf16 tolerance."""
    # Regression (see test_autocast_does_not_change_the_op_precision): the forward's log-sum-exp was computed
    # under autocast (bf16 logits blocks) while the backward, run outside autocast, recomputed the logits in fp32;
    # softmax = exp(logits - lse) then no longer summed to 1 and dE / dC were 2.4% / 4.6% off (relative L2 vs
    # fp64 from the bf16-rounded inputs; eager autocast: 0.3%; with autocast off inside the op: 0.17%).
    e, c, t, b = make_op_inputs((4, 16), 257, 32, torch.float32, bias=bias)
    leaves = [x.clone().requires_grad_(True) for x in (e, c)] + ([b.clone().requires_grad_(True)] if bias else [])
    ref_leaves = [x.detach().clone().requires_grad_(True) for x in leaves]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = lce(leaves[0], leaves[1], t, bias=leaves[2] if bias else None)
        ref = eager_loss(ref_leaves[0], ref_leaves[1], t, ref_leaves[2] if bias else None)
    assert loss.dtype == torch.float32 and ref.dtype == torch.float32
    loss.backward()
    ref.backward()
    # Both compute logits from bf16-rounded inputs; eager also rounds the logits to bf16 (one more rounding).
    tol = 4 * UNIT_ROUNDOFF[torch.bfloat16]
    assert rel_err(loss, ref) <= tol
    for x, y in zip(leaves, ref_leaves):
        assert x.grad.dtype == torch.float32  # gradients flow back through the cast to the fp32 leaves
        assert rel_err(x.grad, y.grad) <= tol, rel_err(x.grad, y.grad)
    # and against fp64 from the bf16-rounded inputs
    ref64 = eager_loss(
        *(x.detach().bfloat16().double() for x in (e, c)), t, None if b is None else b.bfloat16().double()
    )
    assert rel_err(loss, ref64) <= tol


def test_autocast_does_not_change_the_op_precision():
    # Regression: the op's implementation ran with CPU autocast still on, so the matmuls inside
    # `_chunked.forward/backward` meant to run in the float32 accumulation dtype were silently downcast to bf16.
    # The same bf16 inputs gave a loss ~1e-2 (max abs, V=4096) less accurate inside `torch.autocast` than
    # outside it. Fixed by running both op implementations under `torch.autocast(..., enabled=False)`.
    e, c, t, _ = make_op_inputs((64,), 4096, 64, torch.bfloat16, ignore="none")
    plain = lce(e, c, t, reduction="none")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = lce(e, c, t, reduction="none")
    ref64 = eager_loss(e.double(), c.double(), t, reduction="none")
    assert rel_err(plain, ref64) <= LOSS_RTOL[torch.bfloat16]
    assert rel_err(inside, ref64) <= LOSS_RTOL[torch.bfloat16]
    # the gradients of bf16 inputs: one bf16 rounding of an fp32-accurate result
    e.requires_grad_(True)
    c.requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = lce(e, c, t)
    loss.backward()
    ref = run_fresh(eager_loss, e, c, t, None, dtype=torch.float64)
    assert rel_err(e.grad, ref[1]) <= grad_rtol(torch.bfloat16)
    assert rel_err(c.grad, ref[2]) <= grad_rtol(torch.bfloat16)


# ----------------------------------------------------------------------------------------------------------------
# opcheck
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("softcap", [None, 3.0], ids=["nocap", "cap"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_opcheck_forward(reduction, softcap, bias):
    e, c, t, b = make_op_inputs((6,), 10, 4, torch.float64, bias=bias)
    args = (
        e.requires_grad_(),
        c.requires_grad_(),
        t,
        None if b is None else b.requires_grad_(),
        softcap,
        -100,
        reduction,
        0.0,
        OPTIONS,
        reduction == "mean",
        reduction != "sum",
    )
    torch.library.opcheck(ops.linear_cross_entropy_op, args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck_forward_low_precision(dtype):
    e, c, t, b = make_op_inputs((5,), 9, 4, dtype, bias=True)
    args = (e.requires_grad_(), c.requires_grad_(), t, b, None, -100, "mean", 0.1, OPTIONS, True, True)
    torch.library.opcheck(ops.linear_cross_entropy_op, args)


@pytest.mark.parametrize(
    "needs",
    [(True, True, True), (True, True, False), (False, True, True), (True, False, True)],
    ids=["all", "no_bias", "no_e", "no_c"],
)
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_opcheck_backward(needs, reduction):
    e, c, t, b = make_op_inputs((6,), 10, 4, torch.float64, bias=True)
    lse = torch.logsumexp(F.linear(e, c, b), dim=1)
    grad = torch.rand(6, dtype=torch.float64) if reduction == "none" else torch.tensor(0.5, dtype=torch.float64)
    grad_lse = torch.rand(6, dtype=torch.float64) if reduction == "none" else None
    # with the entropy's gradient where every row's lse is used too
    entropy = torch.distributions.Categorical(logits=F.linear(e, c, b)).entropy() if reduction == "none" else None
    grad_entropy = torch.rand(6, dtype=torch.float64) if reduction == "none" else None
    args = (grad, e, c, t, b, lse, grad_lse, entropy, grad_entropy, None, -100, reduction, 0.1, OPTIONS, *needs)
    torch.library.opcheck(ops.linear_cross_entropy_backward_op, args)


def test_opcheck_backward_two_grads_not_needed():
    # Regression: see test_frozen_weight_without_bias (the same `empty` tensor returned for two outputs).
    e, c, t, _ = make_op_inputs((6,), 10, 4, torch.float64)
    lse = torch.logsumexp(F.linear(e, c), dim=1)
    args = (
        torch.tensor(0.5, dtype=torch.float64),
        e,
        c,
        t,
        None,
        lse,
        None,
        None,
        None,
        None,
        -100,
        "mean",
        0.0,
        OPTIONS,
        True,
        False,
        False,
    )
    torch.library.opcheck(ops.linear_cross_entropy_backward_op, args)


# ----------------------------------------------------------------------------------------------------------------
# The balanced path's op: linear_cross_entropy_with_grads
# ----------------------------------------------------------------------------------------------------------------


def test_opcheck():
    e, c, t, b = make_balanced_inputs(9, 30, 8, torch.float32, bias=True)
    for reduction in ("mean", "sum"):
        args = (
            e.requires_grad_(),
            c.requires_grad_(),
            t,
            b.requires_grad_(),
            4.0,
            IGNORE,
            reduction,
            0.1,
            BALANCED.encode(),
            True,
            True,
            True,
            False,
        )
        torch.library.opcheck(torch.ops.cce_inductor.linear_cross_entropy_with_grads.default, args)


def test_backward_scales_saved_gradients_and_refuses_missing_ones():
    e, c, t, _ = make_balanced_inputs(10, 30, 8, torch.float32)
    e.requires_grad_()
    loss, grad_e, grad_c, *_ = torch.ops.cce_inductor.linear_cross_entropy_with_grads(
        e, c, t, None, None, IGNORE, "sum", 0.0, BALANCED.encode(), True, False, False, False
    )
    assert grad_c.numel() == 0 and not grad_e.requires_grad
    (ge,) = torch.autograd.grad(loss * 2.0, [e])
    assert torch.equal(ge, grad_e * 2.0)
    # c requires grad but its gradient was not computed: loud, never a silent None / zero
    loss, *_ = torch.ops.cce_inductor.linear_cross_entropy_with_grads(
        e, c.requires_grad_(), t, None, None, IGNORE, "sum", 0.0, BALANCED.encode(), True, False, False, False
    )
    with pytest.raises(RuntimeError, match="told not to compute"):
        torch.autograd.grad(loss, [c])


# ----------------------------------------------------------------------------------------------------------------
# torch.compile
# ----------------------------------------------------------------------------------------------------------------


def test_compile_fullgraph_dynamic_no_recompile():
    """fullgraph=True (no graph break), dynamic=True: two batch sizes, one compilation, eager numbers."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend("inductor")

    def loss_fn(h, w, b, y):
        return cce_inductor.linear_cross_entropy(h, w, y, bias=b, softcap=5.0, ignore_index=-1)

    compiled = torch.compile(loss_fn, fullgraph=True, dynamic=True, backend=counter)
    frames_after_first = None
    for seed, lead in enumerate([(2, 9), (3, 13)]):
        e, c, t, b = make_op_inputs(lead, 33, 16, torch.float32, bias=True, ignore_index=-1, seed=seed)
        got = run_fresh(lambda e_, c_, t_, bias: compiled(e_, c_, bias, t_), e, c, t, b)
        ref = run_fresh(eager_loss, e, c, t, b, softcap=5.0, ignore_index=-1)
        assert rel_err(got[0], ref[0]) <= 1e-5
        for x, y in zip(got[1:], ref[1:]):
            assert rel_err(x, y) <= 1e-5
        if frames_after_first is None:
            frames_after_first = counter.frame_count
    # The first call may invoke the backend twice: Dynamo restarts the analysis once to specialise the float
    # argument (softcap) it first traced symbolically; that is one frame, not a recompilation.
    assert counter.frame_count == frames_after_first, "recompiled for the second batch size"
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["graph_break"].values()) == 0
    # the compiled graph calls our op, not a decomposition
    assert any(
        node.target is torch.ops.cce_inductor.linear_cross_entropy.default for node in counter.graphs[-1].graph.nodes
    )
    torch._dynamo.reset()


# ----------------------------------------------------------------------------------------------------------------
# Entropy of the softmax (the op's third output)
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("softcap", [None, 4.0], ids=["nocap", "cap"])
@pytest.mark.parametrize("ignore", ["some", "all"])
def test_entropy_output_matches_eager(dtype, softcap, ignore):
    """Every row's entropy (ignored rows too) and the gradients of ``sum(g * loss) + sum(k * entropy)``, against
    eager computed in fp64 from the same inputs; the loss is unchanged by asking for the entropy."""
    e, c, t, b = make_op_inputs((23,), 31, 8, dtype, bias=True, ignore=ignore)
    leaves = [x.detach().clone().requires_grad_() for x in (e, c, b)]
    loss, lse, entropy, _ = ops.linear_cross_entropy_op(
        *leaves[:2], t, leaves[2], softcap, -100, "none", 0.0, OPTIONS, False, True
    )
    plain_loss, _, no_entropy, _ = ops.linear_cross_entropy_op(
        e, c, t, b, softcap, -100, "none", 0.0, OPTIONS, False, False
    )
    assert no_entropy.shape == (0,)
    torch.testing.assert_close(loss, plain_loss)
    gen = torch.Generator().manual_seed(1)  # not the global RNG: the result must not depend on the tests run before
    g, k = torch.randn(23, dtype=torch.float64, generator=gen), torch.randn(23, dtype=torch.float64, generator=gen)
    ((loss.double() * g).sum() + (entropy.double() * k).sum()).backward()

    ref = [x.detach().double().requires_grad_() for x in (e, c, b)]
    logits = F.linear(*ref)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    want_entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    want_loss = F.cross_entropy(logits, t, reduction="none")
    ((want_loss * g).sum() + (want_entropy * k).sum()).backward()
    tol = dict(rtol=grad_rtol(dtype), atol=grad_rtol(dtype))
    torch.testing.assert_close(entropy.double(), want_entropy.detach(), **tol)
    for got, want in zip(leaves, ref):
        torch.testing.assert_close(got.grad.double(), want.grad, **tol)


def test_entropy_of_an_empty_batch():
    e, c, t, _ = make_op_inputs((0,), 11, 4, torch.float32, ignore="none")
    e.requires_grad_()
    loss, _, entropy, _ = ops.linear_cross_entropy_op(e, c, t, None, None, -100, "none", 0.0, OPTIONS, False, True)
    assert loss.shape == entropy.shape == (0,)
    entropy.sum().backward()
    assert e.grad.shape == e.shape


@pytest.mark.parametrize("weights", ["bf16", "fp32 under autocast"])
def test_compiled_backward_scales_the_balanced_gradients_in_place(weights, no_inductor_caches):
    """The balanced op's saved gradients (a 16-bit pair, or fp32 sums) are donated buffers: Inductor's compiled
    backward writes the scaled, rounded gradient into the saved gradient's own buffer and allocates none of the
    gradients' size (the memory the balanced path is sized for). A partitioner that computes ``hi + lo`` in the
    forward (saving it in fp32) breaks this; the check reads the generated backward code."""
    from torch._inductor.utils import run_and_get_code

    n, d, v = 512, 64, 1000
    dtype = torch.bfloat16 if weights == "bf16" else torch.float32
    e = torch.randn(n, d, dtype=dtype, requires_grad=True)
    c = torch.randn(v, d, dtype=dtype, requires_grad=True)
    t = torch.randint(0, v, (n,))

    def loss_fn(e, c, t):
        return F.cross_entropy(F.linear(e, c).float(), t)

    compiled = torch.compile(loss_fn, backend=cce_inductor.make_backend(path="balanced", lazy_logits=False))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=weights != "bf16"):
            loss = compiled(e, c, t)
        loss.backward()

    cce_inductor.reset_stats()
    _, codes = run_and_get_code(step)
    assert cce_inductor.stats()["sites"][0]["path"] == "balanced"
    backward = codes[-1]
    for shape in ((n, d), (v, d)):
        assert f"empty_strided_cpu({shape}" not in backward, backward
    assert backward.count("# reuse") >= 2, backward
    assert e.grad.dtype == dtype and c.grad.dtype == dtype


# ----------------------------------------------------------------------------------------------------------------
# The balanced op falls back to the lean path where its buffers cannot be allocated (issue 64, item 3)
# ----------------------------------------------------------------------------------------------------------------


def _out_of_memory(*args, **kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("plain_sum", [False, True])
def test_balanced_op_runs_the_lean_path_where_its_buffers_cannot_be_allocated(dtype, plain_sum, monkeypatch):
    """Fault injection: the balanced path's launch raises ``torch.OutOfMemoryError``; the op computes the loss and
    gradients on the lean path (one G block, no scratch of logits) in its own output layout (a 16-bit pair's remainder
    0, none for a plain dC sum), equal to the balanced path's to rounding, and ``stats()`` counts the call."""
    e, c, t, b = make_balanced_inputs(23, 40, 8, dtype, bias=True)

    def run():
        return balanced_op.balanced_call(
            e, c, t, b, softcap=3.0, options=CCEOptions().encode(), need_e=True, need_c=True, need_bias=True,
            plain_sum=plain_sum,
        )()  # fmt: skip

    want = run()
    cce_inductor.reset_stats()
    monkeypatch.setattr(ops._dispatch, "loss_and_grads", _out_of_memory)
    got = run()
    assert cce_inductor.stats()["balanced_rows"]["lean_after_oom"] == 1
    assert "1 balanced calls ran the lean path" in cce_inductor.stats()["summary"]
    assert [x.shape for x in got] == [x.shape for x in want] and [x.dtype for x in got] == [x.dtype for x in want]
    assert got[0].item() == pytest.approx(want[0].item(), rel=1e-6)
    tol = 2.0**-7 if dtype == torch.bfloat16 else 1e-6
    for mine, theirs in zip(got[1:4], want[1:4]):
        assert rel_err(mine.float(), theirs.float()) <= tol
    for lo in got[4:]:
        assert not lo.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fallback", [False, True], ids=["balanced", "lean_after_oom"])
def test_balanced_op_computes_its_gradients_at_grad_scale(dtype, fallback, monkeypatch):
    """``grad_scale`` (the loss's scale after the cross-entropy, which the pass reads from the graph): the op's
    gradients are those of ``grad_scale * loss``, the loss itself unscaled, so that the backward at that upstream
    gradient returns them as they are (bit for bit: no rounding more), and at another its product by ``grad_loss /
    grad_scale``; a ``grad_scale`` of 0 or inf computes at 1. The same on the lean path the op falls back to."""
    e, c, t, b = make_balanced_inputs(23, 40, 8, dtype, bias=True)
    leaves = [x.detach().requires_grad_() for x in (e, c, b)]
    if fallback:
        monkeypatch.setattr(ops._dispatch, "loss_and_grads", _out_of_memory)

    def run(scale):
        return balanced_op.balanced_call(
            *leaves[:2], t, leaves[2], softcap=3.0, options=CCEOptions().encode(), need_e=True, need_c=True,
            need_bias=True, plain_sum=True, grad_scale=scale,
        )()  # fmt: skip

    scale = torch.tensor(0.7)
    at_one, at_scale = run(None), run(scale)
    assert torch.equal(at_scale[0], at_one[0])
    own = at_scale[1:4]  # (plain_sum: no remainders)
    assert not at_scale[4].numel() and not at_scale[5].numel()
    for got, want in zip(torch.autograd.grad(at_scale[0], leaves, scale, retain_graph=True), own):
        assert torch.equal(got, want.to(got.dtype))
    for got, want in zip(torch.autograd.grad(at_scale[0], leaves, 2 * scale, retain_graph=True), own):
        assert torch.equal(got, 2 * want.to(got.dtype))
    tol = 2.0**-7 if dtype == torch.bfloat16 else 1e-6
    for got, want in zip(torch.autograd.grad(at_scale[0], leaves, torch.tensor(0.3)), at_one[1:4]):
        assert rel_err(got.float(), 0.3 * want.float()) <= tol
    for degenerate in (torch.tensor(0.0), torch.tensor(float("inf"))):
        for got, want in zip(run(degenerate), at_one):
            assert torch.equal(got, want)


def test_balanced_op_falls_back_through_the_pass_and_raises_other_errors(monkeypatch, no_inductor_caches):
    """Compiled (the pass's balanced site): the fallback's loss and gradients are eager's; an error that is not an
    allocation failure is raised as it is."""
    torch.manual_seed(0)
    hidden = torch.randn(4, 6, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    labels = torch.randint(0, 50, (4, 6))

    def loss_fn(h, w, y):
        return F.cross_entropy(F.linear(h, w).float().view(-1, 50), y.view(-1))

    want = loss_fn(hidden, weight, labels)
    want_grads = torch.autograd.grad(want, [hidden, weight])
    monkeypatch.setattr(ops._dispatch, "loss_and_grads", _out_of_memory)
    cce_inductor.reset_stats()
    compiled = torch.compile(loss_fn, backend=cce_inductor.make_backend(BALANCED))
    loss = compiled(hidden, weight, labels)
    assert cce_inductor.stats()["balanced_rows"]["lean_after_oom"] >= 1
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(torch.autograd.grad(loss, [hidden, weight]), want_grads):
        assert rel_err(mine, theirs) < 1e-5

    def broken(*args, **kwargs):
        raise RuntimeError("an unrelated failure")

    monkeypatch.setattr(ops._dispatch, "loss_and_grads", broken)
    with pytest.raises(RuntimeError, match="an unrelated failure"):
        balanced_op.balanced_call(hidden.view(-1, 16), weight, labels.view(-1), options=CCEOptions().encode(),
                                  need_e=True, need_c=True, need_bias=False)()  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# The error budget's dE: with a plain dC sum, rounded once, no remainder (issue 62); otherwise the pair
# ----------------------------------------------------------------------------------------------------------------


def test_opcheck_bf16_de_remainder_only_without_a_plain_sum():
    """The fake impl and the op agree on dE's remainder: none with ``plain_sum`` (each row of dE is one chunk's sum,
    rounded once as torch.compile's product rounds it), the pair without (``exact``, or a loss scale the op cannot
    be given)."""
    e, c, t, _ = make_balanced_inputs(12, 40, 8, torch.bfloat16)
    options = CCEOptions(scratch_mb=1).encode()
    args = (e.requires_grad_(), c.requires_grad_(), t, None, None, IGNORE, "mean", 0.0, options, True, True, False)
    for plain_sum in (False, True):
        torch.library.opcheck(
            torch.ops.cce_inductor.linear_cross_entropy_with_grads.default, (*args, False, None, plain_sum)
        )
        torch.library.opcheck(
            torch.ops.cce_inductor.linear_cross_entropy_with_grads.default,
            (*args, False, None, plain_sum, torch.tensor(0.7)),
        )
        out = torch.ops.cce_inductor.linear_cross_entropy_with_grads(*args, False, None, plain_sum)
        assert out[4].shape == ((0,) if plain_sum else e.shape), plain_sum


def test_de_without_its_remainder_where_dc_is_a_pair_for_memory():
    """``de_pair=False`` (the site's dC a pair for memory, not for ``exact`` or a scale the op cannot be given): dE
    leaves without its remainder, the fake impl agrees, and dE is the pair's ``hi`` (both round the same sum once);
    dC stays the pair."""
    e, c, t, _ = make_balanced_inputs(12, 40, 8, torch.bfloat16)
    options = CCEOptions(scratch_mb=1).encode()
    args = (e.requires_grad_(), c.requires_grad_(), t, None, None, IGNORE, "mean", 0.0, options, True, True, False)
    op = torch.ops.cce_inductor.linear_cross_entropy_with_grads.default
    torch.library.opcheck(op, (*args, False, None, False, None, False))
    torch.library.opcheck(op, (*args, False, None, False, torch.tensor(0.7), False))
    rounded, pair = op(*args, False, None, False, None, False), op(*args, False, None, False)
    assert rounded[4].shape == (0,) and pair[4].shape == e.shape
    assert torch.equal(rounded[1], pair[1])
    assert torch.equal(rounded[2], pair[2]) and torch.equal(rounded[5], pair[5]) and rounded[5].shape == c.shape


@pytest.mark.parametrize("grad_loss", [0.7, 1e-3])
def test_balanced_de_error_within_its_budget_at_any_upstream_gradient(grad_loss):
    """bf16 dE against fp64 at an upstream gradient that is not a power of two: rounded once at that gradient (the
    plain route given it as ``grad_scale``, as the pass gives it) or as the pair (``g * (hi + lo)`` rounded once), no
    more than torch.compile's (eager bf16's) error (1.01x: another order of summation); rounded once at 1 and then
    scaled (the plain route without ``grad_scale``: a scale the pass cannot see) it is more."""
    torch.manual_seed(0)
    n, d, v = 512, 64, 4096
    e = (torch.randn(n, d) * 3 / d**0.5).bfloat16().requires_grad_()
    c = torch.randn(v, d).bfloat16().requires_grad_()
    t = torch.randint(0, v, (n,))
    e64 = e.detach().double().requires_grad_()
    (F.cross_entropy(F.linear(e64, c.detach().double()), t) * grad_loss).backward()
    (eager,) = torch.autograd.grad(F.cross_entropy(F.linear(e, c).float(), t) * grad_loss, [e])
    errors = {}
    scale = torch.tensor(grad_loss)
    for name, plain_sum, grad_scale in (("given", True, scale), ("pair", False, None), ("unseen", True, None)):
        call = balanced_op.balanced_call(
            e, c, t, options=BALANCED.encode(), need_e=True, need_c=True, need_bias=False, plain_sum=plain_sum,
            grad_scale=grad_scale,
        )  # fmt: skip
        (mine,) = torch.autograd.grad(call()[0] * grad_loss, [e])
        errors[name] = rel_err(mine.double(), e64.grad) / rel_err(eager.double(), e64.grad)
    assert errors["given"] <= 1.01 and errors["pair"] <= 1.01, errors
    assert errors["pair"] < errors["unseen"], errors
