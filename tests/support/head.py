"""A tiny head for edge-case tests (V = 13, D = 7: not multiples of anything): the eager loss, model snippets with
the constants baked in (as model code has them), their inputs, and compiling with ``PassCapture``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .graphs import PassCapture

V, D = 13, 7  # not multiples of anything
REDUCTIONS = ["mean", "sum", "none"]


def head_loss(hidden, weight, labels, bias=None, softcap=None, ignore_index=-100, reduction="mean"):
    """Eager reference: linear -> [softcap] -> cross_entropy."""
    logits = F.linear(hidden, weight, bias)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=ignore_index, reduction=reduction
    )


def make_fn(softcap=None, ignore_index=-100, reduction="mean", bias=False):
    """A model snippet with the constants baked in (as model code has them)."""
    if bias:

        def fn(hidden, weight, labels, b):
            return head_loss(hidden, weight, labels, b, softcap, ignore_index, reduction)
    else:

        def fn(hidden, weight, labels):
            return head_loss(hidden, weight, labels, None, softcap, ignore_index, reduction)

    return fn


def inputs(n=6, *, dtype=torch.float32, seed=0, bias=False, ignore_index=-100, lead=None):
    """[hidden (*lead, D), weight (V, D), labels (*lead) with the second one ignored, [bias (V,)]], leaves needing
    grad; ``lead`` is ``(n,)`` unless given."""
    gen = torch.Generator().manual_seed(seed)
    lead = (n,) if lead is None else lead
    hidden = torch.randn(*lead, D, generator=gen).to(dtype).requires_grad_()
    weight = torch.randn(V, D, generator=gen).div(D**0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, V, lead, generator=gen)
    if labels.numel() > 2:
        labels.view(-1)[1] = ignore_index
    out = [hidden, weight, labels]
    if bias:
        out.append(torch.randn(V, generator=gen).to(dtype).requires_grad_())
    return out


def compile_capture(fn, **kwargs):
    """``fn`` compiled with ``fullgraph=True`` through a fresh :class:`PassCapture`; returns both."""
    capture = PassCapture()
    return torch.compile(fn, backend=capture, fullgraph=True, **kwargs), capture


def _hf_shift_fn():  # (its name is part of test ids: test_dynamic_shapes_rewrite_once_capture)
    """Gemma-2 style: upcast, softcap written as a literal (a softcap held in a Python float attribute has tests of
    its own: test_softcap_attribute_*), HF label shift. Returns the function and its head."""
    head = nn.Linear(D, V, bias=False)

    def fn(hidden, labels):
        logits = head(hidden).float()
        logits = torch.tanh(logits / 30.0) * 30.0
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        return F.cross_entropy(shift_logits.view(-1, V), shift_labels.view(-1))

    return fn, head
