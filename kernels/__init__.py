"""Triton kernels of Cut Cross-Entropy (imported as ``cce_inductor.kernels``).

Interface used by the custom op and the vocabulary-parallel loss:

* ``forward(e, c, targets, bias, *, softcap, ignore_index, logit_sum=False, mean_logit=False, every_row=False)
  -> RowStats(lse, target_logit, logit_sum | None, mean_logit | None)`` (``mean_logit``: the softmax-weighted mean
  logit of each row; the entropy is ``lse - mean_logit``)
* ``backward(e, c, targets, bias, lse, grad_rows, *, softcap, ignore_index, need_e, need_c, need_bias, row_chunk,
  block_width, split_g, products, counted_hint=None, label_smoothing=0.0, grad_lse=None, grad_entropy=None,
  mean_logit=None, observe_counted=None) -> (dE | None, dC | None, dbias | None)``: the plan's fields
  (``cce_inductor._planning.BackwardPlan``) are explicit arguments
* ``row_skipping_ok(e, c, exact) -> bool``: whether the row-skipping products can read these operands
* ``loss_and_grads(e, c, targets, bias, *, softcap, ignore_index, reduction, label_smoothing=0.0, chunk_rows,
  need_e=True, need_c=True, need_bias=True, check_range=False) -> LossAndGrads(loss, dE | None, dC | None,
  dbias | None)``: the balanced path (mean / sum losses whose head needs gradients): the gradients computed with the
  loss, ``chunk_rows`` rows at a time through one scratch of logits (its rows padded to aligned leading dimensions);
  ``check_range=True``: a device-side assert where a counted target lies outside ``[0, V)``, as eager's
* ``count_targets(targets, ignore_index, *, mean, check_vocab=None) -> (num_counted, row_scale)``: the rows that
  count, on the device, and with ``check_vocab`` V the same range check, in one launch

with ``logits[n, v] = softcap * tanh((e[n] . c[v] + bias[v]) / softcap)`` (no tanh without softcap).  In ``forward`` /
``backward`` rows whose target is ``ignore_index`` cost nothing; a target outside ``[0, V)`` counts with no one-hot term.

Kernel files, each opening with its math, block layout and memory, and keeping its own block sizes:
``_forward`` (fused log-sum-exp / target logit), ``_balanced`` (cuBLAS logits per row chunk, the softmax gradient
in place, cuBLAS dE / dC), ``_backward`` (a Triton kernel recomputes each logit block into
the softmax gradient; cuBLAS does dE and dC; exact mode), ``_products`` (Triton dE / dC products that skip
ignored rows, ``options.products="triton"``), ``_targets`` (the count of counted rows and the range check, one
launch), ``_tile`` (the logit tile and softmax gradient shared by the kernels), ``_launch`` (host-side helpers: device
facts, row compaction).
No host synchronisation: ignored rows are compacted on the device and the kernels read the count.
"""
from ._backward import backward, row_skipping_ok
from ._balanced import LossAndGrads, loss_and_grads
from ._forward import forward
from ._targets import count_targets
from ._launch import INTERPRET

__all__ = ["forward", "backward", "row_skipping_ok", "loss_and_grads", "LossAndGrads", "count_targets", "INTERPRET"]
