"""The fused linear-cross-entropy op: ``torch.ops.cce_inductor.linear_cross_entropy`` and its backward.

    loss = cross_entropy(softcap(e @ c.T + bias), targets, ignore_index=..., reduction=...)

computed without materialising the ``N x V`` logits. Both ops are ``torch.library.custom_op``s, so Inductor
keeps each as one opaque call; the backward is a second custom op traced into the joint graph by
``register_autograd``. On CUDA (with Triton) they run the kernels in ``cce_inductor.kernels``; everywhere else
the chunked PyTorch path in ``cce_inductor._chunked``.

Public entry point: :func:`linear_cross_entropy` (shape handling, autocast, argument checks).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from . import _chunked

__all__ = ["linear_cross_entropy", "Reduction"]


class Reduction:
    """Integer codes used in the op schema; the same numbering as ``torch.nn._reduction``."""

    NONE = 0
    MEAN = 1
    SUM = 2
    BY_NAME = {"none": NONE, "mean": MEAN, "sum": SUM}


# Sentinels in the op schema (a schema float cannot be None).
NO_SOFTCAP = 0.0
AUTO_FILTER_EPS = -1.0

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.lru_cache(maxsize=None)
def _kernels():
    """The Triton kernels module, or None when Triton (or the module) is unavailable."""
    try:
        from . import kernels  # noqa: PLC0415 - imports triton, optional on CPU-only installs
    except ImportError:
        return None
    return kernels if hasattr(kernels, "forward") else None


def uses_kernels(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether tensors on ``device`` of ``dtype`` take the Triton path (the fake impls must agree)."""
    return device.type == "cuda" and dtype in _KERNEL_DTYPES and _kernels() is not None


def _backward_filters(filter_eps: float, exact: bool) -> bool:
    """Whether the kernels' backward may filter, i.e. needs the forward's summaries (``aux``).  Deterministic
    mode turns filtering off later, in the backward; the summaries are then computed for nothing."""
    return filter_eps != 0.0 and not exact


def kernel_filter_eps(filter_eps: float, exact: bool, dtype: torch.dtype) -> float:
    """The threshold the kernels' backward gets: 0 in exact mode and under ``torch.use_deterministic_algorithms``
    (the filtering tile kernel adds with atomics; unfiltered, the dense path is reproducible), the per-dtype
    default for ``AUTO_FILTER_EPS``, else the user's value."""
    if exact or torch.are_deterministic_algorithms_enabled():
        return 0.0
    return _kernels().default_filter_eps(dtype) if filter_eps == AUTO_FILTER_EPS else filter_eps


def _aux_spec(n_rows, vocab, device: torch.device, dtype: torch.dtype, vocab_sort: bool, summaries: bool):
    if uses_kernels(device, dtype):
        return _kernels().aux_spec(n_rows, vocab, vocab_sort, summaries)
    return (0,), torch.float32


def _check_targets_dtype(targets: Tensor) -> None:
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise TypeError(
            f"targets must hold class indices (an integer dtype), got {targets.dtype}; "
            "probability targets are not supported"
        )


def check_inputs(e: Tensor, c: Tensor, targets: Tensor, bias: Optional[Tensor]) -> None:
    """Shape, dtype and device checks shared by the real and the fake implementations."""
    if e.dim() != 2 or c.dim() != 2:
        raise ValueError(f"expected e of shape (N, D) and c of shape (V, D), got {tuple(e.shape)} and {tuple(c.shape)}")
    torch._check_value(
        e.shape[1] == c.shape[1],
        lambda: f"hidden size mismatch: e is {tuple(e.shape)} but c is {tuple(c.shape)} (c must be (V, D))",
    )
    if targets.dim() != 1:
        raise ValueError(f"expected targets of shape (N,), got {tuple(targets.shape)}")
    torch._check_value(
        targets.shape[0] == e.shape[0],
        lambda: f"targets has {targets.shape[0]} entries but e has {e.shape[0]} rows",
    )
    _check_targets_dtype(targets)
    if e.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"unsupported dtype {e.dtype}; expected one of {_SUPPORTED_DTYPES}")
    tensors = [("c", c)] + ([] if bias is None else [("bias", bias)])
    for name, tensor in tensors:
        if tensor.dtype != e.dtype:
            raise TypeError(f"{name} has dtype {tensor.dtype} but e has {e.dtype}; they must match")
    for name, tensor in tensors + [("targets", targets)]:
        if tensor.device != e.device:
            raise ValueError(f"{name} is on {tensor.device} but e is on {e.device}")
    if bias is not None:
        if bias.dim() != 1:
            raise ValueError(f"expected bias of shape (V,), got {tuple(bias.shape)}")
        torch._check_value(bias.shape[0] == c.shape[0], lambda: f"bias has {bias.shape[0]} entries, c has {c.shape[0]} rows")


def check_target_range(targets: Tensor, vocab: int, ignore_index: int) -> None:
    """Out-of-range targets are an error as in eager PyTorch: an IndexError on CPU, a device-side assert on CUDA
    and under torch.compile (a Python branch on a tensor would be a host sync / a graph break there)."""
    out_of_range = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))
    if targets.device.type == "cuda" or torch.compiler.is_compiling():
        torch._assert_async(~out_of_range.any(), "cce_inductor: target out of bounds (not ignore_index and not in [0, V))")
    elif out_of_range.any():
        bad = int(targets[out_of_range][0])
        raise IndexError(f"Target {bad} is out of bounds.")


def _softcap_or_none(softcap: float) -> Optional[float]:
    return None if softcap == NO_SOFTCAP else softcap


@torch.library.custom_op("cce_inductor::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(
    e: Tensor,
    c: Tensor,
    targets: Tensor,
    bias: Optional[Tensor],
    softcap: float,
    ignore_index: int,
    reduction: int,
    filter_eps: float,
    vocab_sort: bool,
    exact: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns ``(loss, lse, aux)``: the reduced loss, per-row log-sum-exp, and what the kernels' backward needs."""
    # Autocast already did its work on the inputs (the public wrapper casts them as F.linear would); inside,
    # the chunked path's matmuls must run in the accumulation dtype, not be downcast again.
    with torch.autocast(e.device.type, enabled=False):
        return _forward_impl(e, c, targets, bias, softcap, ignore_index, reduction, vocab_sort,
                             _backward_filters(filter_eps, exact))


def _forward_impl(e, c, targets, bias, softcap, ignore_index, reduction, vocab_sort, summaries):
    check_inputs(e, c, targets, bias)
    check_target_range(targets, c.shape[0], ignore_index)
    cap = _softcap_or_none(softcap)
    acc = _chunked.accumulation_dtype(e.dtype)
    if uses_kernels(e.device, e.dtype) and e.shape[0] > 0:
        lse, target_logit, aux = _kernels().forward(
            e, c, targets, bias, softcap=cap, ignore_index=ignore_index, vocab_sort=vocab_sort, summaries=summaries
        )
    else:
        lse, target_logit = _chunked.forward(e, c, targets, bias, softcap=cap, ignore_index=ignore_index)
        shape, dtype = _aux_spec(e.shape[0], c.shape[0], e.device, e.dtype, vocab_sort, summaries)
        aux = torch.zeros(shape, dtype=dtype, device=e.device)
    valid = targets != ignore_index
    row_loss = torch.where(valid, lse.to(acc) - target_logit.to(acc), 0.0)
    if reduction == Reduction.NONE:
        loss = row_loss
    elif reduction == Reduction.SUM:
        loss = row_loss.sum()
    else:  # mean over non-ignored targets: 0/0 = NaN when all are ignored, as in PyTorch
        loss = row_loss.sum() / valid.sum()
    return loss, lse, aux


@linear_cross_entropy_op.register_fake
def _(e, c, targets, bias, softcap, ignore_index, reduction, filter_eps, vocab_sort, exact):
    check_inputs(e, c, targets, bias)
    acc = _chunked.accumulation_dtype(e.dtype)
    n_rows = e.shape[0]
    loss = e.new_empty((n_rows,) if reduction == Reduction.NONE else (), dtype=acc)
    lse_dtype = torch.float32 if uses_kernels(e.device, e.dtype) else acc
    lse = e.new_empty((n_rows,), dtype=lse_dtype)
    shape, dtype = _aux_spec(n_rows, c.shape[0], e.device, e.dtype, vocab_sort, _backward_filters(filter_eps, exact))
    return loss, lse, e.new_empty(shape, dtype=dtype)


@torch.library.custom_op("cce_inductor::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward_op(
    grad_loss: Tensor,
    e: Tensor,
    c: Tensor,
    targets: Tensor,
    bias: Optional[Tensor],
    lse: Tensor,
    aux: Tensor,
    softcap: float,
    ignore_index: int,
    reduction: int,
    filter_eps: float,
    vocab_sort: bool,
    exact: bool,
    need_e: bool,
    need_c: bool,
    need_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns ``(grad_e, grad_c, grad_bias)``; a gradient not asked for is an empty tensor and costs nothing."""
    with torch.autocast(e.device.type, enabled=False):
        return _backward_impl(
            grad_loss, e, c, targets, bias, lse, aux, softcap, ignore_index, reduction, filter_eps, vocab_sort,
            exact, need_e, need_c, need_bias,
        )  # fmt: skip


def _backward_impl(grad_loss, e, c, targets, bias, lse, aux, softcap, ignore_index, reduction, filter_eps,
                   vocab_sort, exact, need_e, need_c, need_bias):  # fmt: skip
    need_bias = need_bias and bias is not None
    valid = targets != ignore_index
    acc = _chunked.accumulation_dtype(e.dtype)
    if reduction == Reduction.NONE:
        per_row = grad_loss.to(acc)
    elif reduction == Reduction.SUM:
        per_row = grad_loss.to(acc).expand(targets.shape[0])
    else:
        per_row = grad_loss.to(acc) / valid.sum()
    grad_rows = torch.where(valid, per_row, 0.0)
    cap = _softcap_or_none(softcap)
    # The filtering tile kernel accumulates dE/dC with atomics, not bitwise reproducible; under
    # torch.use_deterministic_algorithms(True) kernel_filter_eps turns filtering off, so the gradients come from the
    # dense kernel path (plain products, no atomics), exact mode included.
    if uses_kernels(e.device, e.dtype) and e.shape[0] > 0:
        grad_e, grad_c, grad_bias = _kernels().backward(
            e, c, targets, bias, lse, aux, grad_rows.float(),
            softcap=cap, ignore_index=ignore_index, filter_eps=kernel_filter_eps(filter_eps, exact, e.dtype),
            vocab_sort=vocab_sort, exact=exact,
            need_e=need_e, need_c=need_c, need_bias=need_bias,
        )  # fmt: skip
    else:
        grad_e, grad_c, grad_bias = _chunked.backward(
            e, c, targets, bias, lse, grad_rows, softcap=cap, need_e=need_e, need_c=need_c, need_bias=need_bias
        )
    # Separate empty tensors: custom op outputs may not alias each other.
    return (
        grad_e if need_e else e.new_empty(0),
        grad_c if need_c else e.new_empty(0),
        grad_bias if need_bias else e.new_empty(0),
    )


@linear_cross_entropy_backward_op.register_fake
def _(grad_loss, e, c, targets, bias, lse, aux, softcap, ignore_index, reduction, filter_eps, vocab_sort, exact,
      need_e, need_c, need_bias):  # fmt: skip
    need_bias = need_bias and bias is not None
    return (
        torch.empty_like(e, memory_format=torch.contiguous_format) if need_e else e.new_empty(0),
        torch.empty_like(c, memory_format=torch.contiguous_format) if need_c else e.new_empty(0),
        torch.empty_like(bias) if need_bias else e.new_empty(0),
    )


_FORWARD_ATTRS = ("softcap", "ignore_index", "reduction", "filter_eps", "vocab_sort", "exact")


def _setup_context(ctx, inputs, output) -> None:
    e, c, targets, bias, *attrs = inputs
    _, lse, aux = output
    ctx.save_for_backward(e, c, targets, bias, lse, aux)
    ctx.mark_non_differentiable(lse, aux)
    ctx.attrs = dict(zip(_FORWARD_ATTRS, attrs))


def _backward(ctx, grad_loss, _grad_lse, _grad_aux):
    e, c, targets, bias, lse, aux = ctx.saved_tensors
    need_e, need_c, _, need_bias = ctx.needs_input_grad[:4]
    grad_e, grad_c, grad_bias = linear_cross_entropy_backward_op(
        grad_loss, e, c, targets, bias, lse, aux, **ctx.attrs, need_e=need_e, need_c=need_c, need_bias=need_bias
    )
    return (
        grad_e if need_e else None,
        grad_c if need_c else None,
        None,
        grad_bias if need_bias else None,
    ) + (None,) * len(_FORWARD_ATTRS)


linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


def check_public_args(e: Tensor, c: Tensor, targets: Tensor, *, softcap, reduction: str, filter_eps) -> None:
    """Argument checks of the public entry points (this op and the vocabulary-parallel loss)."""
    if reduction not in Reduction.BY_NAME:
        raise ValueError(f"reduction must be one of {sorted(Reduction.BY_NAME)}, got {reduction!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    if filter_eps is not None and not (0.0 <= filter_eps < 1.0):
        raise ValueError(f"filter_eps must be in [0, 1), got {filter_eps}")
    if e.dim() < 1 or c.dim() != 2:
        raise ValueError(f"expected e of shape (..., D) and c of shape (V, D), got {tuple(e.shape)} and {tuple(c.shape)}")
    _check_targets_dtype(targets)
    if tuple(targets.shape) != tuple(e.shape[:-1]):
        raise ValueError(f"targets must have shape {tuple(e.shape[:-1])} (e's leading dims), got {tuple(targets.shape)}")


def autocast_inputs(e: Tensor, c: Tensor, bias: Optional[Tensor]):
    """Under autocast, ``e``, ``c`` and ``bias`` in the autocast dtype, as ``F.linear`` would see them."""
    device_type = e.device.type
    if torch.is_autocast_enabled(device_type) and e.dtype.is_floating_point:
        autocast_dtype = torch.get_autocast_dtype(device_type)
        e, c = e.to(autocast_dtype), c.to(autocast_dtype)
        bias = None if bias is None else bias.to(autocast_dtype)
    return e, c, bias


def linear_cross_entropy(
    e: Tensor,
    c: Tensor,
    targets: Tensor,
    *,
    bias: Optional[Tensor] = None,
    softcap: Optional[float] = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    filter_eps: Optional[float] = 0.0,
    vocab_sort: bool = False,
    exact: bool = False,
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
        filter_eps, vocab_sort, exact: backward speed/precision trade-offs of the CUDA kernels, see
            :class:`cce_inductor.CCEOptions` (``filter_eps=None``: the paper's per-dtype threshold; the default
            0.0 computes every gradient entry).

    Returns the loss in float32 (float64 for float64 inputs). Under autocast ``e``, ``c`` and ``bias`` are cast
    to the autocast dtype, as ``F.linear`` would be.
    """
    check_public_args(e, c, targets, softcap=softcap, reduction=reduction, filter_eps=filter_eps)
    e, c, bias = autocast_inputs(e, c, bias)

    loss, _, _ = linear_cross_entropy_op(
        e.reshape(-1, e.shape[-1]),
        c,
        targets.reshape(-1).long(),
        bias,
        NO_SOFTCAP if softcap is None else float(softcap),
        int(ignore_index),
        Reduction.BY_NAME[reduction],
        AUTO_FILTER_EPS if filter_eps is None else float(filter_eps),
        bool(vocab_sort),
        bool(exact),
    )
    if reduction == "none":
        loss = loss.view(targets.shape)
    return loss
