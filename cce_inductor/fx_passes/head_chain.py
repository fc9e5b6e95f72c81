"""From what a loss reads back to the linear head: the chain every pass must understand before it rewrites.

Real code puts row views, upcasts, a constant scale and a softcap between the head and the loss. Walking back
from the node a loss reads (:func:`walk_logits`)::

    hidden (..., D)   weight (V, D) | weight_t (D, V)   [bias (V,)]
          \\                 |                           /
           linear(hidden, weight, bias) | hidden @ weight.T | matmul(hidden, weight_t)      <- the head
             | addmm(bias, hidden, weight.t() | weight_t)
                  |
                  |   bias:       logits + bias, bias + logits, torch.add / .add, in place (logits += bias,
                  |               logits.add_(bias)), for a (V,) bias, at most one; row views before it, never a
                  |               scale or softcap (only the head's product gets the bias; ``added_bias.py``)
                  |   row views:  view / reshape / flatten over leading dims, contiguous, getitem slices of leading
                  |               dims (the label shift ``logits[..., :-1, :]``)
                  |   upcasts:    .float(), .to(torch.float32)
                  |   scale:      logits * k, logits / k        (constant k; before any softcap)
                  |   softcap:    tanh(logits / cap) * cap       (or tanh(logits * (1 / cap)) * cap)
                  v
            what the loss reads

gives a :class:`Logits`: the head's operands, the row views in forward order (to be replayed on the hidden
states), the scale, the softcap and the chain's nodes. Anything else in the chain (a vocabulary slice, a downcast,
a non-tanh softcap, an in-place update of an operand, a switch back to grad mode) raises :class:`NoMatch` with
the reason ``stats()`` shows, and so does a head eager PyTorch would refuse (operands of two dtypes that autocast
does not reconcile, or on two devices): a rewrite must fail where eager fails. :func:`private_chain` then checks
that nothing else reads the chain.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.fx as fx

from .._checks import SUPPORTED_DTYPES, head_dtype_error
from .added_bias import added_bias_error, match_bias_add, through_inplace_add
from .graph_facts import mutated_tensor, storage_roots, transposed_source
from .spellings import (
    ADDMM,
    AUTOCAST_ENTER,
    AUTOCAST_EXIT,
    DIV,
    DTYPE_METHODS,
    EINSUM,
    FLATTEN,
    GETITEM,
    GRAD_MODE,
    IDENTITY_VIEW,
    LINEAR,
    MATMUL,
    MUL,
    RESHAPE,
    TANH,
    TO_DTYPE,
    call_arg,
    const_float,
    example_value,
    matches,
    normalize_dim,
    short,
    spelling,
)

SUPPORTED_DEVICES = ("cpu", "cuda")


class NoMatch(Exception):
    """The site is left alone; the message says why (it reaches stats() and the log)."""


@dataclasses.dataclass
class RowStep:
    """One row view on the logits, to be replayed on the hidden states."""

    kind: str  # "reshape" | "flatten" | "getitem"
    args: tuple


@dataclasses.dataclass
class Logits:
    """The head and everything between it and the node a loss reads (row views, upcasts, scale, softcap)."""

    head: fx.Node
    hidden: fx.Node
    weight: fx.Node
    weight_is_transposed: bool  # the graph holds weight as (D, V): pass weight.t() to the op
    bias: fx.Node | None
    compute_dtype: torch.dtype
    row_steps: list[RowStep]  # in forward order
    softcap: float | None
    scale: float  # constant factor on the logits before the softcap, folded into the hidden states and bias
    chain: list[fx.Node]  # head ... the node the loss reads, forward order

    def fields(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def _is_true_division(node: Any) -> bool:
    return matches(node, DIV) and len(node.args) == 2 and node.kwargs.get("rounding_mode") is None


def _match_softcap(node: fx.Node) -> tuple[float, fx.Node, list[fx.Node]] | None:
    """``tanh(x / cap) * cap`` or ``tanh(x * (1/cap)) * cap`` ending at ``node``: (cap, x, inner nodes)."""
    if not matches(node, MUL):
        return None
    lhs, rhs = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("other")
    tanh_node, cap = (lhs, const_float(rhs)) if matches(lhs, TANH) else (rhs, const_float(lhs))
    if cap is None or not matches(tanh_node, TANH) or cap <= 0:
        return None
    scaled = tanh_node.args[0]
    if _is_true_division(scaled) and const_float(scaled.args[1]) is not None:
        x, inner_cap = scaled.args[0], const_float(scaled.args[1])
    elif matches(scaled, MUL):
        a, b = scaled.args[0], scaled.args[1]
        x, inv = (a, const_float(b)) if const_float(b) is not None else (b, const_float(a))
        if inv is None or inv == 0:
            return None
        inner_cap = 1.0 / inv
    else:
        return None
    if not isinstance(x, fx.Node) or not math.isclose(inner_cap, cap, rel_tol=1e-6):
        return None
    return cap, x, [scaled, tanh_node]


def _match_scale(node: fx.Node) -> tuple[float, fx.Node] | None:
    """``x * k``, ``k * x`` or ``x / k`` for a constant ``k`` (Cohere's logit_scale, Granite's logits_scaling)."""
    if matches(node, MUL) and len(node.args) == 2 and not node.kwargs:
        a, b = node.args
        if isinstance(a, fx.Node) and const_float(b) is not None:
            return const_float(b), a
        if isinstance(b, fx.Node) and const_float(a) is not None:
            return const_float(a), b
    if _is_true_division(node) and isinstance(node.args[0], fx.Node):
        divisor = const_float(node.args[1])
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


def _row_step(node: fx.Node, vocab) -> RowStep:
    """Classify a view on the logits; raise NoMatch if it touches the vocabulary dimension."""
    src, out = example_value(node.args[0]), example_value(node)
    if not isinstance(out, torch.Tensor) or out.dim() < 1 or out.shape[-1] != vocab:
        raise NoMatch(f"{short(node)} changes the vocabulary dimension")
    if matches(node, RESHAPE):
        shape = _reshape_shape(node)
        if not shape or example_value(shape[-1]) not in (vocab, -1):
            raise NoMatch(f"{node.name} reshapes across the vocabulary dimension")
        if example_value(shape[-1]) == -1 and any(example_value(s) == -1 for s in shape[:-1]):
            raise NoMatch(f"{node.name} has two inferred dimensions")
        return RowStep("reshape", tuple(shape[:-1]))
    if matches(node, FLATTEN):
        start = normalize_dim(call_arg(node, 1, "start_dim", 0), src.dim())
        end = normalize_dim(call_arg(node, 2, "end_dim", -1), src.dim())
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


def upcast_target(node: fx.Node) -> torch.dtype | None:
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


def _match_head(node: fx.Node) -> tuple[fx.Node, fx.Node, bool, fx.Node | None]:
    """(hidden, weight, weight_is_transposed, bias) of the linear layer producing ``node``."""
    if matches(node, LINEAR):
        bias = call_arg(node, 2, "bias")
        if bias is not None and not isinstance(bias, fx.Node):
            raise NoMatch(f"{node.name} has a non-tensor bias")
        return call_arg(node, 0, "input"), call_arg(node, 1, "weight"), False, bias
    if matches(node, MATMUL):
        return (node.args[0], *_weight_operand(node, call_arg(node, 1, "other")), None)
    if matches(node, ADDMM):
        if const_float(node.kwargs.get("beta", 1)) != 1.0 or const_float(node.kwargs.get("alpha", 1)) != 1.0:
            raise NoMatch(f"{short(node)} scales its bias or its product (beta, alpha)")
        bias = call_arg(node, 0, "input")
        if not isinstance(bias, fx.Node):
            raise NoMatch(f"{node.name} has a non-tensor bias")
        return (call_arg(node, 1, "mat1"), *_weight_operand(node, call_arg(node, 2, "mat2")), bias)
    if matches(node, EINSUM):
        return (*_einsum_operands(node), None)
    if node.op == "placeholder":
        raise NoMatch(
            f"the input of cross_entropy comes from {short(node)}, not from a linear layer in the same graph "
            "(a graph break between the head and the loss?)"
        )
    raise NoMatch(f"the input of cross_entropy comes from {short(node)}, which is not a linear layer")


def _einsum_operands(node: fx.Node) -> tuple[fx.Node, fx.Node, bool]:
    """(hidden, weight, weight_is_transposed) of ``einsum("...d,vd->...v", hidden, weight)``, or of ``"...d,dv->...v"``
    (the weight held as (D, V)): one contracted letter, the last of the hidden states' and one of the weight's two,
    the output the hidden states' other letters and then the weight's other. Else NoMatch, naming the equation."""
    equation, *operands = node.args
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    eq = equation.replace(" ", "") if isinstance(equation, str) else ""
    lhs, _, out = eq.partition("->")
    terms = lhs.split(",")
    why = f"{short(node)}'s equation {equation!r} is not a linear head ('...d,vd->...v' or '...d,dv->...v')"
    if len(operands) != 2 or len(terms) != 2 or not out or len(terms[1]) != 2 or not terms[0]:
        raise NoMatch(why)
    hidden_terms, weight_terms = terms
    contracted, rows = hidden_terms[-1], hidden_terms[:-1]
    letters = rows.replace("...", "")
    if contracted not in weight_terms or weight_terms[0] == weight_terms[1]:
        raise NoMatch(why)
    vocab = weight_terms[1] if weight_terms[0] == contracted else weight_terms[0]
    if out != rows + vocab or len(set(letters)) != len(letters) or {contracted, vocab} & set(letters):
        raise NoMatch(why)
    return operands[0], operands[1], weight_terms == contracted + vocab


def _weight_operand(head: fx.Node, rhs: Any) -> tuple[fx.Node, bool]:
    """The weight of ``hidden @ rhs``: ``w`` for ``rhs = w.T`` (weight_is_transposed False), else ``rhs`` (D, V)."""
    rhs_meta = example_value(rhs)
    if not isinstance(rhs_meta, torch.Tensor) or rhs_meta.dim() != 2:
        raise NoMatch(
            f"{head.name} multiplies by a {getattr(rhs_meta, 'dim', lambda: '?')()}-D tensor, not a weight matrix"
        )
    weight = transposed_source(rhs)
    return (weight, False) if weight is not None else (rhs, True)


def _autocast_at(node: fx.Node, device_type: str) -> torch.dtype | None:
    """The autocast dtype in effect where the graph computes ``node`` on ``device_type``, or None (autocast off): the
    state this compile runs under (Dynamo guards on it), changed by the graph's own autocast regions before ``node``."""
    enabled = torch.is_autocast_enabled(device_type)
    states = [torch.get_autocast_dtype(device_type) if enabled else None]
    for current in node.graph.nodes:
        if current is node:
            break
        if matches(current, AUTOCAST_ENTER):
            device, dtype = call_arg(current, 0, "device_type"), call_arg(current, 1, "dtype")
            on = call_arg(current, 2, "enabled", True)
            if device != device_type:
                states.append(states[-1])
            else:
                states.append((dtype or torch.get_autocast_dtype(device_type)) if on else None)
        elif matches(current, AUTOCAST_EXIT) and len(states) > 1:
            states.pop()
    return states[-1]


def _check_nothing_in_between(head: fx.Node, loss: fx.Node, protected: list) -> None:
    """The fused op runs where the loss ran: nothing between the head and it may change what it reads.

    Refuses a switch back to grad mode (a head computed under no_grad must stay non-differentiable) and an in-place
    update of the hidden states, the weight or the bias (or of anything they are views of).
    """
    protected_roots = set().union(*(storage_roots(p) for p in protected))
    grad_enabled_at_loss = None  # unchanged since the head
    node = head.next
    while node is not loss and node.op != "output":
        if matches(node, GRAD_MODE):
            grad_enabled_at_loss = node.args[0] if node.args else node.kwargs.get("mode")
        mutated = mutated_tensor(node)
        if mutated is not None and storage_roots(mutated) & protected_roots:
            raise NoMatch(f"{short(node)} updates an operand of the head in place before the loss")
        node = node.next
    # A loss under no_grad is non-differentiable either way; the reverse would make a no_grad head trainable.
    if grad_enabled_at_loss is not None and grad_enabled_at_loss is not False:
        raise NoMatch("the head runs under torch.no_grad but the loss does not")


def walk_logits(logits: fx.Node, consumer: fx.Node) -> Logits:
    """Walk back from ``logits`` (what ``consumer``, a loss, reads) to the linear head, or raise NoMatch."""
    logits_meta = example_value(logits)
    vocab = logits_meta.shape[-1]
    chain: list[fx.Node] = []  # logits ... head, backwards
    row_steps: list[RowStep] = []
    softcap: float | None = None
    scale = 1.0
    scaled_after_softcap = False  # a factor met before the softcap on the way back is applied after it
    bias_add: tuple[fx.Node, fx.Node] | None = None  # (the add node, the bias) of a bias added to the product
    node, reader = logits, consumer
    while True:
        if not isinstance(node, fx.Node):
            raise NoMatch(f"the input of {short(consumer)} is not computed in the graph")
        node = through_inplace_add(node, reader, vocab)
        chain.append(node)
        reader = node
        softcap_match = _match_softcap(node)
        if softcap_match is not None:
            if softcap is not None:
                raise NoMatch("logits are soft-capped twice")
            if scaled_after_softcap:
                raise NoMatch("logits are scaled after the softcap")
            if bias_add is not None:
                raise NoMatch("logits are soft-capped before the bias is added")
            softcap, node, inner = softcap_match
            chain.extend(inner[::-1])
            reader = inner[0]
            continue
        if matches(node, RESHAPE) or matches(node, FLATTEN) or matches(node, GETITEM):
            row_steps.append(_row_step(node, vocab))
            node = node.args[0]
            continue
        if matches(node, IDENTITY_VIEW):
            node = node.args[0]
            continue
        bias_match = match_bias_add(node, vocab)
        if bias_match is not None:
            if bias_add is not None:
                raise NoMatch("two biases are added to the logits")
            bias_add = (node, bias_match[1])
            node = bias_match[0]
            continue
        scale_match = _match_scale(node)
        if scale_match is not None:
            if bias_add is not None:
                raise NoMatch("logits are scaled before the bias is added")
            factor, node = scale_match
            scale *= factor
            scaled_after_softcap = scaled_after_softcap or softcap is None
            continue
        cast_to = upcast_target(node)
        if cast_to is not None:
            src_dtype = example_value(node.args[0]).dtype
            if cast_to not in SUPPORTED_DTYPES or torch.promote_types(src_dtype, cast_to) != cast_to:
                raise NoMatch(f"{node.name} casts the logits down from {src_dtype} to {cast_to}")
            node = node.args[0]
            continue
        break

    head = chain[-1]
    hidden, weight, weight_is_transposed, bias = _match_head(head)
    compute_dtype, device = _check_head(head, hidden, weight, bias, vocab, consumer)
    if bias_add is not None:
        if bias is not None:
            raise NoMatch(f"{head.name} has a bias and {bias_add[0].name} adds another")
        bias = bias_add[1]
        why = added_bias_error(bias_add[0], bias, chain, compute_dtype, device)
        if why:
            raise NoMatch(why)
    if scale != 1.0 and compute_dtype == torch.float16:
        # Folding the factor into fp16 hidden states could overflow where the fp32 logits would not.
        raise NoMatch("a constant logit scale on fp16 logits cannot be folded safely")
    _check_nothing_in_between(head, consumer, protected=[hidden, weight] + ([bias] if bias is not None else []))
    chain.reverse()
    return Logits(
        head=head,
        hidden=hidden,
        weight=weight,
        weight_is_transposed=weight_is_transposed,
        bias=bias,
        compute_dtype=compute_dtype,
        row_steps=row_steps[::-1],
        softcap=softcap,
        scale=scale,
        chain=chain,
    )


def _check_head(head: fx.Node, hidden: fx.Node, weight: fx.Node, bias: fx.Node | None, vocab, consumer: fx.Node):
    """The head's dtype and device, or NoMatch where its operands are not tensors, it does not produce the loss's
    vocabulary dimension, its dtype or device is not supported, its bias is not ``(V,)``, or eager refuses it."""
    head_meta, hidden_meta, weight_meta = example_value(head), example_value(hidden), example_value(weight)
    if not all(isinstance(m, torch.Tensor) for m in (head_meta, hidden_meta, weight_meta)):
        raise NoMatch(f"{head.name}: operands are not tensors")
    if hidden_meta.dim() < 1 or head_meta.shape[-1] != vocab:
        raise NoMatch(f"{head.name} does not produce the vocabulary dimension of {short(consumer)}")
    if head_meta.dtype not in SUPPORTED_DTYPES:
        raise NoMatch(f"logits dtype {head_meta.dtype} is not supported")
    if head_meta.device.type not in SUPPORTED_DEVICES:
        raise NoMatch(f"device {head_meta.device} is not supported")
    if bias is not None:
        bias_meta = example_value(bias)
        if not isinstance(bias_meta, torch.Tensor) or tuple(bias_meta.shape) != (vocab,):
            raise NoMatch(f"the bias has shape {tuple(getattr(bias_meta, 'shape', ()))}, not (V,)")
    _check_as_eager(head, hidden, weight, bias)
    return head_meta.dtype, head_meta.device


def _check_as_eager(head: fx.Node, hidden: fx.Node, weight: fx.Node, bias: fx.Node | None) -> None:
    """NoMatch where eager's head would raise and the fused call would not: operands on two devices, or of two
    dtypes that autocast (if on where the head runs) does not reconcile. The site is left alone, so eager's error
    is what the compiled code raises (a rewrite would compute in the head's dtype: a bf16 weight upcast beside
    fp32 hidden states, say)."""
    device = example_value(head).device
    operands = {"hidden states": hidden, "weight": weight, "bias": bias}
    metas = {name: example_value(node) for name, node in operands.items() if node is not None}
    for name, meta in metas.items():
        if meta.device != device:
            raise NoMatch(
                f"the head's {name} on {meta.device}, its output on {device}: eager raises, so the site is left to it"
            )
    why = head_dtype_error(
        metas["hidden states"].dtype,
        metas["weight"].dtype,
        metas["bias"].dtype if "bias" in metas else None,
        _autocast_at(head, device.type),
    )
    if why:
        raise NoMatch(why)


def private_chain(chain: list[fx.Node], consumer: fx.Node, allowed: list[fx.Node] = ()) -> list[fx.Node]:
    """The chain must be private to its loss (besides ``allowed`` users), except for being returned from the graph
    (Hugging Face models return their logits), directly or through casts and row views (Accelerate's mixed precision
    returns ``logits.float()``): returns the nodes whose values are graph outputs, or raises NoMatch."""
    escaping = []
    for i, node in enumerate(chain):
        next_node = chain[i + 1] if i + 1 < len(chain) else consumer
        others = [user for user in node.users if user is not next_node and user not in allowed]
        if any(user.op == "output" for user in others):
            escaping.append(node)
        for user in others:
            if user.op != "output":
                escaping.extend(_returned_branch(user, node))
    return escaping


def _returned_branch(node: fx.Node, source: fx.Node) -> list[fx.Node]:
    """The graph outputs reached from ``node`` (a user of chain node ``source``) through casts, ``contiguous``,
    ``detach`` and row views alone, or NoMatch: the logits have another user."""
    if not is_replayable_view(node):
        raise NoMatch(f"the logits ({source.name}) are also used by {short(node)}, not only by the loss")
    returned = []
    for user in node.users:
        if user.op == "output":
            returned.append(node)
        else:
            returned.extend(_returned_branch(user, source))
    return list(dict.fromkeys(returned))


DETACH = {("call_method", "detach"), ("call_function", torch.detach)}


def is_replayable_view(node: fx.Node) -> bool:
    """A node that changes neither the logits' values nor their vocabulary dimension: a cast to a floating-point
    dtype, ``contiguous``, ``detach``, a row view."""
    if matches(node, IDENTITY_VIEW) or spelling(node) in DETACH:
        return True
    cast_to = upcast_target(node)
    if cast_to is not None:
        return cast_to in SUPPORTED_DTYPES
    if matches(node, RESHAPE) or matches(node, FLATTEN) or matches(node, GETITEM):
        meta = example_value(node.args[0])
        try:
            _row_step(node, meta.shape[-1])
        except (NoMatch, AttributeError, IndexError, TypeError):
            return False
        return True
    return False


def branch_path(node: fx.Node, chain: list[fx.Node]) -> list[fx.Node]:
    """The nodes from the head to ``node`` (a chain node, or the end of a returned branch), forward order, without a
    bias added to the head's product: the bias is the head's, as ``F.linear``'s is."""
    tail = []
    while node not in chain:
        tail.append(node)
        node = node.args[0]
    vocab = example_value(chain[0]).shape[-1]
    path = chain[: chain.index(node) + 1] + tail[::-1]
    return [path[0]] + [n for n in path[1:] if match_bias_add(n, vocab) is None]
