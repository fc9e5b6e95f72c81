"""A torchtitan loss that applies the output head and the cross-entropy as one fused call.

Why the graph pass does not reach torchtitan: torchtitan compiles each transformer block on its own
(``compile.components = ["model"]``: ``torch.compile`` per block) and the loss function apart
(``components = ["loss"]``), and its default loss for language models, ``ChunkedLossWrapper``, runs the output head
itself, in eager, chunk by chunk. No compiled graph holds ``linear -> cross_entropy``.

torchtitan's own hook is the loss: ``Trainer.Config.loss`` (a ``BaseLoss.Config``). For a ``ChunkedLossWrapper``
the trainer hands the loss the model's output head (``set_lm_head``) and makes the model return its hidden states
(``model._skip_lm_head = True``). :class:`CCELoss` is a ``ChunkedLossWrapper`` that does, with what it is handed,
``linear_cross_entropy(hidden, lm_head.weight, labels, bias=lm_head.bias, reduction="sum", ignore_index=-100) /
global_valid_tokens``: torchtitan's ``cross_entropy_loss`` (sum over the tokens whose label is not ``IGNORE_INDEX``,
divided by the global count of such tokens) without the ``N x V`` logits and without chunks. In a config function::

    from cce_inductor.integrations.torchtitan import CCELoss

    def llama3_debugmodel_cce() -> Trainer.Config:
        config = llama3_debugmodel()
        config.loss = CCELoss.Config()
        return config

The head is called as a module (its ``forward`` computing the loss for that one call), so FSDP2's hooks on it run
as they do for the logits: the weight is gathered before and its gradient reduce-scattered after. A tensor-parallel
head (a vocabulary-sharded weight) is refused with a clear error: use ``ChunkedLossWrapper`` there. Validation uses
the same loss (no gradient). ``compile.components`` needs nothing: the loss is one fused op whatever it says.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ..functional import linear_cross_entropy

try:
    from torchtitan.components.loss import IGNORE_INDEX, ChunkedLossWrapper
    from torchtitan.config import CompileConfig
except ImportError as exc:  # pragma: no cover - exercised without torchtitan
    raise ImportError("cce_inductor.integrations.torchtitan needs torchtitan (pip install torchtitan)") from exc

__all__ = ["CCELoss", "fused_head_loss"]


def fused_head_loss(lm_head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``cross_entropy(lm_head(hidden).flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum",
    ignore_index=IGNORE_INDEX)`` (torchtitan's ``cross_entropy_loss``) without the logits: ``lm_head`` is called as a
    module whose ``forward`` computes the loss for this call, so module hooks (FSDP2's gather / reduce-scatter) run."""
    weight = lm_head.weight
    if type(weight).__name__ == "DTensor" or type(hidden).__name__ == "DTensor":
        raise NotImplementedError(
            "CCELoss: the output head is a DTensor (tensor parallelism): the vocabulary-parallel loss is not wired "
            "into torchtitan; use ChunkedLossWrapper for tensor-parallel runs"
        )

    def forward(module: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy(
            rows, module.weight, labels, bias=getattr(module, "bias", None), reduction="sum", ignore_index=IGNORE_INDEX
        )

    lm_head.forward = types.MethodType(forward, lm_head)  # an instance attribute: the class's forward is untouched
    try:
        return lm_head(hidden)
    finally:
        del lm_head.forward


class CCELoss(ChunkedLossWrapper):
    """torchtitan's cross-entropy over the output head, fused (module docstring). A ``ChunkedLossWrapper`` so that
    the trainer hands it the head and skips the head in the model; it applies the head in one fused call."""

    @dataclass(kw_only=True, slots=True)
    class Config(ChunkedLossWrapper.Config):
        pass

    def __init__(self, config: Config, *, compile_config: CompileConfig | None = None):
        # The inner loss (config.loss_fn) is not built: the fused op is the loss.
        self.num_chunks = 1
        self.lm_head: nn.Module | None = None

    def __call__(
        self,
        pred: torch.Tensor,
        labels: torch.Tensor,
        global_valid_tokens: torch.Tensor | None = None,
        **loss_inputs: Any,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``pred``: the hidden states ``[B, L, D]`` (the model runs with ``_skip_lm_head``). Returns the summed loss
        divided by ``global_valid_tokens`` (where given) and no metrics, as ``CrossEntropyLoss`` does."""
        del loss_inputs  # (positions: used by the model, not by the loss)
        if self.lm_head is None:
            raise RuntimeError("CCELoss: the trainer has not set the output head (set_lm_head)")
        loss = fused_head_loss(self.lm_head, pred, labels)
        if global_valid_tokens is not None:
            loss = loss / global_valid_tokens
        return loss, {}
