"""The share of a head's rows that count, seen on earlier calls: how the lean backward sizes its products.

The lean backward's dE / dC products are cuBLAS GEMMs, sized on the host, so they multiply every row: the zeros of
rows whose target is ``ignore_index`` too. The Triton GEMMs of ``kernels/_products.py`` read the device-side count
of counted rows and skip the rest, at ~75-80% of cuBLAS's speed per row. The host cannot read the count of this
call without waiting for the device, which the op never does. It reads the counts of *earlier* calls of the same
head instead: each backward enqueues a copy of its count into pinned host memory and records an event; a later
call reads the copies whose events have completed (``Event.query``, which does not wait) and keeps the last
``_HISTORY`` shares (:class:`Seen`: their median and their 20th percentile). From those, per call:

    median share of counted rows       products                                          (products())
    > COUNTED_PREFIX_AT_MOST (0.9)     cuBLAS over every row
    <= 0.9                             the counted prefix: cuBLAS over the first rows of the compacted batch
                                       (counted rows first), the 20th percentile's share of this call's rows in
                                       whole 128-row tiles, the row-skipping products over the rows past them
                                       (which do nothing unless this call counts more)
    <= ROW_SKIPPING_AT_MOST (0.4),     the row-skipping products alone, G blocks made wider by the 20th
    or <= 0.6 while the share moves    percentile's share (``cce_inductor/_planning.py``, ``row_skipping_widen``)

Why (measured; the figures are in docs/): at half the rows ignored the counted prefix is the fastest of the
three, well under cuBLAS over every row; at three quarters ignored its host work per vocabulary chunk (four launches
whatever the rows) leaves it waiting on the host, and the widened row-skipping products take about half its time;
and where the share moves from call to call its prefix mispredicts and its calls with few counted rows wait on the
host, so the row-skipping products alone win there from a higher share. A share that mispredicts costs time, never
a different result beyond rounding. The first call of a head, a call under CUDA graph capture that has
no earlier count, and runs with ``torch.use_deterministic_algorithms(True)`` (whose bits must not depend on when a
copy completed) multiply every row with cuBLAS. ``stats()['backward_products']`` counts what ran.

The balanced path (``kernels/_balanced.py``) reads the same shares for its three products per row chunk
(:func:`balanced_prefix`): cuBLAS over every row where the median share is above ``COUNTED_PREFIX_AT_MOST``, else the
rows compacted, cuBLAS over the low quantile's share of them and the row-skipping products past it (at every share:
its chunks past the prefix hold no counted rows when the share holds, so they cost launches, not products).
``stats()['balanced_rows']`` counts what ran.
"""

from __future__ import annotations

import collections
import math
import threading
from typing import NamedTuple

import torch

# The counted-prefix products where at most this share of an earlier call's rows counted (at least 10% ignored).
COUNTED_PREFIX_AT_MOST = 0.9
# The row-skipping products alone where at most this share counted (at least 60% ignored): at 75% ignored the
# counted prefix's fixed host work per vocabulary chunk outweighs the rows it saves.
ROW_SKIPPING_AT_MOST = 0.4
# ... and up to this share where the share moves from call to call (the last shares' median and low quantile more
# than STEADY_SPREAD apart): the counted prefix's host work per vocabulary chunk is fixed, so its calls with few
# counted rows wait on the host, and its prefix mispredicts.
MOVING_ROW_SKIPPING_AT_MOST = 0.6
STEADY_SPREAD = 0.1
# Copies in flight per head; more are not enqueued (a host running many calls ahead of the device).
_MAX_PENDING = 8
# Delivered shares kept per head: the choice reads their median, the prefix their low quantile (below).
_HISTORY = 8


class Seen(NamedTuple):
    """What the earlier calls of a head counted: ``typical``, the median share of counted rows (which products);
    ``low``, a low quantile (how many rows the counted prefix's cuBLAS products multiply; how wide the row-skipping
    products' G blocks, whose calls with fewest counted rows wait on the host). A prefix too long multiplies ignored
    rows' zeros at cuBLAS's full cost per row; one too short leaves counted rows to the Triton products, which cost
    ~1.25x cuBLAS per row, so ~0.25x more: the cheapest prefix over a spread of shares is their 20th percentile (the
    newsvendor's ratio 0.25 / 1.25); with moving shares it beats a prefix sized by the latest share."""

    typical: float
    low: float


class CountedShare:
    """One head's counted shares: the last ``_HISTORY`` that the device has delivered, read without waiting (one low
    outlier, e.g. a short final batch, moves neither the median nor the 20th percentile of eight)."""

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

    def latest(self) -> float | None:
        """The share of the most recent call whose count has reached the host (None before the first)."""
        with self._lock:
            self._collect()
            return self._history[-1] if self._history else None

    def seen(self) -> Seen | None:
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


def products(asked: str, seen: Seen | None, *, row_skipping_ok: bool) -> str:
    """``"cublas"``, ``"triton"`` or ``"counted_prefix"`` for one backward: ``asked`` (``CCEOptions.products``)
    unless it is ``"auto"``; then, where the row-skipping kernels can run (``row_skipping_ok``: C and E rows
    readable by the tensor-memory accelerator), from what earlier calls counted (``seen``): the row-skipping
    products alone (``"triton"``) where their median share is at most ``ROW_SKIPPING_AT_MOST``, or at most
    ``MOVING_ROW_SKIPPING_AT_MOST`` while the share moves (median and low quantile more than ``STEADY_SPREAD``
    apart); the counted prefix up to ``COUNTED_PREFIX_AT_MOST``; else cuBLAS over every row."""
    if asked != "auto":
        return asked
    if not row_skipping_ok or seen is None or torch.are_deterministic_algorithms_enabled():
        return "cublas"
    moving = seen.typical - seen.low > STEADY_SPREAD
    if seen.typical <= (MOVING_ROW_SKIPPING_AT_MOST if moving else ROW_SKIPPING_AT_MOST):
        return "triton"
    return "counted_prefix" if seen.typical <= COUNTED_PREFIX_AT_MOST else "cublas"


def balanced_prefix(asked: str, seen: Seen | None, rows: int) -> int | None:
    """The compacted rows the balanced path's cuBLAS products multiply (the rest by the row-skipping products), or
    None: every row by cuBLAS, uncompacted.  ``asked`` (``CCEOptions.products``): ``"cublas"`` None, ``"triton"`` 0;
    ``"auto"``: None without an earlier count, with deterministic algorithms or a median share above
    ``COUNTED_PREFIX_AT_MOST``, else the low quantile's share of ``rows`` in whole 128-row blocks (the module
    docstring).  Whether the kernels can skip rows for the operands is the caller's to ask."""
    if asked == "cublas":
        return None
    if asked == "triton":
        return 0
    if seen is None or torch.are_deterministic_algorithms_enabled() or seen.typical > COUNTED_PREFIX_AT_MOST:
        return None
    return min(rows, math.ceil(seen.low * rows / 128) * 128)
