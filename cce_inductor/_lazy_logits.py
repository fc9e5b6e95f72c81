"""Logits computed on first use: what a compiled model returns in place of logits it no longer computes in the graph
(the ``lazy_logits`` option, on by default).

A rewritten loss needs no logits, but Hugging Face models (and nanoGPT, and most training code) also return them.
With ``lazy_logits`` the pass puts ``torch.ops.cce_inductor.lazy_logits`` in their place in the graph's outputs. Its
real impl returns a :class:`LazyLogits`: a tensor of the logits' shape, dtype and device that holds what the head
holds -- a copy of the hidden-state rows (``N x D``, in the head's compute dtype), references to the head's weight
(``V x D``) and bias, and the elementwise steps between the head and the returned node (scale, softcap, casts) -- but
no values. The first operation that reads values computes them, exactly as the graph would have::

    logits = steps(F.linear(rows, weight.to(rows.dtype), bias.to(rows.dtype)))      (autocast off: rows are already
                                                                                      in the compute dtype)

and keeps them for later uses. Code that never reads the logits (``Trainer``'s training step) pays for the rows'
copy only; code that does (evaluation, ``compute_metrics``, a callback) gets the real numbers, for one extra head
product. Metadata (shape, dtype, device, ``requires_grad``) is answered without computing; so are ``detach()``,
dtype casts (``.float()``: Accelerate's mixed-precision wrapper casts every output) and ``contiguous()``, which
return another lazy tensor.

Non-negotiables, and how they hold:

* the values are the graph's: the same rows, weight and steps, in the same order and dtypes. The weight and bias are
  read when the values are computed, so an in-place update in between (``optimizer.step()``) would give other
  numbers: their version counters are recorded and a changed one raises (never plausible wrong numbers). The rows
  are copied in the op, as Inductor may reuse the graph's own buffer once the op has run.
* gradient: the op's inputs are detached (AOTAutograd must not see a differentiable ``N x V`` output, or it would
  allocate its zero gradient). Where eager's logits would require grad, computed values require grad through a
  node whose backward raises a clear error: a loss built from the returned logits cannot reach the model's
  parameters, and saying so beats training on a silently dropped gradient.
* no host synchronisation (one ``expand`` of one element); the fake impl has the logits' symbolic shape.
* C++ code that reads the storage directly (bypassing ``__torch_function__``) sees one NaN element expanded.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._pytree import tree_map

from ._dropped_logits import CUDAGRAPH_UNSAFE, METADATA_READS

__all__ = ["LazyLogits", "encode_steps", "decode_steps"]

_T = torch.Tensor

# Answered from the placeholder itself, as for dropped logits: metadata only.
_METADATA = METADATA_READS
_REQUIRES_GRAD = _T.requires_grad.__get__
_DTYPE_METHODS = {
    _T.float: torch.float32,
    _T.double: torch.float64,
    _T.half: torch.float16,
    _T.bfloat16: torch.bfloat16,
}


# --------------------------------------------------------------------------------------------------------------
# The steps between the head and the returned node, as one string (an op argument, so part of the graph)
# --------------------------------------------------------------------------------------------------------------


def encode_steps(steps: list[tuple]) -> str:
    """``[("mul", 0.5), ("tanh",), ("to", torch.float32)]`` -> ``"mul:0.5;tanh;to:float32"`` (floats by ``repr``:
    exact round trip)."""
    parts = []
    for step in steps:
        if step[0] in ("mul", "div"):
            parts.append(f"{step[0]}:{float(step[1])!r}")
        elif step[0] == "to":
            parts.append(f"to:{str(step[1]).removeprefix('torch.')}")
        elif step[0] == "tanh":
            parts.append("tanh")
        else:
            raise ValueError(f"not a lazy-logits step: {step!r}")
    return ";".join(parts)


def decode_steps(encoded: str) -> list[tuple]:
    steps: list[tuple] = []
    for item in filter(None, encoded.split(";")):
        name, _, value = item.partition(":")
        if name in ("mul", "div"):
            steps.append((name, float(value)))
        elif name == "to" and isinstance(getattr(torch, value, None), torch.dtype):
            steps.append((name, getattr(torch, value)))
        elif name == "tanh" and not value:
            steps.append((name,))
        else:
            raise ValueError(f"not an encoded lazy-logits step: {item!r} in {encoded!r}")
    return steps


def output_dtype(rows_dtype: torch.dtype, steps: list[tuple]) -> torch.dtype:
    dtype = rows_dtype
    for step in steps:
        if step[0] == "to":
            dtype = step[1]
    return dtype


def _apply(logits: Tensor, steps: list[tuple]) -> Tensor:
    # The graph's own operations, one by one, each in the dtype it ran in (a Python float scalar keeps a tensor's
    # dtype, as in the graph).
    for step in steps:
        if step[0] == "mul":
            logits = logits * step[1]
        elif step[0] == "div":
            logits = logits / step[1]
        elif step[0] == "tanh":
            logits = torch.tanh(logits)
        else:
            logits = logits.to(step[1])
    return logits


# --------------------------------------------------------------------------------------------------------------
# The lazy tensor
# --------------------------------------------------------------------------------------------------------------


class _NoGradientThrough(torch.autograd.Function):
    """Values of lazily computed logits, where eager's logits would require grad: their backward raises."""

    @staticmethod
    def forward(ctx, anchor: Tensor, compute: Callable[[], Tensor]) -> Tensor:  # type: ignore[override]
        return compute()

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        raise RuntimeError(
            "cce_inductor: a gradient reached logits that a compiled model returned lazily (computed on first use "
            "from the hidden states, outside the compiled graph): it cannot flow back into the model, so this "
            "backward would silently miss that part of the gradient. The compiled graph's rewritten loss is "
            "differentiable as usual; to backpropagate through the returned logits themselves, compute that loss "
            "inside the compiled region, or turn the rewrite of returned logits off: CCE_INDUCTOR_LAZY_LOGITS=0, or "
            "lazy_logits=False in cce_inductor.enable / cce_inductor.make_backend (the site is then left to Inductor)."
        )


class _Head:
    """What computing the logits needs: the rows' copy, the head's weight and bias, and their versions then."""

    __slots__ = ("rows", "weight", "bias", "steps", "versions")

    def __init__(self, rows: Tensor, weight: Tensor, bias: Tensor | None, steps: list[tuple]) -> None:
        self.rows, self.weight, self.bias, self.steps = rows, weight, bias, steps
        self.versions = (weight._version, None if bias is None else bias._version)

    def compute(self, extra_casts: tuple) -> Tensor:
        now = (self.weight._version, None if self.bias is None else self.bias._version)
        if now != self.versions:
            raise RuntimeError(
                "cce_inductor: these logits were returned lazily by a compiled model (computed on first use from the "
                "hidden states and the output head's weight), and the head's weight or bias has been modified in "
                "place since that forward (an optimizer step?): computing them now would not give the forward's "
                "logits. Read the logits before updating the weights, or turn lazy logits off "
                "(CCE_INDUCTOR_LAZY_LOGITS=0, or lazy_logits=False in cce_inductor.enable / make_backend)."
            )
        dtype = self.rows.dtype
        with torch.no_grad(), torch.autocast(self.rows.device.type, enabled=False):
            weight = self.weight.to(dtype)
            bias = None if self.bias is None else self.bias.to(dtype)
            logits = _apply(F.linear(self.rows, weight, bias), self.steps)
            for dtype in extra_casts:
                logits = logits.to(dtype)
        return logits


class LazyLogits(torch.Tensor):
    """Logits computed on first use (see the module docstring). ``isinstance(x, torch.Tensor)`` holds; every
    operation on it works as on the real logits."""

    _head: _Head
    _casts: tuple
    _wants_grad: bool
    _values: dict

    @staticmethod
    def make(head: _Head, shape: list, dtype: torch.dtype, wants_grad: bool, casts: tuple = ()) -> LazyLogits:
        # One NaN element, expanded: Inductor checks the fake impl's zero strides against it.
        base = torch.full((1,), math.nan, dtype=dtype, device=head.rows.device).expand(shape)
        lazy = Tensor._make_subclass(LazyLogits, base, False)
        lazy._head, lazy._casts, lazy._wants_grad, lazy._values = head, casts, wants_grad, {}
        return lazy

    def _derived(self, dtype: torch.dtype | None = None, wants_grad: bool | None = None) -> LazyLogits:
        with torch._C.DisableTorchFunctionSubclass():
            shape, own = list(self.shape), self.dtype
        casts = self._casts + ((dtype,) if dtype is not None and dtype != own else ())
        return LazyLogits.make(
            self._head, shape, dtype or own, self._wants_grad if wants_grad is None else wants_grad, casts
        )

    def materialize(self) -> Tensor:
        """The logits' values, computed now (once; later calls return the same tensor)."""
        grad = self._wants_grad and torch.is_grad_enabled()
        if grad not in self._values:
            if grad:
                anchor = torch.empty(0, device=self._head.rows.device, requires_grad=True)
                value = _NoGradientThrough.apply(anchor, lambda: self._head.compute(self._casts))
            else:
                value = self._head.compute(self._casts)
            self._values[grad] = value
        return self._values[grad]

    @property
    def is_materialized(self) -> bool:
        """Whether the values have been computed (for tests and memory accounting)."""
        return bool(self._values)

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func == _REQUIRES_GRAD and len(args) == 1:  # (a method-wrapper: a new object per access)
            return args[0]._wants_grad  # what eager's logits would say
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        self = args[0] if args and isinstance(args[0], LazyLogits) else None
        if self is not None:
            lazy = self._lazy_method(func, args[1:], kwargs)
            if lazy is not None:
                return lazy
        plain = tree_map(lambda x: x.materialize() if isinstance(x, LazyLogits) else x, (args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*plain[0], **plain[1])

    def _lazy_method(self, func: Callable, rest: tuple, kwargs: dict) -> LazyLogits | None:
        """Methods that need no values: detach, dtype casts, contiguous; None for everything else."""
        if self._values:
            return None  # computed already: the real tensor answers
        if func is _T.detach and not rest and not kwargs:
            return self._derived(wants_grad=False)
        if func in _DTYPE_METHODS and not rest and not kwargs:
            return self._derived(_DTYPE_METHODS[func])
        if func in (_T.to, _T.type):
            dtype = _only_dtype(rest, kwargs)
            if dtype is not None and dtype.is_floating_point:
                return self._derived(dtype)
        if (
            func is _T.contiguous
            and not rest
            and kwargs.get("memory_format", torch.contiguous_format) is torch.contiguous_format
        ):
            return self  # computed values are contiguous
        return None

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return repr(self.materialize())

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.materialize().__reduce_ex__(protocol)

    def __deepcopy__(self, memo: Any) -> Any:
        return copy.deepcopy(self.materialize(), memo)


def _only_dtype(rest: tuple, kwargs: dict) -> torch.dtype | None:
    """The dtype of ``x.to(dtype)`` / ``x.type(dtype)`` / ``x.to(dtype=...)``, or None for any other form (a device,
    ``copy=True``, a memory format: those compute)."""
    if len(rest) == 1 and isinstance(rest[0], torch.dtype) and not kwargs:
        return rest[0]
    if not rest and set(kwargs) == {"dtype"} and isinstance(kwargs["dtype"], torch.dtype):
        return kwargs["dtype"]
    return None


@torch.library.custom_op("cce_inductor::lazy_logits", mutates_args=(), tags=CUDAGRAPH_UNSAFE)
def lazy_logits_op(rows: Tensor, weight: Tensor, bias: Tensor | None, steps: str, requires_grad: bool) -> Tensor:
    """A :class:`LazyLogits` of ``steps(linear(rows, weight, bias))``: shape ``rows.shape[:-1] + (V,)``, its dtype
    the last cast of ``steps`` (else the rows'). ``requires_grad``: whether eager's logits would require grad. The
    inputs never require grad (the pass detaches them)."""
    decoded = decode_steps(steps)
    head = _Head(rows.clone(), weight, bias, decoded)  # a copy: Inductor may reuse the rows' buffer after this op
    shape = [*rows.shape[:-1], weight.shape[0]]
    return LazyLogits.make(head, shape, output_dtype(rows.dtype, decoded), requires_grad)


@lazy_logits_op.register_fake
def _(rows, weight, bias, steps, requires_grad):
    shape = [*rows.shape[:-1], weight.shape[0]]
    return rows.new_empty_strided(shape, [0] * len(shape), dtype=output_dtype(rows.dtype, decode_steps(steps)))


def emit(graph: torch.fx.Graph, rows, weight, bias, *, steps: list, requires_grad: bool) -> torch.fx.Node:
    """A ``lazy_logits`` node (at the graph's insertion point) of ``steps`` (decoded, :func:`encode_steps`' input)
    over ``linear(rows, weight, bias)``: the one place its arguments are put in schema order."""
    return graph.call_function(
        torch.ops.cce_inductor.lazy_logits.default, (rows, weight, bias, encode_steps(steps), requires_grad)
    )
