"""Tests of the fused op ``torch.ops.cce_inductor.linear_cross_entropy`` and of ``cce_inductor.linear_cross_entropy``
against eager PyTorch (``F.linear`` + optional softcap ``tanh(x / c) * c`` + ``F.cross_entropy``).

CPU only: everything here runs the chunked PyTorch path (``cce_inductor._chunked``).

Tolerances. The op accumulates in float32 (float64 for float64 inputs) and computes the logits from the inputs
as given, so for every input dtype the loss is compared with an fp64 reference computed *from the same rounded
inputs* at fp32 precision. Gradients come back in the input dtype, so they are compared at a few units of that
dtype's rounding error (relative L2 norm). Against eager PyTorch run in the input dtype (which rounds its logits
and its log-sum-exp to bf16/fp16) the op must be at least as accurate as eager.

Tests with a ``Regression`` comment reproduce bugs found while writing this file (fixed in the package since).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import cce_inductor
from cce_inductor import CCEOptions, _checks, _chunked, ops

from tests.support.compare import rel_l2 as rel_err

lce = cce_inductor.linear_cross_entropy
OPTIONS = CCEOptions().encode()  # the op's options argument, as the pass and the public wrapper pass it

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
# Unit roundoff of each dtype: a correctly rounded result has relative error <= this.
UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.bfloat16: 2.0**-9, torch.float16: 2.0**-12}
# The loss is accumulated in fp32 (fp64 for fp64 inputs).
LOSS_RTOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-5, torch.float16: 1e-5}


def grad_rtol(dtype: torch.dtype) -> float:
    """Relative L2 error allowed for a gradient returned in ``dtype``: fp32 accumulation, then one rounding."""
    return max(4 * UNIT_ROUNDOFF[dtype], 1e-5) if dtype != torch.float64 else 1e-10


# ----------------------------------------------------------------------------------------------------------------
# Inputs and the eager reference
# ----------------------------------------------------------------------------------------------------------------


def make_inputs(lead, vocab, dim, dtype, *, bias=False, ignore="some", ignore_index=-100, seed=0):
    """Hidden states ``(*lead, dim)``, weight ``(vocab, dim)``, targets ``lead``, optional bias, in ``dtype``.

    Logits have a spread of a few units (some rows confident), so softmax is neither uniform nor one-hot.
    """
    gen = torch.Generator().manual_seed(seed)
    n = math.prod(lead)
    c = torch.randn(vocab, dim, generator=gen) / math.sqrt(dim)
    e = torch.randn(n, dim, generator=gen) * 2.0
    targets = torch.randint(0, vocab, (n,), generator=gen)
    if ignore_index in range(vocab):  # keep the ignored class out of the "real" targets
        targets = torch.where(targets == ignore_index, (ignore_index + 1) % vocab, targets)
    confident = torch.rand(n, generator=gen) < 0.4
    e[confident] += 3.0 * math.sqrt(dim) * c[targets[confident]]
    if ignore == "some":
        ignored = torch.rand(n, generator=gen) < 0.3
        if n >= 2:
            ignored[0], ignored[1] = True, False
        targets[ignored] = ignore_index
    elif ignore == "all":
        targets[:] = ignore_index
    else:
        assert ignore == "none"
    b = (torch.randn(vocab, generator=gen) * 0.5).to(dtype) if bias else None
    return e.reshape(*lead, dim).to(dtype), c.to(dtype), targets.reshape(lead), b


def eager_loss(e, c, targets, bias=None, softcap=None, ignore_index=-100, reduction="mean", label_smoothing=0.0):
    logits = F.linear(e, c, bias)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long(), ignore_index=ignore_index, reduction=reduction,
        label_smoothing=label_smoothing,
    )
    return loss.view(targets.shape) if reduction == "none" else loss


def run(fn, e, c, targets, bias, *, grad_out=None, dtype=None, **kwargs):
    """``fn`` on fresh leaves (cast to ``dtype`` if given); returns loss and grads (e, c, bias)."""
    leaves = [t.detach().clone() if dtype is None else t.detach().to(dtype) for t in (e, c)]
    b = None if bias is None else (bias.detach().clone() if dtype is None else bias.detach().to(dtype))
    for t in leaves + ([b] if b is not None else []):
        t.requires_grad_(True)
    loss = fn(leaves[0], leaves[1], targets, bias=b, **kwargs)
    if grad_out is None:
        grad_out = torch.ones_like(loss)
    loss.backward(grad_out.to(loss.dtype))
    return loss.detach(), leaves[0].grad, leaves[1].grad, None if b is None else b.grad


def grad_output_for(loss_shape, reduction, seed=1):
    gen = torch.Generator().manual_seed(seed)
    if reduction == "none":
        return torch.rand(loss_shape, generator=gen, dtype=torch.float64) + 0.5
    return torch.tensor(0.7, dtype=torch.float64)


def check_against_eager(lead, vocab, dim, dtype, *, bias, softcap, reduction, ignore="some", ignore_index=-100,
                        seed=0, transform=None, label_smoothing=0.0):
    e, c, t, b = make_inputs(lead, vocab, dim, dtype, bias=bias, ignore=ignore, ignore_index=ignore_index, seed=seed)
    if transform is not None:
        e, c, t, b = transform(e, c, t, b)
    kw = dict(softcap=softcap, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)
    g = grad_output_for(t.shape, reduction)
    # fp64 reference from the same (already rounded) inputs
    ref = run(eager_loss, e, c, t, b, grad_out=g, dtype=torch.float64, **kw)
    out = run(lce, e, c, t, b, grad_out=g, **kw)

    loss, ref_loss = out[0], ref[0]
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert loss.shape == ref_loss.shape
    if ignore == "all" and reduction == "mean":
        assert torch.isnan(loss) and torch.isnan(ref_loss)
    else:
        assert rel_err(loss, ref_loss) <= LOSS_RTOL[dtype], (loss, ref_loss)
    names = ("e", "c", "bias")
    for name, grad, ref_grad, leaf in zip(names, out[1:], ref[1:], (e, c, b)):
        if leaf is None:
            assert grad is None and ref_grad is None
            continue
        assert grad is not None, f"no gradient for {name}"
        assert grad.dtype == leaf.dtype and grad.shape == leaf.shape, (name, grad.dtype, grad.shape)
        assert rel_err(grad, ref_grad) <= grad_rtol(dtype), (name, rel_err(grad, ref_grad))

    if dtype in (torch.bfloat16, torch.float16):
        # Eager in the input dtype: the op must be at least as close to fp64 as eager is (eager rounds the logits).
        eag = run(eager_loss, e, c, t, b, grad_out=g, **kw)
        if not (ignore == "all" and reduction == "mean"):
            assert rel_err(loss, ref_loss) <= rel_err(eag[0], ref_loss) + LOSS_RTOL[dtype]
        for grad, eag_grad, ref_grad in zip(out[1:], eag[1:], ref[1:]):
            if grad is not None:
                assert rel_err(grad, ref_grad) <= rel_err(eag_grad, ref_grad) + UNIT_ROUNDOFF[dtype]
    if dtype == torch.float32:
        eag = run(eager_loss, e, c, t, b, grad_out=g, **kw)
        if not (ignore == "all" and reduction == "mean"):
            # norm-wise: a confident row's loss (~1e-7) is below the fp32 rounding of its log-sum-exp
            assert rel_err(loss, eag[0]) <= 1e-5
        for grad, eag_grad in zip(out[1:], eag[1:]):
            if grad is not None:
                assert rel_err(grad, eag_grad) <= 1e-5
    return out


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
    check_against_eager((5, 7), 53, 24, dtype, bias=True, softcap=4.0, reduction=reduction, ignore=ignore,
                        ignore_index=2, label_smoothing=label_smoothing)


@pytest.mark.parametrize("label_smoothing", [-0.1, 1.5])
def test_label_smoothing_out_of_range_is_value_error(label_smoothing):
    e, c, t, _ = make_inputs((6,), 10, 4, torch.float32)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\]"):
        lce(e, c, t, label_smoothing=label_smoothing)


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
    e, c, t, _ = make_inputs((16,), 23, 8, torch.float64, ignore="some")
    assert t[0] == -100
    e2 = e.clone()
    e2[0] += 10.0
    a, b_ = run(lce, e, c, t, None, reduction=reduction), run(lce, e2, c, t, None, reduction=reduction)
    torch.testing.assert_close(a[0], b_[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(a[2], b_[2], rtol=0, atol=1e-12)
    assert torch.equal(a[1][0], torch.zeros_like(a[1][0]))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty_batch(dtype, reduction):
    """N = 0 behaves as eager: NaN mean, 0 sum, empty none; zero gradients of the right shapes."""
    e, c, t, b = make_inputs((0,), 11, 5, dtype, bias=True, ignore="none")
    out = run(lce, e, c, t, b, reduction=reduction)
    ref = run(eager_loss, e, c, t, b, reduction=reduction)
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
        (4, 9), 29, 8, torch.float32, bias=True, softcap=None, reduction="mean",
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
        check_against_eager(
            (21,), 27, 12, dtype, bias=True, softcap=2.5, reduction=reduction, transform=transform
        )


def test_reduction_none_with_expanded_grad_output():
    """``loss.sum().backward()`` hands the op a stride-0 (expanded) gradient."""
    e, c, t, b = make_inputs((3, 5), 19, 8, torch.float64, bias=True)

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
        (17,), 29, 8, dtype, bias=False, softcap=None, reduction="mean",
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
    e, c, t, b = make_inputs((13,), 19, 8, torch.float32, bias=with_bias)
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
    e, c, t, _ = make_inputs((13,), 19, 8, torch.float32)
    c.requires_grad_(True)
    recorder = RecordBackward(monkeypatch)
    lce(e, c, t).backward()
    assert recorder.calls[0]["need_e"] is False and recorder.calls[0]["need_c"] is True
    c_ref = c.detach().clone().requires_grad_(True)
    eager_loss(e, c_ref, t).backward()
    torch.testing.assert_close(c.grad, c_ref.grad, rtol=1e-5, atol=1e-6)


def test_backward_op_gradients_not_needed_are_empty_and_distinct():
    # Regression (see test_frozen_weight_without_bias): the op itself, called with need_c=False and no bias.
    e, c, t, _ = make_inputs((6,), 10, 4, torch.float64, ignore="none")
    lse = torch.logsumexp(e @ c.T, dim=1)
    for need_e, need_c, need_bias in [(True, False, False), (False, True, False), (False, False, False)]:
        grads = ops.linear_cross_entropy_backward_op(
            torch.tensor(1.0, dtype=torch.float64), e, c, t, None, lse, None, None, None, None, -100, "mean", 0.0,
            OPTIONS, need_e, need_c, need_bias,
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
    e, c, t, _ = make_inputs((5,), 7, 3, torch.float64, ignore="none")
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
    e, c, t, b = make_inputs((4, 16), 257, 32, torch.float32, bias=bias)
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
    ref64 = eager_loss(*(x.detach().bfloat16().double() for x in (e, c)), t, None if b is None else b.bfloat16().double())
    assert rel_err(loss, ref64) <= tol


def test_autocast_does_not_change_the_op_precision():
    # Regression: the op's implementation ran with CPU autocast still on, so the matmuls inside
    # `_chunked.forward/backward` meant to run in the float32 accumulation dtype were silently downcast to bf16.
    # The same bf16 inputs gave a loss ~1e-2 (max abs, V=4096) less accurate inside `torch.autocast` than
    # outside it. Fixed by running both op implementations under `torch.autocast(..., enabled=False)`.
    e, c, t, _ = make_inputs((64,), 4096, 64, torch.bfloat16, ignore="none")
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
    ref = run(eager_loss, e, c, t, None, dtype=torch.float64)
    assert rel_err(e.grad, ref[1]) <= grad_rtol(torch.bfloat16)
    assert rel_err(c.grad, ref[2]) <= grad_rtol(torch.bfloat16)


# ----------------------------------------------------------------------------------------------------------------
# opcheck
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("softcap", [None, 3.0], ids=["nocap", "cap"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_opcheck_forward(reduction, softcap, bias):
    e, c, t, b = make_inputs((6,), 10, 4, torch.float64, bias=bias)
    args = (e.requires_grad_(), c.requires_grad_(), t, None if b is None else b.requires_grad_(),
            softcap, -100, reduction, 0.0, OPTIONS, reduction == "mean", reduction != "sum")
    torch.library.opcheck(ops.linear_cross_entropy_op, args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck_forward_low_precision(dtype):
    e, c, t, b = make_inputs((5,), 9, 4, dtype, bias=True)
    args = (e.requires_grad_(), c.requires_grad_(), t, b, None, -100, "mean", 0.1, OPTIONS, True, True)
    torch.library.opcheck(ops.linear_cross_entropy_op, args)


@pytest.mark.parametrize(
    "needs", [(True, True, True), (True, True, False), (False, True, True), (True, False, True)],
    ids=["all", "no_bias", "no_e", "no_c"],
)
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_opcheck_backward(needs, reduction):
    e, c, t, b = make_inputs((6,), 10, 4, torch.float64, bias=True)
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
    e, c, t, _ = make_inputs((6,), 10, 4, torch.float64)
    lse = torch.logsumexp(F.linear(e, c), dim=1)
    args = (torch.tensor(0.5, dtype=torch.float64), e, c, t, None, lse, None, None, None, None, -100, "mean", 0.0,
            OPTIONS, True, False, False)
    torch.library.opcheck(ops.linear_cross_entropy_backward_op, args)


# ----------------------------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------------------------


def _small():
    e, c, t, b = make_inputs((6,), 10, 4, torch.float32, bias=True, ignore="none")
    return e, c, t, b


@pytest.mark.parametrize("bad", [10, 11, -1, -101])
def test_target_out_of_range_is_index_error(bad):
    e, c, t, _ = _small()
    t = t.clone()
    t[3] = bad
    with pytest.raises(IndexError, match="out of bounds"):
        eager_loss(e, c, t)
    with pytest.raises(IndexError, match=f"Target {bad} is out of bounds"):
        lce(e, c, t)


def test_target_equal_to_ignore_index_is_fine_even_out_of_vocab():
    e, c, t, _ = _small()
    t = t.clone()
    t[2] = 1000
    torch.testing.assert_close(lce(e, c, t, ignore_index=1000), eager_loss(e, c, t, ignore_index=1000))


@pytest.mark.parametrize(
    "case, exc, match",
    [
        ("c_3d", ValueError, r"c of shape \(V, D\)"),
        ("targets_shape", ValueError, r"targets must have shape \(6,\)"),
        ("targets_2d", ValueError, r"targets must have shape"),
        ("e_0d", ValueError, r"e of shape"),
        ("c_dtype", TypeError, r"c has dtype torch.float64 but e has torch.float32"),
        ("bias_dtype", TypeError, r"bias has dtype torch.float16"),
        ("bias_2d", ValueError, r"bias of shape \(V,\)"),
        ("int_inputs", TypeError, r"unsupported dtype"),
        ("reduction", ValueError, r"reduction must be one of"),
        ("softcap_zero", ValueError, r"softcap must be positive"),
        ("softcap_negative", ValueError, r"softcap must be positive"),
        ("options", TypeError, r"options must be a cce_inductor.CCEOptions"),
        ("retired_option", TypeError, r"unexpected keyword argument 'filter_eps'"),
    ],
)
def test_bad_input_errors(case, exc, match):
    e, c, t, b = _small()
    call = {
        "c_3d": lambda: lce(e, c[None], t),
        "targets_shape": lambda: lce(e, c, t[:-1]),
        "targets_2d": lambda: lce(e, c, t[:, None]),
        "e_0d": lambda: lce(e[0, 0], c, t),
        "c_dtype": lambda: lce(e, c.double(), t),
        "bias_dtype": lambda: lce(e, c, t, bias=b.half()),
        "bias_2d": lambda: lce(e, c, t, bias=b[None]),
        "int_inputs": lambda: lce(e.long(), c.long(), t),
        "reduction": lambda: lce(e, c, t, reduction="avg"),
        "softcap_zero": lambda: lce(e, c, t, softcap=0.0),
        "softcap_negative": lambda: lce(e, c, t, softcap=-2.0),
        "options": lambda: lce(e, c, t, options={"exact": True}),
        "retired_option": lambda: lce(e, c, t, filter_eps=1.5),
    }[case]
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool], ids=str)
def test_non_integer_targets_are_rejected(dtype):
    # Regression: the public wrapper called `targets.reshape(-1).long()` before the op's dtype check, so float /
    # bool targets were silently truncated to class indices (2.7 -> 2, True -> 1) and a wrong loss returned
    # (eager F.cross_entropy reads float targets as probabilities).
    e, c, t, _ = _small()
    with pytest.raises(TypeError, match="targets must hold class indices"):
        lce(e, c, t.to(dtype))


@pytest.mark.parametrize(
    "case, match",
    [("hidden_size", r"hidden size mismatch"), ("bias_len", r"bias has 11 entries")],
)
def test_shape_mismatch_is_value_error(case, match):
    # Regression (consistency): a hidden-size mismatch or a bias of the wrong length raised RuntimeError (from
    # `torch._check`) while every other bad shape raises ValueError; now `torch._check_value`.
    e, c, t, b = _small()
    call = {"hidden_size": lambda: lce(e, torch.randn(10, 5), t),
            "bias_len": lambda: lce(e, c, t, bias=torch.randn(11))}[case]
    with pytest.raises(ValueError, match=match):
        call()


def test_device_mismatch_is_value_error():
    e, c, t, _ = _small()
    with pytest.raises(ValueError, match="targets is on meta"):
        _checks.check_inputs(e, c, t.to("meta"), None)


# ----------------------------------------------------------------------------------------------------------------
# The chunked path
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("row_chunk, vocab_chunk", [(1, 1), (3, 5), (7, 64), (64, 2)])
@pytest.mark.parametrize("softcap", [None, 3.0], ids=["nocap", "cap"])
def test_chunked_matches_unchunked(row_chunk, vocab_chunk, softcap):
    """_chunked.forward/backward with tiny chunks equal the single-block result (fp64)."""
    e, c, t, b = make_inputs((23,), 37, 6, torch.float64, bias=True)
    big = dict(row_chunk=10**6, vocab_chunk=10**6)
    small = dict(row_chunk=row_chunk, vocab_chunk=vocab_chunk)
    lse_ref, tl_ref, sum_ref, _ = _chunked.forward(e, c, t, b, softcap=softcap, ignore_index=-100, logit_sum=True, **big)
    lse, tl, logit_sum, _ = _chunked.forward(e, c, t, b, softcap=softcap, ignore_index=-100, logit_sum=True, **small)
    valid = t != -100
    torch.testing.assert_close(lse, lse_ref, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(tl[valid], tl_ref[valid], rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(logit_sum, sum_ref, rtol=1e-12, atol=1e-12)
    # and the single block is right
    logits = F.linear(e, c, b)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    torch.testing.assert_close(lse_ref, torch.logsumexp(logits, 1), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(sum_ref, logits.sum(1), rtol=1e-12, atol=1e-12)

    grad_rows = torch.where(valid, torch.rand(23, dtype=torch.float64), 0.0)
    grad_lse = torch.rand(23, dtype=torch.float64)  # a z-loss's, also at ignored rows
    kw = dict(softcap=softcap, need_e=True, need_c=True, need_bias=True, label_smoothing=0.1, grad_lse=grad_lse)
    ref = _chunked.backward(e, c, t, b, lse_ref, grad_rows, **kw, **big)
    got = _chunked.backward(e, c, t, b, lse, grad_rows, **kw, **small)
    for x, y in zip(got, ref):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-13)


@pytest.fixture
def tiny_chunks(monkeypatch):
    """Make the op use tiny chunks. ops.py calls _chunked.forward/backward without chunk arguments, so the
    chunk sizes are the keyword-only defaults bound at def time (patching ROW_CHUNK/VOCAB_CHUNK does nothing)."""
    sizes = {"row_chunk": 4, "vocab_chunk": 8}
    for fn in (_chunked.forward, _chunked.backward):
        for name, value in sizes.items():
            monkeypatch.setitem(fn.__kwdefaults__, name, value)
    return sizes


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_op_with_tiny_chunks_matches_eager(tiny_chunks, reduction, dtype):
    check_against_eager((3, 11), 45, 8, dtype, bias=True, softcap=4.0, reduction=reduction)


class MaxNumel(TorchDispatchMode):
    """Records the largest tensor any ATen op creates (runs the cce_inductor ops' Python impls under the mode)."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0
        self.max_op = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name.startswith("cce_inductor::"):
            opdef = {
                "cce_inductor::linear_cross_entropy": ops.linear_cross_entropy_op,
                "cce_inductor::linear_cross_entropy_backward": ops.linear_cross_entropy_backward_op,
            }[name]
            with self:
                return opdef._init_fn(*args, **kwargs)
        out = func(*args, **kwargs)
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() > self.max_numel:
                self.max_numel, self.max_op = t.numel(), func
        return out


def test_memory_detector_sees_eager_logits():
    e, c, t, _ = make_inputs((64,), 256, 8, torch.float32)
    with MaxNumel() as mode:
        eager_loss(e.requires_grad_(), c, t).backward()
    assert mode.max_numel >= 64 * 256


@pytest.mark.parametrize("softcap", [None, 3.0], ids=["nocap", "cap"])
def test_chunked_path_never_allocates_n_by_v(tiny_chunks, softcap):
    n, vocab, dim = 64, 256, 8
    e, c, t, b = make_inputs((n,), vocab, dim, torch.float32, bias=True)
    for x in (e, c, b):
        x.requires_grad_(True)
    with MaxNumel() as mode:
        loss = lce(e, c, t, bias=b, softcap=softcap)
        loss.backward()
    assert mode.max_numel < n * vocab, (mode.max_numel, mode.max_op)
    assert mode.max_numel <= max(tiny_chunks["row_chunk"] * tiny_chunks["vocab_chunk"], n * dim, vocab * dim)
    ref = run(eager_loss, e, c, t, b, softcap=softcap)
    torch.testing.assert_close(loss.detach(), ref[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(c.grad, ref[2], rtol=1e-4, atol=1e-6)


def test_default_chunks_never_allocate_n_by_v():
    """The real chunk sizes (ROW_CHUNK x VOCAB_CHUNK) at a shape where N x V is 4x one block."""
    n, vocab, dim = 2 * _chunked.ROW_CHUNK, 2 * _chunked.VOCAB_CHUNK, 4
    gen = torch.Generator().manual_seed(0)
    e = torch.randn(n, dim, generator=gen, requires_grad=True)
    c = torch.randn(vocab, dim, generator=gen, requires_grad=True)
    t = torch.randint(0, vocab, (n,), generator=gen)
    with MaxNumel() as mode:
        lce(e, c, t).backward()
    assert mode.max_numel <= _chunked.ROW_CHUNK * _chunked.VOCAB_CHUNK < n * vocab


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
        e, c, t, b = make_inputs(lead, 33, 16, torch.float32, bias=True, ignore_index=-1, seed=seed)
        got = run(lambda e_, c_, t_, bias: compiled(e_, c_, bias, t_), e, c, t, b)
        ref = run(eager_loss, e, c, t, b, softcap=5.0, ignore_index=-1)
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
        node.target is torch.ops.cce_inductor.linear_cross_entropy.default
        for node in counter.graphs[-1].graph.nodes
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
    e, c, t, b = make_inputs((23,), 31, 8, dtype, bias=True, ignore=ignore)
    leaves = [x.detach().clone().requires_grad_() for x in (e, c, b)]
    loss, lse, entropy = ops.linear_cross_entropy_op(*leaves[:2], t, leaves[2], softcap, -100, "none", 0.0, OPTIONS,
                                                     False, True)  # fmt: skip
    plain_loss, _, no_entropy = ops.linear_cross_entropy_op(e, c, t, b, softcap, -100, "none", 0.0, OPTIONS, False,
                                                            False)  # fmt: skip
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
    e, c, t, _ = make_inputs((0,), 11, 4, torch.float32, ignore="none")
    e.requires_grad_()
    loss, _, entropy = ops.linear_cross_entropy_op(e, c, t, None, None, -100, "none", 0.0, OPTIONS, False, True)
    assert loss.shape == entropy.shape == (0,)
    entropy.sum().backward()
    assert e.grad.shape == e.shape
