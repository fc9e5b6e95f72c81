"""Helpers for graph-match tests: capture Dynamo's graph, run the pass on it, print before and after."""

from __future__ import annotations

import re

import torch

from cce_inductor import _compat
from cce_inductor.fx_passes import rewrite_graph
from cce_inductor.options import CCEOptions


def _sorted_placeholders(lines: list[str]) -> list[str]:
    """Dynamo orders a graph's inputs differently across torch versions (2.11 lists parameters before the
    tensors passed in, 2.13 in first-use order): sort the signature and the ``l_x = L_x_`` lines after it."""
    if not lines or not lines[0].startswith("def forward(self, "):
        return lines
    params = lines[0][len("def forward(self, ") : -len("):")].split(", ")
    lines = [f"def forward(self, {', '.join(sorted(params))}):"] + lines[1:]
    end = 1
    while end < len(lines) and re.fullmatch(r"\s+\w+ = L_\w+", lines[end]):
        end += 1
    return lines[:1] + sorted(lines[1:end]) + lines[end:]


# Tensor attribute -> (the aten op torch 2.14's Dynamo records for it, the name FX gives that node).
_VIEW_ATTR_OPS = {"T": ("numpy_T", "numpy_t"), "mT": ("mT", "m_t"), "H": ("matrix_H", "matrix_h"), "mH": ("mH", "m_h")}


def _view_attrs_as_ops(text: str) -> str:
    """Torch 2.13 records ``w.T`` as ``getattr_1 = w.T``, 2.14 as ``numpy_t = torch.ops.aten.numpy_T(w)``:
    write the former as the latter, renaming the node as FX names it."""
    renames: dict[str, str] = {}
    counts: dict[str, int] = {}

    def as_op(m: re.Match) -> str:
        indent, name, base, attr = m.groups()
        op, stem = _VIEW_ATTR_OPS[attr]
        renames[name] = stem if stem not in counts else f"{stem}_{counts[stem]}"
        counts[stem] = counts.get(stem, 0) + 1
        return f"{indent}{renames[name]} = torch.ops.aten.{op}({base})"

    text = re.sub(r"^(\s+)(getattr_\d+) = (\w+)\.(T|mT|H|mH)$", as_op, text, flags=re.M)
    if renames:
        text = re.sub(r"\bgetattr_\d+\b", lambda m: renames.get(m.group(), m.group()), text)
    return text


def graph_code(gm: torch.fx.GraphModule) -> str:
    """``gm.code`` without blank lines and torch's per-version noise."""
    lines = [line.rstrip() for line in gm.code.strip().splitlines() if line.strip()]
    text = "\n".join(_sorted_placeholders(lines))
    text = re.sub(r"  # .*", "", text)  # source comments
    text = re.sub(r";  [\w ,=]+ = None$", "", text, flags=re.M)  # Dynamo's "free this early" assignments
    return _view_attrs_as_ops(text)


class PassCapture:
    """A Dynamo backend that records the graph before and after the pass and runs the rewritten graph eagerly."""

    def __init__(self, options: CCEOptions | None = None):
        _compat.install()  # as cce_inductor's own backends do: see cce_inductor/_compat.py
        self.options = options or CCEOptions()
        self.before: list[str] = []
        self.after: list[str] = []
        self.rewrites: list[int] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.before.append(graph_code(gm))
        self.rewrites.append(rewrite_graph(gm.graph, self.options))
        gm.recompile()
        self.after.append(graph_code(gm))
        return gm.forward
