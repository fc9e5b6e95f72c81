"""Options of the fused op and of the graph pass, and how they are read from the environment."""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

_TRUTHY = ("1", "true", "yes", "on")


def _env_flag(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    return value.strip().lower() in _TRUTHY


def _env_filter_eps(name: str) -> Optional[float]:
    """A number, or ``auto`` for the paper's per-dtype threshold (``None``); unset gives 0.0 (no filtering)."""
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return 0.0
    if value.strip().lower() == "auto":
        return None
    try:
        return float(value)
    except ValueError as exc:
        raise ValueError(f"{name}={value!r} is not a number") from exc


@dataclasses.dataclass(frozen=True)
class CCEOptions:
    """How rewritten sites compute their loss.

    Every field is part of the pass's cache key, so changing one never reuses a graph compiled under another.

    filter_eps: skip gradient tiles whose ``|softmax - onehot|`` is everywhere below this (CUDA kernels only).
        ``0.0`` (default) computes every gradient entry; ``None`` picks the paper's threshold for the input dtype
        (2**-12 for bf16). Filtering is for fine-tuning: it gives the classifier rows of unlikely tokens an
        exactly-zero gradient, which Adam turns from a small update into none at all, and it stalled training
        from scratch in our Gemma-2-like run (README, "Gradient filtering").
    vocab_sort: order the vocabulary by average logit before the backward so that surviving tiles cluster
        (the paper's heuristic). Off by default: on an H200 it was never faster than skipping tiles from the
        forward's per-tile maxima, which sorting rules out (examples/benchmark_notes.md).
    exact: no gradient filtering and fp32 accumulation of dE/dC (pretraining); slower.
    drop_logits: when the logits also leave the compiled region (Hugging Face models return them), return an
        empty tensor in their place so the site can still be rewritten. Off by default: it changes what the
        compiled function returns.
    """

    filter_eps: Optional[float] = 0.0
    vocab_sort: bool = False
    exact: bool = False
    drop_logits: bool = False

    def __post_init__(self) -> None:
        if self.filter_eps is not None and not (0.0 <= self.filter_eps < 1.0):
            raise ValueError(f"filter_eps must be in [0, 1), got {self.filter_eps}")

    @classmethod
    def from_env(cls, **overrides) -> "CCEOptions":
        """Options from ``CCE_INDUCTOR_*`` environment variables, then ``overrides`` (ignoring ``None``;
        ``filter_eps="auto"`` asks for the paper's per-dtype threshold)."""
        values = dict(
            filter_eps=_env_filter_eps("CCE_INDUCTOR_FILTER_EPS"),
            vocab_sort=_env_flag("CCE_INDUCTOR_VOCAB_SORT", False),
            exact=_env_flag("CCE_INDUCTOR_EXACT"),
            drop_logits=_env_flag("CCE_INDUCTOR_DROP_LOGITS"),
        )
        values.update({k: v for k, v in overrides.items() if v is not None})
        if values["filter_eps"] == "auto":  # the paper's per-dtype threshold
            values["filter_eps"] = None
        return cls(**values)

    def cache_key(self) -> str:
        return ",".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
