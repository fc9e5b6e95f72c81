"""Device helpers shared by the forward and backward kernels: one logit tile, and the softmax gradient.

For a block of ``BLOCK_N`` rows (row indices ``rows``, int64) and ``BLOCK_V`` vocabulary entries
(``vocab_ids``, int64, already clamped into ``[0, V)``) the tile is

    raw[n, v]    = sum_d E[rows[n], d] * C[vocab_ids[v], d]  (+ bias[vocab_ids[v]])
    logits[n, v] = softcap * tanh(raw[n, v] / softcap)       (or raw when there is no softcap)

computed as a loop over ``BLOCK_D`` chunks of the hidden dimension with an fp32 accumulator
(``tl.dot`` on the input dtype, fp32 accumulation; fp32 inputs as ``_launch.dot_precision`` says).  Rows and
vocabulary ids are clamped, never masked, inside the loop: padded rows / columns read real memory and
are masked by the caller afterwards, which keeps the inner loop free of row/column masks.  All offsets
are int64 so ``V * D`` and ``N * D`` may exceed 2**31.

With ``TMA`` the operand tiles come from the tensor-memory accelerator instead: ``E`` and ``C`` are then host-built
descriptors (:func:`cce_inductor.kernels._launch.descriptor`) over a *compacted* E (row ``row0 + i`` of the tile is
compacted row ``row0 + i``: Hopper has no TMA gather) and over C, and the tile is ``[row0, row0 + BLOCK_N) x
[col0, col0 + BLOCK_V)``; reads past an edge give 0.  The copy engine computes the addresses and signals completion
on a barrier, so the pipelined loop issues no per-thread address arithmetic and keeps fewer registers.
"""

import triton
import triton.language as tl


@triton.jit
def tanh(x):
    """tanh through exp (portable: the interpreter has no libdevice): 1 - 2 / (e^2x + 1), which tends to -1 / +1
    as e^2x underflows to 0 / overflows to inf, so it needs no sign select (one tile-sized mask fewer live in the
    softcap's epilogue); absolute error ~1e-7 (cancellation near 0, as any exp form has)."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def round_bf16_rne(x):
    """fp32 -> the nearest bf16 value (ties to even), still in fp32.  For Triton's interpreter, whose fp32 -> bf16
    cast truncates (the GPU's cvt.rn rounds to nearest): after it the truncating cast is exact."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def round_to_tf32(x):
    """fp32 -> the nearest TF32 value (10 mantissa bits; ties away from zero, as PTX's ``cvt.rna.tf32.f32``): add
    half of TF32's unit in the last place to the bit pattern, clear the 13 bits TF32 drops. NaN stays NaN (a
    payload in the top mantissa bits would carry into the sign); a value past TF32's largest rounds to inf."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = ((bits + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return tl.where(x == x, rounded, x)


@triton.jit
def dot(a, b, acc, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``acc + a @ b`` in fp32 for every kernel here. ``DOT_PRECISION`` as ``_launch.dot_precision`` gives it:
    "tf32_rn" rounds fp32 operands to the nearest TF32 value first and multiplies in TF32 (``tl.dot``'s "tf32"
    alone hands the tensor cores the fp32 bits, which keep the top 10 mantissa bits: rounding toward zero, a bias
    that pulls every logit toward 0); 16-bit operands are upcast under the interpreter (see ``_launch``)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if DOT_PRECISION == "tf32_rn":
        return tl.dot(round_to_tf32(a), round_to_tf32(b), acc, input_precision="tf32")
    else:
        return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def logit_tile(
    E, C, Bias,
    rows, vocab_ids, row0, col0, D,
    stride_en, stride_ed, stride_cv, stride_cd,
    softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, TMA: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    if TMA:
        for d0 in range(0, D, BLOCK_D):
            acc = dot(E.load([row0, d0]), tl.trans(C.load([col0, d0])), acc, UPCAST, DOT_PRECISION)
    else:
        # 1-D row pointers, offset per step: a 2-D pointer tile carried through the loop held ~190 registers
        e_rows = E + rows * stride_en
        c_rows = C + vocab_ids * stride_cv
        offs_d = tl.arange(0, BLOCK_D)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + offs_d
            if EVEN_D:
                e_blk = tl.load(e_rows[:, None] + (d * stride_ed)[None, :])
                c_blk = tl.load(c_rows[:, None] + (d * stride_cd)[None, :])
            else:
                d_mask = (d < D)[None, :]
                e_blk = tl.load(e_rows[:, None] + (d * stride_ed)[None, :], mask=d_mask, other=0.0)
                c_blk = tl.load(c_rows[:, None] + (d * stride_cd)[None, :], mask=d_mask, other=0.0)
            acc = dot(e_blk, tl.trans(c_blk), acc, UPCAST, DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(Bias + vocab_ids).to(tl.float32)[None, :]
    if HAS_SOFTCAP:
        acc = softcap * tanh(acc / softcap)
    return acc


@triton.jit
def softmax_grad(
    z, lse, grad_p, grad_entropy, mean_logit, offset, softcap, HAS_SOFTCAP: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr
):
    """The gradient w.r.t. the raw logits at (softcapped) logits ``z``, every other argument broadcast to z's shape
    (per-row values as ``x[:, None]`` for a tile, plain for a vector of one entry per row):
    ``(p * (grad_p + h * (mean_logit - z)) - offset) * (1 - (z / softcap)^2)`` with ``p = exp(z - lse)`` and
    ``h = grad_entropy`` (no last factor without softcap; no h term without HAS_ENTROPY_GRAD).  The caller picks
    ``offset``: ``g * eps / V`` off the target, ``g * (1 - eps + eps / V)`` at it (``g``: the row's loss gradient,
    ``eps``: label smoothing); a log-sum-exp also used elsewhere adds its own upstream gradient to ``grad_p``; the
    entropy ``H = lse - sum_v p_v z_v`` has ``dH/dz_v = -p_v (z_v - sum_u p_u z_u)``.

    Rows with no gradient must come with ``lse = +inf`` (then p = 0 and the result 0, not 0 * (p - onehot): an
    ignored row's exp(z) may overflow to inf); a NaN or +inf logit still gives NaN there, as eager's log-softmax
    backward does."""
    weight = grad_p
    if HAS_ENTROPY_GRAD:
        weight = weight + grad_entropy * (mean_logit - z)
    grad = weight * tl.exp(z - lse) - offset
    if HAS_SOFTCAP:
        capped = z * (1.0 / softcap)
        grad = grad - grad * capped * capped  # (this form spills fewer registers than grad * (1 - capped^2))
    return grad
