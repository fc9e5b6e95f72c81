"""Rewrite ``linear -> [softcap] -> cross_entropy`` in Dynamo graphs into ``cce_inductor::linear_cross_entropy``.

Runs on the graph Dynamo hands to Inductor (before AOTAutograd: torch IR with ``call_method`` views), so the
logits are never created, neither in the forward nor as a saved activation for the backward.

The matched graph, read from the loss back to the head (every part but the two ends is optional and may come
in any order)::

    hidden  (..., D)        weight (V, D)      [bias (V,)]
        \\                      |                /
         linear(hidden, weight, bias) | hidden @ weight.T | matmul(hidden, weight_t)
                  |
          logits (..., V)   ---- row views:   view/reshape/flatten over leading dims, contiguous,
                  |                           getitem slices of leading dims (label shift logits[..., :-1, :])
                  |         ---- upcasts:     .float(), .to(torch.float32)
                  |         ---- scale:       logits * k, logits / k  (constant k; before any softcap)
                  |         ---- softcap:     tanh(logits / cap) * cap  (or  * (1 / cap))
          logits2d (M, V)           targets (M,) int   (any computation: shifts, F.pad(labels, (0, 1), value=ignore))
                   \\                /
                 cross_entropy(logits2d, targets, ignore_index=i, reduction=r, label_smoothing=eps)   [weight=None]

                 [logsumexp(logits2d, -1), after the cross_entropy: a z-loss, logging]

is replaced by::

    rows = <the same row views replayed on hidden * k, with D in place of V>       (M, D)
    fused = cce_inductor::linear_cross_entropy(rows, weight, targets, bias, cap, i, r, eps, options.encode(), full_lse,
                                              False)
    loss = fused[0].to(<dtype cross_entropy returned>)
    lse = fused[1].to(<dtype logsumexp returned>)          (only with logsumexp users: full_lse, every row's lse)

Every ``cross_entropy`` that is not rewritten gets a reason in :func:`cce_inductor.stats` and the
``cce_inductor`` log. The tables below are the whole vocabulary of the matcher. Sites on DTensors belong to
``tensor_parallel.py``, which reuses :func:`match_site` and :func:`replace_site` with its own loss call.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import operator
from typing import Any, Callable, Optional, Union

import torch
import torch.fx as fx
import torch.nn.functional as F

from .. import _dropped_logits, _loss, diagnostics
from ..options import CCEOptions

# --------------------------------------------------------------------------------------------------------------
# The patterns, as data: how each operation can be spelled in a Dynamo graph.
# A spelling is ("call_function", target) or ("call_method", name).
# --------------------------------------------------------------------------------------------------------------


def functions(*targets) -> set:
    return {("call_function", t) for t in targets}


def methods(*names) -> set:
    return {("call_method", n) for n in names}


CROSS_ENTROPY = functions(F.cross_entropy)
LINEAR = functions(F.linear, torch._C._nn.linear)
MATMUL = functions(operator.matmul, torch.matmul, torch.mm) | methods("matmul", "mm", "__matmul__")
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
LOGSUMEXP = functions(torch.logsumexp) | methods("logsumexp")
MUL = functions(operator.mul, torch.mul) | methods("mul")
DIV = functions(operator.truediv, torch.div, torch.true_divide) | methods("div", "true_divide")

SUPPORTED_DEVICES = ("cpu", "cuda")
_CE_SIGNATURE = inspect.signature(F.cross_entropy)


def _spelling(node: fx.Node):
    if node.op in ("call_function", "call_method"):
        return (node.op, node.target)
    return None


def matches(node: Any, spellings: set) -> bool:
    return isinstance(node, fx.Node) and _spelling(node) in spellings


def example_value(node: Any):
    """Dynamo's example value of ``node`` (a FakeTensor, SymInt, ...) or the constant itself."""
    if isinstance(node, fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


class NoMatch(Exception):
    """The site is left alone; the message says why (it reaches stats() and the log)."""


# --------------------------------------------------------------------------------------------------------------
# Matching
# --------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class RowStep:
    """One row view on the logits, to be replayed on the hidden states."""

    kind: str  # "reshape" | "flatten" | "getitem"
    args: tuple


@dataclasses.dataclass
class Site:
    cross_entropy: fx.Node
    head: fx.Node
    hidden: fx.Node
    weight: fx.Node
    weight_is_transposed: bool  # the graph holds weight as (D, V): pass weight.t() to the op
    bias: Optional[fx.Node]
    compute_dtype: torch.dtype
    row_steps: list[RowStep]  # in forward order
    softcap: Optional[float]
    scale: float  # constant factor on the logits before the softcap, folded into the hidden states and bias
    targets: fx.Node
    ignore_index: int
    reduction: str
    label_smoothing: float
    chain: list[fx.Node]  # head ... cross_entropy input, forward order
    escaping: list[fx.Node]  # chain nodes that are also graph outputs
    lse_users: list[fx.Node]  # logsumexp(cross_entropy input, -1) nodes: fed by the op's lse


def _short(node: fx.Node) -> str:
    if node.op == "call_method":
        return f"{node.name} (.{node.target}())"
    if node.op == "call_function":
        return f"{node.name} ({getattr(node.target, '__name__', node.target)})"
    return f"{node.name} ({node.op})"


def _const_float(value: Any) -> Optional[float]:
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


def _is_true_division(node: Any) -> bool:
    return matches(node, DIV) and len(node.args) == 2 and node.kwargs.get("rounding_mode") is None


def _match_softcap(node: fx.Node) -> Optional[tuple[float, fx.Node, list[fx.Node]]]:
    """``tanh(x / cap) * cap`` or ``tanh(x * (1/cap)) * cap`` ending at ``node``: (cap, x, inner nodes)."""
    if not matches(node, MUL):
        return None
    lhs, rhs = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("other")
    tanh_node, cap = (lhs, _const_float(rhs)) if matches(lhs, TANH) else (rhs, _const_float(lhs))
    if cap is None or not matches(tanh_node, TANH) or cap <= 0:
        return None
    scaled = tanh_node.args[0]
    if _is_true_division(scaled) and _const_float(scaled.args[1]) is not None:
        x, inner_cap = scaled.args[0], _const_float(scaled.args[1])
    elif matches(scaled, MUL):
        a, b = scaled.args[0], scaled.args[1]
        x, inv = (a, _const_float(b)) if _const_float(b) is not None else (b, _const_float(a))
        if inv is None or inv == 0:
            return None
        inner_cap = 1.0 / inv
    else:
        return None
    if not isinstance(x, fx.Node) or not math.isclose(inner_cap, cap, rel_tol=1e-6):
        return None
    return cap, x, [scaled, tanh_node]


def _match_scale(node: fx.Node) -> Optional[tuple[float, fx.Node]]:
    """``x * k``, ``k * x`` or ``x / k`` for a constant ``k`` (Cohere's logit_scale, Granite's logits_scaling)."""
    if matches(node, MUL) and len(node.args) == 2 and not node.kwargs:
        a, b = node.args
        if isinstance(a, fx.Node) and _const_float(b) is not None:
            return _const_float(b), a
        if isinstance(b, fx.Node) and _const_float(a) is not None:
            return _const_float(a), b
    if _is_true_division(node) and isinstance(node.args[0], fx.Node):
        divisor = _const_float(node.args[1])
        if divisor:
            return 1.0 / divisor, node.args[0]
    return None


def _reshape_shape(node: fx.Node) -> list:
    """The target shape of ``x.view(*shape)``, ``x.reshape(shape)`` or ``torch.reshape(x, shape)``."""
    if node.op == "call_function":
        args = node.args[1:] or (node.kwargs.get("shape"),)
    else:
        args = node.args[1:] or (node.kwargs.get("shape", node.kwargs.get("size")),)
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        return list(args[0])
    return list(args)


def call_arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``index`` (positional) or ``name`` (keyword) of a call; builtins have no inspectable signature."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _normalize_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _row_step(node: fx.Node, vocab) -> RowStep:
    """Classify a view on the logits; raise NoMatch if it touches the vocabulary dimension."""
    src, out = example_value(node.args[0]), example_value(node)
    if not isinstance(out, torch.Tensor) or out.dim() < 1 or out.shape[-1] != vocab:
        raise NoMatch(f"{_short(node)} changes the vocabulary dimension")
    if matches(node, RESHAPE):
        shape = _reshape_shape(node)
        if not shape or example_value(shape[-1]) not in (vocab, -1):
            raise NoMatch(f"{node.name} reshapes across the vocabulary dimension")
        if example_value(shape[-1]) == -1 and any(example_value(s) == -1 for s in shape[:-1]):
            raise NoMatch(f"{node.name} has two inferred dimensions")
        return RowStep("reshape", tuple(shape[:-1]))
    if matches(node, FLATTEN):
        start = _normalize_dim(call_arg(node, 1, "start_dim", 0), src.dim())
        end = _normalize_dim(call_arg(node, 2, "end_dim", -1), src.dim())
        if end >= src.dim() - 1:
            raise NoMatch(f"{node.name} flattens the vocabulary dimension into the rows")
        return RowStep("flatten", (start, end))
    if matches(node, GETITEM):
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        if any(i is None or isinstance(i, fx.Node) and isinstance(example_value(i), torch.Tensor) for i in index):
            raise NoMatch(f"{node.name} uses advanced indexing or None on the logits")
        if Ellipsis in index:
            last = index[-1]
            if index[-1] is not Ellipsis and last != slice(None):
                raise NoMatch(f"{node.name} slices the vocabulary dimension")
        elif len(index) >= src.dim() and index[src.dim() - 1] != slice(None):
            raise NoMatch(f"{node.name} slices the vocabulary dimension")
        return RowStep("getitem", (node.args[1],))
    raise AssertionError(node)


def upcast_target(node: fx.Node) -> Optional[torch.dtype]:
    """The dtype a cast node converts to, or None if the node is not a pure dtype cast."""
    if node.op == "call_method" and node.target in DTYPE_METHODS and len(node.args) == 1 and not node.kwargs:
        return DTYPE_METHODS[node.target]
    if matches(node, TO_DTYPE):
        dtypes = [a for a in list(node.args[1:]) + list(node.kwargs.values()) if isinstance(a, torch.dtype)]
        others = [a for a in node.args[1:] if not isinstance(a, torch.dtype)]
        others += [k for k in node.kwargs if k not in ("dtype", "copy", "non_blocking")]
        if len(dtypes) == 1 and not others:
            return dtypes[0]
    return None


def _match_head(node: fx.Node) -> tuple[fx.Node, fx.Node, bool, Optional[fx.Node]]:
    """(hidden, weight, weight_is_transposed, bias) of the linear layer producing ``node``."""
    if matches(node, LINEAR):
        bias = call_arg(node, 2, "bias")
        if bias is not None and not isinstance(bias, fx.Node):
            raise NoMatch(f"{node.name} has a non-tensor bias")
        return call_arg(node, 0, "input"), call_arg(node, 1, "weight"), False, bias
    if matches(node, MATMUL):
        hidden = node.args[0]
        rhs = call_arg(node, 1, "other")
        rhs_meta = example_value(rhs)
        if not isinstance(rhs_meta, torch.Tensor) or rhs_meta.dim() != 2:
            raise NoMatch(f"{node.name} multiplies by a {getattr(rhs_meta, 'dim', lambda: '?')()}-D tensor, not a weight matrix")
        weight = _transposed_source(rhs)
        if weight is not None:
            return hidden, weight, False, None
        return hidden, rhs, True, None
    raise NoMatch(
        f"the input of cross_entropy comes from {_short(node)}, "
        "not from a linear layer in the same graph (a graph break between the head and the loss?)"
    )


def _transposed_source(node: fx.Node) -> Optional[fx.Node]:
    """``w`` if ``node`` is ``w.T`` / ``w.t()`` / ``w.transpose(0, 1)`` / ``w.permute(1, 0)`` of a 2-D ``w``."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_function" and node.target is getattr and node.args[1] in TRANSPOSE_ATTRS:
        return node.args[0]
    if matches(node, TRANSPOSE_ATTR_OPS):
        return node.args[0]
    if matches(node, TRANSPOSE_2D):
        src, dims = node.args[0], node.args[1:]
        if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
            dims = tuple(dims[0])
        dims = tuple(_normalize_dim(d, 2) for d in dims if isinstance(d, int))
        kind = _spelling(node)[1]
        if kind in ("t", torch.t):
            return src
        if kind in ("transpose", torch.transpose) and sorted(dims) == [0, 1]:
            return src
        if kind in ("permute", torch.permute) and dims == (1, 0):  # permute(0, 1) is the identity
            return src
    return None


GRAD_MODE = functions(torch._C._set_grad_enabled)
# With VIEW_ATTR_OPS: torch 2.14's spelling of the view attributes, which are getattr nodes (followed below) before.
VIEW_LIKE = (
    RESHAPE | FLATTEN | GETITEM | IDENTITY_VIEW | TRANSPOSE_2D | VIEW_ATTR_OPS | methods("expand", "narrow", "detach")
)
INPLACE_FUNCTIONS = functions(
    operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ipow
)


def _mutated_tensor(node: fx.Node) -> Optional[fx.Node]:
    """The tensor an in-place node writes to, or None if the node does not mutate."""
    if node.op == "call_method" and node.target.endswith("_") and not node.target.startswith("_"):
        return node.args[0] if node.args else None
    if node.op == "call_function":
        if _spelling(node) in INPLACE_FUNCTIONS:
            return node.args[0]
        name = getattr(node.target, "__name__", "")
        if name.endswith("_") and not name.startswith("_") and node.args:
            return node.args[0]
        schema = getattr(node.target, "_schema", None)
        if schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
            return node.args[0] if node.args else None
    return None


def _storage_roots(node: Any) -> set:
    """``node`` and everything it may be a view of."""
    roots, stack = set(), [node]
    while stack:
        current = stack.pop()
        if not isinstance(current, fx.Node) or current in roots:
            continue
        roots.add(current)
        if matches(current, VIEW_LIKE) or (current.op == "call_function" and current.target is getattr):
            stack.append(current.args[0])
    return roots


def _check_nothing_in_between(head: fx.Node, ce: fx.Node, protected: list) -> None:
    """The fused op runs where cross_entropy ran: nothing between the head and it may change what it reads.

    Refuses a switch back to grad mode (a head computed under no_grad must stay non-differentiable) and an in-place
    update of the hidden states, the weight or the bias (or of anything they are views of).
    """
    protected_roots = set().union(*(_storage_roots(p) for p in protected))
    grad_enabled_at_loss = None  # unchanged since the head
    node = head.next
    while node is not ce and node.op != "output":
        if matches(node, GRAD_MODE):
            grad_enabled_at_loss = node.args[0] if node.args else node.kwargs.get("mode")
        mutated = _mutated_tensor(node)
        if mutated is not None and _storage_roots(mutated) & protected_roots:
            raise NoMatch(f"{_short(node)} updates an operand of the head in place before the loss")
        node = node.next
    # A loss under no_grad is non-differentiable either way; the reverse would make a no_grad head trainable.
    if grad_enabled_at_loss is not None and grad_enabled_at_loss is not False:
        raise NoMatch("the head runs under torch.no_grad but the loss does not")


@dataclasses.dataclass
class Logits:
    """The head and everything between it and the node a loss reads (row views, upcasts, scale, softcap)."""

    head: fx.Node
    hidden: fx.Node
    weight: fx.Node
    weight_is_transposed: bool
    bias: Optional[fx.Node]
    compute_dtype: torch.dtype
    row_steps: list[RowStep]
    softcap: Optional[float]
    scale: float
    chain: list[fx.Node]  # head ... the node the loss reads, forward order

    def fields(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def walk_logits(logits: fx.Node, consumer: fx.Node) -> Logits:
    """Walk back from ``logits`` (what ``consumer``, a loss, reads) to the linear head, or raise NoMatch."""
    logits_meta = example_value(logits)
    vocab = logits_meta.shape[-1]
    chain: list[fx.Node] = []  # logits ... head, backwards
    row_steps: list[RowStep] = []
    softcap: Optional[float] = None
    scale = 1.0
    scaled_after_softcap = False  # a factor met before the softcap on the way back is applied after it
    node = logits
    while True:
        if not isinstance(node, fx.Node):
            raise NoMatch(f"the input of {_short(consumer)} is not computed in the graph")
        chain.append(node)
        softcap_match = _match_softcap(node)
        if softcap_match is not None:
            if softcap is not None:
                raise NoMatch("logits are soft-capped twice")
            if scaled_after_softcap:
                raise NoMatch("logits are scaled after the softcap")
            softcap, node, inner = softcap_match
            chain.extend(inner[::-1])
            continue
        if matches(node, RESHAPE) or matches(node, FLATTEN) or matches(node, GETITEM):
            row_steps.append(_row_step(node, vocab))
            node = node.args[0]
            continue
        if matches(node, IDENTITY_VIEW):
            node = node.args[0]
            continue
        scale_match = _match_scale(node)
        if scale_match is not None:
            factor, node = scale_match
            scale *= factor
            scaled_after_softcap = scaled_after_softcap or softcap is None
            continue
        cast_to = upcast_target(node)
        if cast_to is not None:
            src_dtype = example_value(node.args[0]).dtype
            if cast_to not in _loss.SUPPORTED_DTYPES or torch.promote_types(src_dtype, cast_to) != cast_to:
                raise NoMatch(f"{node.name} casts the logits down from {src_dtype} to {cast_to}")
            node = node.args[0]
            continue
        break

    head = chain[-1]
    hidden, weight, weight_is_transposed, bias = _match_head(head)
    head_meta, hidden_meta, weight_meta = example_value(head), example_value(hidden), example_value(weight)
    if not all(isinstance(m, torch.Tensor) for m in (head_meta, hidden_meta, weight_meta)):
        raise NoMatch(f"{head.name}: operands are not tensors")
    if hidden_meta.dim() < 1 or head_meta.shape[-1] != vocab:
        raise NoMatch(f"{head.name} does not produce the vocabulary dimension of {_short(consumer)}")
    compute_dtype = head_meta.dtype
    if compute_dtype not in _loss.SUPPORTED_DTYPES:
        raise NoMatch(f"logits dtype {compute_dtype} is not supported")
    device = head_meta.device
    if device.type not in SUPPORTED_DEVICES:
        raise NoMatch(f"device {device} is not supported")
    if bias is not None:
        bias_meta = example_value(bias)
        if not isinstance(bias_meta, torch.Tensor) or tuple(bias_meta.shape) != (vocab,):
            raise NoMatch(f"the bias has shape {tuple(getattr(bias_meta, 'shape', ()))}, not (V,)")
    if scale != 1.0 and compute_dtype == torch.float16:
        # Folding the factor into fp16 hidden states could overflow where the fp32 logits would not.
        raise NoMatch("a constant logit scale on fp16 logits cannot be folded safely")
    _check_nothing_in_between(head, consumer, protected=[hidden, weight] + ([bias] if bias is not None else []))
    chain.reverse()
    return Logits(head=head, hidden=hidden, weight=weight, weight_is_transposed=weight_is_transposed, bias=bias,
                  compute_dtype=compute_dtype, row_steps=row_steps[::-1], softcap=softcap, scale=scale, chain=chain)


def private_chain(chain: list[fx.Node], consumer: fx.Node, allowed: list[fx.Node] = ()) -> list[fx.Node]:
    """The chain must be private to its loss (besides ``allowed`` users), except for being returned from the graph
    (Hugging Face models return their logits): returns those escaping nodes, or raises NoMatch."""
    escaping = []
    for i, node in enumerate(chain):
        next_node = chain[i + 1] if i + 1 < len(chain) else consumer
        others = [user for user in node.users if user is not next_node and user not in allowed]
        if any(user.op != "output" for user in others):
            names = ", ".join(_short(user) for user in others if user.op != "output")
            raise NoMatch(f"the logits ({node.name}) are also used by {names}, not only by the loss")
        if others:
            escaping.append(node)
    return escaping


def match_site(ce: fx.Node) -> Site:
    """Match the chain feeding one cross_entropy call, or raise NoMatch with the reason."""
    bound = _CE_SIGNATURE.bind(*ce.args, **ce.kwargs)
    bound.apply_defaults()
    args = bound.arguments
    if args["weight"] is not None:
        raise NoMatch("cross_entropy has class weights (weight=...)")
    label_smoothing = _const_float(args["label_smoothing"])
    if label_smoothing is None or not 0.0 <= label_smoothing <= 1.0:
        raise NoMatch(f"label_smoothing={args['label_smoothing']!r} is not a constant in [0, 1]")
    if args["size_average"] is not None or args["reduce"] is not None:
        raise NoMatch("cross_entropy uses the deprecated size_average/reduce arguments")
    if not isinstance(args["ignore_index"], int) or not isinstance(args["reduction"], str):
        raise NoMatch("ignore_index or reduction is not a constant")
    if args["reduction"] not in _loss.REDUCTIONS:
        raise NoMatch(f"unknown reduction {args['reduction']!r}")
    logits2d, targets = args["input"], args["target"]
    logits_meta, targets_meta = example_value(logits2d), example_value(targets)
    if not isinstance(logits_meta, torch.Tensor) or not isinstance(targets_meta, torch.Tensor):
        raise NoMatch("cross_entropy input or target is not a tensor")
    if targets_meta.dtype.is_floating_point:
        raise NoMatch("cross_entropy has probability (floating-point) targets")
    if targets_meta.dtype != torch.int64:
        raise NoMatch(f"targets are {targets_meta.dtype}, not int64 (eager cross_entropy rejects them)")
    if logits_meta.dim() != 2 or targets_meta.dim() != 1:
        raise NoMatch(
            f"cross_entropy input is {logits_meta.dim()}-D and target {targets_meta.dim()}-D; "
            "only (N, V) logits with (N,) class targets are matched"
        )
    logits = walk_logits(logits2d, ce)

    # A log-sum-exp of the loss's own logits (a z-loss) may read them too: the op computes it anyway.
    lse_users = [user for user in logits2d.users if is_row_logsumexp(user, logits2d)]
    position = {node: i for i, node in enumerate(ce.graph.nodes)}
    if any(position[user] < position[ce] for user in lse_users):
        raise NoMatch("logsumexp of the logits comes before the cross_entropy (only the other order is matched)")
    return Site(
        cross_entropy=ce,
        targets=targets,
        ignore_index=args["ignore_index"],
        reduction=args["reduction"],
        label_smoothing=label_smoothing,
        escaping=private_chain(logits.chain, ce, allowed=lse_users),
        lse_users=lse_users,
        **logits.fields(),
    )


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


# --------------------------------------------------------------------------------------------------------------
# Rewriting
# --------------------------------------------------------------------------------------------------------------


def _cast(graph: fx.Graph, node: fx.Node, dtype: torch.dtype) -> fx.Node:
    if example_value(node).dtype == dtype:
        return node
    return graph.call_method("to", (node, dtype))


def _hidden_size(graph: fx.Graph, hidden: fx.Node) -> Union[int, fx.Node]:
    size = example_value(hidden).shape[-1]
    if isinstance(size, int):
        return size
    return graph.call_method("size", (hidden, -1))


# What a rewrite puts in place of the cross_entropy: given the hidden-state rows (M, D), the (V, D) weight, the
# targets and the bias (None or (V,)), all in the logits' dtype, emit the loss nodes and return the last one.
EmitLoss = Callable[[fx.Graph, Site, fx.Node, fx.Node, fx.Node, Optional[fx.Node]], fx.Node]


def replace_site(graph: fx.Graph, site: Site, emit_loss: EmitLoss) -> None:
    """Replace the matched site by ``emit_loss``'s nodes: replay the row views on the hidden states, fold the
    scale, hand the operands to ``emit_loss``, cast its loss to cross_entropy's dtype, drop escaping logits and
    erase the chain. Shared by every pass that rewrites a ``linear -> cross_entropy`` site."""
    with graph.inserting_before(site.cross_entropy):
        rows, weight, bias = _operands(graph, site)
        loss = emit_loss(graph, site, rows, weight, site.targets, bias)
    _retire(graph, site, loss)


def _operands(graph: fx.Graph, site: Site) -> tuple[fx.Node, fx.Node, Optional[fx.Node]]:
    """``(rows, weight, bias)`` for the op, at the graph's insertion point: the row views replayed on the hidden
    states, the logits' dtype, the scale folded in."""
    return (_rows(graph, site),) + _head_operands(graph, site)


def _rows(graph: fx.Graph, site: Site) -> fx.Node:
    rows = _cast(graph, site.hidden, site.compute_dtype)
    if site.scale != 1.0:
        rows = graph.call_function(operator.mul, (rows, site.scale))
    hidden_size = _hidden_size(graph, site.hidden)
    for step in site.row_steps:
        if step.kind == "reshape":
            rows = graph.call_method("reshape", (rows, *step.args, hidden_size))
        elif step.kind == "flatten":
            rows = graph.call_method("flatten", (rows, *step.args))
        else:
            rows = graph.call_function(operator.getitem, (rows, *step.args))
    return rows


def _head_operands(graph: fx.Graph, site: Site) -> tuple[fx.Node, Optional[fx.Node]]:
    weight = _cast(graph, site.weight, site.compute_dtype)
    if site.weight_is_transposed:
        weight = graph.call_method("t", (weight,))
    bias = None if site.bias is None else _cast(graph, site.bias, site.compute_dtype)
    if bias is not None and site.scale != 1.0:
        bias = graph.call_function(operator.mul, (bias, site.scale))
    return weight, bias


def _retire(graph: fx.Graph, site: Site, loss: fx.Node) -> None:
    """``loss`` (fp32, or fp64 for fp64 logits) takes the place of the site's cross_entropy; the escaping logits
    become ``dropped_logits`` placeholders (drop_logits); the chain goes."""
    ce = site.cross_entropy
    out_dtype = example_value(ce).dtype
    if out_dtype != torch.float32:
        with graph.inserting_after(loss):
            loss = graph.call_method("to", (loss, out_dtype))
    ce.replace_all_uses_with(loss)
    graph.erase_node(ce)

    if site.escaping:
        # drop_logits: the returned logits become a placeholder of their shape that raises on use
        # (cce_inductor/_dropped_logits.py); check_escaping made sure each shape can be rebuilt.
        output = next(n for n in graph.nodes if n.op == "output")
        for node in site.escaping:
            recipe = _dropped_logits.shape_recipe(node, _dropped_logits.shape_sources(site))
            with graph.inserting_before(output):
                placeholder = _dropped_logits.emit(graph, node, site, recipe)
            output.replace_input_with(node, placeholder)

    for node in reversed(site.chain):
        if not node.users:
            transposed_weight = site.head.args[1] if node is site.head and matches(site.head, MATMUL) else None
            graph.erase_node(node)
            if isinstance(transposed_weight, fx.Node) and not transposed_weight.users:
                if _transposed_source(transposed_weight) is not None:
                    graph.erase_node(transposed_weight)


def requires_grad(node: Any) -> bool:
    value = example_value(node)
    return isinstance(value, torch.Tensor) and value.requires_grad


def lean_path_reason(site: Site, options: CCEOptions) -> Optional[str]:
    """None where the site takes the balanced path (its gradients computed with the loss, ``options.scratch_mb``),
    else why it keeps the lean one. What requires grad is known here: Dynamo traced the graph with it, and guards
    on it (the loss itself: a head computed with grad whose loss is taken under no_grad needs no gradient)."""
    why = _loss.lean_path_reason(options, site.reduction, requires_grad(site.cross_entropy))
    if why is None and site.lse_users:
        return "the log-sum-exp is used beyond the loss (a z-loss)"
    return why


def _fused_loss(options: CCEOptions) -> EmitLoss:
    def emit(graph: fx.Graph, site: Site, rows, weight, targets, bias) -> fx.Node:
        if lean_path_reason(site, options) is None:
            need = (requires_grad(site.hidden), requires_grad(site.weight),
                    site.bias is not None and requires_grad(site.bias))
            fused = graph.call_function(
                torch.ops.cce_inductor.linear_cross_entropy_with_grads.default,
                (rows, weight, targets, bias, site.softcap, site.ignore_index, site.reduction, site.label_smoothing,
                 options.encode(), *need),
            )  # fmt: skip
            return graph.call_function(operator.getitem, (fused, 0))
        fused = graph.call_function(
            torch.ops.cce_inductor.linear_cross_entropy.default,
            (rows, weight, targets, bias, site.softcap, site.ignore_index, site.reduction, site.label_smoothing,
             options.encode(), bool(site.lse_users), False),
        )
        lse_dtype = torch.float64 if site.compute_dtype == torch.float64 else torch.float32
        for user in site.lse_users:
            lse = graph.call_function(operator.getitem, (fused, 1))
            if example_value(user).dtype != lse_dtype:
                lse = graph.call_method("to", (lse, example_value(user).dtype))
            user.replace_all_uses_with(lse)
            graph.erase_node(user)
        return graph.call_function(operator.getitem, (fused, 0))

    return emit


PER_ROW_OUTPUTS = "per-row outputs (the balanced path computes 'mean' and 'sum' losses)"


def lean_only(options: CCEOptions, why: str = PER_ROW_OUTPUTS) -> str:
    """The suffix of the record of a site that always takes the lean path (per-row outputs: token log-probs,
    entropy; the vocabulary-parallel loss): why, when a balanced path was asked for."""
    return f"; lean path: {why}" if options.scratch_mb else ""


def path_decision(graph_id: int, site: Site, options: CCEOptions, description: str,
                  lean_reason: Optional[str]) -> diagnostics.SiteDecision:
    """The rewritten site's record for ``stats()``: which path it got, and (when the balanced path was asked for)
    why not."""
    if lean_reason is None:
        return diagnostics.SiteDecision(graph_id, site.cross_entropy.name, True,
                                        f"{description}; balanced path ({options.scratch_mb} MiB scratch)", "balanced")
    return diagnostics.SiteDecision(graph_id, site.cross_entropy.name, True,
                                    description + lean_only(options, lean_reason), "lean")


def describe_site(site: Site) -> str:
    parts = [f"{site.head.name}: {'matmul' if matches(site.head, MATMUL) else 'linear'}"]
    if site.bias is not None:
        parts.append("bias")
    if site.scale != 1.0:
        parts.append(f"scale={site.scale:g}")
    if site.softcap is not None:
        parts.append(f"softcap={site.softcap:g}")
    parts.append(f"reduction={site.reduction}")
    parts.append(f"ignore_index={site.ignore_index}")
    if site.label_smoothing:
        parts.append(f"label_smoothing={site.label_smoothing:g}")
    if site.lse_users:
        parts.append("log-sum-exp reused")
    if site.escaping:
        parts.append("logits dropped from the outputs")
    return ", ".join(parts)


def is_dtensor(value: Any) -> bool:
    return type(value).__name__ == "DTensor" and type(value).__module__.startswith("torch.distributed")


def cross_entropy_input(ce: fx.Node) -> Any:
    return call_arg(ce, 0, "input")


def decide(graph_id: int, node: fx.Node, match: Callable[[], Any], prefix: str = "") -> Any:
    """``match()`` for the site at ``node``, or None with the reason recorded for ``stats()``: a NoMatch's message,
    or for any other error "not understood" (a graph shape the matcher does not know must never break compilation).
    Shared by every pass."""
    try:
        return match()
    except NoMatch as why:
        reason = str(why)
    except Exception as exc:  # noqa: BLE001
        reason = f"not understood ({type(exc).__name__}: {exc})"
    diagnostics.record(diagnostics.SiteDecision(graph_id, node.name, False, prefix + reason))
    return None


def check_escaping(site: Site, options: CCEOptions) -> None:
    """Logits returned from the graph may only be replaced by a placeholder (same shape and dtype, raising on any
    use; see ``cce_inductor/_dropped_logits.py``) when the user opted in, and only when their shape can be rebuilt
    from nodes that stay in the graph."""
    if not site.escaping:
        return
    if not options.drop_logits:
        names = ", ".join(n.name for n in site.escaping)
        raise NoMatch(
            f"logits escape the compiled region ({names} is a graph output, as in Hugging Face models); "
            "set CCE_INDUCTOR_DROP_LOGITS=1 or cce_inductor.make_backend(drop_logits=True) "
            "to return, in their place, a placeholder that raises on use"
        )
    if _compiling_with_cuda_graphs():
        # Inductor's CUDA graphs hand their outputs back as plain tensors over the recorded memory: the placeholder
        # would come back as an ordinary (NaN-filled) tensor that no longer raises on use.
        raise NoMatch(
            "logits escape the compiled region and this graph is compiled with CUDA graphs (mode='reduce-overhead'), "
            "which return plain tensors: a dropped-logits placeholder could not raise on use there"
        )
    for node in site.escaping:
        recipe = _dropped_logits.shape_recipe(node, _dropped_logits.shape_sources(site))
        if isinstance(recipe, str):
            raise NoMatch(f"the returned logits cannot be replaced by a placeholder: {recipe}")


def _compiling_with_cuda_graphs() -> bool:
    """Whether the graph being compiled will run as Inductor CUDA graphs (``mode="reduce-overhead"`` sets this
    config for the duration of the compile, the pre-grad pass included)."""
    import torch._inductor.config as inductor_config  # noqa: PLC0415 - only needed while compiling

    return bool(inductor_config.triton.cudagraphs)


def _checked(site: Site, options: CCEOptions) -> Site:
    check_escaping(site, options)
    dtensor_operand = next(
        (n.name for n in (site.hidden, site.weight, site.bias, site.targets) if is_dtensor(example_value(n))), None
    )
    if dtensor_operand is not None:
        raise NoMatch(f"{dtensor_operand} is a DTensor but the logits are not: an unsupported parallel layout")
    return site


def rewrite_linear_cross_entropy(graph: fx.Graph, options: CCEOptions, graph_id: Optional[int] = None) -> int:
    """Rewrite every matching site on plain tensors in ``graph``; returns how many were rewritten. Sites whose
    logits are DTensors are ``tensor_parallel.py``'s (run first by ``fx_passes.rewrite_graph``)."""
    sites = [n for n in graph.nodes
             if matches(n, CROSS_ENTROPY) and not is_dtensor(example_value(cross_entropy_input(n)))]  # fmt: skip
    if graph_id is None:
        graph_id = diagnostics.new_graph()
    emit = _fused_loss(options)
    rewritten = 0
    matched: list[Site] = []
    for ce in sites:
        site = decide(graph_id, ce, lambda ce=ce: _checked(match_site(ce), options))
        if site is not None:
            matched.append(site)
    for group in _chunk_groups(matched):
        merged = f"; one call with {len(group) - 1} other chunk(s) of this head" if len(group) > 1 else ""
        chunked = "chunks of one head are fused with reduction='none'" if len(group) > 1 else None
        decisions = [path_decision(graph_id, site, options, describe_site(site) + merged,
                                   chunked or lean_path_reason(site, options)) for site in group]
        if len(group) > 1:
            _replace_chunks(graph, group, options)
        else:
            replace_site(graph, group[0], emit)
        for decision in decisions:
            diagnostics.record(decision)
        rewritten += len(group)
    if not sites:
        diagnostics.log.debug("cce_inductor: graph %d has no cross_entropy call on plain tensors", graph_id)
    if rewritten:
        graph.lint()
    return rewritten


# --------------------------------------------------------------------------------------------------------------
# Chunked heads: one call for the sites that share a head
# --------------------------------------------------------------------------------------------------------------
#
# torchtune-style code applies the head to chunks of the hidden states and takes a cross-entropy per chunk:
#
#     chunk_k = hidden.chunk(n, dim=1)[k];  loss_k = cross_entropy(linear(chunk_k, W).reshape(-1, V), labels_k)
#
# One fused call per chunk would pay the per-call costs n times (a full V x D dC per chunk, summed by autograd, and
# underfilled grids). Sites with the same head (weight, bias, scale, softcap) and loss settings become one call over
# the concatenated rows with reduction "none"; each chunk's loss is then its own slice of the per-row losses,
# reduced as its cross_entropy asked, so every use of every chunk's loss sees eager's value.


def _chunk_key(site: Site) -> Optional[tuple]:
    if site.escaping or site.lse_users:
        return None
    return (site.weight, site.weight_is_transposed, site.bias, site.scale, site.softcap, site.ignore_index,
            site.label_smoothing, site.compute_dtype)  # fmt: skip


def _chunk_groups(sites: list[Site]) -> list[list[Site]]:
    """Sites grouped for one call each: same head and settings, and every operand computed before the first loss
    of the group (the call goes there)."""
    groups: dict = {}
    singles = []
    for site in sites:
        key = _chunk_key(site)
        if key is None:
            singles.append([site])
        else:
            groups.setdefault(key, []).append(site)
    result = singles
    for group in groups.values():
        if len(group) == 1:
            result.append(group)
            continue
        position = {node: i for i, node in enumerate(group[0].cross_entropy.graph.nodes)}
        group.sort(key=lambda site: position[site.cross_entropy])
        operands = [n for site in group for n in (site.hidden, site.targets, site.weight, site.bias)
                    if isinstance(n, fx.Node)]  # fmt: skip
        first = group[0].cross_entropy
        if all(position[n] < position[first] for n in operands) and not _changed_between(group[0], group[-1], operands):
            result.append(group)
        else:
            result.extend([site] for site in group)
    return result


def _changed_between(first: Site, last: Site, operands: list[fx.Node]) -> bool:
    """Whether, between the group's first and last loss, an operand is updated in place or grad mode switches: the
    one call runs at the first loss, so every loss must read what it would have read there."""
    roots = set().union(*(_storage_roots(n) for n in operands))
    node = first.cross_entropy.next
    while node is not last.cross_entropy:
        mutated = _mutated_tensor(node)
        if matches(node, GRAD_MODE) or (mutated is not None and _storage_roots(mutated) & roots):
            return True
        node = node.next
    return False


def _row_count(graph: fx.Graph, targets: fx.Node) -> Union[int, fx.Node]:
    size = example_value(targets).shape[0]
    return size if isinstance(size, int) else graph.call_method("size", (targets, 0))


def _replace_chunks(graph: fx.Graph, group: list[Site], options: CCEOptions) -> None:
    head = group[0]
    with graph.inserting_before(head.cross_entropy):
        rows = graph.call_function(torch.cat, ([_rows(graph, site) for site in group], 0))
        weight, bias = _head_operands(graph, head)  # the same for every site of the group
        targets = graph.call_function(torch.cat, ([site.targets for site in group], 0))
        fused = graph.call_function(
            torch.ops.cce_inductor.linear_cross_entropy.default,
            (rows, weight, targets, bias, head.softcap, head.ignore_index, "none", head.label_smoothing,
             options.encode(), False, False),
        )  # fmt: skip
        row_loss = graph.call_function(operator.getitem, (fused, 0))
        pieces = graph.call_function(torch.split, (row_loss, [_row_count(graph, site.targets) for site in group]))
        losses = []
        for k, site in enumerate(group):
            piece = graph.call_function(operator.getitem, (pieces, k))
            if site.reduction == "sum":
                piece = graph.call_method("sum", (piece,))
            elif site.reduction == "mean":  # over the chunk's counted rows: 0/0 = NaN when all are ignored, as eager
                counted = graph.call_function(operator.ne, (site.targets, site.ignore_index))
                piece = graph.call_function(operator.truediv,
                                            (graph.call_method("sum", (piece,)), graph.call_method("sum", (counted,))))
            losses.append(piece)
    for site, loss in zip(group, losses):
        _retire(graph, site, loss)
