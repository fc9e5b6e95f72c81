"""The balanced path's op, ``cce_inductor::linear_cross_entropy_with_grads``: a mean / sum loss whose head needs
gradients, computed with its own gradients (three matmuls), and the keyword helper every caller uses
(:func:`balanced_call`).

    loss, dE, dC, dbias = cross_entropy(softcap(e @ c.T + bias), targets, ...) and its gradients at upstream
                          gradient 1, in one pass over row chunks (``cce_inductor.kernels.loss_and_grads``)

Its autograd formula scales the gradients by the loss's upstream gradient in plain aten, which Inductor fuses into
the compiled backward and writes in place. Where the graph scales the loss after the cross-entropy (Hugging Face's
``sum / num_items_in_batch``), the pass passes that scale as ``grad_scale``: the gradients are computed at it (G
carries it before its one rounding) and the backward multiplies them by ``grad_loss / grad_scale``, 1 where the
graph's own gradient arrives, so a 16-bit gradient is not rounded a second time (the error budget of a plain 16-bit
sum holds at upstream gradient 1 only). The lean op and the conventions the two share (``compute_dtype``, the
options string, :class:`ops.OpCall`) are ``ops.py``'s.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _checks, _chunked, _dispatch, _loss, diagnostics, paths
from .ops import OpCall, _set
from .options import CCEOptions


@torch.library.custom_op("cce_inductor::linear_cross_entropy_with_grads", mutates_args=())
def linear_cross_entropy_with_grads_op(
    e: Tensor,
    c: Tensor,
    targets: Tensor,
    bias: Tensor | None,
    softcap: float | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    options: str,
    need_e: bool,
    need_c: bool,
    need_bias: bool,
    returned_logits: bool,
    compute_dtype: torch.dtype | None = None,
    plain_sum: bool = False,
    grad_scale: Tensor | None = None,
    de_pair: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns ``(loss, grad_e, grad_c, grad_bias, grad_e_lo, grad_c_lo)``: the loss (reduction "mean" or "sum") and its
    own gradients (upstream gradient 1), each in its input's dtype: an fp32 gradient whole, a 16-bit one as the pair
    ``(grad, grad_lo)`` whose sum carries ~16 mantissa bits (``kernels/_pair_sums.py``), but with ``plain_sum`` (the
    site's ``paths.BalancedPlan``) each alone: a 16-bit dC summed in its own dtype over at most two row chunks, a
    16-bit dE rounded once (each of its rows is one chunk's product, as torch.compile's); without ``de_pair`` (the
    site's plan: neither ``exact`` nor a scale the op cannot be given) dE alone also where dC is the pair; dbias in the
    accumulation dtype; what is not asked for (or an fp32 gradient's ``lo``) an empty tensor. The autograd formula
    rounds ``grad_loss * (grad + grad_lo)`` once to the input's dtype, in the gradient's own buffer where
    Inductor compiles it (a saved tensor only the backward reads is a donated buffer). On CUDA the balanced kernels
    (``kernels/_balanced.py``: row chunks of logits in a scratch of ``options.scratch_mb``, or planned here for the
    rows of the call, ``paths.balanced_plan``, with the site's ``plain_sum``); elsewhere the chunked path's forward and
    backward back to back. ``returned_logits``: the site's graph also returns the logits (``paths.HeadFacts``), which
    raises the memory target as it raised it when the pass planned this site. ``compute_dtype``, ``grad_scale`` (a
    0-dim tensor, the upstream gradient the graph is expected to pass to the loss; not differentiated): module
    docstring."""
    diagnostics.count_execution("linear_cross_entropy")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"linear_cross_entropy_with_grads computes reductions 'mean' and 'sum', got {reduction!r}")
    need_bias = need_bias and bias is not None
    with torch.autocast(e.device.type, enabled=False):
        _checks.check_inputs(e, c, targets, bias, compute_dtype)
        dtype = compute_dtype or e.dtype
        # the scratch for the rows this call really has (the site may have been compiled for another batch size)
        facts = _dispatch.head_facts(
            *e.shape,
            c.shape[0],
            dtype,
            e.device,
            reduction,
            needs_grad=True,
            returned_logits=returned_logits,
            softcapped=softcap is not None,
            **paths.storage_facts(e.dtype, c.dtype, dtype),
        )
        decoded = CCEOptions.decode(options)
        plan = paths.balanced_plan(facts, decoded.scratch_mb, plain_sum=plain_sum, de_pair=de_pair)
        e_pair = de_pair and not plan.plain_sum
        common = dict(
            softcap=softcap,
            ignore_index=ignore_index,
            reduction=reduction,
            label_smoothing=label_smoothing,
            need_e=need_e,
            need_c=need_c,
            need_bias=need_bias,
            compute_dtype=compute_dtype,
            grad_scale=None if grad_scale is None else expected_upstream(grad_scale, e.device),
        )
        try:
            result = _dispatch.loss_and_grads(
                e, c, targets, bias, chunk_rows=plan.chunk_rows, plain_sum=plan.plain_sum, de_pair=e_pair,
                products=decoded.products, **common,
            )  # fmt: skip
        except torch.OutOfMemoryError:
            result = None  # (the traceback holds the failed call's buffers: the fallback runs after it is gone)
        if result is None:  # the lean path's memory where the balanced path's buffers could not be allocated
            diagnostics.count_balanced_rows("lean_after_oom")
            result = _dispatch.lean_loss_and_grads(
                e, c, targets, bias, options=decoded, plain_sum=plan.plain_sum, de_pair=e_pair, **common
            )
        loss, grad_e, grad_c, grad_bias, grad_e_lo, grad_c_lo = result
    acc = _chunked.accumulation_dtype(dtype)

    def out(needed: bool, grad: Tensor | None, like: Tensor) -> Tensor:
        return grad if needed and grad is not None else like.new_empty(0)

    return (
        loss,
        out(need_e, grad_e, e),
        out(need_c, grad_c, c),
        out(need_bias, grad_bias, e).to(acc),
        out(need_e and de_pair and not plain_sum, grad_e_lo, e),
        out(need_c, grad_c_lo, c),
    )


@linear_cross_entropy_with_grads_op.register_fake
def _(
    e, c, targets, bias, softcap, ignore_index, reduction, label_smoothing, options, need_e, need_c, need_bias,
    returned_logits, compute_dtype=None, plain_sum=False, grad_scale=None, de_pair=True,
):  # fmt: skip
    _checks.check_inputs(e, c, targets, bias, compute_dtype)
    acc = _chunked.accumulation_dtype(compute_dtype or e.dtype)
    grad_e, grad_c, grad_bias = _loss.grad_outputs_fake(e, c, bias, need_e, need_c, need_bias)
    return (
        e.new_empty((), dtype=acc),
        grad_e,
        grad_c,
        grad_bias.to(acc),
        torch.empty_like(grad_e) if _pair(need_e, e) and de_pair and not plain_sum else e.new_empty(0),
        torch.empty_like(grad_c) if _pair(need_c, c) and not plain_sum else c.new_empty(0),
    )


def _pair(needed: bool, x: Tensor) -> bool:
    """Whether a gradient of ``x`` leaves the balanced op as a 16-bit pair (``grad, grad_lo``)."""
    return needed and x.dtype in (torch.bfloat16, torch.float16)


def balanced_call(
    e,
    c,
    targets,
    bias=None,
    *,
    softcap: float | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    options: str,
    need_e: bool,
    need_c: bool,
    need_bias: bool,
    returned_logits: bool = False,
    compute_dtype: torch.dtype | None = None,
    plain_sum: bool = False,
    grad_scale=None,
    de_pair: bool = True,
) -> OpCall:
    """A call of ``linear_cross_entropy_with_grads`` (its docstring has the arguments)."""
    return OpCall(
        torch.ops.cce_inductor.linear_cross_entropy_with_grads.default,
        (
            e,
            c,
            targets,
            bias,
            softcap,
            ignore_index,
            reduction,
            label_smoothing,
            options,
            need_e,
            need_c,
            need_bias,
            returned_logits,
        ),
        # de_pair only where dC is the pair, and only when False (its default, the exact pair, otherwise)
        _set(compute_dtype=compute_dtype, plain_sum=plain_sum, grad_scale=grad_scale)
        | ({} if plain_sum or de_pair else {"de_pair": False}),
    )


def expected_upstream(grad_scale: Tensor, device: torch.device) -> Tensor:
    """``grad_scale`` as the gradients are computed at it: fp32 on ``device``; 1 where it is 0 or not finite (a
    gradient computed at 0 could not be scaled back; eager's own inf / NaN then come from the backward's product)."""
    scale = grad_scale.detach().to(device=device, dtype=torch.float32)
    return torch.where(torch.isfinite(scale) & (scale != 0), scale, 1.0)


def _setup_context_with_grads(ctx, inputs, output) -> None:
    e, c, _, bias = inputs[:4]
    _, grad_e, grad_c, grad_bias, grad_e_lo, grad_c_lo = output
    ctx.mark_non_differentiable(grad_e, grad_c, grad_bias, grad_e_lo, grad_c_lo)
    # no zero tensors for the gradient outputs' (absent) upstream gradients: dC's would be a V x D fill
    ctx.set_materialize_grads(False)
    grad_scale = inputs[_GRAD_SCALE]
    ctx.save_for_backward(grad_e, grad_c, grad_bias, grad_e_lo, grad_c_lo, grad_scale)
    ctx.computed = inputs[9:12]  # need_e, need_c, need_bias: which of them hold a gradient
    ctx.dtypes = (e.dtype, c.dtype, None if bias is None else bias.dtype)


def _scaled(grad: Tensor, lo: Tensor | None, grad_loss: Tensor, dtype: torch.dtype) -> Tensor:
    """``grad_loss * (grad + lo)`` rounded once to ``dtype`` (``lo`` None: ``grad`` alone). Compiled, Inductor fuses
    it into one pass and writes it into ``grad``'s buffer (same dtype and size, a donated saved tensor). Each term is
    scaled before the sum (fp32 products, one rounding of the result as before) so that nothing of it can be computed
    in the forward graph: the partitioner would otherwise save ``grad + lo`` in fp32 there, and the 16-bit result
    would need a buffer of its own."""
    if lo is None:
        return (grad * grad_loss).to(dtype)
    return (grad.float() * grad_loss + lo.float() * grad_loss).to(dtype)


# grad_scale's position among the op's inputs
_GRAD_SCALE = 15


def _backward_with_grads(ctx, grad_loss, *_):
    """Each gradient scaled by the loss's upstream gradient (over ``grad_scale``, where given) and rounded once
    (:func:`_scaled`)."""
    if grad_loss is None:  # (grads are not materialised) nothing flows back into the loss
        return (None,) * len(ctx.needs_input_grad)
    grad_e, grad_c, grad_bias, grad_e_lo, grad_c_lo, grad_scale = ctx.saved_tensors
    if grad_scale is not None:  # the gradients were computed at grad_scale (module docstring)
        grad_loss = grad_loss / expected_upstream(grad_scale, grad_loss.device)
    grads = []
    for needed, computed, grad, lo, dtype in zip(
        (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[3]),
        ctx.computed,
        (grad_e, grad_c, grad_bias),
        (grad_e_lo, grad_c_lo, None),
        ctx.dtypes,
    ):
        if needed and not computed:
            raise RuntimeError(
                "cce_inductor: a gradient is needed that the balanced path was told not to compute "
                "(linear_cross_entropy_with_grads was called with need_*=False for an input that requires grad)"
            )
        has_lo = lo is not None and lo.numel() == grad.numel()
        grads.append(_scaled(grad, lo if has_lo else None, grad_loss, dtype) if needed else None)
    grad_e, grad_c, grad_bias = grads
    return (grad_e, grad_c, None, grad_bias) + (None,) * (len(ctx.needs_input_grad) - 4)


linear_cross_entropy_with_grads_op.register_autograd(_backward_with_grads, setup_context=_setup_context_with_grads)
