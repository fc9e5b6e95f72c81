"""Targets: the count of rows that count, and the range check, in one launch.

Math
----
    counted[n]  = targets[n] != ignore_index
    num_counted = sum_n counted[n]                    (fp32: exact up to 2^24 rows; summed as int32)
    row_scale   = 1 / num_counted  ("mean": inf when no row counts) |  1  ("sum")
    with ``CHECK_RANGE``: a device-side assert where counted[n] and not 0 <= targets[n] < V, which is what eager
    ``F.cross_entropy`` does on CUDA with such a target

Grid / memory
-------------
One program walks the N targets ``BLOCK`` at a time (8 bytes each: N 4096-65536 is 32-512 KB, a few microseconds)
and writes two fp32 scalars. One program, so the count needs no atomics and gives the same bits on every run.

Why a kernel: the same work in eager PyTorch is ~12 small launches (comparisons, a sum, a reciprocal, the assert),
each with its own host time, where a small head's fused call waits on the host. The assert is compiled in for
this kernel alone (``debug=True``: Triton drops ``tl.device_assert`` otherwise); the interpreter never asserts, so
the CPU tests check the count and the CUDA suite the assert.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch

_TUNING = {"gpu": dict(block=2048, num_warps=8), "interpret": dict(block=64, num_warps=4)}


@triton.jit(debug=True)
def _count_targets_kernel(
    Targets, Out, N, V, ignore_index, CHECK_RANGE: tl.constexpr, MEAN: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.arange(0, BLOCK)
    count = tl.zeros((BLOCK,), dtype=tl.int32)
    for r0 in range(0, N, BLOCK):
        rows = r0 + offs
        target = tl.load(Targets + rows, mask=rows < N, other=ignore_index)
        counted = target != ignore_index
        if CHECK_RANGE:
            tl.device_assert(
                ~counted | ((target >= 0) & (target < V)),
                "cce_inductor: target out of bounds (not ignore_index and not in [0, V))",
            )
        count += counted.to(tl.int32)
    num_counted = tl.sum(count, axis=0).to(tl.float32)
    tl.store(Out, num_counted)
    if MEAN:
        tl.store(Out + 1, 1.0 / num_counted)
    else:
        tl.store(Out + 1, 1.0)


def count_targets(
    targets: torch.Tensor, ignore_index: int, *, mean: bool, check_vocab: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch helper: ``(num_counted, row_scale)``, 0-dim fp32 device tensors (module docstring); with
    ``check_vocab`` V, a device-side assert where a counted target lies outside ``[0, V)``."""
    tune = _launch.tuning(_TUNING)
    out = torch.empty(2, dtype=torch.float32, device=targets.device)
    n = targets.shape[0]
    _count_targets_kernel[(1,)](
        targets.contiguous(),
        out, n, check_vocab if check_vocab is not None else 0, ignore_index,
        CHECK_RANGE=check_vocab is not None, MEAN=mean, BLOCK=tune["block"],
        num_warps=tune["num_warps"],
    )  # fmt: skip
    return out[0], out[1]
