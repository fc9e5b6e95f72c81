"""How each operation the passes look for can be spelled in a Dynamo graph: the matchers' vocabulary, as data.

Dynamo hands Inductor torch IR, where one operation has several spellings: ``F.linear(x, w)`` is
``("call_function", torch._C._nn.linear)``, ``x.view(...)`` is ``("call_method", "view")``, ``w.T`` is a
``getattr`` (torch <= 2.13) or ``torch.ops.aten.numpy_T`` (2.14+). A table below is the set of spellings of one
operation; :func:`matches` tests a node against it. Tables used by one pass only live in that pass's module.

Also here: the few accessors every matcher needs (a node's example value, a call's argument, a constant).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F


def functions(*targets) -> set:
    return {("call_function", t) for t in targets}


def methods(*names) -> set:
    return {("call_method", n) for n in names}


CROSS_ENTROPY = functions(F.cross_entropy)
LINEAR = functions(F.linear, torch._C._nn.linear)
MATMUL = functions(operator.matmul, torch.matmul, torch.mm) | methods("matmul", "mm", "__matmul__")
EINSUM = functions(torch.einsum, torch.functional.einsum)  # einsum("...d,vd->...v", hidden, weight): a head too
ADDMM = functions(torch.addmm) | methods("addmm")  # addmm(bias, hidden, weight.t()): beta * bias + alpha * (h @ w)
ADD = functions(operator.add, torch.add) | methods("add")
# `x += b` is `operator.iadd(x, b)` (read through its result), `x.add_(b)` a method call (read through x): both return
# x, updated in place.
INPLACE_ADD = functions(operator.iadd) | methods("add_")
TRANSPOSE_2D = functions(torch.t, torch.transpose, torch.permute) | methods("t", "transpose", "permute")
TRANSPOSE_ATTRS = ("T", "mT")
# From torch 2.14 Dynamo records the view attributes as calls of the aten ops behind them, `w.T` as
# `torch.ops.aten.numpy_T(w)` where 2.13 has `getattr(w, "T")`; on a 2-D weight the first two are its transpose.
TRANSPOSE_ATTR_OPS = functions(torch.ops.aten.numpy_T, torch.ops.aten.mT)
VIEW_ATTR_OPS = TRANSPOSE_ATTR_OPS | functions(torch.ops.aten.matrix_H, torch.ops.aten.mH)
RESHAPE = functions(torch.reshape) | methods("view", "reshape")
FLATTEN = functions(torch.flatten) | methods("flatten")
IDENTITY_VIEW = methods("contiguous")
GETITEM = functions(operator.getitem)
TO_DTYPE = methods("to", "type")
DTYPE_METHODS = {"float": torch.float32, "double": torch.float64, "half": torch.float16, "bfloat16": torch.bfloat16}
TANH = functions(torch.tanh, F.tanh) | methods("tanh")
LOG_SOFTMAX = functions(F.log_softmax, torch.log_softmax) | methods("log_softmax")
LOGSUMEXP = functions(torch.logsumexp) | methods("logsumexp")
MUL = functions(operator.mul, torch.mul) | methods("mul")
DIV = functions(operator.truediv, torch.div, torch.true_divide) | methods("div", "true_divide")
SUB = functions(operator.sub, torch.sub) | methods("sub")
ADD = functions(operator.add, torch.add) | methods("add")
NEG = functions(operator.neg, torch.neg) | methods("neg")
GRAD_MODE = functions(torch._C._set_grad_enabled)
# An autocast region inside the compiled code: `_enter_autocast(device_type, dtype, enabled, cache_enabled)` returns the
# context `_exit_autocast(context)` closes.
AUTOCAST_ENTER = functions(torch.amp.autocast_mode._enter_autocast)
AUTOCAST_EXIT = functions(torch.amp.autocast_mode._exit_autocast)
# With VIEW_ATTR_OPS: torch 2.14's spelling of the view attributes, which are getattr nodes before.
VIEW_LIKE = (
    RESHAPE | FLATTEN | GETITEM | IDENTITY_VIEW | TRANSPOSE_2D | VIEW_ATTR_OPS | methods("expand", "narrow", "detach")
)
INPLACE_FUNCTIONS = functions(
    operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ipow
)


def spelling(node: fx.Node):
    if node.op in ("call_function", "call_method"):
        return (node.op, node.target)
    return None


def matches(node: Any, spellings: set) -> bool:
    return isinstance(node, fx.Node) and spelling(node) in spellings


def example_value(node: Any):
    """Dynamo's example value of ``node`` (a FakeTensor, SymInt, ...) or the constant itself."""
    if isinstance(node, fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


def call_arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``index`` (positional) or ``name`` (keyword) of a call; builtins have no inspectable signature."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def dtype_arg(node: fx.Node) -> torch.dtype | None:
    """The ``dtype`` of a (log_)softmax call, ``f(x, dim, [_stacklevel], dtype)`` / ``x.f(dim, dtype)``, or None."""
    if node.kwargs.get("dtype") is not None:
        return node.kwargs["dtype"]
    return next((a for a in node.args[2:] if isinstance(a, torch.dtype)), None)


def normalize_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def const_float(value: Any) -> float | None:
    """A Python number, or a symbolic float/int from the graph specialised to its value.

    ``torch.compile(dynamic=True)`` turns float attributes (Gemma-2's ``final_logit_softcapping``) into graph
    inputs. ``float()`` on their SymFloat installs a guard on the value, as Inductor does when it specialises, so
    the compiled code is only reused for the same constant.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, fx.Node) and isinstance(example_value(value), (torch.SymFloat, torch.SymInt)):
        return float(example_value(value))
    return None


def short(node: fx.Node) -> str:
    """A node as a reason names it: ``name (.method())``, ``name (function)`` or ``name (op)``."""
    if node.op == "call_method":
        return f"{node.name} (.{node.target}())"
    if node.op == "call_function":
        return f"{node.name} ({getattr(node.target, '__name__', node.target)})"
    return f"{node.name} ({node.op})"


def reduces_last_dim(node: fx.Node, source: Any) -> bool:
    """``node`` reduces ``source`` over its last dimension alone (``dim`` / ``axis`` -1, the last by number, or a
    one-element list), keeping no dimension: one value per row."""
    meta = example_value(source)
    if not isinstance(meta, torch.Tensor) or call_arg(node, 0, "input") is not source:
        return False
    if call_arg(node, 2, "keepdim", False) or node.kwargs.get("dtype") is not None:
        return False
    dim = call_arg(node, 1, "dim", node.kwargs.get("axis"))
    dims = tuple(dim) if isinstance(dim, (list, tuple)) else (dim,)
    return len(dims) == 1 and dims[0] in (-1, meta.dim() - 1)


def is_row_logsumexp(node: fx.Node, logits: fx.Node) -> bool:
    """``logsumexp(logits, -1)``: one value per row."""
    return matches(node, LOGSUMEXP) and reduces_last_dim(node, logits)


def is_dtensor(value: Any) -> bool:
    return type(value).__name__ == "DTensor" and type(value).__module__.startswith("torch.distributed")


def requires_grad(node: Any) -> bool:
    value = example_value(node)
    return isinstance(value, torch.Tensor) and value.requires_grad
