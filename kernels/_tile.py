"""Device helpers shared by the forward and backward kernels: one logit tile, and its softmax gradient.

For a block of ``BLOCK_N`` rows (row indices ``rows``, int64) and ``BLOCK_V`` vocabulary entries
(``vocab_ids``, int64, already clamped into ``[0, V)``) the tile is

    raw[n, v]    = sum_d E[rows[n], d] * C[vocab_ids[v], d]  (+ bias[vocab_ids[v]])
    logits[n, v] = softcap * tanh(raw[n, v] / softcap)       (or raw when there is no softcap)

computed as a loop over ``BLOCK_D`` chunks of the hidden dimension with an fp32 accumulator
(``tl.dot`` on the input dtype, fp32 accumulation; fp32 inputs use "ieee" precision).  Rows and
vocabulary ids are clamped, never masked, inside the loop: padded rows / columns read real memory and
are masked by the caller afterwards, which keeps the inner loop free of row/column masks.  All offsets
are int64 so ``V * D`` and ``N * D`` may exceed 2**31.
"""
import triton
import triton.language as tl


@triton.jit
def tanh(x):
    """tanh through exp (portable: the interpreter has no libdevice); exact to fp32 rounding."""
    a = tl.abs(x)
    t = 1.0 - 2.0 / (tl.exp(2.0 * a) + 1.0)
    return tl.where(x < 0, -t, t)


@triton.jit
def logit_tile(
    E, C, Bias, rows, vocab_ids, D,
    stride_en, stride_ed, stride_cv, stride_cd,
    softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
):
    offs_d = tl.arange(0, BLOCK_D)
    e_ptrs = E + rows[:, None] * stride_en + offs_d[None, :] * stride_ed
    c_ptrs = C + vocab_ids[:, None] * stride_cv + offs_d[None, :] * stride_cd
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        if EVEN_D:
            e_blk = tl.load(e_ptrs)
            c_blk = tl.load(c_ptrs)
        else:
            d_mask = (d0 + offs_d) < D
            e_blk = tl.load(e_ptrs, mask=d_mask[None, :], other=0.0)
            c_blk = tl.load(c_ptrs, mask=d_mask[None, :], other=0.0)
        if UPCAST:
            e_blk = e_blk.to(tl.float32)
            c_blk = c_blk.to(tl.float32)
        acc = tl.dot(e_blk, tl.trans(c_blk), acc, input_precision=DOT_PRECISION)
        e_ptrs += BLOCK_D * stride_ed
        c_ptrs += BLOCK_D * stride_cd
    if HAS_BIAS:
        acc += tl.load(Bias + vocab_ids).to(tl.float32)[None, :]
    if HAS_SOFTCAP:
        acc = softcap * tanh(acc / softcap)
    return acc


@triton.jit
def softmax_grad(logits, lse, grad_p, grad_row, target, vocab_ids, softcap, target_weight, uniform,
                 grad_entropy, mean_logit, HAS_SOFTCAP: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr):
    """The gradient w.r.t. the raw logits of a ``rows x cols`` tile, from its (softcapped) ``logits`` z:
    ``(p * (grad_p + h * (mean_logit - z)) - g * (target_weight * [col == target] + uniform)) * (1 - (z / softcap)^2)``
    with ``p = exp(z - lse)``, ``g = grad_row``, ``h = grad_entropy`` (no last factor without softcap; no h term
    without HAS_ENTROPY_GRAD).  Plain cross-entropy: ``grad_p = g``, ``target_weight = 1``, ``uniform = 0``; label
    smoothing eps: ``1 - eps`` and ``eps / V``; a log-sum-exp that is also used elsewhere adds its own upstream
    gradient to ``grad_p``; the entropy ``H = lse - sum_v p_v z_v`` has ``dH/dz_v = -p_v (z_v - sum_u p_u z_u)``.

    Rows with no gradient get 0, not 0 * (p - onehot): an ignored row's lse is 0 and exp(logits) may overflow to
    inf.  A NaN / inf logit still gives NaN there (``logits * 0``), as eager's log-softmax backward does."""
    one_hot = vocab_ids[None, :] == target[:, None]
    weight = grad_p[:, None]
    has_grad = (grad_p != 0.0) | (grad_row != 0.0)
    if HAS_ENTROPY_GRAD:
        weight += grad_entropy[:, None] * (mean_logit[:, None] - logits)
        has_grad = has_grad | (grad_entropy != 0.0)
    grad = weight * tl.exp(logits - lse[:, None]) - grad_row[:, None] * (target_weight * one_hot.to(tl.float32) + uniform)
    if HAS_SOFTCAP:
        capped = logits / softcap
        grad = grad * (1.0 - capped * capped)
    return tl.where(has_grad[:, None], grad, logits * 0.0)
