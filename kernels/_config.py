"""Shared configuration of the CCE Triton kernels.

Tile geometry
-------------
Both the forward and the backward kernels cut the (rows x vocabulary) logit matrix into tiles of
``tile_n`` rows by ``tile_v`` vocabulary entries.  Rows are taken in *compacted* order: the rows whose
target is ``ignore_index`` are moved to the end by a stable sort done on the device, and a device-side
count ``num_valid`` tells each program whether its row block holds any real row.  Programs whose row
block lies entirely past ``num_valid`` return at once, so ignored rows cost (almost) nothing.

The forward pass may process ``fwd_v_mult`` summary tiles per step (``BLOCK_V = tile_v * fwd_v_mult``)
but it always records the per-tile maximum logit at ``tile_n x tile_v`` granularity, which is exactly the
tile the backward kernel works on.  That is why the aux layout depends on ``tile_n`` / ``tile_v`` only.

Interpreter
-----------
``TRITON_INTERPRET=1`` must be set before this package is imported.  The interpreter multiplies the raw
bit patterns of 16-bit operands in ``tl.dot`` and has no bf16 atomics, so under the interpreter the
kernels upcast dot operands to fp32 (``UPCAST``) and accumulate bf16 gradients in fp32 buffers.
"""
from __future__ import annotations

import contextlib
import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# Defaults tuned for Hopper (H100/H200).  Under the interpreter tiny tiles keep the CPU tests fast.
_GPU_DEFAULTS = dict(
    tile_n=128,          # rows per tile (forward row block == backward row block == aux granularity)
    tile_v=128,          # vocabulary entries per backward tile / aux summary tile
    fwd_v_mult=2,        # forward processes tile_v * fwd_v_mult vocab entries per step
    fwd_block_d=64,
    fwd_num_warps=8,
    fwd_num_stages=3,
    fwd_flatten=0,       # tl.range(flatten=True) on the vocab loop (pipelining across tiles)
    fwd_waves=16,        # forward grid ~ fwd_waves * num_SMs programs (rows blocks x vocab splits)
    bwd_block_d=64,
    bwd_num_warps=4,
    bwd_num_stages=3,
    bwd_group=8,         # 0: vocab-major program order, >0: row blocks grouped in groups of this size
    bwd_packed=0,        # 1: packed-pair atomics (red.global.add.noftz.bf16x2); measured slower on H200
    bwd_filter_e=1,      # 1: filter dE tiles too (paper); 0: dE dense, only dC / dbias filtered
    flat_row_log2=4,     # rows with max prob < 2**flat_row_log2 * filter_eps get an unfiltered dE
    tail_frac_pct=25,    # ... and rows with more than this % of their mass in sub-eps entries
    bwd_dense=1,         # unfiltered, non-exact backward: cuBLAS products + _backward_dense kernel
    dense_row_chunk=8192,  # rows per dense block (0: all rows); bounds the G block and dE rows for long batches
    dense_vocab_chunk=2048,
    dense_recompute="triton",  # "triton": _recompute_grad_kernel; "cublas": fp32 mm + _softmax_grad_kernel
    dense_block_n=128,   # _recompute_grad_kernel tile
    dense_block_v=256,
    dense_block_d=64,
    dense_num_warps=8,
    dense_num_stages=4,
    dense_block_r=8,     # _softmax_grad_kernel ("cublas" recompute)
    dense_block_c=256,
    dense_products="cublas",  # dE / dC of the "triton" recompute: "cublas", or "triton" (_products: skip ignored rows)
    prod_block_m=128,    # _products GEMM tiles
    prod_block_n=128,
    prod_block_k=64,
    prod_group_m=8,
    prod_num_warps=8,
    prod_num_stages=4,
)
_INTERPRET_DEFAULTS = dict(
    tile_n=16,
    tile_v=32,
    fwd_v_mult=2,
    fwd_block_d=16,
    fwd_num_warps=4,
    fwd_num_stages=1,
    fwd_flatten=0,
    fwd_waves=2,
    bwd_block_d=16,
    bwd_num_warps=4,
    bwd_num_stages=1,
    bwd_group=0,
    bwd_packed=0,
    bwd_filter_e=1,
    flat_row_log2=4,
    tail_frac_pct=25,
    bwd_dense=1,
    dense_row_chunk=16,
    dense_vocab_chunk=48,
    dense_recompute="triton",
    dense_block_n=16,
    dense_block_v=32,
    dense_block_d=16,
    dense_num_warps=4,
    dense_num_stages=1,
    dense_block_r=8,
    dense_block_c=32,
    dense_products="cublas",
    prod_block_m=16,
    prod_block_n=16,
    prod_block_k=16,
    prod_group_m=2,
    prod_num_warps=4,
    prod_num_stages=1,
)

CONFIG: dict = dict(_INTERPRET_DEFAULTS if INTERPRET else _GPU_DEFAULTS)


@contextlib.contextmanager
def override_config(**kwargs):
    """Temporarily change kernel block sizes (tests and benchmarks).  Forward and backward of one
    loss must run under the same ``tile_n`` / ``tile_v`` because the aux layout depends on them."""
    unknown = set(kwargs) - set(CONFIG)
    if unknown:
        raise KeyError(f"unknown kernel config keys: {sorted(unknown)}")
    saved = dict(CONFIG)
    CONFIG.update(kwargs)
    try:
        yield CONFIG
    finally:
        CONFIG.clear()
        CONFIG.update(saved)


def default_filter_eps(dtype: torch.dtype) -> float:
    """Gradient-filter threshold.  The paper uses 2**-12 for bf16 (7 mantissa bits); scale with the
    mantissa: 2**-(mantissa_bits + 5), i.e. fp16 2**-15 and fp32 2**-28."""
    mantissa_bits = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}.get(dtype)
    if mantissa_bits is None:
        raise TypeError(f"unsupported dtype {dtype}")
    return 2.0 ** -(mantissa_bits + 5)


def aux_spec(n, v, vocab_sort: bool, summaries: bool = True):
    """Shape and dtype of the ``aux`` tensor produced by :func:`forward` and consumed by :func:`backward`.

    ``summaries=False`` (the backward will not filter, so it reads none of this): empty.  Otherwise one flat
    fp32 vector:

    * ``aux[:n]``: per-row maximum logit, and ``aux[n:2n]``: per-row fraction of the softmax mass held by
      entries below ``default_filter_eps`` relative to the running max.  The backward flags rows whose
      largest probability ``exp(max - lse)`` is tiny or whose tail fraction is large: their many tiny
      probabilities carry a real part of dE, so the filter must not drop them from dE.
    * ``vocab_sort=True``: then ``aux[2n:2n + v]``, the per-vocabulary sum of logits over the valid rows
      (the backward sorts the vocabulary by it, paper sec. 4.3).
    * ``vocab_sort=False``: then ``aux[2n:]``, the per-tile maximum logit, ``row_blocks * vocab_tiles``
      entries, row-block-major; the backward skips a tile without recomputing it when
      ``exp(tile_max - min(lse over the tile's rows)) < filter_eps``.

    Works with symbolic ints (only +, * and //)."""
    if not summaries:
        return (0,), torch.float32
    if vocab_sort:
        return (2 * n + v,), torch.float32
    tn, tv = CONFIG["tile_n"], CONFIG["tile_v"]
    return (2 * n + ((n + tn - 1) // tn) * ((v + tv - 1) // tv),), torch.float32


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 4


_SM_CACHE: dict = {}


def _cuda_sms(index: int) -> int:
    if index not in _SM_CACHE:
        _SM_CACHE[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_CACHE[index]


# Shared memory a software-pipelined tile loop may take for its operand buffers (Hopper: 227 KB per block;
# leave room for the compiler's own scratch).
_PIPELINE_SMEM_BYTES = 200 * 1024


def fit_num_stages(num_stages: int, block_rows: int, block_cols: int, block_d: int, element_size: int) -> int:
    """``num_stages`` lowered until the operand buffers fit: a loop pipelined over ``num_stages`` keeps
    ``num_stages - 1`` pairs of ``block_rows x block_d`` and ``block_cols x block_d`` tiles in shared memory
    (fp32 inputs need twice what 16-bit ones do)."""
    per_stage = (block_rows + block_cols) * block_d * element_size
    while num_stages > 2 and (num_stages - 1) * per_stage > _PIPELINE_SMEM_BYTES:
        num_stages -= 1
    return num_stages


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs use true fp32 products ("ieee"), not tf32, so fp32 results stay fp32-accurate."""
    return "ieee" if dtype == torch.float32 else "tf32"


def compact_rows(targets: torch.Tensor, ignore_index: int):
    """Device-side compaction: row indices with valid rows first (stable), and the count of valid rows
    as a 1-element int32 device tensor.  No host synchronisation."""
    return compact_counted(targets != ignore_index)


def compact_counted(counted: torch.Tensor):
    """:func:`compact_rows` for a boolean mask of the rows that count."""
    row_order = torch.argsort((~counted).to(torch.int8), stable=True)
    return row_order, counted.sum(dtype=torch.int32).reshape(1)


def counted_mask(n: int, row_compaction, device: torch.device) -> torch.Tensor:
    """The boolean mask of counted rows that a ``(row_order, num_valid)`` compaction describes (device ops)."""
    row_order, num_valid = row_compaction
    counted = torch.zeros(n, dtype=torch.bool, device=device)
    return counted.index_put_((row_order,), torch.arange(n, device=device) < num_valid)
