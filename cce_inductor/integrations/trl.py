"""TRL's fused LM head, computed by cce_inductor's op.

TRL (1.16) patches the model of ``SFTTrainer``, ``GRPOTrainer``, ``RLOOTrainer``, ``KTOTrainer`` and ``DPOTrainer``
with ``trl.trainer.utils.add_fused_lm_head``: called with ``fused_lm_head=True``, the model runs its backbone and
hands the hidden states, the head's weight / bias and the labels to ``ChunkedLogProbFunction``
(``trl/kernels/chunked_logprob.py``), which computes per-token log-probabilities (and, on request, the entropy,
``log(sum p^2)``, the mean logit and whether the label is the top-1 token) tile by tile: a cuBLAS product of 4096
tokens x ``chunk_size`` (32768) vocabulary entries in the compute dtype, folded into online log-sum-exp statistics by
a Triton kernel (torch ops elsewhere); the backward recomputes each tile. The model is called without labels, so a
compiled graph holds no loss for the pass to rewrite: TRL's trainers run as they are under ``CCE_INDUCTOR=1``.

This module gives them cce_inductor's op instead::

    from cce_inductor.integrations import trl as cce_trl
    cce_trl.install()          # every add_fused_lm_head model now computes through cce_inductor's op

:func:`log_probs` has ``ChunkedLogProbFunction.apply``'s signature and outputs. It computes ``log_probs``,
``entropy`` and ``is_top1`` (one pass of the op, no ``N x V`` logits); a request it cannot compute exactly as TRL
defines it (``log_sum_sq_probs``, ``mean_logits``, or a softcap with a temperature other than 1) goes to TRL's own
function, so every output keeps TRL's meaning. Differences from TRL's numbers: TRL rounds each logit tile to the
compute dtype before its fp32 epilogue; the op keeps the fp32 sums (16-bit inputs: differences at the 16-bit rounding
level; ``is_top1`` compares the logits rounded to the compute dtype, as TRL's tiles are).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .. import _checks
from ..ops import lean_call
from ..options import CCEOptions

__all__ = ["install", "uninstall", "log_probs", "CCELogProbFunction", "SUPPORTED_OUTPUTS"]

# Every id counts: TRL passes only positions with a label (or labels clamped to >= 0).
_NO_TARGET = -(2**63)
SUPPORTED_OUTPUTS = ("log_probs", "entropy", "is_top1")


def _trl_function() -> Any:
    from trl.kernels import ChunkedLogProbFunction  # TRL is optional

    return ChunkedLogProbFunction


def supports(
    final_logit_softcapping: float | None,
    temperature: float,
    logit_scale: float,
    dtype: torch.dtype,
    outputs: tuple[str, ...],
) -> bool:
    """Whether :func:`log_probs` computes this request with the op (else TRL's own function does)."""
    if any(name not in SUPPORTED_OUTPUTS for name in outputs):
        return False
    if final_logit_softcapping is not None and temperature != 1.0:
        return False  # softcap(z) / T: a factor after the softcap, which the op does not take
    # the scale (and 1 / T) is folded into the hidden states; in fp16 that could overflow where fp32 logits do not
    return dtype != torch.float16 or logit_scale / temperature == 1.0


def log_probs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    temperature: float,
    chunk_size: int,
    final_logit_softcapping: float | None = None,
    logit_scale: float = 1.0,
    outputs: tuple[str, ...] = SUPPORTED_OUTPUTS,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """``ChunkedLogProbFunction.apply``'s signature and outputs: ``(log_probs, entropy, log_sum_sq_probs,
    mean_logits, is_top1)``, each ``(N,)`` (fp32; ``is_top1`` bool) or None where not in ``outputs``.

    ``hidden`` (N, H), ``weight`` (V, H), ``targets`` (N,) ids in ``[0, V)``; logits ``softcap(hidden @ weight.T *
    logit_scale) / temperature`` in the autocast dtype (where autocast is on) or ``hidden``'s. ``chunk_size`` is TRL's
    tile width, unused here. ``log_probs`` and ``entropy`` are differentiable."""
    compute = (
        torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type) else hidden.dtype
    )
    if not supports(final_logit_softcapping, temperature, logit_scale, compute, outputs):
        return _trl_function().apply(
            hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping, logit_scale, outputs
        )
    e, c, b = hidden, weight, bias
    factor = logit_scale / temperature if final_logit_softcapping is None else logit_scale
    if factor != 1.0:
        e, b = e * factor, None if b is None else b * factor
    _checks.check_targets_dtype(targets)
    # the operands as stored, converted for the call only (an fp32 head under autocast: no 16-bit copy held)
    stored = {e.dtype, c.dtype} | ({b.dtype} if b is not None else set())
    with torch.autocast(hidden.device.type, enabled=False):
        neg_log_probs, _, entropy, argmax = lean_call(
            e,
            c,
            targets.long(),
            b,
            softcap=None if final_logit_softcapping is None else float(final_logit_softcapping),
            ignore_index=_NO_TARGET,
            reduction="none",
            options=CCEOptions().encode(),
            entropy="entropy" in outputs,
            argmax=str(compute).removeprefix("torch.") if "is_top1" in outputs else "",
            compute_dtype=None if stored == {compute} else compute,
        )()
    return (
        -neg_log_probs,
        entropy if "entropy" in outputs else None,
        None,
        None,
        argmax == targets if "is_top1" in outputs else None,
    )


class CCELogProbFunction:
    """A stand-in for ``trl.kernels.ChunkedLogProbFunction`` (what ``add_fused_lm_head`` calls): ``apply`` is
    :func:`log_probs`."""

    apply = staticmethod(log_probs)


_saved: list[Any] = []


def install() -> None:
    """Route every ``add_fused_lm_head`` model (TRL's trainers patch theirs when they start) through :func:`log_probs`:
    TRL's patched forward looks ``trl.trainer.utils._ChunkedLogProbFunction`` up on every call. Idempotent."""
    import trl.trainer.utils as trl_utils  # TRL is optional

    if trl_utils._ChunkedLogProbFunction is not CCELogProbFunction:
        _saved.append(trl_utils._ChunkedLogProbFunction)
        trl_utils._ChunkedLogProbFunction = CCELogProbFunction


def uninstall() -> None:
    """Put TRL's own function back."""
    import trl.trainer.utils as trl_utils

    if _saved:
        trl_utils._ChunkedLogProbFunction = _saved.pop()
