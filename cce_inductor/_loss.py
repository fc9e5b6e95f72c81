"""What the fused op and the vocabulary-parallel loss share around the kernels: argument checks, the choice of
kernels or chunked path, the reduction and its gradient per row.

    row_loss[n] = lse[n] - target_logit[n]   (0 where targets[n] == ignore_index; label smoothing: ops.py)
    loss        = row_loss | sum(row_loss) | sum(row_loss) / #valid        ("none" | "sum" | "mean")
    grad_rows   = d loss / d row_loss          (0 at ignored rows)
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from . import _chunked

REDUCTIONS = ("none", "mean", "sum")
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.lru_cache(maxsize=None)
def triton_kernels():
    """``cce_inductor.kernels``, or None where Triton (or the module) is unavailable."""
    try:
        from . import kernels  # noqa: PLC0415 - imports triton, optional on CPU-only installs
    except ImportError:
        return None
    return kernels


def uses_kernels(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether tensors on ``device`` of ``dtype`` take the Triton path (the fake impls must agree)."""
    return device.type == "cuda" and dtype in _KERNEL_DTYPES and triton_kernels() is not None


def lse_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if uses_kernels(device, dtype) else _chunked.accumulation_dtype(dtype)


def row_losses(lse: Tensor, target_logit: Tensor, logit_sum: Optional[Tensor], valid: Tensor, label_smoothing: float,
               vocab: int, acc: torch.dtype) -> Tensor:
    """Each row's loss in ``acc``: ``lse - target_logit`` (with label smoothing eps: ``lse - (1 - eps) target_logit -
    eps / V logit_sum``, as ``F.cross_entropy``), 0 at ignored rows."""
    row_loss = lse.to(acc) - target_logit.to(acc)
    if label_smoothing != 0.0:
        row_loss = row_loss + label_smoothing * (target_logit.to(acc) - logit_sum.to(acc) / vocab)
    return torch.where(valid, row_loss, 0.0)


def reduce_rows(row_loss: Tensor, valid: Tensor, reduction: str) -> Tensor:
    if reduction == "none":
        return row_loss
    if reduction == "sum":
        return row_loss.sum()
    return row_loss.sum() / valid.sum()  # mean over counted rows: 0/0 = NaN when all are ignored, as in PyTorch


def grad_rows(grad_loss: Tensor, valid: Tensor, reduction: str, dtype: torch.dtype) -> Tensor:
    """The upstream gradient of each row's loss: ``grad_loss`` spread as the reduction spread the rows."""
    if reduction == "none":
        per_row = grad_loss.to(dtype)
    elif reduction == "sum":
        per_row = grad_loss.to(dtype).expand(valid.shape[0])
    else:
        per_row = grad_loss.to(dtype) / valid.sum()
    return torch.where(valid, per_row, 0.0)


def empty_unless(needed: bool, grad: Optional[Tensor], like: Tensor) -> Tensor:
    """``grad``, or a fresh empty tensor: a custom op returns a tensor for every output, and outputs may not
    alias each other."""
    return grad if needed else like.new_empty(0)


def grad_outputs_fake(e: Tensor, c: Tensor, bias: Optional[Tensor], need_e: bool, need_c: bool, need_bias: bool):
    """The backward ops' outputs as their fake impls describe them."""
    need_bias = need_bias and bias is not None
    return (
        torch.empty_like(e, memory_format=torch.contiguous_format) if need_e else e.new_empty(0),
        torch.empty_like(c, memory_format=torch.contiguous_format) if need_c else e.new_empty(0),
        torch.empty_like(bias) if need_bias else e.new_empty(0),
    )


def lean_path_reason(options, reduction: str, needs_grad: bool) -> Optional[str]:
    """None where a loss takes the balanced path (``options.scratch_mb > 0``, reduction "mean" or "sum", a gradient
    needed), else why it takes the lean path (``stats()`` shows it)."""
    if options.scratch_mb == 0:
        return "scratch_mb=0"
    if reduction not in ("mean", "sum"):
        return f"reduction={reduction!r} (the balanced path computes 'mean' and 'sum')"
    if not needs_grad:
        return "no gradient is needed (no input of the head requires grad, or grad mode is off)"
    return None


def check_targets_dtype(targets: Tensor) -> None:
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
    check_targets_dtype(targets)
    if e.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"unsupported dtype {e.dtype}; expected one of {SUPPORTED_DTYPES}")
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


def check_public_args(e: Tensor, c: Tensor, targets: Tensor, *, softcap: Optional[float], reduction: str) -> None:
    """Argument checks of the public entry points (the op and the vocabulary-parallel loss)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {sorted(REDUCTIONS)}, got {reduction!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    if e.dim() < 1 or c.dim() != 2:
        raise ValueError(f"expected e of shape (..., D) and c of shape (V, D), got {tuple(e.shape)} and {tuple(c.shape)}")
    check_targets_dtype(targets)
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
