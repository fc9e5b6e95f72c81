"""The op against eager PyTorch (``F.linear`` + optional softcap ``tanh(x / c) * c`` + ``F.cross_entropy``), and the
tolerances it is held to.

Tolerances. The op accumulates in float32 (float64 for float64 inputs) and computes the logits from the inputs
as given, so for every input dtype the loss is compared with an fp64 reference computed *from the same rounded
inputs* at fp32 precision. Gradients come back in the input dtype, so they are compared at a few units of that
dtype's rounding error (relative L2 norm). Against eager PyTorch run in the input dtype (which rounds its logits
and its log-sum-exp to bf16/fp16) the op must be at least as accurate as eager.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import cce_inductor

from .compare import rel_l2 as rel_err
from .inputs import make_op_inputs

lce = cce_inductor.linear_cross_entropy

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
# Unit roundoff of each dtype: a correctly rounded result has relative error <= this.
UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.bfloat16: 2.0**-9, torch.float16: 2.0**-12}
# The loss is accumulated in fp32 (fp64 for fp64 inputs).
LOSS_RTOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-5, torch.float16: 1e-5}


def grad_rtol(dtype: torch.dtype) -> float:
    """Relative L2 error allowed for a gradient returned in ``dtype``: fp32 accumulation, then one rounding."""
    return max(4 * UNIT_ROUNDOFF[dtype], 1e-5) if dtype != torch.float64 else 1e-10


def eager_loss(e, c, targets, bias=None, softcap=None, ignore_index=-100, reduction="mean", label_smoothing=0.0):
    """Eager reference (targets taken as int64; ``reduction="none"`` in the targets' shape)."""
    logits = F.linear(e, c, bias)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        targets.reshape(-1).long(),
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
    )
    return loss.view(targets.shape) if reduction == "none" else loss


def run_fresh(fn, e, c, targets, bias, *, grad_out=None, dtype=None, **kwargs):
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


def check_against_eager(
    lead,
    vocab,
    dim,
    dtype,
    *,
    bias,
    softcap,
    reduction,
    ignore="some",
    ignore_index=-100,
    seed=0,
    transform=None,
    label_smoothing=0.0,
):
    """The op on ``make_op_inputs(...)`` (``transform``ed) against eager in fp64 from the same rounded inputs, and in
    16-bit at least as accurate as eager in that dtype; returns the op's (loss, dE, dC, dbias)."""
    e, c, t, b = make_op_inputs(lead, vocab, dim, dtype, bias=bias, ignore=ignore, ignore_index=ignore_index, seed=seed)
    if transform is not None:
        e, c, t, b = transform(e, c, t, b)
    kw = dict(softcap=softcap, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)
    g = grad_output_for(t.shape, reduction)
    # fp64 reference from the same (already rounded) inputs
    ref = run_fresh(eager_loss, e, c, t, b, grad_out=g, dtype=torch.float64, **kw)
    out = run_fresh(lce, e, c, t, b, grad_out=g, **kw)

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
        eag = run_fresh(eager_loss, e, c, t, b, grad_out=g, **kw)
        if not (ignore == "all" and reduction == "mean"):
            assert rel_err(loss, ref_loss) <= rel_err(eag[0], ref_loss) + LOSS_RTOL[dtype]
        for grad, eag_grad, ref_grad in zip(out[1:], eag[1:], ref[1:]):
            if grad is not None:
                assert rel_err(grad, ref_grad) <= rel_err(eag_grad, ref_grad) + UNIT_ROUNDOFF[dtype]
    if dtype == torch.float32:
        eag = run_fresh(eager_loss, e, c, t, b, grad_out=g, **kw)
        if not (ignore == "all" and reduction == "mean"):
            # norm-wise: a confident row's loss (~1e-7) is below the fp32 rounding of its log-sum-exp
            assert rel_err(loss, eag[0]) <= 1e-5
        for grad, eag_grad in zip(out[1:], eag[1:]):
            if grad is not None:
                assert rel_err(grad, eag_grad) <= 1e-5
    return out
