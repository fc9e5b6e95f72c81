"""The balanced path (``CCEOptions.scratch_mb > 0``): the loss's gradients computed with the loss.

* the kernels (``cce_inductor.kernels.loss_and_grads``; the Triton interpreter on a machine without CUDA) against an
  fp64 reference: mean and sum, softcap, bias, label smoothing, ignored rows (some, all), N not a multiple of the
  chunk rows, N = 1, empty, fp32 and bf16 (bf16 also against eager bf16's own error: the bar torch.compile sets),
  the need flags, eager's NaN pattern for a poisoned ignored row, several chunks against one (dC summed in fp32);
* the op ``cce_inductor::linear_cross_entropy_with_grads`` (opcheck; its backward scales by the upstream gradient,
  bit for bit at 1 and powers of two) and ``cce_inductor.linear_cross_entropy``'s choice of path;
* the pass: the balanced path is chosen exactly for mean / sum losses whose head needs gradients (and an lse not
  used elsewhere), ``stats()`` says which path each site got and why, and compiled results match eager (frozen and
  tied weights, dynamic shapes).
"""
import os

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import cce_inductor  # noqa: E402
import cce_inductor.kernels as K  # noqa: E402
from cce_inductor import CCEOptions  # noqa: E402
from cce_inductor.kernels import _balanced  # noqa: E402
from tests.support.compare import rel_l2  # noqa: E402

IGNORE = -100
HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
BALANCED = CCEOptions(scratch_mb=1)


def _device_ok(device):
    if device == "cpu" and not K.INTERPRET:
        pytest.skip("CPU tensors need the Triton interpreter (run without CUDA)")


def make_inputs(n, v, d, dtype, device="cpu", *, bias=False, ignore="some", seed=0):
    gen = torch.Generator().manual_seed(seed)
    c = torch.randn(v, d, generator=gen)
    e = torch.randn(n, d, generator=gen) * 3.0 / d**0.5
    t = torch.randint(0, v, (n,), generator=gen)
    if ignore == "some" and n > 1:
        t[torch.rand(n, generator=gen) < 0.3] = IGNORE
        t[0] = IGNORE
    elif ignore == "all":
        t[:] = IGNORE
    b = torch.randn(v, generator=gen) * 0.5 if bias else None
    cast = lambda x: None if x is None else x.to(device, dtype)  # noqa: E731
    return cast(e), cast(c), t.to(device), cast(b)


def reference(e, c, t, b, *, softcap=None, reduction="mean", label_smoothing=0.0, dtype=torch.float64,
              logits_dtype=None):
    """Loss and gradients (e, c[, b]) with materialised logits: fp64 by default; with ``logits_dtype`` (= ``dtype``,
    16-bit) eager's own computation: 16-bit logits, upcast, fp32 cross-entropy."""
    leaves = [x.detach().to(dtype).requires_grad_(True) for x in (e, c) + ((b,) if b is not None else ())]
    z = F.linear(leaves[0], leaves[1], leaves[2] if b is not None else None)
    if logits_dtype is not None:  # eager: F.linear in 16-bit (its backward rounds the gradient G), then upcast
        z = z.float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    loss = F.cross_entropy(z, t, ignore_index=IGNORE, reduction=reduction, label_smoothing=label_smoothing)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return loss.detach(), list(grads) + ([None] if b is None else [])


CASES = [  # dtype, n, softcap, bias, label_smoothing, ignore, rows per chunk
    (torch.float32, 37, None, False, 0.0, "some", 10),
    (torch.float32, 37, 5.0, True, 0.1, "some", 128),
    (torch.bfloat16, 37, None, False, 0.0, "some", 10),
    (torch.bfloat16, 37, 5.0, True, 0.1, "none", 10),
    (torch.bfloat16, 1, None, True, 0.0, "none", 10),
    (torch.float32, 64, None, False, 0.0, "all", 16),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{str(c[0])[6:]}-n{c[1]}-cap{c[2]}-bias{c[3]}-ls{c[4]}-{c[5]}-r{c[6]}")
def test_kernels_match_fp64(device, reduction, case):
    _device_ok(device)
    dtype, n, softcap, bias, smoothing, ignore, rows = case
    v, d = 70, 16
    e, c, t, b = make_inputs(n, v, d, dtype, device, bias=bias, ignore=ignore)
    got = K.loss_and_grads(e, c, t, b, softcap=softcap, ignore_index=IGNORE, reduction=reduction,
                           label_smoothing=smoothing, scratch_bytes=rows * v * e.element_size())
    loss, grads = reference(e, c, t, b, softcap=softcap, reduction=reduction, label_smoothing=smoothing)
    if ignore == "all":
        assert (torch.isnan(got.loss) if reduction == "mean" else got.loss == 0), got.loss
        assert not got.grad_e.any() and not got.grad_c.any()
        return
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert abs(got.loss.item() - loss.item()) <= (1e-5 if dtype == torch.float32 else 1e-2) * max(1.0, abs(loss.item()))
    for name, mine, want in zip(("dE", "dC", "dbias"), got[1:], grads):
        if want is None:
            assert mine is None, name
            continue
        assert mine.dtype == torch.float32 and mine.shape == want.shape  # rounded by the op's backward
        assert rel_l2(mine.to(dtype), want) < tol, name
    if dtype == torch.bfloat16:
        # no worse than eager / torch.compile, which do the same roundings (bf16 logits, fp32 softmax, the gradient
        # G rounded to bf16, fp32-accumulated products, one rounding of the result) in another order (and add the
        # bias before rounding the logits, we after): on these ~2600 logits that alone moves the ratio of the two
        # errors by up to ~6%; test_gpu_real_shape_error_at_most_torch_compiles holds 1.01x at 134M logits
        _, eager = reference(e, c, t, b, softcap=softcap, reduction=reduction, label_smoothing=smoothing,
                             dtype=torch.bfloat16, logits_dtype=torch.bfloat16)
        for name, mine, theirs, want in zip(("dE", "dC", "dbias"), got[1:], eager, grads):
            if want is not None:
                assert rel_l2(mine.to(dtype), want) <= 1.1 * rel_l2(theirs, want), name


@pytest.mark.parametrize("device", DEVICES)
def test_chunks_change_only_rounding_and_dc_is_summed_in_fp32(device):
    """Several row chunks against one change only the order of fp32 sums (dC is summed over the chunks in fp32, not
    rounded to bf16 per chunk): agreement to ~1e-6. On the GPU cuBLAS may round a bf16 logit differently for another
    chunk shape, which moves G by a bf16 unit in places: there the bar is one bf16 rounding."""
    _device_ok(device)
    for dtype in (torch.float32, torch.bfloat16):
        tol = 1e-5 if dtype == torch.float32 or device == "cpu" else 2.0**-8
        e, c, t, b = make_inputs(64, 70, 16, dtype, device, bias=True)
        one = K.loss_and_grads(e, c, t, b, softcap=None, ignore_index=IGNORE, reduction="sum",
                               scratch_bytes=64 * 70 * e.element_size())
        four = K.loss_and_grads(e, c, t, b, softcap=None, ignore_index=IGNORE, reduction="sum",
                                scratch_bytes=16 * 70 * e.element_size())
        for name in ("grad_e", "grad_c", "grad_bias"):
            assert rel_l2(getattr(four, name), getattr(one, name)) <= tol, name
        assert abs(four.loss.item() - one.loss.item()) <= 1e-5 * abs(one.loss.item())


@pytest.mark.parametrize("device", DEVICES)
def test_need_flags_and_empty_batch(device):
    _device_ok(device)
    e, c, t, b = make_inputs(20, 70, 16, torch.float32, device, bias=True)
    full = K.loss_and_grads(e, c, t, b, softcap=None, ignore_index=IGNORE, reduction="mean", scratch_bytes=4096)
    only_c = K.loss_and_grads(e, c, t, b, softcap=None, ignore_index=IGNORE, reduction="mean", scratch_bytes=4096,
                              need_e=False, need_bias=False)
    assert only_c.grad_e is None and only_c.grad_bias is None
    torch.testing.assert_close(only_c.grad_c, full.grad_c, rtol=0, atol=0)
    torch.testing.assert_close(only_c.loss, full.loss, rtol=0, atol=0)
    empty = K.loss_and_grads(e[:0], c, t[:0], b, softcap=None, ignore_index=IGNORE, reduction="sum",
                             scratch_bytes=4096)
    assert empty.loss.item() == 0 and empty.grad_e.shape == (0, 16)
    assert not empty.grad_c.any() and not empty.grad_bias.any()
    assert torch.isnan(K.loss_and_grads(e[:0], c, t[:0], b, softcap=None, ignore_index=IGNORE, reduction="mean",
                                        scratch_bytes=4096).loss)
    with pytest.raises(ValueError, match="'mean' and 'sum'"):
        K.loss_and_grads(e, c, t, b, softcap=None, ignore_index=IGNORE, reduction="none", scratch_bytes=4096)


@pytest.mark.parametrize("device", DEVICES)
def test_poisoned_ignored_row_gets_eagers_nan_pattern(device):
    """Eager's gradient of an ignored row whose logits hold a NaN is NaN in the whole row (its log-sum-exp is NaN),
    so dE's row and all of dC are NaN; the other rows of dE stay finite. The kernel does not read ignored rows:
    it writes their poison (0 or NaN) instead."""
    _device_ok(device)
    e, c, t, _ = make_inputs(12, 70, 16, torch.float32, device, ignore="none")
    t[3] = IGNORE
    e[3, 5] = float("nan")
    got = K.loss_and_grads(e, c, t, None, softcap=None, ignore_index=IGNORE, reduction="mean", scratch_bytes=4 * 70 * 4)
    _, (ge, gc, _) = reference(e, c, t, None)
    assert torch.equal(torch.isnan(got.grad_e), torch.isnan(ge))
    assert torch.equal(torch.isnan(got.grad_c), torch.isnan(gc))
    assert torch.isnan(got.grad_e[3]).all() and torch.isfinite(got.grad_e[4]).all()
    assert torch.isfinite(got.loss)


def test_chunk_rows():
    assert _balanced.chunk_rows(1 << 20, 1000, 2, 8192) == 512 - 512 % 128 == 512
    assert _balanced.chunk_rows(300 * 1000 * 2, 1000, 2, 8192) == 256  # rounded down to whole 128-row tiles
    assert _balanced.chunk_rows(100 * 1000 * 2, 1000, 2, 8192) == 100
    assert _balanced.chunk_rows(10, 1000, 2, 8192) == 1
    assert _balanced.chunk_rows(1 << 30, 1000, 2, 37) == 37


# ----------------------------------------------------------------------------------------------------------------
# The op and the public function
# ----------------------------------------------------------------------------------------------------------------


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _ops_called(fn):
    with _OpLog() as log:
        fn()
    return {name for name in log.names if name.startswith("cce_inductor.")}


def test_opcheck():
    e, c, t, b = make_inputs(9, 30, 8, torch.float32, bias=True)
    for reduction in ("mean", "sum"):
        args = (e.requires_grad_(), c.requires_grad_(), t, b.requires_grad_(), 4.0, IGNORE, reduction, 0.1,
                BALANCED.encode(), True, True, True)
        torch.library.opcheck(torch.ops.cce_inductor.linear_cross_entropy_with_grads.default, args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_public_function_chooses_the_path_and_matches_the_lean_one(dtype):
    e, c, t, b = make_inputs(23, 40, 8, dtype, bias=True)
    leaves = [x.requires_grad_() for x in (e, c, b)]

    def run(options, upstream):
        loss = cce_inductor.linear_cross_entropy(e, c, t, bias=b, softcap=3.0, options=options)
        return loss, torch.autograd.grad(loss * upstream, leaves)

    assert _ops_called(lambda: run(BALANCED, 1.0)) == {"cce_inductor.linear_cross_entropy_with_grads.default"}
    assert "cce_inductor.linear_cross_entropy.default" in _ops_called(lambda: run(CCEOptions(), 1.0))
    with torch.no_grad():
        assert _ops_called(lambda: cce_inductor.linear_cross_entropy(e, c, t, options=BALANCED)) == {
            "cce_inductor.linear_cross_entropy.default"}
    assert _ops_called(lambda: cce_inductor.linear_cross_entropy(e, c, t, reduction="none", options=BALANCED)) == {
        "cce_inductor.linear_cross_entropy.default"}

    for upstream in (1.0, 0.25, 3.0):
        lean_loss, lean = run(CCEOptions(), upstream)
        loss, grads = run(BALANCED, upstream)
        assert loss.item() == lean_loss.item()
        for mine, theirs in zip(grads, lean):
            if upstream == 3.0:  # the scaling rounds once more (README, "The balanced path")
                # (each within ~2 units of rounding of the exact gradient)
                assert rel_l2(mine, theirs) <= 4 * (2.0**-9 if dtype == torch.bfloat16 else 2.0**-24)
            else:  # CPU: both are the chunked path's gradients; scaling by a power of two is exact
                assert torch.equal(mine, theirs)


def test_backward_scales_saved_gradients_and_refuses_missing_ones():
    e, c, t, _ = make_inputs(10, 30, 8, torch.float32)
    e.requires_grad_()
    loss, grad_e, grad_c, _ = torch.ops.cce_inductor.linear_cross_entropy_with_grads(
        e, c, t, None, None, IGNORE, "sum", 0.0, BALANCED.encode(), True, False, False)
    assert grad_c.numel() == 0 and not grad_e.requires_grad
    (ge,) = torch.autograd.grad(loss * 2.0, [e])
    assert torch.equal(ge, grad_e * 2.0)
    # c requires grad but its gradient was not computed: loud, never a silent None / zero
    loss, *_ = torch.ops.cce_inductor.linear_cross_entropy_with_grads(
        e, c.requires_grad_(), t, None, None, IGNORE, "sum", 0.0, BALANCED.encode(), True, False, False)
    with pytest.raises(RuntimeError, match="told not to compute"):
        torch.autograd.grad(loss, [c])


# ----------------------------------------------------------------------------------------------------------------
# The pass
# ----------------------------------------------------------------------------------------------------------------


class Head(torch.nn.Module):
    def __init__(self, d=16, v=50, tied=False):
        super().__init__()
        self.embed = torch.nn.Embedding(v, d)
        self.proj = torch.nn.Linear(d, d)
        self.head = torch.nn.Linear(d, v, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids, labels, reduction="mean", z_loss=0.0):
        h = torch.tanh(self.proj(self.embed(ids)))
        logits = self.head(h).float().view(-1, self.head.out_features)
        loss = F.cross_entropy(logits, labels.view(-1), reduction=reduction)
        if z_loss:
            loss = loss + z_loss * torch.logsumexp(logits, -1).pow(2).mean()
        return loss


def _compiled_run(model, ids, labels, options, **kwargs):
    cce_inductor.reset_stats()
    compiled = torch.compile(model, backend=cce_inductor.make_backend(options), **kwargs.pop("compile", {}))
    loss = compiled(ids, labels, **kwargs)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss.sum(), params) if loss.requires_grad else []
    return loss, grads, cce_inductor.stats()


def _eager_run(model, ids, labels, **kwargs):
    loss = model(ids, labels, **kwargs)
    params = [p for p in model.parameters() if p.requires_grad]
    return loss, (torch.autograd.grad(loss.sum(), params) if loss.requires_grad else [])


def _data(b=3, t=7, v=50, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, v, (b, t), generator=gen)
    labels = torch.randint(0, v, (b, t), generator=gen)
    labels[0, :3] = IGNORE
    return ids, labels


@pytest.mark.parametrize("setting", ["mean", "sum", "tied", "frozen_head", "dynamic"])
def test_pass_takes_the_balanced_path_and_matches_eager(setting, no_inductor_caches):
    torch.manual_seed(0)
    model = Head(tied=setting == "tied")
    if setting == "frozen_head":
        model.head.weight.requires_grad_(False)
    reduction = "sum" if setting == "sum" else "mean"
    ids, labels = _data()
    want_loss, want = _eager_run(model, ids, labels, reduction=reduction)
    compile_kwargs = {"dynamic": True} if setting == "dynamic" else {}
    loss, grads, stats = _compiled_run(model, ids, labels, BALANCED, reduction=reduction, compile=compile_kwargs)
    # (dynamic=True: Dynamo may restart its analysis after calling the backend once: the site is then seen twice)
    assert {s["path"] for s in stats["sites"]} == {"balanced"}, stats["sites"]
    assert "balanced path (1 MiB scratch)" in stats["sites"][0]["reason"]
    assert f"({len(stats['sites'])} on the balanced path)" in stats["summary"]
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(grads, want):
        assert rel_l2(mine, theirs) < 1e-5
    if setting == "dynamic":  # another batch size reuses the dynamic graph
        ids2, labels2 = _data(b=5, t=4, seed=1)
        want_loss2, want2 = _eager_run(model, ids2, labels2)
        compiled = torch.compile(model, backend=cce_inductor.make_backend(BALANCED), dynamic=True)
        loss2 = compiled(ids2, labels2)
        grads2 = torch.autograd.grad(loss2, [p for p in model.parameters() if p.requires_grad])
        torch.testing.assert_close(loss2, want_loss2, rtol=1e-5, atol=1e-6)
        for mine, theirs in zip(grads2, want2):
            assert rel_l2(mine, theirs) < 1e-5


@pytest.mark.parametrize("setting, reason", [
    ("none", "lean path: reduction='none'"),
    ("no_grad", "lean path: no gradient is needed"),
    ("frozen_all", "lean path: no gradient is needed"),
    ("z_loss", "lean path: the log-sum-exp is used beyond the loss"),
    ("scratch_0", None),
])
def test_pass_keeps_the_lean_path_where_the_balanced_one_does_not_apply(setting, reason, no_inductor_caches):
    torch.manual_seed(0)
    model = Head()
    if setting == "frozen_all":
        model.requires_grad_(False)
    ids, labels = _data()
    kwargs = {"reduction": "none"} if setting == "none" else {"z_loss": 1e-2} if setting == "z_loss" else {}
    options = CCEOptions() if setting == "scratch_0" else BALANCED
    want_loss, want = _eager_run(model, ids, labels, **kwargs)
    if setting == "no_grad":
        with torch.no_grad():
            loss, grads, stats = _compiled_run(model, ids, labels, options, **kwargs)
        want = []
    else:
        loss, grads, stats = _compiled_run(model, ids, labels, options, **kwargs)
    assert [s["path"] for s in stats["sites"]] == ["lean"], stats["sites"]
    assert stats["sites"][0]["rewritten"]
    if reason is None:
        assert "path" not in stats["sites"][0]["reason"] and "balanced" not in stats["summary"]
    else:
        assert reason in stats["sites"][0]["reason"], stats["sites"][0]["reason"]
    torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(grads, want):
        assert rel_l2(mine, theirs) < 1e-5


def test_per_row_sites_say_they_keep_the_lean_path(no_inductor_caches):
    """Token log-probs (RL) are per-row outputs: the lean path, and stats() says why when a scratch was asked for."""

    def log_probs(hidden, weight, ids):
        logits = hidden @ weight.T
        return torch.gather(logits.log_softmax(-1), -1, ids.unsqueeze(-1)).squeeze(-1)

    hidden = torch.randn(2, 5, 8, requires_grad=True)
    weight = torch.randn(30, 8, requires_grad=True)
    ids = torch.randint(0, 30, (2, 5))
    cce_inductor.reset_stats()
    out = torch.compile(log_probs, backend=cce_inductor.make_backend(BALANCED))(hidden, weight, ids)
    torch.testing.assert_close(out, log_probs(hidden, weight, ids), rtol=1e-5, atol=1e-5)
    (site,) = cce_inductor.stats()["sites"]
    assert site["rewritten"] and site["path"] == "lean" and "lean path: per-row outputs" in site["reason"]


# ----------------------------------------------------------------------------------------------------------------
# CUDA: a real head shape, no host synchronisation
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_gpu_real_shape_error_at_most_torch_compiles(softcap):
    """N 4096 x D 2048 x V 32768 bf16 in 4 chunks: dE / dC errors against fp32 logits no larger than eager's
    (torch.compile's) bf16 computation, and the loss within 1e-3."""
    torch.manual_seed(0)
    n, d, v = 4096, 2048, 32768
    e = (torch.randn(n, d, device="cuda") * 3 / d**0.5).bfloat16()
    c = torch.randn(v, d, device="cuda").bfloat16()
    t = torch.randint(0, v, (n,), device="cuda")
    t[::5] = IGNORE
    got = K.loss_and_grads(e, c, t, None, softcap=softcap, ignore_index=IGNORE, reduction="mean",
                           scratch_bytes=n // 4 * v * 2)
    loss, want = reference(e, c, t, None, softcap=softcap, dtype=torch.float32)
    _, eager = reference(e, c, t, None, softcap=softcap, dtype=torch.bfloat16, logits_dtype=torch.bfloat16)
    assert abs(got.loss.item() - loss.item()) <= 1e-3 * loss.item()
    for name, mine, theirs, ref in zip(("dE", "dC"), got[1:3], eager[:2], want[:2]):
        # the same roundings as eager's in another summation order (test_kernels_match_fp64)
        assert rel_l2(mine.bfloat16(), ref) <= 1.01 * rel_l2(theirs, ref), name


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_no_host_sync():
    e = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    c = torch.randn(5000, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, 5000, (1000,), device="cuda")
    cce_inductor.linear_cross_entropy(e, c, t, options=BALANCED).backward()  # warm up (compiles the kernel)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        cce_inductor.linear_cross_entropy(e, c, t, options=CCEOptions(scratch_mb=2)).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_pass_under_autocast_is_no_less_accurate_than_eager(no_inductor_caches):
    """CPU autocast (bf16 head over fp32 weights): the balanced path is taken, and its loss and gradients are at
    least as close to the fp32 computation as eager autocast's."""
    torch.manual_seed(0)
    model = Head(d=32, v=300)
    ids, labels = _data(b=4, t=16, v=300)
    ref_loss, ref = _eager_run(model, ids, labels)  # fp32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager_loss, eager = _eager_run(model, ids, labels)
        loss, grads, stats = _compiled_run(model, ids, labels, BALANCED)
    assert {s["path"] for s in stats["sites"]} == {"balanced"}, stats["sites"]
    assert abs(loss.item() - ref_loss.item()) <= abs(eager_loss.item() - ref_loss.item()) + 1e-6
    for mine, theirs, want in zip(grads, eager, ref):
        assert mine.dtype == want.dtype
        assert rel_l2(mine, want) <= rel_l2(theirs, want) + 1e-6


def test_pass_balanced_gemma_style_softcap_and_label_smoothing(no_inductor_caches):
    """Gemma-2's final-logit softcap and a label-smoothed loss, through the pass on the balanced path."""

    class SoftcapHead(Head):
        def forward(self, ids, labels):
            h = torch.tanh(self.proj(self.embed(ids)))
            logits = torch.tanh(self.head(h) / 30.0) * 30.0
            return F.cross_entropy(logits.float().view(-1, self.head.out_features), labels.view(-1),
                                   label_smoothing=0.1)

    torch.manual_seed(0)
    model = SoftcapHead()
    ids, labels = _data()
    want_loss, want = _eager_run(model, ids, labels)
    loss, grads, stats = _compiled_run(model, ids, labels, BALANCED)
    assert {s["path"] for s in stats["sites"]} == {"balanced"}, stats["sites"]
    assert "softcap=30" in stats["sites"][0]["reason"] and "label_smoothing=0.1" in stats["sites"][0]["reason"]
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(grads, want):
        assert rel_l2(mine, theirs) < 1e-5


def test_pass_loss_under_no_grad_after_a_head_with_grad_stays_lean(no_inductor_caches):
    """The head computed with grad, its loss taken under torch.no_grad (an evaluation metric in a training step):
    the loss needs no gradient, so no gradients are computed for it."""

    class MetricHead(Head):
        def forward(self, ids, labels):
            h = torch.tanh(self.proj(self.embed(ids)))
            logits = self.head(h)
            with torch.no_grad():
                metric = F.cross_entropy(logits.float().view(-1, self.head.out_features), labels.view(-1))
            return h.sum() * 0.0 + metric

    torch.manual_seed(0)
    model = MetricHead()
    ids, labels = _data()
    want = model(ids, labels)
    cce_inductor.reset_stats()
    got = torch.compile(model, backend=cce_inductor.make_backend(BALANCED))(ids, labels)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    (site,) = cce_inductor.stats()["sites"]
    assert site["rewritten"] and site["path"] == "lean", site
    assert "lean path: no gradient is needed" in site["reason"], site
