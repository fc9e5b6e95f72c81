"""Triton kernels of Cut Cross-Entropy (imported as ``cce_inductor.kernels``).

Interface used by the custom op and the vocabulary-parallel loss:

* ``forward(e, c, targets, bias, *, softcap, ignore_index, logit_sum=False, mean_logit=False, every_row=False,
  argmax_out=None, argmax_round=None) -> RowStats(lse, target_logit, logit_sum | None, mean_logit | None)``
  (``mean_logit``: the softmax-weighted mean logit of each row, the entropy being ``lse - mean_logit``;
  ``argmax_out``: an int64 ``(N,)`` tensor that receives each counted row's argmax over the logits rounded to
  ``argmax_round``)
* ``backward(e, c, targets, bias, lse, grad_rows, *, softcap, ignore_index, need_e, need_c, need_bias, row_chunk,
  block_width, products, counted_hint=None, label_smoothing=0.0, grad_lse=None, grad_entropy=None, mean_logit=None,
  observe_counted=None, de_dtype=None, dc_dtype=None, compute_dtype=None) -> (dE | None, dC | None, dbias | None)``:
  the plan's fields (the caller's plan: ``row_chunk``, ``block_width``, ``products``
  ``"cublas"`` / ``"triton"`` / ``"prefix"``, ``counted_hint``) are explicit arguments; ``de_dtype`` / ``dc_dtype`` /
  ``compute_dtype``: the gradients' and the products' dtypes where not the operands' (autocast)
* ``row_skipping_ok(e, c) -> bool``: whether the row-skipping products can read these operands
* ``loss_and_grads(e, c, targets, bias, *, softcap, ignore_index, reduction, label_smoothing=0.0, chunk_rows,
  compute_dtype=None, need_e=True, need_c=True, need_bias=True, check_range=False, counted_prefix_rows=None,
  observe_counted=None, plain_sum=False) -> LossAndGrads(loss, grad_e, grad_c, grad_bias, grad_e_lo, grad_c_lo)``:
  the balanced path (mean / sum losses whose head needs gradients): the gradients computed with the loss,
  ``chunk_rows`` rows at a time through one scratch of logits (its rows padded to aligned leading dimensions), each
  in its input's dtype (a 16-bit one as the pair ``grad`` + ``grad_lo``, but with ``plain_sum`` a 16-bit dC summed
  in its own dtype over at most two chunks, alone; an fp32 one whole with ``grad_lo`` None; ``grad_bias`` fp32; None
  where not asked for); ``compute_dtype``: the products' dtype where not the inputs' (autocast); ``check_range=True``:
  a device-side assert where a counted target lies outside ``[0, V)``, as eager's; ``counted_prefix_rows``: rows
  compacted, cuBLAS over that many, the row-skipping products past them (where
  ``balanced_row_skipping_ok(e, c, *, compute_dtype, need_bias)``)
* ``count_targets(targets, ignore_index, *, mean, check_vocab=None) -> (num_counted, row_scale)``: the rows that
  count, on the device, and with ``check_vocab`` V the same range check, in one launch

with ``logits[n, v] = softcap * tanh((e[n] . c[v] + bias[v]) / softcap)`` (no tanh without softcap).  In
``forward`` / ``backward`` rows whose target is ``ignore_index`` cost nothing; a target outside ``[0, V)`` counts with
no one-hot term.

Kernel files, each opening with its math, block layout and memory, and keeping its own block sizes: ``_forward``
(fused log-sum-exp / target logit, the argmax), ``_balanced`` (cuBLAS logits per row chunk, the softmax gradient in
place, cuBLAS dE, dC summed chunk by chunk; its launches: ``_balanced_launch``), ``_pair_sums`` (a 16-bit gradient
summed over the balanced path's row chunks as a pair ``hi + lo``: the dC product with the pair in its epilogue),
``_backward`` (a Triton kernel recomputes each logit block into the softmax gradient; cuBLAS does dE and dC, or over
the counted prefix only; its launches: ``_backward_launch``), ``_row_chunks`` (the lean backward's host-side row
chunks: compaction, the counted prefix's split, the target logits), ``_products`` (Triton dE / dC products that skip
ignored rows), ``_targets`` (the count of counted rows and the range check, one launch), ``_tile`` (the logit tile
and softmax gradient shared by the kernels), ``_launch`` (host-side helpers: device facts, tunings, row compaction,
products into fp32 sums), ``_layout`` (the layout constants the package's memory model reads too; no Triton). No
host synchronisation: ignored rows are compacted on the device and the kernels read the count.
"""

import importlib

# name -> (module, attribute): loaded on first use, so that ``_layout`` (the constants the package's memory model
# reads) imports without Triton; the first kernel asked for imports Triton (an ImportError where it is missing)
_EXPORTS = {
    "forward": ("._forward", "forward"),
    "backward": ("._backward_launch", "backward"),
    "row_skipping_ok": ("._backward_launch", "row_skipping_ok"),
    "loss_and_grads": ("._balanced_launch", "loss_and_grads"),
    "balanced_row_skipping_ok": ("._balanced_launch", "row_skipping_ok"),
    "LossAndGrads": ("._balanced_launch", "LossAndGrads"),
    "count_targets": ("._targets", "count_targets"),
    "INTERPRET": ("._launch", "INTERPRET"),
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _EXPORTS[name]
    value = getattr(importlib.import_module(module, __name__), attribute)
    globals()[name] = value
    return value


def __dir__():
    return sorted({*globals(), *_EXPORTS})
