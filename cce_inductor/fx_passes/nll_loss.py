"""Cross-entropy spelled ``nll_loss(log_softmax(logits))``, normalised into ``cross_entropy(logits)`` before the
matchers run: the same computation (``F.cross_entropy`` is that composite), so every form that reads a
``cross_entropy`` (``linear_cross_entropy.py``, ``tensor_parallel.py``) finds the site.

    log_probs = log_softmax(logits2d, dim=-1 | 1 [, dtype=d])        logits2d: (N, V); log_probs read by nothing else
    loss      = nll_loss(log_probs, targets, [weight=w], [ignore_index=i], [reduction=r])     targets: (N,)
    ->
    loss      = cross_entropy(logits2d [.to(d)], targets, [weight=w], [ignore_index=i], [reduction=r])

Where the log-probabilities have another reader (a metric, a second loss) or the shapes are not ``(N, V)`` and
``(N,)``, the graph is left as it is and ``stats()`` records why, naming the nodes it saw.
"""

from __future__ import annotations

import inspect

import torch
import torch.fx as fx
import torch.nn.functional as F

from . import spellings as sp

NLL_LOSS = sp.functions(F.nll_loss)
_NLL_SIGNATURE = inspect.signature(F.nll_loss)


def normalize_nll_loss(graph: fx.Graph) -> list[tuple[str, str]]:
    """Rewrite every ``nll_loss(log_softmax(...))`` of ``graph`` that computes a cross-entropy into
    ``cross_entropy``; returns ``(node name, why)`` of each one that cannot be, for ``stats()``."""
    refused = []
    for nll in [n for n in graph.nodes if sp.matches(n, NLL_LOSS)]:
        log_probs = sp.call_arg(nll, 0, "input")
        why = _why_not(nll, log_probs)
        if why is not None:
            refused.append((nll.name, why))
            continue
        bound = _NLL_SIGNATURE.bind(*nll.args, **nll.kwargs)
        kwargs = {k: v for k, v in bound.arguments.items() if k not in ("input", "target")}
        logits = sp.call_arg(log_probs, 0, "input")
        dtype = sp.dtype_arg(log_probs)
        with graph.inserting_before(nll):
            if dtype is not None:  # log_softmax(x, dtype=d) is log_softmax(x.to(d))
                logits = graph.call_method("to", (logits, dtype))
                logits.meta["example_value"] = sp.example_value(log_probs)
            ce = graph.call_function(F.cross_entropy, (logits, bound.arguments["target"]), kwargs)
        ce.meta.update(nll.meta)
        nll.replace_all_uses_with(ce)
        graph.erase_node(nll)
        graph.erase_node(log_probs)
    return refused


def _why_not(nll: fx.Node, log_probs) -> str | None:
    name = sp.short(nll)
    if not sp.matches(log_probs, sp.LOG_SOFTMAX):
        return f"{name} does not read a log_softmax (what it reads is not a cross-entropy of logits)"
    others = [user.name for user in log_probs.users if user is not nll]
    if others:
        return f"the log-probabilities {log_probs.name} of {name} are also read by {', '.join(others)}"
    meta, targets = sp.example_value(log_probs), sp.example_value(sp.call_arg(nll, 1, "target"))
    if not isinstance(meta, torch.Tensor) or not isinstance(targets, torch.Tensor):
        return f"{name}: its input or target is not a tensor"
    if meta.dim() != 2 or targets.dim() != 1:
        return f"{name} reads {meta.dim()}-D log-probabilities and {targets.dim()}-D targets, not (N, V) and (N,)"
    dim = sp.call_arg(log_probs, 1, "dim")
    if dim not in (-1, 1):
        return f"{log_probs.name} normalises over dimension {dim!r}, not the vocabulary"
    return None
