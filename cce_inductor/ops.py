"""The fused linear-cross-entropy ops, and one keyword-argument helper per op that every caller uses.

    loss = cross_entropy(softcap(e @ c.T + bias), targets, ignore_index=..., reduction=..., label_smoothing=...)
    lse = logsumexp(logits, -1),   entropy = -(softmax(logits) * log_softmax(logits)).sum(-1)   (when asked for)

computed without materialising the ``N x V`` logits. The ops are ``torch.library.custom_op``s, so Inductor keeps
each as one opaque call:

* ``cce_inductor::linear_cross_entropy`` (the lean path): the loss, each row's log-sum-exp and, where asked for,
  each row's entropy and argmax, with ``F.cross_entropy``'s class weights where given; its backward is a second
  custom op, ``linear_cross_entropy_backward``, traced into the joint graph by ``register_autograd``;
* ``cce_inductor::linear_cross_entropy_with_grads`` (the balanced path, mean / sum losses whose head needs
  gradients): the loss with its own gradients; its autograd formula scales them by the loss's upstream gradient in
  plain aten, which Inductor fuses into the compiled backward and writes in place.

On CUDA (with Triton) they run the kernels in ``cce_inductor.kernels``; everywhere else the chunked PyTorch path in
``cce_inductor._chunked``. The user's options reach them as one string argument, ``CCEOptions.encode()``.

``compute_dtype`` (both ops): the dtype the products run in where it is not the inputs' own: under autocast an fp32
head (and fp32 hidden states) computes as ``F.linear`` would, in the autocast dtype, but the ops take the inputs
as they are, convert them for the call only (no 16-bit copy of the head is held from the forward to the backward)
and return each gradient in its input's dtype (an fp32 weight's gradient is summed in fp32, not rounded to 16 bits).

Callers build a call with :func:`lean_call` / :func:`balanced_call` (keywords, defaults left out of the graph), then
run it eagerly (``call()``) or put it in a graph (``call.emit(graph)``). Public entry point:
:func:`linear_cross_entropy` (shape handling, autocast, argument checks).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from . import _checks, _chunked, _dispatch, _loss, diagnostics, paths
from .options import CCEOptions

__all__ = ["linear_cross_entropy"]


class OpCall(NamedTuple):
    """One call of a fused op: the op and its arguments in schema order, with arguments at their defaults left out
    (so a graph shows only what a site sets)."""

    op: Any
    args: tuple
    kwargs: dict

    def __call__(self):
        return self.op(*self.args, **self.kwargs)

    def emit(self, graph: torch.fx.Graph) -> torch.fx.Node:
        return graph.call_function(self.op, self.args, self.kwargs)


def _set(**optional) -> dict:
    """The keyword arguments that differ from their defaults (None, "", False)."""
    return {name: value for name, value in optional.items() if not (value is None or value is False or value == "")}


# --------------------------------------------------------------------------------------------------------------
# The lean path
# --------------------------------------------------------------------------------------------------------------

_ARGMAX_ROUNDING = {
    "": None,
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@torch.library.custom_op("cce_inductor::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(
    e: Tensor,
    c: Tensor,
    targets: Tensor,
    bias: Tensor | None,
    softcap: float | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    options: str,
    full_lse: bool,
    entropy: bool,
    class_weights: Tensor | None = None,
    argmax: str = "",
    compute_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns ``(loss, lse, entropy, argmax)``: the reduced loss, the per-row log-sum-exp (what the backward
    needs), the per-row entropy of the softmax (empty unless ``entropy``) and each row's argmax (empty unless
    ``argmax``).

    With label smoothing eps (as ``F.cross_entropy``): ``row_loss = lse - (1 - eps) * target_logit - eps / V *
    sum_v logits``, the last sum coming out of the same forward pass. ``full_lse``: the graph uses ``lse`` beyond the
    loss (a z-loss): it is computed for every row, ignored ones included, and is differentiable. ``entropy``: every
    row's ``lse - sum_v softmax_v logits_v``, from the same forward pass, differentiable. ``class_weights`` (V,):
    each counted row's loss is scaled by its target's weight, and a mean divides by the sum of those weights (eager's
    semantics; not with label smoothing: eager's weighted smoothing is another formula). ``argmax``: "" for none, else
    the dtype whose rounding the logits get before the comparison (the dtype eager's logits have: 16-bit logits tie
    where their fp32 sums differ): each row's argmax, int64, ``torch.argmax``'s ties, every row computed.
    ``compute_dtype``: module docstring."""
    diagnostics.count_execution("linear_cross_entropy")
    if class_weights is not None and label_smoothing != 0.0:
        raise ValueError("linear_cross_entropy: class weights with label_smoothing are not supported")
    if argmax not in _ARGMAX_ROUNDING:
        raise ValueError(f"argmax must be one of {sorted(_ARGMAX_ROUNDING)}, got {argmax!r}")
    # Autocast already did its work on the inputs (the public wrapper casts them as F.linear would, or the pass
    # names compute_dtype); inside, the chunked path's matmuls must run in the accumulation dtype.
    with torch.autocast(e.device.type, enabled=False):
        _checks.check_inputs(e, c, targets, bias, compute_dtype)
        _checks.check_class_weights(class_weights, c)
        e, c, bias = _dispatch.in_compute_dtype(e, c, bias, compute_dtype)
        _dispatch.check_target_range(e, targets, c.shape[0], ignore_index)
        acc = _chunked.accumulation_dtype(e.dtype)
        argmax_out = torch.empty(e.shape[0] if argmax else 0, dtype=torch.int64, device=e.device)
        lse, target_logit, logit_sum, mean_logit = _dispatch.forward(
            e,
            c,
            targets,
            bias,
            softcap=softcap,
            ignore_index=ignore_index,
            logit_sum=label_smoothing != 0.0,
            mean_logit=entropy,
            every_row=full_lse or entropy or bool(argmax),
            argmax_out=argmax_out if argmax else None,
            argmax_round=_ARGMAX_ROUNDING[argmax],
        )
        valid = targets != ignore_index
        row_loss = _loss.row_losses(lse, target_logit, logit_sum, valid, label_smoothing, c.shape[0], acc)
        row_entropy = lse - mean_logit if entropy else lse.new_empty(0)
        loss = _loss.reduce_rows(row_loss, valid, reduction, _loss.row_weights(class_weights, targets, valid, acc))
        return loss, lse, row_entropy, argmax_out


@linear_cross_entropy_op.register_fake
def _(
    e,
    c,
    targets,
    bias,
    softcap,
    ignore_index,
    reduction,
    label_smoothing,
    options,
    full_lse,
    entropy,
    class_weights=None,
    argmax="",
    compute_dtype=None,
):
    _checks.check_inputs(e, c, targets, bias, compute_dtype)
    _checks.check_class_weights(class_weights, c)
    dtype = compute_dtype or e.dtype
    n_rows = e.shape[0]
    loss = e.new_empty((n_rows,) if reduction == "none" else (), dtype=_chunked.accumulation_dtype(dtype))
    row_dtype = _dispatch.lse_dtype(e.device, dtype)
    return (
        loss,
        e.new_empty((n_rows,), dtype=row_dtype),
        e.new_empty((n_rows if entropy else 0,), dtype=row_dtype),
        e.new_empty((n_rows if argmax else 0,), dtype=torch.int64),
    )


def lean_call(
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
    full_lse: bool = False,
    entropy: bool = False,
    class_weights=None,
    argmax: str = "",
    compute_dtype: torch.dtype | None = None,
) -> OpCall:
    """A call of ``linear_cross_entropy`` (its docstring has the arguments); ``e``, ``c``, ``targets``, ``bias``
    may be tensors or graph nodes."""
    return OpCall(
        torch.ops.cce_inductor.linear_cross_entropy.default,
        (e, c, targets, bias, softcap, ignore_index, reduction, label_smoothing, options, full_lse, entropy),
        _set(class_weights=class_weights, argmax=argmax, compute_dtype=compute_dtype),
    )


@torch.library.custom_op("cce_inductor::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward_op(
    grad_loss: Tensor,
    e: Tensor,
    c: Tensor,
    targets: Tensor,
    bias: Tensor | None,
    lse: Tensor,
    grad_lse: Tensor | None,
    entropy: Tensor | None,
    grad_entropy: Tensor | None,
    softcap: float | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    options: str,
    need_e: bool,
    need_c: bool,
    need_bias: bool,
    class_weights: Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns ``(grad_e, grad_c, grad_bias)``, each in its input's dtype; a gradient not asked for is an empty
    tensor and costs nothing. ``grad_lse`` / ``grad_entropy``: upstream gradients of the forward's per-row lse /
    entropy, where they are used. ``class_weights``: each row's loss gradient scaled by its target's weight (the
    kernels need nothing else: the weight is a per-row factor)."""
    need_bias = need_bias and bias is not None
    with torch.autocast(e.device.type, enabled=False):
        # the entropy's gradient needs each row's softmax-weighted mean logit: lse - entropy
        mean_logit = None if grad_entropy is None else lse - entropy
        valid = targets != ignore_index
        acc = _chunked.accumulation_dtype(compute_dtype or e.dtype)
        grad_rows = _loss.grad_rows(
            grad_loss, valid, reduction, acc, _loss.row_weights(class_weights, targets, valid, acc)
        )
        grad_e, grad_c, grad_bias = _dispatch.backward(
            e,
            c,
            targets,
            bias,
            lse,
            grad_rows,
            softcap=softcap,
            ignore_index=ignore_index,
            options=CCEOptions.decode(options),
            need_e=need_e,
            need_c=need_c,
            need_bias=need_bias,
            label_smoothing=label_smoothing,
            grad_lse=grad_lse,
            grad_entropy=grad_entropy,
            mean_logit=mean_logit,
            compute_dtype=compute_dtype,
        )
    return tuple(
        grad if needed else e.new_empty(0)
        for needed, grad in ((need_e, grad_e), (need_c, grad_c), (need_bias, grad_bias))
    )


@linear_cross_entropy_backward_op.register_fake
def _(
    grad_loss,
    e,
    c,
    targets,
    bias,
    lse,
    grad_lse,
    entropy,
    grad_entropy,
    softcap,
    ignore_index,
    reduction,
    label_smoothing,
    options,
    need_e,
    need_c,
    need_bias,
    class_weights=None,
    compute_dtype=None,
):
    return _loss.grad_outputs_fake(e, c, bias, need_e, need_c, need_bias)


_FORWARD_ATTRS = ("softcap", "ignore_index", "reduction", "label_smoothing", "options")


def _setup_context(ctx, inputs, output) -> None:
    e, c, targets, bias, *attrs, full_lse, entropy, class_weights, _argmax, compute_dtype = inputs
    _, lse, row_entropy, argmax = output
    ctx.save_for_backward(e, c, targets, bias, lse, row_entropy if entropy else None, class_weights)
    ctx.mark_non_differentiable(argmax)
    if not full_lse:
        ctx.mark_non_differentiable(lse)
    if not entropy:
        ctx.mark_non_differentiable(row_entropy)
    ctx.full_lse = full_lse
    ctx.attrs = dict(zip(_FORWARD_ATTRS, attrs), compute_dtype=compute_dtype)


def _backward(ctx, grad_loss, grad_lse, grad_entropy, _grad_argmax):
    e, c, targets, bias, lse, row_entropy, class_weights = ctx.saved_tensors
    need_e, need_c, _, need_bias = ctx.needs_input_grad[:4]
    if len(ctx.needs_input_grad) > 11 and ctx.needs_input_grad[11]:
        # never a silently missing gradient: the public wrapper and the pass refuse weights that require grad
        raise RuntimeError("cce_inductor: the gradient w.r.t. cross_entropy's class weights is not computed")
    grad_e, grad_c, grad_bias = linear_cross_entropy_backward_op(
        grad_loss,
        e,
        c,
        targets,
        bias,
        lse,
        grad_lse if ctx.full_lse else None,
        row_entropy,
        grad_entropy if row_entropy is not None else None,
        **ctx.attrs,
        need_e=need_e,
        need_c=need_c,
        need_bias=need_bias,
        class_weights=class_weights,
    )
    grads = (grad_e if need_e else None, grad_c if need_c else None, None, grad_bias if need_bias else None)
    return grads + (None,) * (len(ctx.needs_input_grad) - len(grads))


linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------------------------
# The balanced path: the gradients computed with the loss
# --------------------------------------------------------------------------------------------------------------


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
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns ``(loss, grad_e, grad_c, grad_bias, grad_e_lo, grad_c_lo)``: the loss (reduction "mean" or "sum") and its
    own gradients (upstream gradient 1), each in its input's dtype: an fp32 gradient whole, a 16-bit one as the pair
    ``(grad, grad_lo)`` whose sum carries ~16 mantissa bits (``kernels/_pair_sums.py``), but a 16-bit dC with
    ``plain_sum`` (the site's ``paths.BalancedPlan``: summed in its own dtype over at most two row chunks) alone; dbias
    in the accumulation dtype; what is not asked for (or an fp32 gradient's ``lo``) an empty tensor. The autograd
    formula rounds ``grad_loss * (grad + grad_lo)`` once to the input's dtype, in the gradient's own buffer where
    Inductor compiles it (a saved tensor only the backward reads is a donated buffer). On CUDA the balanced kernels
    (``kernels/_balanced.py``: row chunks of logits in a scratch of ``options.scratch_mb``, or planned here for the
    rows of the call, ``paths.balanced_plan``, with the site's ``plain_sum``); elsewhere the chunked path's forward and
    backward back to back. ``returned_logits``: the site's graph also returns the logits (``paths.HeadFacts``), which
    raises the memory target as it raised it when the pass planned this site. ``compute_dtype``: module docstring."""
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
        plan = paths.balanced_plan(facts, decoded.scratch_mb, plain_sum=plain_sum)
        common = dict(
            softcap=softcap,
            ignore_index=ignore_index,
            reduction=reduction,
            label_smoothing=label_smoothing,
            need_e=need_e,
            need_c=need_c,
            need_bias=need_bias,
            compute_dtype=compute_dtype,
        )
        try:
            result = _dispatch.loss_and_grads(
                e, c, targets, bias, chunk_rows=plan.chunk_rows, plain_sum=plan.plain_sum, products=decoded.products,
                **common,
            )  # fmt: skip
        except torch.OutOfMemoryError:
            result = None  # (the traceback holds the failed call's buffers: the fallback runs after it is gone)
        if result is None:  # the lean path's memory where the balanced path's buffers could not be allocated
            diagnostics.count_balanced_rows("lean_after_oom")
            result = _dispatch.lean_loss_and_grads(
                e, c, targets, bias, options=decoded, plain_sum=plan.plain_sum, **common
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
        out(need_e, grad_e_lo, e),
        out(need_c, grad_c_lo, c),
    )


@linear_cross_entropy_with_grads_op.register_fake
def _(
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
    compute_dtype=None,
    plain_sum=False,
):
    _checks.check_inputs(e, c, targets, bias, compute_dtype)
    acc = _chunked.accumulation_dtype(compute_dtype or e.dtype)
    grad_e, grad_c, grad_bias = _loss.grad_outputs_fake(e, c, bias, need_e, need_c, need_bias)
    return (
        e.new_empty((), dtype=acc),
        grad_e,
        grad_c,
        grad_bias.to(acc),
        torch.empty_like(grad_e) if _pair(need_e, e) else e.new_empty(0),
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
        _set(compute_dtype=compute_dtype, plain_sum=plain_sum),
    )


def _setup_context_with_grads(ctx, inputs, output) -> None:
    e, c, _, bias = inputs[:4]
    _, grad_e, grad_c, grad_bias, grad_e_lo, grad_c_lo = output
    ctx.mark_non_differentiable(grad_e, grad_c, grad_bias, grad_e_lo, grad_c_lo)
    # no zero tensors for the gradient outputs' (absent) upstream gradients: dC's would be a V x D fill
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(grad_e, grad_c, grad_bias, grad_e_lo, grad_c_lo)
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


def _backward_with_grads(ctx, grad_loss, *_):
    """Each gradient scaled by the loss's upstream gradient and rounded once (:func:`_scaled`)."""
    if grad_loss is None:  # (grads are not materialised) nothing flows back into the loss
        return (None,) * len(ctx.needs_input_grad)
    grad_e, grad_c, grad_bias, grad_e_lo, grad_c_lo = ctx.saved_tensors
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


def linear_cross_entropy(
    e: Tensor,
    c: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    softcap: float | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    class_weights: Tensor | None = None,
    options: CCEOptions | None = None,
) -> Tensor:
    """``F.cross_entropy(softcap(e @ c.T + bias), targets, ...)`` without materialising the logits.

    Args:
        e: hidden states ``(..., D)``.
        c: classifier weight ``(V, D)`` (the ``weight`` of ``nn.Linear(D, V)``).
        targets: class indices of shape ``e.shape[:-1]``; ``ignore_index`` entries contribute nothing.
        bias: optional ``(V,)``.
        softcap: Gemma-2 style logit soft-capping ``softcap * tanh(logits / softcap)``; ``None`` for none.
        reduction: ``"mean"`` (over non-ignored targets; NaN if there are none), ``"sum"`` or ``"none"``
            (shape ``targets.shape``, 0 at ignored positions).
        label_smoothing: as in ``F.cross_entropy``, in ``[0, 1]``.
        class_weights: ``F.cross_entropy``'s ``weight``, ``(V,)``: a counted row's loss is scaled by its target's
            weight, and "mean" divides by the sum of those weights. Not with ``label_smoothing``; not differentiable
            (an error where they require grad). Always the lean path.
        options: :class:`cce_inductor.CCEOptions` (``exact``, ``products``, ``backward_row_chunk``, ``path``,
            ``scratch_mb``); default ``CCEOptions()``, not the environment: a direct call does what its arguments
            say. The path is chosen as the pass chooses it (``cce_inductor.paths.choose``) for these operands: a
            "mean" / "sum" loss of inputs that require grad (grad mode on) takes the balanced path (its gradients
            computed with the loss) where that fits the memory budget, else the lean one.

    Returns the loss in float32 (float64 for float64 inputs). Under autocast the products run in the autocast dtype,
    as ``F.linear``'s would, and each gradient comes back in its input's dtype.
    """
    _checks.check_public_args(e, c, targets, softcap=softcap, reduction=reduction)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if options is not None and not isinstance(options, CCEOptions):
        raise TypeError(f"options must be a cce_inductor.CCEOptions, got {type(options).__name__}")
    if class_weights is not None:
        if label_smoothing != 0.0:
            raise NotImplementedError(
                "linear_cross_entropy: class_weights with label_smoothing are not supported "
                "(F.cross_entropy's weighted label smoothing is another formula)"
            )
        if class_weights.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                "linear_cross_entropy: class_weights that require grad are not supported (their "
                "gradient is not computed); pass class_weights.detach()"
            )
    compute_dtype = _checks.autocast_dtype(e, c, bias)
    options = options or CCEOptions()
    shape = targets.shape
    rows, targets = e.reshape(-1, e.shape[-1]), targets.reshape(-1).long()
    common = dict(
        softcap=None if softcap is None else float(softcap),
        ignore_index=int(ignore_index),
        reduction=reduction,
        label_smoothing=float(label_smoothing),
        options=options.encode(),
        compute_dtype=compute_dtype,
    )
    need = (e.requires_grad, c.requires_grad, bias is not None and bias.requires_grad)
    dtype = compute_dtype or e.dtype
    facts = _dispatch.head_facts(
        math.prod(e.shape[:-1]),
        e.shape[-1],
        c.shape[0],
        dtype,
        e.device,
        reduction,
        needs_grad=torch.is_grad_enabled() and any(need),
        **paths.storage_facts(e.dtype, c.dtype, dtype),
    )
    choice = paths.choose_for(facts, options)
    if class_weights is None and choice.path == "balanced":
        need_e, need_c, need_bias = need
        return balanced_call(
            rows,
            c,
            targets,
            bias,
            need_e=need_e,
            need_c=need_c,
            need_bias=need_bias,
            plain_sum=choice.plain_sum,
            **common,
        )()[0]
    loss = lean_call(rows, c, targets, bias, class_weights=class_weights, **common)()[0]
    return loss.view(shape) if reduction == "none" else loss
