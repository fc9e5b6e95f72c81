"""Argument checks of the public entry points and of the ops (real and fake implementations), and autocast.

Bad input gets eager PyTorch's error or a clearer one: the same exception types, raised before any work.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake  # private; imported by torch itself, so free here

REDUCTIONS = ("none", "mean", "sum")
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# The dtypes autocast casts to its own for a matmul (fp64 stays fp64).
AUTOCAST_CASTS = (torch.float16, torch.bfloat16, torch.float32)


def head_dtype_error(
    hidden: torch.dtype, weight: torch.dtype, bias: torch.dtype | None, autocast: torch.dtype | None
) -> str | None:
    """Why eager's head (``F.linear``, ``matmul``, ``addmm``) raises on operands of these dtypes, or None where it
    computes them: every operand in one dtype once autocast, where it is on (``autocast``: its dtype), has cast those
    it casts. Where eager raises, the pass leaves the site to that error."""
    named = {"hidden states": hidden, "weight": weight, **({} if bias is None else {"bias": bias})}
    seen = {autocast if autocast is not None and dtype in AUTOCAST_CASTS else dtype for dtype in named.values()}
    if len(seen) == 1:
        return None
    listing = ", ".join(f"{name} {str(dtype).removeprefix('torch.')}" for name, dtype in named.items())
    where = "without autocast" if autocast is None else f"under autocast to {str(autocast).removeprefix('torch.')}"
    return f"the head's operands have two dtypes ({listing}) {where}: eager raises, so the site is left to it"


def check_targets_dtype(targets: Tensor) -> None:
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise TypeError(
            f"targets must hold class indices (an integer dtype), got {targets.dtype}; "
            "probability targets are not supported"
        )


def check_inputs(
    e: Tensor, c: Tensor, targets: Tensor, bias: Tensor | None, compute_dtype: torch.dtype | None = None
) -> None:
    """Shape, dtype and device checks shared by the real and the fake implementations. ``compute_dtype`` (autocast:
    the products' dtype): e, c and bias may then each have any supported floating dtype, each cast to it first, as
    autocast's ``F.linear`` casts them; without it they must share one dtype."""
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
    tensors = [("c", c)] + ([] if bias is None else [("bias", bias)])
    if compute_dtype is not None:
        for name, tensor in [("compute_dtype", torch.empty(0, dtype=compute_dtype)), ("e", e)] + tensors:
            if tensor.dtype not in SUPPORTED_DTYPES:
                raise TypeError(f"unsupported dtype {tensor.dtype} of {name}; expected one of {SUPPORTED_DTYPES}")
    else:
        if e.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"unsupported dtype {e.dtype}; expected one of {SUPPORTED_DTYPES}")
        for name, tensor in tensors:
            if tensor.dtype != e.dtype:
                raise TypeError(f"{name} has dtype {tensor.dtype} but e has {e.dtype}; they must match")
    for name, tensor in tensors + [("targets", targets)]:
        if tensor.device != e.device:
            raise ValueError(f"{name} is on {tensor.device} but e is on {e.device}")
    if bias is not None:
        if bias.dim() != 1:
            raise ValueError(f"expected bias of shape (V,), got {tuple(bias.shape)}")
        torch._check_value(
            bias.shape[0] == c.shape[0], lambda: f"bias has {bias.shape[0]} entries, c has {c.shape[0]} rows"
        )


def check_class_weights(class_weights: Tensor | None, c: Tensor) -> None:
    """``F.cross_entropy``'s ``weight``: one weight per class, on c's device, floating point."""
    if class_weights is None:
        return
    if class_weights.dim() != 1:
        raise ValueError(f"expected class weights of shape (V,), got {tuple(class_weights.shape)}")
    torch._check_value(
        class_weights.shape[0] == c.shape[0],
        lambda: f"class weights have {class_weights.shape[0]} entries but c has {c.shape[0]} classes",
    )
    if not class_weights.dtype.is_floating_point:
        raise TypeError(f"class weights must be floating-point, got {class_weights.dtype}")
    if class_weights.device != c.device:
        raise ValueError(f"class weights are on {class_weights.device} but c is on {c.device}")


def check_target_range(targets: Tensor, vocab: int, ignore_index: int) -> None:
    """Out-of-range targets are an error as in eager PyTorch: an IndexError on CPU, a device-side assert on CUDA
    and under torch.compile (a Python branch on a tensor would be a host sync / a graph break there)."""
    out_of_range = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))
    if targets.device.type == "cuda" or _traced(targets):
        torch._assert_async(
            ~out_of_range.any(), "cce_inductor: target out of bounds (not ignore_index and not in [0, V))"
        )
    elif out_of_range.any():
        bad = int(targets[out_of_range][0])
        raise IndexError(f"Target {bad} is out of bounds.")


def _traced(tensor: Tensor) -> bool:
    """Whether ``tensor``'s values are unknown here (compile, export, AOTAutograd tracing a function the graph calls,
    as the vocabulary-parallel loss is): ``torch.compiler.is_compiling()``, which not every supported torch release
    sets while AOTAutograd traces, or a fake tensor."""
    return torch.compiler.is_compiling() or is_fake(tensor)


def check_public_args(e: Tensor, c: Tensor, targets: Tensor, *, softcap: float | None, reduction: str) -> None:
    """Argument checks of the public entry points (the op and the vocabulary-parallel loss)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {sorted(REDUCTIONS)}, got {reduction!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    if e.dim() < 1 or c.dim() != 2:
        raise ValueError(
            f"expected e of shape (..., D) and c of shape (V, D), got {tuple(e.shape)} and {tuple(c.shape)}"
        )
    check_targets_dtype(targets)
    if tuple(targets.shape) != tuple(e.shape[:-1]):
        raise ValueError(
            f"targets must have shape {tuple(e.shape[:-1])} (e's leading dims), got {tuple(targets.shape)}"
        )


_AUTOCAST_ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)


def autocast_dtype(*tensors: Tensor | None) -> torch.dtype | None:
    """Under autocast, the dtype ``F.linear`` would cast these (floating, not fp64) tensors to, where one of them is
    not already in it; else None."""
    device_type = next(t for t in tensors if t is not None).device.type
    if not torch.is_autocast_enabled(device_type):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    if any(t is not None and t.dtype in _AUTOCAST_ELIGIBLE and t.dtype != dtype for t in tensors):
        return dtype
    return None


def autocast_inputs(e: Tensor, c: Tensor, bias: Tensor | None):
    """Under autocast, ``e``, ``c`` and ``bias`` in the autocast dtype, as ``F.linear`` would see them."""
    device_type = e.device.type
    if torch.is_autocast_enabled(device_type) and e.dtype.is_floating_point:
        autocast_dtype = torch.get_autocast_dtype(device_type)
        e, c = e.to(autocast_dtype), c.to(autocast_dtype)
        bias = None if bias is None else bias.to(autocast_dtype)
    return e, c, bias
