"""Token accuracy (argmax) and class weights in the fused op and through the pass, and lazy logits: parity with
eager on the chunked CPU path and the Triton kernels (interpreter), ties and all-ignored batches included."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F

import cce_inductor
from cce_inductor import _chunked, linear_cross_entropy
from tests.support.compare import inductor_caches_off


def _tied_inputs(n=37, v=70, d=16, dtype=torch.float32, seed=0, span=2):
    """Small integers: every dot product is exact in fp32, so duplicated classes tie exactly in any summation order
    (and with ``span`` 16, sums past 256 tie in bf16 where they differ in fp32: ties made by the rounding)."""
    g = torch.Generator().manual_seed(seed)
    e = torch.randint(-span, span + 1, (n, d), generator=g).to(dtype)
    c = torch.randint(-span, span + 1, (v, d), generator=g).to(dtype)
    c[v // 2], c[v - 1] = c[3], c[1]  # duplicated classes: exact ties, the first must win
    e[0] = 0  # a row where every class ties
    return e, c


@pytest.mark.parametrize("path", ["chunked", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_argmax_equals_torch_argmax_with_ties(path, dtype):
    e, c = _tied_inputs(dtype=dtype, d=32, span=16 if dtype == torch.bfloat16 else 2)
    targets = torch.randint(0, c.shape[0], (e.shape[0],))
    targets[::3] = -100
    exact = e.float() @ c.float().T
    want = exact.to(dtype).argmax(-1)
    if dtype == torch.bfloat16:  # the rounding decides some rows: without it, another argmax
        assert not torch.equal(exact.argmax(-1), want)
    got = torch.empty(e.shape[0], dtype=torch.long)
    if path == "chunked":
        _chunked.forward(
            e, c, targets, None, softcap=None, ignore_index=-100, argmax_out=got, argmax_round=dtype, vocab_chunk=32
        )
    else:
        from cce_inductor.kernels import _forward

        _forward.forward(
            e, c, targets, None, softcap=None, ignore_index=-100, every_row=True, argmax_out=got, argmax_round=dtype
        )
    assert torch.equal(got, want), (got, want)


def test_argmax_nan_is_largest():
    e, c = torch.randn(4, 8), torch.randn(40, 8)
    c[7] = c[20] = float("nan")
    got = torch.empty(4, dtype=torch.long)
    _chunked.forward(
        e, c, torch.zeros(4, dtype=torch.long), None, softcap=None, ignore_index=-100, argmax_out=got, vocab_chunk=8
    )
    assert torch.equal(got, (e @ c.T).argmax(-1))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignored", ["some", "all"])
def test_class_weights_match_eager(reduction, ignored):
    torch.manual_seed(0)
    e = torch.randn(13, 8, dtype=torch.float64, requires_grad=True)
    c = torch.randn(21, 8, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 21, (13,))
    t[::4] = -100
    if ignored == "all":
        t[:] = -100
    w = torch.rand(21, dtype=torch.float64) + 0.1
    want = F.cross_entropy(e @ c.T, t, weight=w, reduction=reduction)
    got = linear_cross_entropy(e, c, t, class_weights=w, reduction=reduction)
    torch.testing.assert_close(got, want, equal_nan=True)  # all ignored, mean: 0 / 0 = NaN as eager
    if ignored == "some":
        upstream = torch.rand_like(want)
        for g, r in zip(
            torch.autograd.grad((got * upstream).sum(), (e, c)), torch.autograd.grad((want * upstream).sum(), (e, c))
        ):
            torch.testing.assert_close(g, r)


def test_class_weights_refusals():
    e, c, t = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 2])
    with pytest.raises(NotImplementedError, match="label_smoothing"):
        linear_cross_entropy(e, c, t, class_weights=torch.ones(5), label_smoothing=0.1)
    with pytest.raises(ValueError, match="require grad"):
        linear_cross_entropy(e, c, t, class_weights=torch.ones(5, requires_grad=True))


def _step(weight, class_weights, smoothing=0.0):
    def f(hidden, labels):
        logits = F.linear(hidden, weight)
        loss = F.cross_entropy(
            logits.float().flatten(0, 1), labels.flatten(), weight=class_weights, label_smoothing=smoothing
        )
        mask = labels != -100
        accuracy = ((logits.argmax(-1) == labels) & mask).sum() / mask.sum()
        return loss, accuracy

    return f


@pytest.mark.parametrize("weighted", [False, True])
def test_pass_fuses_accuracy_and_class_weights(weighted):
    e, c = _tied_inputs(n=24, v=50, d=8)
    weight = c.clone().requires_grad_()
    class_weights = torch.rand(50) + 0.5 if weighted else None
    hidden = e.view(2, 12, 8).clone().requires_grad_()
    labels = (e.view(2, 12, 8) @ c.T).argmax(-1)  # the predictions are right where the labels say so: accuracy > 0
    labels[0, 5:] = torch.randint(0, 50, (7,))
    labels[1, :4] = -100
    f = _step(weight, class_weights)
    want_loss, want_accuracy = f(hidden, labels)
    want_grads = torch.autograd.grad(want_loss, (hidden, weight))
    with inductor_caches_off():
        got_loss, got_accuracy = torch.compile(f, backend=cce_inductor.backend)(hidden, labels)
    stats = cce_inductor.stats()
    assert stats["rewritten"] == 1, stats
    reason = stats["sites"][0]["reason"]
    assert "argmax fused" in reason and ("class weights" in reason) == weighted
    assert 0 < want_accuracy.item() < 1 and got_accuracy.item() == want_accuracy.item()
    torch.testing.assert_close(got_loss, want_loss)
    for g, w in zip(torch.autograd.grad(got_loss, (hidden, weight)), want_grads):
        torch.testing.assert_close(g, w)


def test_class_weights_with_label_smoothing_left_alone():
    f = _step(torch.randn(50, 8, requires_grad=True), torch.rand(50) + 0.5, smoothing=0.1)
    with inductor_caches_off():
        torch.compile(f, backend=cce_inductor.backend)(torch.randn(2, 3, 8), torch.randint(0, 50, (2, 3)))
    (reason,) = cce_inductor.stats()["reasons"]
    assert "class weights and label_smoothing" in reason


# --------------------------------------------------------------------------------------------------------------
# Lazy logits
# --------------------------------------------------------------------------------------------------------------


class _Head(torch.nn.Module):
    def __init__(self, softcap=None):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head, self.softcap = torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50), softcap

    def forward(self, x, y):
        logits = self.head(self.emb(x))
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        loss = F.cross_entropy(logits.float().view(-1, 50), y.view(-1))
        return loss, logits


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_lazy_logits_values_and_laziness(dynamic, softcap):
    model = _Head(softcap)
    x, y = torch.randint(0, 50, (2, 7)), torch.randint(0, 50, (2, 7))
    want_loss, want_logits = model(x, y)
    with inductor_caches_off():
        loss, logits = torch.compile(model, backend=cce_inductor.backend, dynamic=dynamic)(x, y)
    assert cce_inductor.stats()["rewritten"] >= 1 and not cce_inductor.stats()["reasons"]
    assert isinstance(logits, cce_inductor.LazyLogits) and not logits.is_materialized
    assert logits.shape == want_logits.shape and logits.dtype == want_logits.dtype and logits.requires_grad
    loss.backward()
    detached, upcast = logits.detach(), logits.float()
    assert isinstance(upcast, cce_inductor.LazyLogits) and not logits.is_materialized  # metadata, detach, casts
    torch.testing.assert_close(loss, want_loss)
    torch.testing.assert_close(detached * 1, want_logits.detach())
    torch.testing.assert_close(pickle.loads(pickle.dumps(upcast)), want_logits.detach())
    with pytest.raises(RuntimeError, match="cannot flow back into the model"):
        logits.sum().backward()


def test_lazy_logits_into_another_compiled_function():
    """Returned logits handed to another compiled function: torch 2.13's Dynamo cannot trace the lazy tensor (an
    error), 2.15's computes them through ``__torch_function__``; never the placeholder's NaN as values.
    ``materialize()`` first gives that function the real logits on both."""
    model = _Head()
    x, y = torch.randint(0, 50, (2, 7)), torch.randint(0, 50, (2, 7))
    _, want = model(x, y)
    metric = torch.compile(lambda t: t.float().amax(-1) * 3)
    with inductor_caches_off():
        _, logits = torch.compile(model, backend=cce_inductor.backend)(x, y)
        try:
            got = metric(logits)
        except Exception:  # noqa: BLE001 - Dynamo's error (torch 2.13): loud, and the route below works
            got = None
        if got is not None:
            torch.testing.assert_close(got, want.amax(-1) * 3)
        torch._dynamo.reset()
        _, logits = torch.compile(model, backend=cce_inductor.backend)(x, y)
        torch.testing.assert_close(metric(logits.materialize()), want.amax(-1) * 3)


def test_lazy_logits_refuse_a_modified_head_and_can_be_turned_off():
    model = _Head()
    x, y = torch.randint(0, 50, (2, 7)), torch.randint(0, 50, (2, 7))
    with inductor_caches_off():
        _, logits = torch.compile(model, backend=cce_inductor.backend)(x, y)
        with torch.no_grad():
            model.head.weight.add_(1.0)  # an optimizer step before the logits are read
        with pytest.raises(RuntimeError, match="modified in place"):
            logits.sum()
        torch._dynamo.reset()
        cce_inductor.reset_stats()
        _, logits = torch.compile(model, backend=cce_inductor.make_backend(lazy_logits=False))(x, y)
    assert type(logits) is torch.Tensor
    (reason,) = cce_inductor.stats()["reasons"]
    assert "lazy_logits is off" in reason and "CCE_INDUCTOR_LAZY_LOGITS" in reason


def test_lazy_logits_option_in_the_cache_key():
    on, off = (
        cce_inductor.CCEGraphPass(cce_inductor.CCEOptions()),
        cce_inductor.CCEGraphPass(cce_inductor.CCEOptions(lazy_logits=False)),
    )
    assert on.uuid() != off.uuid()


@pytest.mark.parametrize("graph_partition", [True, False])
def test_lazy_logits_under_cuda_graphs_only_between_the_graphs(graph_partition):
    """A CUDA graph hands outputs back as plain tensors: the lazy-logits op is tagged cudagraph_unsafe, so Inductor's
    graph partition (the default) runs it between the graphs and the site is rewritten; without partitioning it is
    left alone (the pass reads the config that ``mode="reduce-overhead"`` sets; checked here on the CPU with the
    config set, tests/test_cuda.py records and replays real graphs)."""
    import torch._inductor.config as inductor_config

    assert torch._C.Tag.cudagraph_unsafe in torch.ops.cce_inductor.lazy_logits.default.tags
    model = _Head()
    x, y = torch.randint(0, 50, (2, 7)), torch.randint(0, 50, (2, 7))
    want_loss, want_logits = model(x, y)
    with inductor_caches_off(), inductor_config.patch({"triton.cudagraphs": True, "graph_partition": graph_partition}):
        loss, logits = torch.compile(model, backend=cce_inductor.backend)(x, y)
    stats = cce_inductor.stats()
    if graph_partition:
        assert type(logits) is cce_inductor.LazyLogits
        (site,) = stats["sites"]
        assert site["rewritten"] and "(their op runs between Inductor's CUDA graphs)" in site["reason"], site
    else:
        (reason,) = stats["reasons"]
        assert "CUDA graphs" in reason and "graph_partition" in reason and "lazy logits" in reason, reason
        assert type(logits) is torch.Tensor
    torch.testing.assert_close(logits, want_logits)
    torch.testing.assert_close(loss, want_loss)


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """The op's forward and backward through the Triton kernels (the interpreter) on CPU tensors."""
    from cce_inductor import _dispatch

    monkeypatch.setattr(_dispatch, "uses_kernels", lambda device, dtype: dtype in (torch.float32, torch.bfloat16))


@pytest.mark.parametrize("ignored", ["some", "all"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_op_with_class_weights_and_argmax_through_the_kernels(kernels_on_cpu, reduction, ignored):
    from cce_inductor.ops import lean_call
    from cce_inductor.options import CCEOptions

    e, c = _tied_inputs(n=29, v=70, d=16)
    e, c = e.requires_grad_(), c.requires_grad_()
    targets = torch.randint(0, 70, (29,), generator=torch.Generator().manual_seed(1))
    targets[::4] = -100
    if ignored == "all":
        targets[:] = -100
    w = torch.rand(70, generator=torch.Generator().manual_seed(2)) + 0.5
    logits = e @ c.T
    want = F.cross_entropy(logits, targets, weight=w, reduction=reduction)
    loss, _, _, argmax = lean_call(
        e, c, targets, reduction=reduction, options=CCEOptions().encode(), class_weights=w, argmax="float32"
    )()
    assert torch.equal(argmax, logits.argmax(-1))  # every row, ignored ones too; exact ties: the first index
    torch.testing.assert_close(loss, want, equal_nan=True)
    if ignored == "some":
        for g, r in zip(torch.autograd.grad(loss, (e, c)), torch.autograd.grad(want, (e, c))):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def test_pass_fuses_an_argmax_of_upcast_logits():
    """``logits.float().argmax(-1)`` (an upcast of the head's logits that only the argmax reads)."""
    e, c = _tied_inputs(n=24, v=50, d=8)
    weight = c.clone().to(torch.bfloat16).requires_grad_()
    hidden = e.view(2, 12, 8).to(torch.bfloat16).requires_grad_()
    labels = (e.view(2, 12, 8) @ c.T).argmax(-1)
    labels[0, 5:] = 3

    def f(h, y):
        logits = F.linear(h, weight)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        return loss, (logits.float().argmax(-1) == y).float().mean()

    want = f(hidden, labels)
    with inductor_caches_off():
        got = torch.compile(f, backend=cce_inductor.backend)(hidden, labels)
    stats = cce_inductor.stats()
    assert stats["rewritten"] == 1 and "argmax fused" in stats["sites"][0]["reason"], stats
    assert 0 < want[1].item() < 1 and got[1].item() == want[1].item()
    torch.testing.assert_close(got[0], want[0], rtol=1e-2, atol=1e-2)  # bf16 logits: eager rounds them, the op not
