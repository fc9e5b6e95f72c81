"""Kernels or the chunked PyTorch path: the one place that decides which implementation computes a head.

CUDA tensors of a kernel dtype run the Triton kernels (``cce_inductor.kernels``) where Triton is installed;
everything else (CPU, fp64, CUDA without Triton) runs the chunked path (``cce_inductor._chunked``). Both take the
same arguments and give the same results; callers (the fused ops, the vocabulary-parallel loss) never choose.

Target codes, for both: ``ignore_index`` rows do not count; a target outside ``[0, V)`` counts, with no one-hot
term (a vocabulary shard sees the targets that other shards hold that way).
"""

from __future__ import annotations

import functools
import importlib
import warnings

import torch
from torch import Tensor

from . import _checks, _chunked, _counted_share, _loss, _planning, diagnostics, paths

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# Why ``cce_inductor.kernels`` could not be imported (None until tried, "" where it was): set by triton_kernels().
_kernels_error: str | None = None


@functools.cache
def triton_kernels():
    """``cce_inductor.kernels`` with its kernels loaded, or None where Triton is unavailable (``_kernels_error`` says
    why). The package's own constants (``kernels/_layout.py``) import without Triton; the kernels themselves load
    here, on first use. The folder is ``cce_inductor.kernels`` through the install's package-dir mapping
    (``pyproject.toml``; in a checkout, ``pip install --no-deps -e .``)."""
    global _kernels_error
    try:  # imports triton, optional on CPU-only installs
        kernels = importlib.import_module(f"{__package__}.kernels")
        _ = kernels.loss_and_grads  # loads the kernel modules, and Triton with them
    except ImportError as exc:
        _kernels_error = f"{type(exc).__name__}: {exc}"
        return None
    _kernels_error = ""
    return kernels


def _misses_kernels(device: torch.device, dtype: torch.dtype) -> bool:
    """A CUDA head of a kernel dtype in a process without the kernels."""
    return device.type == "cuda" and dtype in _KERNEL_DTYPES and triton_kernels() is None


def uses_kernels(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether tensors on ``device`` of ``dtype`` take the Triton path (the fake impls must agree). A CUDA head of a
    kernel dtype that cannot have them warns once: the chunked path computes the same numbers, slower."""
    if _misses_kernels(device, dtype):
        _warn_no_kernels()
        return False
    return device.type == "cuda" and dtype in _KERNEL_DTYPES


def no_kernels_note(device: torch.device, dtype: torch.dtype) -> str:
    """For a site's ``stats()`` record: why a CUDA head of a kernel dtype runs the chunked path ("" otherwise)."""
    if not _misses_kernels(device, dtype):
        return ""
    return f"; no Triton kernels on this CUDA device ({_kernels_error}): {_NO_KERNELS_FIX}"


_NO_KERNELS_FIX = (
    "the chunked PyTorch path runs instead, much slower on a real model's step; install Triton and "
    "the package (pip install -e . from a checkout)"
)


@functools.cache
def _warn_no_kernels() -> None:
    warnings.warn(
        f"cce_inductor: no Triton kernels for CUDA tensors ({_kernels_error}); {_NO_KERNELS_FIX}",
        RuntimeWarning,
        stacklevel=3,
    )


def lse_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype of the per-row results (log-sum-exp, entropy): fp32 from the kernels, else the accumulation dtype."""
    return torch.float32 if uses_kernels(device, dtype) else _chunked.accumulation_dtype(dtype)


# Where a symbolic size has no hint (unbacked), the choice assumes a typical training batch.
_UNKNOWN_ROWS = 8192


def size_hint(value) -> int | None:
    """An int size as it is; a symbolic one's hint (the size it was traced with), None where it has none."""
    if isinstance(value, int):
        return value
    hint = getattr(getattr(value, "node", None), "hint", None)  # a SymInt
    return int(hint) if hint is not None else None


def head_facts(
    rows, hidden, vocab, dtype: torch.dtype, device: torch.device, reduction: str, *, needs_grad: bool, **more
) -> paths.HeadFacts:
    """What :func:`cce_inductor.paths.choose` reads of a head; ``more``: its other fields. Sizes may be symbolic (a
    site compiled with a dynamic batch): their hint, the size the site was compiled for, stands in."""

    def size(value) -> int:
        hint = size_hint(value)
        return hint if hint is not None else _UNKNOWN_ROWS

    return paths.HeadFacts(
        rows=size(rows),
        hidden=size(hidden),
        vocab=size(vocab),
        element_size=dtype.itemsize,
        kernels=uses_kernels(device, dtype),
        reduction=reduction,
        needs_grad=needs_grad,
        **more,
    )


def in_compute_dtype(e: Tensor, c: Tensor, bias: Tensor | None, compute_dtype: torch.dtype | None):
    """The operands in the products' dtype, converted for this call only (autocast's ``F.linear`` casts)."""
    if compute_dtype is None:
        return e, c, bias
    return tuple(None if x is None else x.to(compute_dtype) for x in (e, c, bias))


def check_target_range(e: Tensor, targets: Tensor, vocab: int, ignore_index: int) -> None:
    """Out-of-range targets fail as in eager (:func:`cce_inductor._checks.check_target_range`); where the kernels run,
    in one launch (``kernels._targets``, which also counts the rows for the balanced path) instead of eight."""
    if uses_kernels(e.device, e.dtype):
        triton_kernels().count_targets(targets, ignore_index, mean=False, check_vocab=vocab)
    else:
        _checks.check_target_range(targets, vocab, ignore_index)


def forward(
    e: Tensor,
    c: Tensor,
    targets: Tensor,
    bias: Tensor | None,
    *,
    softcap: float | None,
    ignore_index: int,
    logit_sum: bool = False,
    mean_logit: bool = False,
    every_row: bool = False,
    argmax_out: Tensor | None = None,
    argmax_round: torch.dtype | None = None,
):
    """``(lse, target_logit, logit_sum | None, mean_logit | None)`` per row. ``every_row``: ignored rows are computed
    too (the chunked path always computes them; the kernels skip them otherwise, leaving 0). ``argmax_out``: an int64
    ``(N,)`` tensor filled with each row's argmax over the logits rounded to ``argmax_round`` (``torch.argmax``'s
    ties; with the kernels, 0 at rows not computed)."""
    kw = dict(softcap=softcap, ignore_index=ignore_index, logit_sum=logit_sum, mean_logit=mean_logit)
    kw.update(argmax_out=argmax_out, argmax_round=argmax_round)
    if uses_kernels(e.device, e.dtype) and e.shape[0] > 0:
        return tuple(triton_kernels().forward(e, c, targets, bias, every_row=every_row, **kw))
    return _chunked.forward(e, c, targets, bias, **kw)


def backward(
    e: Tensor,
    c: Tensor,
    targets: Tensor,
    bias: Tensor | None,
    lse: Tensor,
    grad_rows: Tensor,
    *,
    softcap: float | None,
    ignore_index: int,
    options,
    need_e: bool,
    need_c: bool,
    need_bias: bool,
    label_smoothing: float = 0.0,
    grad_lse: Tensor | None = None,
    grad_entropy: Tensor | None = None,
    mean_logit: Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
):
    """``(dE | None, dC | None, dbias | None)``, each in its input's dtype; ``grad_rows`` is 0 at ignored rows;
    ``options`` a :class:`cce_inductor.CCEOptions` (``products``, ``backward_row_chunk``): the kernels' plan is made
    from them here (:func:`cce_inductor._planning.backward_plan`); ``products="auto"`` is decided per call, from the
    share of rows an earlier call of this head counted (:mod:`cce_inductor._counted_share`).
    ``compute_dtype``: the products' dtype where the inputs are stored in another (autocast): the kernels convert the
    head a vocabulary chunk at a time; the gradients keep the inputs' dtypes."""
    de_dtype, dc_dtype, db_dtype = e.dtype, c.dtype, None if bias is None else bias.dtype
    dtype = compute_dtype or e.dtype
    common = dict(softcap=softcap, need_e=need_e, need_c=need_c, need_bias=need_bias, label_smoothing=label_smoothing)
    common.update(grad_lse=grad_lse, grad_entropy=grad_entropy, mean_logit=mean_logit)
    if compute_dtype is not None and not uses_kernels(e.device, dtype):
        e, c, bias = in_compute_dtype(e, c, bias, compute_dtype)
    elif compute_dtype is not None:
        e = e.to(compute_dtype)
    if uses_kernels(e.device, dtype) and e.shape[0] > 0:
        kernels = triton_kernels()
        share = _counted_share.of_head(e.device, c.shape[0], c.shape[1])
        # with a gradient for every row's lse / entropy every row counts: nothing to skip, nothing to learn
        every_row = grad_lse is not None or grad_entropy is not None
        can_skip = kernels.row_skipping_ok(e, c)  # (else even a forced "triton" runs cuBLAS)
        seen = share.seen()
        products = _counted_share.products(options.products, seen, row_skipping_ok=can_skip and not every_row)
        diagnostics.count_products(products if can_skip else "cublas")
        prefix = products == "counted_prefix"
        # the earlier shares' low quantile sizes the prefix, or the row-skipping products' G blocks where "auto"
        # chose them (the calls that count fewest rows are the ones that wait on the host)
        auto_row_skipping = products == "triton" and options.products == "auto"
        hint = seen.low if prefix or auto_row_skipping else None
        plan = _planning.backward_plan(
            e.shape[0],
            c.shape[0],
            products=products,
            backward_row_chunk=options.backward_row_chunk,
            counted_hint=hint,
            row_skipping=can_skip,
        )
        grads = kernels.backward(
            e, c, targets, bias, lse.float(), grad_rows.float(), ignore_index=ignore_index, **common,
            **plan._asdict(), observe_counted=share.observe if options.products == "auto" and not every_row else None,
            de_dtype=de_dtype, dc_dtype=dc_dtype, compute_dtype=compute_dtype,
        )  # fmt: skip
    else:
        # (fp32 stored inputs: the accumulation dtype's gradients are theirs, with no 16-bit rounding between)
        wide = any(dtype is not None and dtype.itemsize > e.dtype.itemsize for dtype in (de_dtype, dc_dtype, db_dtype))
        grads = _chunked.backward(e, c, targets, bias, lse, grad_rows, **common, in_accumulation_dtype=wide)
    return tuple(None if grad is None else grad.to(dtype) for grad, dtype in zip(grads, (de_dtype, dc_dtype, db_dtype)))


def loss_and_grads(
    e: Tensor,
    c: Tensor,
    targets: Tensor,
    bias: Tensor | None,
    *,
    softcap: float | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    chunk_rows: int,
    plain_sum: bool,
    de_pair: bool,
    need_e: bool,
    need_c: bool,
    need_bias: bool,
    compute_dtype: torch.dtype | None = None,
    products: str = "auto",
    grad_scale: Tensor | None = None,
):
    """The balanced path: ``(loss, dE, dC, dbias, dE_lo, dC_lo)`` of a "mean" / "sum" loss, the gradients those of the
    loss itself (upstream gradient 1; with ``grad_scale``, a 0-dim fp32 tensor, those of ``grad_scale * loss``, G
    scaled before its rounding), each in its input's dtype as ``kernels.loss_and_grads`` returns them (an fp32
    gradient whole, a 16-bit one as a pair, but dC with ``plain_sum`` and dE without ``de_pair`` alone; dbias in
    fp32; None where not asked for). The kernels go through row chunks of ``chunk_rows`` rows
    (``paths.BalancedPlan``); the chunked path runs its forward and backward back to back in the accumulation dtype
    and rounds the result the same way. Targets outside ``[0, V)`` that are not ``ignore_index`` fail as in eager
    (:func:`check_target_range`). ``compute_dtype``: the products' dtype where it is not the inputs' (autocast).
    ``products`` (``CCEOptions.products``): whether the kernels skip ignored rows, decided per call from the share of
    rows earlier calls of this head counted
    (``_counted_share.balanced_prefix``)."""
    dtype = compute_dtype or e.dtype
    common = dict(softcap=softcap, label_smoothing=label_smoothing, need_e=need_e, need_c=need_c, need_bias=need_bias)
    if uses_kernels(e.device, dtype):
        kernels = triton_kernels()
        share = _counted_share.of_head(e.device, c.shape[0], c.shape[1])
        prefix = _counted_share.balanced_prefix(products, share.seen(), e.shape[0])
        can_skip = kernels.balanced_row_skipping_ok(e, c, compute_dtype=compute_dtype, need_bias=need_bias)
        if prefix is not None and not can_skip:
            diagnostics.count_balanced_rows("cannot_skip")  # ignored rows multiplied where they would be skipped
            prefix = None
        elif e.shape[0] > 0:
            diagnostics.count_balanced_rows("every_row" if prefix is None or prefix >= e.shape[0] else "counted_prefix")
        return tuple(
            kernels.loss_and_grads(
                e, c, targets, bias, ignore_index=ignore_index, reduction=reduction, check_range=True,
                compute_dtype=compute_dtype,
                chunk_rows=chunk_rows, plain_sum=plain_sum, de_pair=de_pair, counted_prefix_rows=prefix,
                observe_counted=share.observe if products == "auto" else None, grad_scale=grad_scale, **common,
            )
        )  # fmt: skip
    _checks.check_target_range(targets, c.shape[0], ignore_index)
    stored = (e.dtype, c.dtype)
    if compute_dtype is not None:  # autocast's casts, as F.linear makes them
        e, c, bias = in_compute_dtype(e, c, bias, compute_dtype)
    acc = _chunked.accumulation_dtype(e.dtype)
    lse, target_logit, logit_sum, _ = _chunked.forward(
        e, c, targets, bias, softcap=softcap, ignore_index=ignore_index, logit_sum=label_smoothing != 0.0
    )
    valid = targets != ignore_index
    row_loss = _loss.row_losses(lse, target_logit, logit_sum, valid, label_smoothing, c.shape[0], acc)
    loss = _loss.reduce_rows(row_loss, valid, reduction)
    grad_rows = _loss.grad_rows(_upstream(grad_scale, e.device), valid, reduction, acc)
    grad_e, grad_c, grad_bias = _chunked.backward(
        e, c, targets, bias, lse, grad_rows, **common, in_accumulation_dtype=True
    )
    grad_e, grad_e_lo = _as_stored(grad_e, stored[0], alone=not de_pair)
    grad_c, grad_c_lo = _as_stored(grad_c, stored[1], alone=plain_sum)
    return loss, grad_e, grad_c, grad_bias, grad_e_lo, grad_c_lo


def lean_loss_and_grads(
    e, c, targets, bias, *, softcap, ignore_index, reduction, label_smoothing, need_e, need_c, need_bias, compute_dtype,
    options, plain_sum: bool, de_pair: bool, grad_scale: Tensor | None = None,
):  # fmt: skip
    """:func:`loss_and_grads`' results computed by the lean path, forward then backward at upstream gradient 1 (its
    memory: one G block, no scratch of logits), in the same layout: each gradient the lean path's, rounded once, and
    a 16-bit pair's remainder 0 (none for dC with ``plain_sum``, for dE without ``de_pair``), at upstream gradient
    ``grad_scale`` as there.
    ``options``: a ``CCEOptions`` (the backward's)."""
    e_cd, c_cd, bias_cd = in_compute_dtype(e, c, bias, compute_dtype)
    check_target_range(e_cd, targets, c.shape[0], ignore_index)
    lse, target_logit, logit_sum, _ = forward(
        e_cd, c_cd, targets, bias_cd, softcap=softcap, ignore_index=ignore_index, logit_sum=label_smoothing != 0.0
    )
    e_cd = c_cd = bias_cd = None  # (the backward converts the head a vocabulary chunk at a time)
    valid = targets != ignore_index
    acc = _chunked.accumulation_dtype(compute_dtype or e.dtype)
    row_loss = _loss.row_losses(lse, target_logit, logit_sum, valid, label_smoothing, c.shape[0], acc)
    loss = _loss.reduce_rows(row_loss, valid, reduction)
    grad_rows = _loss.grad_rows(_upstream(grad_scale, e.device), valid, reduction, acc)
    grad_e, grad_c, grad_bias = backward(
        e, c, targets, bias, lse, grad_rows, softcap=softcap, ignore_index=ignore_index, options=options,
        need_e=need_e, need_c=need_c, need_bias=need_bias, label_smoothing=label_smoothing,
        compute_dtype=compute_dtype,
    )  # fmt: skip
    sixteen = (torch.bfloat16, torch.float16)
    grad_e_lo = torch.zeros_like(grad_e) if grad_e is not None and e.dtype in sixteen and de_pair else None
    grad_c_lo = torch.zeros_like(grad_c) if grad_c is not None and c.dtype in sixteen and not plain_sum else None
    return loss, grad_e, grad_c, grad_bias, grad_e_lo, grad_c_lo


def _upstream(grad_scale: Tensor | None, device: torch.device) -> Tensor:
    """The upstream gradient the balanced path's gradients are computed at: ``grad_scale``, else 1."""
    return torch.ones((), dtype=torch.float32, device=device) if grad_scale is None else grad_scale


def _as_stored(grad: Tensor | None, dtype: torch.dtype, *, alone: bool) -> tuple[Tensor | None, Tensor | None]:
    """A gradient summed in the accumulation dtype as the balanced op returns it in ``dtype``: as it is in fp32 /
    fp64 (rounded to fp32 from fp64 only where stored in fp32), a 16-bit pair ``(round(x), round(x - round(x)))``,
    or ``alone`` a 16-bit gradient rounded once."""
    if grad is None:
        return None, None
    if dtype.itemsize >= 4 or alone:
        return grad.to(dtype), None
    hi = grad.to(dtype)
    return hi, (grad - hi.to(grad.dtype)).to(dtype)
