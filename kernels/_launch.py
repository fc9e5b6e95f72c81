"""Host-side helpers shared by the kernels' launch helpers: the device's facts, and row compaction.

Interpreter
-----------
``TRITON_INTERPRET=1`` must be set before this package is imported.  The interpreter multiplies the raw bit
patterns of 16-bit operands in ``tl.dot``, so under it the kernels upcast dot operands to fp32 (``UPCAST``);
each kernel file keeps a small set of block sizes for it beside its GPU tuning, so the CPU tests stay fast.

Row compaction
--------------
Rows whose target is ``ignore_index`` cost nothing: a stable sort on the device moves them to the end, and a
device-side count of the rows that count tells each program whether its row block holds any.  No host
synchronisation.
"""

from __future__ import annotations

import functools
import os

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from . import _layout

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def tuning(per_device: dict) -> dict:
    """The block sizes of one kernel file: its ``"interpret"`` entry under the interpreter, else ``"gpu"``."""
    return per_device["interpret" if INTERPRET else "gpu"]


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 4


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# Shared memory a software-pipelined tile loop may take for its operand buffers (Hopper: 227 KB per block;
# leave room for the compiler's own scratch).
_PIPELINE_SMEM_BYTES = 200 * 1024


def vocab_splits(row_blocks: int, vblocks: int, waves: int, device) -> tuple[int, int]:
    """``(splits, vocabulary blocks per split)``: enough programs for ``waves`` of the device's multiprocessors,
    each split a whole number of blocks, no split empty."""
    want = max(1, waves * num_sms(device))
    splits = max(1, min(vblocks, -(-want // row_blocks)))
    per_split = -(-vblocks // splits)
    return -(-vblocks // per_split), per_split


def fit_num_stages(num_stages: int, block_rows: int, block_cols: int, block_d: int, element_size: int) -> int:
    """``num_stages`` lowered until the operand buffers fit: a loop pipelined over ``num_stages`` keeps one pair
    of ``block_rows x block_d`` and ``block_cols x block_d`` tiles in shared memory per stage (fp32 128 x 256 x 64
    tiles at 3 stages ask for 3 x 98304 bytes, over Hopper's limit). fp32 inputs need twice what 16-bit ones do;
    every 16-bit tuning here fits as it is."""
    per_stage = (block_rows + block_cols) * block_d * element_size
    while num_stages > 2 and num_stages * per_stage > _PIPELINE_SMEM_BYTES:
        num_stages -= 1
    return num_stages


def dot_precision(dtype: torch.dtype) -> str:
    """How ``tl.dot`` (``_tile.dot``) multiplies fp32 operands: as torch's own CUDA matmuls do, read at each launch
    as cuBLAS reads it (``torch.set_float32_matmul_precision`` / ``torch.backends.cuda.matmul``). At the default
    ``"highest"``, true fp32 products ("ieee"); at ``"high"`` / ``"medium"``, TF32 tensor cores with the operands
    rounded to nearest first ("tf32_rn"), as cuBLAS's TF32 GEMMs give them: at "high", "ieee" would run on the CUDA
    cores, many times slower than torch.compile's TF32 matmuls; plain "tf32" truncates the operands, a biased error
    well above cuBLAS's; "tf32_rn" matches cuBLAS's error (measured; the figures are in docs/). 16-bit operands
    ignore it."""
    if dtype != torch.float32:
        return "tf32"
    return "tf32_rn" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


def upcast_dots(dtype: torch.dtype) -> bool:
    """Whether ``tl.dot`` operands must be upcast to fp32 (16-bit operands under the interpreter)."""
    return INTERPRET and dtype != torch.float32


def compact_counted(counted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices with the counted rows first (stable), and their number as a 1-element int32 device tensor."""
    row_order = torch.argsort((~counted).to(torch.int8), stable=True)
    return row_order, counted.sum(dtype=torch.int32).reshape(1)


def fp32_out_mm_available(device: torch.device) -> bool:
    """cuBLAS 16-bit products with an fp32 result (``aten::mm.dtype`` / ``addmm.dtype``; CUDA only, torch >= 2.8)."""
    return device.type == "cuda" and torch._C._dispatch_has_kernel_for_dispatch_key("aten::addmm.dtype", "CUDA")


# cuBLAS runs a 16-bit product several times slower when one of its dimensions is not a multiple of 8 elements,
# whatever the leading dimensions: products over a vocabulary dimension are split at a multiple of VOCAB_ALIGN (the
# aligned part at full speed, the tail as a second, small product).
VOCAB_ALIGN = _layout.VOCAB_ALIGN


def product_into(
    out: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    accumulate: bool,
    vocab_dim: str | None = None,
    **out_dtype,
) -> None:
    """``out (+)= a @ b``.  The first product of a sum writes with ``mm``: never ``addmm(beta=0)`` over
    uninitialised memory (an addmm may form beta * input, and 0 * NaN = NaN).  ``vocab_dim``: which dimension of the
    product runs over the vocabulary, ``"m"`` (rows of ``a`` and ``out``), ``"n"`` (columns of ``b`` and ``out``) or
    ``"k"`` (the inner one): split at a multiple of ``VOCAB_ALIGN`` where it is not one (above)."""
    size = a.shape[0] if vocab_dim == "m" else b.shape[1] if vocab_dim == "n" else a.shape[1] if vocab_dim == "k" else 0
    split = size - size % VOCAB_ALIGN
    if split == 0 or split == size:
        if accumulate:
            torch.addmm(out, a, b, out=out, **out_dtype)
        else:
            torch.mm(a, b, out=out, **out_dtype)
    elif vocab_dim == "m":
        product_into(out[:split], a[:split], b, accumulate=accumulate, **out_dtype)
        product_into(out[split:], a[split:], b, accumulate=accumulate, **out_dtype)
    elif vocab_dim == "n":
        product_into(out[:, :split], a, b[:, :split], accumulate=accumulate, **out_dtype)
        product_into(out[:, split:], a, b[:, split:], accumulate=accumulate, **out_dtype)
    else:
        product_into(out, a[:, :split], b[:split], accumulate=accumulate, **out_dtype)
        product_into(out, a[:, split:], b[split:], accumulate=True, **out_dtype)


def nonfinite_rows(rows: torch.Tensor) -> torch.Tensor:
    """Per row of a 2-D tensor, fp32: 0 where it is finite, NaN where it holds a NaN / inf (0 * x summed); one
    matrix-vector product, no temporary the size of ``rows``.  Eager's softmax gradient of a row that gets no
    gradient is 0, or NaN everywhere when its log-sum-exp is NaN: the kernels write this there."""
    return torch.mv(rows, torch.zeros(rows.shape[1], dtype=rows.dtype, device=rows.device)).float()


def weight_poison(c: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """0-dim fp32: 0, or NaN when any of C / bias, converted to the products' ``dtype`` (default: C's), is not finite
    (then every logit row holds a NaN).  C's largest magnitude (one reduction, no temporary) is converted as its
    entries are (rounding is monotone: an entry overflows the products' dtype, as autocast converts a wider head, iff
    the largest does; NaN propagates); the bias's entries are summed in fp32 (a 16-bit sum of finite ones may
    overflow)."""
    dtype = dtype or c.dtype
    if c.numel() == 0:  # (no largest magnitude: nothing to poison)
        poison = torch.zeros((), dtype=torch.float32, device=c.device)
    else:
        poison = torch.linalg.vector_norm(c, ord=float("inf")).to(dtype).float() * 0.0
    return poison if bias is None else poison + bias.to(dtype).float().sum() * 0.0


def tma_ok(*tensors: torch.Tensor) -> bool:
    """Whether the tensor-memory accelerator can read these 2-D tensors: 16-byte aligned base and row
    stride, contiguous rows."""
    return all(
        t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in tensors
    )


def descriptor(tensor: torch.Tensor, block: list) -> TensorDescriptor:
    """A host-built tensor-memory-accelerator descriptor over a 2-D tensor that passes :func:`tma_ok`, read in
    ``block``-shaped tiles (reads past an edge give 0)."""
    return TensorDescriptor.from_tensor(tensor, block)
