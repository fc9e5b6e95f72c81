"""Tests of the chunked PyTorch path (``cce_inductor/_chunked.py``: the CPU path and the CUDA fallback): tiny chunks
give the single block's numbers (forward and backward, fp64), the op on tiny chunks matches eager, no ``N x V``
tensor is ever allocated (tiny and default chunks), and the CPU path is bitwise reproducible (the op directly, with
tiny chunks, and compiled).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import cce_inductor
from cce_inductor import _chunked, ops
from tests.support.compare import run
from tests.support.head import REDUCTIONS, _hf_shift_fn, inputs
from tests.support.inputs import make_op_inputs
from tests.support.reference import check_against_eager, eager_loss, run_fresh

lce = cce_inductor.linear_cross_entropy


@pytest.mark.parametrize("row_chunk, vocab_chunk", [(1, 1), (3, 5), (7, 64), (64, 2)])
@pytest.mark.parametrize("softcap", [None, 3.0], ids=["nocap", "cap"])
def test_chunked_matches_unchunked(row_chunk, vocab_chunk, softcap):
    """_chunked.forward/backward with tiny chunks equal the single-block result (fp64)."""
    e, c, t, b = make_op_inputs((23,), 37, 6, torch.float64, bias=True)
    big = dict(row_chunk=10**6, vocab_chunk=10**6)
    small = dict(row_chunk=row_chunk, vocab_chunk=vocab_chunk)
    lse_ref, tl_ref, sum_ref, _ = _chunked.forward(
        e, c, t, b, softcap=softcap, ignore_index=-100, logit_sum=True, **big
    )
    lse, tl, logit_sum, _ = _chunked.forward(e, c, t, b, softcap=softcap, ignore_index=-100, logit_sum=True, **small)
    valid = t != -100
    torch.testing.assert_close(lse, lse_ref, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(tl[valid], tl_ref[valid], rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(logit_sum, sum_ref, rtol=1e-12, atol=1e-12)
    # and the single block is right
    logits = F.linear(e, c, b)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    torch.testing.assert_close(lse_ref, torch.logsumexp(logits, 1), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(sum_ref, logits.sum(1), rtol=1e-12, atol=1e-12)

    grad_rows = torch.where(valid, torch.rand(23, dtype=torch.float64), 0.0)
    grad_lse = torch.rand(23, dtype=torch.float64)  # a z-loss's, also at ignored rows
    kw = dict(softcap=softcap, need_e=True, need_c=True, need_bias=True, label_smoothing=0.1, grad_lse=grad_lse)
    ref = _chunked.backward(e, c, t, b, lse_ref, grad_rows, **kw, **big)
    got = _chunked.backward(e, c, t, b, lse, grad_rows, **kw, **small)
    for x, y in zip(got, ref):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-13)


@pytest.fixture
def tiny_chunks(monkeypatch):
    """Make the op use tiny chunks. ops.py calls _chunked.forward/backward without chunk arguments, so the
    chunk sizes are the keyword-only defaults bound at def time (patching ROW_CHUNK/VOCAB_CHUNK does nothing)."""
    sizes = {"row_chunk": 4, "vocab_chunk": 8}
    for fn in (_chunked.forward, _chunked.backward):
        for name, value in sizes.items():
            monkeypatch.setitem(fn.__kwdefaults__, name, value)
    return sizes


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_op_with_tiny_chunks_matches_eager(tiny_chunks, reduction, dtype):
    check_against_eager((3, 11), 45, 8, dtype, bias=True, softcap=4.0, reduction=reduction)


class MaxNumel(TorchDispatchMode):
    """Records the largest tensor any ATen op creates (runs the cce_inductor ops' Python impls under the mode)."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0
        self.max_op = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name.startswith("cce_inductor::"):
            opdef = {
                "cce_inductor::linear_cross_entropy": ops.linear_cross_entropy_op,
                "cce_inductor::linear_cross_entropy_backward": ops.linear_cross_entropy_backward_op,
            }[name]
            with self:
                return opdef._init_fn(*args, **kwargs)
        out = func(*args, **kwargs)
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() > self.max_numel:
                self.max_numel, self.max_op = t.numel(), func
        return out


def test_memory_detector_sees_eager_logits():
    e, c, t, _ = make_op_inputs((64,), 256, 8, torch.float32)
    with MaxNumel() as mode:
        eager_loss(e.requires_grad_(), c, t).backward()
    assert mode.max_numel >= 64 * 256


@pytest.mark.parametrize("softcap", [None, 3.0], ids=["nocap", "cap"])
def test_chunked_path_never_allocates_n_by_v(tiny_chunks, softcap):
    n, vocab, dim = 64, 256, 8
    e, c, t, b = make_op_inputs((n,), vocab, dim, torch.float32, bias=True)
    for x in (e, c, b):
        x.requires_grad_(True)
    with MaxNumel() as mode:
        loss = lce(e, c, t, bias=b, softcap=softcap)
        loss.backward()
    assert mode.max_numel < n * vocab, (mode.max_numel, mode.max_op)
    assert mode.max_numel <= max(tiny_chunks["row_chunk"] * tiny_chunks["vocab_chunk"], n * dim, vocab * dim)
    ref = run_fresh(eager_loss, e, c, t, b, softcap=softcap)
    torch.testing.assert_close(loss.detach(), ref[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(c.grad, ref[2], rtol=1e-4, atol=1e-6)


def test_default_chunks_never_allocate_n_by_v():
    """The real chunk sizes (ROW_CHUNK x VOCAB_CHUNK) at a shape where N x V is 4x one block."""
    n, vocab, dim = 2 * _chunked.ROW_CHUNK, 2 * _chunked.VOCAB_CHUNK, 4
    gen = torch.Generator().manual_seed(0)
    e = torch.randn(n, dim, generator=gen, requires_grad=True)
    c = torch.randn(vocab, dim, generator=gen, requires_grad=True)
    t = torch.randint(0, vocab, (n,), generator=gen)
    with MaxNumel() as mode:
        lce(e, c, t).backward()
    assert mode.max_numel <= _chunked.ROW_CHUNK * _chunked.VOCAB_CHUNK < n * vocab


# ----------------------------------------------------------------------------------------------------------------
# Determinism
# ----------------------------------------------------------------------------------------------------------------


def _bitwise_equal(a, b):
    assert torch.equal(a[0], b[0]) or (a[0].isnan().all() and b[0].isnan().all()), (a[0], b[0])
    for x, y in zip(a[1], b[1]):
        assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_direct_op_is_bitwise_deterministic(dtype, reduction):
    args = inputs(lead=(3, 11), dtype=dtype, bias=True)

    def f(h, w, y, b):
        return lce(h, w, y, bias=b, softcap=4.0, reduction=reduction, ignore_index=-100)

    _bitwise_equal(run(f, args), run(f, args))


def test_direct_op_is_bitwise_deterministic_with_tiny_chunks(monkeypatch):
    """Several row and vocabulary chunks (the online log-sum-exp and the dC accumulation): same bits twice."""
    from cce_inductor import _chunked

    for fn in (_chunked.forward, _chunked.backward):  # ops.py relies on the keyword-only defaults
        monkeypatch.setitem(fn.__kwdefaults__, "row_chunk", 4)
        monkeypatch.setitem(fn.__kwdefaults__, "vocab_chunk", 5)
    args = inputs(lead=(3, 11), bias=True)

    def f(h, w, y, b):
        return lce(h, w, y, bias=b, softcap=4.0)

    first, second = run(f, args), run(f, args)
    _bitwise_equal(first, second)
    monkeypatch.undo()
    torch.testing.assert_close(run(f, args)[0], first[0])  # and chunking does not change the result


@pytest.mark.slow
def test_compiled_is_bitwise_deterministic(no_inductor_caches):
    fn, head = _hf_shift_fn()
    hidden, _, labels = inputs(lead=(3, 9))
    results = []
    for _ in range(2):
        torch._dynamo.reset()  # two independent compilations
        compiled = torch.compile(fn, backend=cce_inductor.backend, fullgraph=True)
        for _ in range(2):  # and two runs of each
            out = run(compiled, (hidden, labels))
            out[1].append(head.weight.grad.clone())
            head.weight.grad = None
            results.append(out)
    for other in results[1:]:
        _bitwise_equal(results[0], other)
