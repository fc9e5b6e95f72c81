"""Launch helpers of the lean backward (the kernels and their math: ``_backward.py``).

:func:`backward` lays one call out (:class:`_LeanCall`: the G buffers, the row chunks and their recompute
arguments, where each gradient is summed), then walks the vocabulary in chunks of ``block_width`` columns: for each,
the recompute kernel writes the chunk's G block, and cuBLAS (or the row-skipping products) add its share of dE and
dC. Every decision (row chunk, block width, products) is the caller's, an explicit argument.
"""

from __future__ import annotations

import torch
import triton

from . import _forward, _launch, _products
from ._backward import _TUNING, _recompute_grad_kernel
from ._row_chunks import _block, _PrefixTail, _RowChunk, _target_logits, _uncompact_rows, counted_prefix


def row_skipping_ok(e: torch.Tensor, c: torch.Tensor) -> bool:
    """Whether the row-skipping products (``products="triton"``) can run for these operands: C and E rows that the
    tensor-memory accelerator can read."""
    return _launch.tma_ok(c) and (e.shape[1] * e.element_size()) % 16 == 0


def backward(
    e, c, targets, bias, lse, grad_rows, *, softcap, ignore_index, need_e, need_c, need_bias, row_chunk, block_width,
    products, counted_hint=None, label_smoothing=0.0, grad_lse=None, grad_entropy=None, mean_logit=None,
    observe_counted=None, de_dtype=None, dc_dtype=None, compute_dtype=None,
):  # fmt: skip
    """Launch helper: ``(dE | None, dC | None, dbias | None)``; ``grad_rows`` fp32, 0 at ignored rows.  Rows whose
    target is ``ignore_index`` are skipped by the recompute (and by the Triton products) unless ``grad_lse`` (the
    upstream gradient of every row's lse, fp32) or ``grad_entropy`` (that of every row's entropy, with the forward's
    ``mean_logit``) is given; a target outside ``[0, V)`` (a vocabulary shard's code for "another shard's") counts,
    with no one-hot term.

    The plan (the caller's, every field explicit): G blocks of ``row_chunk`` rows x
    ``block_width`` columns; ``products``: ``"cublas"`` over every row, ``"triton"`` (the row-skipping products of
    ``_products``; their operands must pass :func:`row_skipping_ok`), or ``"prefix"``: cuBLAS over the first
    :func:`counted_prefix` rows of each compacted row chunk after an earlier call that counted ``counted_hint`` of its
    rows, the row-skipping products past them (nothing there where this call counts no more rows than the hint).
    ``observe_counted``: called with the first row chunk's device-side count of counted rows and its rows.
    ``de_dtype`` / ``dc_dtype``: the gradients' dtypes where not the operands' (autocast's fp32 inputs: dE is its fp32
    sums, dC written in fp32, with no 16-bit rounding between).  ``compute_dtype``: C (and bias) are stored in another
    dtype than the products' (autocast's fp32 head; ``e`` is already in ``compute_dtype``): each vocabulary chunk of C
    is converted as it is reached, into one ``block_width x D`` buffer, so no converted copy of the whole head
    exists."""
    n, d = e.shape
    v = c.shape[0]
    need_bias = need_bias and bias is not None
    de_dtype, dc_dtype = de_dtype or e.dtype, dc_dtype or c.dtype
    # an fp32 dE is its own fp32 sums (but where they are summed in compacted order and put back at the end)
    de_is_sums = need_e and de_dtype == torch.float32 and products != "prefix"
    de_out = torch.empty((n, d), dtype=de_dtype, device=e.device) if need_e else None
    dc_out = torch.empty((v, d), dtype=dc_dtype, device=e.device) if need_c else None
    dbias32 = torch.zeros((v,), dtype=torch.float32, device=e.device) if need_bias else None
    if n == 0 or not (need_e or need_c or need_bias):
        if need_c:
            dc_out.zero_()
        return de_out, dc_out, (dbias32.to(bias.dtype) if need_bias else None)
    call = _LeanCall.of(
        e, c, targets, bias, lse, grad_rows, de_out, dc_out, dbias32, de_is_sums,
        softcap=softcap, ignore_index=ignore_index, row_chunk=row_chunk, block_width=block_width,
        products=products, counted_hint=counted_hint, label_smoothing=label_smoothing,
        grad_lse=grad_lse, grad_entropy=grad_entropy, mean_logit=mean_logit, compute_dtype=compute_dtype,
    )  # fmt: skip
    if observe_counted is not None:
        observe_counted(call.chunks[0].num_counted, call.chunks[0].rows)
    for v0 in range(0, v, call.vocab_chunk):
        call.vocab_chunk_step(v0)
    return call.finish()


class _LeanCall:
    """One lean backward call, laid out (:meth:`of`) before its vocabulary chunks (:meth:`vocab_chunk_step`) and
    finished (:meth:`finish`): the G buffers, the row chunks and their recompute arguments, where each gradient is
    summed.  Attributes are set once in :meth:`of`."""

    @classmethod
    def of(
        cls, e, c, targets, bias, lse, grad_rows, de_out, dc_out, dbias32, de_is_sums, *, softcap, ignore_index,
        row_chunk, block_width, products, counted_hint, label_smoothing, grad_lse, grad_entropy, mean_logit,
        compute_dtype,
    ):  # fmt: skip
        self = cls()
        tune = _launch.tuning(_TUNING)
        n, d = e.shape
        v = c.shape[0]
        device = e.device
        need_e, need_c, need_bias = de_out is not None, dc_out is not None, dbias32 is not None
        convert_c = compute_dtype is not None and c.dtype != compute_dtype
        every_row = grad_lse is not None or grad_entropy is not None
        counted = torch.ones_like(targets, dtype=torch.bool) if every_row else targets != ignore_index
        row_chunk = min(n, row_chunk or n)
        sixteen_bit = e.dtype in (torch.bfloat16, torch.float16)
        triton_products = products == "triton"
        # cuBLAS over a counted prefix of the compacted rows, the Triton products over the rest (dE in compacted order)
        prefix = products == "prefix" and counted_prefix(counted_hint, row_chunk, tune["block_n"]) < row_chunk
        vocab_chunk = min(v, block_width)
        # 16-bit products with fp32 results where cuBLAS has them; where no such product exists (the CPU interpreter)
        # 16-bit operands are upcast.
        fp32_out = sixteen_bit and _launch.fp32_out_mm_available(device)
        upcast = sixteen_bit and not fp32_out and not triton_products  # (the interpreter's Triton products upcast)
        # G's row pitch: the chunk width padded to 16-byte aligned rows (the Triton products' descriptors and cuBLAS
        # both want aligned leading dimensions; the last, narrower chunk keeps the pitch)
        g_row_pitch = -(-vocab_chunk * e.element_size() // 16) * 16 // e.element_size()
        g_buf = torch.empty(row_chunk * g_row_pitch, dtype=e.dtype, device=device)
        # dE in fp32 until every vocabulary chunk has added to it; dC of one vocabulary chunk in fp32 where several
        # row chunks add to it: each gradient is rounded once, whatever N
        de32 = (de_out if de_is_sums else torch.empty((n, d), dtype=torch.float32, device=device)) if need_e else None
        # (the counted-prefix products sum cuBLAS's part there too, and the tail writes dC from it)
        dc_sums_fp32 = need_c and n > row_chunk
        dc32 = (
            torch.empty((vocab_chunk, d), dtype=torch.float32, device=device)
            if dc_sums_fp32 or (need_c and prefix)
            else None
        )
        lse = lse.contiguous()
        grad_rows = grad_rows.to(torch.float32).contiguous()
        grad_lse = None if grad_lse is None else grad_lse.to(torch.float32).contiguous()
        if grad_entropy is not None:
            grad_entropy = grad_entropy.to(torch.float32).contiguous()
            mean_logit = mean_logit.to(torch.float32).contiguous()
        targets = targets.contiguous()
        # 0, or NaN when any of C / bias is not finite (then every logit row holds a NaN)
        weight_poison = _launch.weight_poison(c, bias, compute_dtype)  # (as autocast converts a wider head)
        c_buf = None
        if convert_c:
            bias = None if bias is None else bias.to(compute_dtype)
            c_buf = torch.empty((vocab_chunk, d), dtype=compute_dtype, device=device)
        # every in-vocabulary target's logit (ignored rows too: with grad_lse their target entry still has a gradient)
        target_logit = _target_logits(e, c, targets, bias, softcap, compute_dtype if convert_c else None)
        block_n, block_v, block_d = tune["block_n"], tune["block_v"], tune["block_d"]
        use_tma = _forward.tma_operands(e, c_buf if convert_c else c, tune)
        compact_g = triton_products or prefix
        # (the compacted copies of E's rows live in dE's rows while those are free: where dE is not its own fp32 sums
        # and the dtypes agree)
        spare_rows = de_out if need_e and not de_is_sums and de_out.dtype == e.dtype else None
        chunks = [
            _RowChunk.of(
                e, counted, r0, min(row_chunk, n - r0), weight_poison, spare_rows, block_n, block_d,
                compact=(compact_g and need_c) or use_tma, tma=use_tma, poison_sum=compact_g and need_c,
            )
            for r0 in range(0, n, row_chunk)
        ]  # fmt: skip
        tails = (
            [_PrefixTail.of(chunk, counted_prefix(counted_hint, chunk.rows, block_n)) for chunk in chunks]
            if prefix
            else None
        )
        self._recompute_args(
            chunks, tails, lse, grad_rows, grad_lse, grad_entropy, mean_logit, targets, target_logit, bias,
            softcap=softcap, label_smoothing=label_smoothing, v=v, d=d, compact_g=compact_g, need_bias=need_bias,
            use_tma=use_tma, dtype=e.dtype, tune=tune,
        )  # fmt: skip
        self.e, self.c, self.bias, self.targets = e, c, bias, targets
        self.bias_or_lse = bias if bias is not None else lse
        self.c_op = _launch.descriptor(c, [block_v, block_d]) if use_tma and not convert_c else c
        self.c_buf, self.convert_c, self.use_tma = c_buf, convert_c, use_tma
        self.block_n, self.block_v, self.block_d = block_n, block_v, block_d
        self.chunks, self.tails, self.prefix, self.triton_products = chunks, tails, prefix, triton_products
        self.vocab_chunk, self.g_buf, self.g_row_pitch = vocab_chunk, g_buf, g_row_pitch
        self.de_out, self.dc_out, self.dbias32, self.de32, self.dc32 = de_out, dc_out, dbias32, de32, dc32
        self.de_is_sums, self.dc_sums_fp32, self.upcast = de_is_sums, dc_sums_fp32, upcast
        self.out_dtype = {"out_dtype": torch.float32} if fp32_out else {}  # fp32 results, 16-bit operands
        self.programs = _launch.num_sms(device)  # a persistent grid: one program per multiprocessor
        return self

    def _recompute_args(
        self, chunks, tails, lse, grad_rows, grad_lse, grad_entropy, mean_logit, targets, target_logit, bias, *,
        softcap, label_smoothing, v, d, compact_g, need_bias, use_tma, dtype, tune,
    ):  # fmt: skip
        """The recompute kernel's arguments that do not change from one vocabulary chunk to the next."""
        block_n, block_v, block_d = tune["block_n"], tune["block_v"], tune["block_d"]
        # G's positions that some product reads: every row for cuBLAS over every row and for the bias gradient (a
        # sum over G's rows); in compacted order, the counted rows' blocks (the recompute stores those whole; the
        # Triton products read whole blocks and K steps that divide them: tests/kernels/test_backward.py checks the
        # tunings) and the cuBLAS prefix
        self.stored_rows = [
            chunk.rows if not compact_g or need_bias else (tails[k].h if tails is not None else 0)
            for k, chunk in enumerate(chunks)
        ]
        # per row chunk, the recompute's row-indexed arguments (sliced once here, not once per vocabulary chunk: the
        # host's launch work is what a small N waits on)
        self.chunk_rows_args = [
            (
                lse[r0:],
                grad_rows[r0:],
                (grad_rows if grad_lse is None else grad_lse)[r0:],
                (grad_rows if grad_entropy is None else grad_entropy)[r0:],
                (grad_rows if grad_entropy is None else mean_logit)[r0:],
                targets[r0:],
                target_logit[r0:],
            )
            for r0 in (chunk.r0 for chunk in chunks)
        ]
        self.flags = dict(
            HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None, HAS_LSE_GRAD=grad_lse is not None,
            HAS_ENTROPY_GRAD=grad_entropy is not None, COMPACT_G=compact_g, TMA=use_tma,
            UPCAST=_launch.upcast_dots(dtype), DOT_PRECISION=_launch.dot_precision(dtype), EVEN_D=(d % block_d == 0),
            BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_D=block_d,
            GROUP_V=max(1, tune["recompute_group"] // block_v),
            num_warps=tune["num_warps"],
            num_stages=_launch.fit_num_stages(tune["num_stages"], block_n, block_v, block_d, dtype.itemsize),
        )  # fmt: skip
        softcap_val = float(softcap) if softcap is not None else 1.0
        self.label_weights = (softcap_val, 1.0 - label_smoothing, label_smoothing / v)

    def vocab_chunk_step(self, v0: int) -> None:
        """The vocabulary chunk from ``v0``: per row chunk the recompute into G, then its products."""
        v, d = self.c.shape[0], self.e.shape[1]
        width = min(self.vocab_chunk, v - v0)
        c_chunk = self.c[v0 : v0 + width]
        # a head stored in another dtype: this chunk converted; the recompute then reads it (and the bias, and the
        # targets) from the chunk's own first entry
        chunk_start, chunk_vocab, chunk_bias, chunk_args, c_op = (
            v0,
            v,
            self.bias_or_lse,
            self.chunk_rows_args,
            self.c_op,
        )
        if self.convert_c:
            c_chunk = self.c_buf[:width].copy_(c_chunk)
            c_op = _launch.descriptor(c_chunk, [self.block_v, self.block_d]) if self.use_tma else c_chunk
            chunk_start, chunk_vocab = 0, width
            chunk_bias = self.bias[v0:] if self.bias is not None else self.bias_or_lse
            local_targets = self.targets - v0
            chunk_args = [
                args[:5] + (local_targets[chunk.r0 :],) + args[6:]
                for args, chunk in zip(self.chunk_rows_args, self.chunks)
            ]
        c_chunk_mm = c_chunk.float() if self.upcast else c_chunk
        # where this vocabulary chunk's dC is summed: straight into dC (one row chunk, one product), else in fp32
        dc_sum = (
            self.dc32[:width]
            if self.dc_sums_fp32
            else (self.dc_out[v0 : v0 + width] if self.dc_out is not None else None)
        )
        for k, chunk in enumerate(self.chunks):
            rows = chunk.rows
            grad = _block(self.g_buf, rows, self.g_row_pitch)[:, :width]
            tiles = triton.cdiv(rows, self.block_n) * triton.cdiv(width, self.block_v)
            _recompute_grad_kernel[(min(tiles, self.programs),)](
                chunk.e_op, c_op, chunk_bias, *chunk_args[k], chunk.row_order, chunk.num_counted, chunk.row_poison,
                grad, rows, self.stored_rows[k], width, chunk_start, chunk_vocab, d,
                self.e.stride(0), self.e.stride(1), c_chunk.stride(0), c_chunk.stride(1), grad.stride(0),
                *self.label_weights,
                EVEN_TILE=(rows % self.block_n == 0 and width % self.block_v == 0),
                **self.flags,
            )  # fmt: skip
            if self.dbias32 is not None:
                self.dbias32[v0 : v0 + width] += grad.sum(dim=0, dtype=torch.float32)
            self._products(k, chunk, grad, v0, width, c_chunk, c_chunk_mm, dc_sum)
        if self.dc_sums_fp32:
            self.dc_out[v0 : v0 + width] = dc_sum

    def _products(self, k, chunk, grad, v0, width, c_chunk, c_chunk_mm, dc_sum) -> None:
        """dE and dC of one G block: the row-skipping Triton products, cuBLAS over the counted prefix and the Triton
        products past it, or cuBLAS over every row."""
        need_e, need_c = self.de32 is not None, self.dc_out is not None
        de_rows = self.de32[chunk.r0 : chunk.r0 + chunk.rows] if need_e else None
        if self.triton_products:
            _products.grad_products(
                grad, chunk.num_counted, c_chunk=c_chunk, de32=de_rows, row_order=chunk.row_order,
                row_poison=chunk.row_poison, accumulate_e=v0 > 0, e_compact=chunk.e_compact, dc_chunk=dc_sum,
                ignored_poison=chunk.ignored_poison, accumulate_c=k > 0,
            )  # fmt: skip
            return
        if self.prefix:
            self.tails[k].products(
                grad, c_chunk_mm, chunk, de_rows, dc_sum if need_c else None, self.dc32[:width] if need_c else None,
                upcast=self.upcast, first_vocab=v0 == 0, first_rows=k == 0, **self.out_dtype,
            )  # fmt: skip
            return
        upcast, out_dtype = self.upcast, self.out_dtype
        grad_mm = grad.float() if upcast else grad
        e_rows_mm = chunk.e_rows.float() if upcast else chunk.e_rows
        if need_e:
            _launch.product_into(de_rows, grad_mm, c_chunk_mm, accumulate=v0 > 0, vocab_dim="k", **out_dtype)
        if need_c:
            # 16-bit operands, fp32 sums (dc32) or a 16-bit dC written once; upcast operands (the CPU interpreter)
            # give fp32, rounded by the copy below
            fp32_sum = {} if upcast or dc_sum.dtype != torch.float32 else out_dtype
            if upcast and dc_sum.dtype != torch.float32:
                dc_sum.copy_(grad_mm.T @ e_rows_mm)
            else:
                _launch.product_into(dc_sum, grad_mm.T, e_rows_mm, accumulate=k > 0, vocab_dim="m", **fp32_sum)

    def finish(self):
        """``(dE, dC, dbias)``: dE put back in row order or rounded from its fp32 sums, dbias in the bias's dtype."""
        # the G block and the dC sums are free before dE is written (the uncompaction's temporary rows must not add to
        # their peak: cce_inductor.paths.lean_peak)
        self.g_buf = self.dc32 = None
        de_out, de32 = self.de_out, self.de32
        if de_out is not None and self.prefix:
            for chunk in self.chunks:  # dE was summed in each chunk's compacted order
                rows = slice(chunk.r0, chunk.r0 + chunk.rows)
                _uncompact_rows(de_out[rows], de32[rows], chunk.row_order)
        elif de_out is not None and not self.de_is_sums:
            de_out.copy_(de32)
        self.de32 = None
        dbias = self.dbias32.to(self.bias.dtype) if self.dbias32 is not None else None
        return de_out, self.dc_out, dbias
