"""Triton kernels of Cut Cross-Entropy (imported as ``cce_inductor.kernels``).

Interface used by the custom op:

* ``aux_spec(n, v, vocab_sort, summaries=True) -> (shape, dtype)`` of the ``aux`` tensor the forward returns
  (empty with ``summaries=False``: then the backward must not filter).
* ``forward(e, c, targets, bias, *, softcap, ignore_index, vocab_sort, summaries=True) -> (lse, target_logit, aux)``
* ``backward(e, c, targets, bias, lse, aux, grad_rows, *, softcap, ignore_index, filter_eps, vocab_sort,
  exact, need_e, need_c, need_bias) -> (dE | None, dC | None, dbias | None)``
* ``default_filter_eps(dtype) -> float``

with ``logits[n, v] = softcap * tanh((e[n] . c[v] + bias[v]) / softcap)`` (no tanh without softcap).
Kernel files: ``_tile`` (shared logit-tile helper), ``_forward`` (lse / target logit / aux),
``_backward`` (tile backward: gradient filtering), ``_backward_dense`` (every unfiltered backward, exact mode
included: a Triton kernel recomputes each logit block into the softmax gradient, cuBLAS does dE and dC; chosen
by ``backward`` when ``filter_eps == 0``), ``_products`` (optional Triton dE / dC products that skip ignored
rows); ``_config`` holds block sizes (``override_config``) and the aux layout.
No host synchronisation: ignored rows are compacted on the device and the kernels read the count.
"""
from ._backward import backward
from ._config import CONFIG, INTERPRET, aux_spec, default_filter_eps, override_config
from ._forward import forward

__version__ = "0.1.0"
__all__ = ["aux_spec", "forward", "backward", "default_filter_eps", "override_config", "CONFIG", "INTERPRET"]
