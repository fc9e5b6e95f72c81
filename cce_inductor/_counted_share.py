"""The share of a head's rows that count, seen on earlier calls: how the lean backward sizes its products.

The lean backward's dE / dC products are cuBLAS GEMMs, sized on the host, so they multiply every row: the zeros of
rows whose target is ``ignore_index`` too. The Triton GEMMs of ``kernels/_products.py`` read the device-side count
of counted rows and skip the rest, but at 75-80% of cuBLAS's speed (H200, bf16, N 8192, fwd + bwd against
torch.compile's, engineering log v19 / v20):

    head        ignored   cuBLAS products   row-skipping products   counted prefix (this module's default)
    Gemma-2     0% / 50%  1.31x / 0.97x     1.45x / 0.78x           1.31x / 0.74x
    Llama-3     0% / 50%  1.41x / 1.04x     1.55x / 0.79x           1.37x / 0.77x

The host cannot read the count of this call without waiting for the device, which the op never does. It reads the
count of *earlier* calls of the same head instead: each backward enqueues a copy of its count into pinned host
memory and records an event; a later call reads the copies whose events have completed (``Event.query``, which does
not wait), and keeps the last few shares (:class:`Seen`: their median and a low quantile). Where the median share is
at most ``COUNTED_PREFIX_AT_MOST``, the backward multiplies with cuBLAS only the first rows of the compacted batch
(counted rows first), as many as the low quantile's share of this call's rows (whole 128-row tiles), and runs the row-skipping Triton products over the rows past them, which do nothing unless this call counts
more rows than the earlier one (``kernels/_backward.py``, ``counted_hint``). So a share that mispredicts costs time
(the rows past the prefix at the Triton products' speed), never a different result beyond rounding. Where the
earlier calls' median share is at most ``ROW_SKIPPING_AT_MOST``, the row-skipping products run alone, over G
blocks made wider by that share (``kernels/_backward.py``, ``row_skipping_widen``): at so few counted rows the
prefix's cuBLAS products save less than its fixed costs (an fp32 pass over dC, two more launches per vocabulary
chunk, which left the backward waiting on the host: engineering log v21). The first call
of a head, a call under CUDA graph capture that has no earlier count, and runs with
``torch.use_deterministic_algorithms(True)`` (whose bits must not depend on when a copy completed) multiply every row
with cuBLAS. ``stats()['backward_products']`` counts what ran.
"""

from __future__ import annotations

import collections
import threading
from typing import NamedTuple, Optional

import torch

# The counted-prefix products where at most this share of an earlier call's rows counted (at least 10% ignored).
COUNTED_PREFIX_AT_MOST = 0.9
# The row-skipping products alone where at most this share counted (at least 60% ignored): at 75% ignored on
# Gemma-2's head (H100, N 8192) they took 20.8 ms fwd + bwd against the counted prefix's 35.5 (engineering log v21).
ROW_SKIPPING_AT_MOST = 0.4
# Copies in flight per head; more are not enqueued (a host running many calls ahead of the device).
_MAX_PENDING = 8
# Delivered shares kept per head: the choice reads their median, the prefix their low quantile (below).
_HISTORY = 8


class Seen(NamedTuple):
    """What the earlier calls of a head counted: ``typical``, the median share of counted rows (which products, how
    wide the row-skipping products' G blocks); ``low``, a low quantile (how many rows the counted prefix's cuBLAS
    products multiply). A prefix too long multiplies ignored rows' zeros at cuBLAS's full cost per row; one too
    short leaves counted rows to the Triton products, which cost ~1.25x cuBLAS per row, so ~0.25x more: the
    cheapest prefix over a spread of shares is their 20th percentile (the newsvendor's ratio 0.25 / 1.25). A batch
    whose share moves from call to call (Gemma-2's head, H100, shares 25-75%, each call the one before's
    successor in a cycle) cost 0.85x torch.compile's time with the latest share alone, against 0.73x at a fixed
    50% (engineering log v21)."""

    typical: float
    low: float


class CountedShare:
    """One head's counted share: the latest that the device has delivered, read without waiting."""

    def __init__(self) -> None:
        self._pending: collections.deque = collections.deque()  # (pinned int32 (1,), rows, event)
        self._history: collections.deque = collections.deque(maxlen=_HISTORY)  # delivered shares, oldest first
        self._lock = threading.Lock()

    def observe(self, num_counted: torch.Tensor, rows: int) -> None:
        """Record this call's count (a 1-element int32 tensor on the head's device) out of ``rows`` rows."""
        if rows <= 0:
            return
        if num_counted.device.type != "cuda":  # the host owns it: nothing to wait for
            with self._lock:
                self._history.append(int(num_counted.reshape(-1)[0]) / rows)
            return
        if torch.cuda.is_current_stream_capturing():  # a copy captured into a graph would land on replays only
            return
        with self._lock:
            if len(self._pending) >= _MAX_PENDING:
                return
            host = torch.empty((1,), dtype=torch.int32, pin_memory=True)
            host.copy_(num_counted.reshape(1), non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(num_counted.device))
            self._pending.append((host, rows, event))

    def _collect(self) -> None:
        """Move the copies whose events have completed into the history (under the lock)."""
        # no event query while a CUDA graph is captured: the capture would fail on it (an unsafe call in
        # cudaStreamCaptureModeGlobal); the shares read before the capture stand
        if self._pending and torch.cuda.is_current_stream_capturing():
            return
        while self._pending and self._pending[0][2].query():
            host, rows, _ = self._pending.popleft()
            self._history.append(int(host[0]) / rows)

    def latest(self) -> Optional[float]:
        """The share of the most recent call whose count has reached the host (None before the first)."""
        with self._lock:
            self._collect()
            return self._history[-1] if self._history else None

    def seen(self) -> Optional[Seen]:
        """The median and the 20th percentile of the last ``_HISTORY`` delivered shares (None before the first)."""
        with self._lock:
            self._collect()
            if not self._history:
                return None
            ordered = sorted(self._history)
            return Seen(typical=ordered[(len(ordered) - 1) // 2], low=ordered[len(ordered) // 5])


_heads: dict[tuple, CountedShare] = {}
_heads_lock = threading.Lock()


def of_head(device: torch.device, vocab: int, hidden: int) -> CountedShare:
    """The counted share of the head ``(vocab, hidden)`` on ``device`` (one per head shape: sites of one shape that
    see different batches share it, which costs time at worst)."""
    key = (device.type, device.index, vocab, hidden)
    with _heads_lock:
        share = _heads.get(key)
        if share is None:
            share = _heads[key] = CountedShare()
        return share


def products(asked: str, share: Optional[float], *, row_skipping_ok: bool) -> str:
    """``"cublas"``, ``"triton"`` or ``"counted_prefix"`` for one backward: ``asked`` (``CCEOptions.products``)
    unless it is ``"auto"``; then the counted-prefix products where the row-skipping kernels can run
    (``row_skipping_ok``: not exact mode, C readable by the tensor-memory accelerator) and earlier calls counted
    ``share`` (their median, :class:`Seen`) of at most ``COUNTED_PREFIX_AT_MOST`` of their rows, the row-skipping
    products alone (``"triton"``) at most ``ROW_SKIPPING_AT_MOST``, else cuBLAS over every row."""
    if asked != "auto":
        return asked
    if not row_skipping_ok or share is None or torch.are_deterministic_algorithms_enabled():
        return "cublas"
    if share <= ROW_SKIPPING_AT_MOST:
        return "triton"
    return "counted_prefix" if share <= COUNTED_PREFIX_AT_MOST else "cublas"
