"""Tests of the CCE Triton kernels (``cce_inductor.kernels``) against an fp64 PyTorch reference.

On a machine without CUDA the kernels run in the Triton interpreter (``TRITON_INTERPRET=1`` is set
below, before the kernels are imported) at tiny shapes with tiny blocks.  With CUDA the same checks run
on the GPU, plus a ``gpu`` set at real LM-head shapes.

Tolerances (relative L2 error against fp64 computed from the same, already rounded, inputs):
default mode (gradient filtering, accumulation in the output dtype) 1e-2; exact mode 2e-3.

Exact mode with 16-bit outputs: merely rounding the fp64 gradient to bf16 costs ~1.6e-3 relative L2 (on
a few dozen elements it can exceed 2e-3), so exact mode is held to 2e-3 against the fp64 reference
*rounded to the output dtype* (the error the kernel adds beyond the unavoidable final rounding), and in
addition to the default-mode 1e-2 against the unrounded fp64 reference.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import pytest  # noqa: E402

import cce_inductor.kernels as K  # noqa: E402

IGNORE = -100
HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
DEFAULT_TOL = 1e-2
EXACT_TOL = 2e-3
LSE_TOL = 1e-5

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


def _device_ok(device):
    if device == "cpu" and not K.INTERPRET:
        pytest.skip("CPU tensors need the Triton interpreter (run without CUDA)")
    if device == "cuda" and not HAS_CUDA:
        pytest.skip("needs CUDA")


def rel(a, ref):
    a = a.double().cpu()
    ref = ref.double().cpu()
    assert torch.isfinite(a).all(), "non-finite values"
    den = ref.norm()
    if den == 0:
        return a.norm().item()
    return ((a - ref).norm() / den).item()


def check_grad(out, ref, exact):
    assert rel(out, ref) < DEFAULT_TOL
    if exact:
        assert rel(out, ref.to(out.dtype)) < EXACT_TOL


def make_inputs(n, v, d, dtype, device, *, ignore_frac=0.0, bias=False, logit_std=3.0, seed=0, noncontig=False):
    gen = torch.Generator().manual_seed(seed)
    c = torch.randn(v, d, generator=gen) / math.sqrt(d)
    e = torch.randn(n, d, generator=gen) * logit_std
    # make some rows confident: add their target's vector (|c| ~ 1), raising the target logit by ~12
    targets = torch.randint(0, v, (n,), generator=gen)
    confident = torch.rand(n, generator=gen) < 0.5
    e[confident] += 12.0 * c[targets[confident]]
    if ignore_frac > 0:
        ignored = torch.rand(n, generator=gen) < ignore_frac
        if ignore_frac >= 1.0:
            ignored[:] = True
        targets[ignored] = IGNORE
    b = (torch.randn(v, generator=gen) * 0.5).to(dtype).to(device) if bias else None
    e = e.to(dtype)
    if noncontig:
        # a transposed-then-transposed view: strides (1, n)
        e = e.t().contiguous().to(device).t()
    else:
        e = e.to(device)
    return e, c.to(dtype).to(device), targets.to(device), b


def reference(e, c, targets, bias, grad_rows, softcap):
    """fp64 reference with materialised logits.  Returns lse, target_logit, dE, dC, dbias."""
    e64 = e.detach().double().cpu().requires_grad_()
    c64 = c.detach().double().cpu().requires_grad_()
    b64 = bias.detach().double().cpu().requires_grad_() if bias is not None else None
    t = targets.cpu()
    raw = e64 @ c64.T
    if b64 is not None:
        raw = raw + b64
    logits = softcap * torch.tanh(raw / softcap) if softcap is not None else raw
    lse = torch.logsumexp(logits, dim=-1)
    valid = t != IGNORE
    tgt_logit = logits.gather(1, t.clamp(min=0)[:, None])[:, 0]
    row_loss = torch.where(valid, lse - tgt_logit, torch.zeros_like(lse))
    (row_loss * grad_rows.double().cpu()).sum().backward()
    return (lse.detach(), tgt_logit.detach(), e64.grad, c64.grad, b64.grad if b64 is not None else None)


def mean_grad_rows(targets):
    valid = targets != IGNORE
    return valid.float() / valid.sum().clamp(min=1).float()


def run_kernels(e, c, targets, bias, grad_rows, *, softcap, vocab_sort, filter_eps, exact,
                need_e=True, need_c=True, need_bias=True):
    summaries = filter_eps > 0 and not exact  # as the op asks: only a filtering backward reads them
    lse, tgt, aux = K.forward(e, c, targets, bias, softcap=softcap, ignore_index=IGNORE, vocab_sort=vocab_sort,
                              summaries=summaries)
    shape, dtype = K.aux_spec(e.shape[0], c.shape[0], vocab_sort, summaries)
    assert tuple(aux.shape) == tuple(shape) and aux.dtype == dtype
    grads = K.backward(e, c, targets, bias, lse, aux, grad_rows, softcap=softcap, ignore_index=IGNORE,
                       filter_eps=filter_eps, vocab_sort=vocab_sort, exact=exact,
                       need_e=need_e, need_c=need_c, need_bias=need_bias)
    return lse, tgt, grads


# (dtype, n, v, d, softcap, bias, ignore_frac, vocab_sort, mode, noncontig)
# mode: "filter" (default eps), "nofilter" (eps=0: the dense backward, BLAS products + softmax-gradient kernel),
# "tile" (eps=0 through the tile kernel, ``bwd_dense=0``), "exact" (the dense backward with G in hi + lo halves),
# "exact_tile" (exact mode through the tile kernel)
CPU_CASES = [
    (torch.float32, 37, 150, 40, None, False, 0.0, False, "filter", False),
    (torch.float32, 37, 150, 40, 15.0, True, 0.3, True, "filter", False),
    (torch.bfloat16, 37, 150, 40, None, False, 0.0, False, "filter", False),
    (torch.bfloat16, 37, 150, 40, 15.0, True, 0.3, False, "filter", False),
    (torch.bfloat16, 64, 300, 64, 15.0, True, 0.3, True, "filter", False),
    (torch.bfloat16, 48, 257, 48, None, True, 0.5, True, "nofilter", False),
    (torch.bfloat16, 37, 150, 40, 15.0, False, 0.3, False, "exact", False),
    (torch.bfloat16, 37, 150, 40, None, True, 0.0, True, "exact", True),
    (torch.float16, 37, 150, 40, None, True, 0.3, False, "filter", False),
    (torch.float16, 33, 131, 24, 15.0, False, 0.0, True, "exact", False),
    (torch.float16, 33, 131, 24, None, False, 0.0, False, "nofilter", True),
    (torch.bfloat16, 1, 150, 40, None, False, 0.0, False, "filter", False),
    (torch.bfloat16, 1, 77, 40, 15.0, True, 0.0, True, "exact", False),
    (torch.float32, 64, 300, 64, 15.0, True, 1.0, False, "filter", False),
    (torch.bfloat16, 17, 300, 64, None, False, 0.0, False, "filter", True),
    (torch.float32, 37, 150, 40, 15.0, True, 0.3, False, "nofilter", False),
    (torch.bfloat16, 37, 150, 40, 15.0, True, 0.3, False, "nofilter", True),
    (torch.bfloat16, 1, 77, 40, 15.0, True, 0.0, False, "nofilter", False),
    (torch.float32, 64, 300, 64, None, True, 1.0, False, "nofilter", False),
    (torch.bfloat16, 48, 257, 48, None, True, 0.5, False, "tile", False),
    (torch.float16, 33, 131, 24, 15.0, True, 0.2, False, "tile", True),
    (torch.bfloat16, 37, 150, 40, 15.0, True, 0.3, False, "exact_tile", False),
    (torch.float32, 37, 150, 40, None, True, 0.3, False, "exact", False),
]


def _case_id(case):
    dtype, n, v, d, softcap, bias, ign, vs, mode, nc = case
    return (f"{str(dtype).split('.')[-1]}-{n}x{v}x{d}-cap{softcap}-bias{int(bias)}-ign{ign}"
            f"-sort{int(vs)}-{mode}{'-noncontig' if nc else ''}")


def check_case(case, device, seed=0):
    dtype, n, v, d, softcap, bias, ign, vocab_sort, mode, noncontig = case
    e, c, targets, b = make_inputs(n, v, d, dtype, device, ignore_frac=ign, bias=bias, seed=seed, noncontig=noncontig)
    grad_rows = mean_grad_rows(targets)
    exact = mode in ("exact", "exact_tile")
    eps = K.default_filter_eps(dtype) if mode == "filter" else 0.0
    with K.override_config(bwd_dense=int(mode not in ("tile", "exact_tile"))):
        lse, tgt, (de, dc, db) = run_kernels(e, c, targets, b, grad_rows, softcap=softcap, vocab_sort=vocab_sort,
                                             filter_eps=eps, exact=exact)
    lse_r, tgt_r, de_r, dc_r, db_r = reference(e, c, targets, b, grad_rows, softcap)
    valid = (targets != IGNORE).cpu()
    assert lse.shape == (n,) and lse.dtype == torch.float32 and tgt.shape == (n,)
    assert torch.isfinite(lse).all() and torch.isfinite(tgt).all()
    if valid.any():
        assert rel(lse.cpu()[valid], lse_r[valid]) < LSE_TOL
        assert rel(tgt.cpu()[valid], tgt_r[valid]) < LSE_TOL
    assert de.dtype == e.dtype and de.shape == e.shape
    assert dc.dtype == c.dtype and dc.shape == c.shape
    if not valid.any():
        assert de.abs().max() == 0 and dc.abs().max() == 0
        return
    assert (de.cpu()[~valid] == 0).all(), "ignored rows must get zero dE"
    check_grad(de, de_r, exact)
    check_grad(dc, dc_r, exact)
    if bias:
        assert db.dtype == b.dtype and db.shape == b.shape
        check_grad(db, db_r, exact)
    else:
        assert db is None


@pytest.mark.parametrize("case", CPU_CASES, ids=_case_id)
@pytest.mark.parametrize("device", DEVICES)
def test_matches_fp64_reference(case, device):
    _device_ok(device)
    check_case(case, device)


def _tile_filtered_reference(e, c, targets, bias, grad_rows, softcap, eps, vocab_sort, tile_n, tile_v, flat_prob):
    """fp64 reference of the tile-filter semantics: the off-target part (softmax) of a tile is dropped when
    all its off-target probabilities are < eps; the target entries (p_t - 1) are always kept; rows whose
    largest probability is < flat_prob keep their whole dE.
    Returns dE, dC, dbias, the kept-tile mask and the unfiltered dE."""
    e64, c64, t = e.double().cpu(), c.double().cpu(), targets.cpu()
    raw = e64 @ c64.T + (bias.double().cpu() if bias is not None else 0.0)
    logits = softcap * torch.tanh(raw / softcap) if softcap is not None else raw
    prob = torch.softmax(logits, dim=-1)
    valid = t != IGNORE
    onehot = torch.zeros_like(prob)
    onehot[valid.nonzero()[:, 0], t[valid]] = 1.0
    off_target = prob * (1 - onehot)
    order = torch.argsort((~valid).to(torch.int8), stable=True)[: int(valid.sum())]
    if vocab_sort:
        vocab_order = torch.argsort(logits[valid].sum(0), descending=True)
    else:
        vocab_order = torch.arange(c.shape[0])
    keep = torch.zeros_like(prob, dtype=torch.bool)
    for i in range(0, len(order), tile_n):
        rows = order[i:i + tile_n]
        for j in range(0, c.shape[0], tile_v):
            cols = vocab_order[j:j + tile_v]
            if off_target[rows][:, cols].max() >= eps:
                keep[rows[:, None], cols[None, :]] = True
    g = grad_rows.double().cpu()[:, None]
    flat = (prob.max(-1).values < flat_prob)[:, None]
    grad = g * (off_target * keep + (prob - 1) * onehot)
    grad_e = g * (off_target * (keep | flat) + (prob - 1) * onehot)
    dense = g * (prob - onehot)
    if softcap is not None:
        chain = 1 - (logits / softcap) ** 2
        grad, grad_e, dense = grad * chain, grad_e * chain, dense * chain
    grad[~valid] = 0
    grad_e[~valid] = 0
    dense[~valid] = 0
    return grad_e @ c64, grad.T @ e64, grad.sum(0), keep, dense @ c64, flat


@pytest.mark.parametrize("filter_e", [1, 0])
@pytest.mark.parametrize("vocab_sort", [False, True])
@pytest.mark.parametrize("softcap", [None, 15.0])
@pytest.mark.parametrize("device", DEVICES)
def test_tile_filter_semantics(device, vocab_sort, softcap, filter_e):
    """A large filter_eps drops many tiles (pre-skip from aux, post-recompute skip, target kernels);
    the result must equal the tile-filtered fp64 reference (fp32 inputs, so tightly).  With
    ``bwd_filter_e=0`` dE is dense (unfiltered) and only dC / dbias are filtered."""
    _device_ok(device)
    with K.override_config(bwd_filter_e=filter_e, flat_row_log2=2, tail_frac_pct=101):
        _check_tile_filter(device, vocab_sort, softcap, filter_e)


def _check_tile_filter(device, vocab_sort, softcap, filter_e):
    e, c, targets, b = make_inputs(40, 200, 32, torch.float32, device, ignore_frac=0.2, bias=True, seed=3)
    grad_rows = torch.randn(40, generator=torch.Generator().manual_seed(5)).to(device) * (targets != IGNORE)
    eps = 0.05
    lse, tgt, (de, dc, db) = run_kernels(e, c, targets, b, grad_rows, softcap=softcap, vocab_sort=vocab_sort,
                                         filter_eps=eps, exact=False)
    de_r, dc_r, db_r, keep, de_dense, flat = _tile_filtered_reference(
        e, c, targets, b, grad_rows, softcap, eps, vocab_sort, K.CONFIG["tile_n"], K.CONFIG["tile_v"],
        eps * 2.0 ** K.CONFIG["flat_row_log2"])
    if not filter_e:
        de_r = de_dense
    assert 0.0 < keep.double().mean() < 1.0, "the test must have both skipped and kept tiles"
    valid = (targets != IGNORE).cpu()
    assert 0 < int(flat[valid].sum()) < int(valid.sum()), "the test must have both flat and peaked rows"
    assert rel(de, de_r) < 1e-5
    assert rel(dc, dc_r) < 1e-5
    assert rel(db, db_r) < 1e-5


@pytest.mark.parametrize("mode", ["filter", "nofilter"])
@pytest.mark.parametrize("device", DEVICES)
def test_need_flags_and_no_bias(device, mode):
    _device_ok(device)
    e, c, targets, b = make_inputs(20, 70, 16, torch.bfloat16, device, bias=True)
    g = mean_grad_rows(targets).to(device)
    eps = K.default_filter_eps(torch.bfloat16) if mode == "filter" else 0.0
    _, _, (de, dc, db) = run_kernels(e, c, targets, b, g, softcap=None, vocab_sort=False, filter_eps=eps,
                                     exact=False, need_e=True, need_c=False, need_bias=False)
    assert dc is None and db is None and de is not None
    _, _, (de2, dc2, db2) = run_kernels(e, c, targets, b, g, softcap=None, vocab_sort=False, filter_eps=eps,
                                        exact=False, need_e=False, need_c=True, need_bias=True)
    assert de2 is None and dc2 is not None and db2 is not None
    _, _, (de3, dc3, db3) = run_kernels(e, c, targets, None, g, softcap=None, vocab_sort=False, filter_eps=eps,
                                        exact=False, need_e=True, need_c=True, need_bias=True)
    assert db3 is None
    _, _, de_r, dc_r, db_r = reference(e, c, targets, b, g, None)
    _, _, de_r3, dc_r3, _ = reference(e, c, targets, None, g, None)
    for got, want in ((de, de_r), (dc2, dc_r), (db2, db_r), (de3, de_r3), (dc3, dc_r3)):
        assert rel(got, want) < DEFAULT_TOL


@pytest.mark.parametrize("device", DEVICES)
def test_sliced_e_view(device):
    """e as a row- and column-sliced view of a larger tensor (non-unit row stride)."""
    _device_ok(device)
    big, c, targets, _ = make_inputs(60, 90, 48, torch.bfloat16, device)
    e = big[::2, 8:40]
    c = c[:, 8:40].contiguous()
    targets = targets[::2].contiguous()
    g = mean_grad_rows(targets).to(device)
    lse, tgt, (de, dc, _) = run_kernels(e, c, targets, None, g, softcap=None, vocab_sort=False,
                                        filter_eps=K.default_filter_eps(torch.bfloat16), exact=False)
    lse_r, _, de_r, dc_r, _ = reference(e, c, targets, None, g, None)
    assert rel(lse, lse_r) < LSE_TOL
    assert rel(de, de_r) < DEFAULT_TOL and rel(dc, dc_r) < DEFAULT_TOL


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch(device):
    _device_ok(device)
    e = torch.randn(0, 16, device=device).to(torch.bfloat16)
    c = torch.randn(50, 16, device=device).to(torch.bfloat16)
    t = torch.zeros(0, dtype=torch.int64, device=device)
    for vocab_sort in (False, True):
        lse, tgt, (de, dc, db) = run_kernels(e, c, t, None, torch.zeros(0, device=device), softcap=None,
                                             vocab_sort=vocab_sort, filter_eps=2**-12, exact=False)
        assert lse.shape == (0,) and de.shape == (0, 16) and dc.shape == (50, 16)
        assert (dc == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab_sort", [False, True])
def test_forward_without_summaries(device, vocab_sort):
    """The bare forward (no aux summaries, what an unfiltered backward gets) computes the same lse and target
    logits bit for bit, returns an empty aux, and a filtering backward refuses that aux."""
    _device_ok(device)
    gen = torch.Generator().manual_seed(5)
    n, v, d = 45, 200, 40
    e = torch.randn(n, d, generator=gen).to(device, torch.bfloat16)
    c = torch.randn(v, d, generator=gen).to(device, torch.bfloat16)
    targets = torch.randint(0, v, (n,), generator=gen).to(device)
    targets[::4] = IGNORE
    bias = torch.randn(v, generator=gen).to(device, torch.bfloat16)
    full = K.forward(e, c, targets, bias, softcap=15.0, ignore_index=IGNORE, vocab_sort=vocab_sort)
    bare = K.forward(e, c, targets, bias, softcap=15.0, ignore_index=IGNORE, vocab_sort=vocab_sort, summaries=False)
    assert torch.equal(full[0], bare[0]) and torch.equal(full[1], bare[1])
    assert full[2].numel() > 2 * n and bare[2].numel() == 0
    grad_rows = mean_grad_rows(targets).to(device)
    with pytest.raises(ValueError, match="summaries"):
        K.backward(e, c, targets, bias, bare[0], bare[2], grad_rows, softcap=15.0, ignore_index=IGNORE,
                   filter_eps=2.0**-12, vocab_sort=vocab_sort, exact=False, need_e=True, need_c=True, need_bias=True)


def test_default_filter_eps():
    assert K.default_filter_eps(torch.bfloat16) == 2.0**-12
    assert K.default_filter_eps(torch.float16) == 2.0**-15
    assert K.default_filter_eps(torch.float32) == 2.0**-28


def test_aux_spec_symbolic():
    """aux_spec only uses +, * and // so it works on SymInts; check with sympy symbols."""
    sympy = pytest.importorskip("sympy")
    n, v = sympy.symbols("n v", integer=True, positive=True)
    shape, dtype = K.aux_spec(n, v, False)
    assert dtype == torch.float32 and len(shape) == 1
    tn, tv = K.CONFIG["tile_n"], K.CONFIG["tile_v"]
    assert shape[0].subs({n: 8192, v: 256000}) == 2 * 8192 + math.ceil(8192 / tn) * math.ceil(256000 / tv)
    assert K.aux_spec(n, v, True) == ((2 * n + v,), torch.float32)
    assert K.aux_spec(n, v, True, summaries=False) == ((0,), torch.float32)


# ----------------------------------------------------------------------------------------------------
# GPU set: real LM-head shapes (skipped without CUDA)
# ----------------------------------------------------------------------------------------------------
GPU_SHAPES = [(8192, 32064, 3072), (8192, 128256, 4096), (8192, 256000, 2304)]


def _gpu_reference_grads(e, c, targets, grad_rows, softcap, chunk=1024):
    """fp64-accumulated reference on the GPU, chunked over rows (fp32 logits would be too coarse for the
    exact-mode tolerance; fp64 matmuls on the GPU are slow but fine at these sizes)."""
    e64, c64 = e.double(), c.double()
    de = torch.zeros_like(e64)
    dc = torch.zeros_like(c64)
    lse_all = torch.empty(e.shape[0], dtype=torch.float64, device=e.device)
    for s in range(0, e.shape[0], chunk):
        raw = e64[s:s + chunk] @ c64.T
        logits = softcap * torch.tanh(raw / softcap) if softcap is not None else raw
        lse = torch.logsumexp(logits, -1)
        lse_all[s:s + chunk] = lse
        t = targets[s:s + chunk]
        valid = t != IGNORE
        grad = torch.softmax(logits, -1)
        grad[valid.nonzero()[:, 0], t[valid]] -= 1
        grad *= grad_rows[s:s + chunk, None].double()
        if softcap is not None:
            grad *= 1 - (logits / softcap) ** 2
        grad[~valid] = 0
        de[s:s + chunk] = grad @ c64
        dc += grad.T @ e64[s:s + chunk]
        del raw, logits, grad
    return lse_all, de, dc


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mode", ["filter", "exact", "nofilter"])
@pytest.mark.parametrize("vocab_sort", [False, True])
def test_gpu_real_shapes(shape, mode, vocab_sort):
    if mode == "nofilter" and vocab_sort:
        pytest.skip("without filtering the vocabulary order is unused")
    n, v, d = shape
    e, c, targets, _ = make_inputs(n, v, d, torch.bfloat16, "cuda", ignore_frac=0.1, logit_std=1.0)
    grad_rows = mean_grad_rows(targets).cuda()
    exact = mode == "exact"
    lse, tgt, (de, dc, _) = run_kernels(e, c, targets, None, grad_rows, softcap=None, vocab_sort=vocab_sort,
                                        filter_eps=0.0 if mode == "nofilter" else K.default_filter_eps(torch.bfloat16),
                                        exact=exact)
    lse_r, de_r, dc_r = _gpu_reference_grads(e, c, targets, grad_rows, None)
    valid = targets != IGNORE
    assert rel(lse[valid], lse_r[valid]) < LSE_TOL
    check_grad(de, de_r, exact)
    check_grad(dc, dc_r, exact)


@pytest.mark.gpu
@requires_cuda
def test_gpu_no_host_sync():
    e, c, targets, b = make_inputs(1024, 32064, 512, torch.bfloat16, "cuda", ignore_frac=0.3, bias=True)
    g = mean_grad_rows(targets).cuda()
    run_kernels(e, c, targets, b, g, softcap=30.0, vocab_sort=True, filter_eps=2**-12, exact=False)  # compile
    run_kernels(e, c, targets, b, g, softcap=30.0, vocab_sort=False, filter_eps=2**-12, exact=False)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for vs in (False, True):
            run_kernels(e, c, targets, b, g, softcap=30.0, vocab_sort=vs, filter_eps=2**-12, exact=False)
        run_kernels(e, c, targets, b, g, softcap=30.0, vocab_sort=False, filter_eps=0.0, exact=False)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("device", DEVICES)
def test_flat_rows_keep_their_de(device):
    """Flat rows (every probability below filter_eps) must keep their whole dE: their many tiny
    probabilities add up to a systematic part of dE (here ~7%) that the tile filter would drop.
    (Confident rows with a heavy flat tail are flagged by the forward's tail-mass estimate; that case needs
    a large D to build and is covered by test_gpu_real_shapes.)"""
    _device_ok(device)
    n, v, d = 16, 16384, 16
    gen = torch.Generator().manual_seed(11)
    c = torch.randn(v, d, generator=gen) / math.sqrt(d)
    e = torch.randn(n, d, generator=gen) * 0.3  # logits ~ N(0, 0.09): every p < filter_eps
    targets = torch.randint(0, v, (n,), generator=gen)
    e, c, targets = e.to(torch.bfloat16).to(device), c.to(torch.bfloat16).to(device), targets.to(device)
    g = mean_grad_rows(targets).to(device)
    eps = K.default_filter_eps(torch.bfloat16)
    _, _, de_r, _, _ = reference(e, c, targets, None, g, None)
    _, _, (de, _, _) = run_kernels(e, c, targets, None, g, softcap=None, vocab_sort=False, filter_eps=eps,
                                   exact=False, need_c=False)
    assert rel(de, de_r) < DEFAULT_TOL
    with K.override_config(flat_row_log2=-60, tail_frac_pct=101):  # no row flagged: the test has teeth
        _, _, (de_bad, _, _) = run_kernels(e, c, targets, None, g, softcap=None, vocab_sort=False,
                                           filter_eps=eps, exact=False, need_c=False)
    assert rel(de_bad, de_r) > DEFAULT_TOL


@pytest.mark.parametrize("products", ["cublas", "triton"])
@pytest.mark.parametrize("device", DEVICES)
def test_dense_backward_is_reproducible_and_chunking_invariant(device, products):
    """The dense backward has no atomics: two runs agree bitwise.  Its row / vocabulary chunking only
    changes how the products are cut: one block and many blocks agree to fp32 rounding (fp32 inputs)."""
    _device_ok(device)
    e, c, targets, b = make_inputs(45, 170, 24, torch.float32, device, ignore_frac=0.2, bias=True, seed=7)
    g = mean_grad_rows(targets).to(device)
    lse, _, _ = K.forward(e, c, targets, b, softcap=20.0, ignore_index=IGNORE, vocab_sort=False)

    def grads(exact=False, e=e, c=c, b=b):
        with K.override_config(dense_products=products):
            return K.backward(e, c, targets, b, lse, None, g, softcap=20.0, ignore_index=IGNORE, filter_eps=0.0,
                              vocab_sort=False, exact=exact, need_e=True, need_c=True, need_bias=True)

    first, second = grads(), grads()
    for x, y in zip(first, second):
        assert torch.equal(x, y)
    # exact mode (16-bit: G in hi + lo halves through the same products) is just as reproducible
    e16, c16, b16 = e.bfloat16(), c.bfloat16(), b.bfloat16()
    for x, y in zip(grads(True, e16, c16, b16), grads(True, e16, c16, b16)):
        assert torch.equal(x, y)
    with K.override_config(dense_row_chunk=0, dense_vocab_chunk=1 << 20):
        whole = grads()
    with K.override_config(dense_row_chunk=7, dense_vocab_chunk=33):
        pieces = grads()
    for x, y in zip(whole, pieces):
        assert rel(y, x) < 1e-6
    _, _, de_r, dc_r, db_r = reference(e, c, targets, b, g, 20.0)
    for x, ref in zip(whole, (de_r, dc_r, db_r)):
        assert rel(x, ref) < 1e-5


@pytest.mark.parametrize("mode", ["filter", "nofilter"])
@pytest.mark.parametrize("device", DEVICES)
def test_targets_outside_the_vocabulary_read_nothing(device, mode):
    """A vocabulary shard sees targets outside [0, V) for rows whose target another shard holds (the
    vocabulary-parallel loss passes -2): such rows have no one-hot term and no kernel may read C[target].
    C is a view between NaN rows, so a stray read shows up as NaN (on the GPU it was an illegal address)."""
    _device_ok(device)
    n, v, d = 24, 90, 16
    e, c_full, targets, _ = make_inputs(n, v + 8, d, torch.float32, device, seed=4)
    c_full[:4] = float("nan")
    c_full[-4:] = float("nan")
    c = c_full[4:-4]
    targets = targets.clamp(max=v - 1)
    targets[::3] = -2
    targets[1::5] = v + 2
    targets[2::7] = IGNORE
    g = torch.rand(n, generator=torch.Generator().manual_seed(1)).to(device) * (targets != IGNORE)
    eps = K.default_filter_eps(torch.float32) if mode == "filter" else 0.0
    lse, tgt, aux = K.forward(e, c, targets, None, softcap=None, ignore_index=IGNORE, vocab_sort=False)
    de, dc, _ = K.backward(e, c, targets, None, lse, aux, g, softcap=None, ignore_index=IGNORE, filter_eps=eps,
                           vocab_sort=False, exact=False, need_e=True, need_c=True, need_bias=False)
    counted = (targets != IGNORE).cpu()
    logits = e.double().cpu() @ c.double().cpu().T
    lse_r = torch.logsumexp(logits, dim=-1)
    assert torch.isfinite(aux).all()
    assert rel(lse.cpu()[counted], lse_r[counted]) < LSE_TOL
    grad = torch.softmax(logits, dim=-1)
    t = targets.cpu()
    here = (t >= 0) & (t < v)
    grad[here.nonzero()[:, 0], t[here]] -= 1.0
    grad *= g.double().cpu()[:, None]
    with_eps = mode == "filter"
    assert rel(de, grad @ c.double().cpu()) < (5e-2 if with_eps else 1e-5)
    assert rel(dc, grad.T @ e.double().cpu()) < (5e-2 if with_eps else 1e-5)


@pytest.mark.parametrize("products", ["cublas", "triton"])
@pytest.mark.parametrize("device", DEVICES)
def test_dense_backward_skips_ignored_rows_keeps_eager_nan_pattern(device, products):
    """The dense backward's recompute skips whole row blocks of ignored rows (compacted on the device) and
    partly ignored blocks alike; the gradients still match the fp64 reference.  NaN lands where eager's
    log-softmax backward puts it through 0 * NaN: an ignored row of E holding a NaN -> dE of that row and all
    of dC / dbias; a NaN in C with every row ignored -> everything (each row's log-sum-exp is NaN).  The cuBLAS recompute
    variant agrees on finite inputs.  ``products``: the dE / dC products (cuBLAS, or the Triton ones that skip the
    ignored rows too)."""
    _device_ok(device)
    n, v, d = 53, 150, 24
    e, c, targets, b = make_inputs(n, v, d, torch.float32, device, bias=True, seed=11)
    targets[10:40] = IGNORE  # whole compacted blocks of ignored rows at any block size <= 16
    g = mean_grad_rows(targets).to(device)

    def grads(e_in, c_in, recompute="triton", targets=targets, g=g):
        lse, _, _ = K.forward(e_in, c_in, targets, b, softcap=None, ignore_index=IGNORE, vocab_sort=False,
                              summaries=False)
        with K.override_config(dense_recompute=recompute, dense_products=products):
            return K.backward(e_in, c_in, targets, b, lse, torch.empty(0, device=device), g, softcap=None,
                              ignore_index=IGNORE, filter_eps=0.0, vocab_sort=False, exact=False, need_e=True,
                              need_c=True, need_bias=True)

    got = grads(e, c)
    _, _, de_r, dc_r, db_r = reference(e, c, targets, b, g, None)
    for x, ref in zip(got, (de_r, dc_r, db_r)):
        assert rel(x, ref) < 1e-5
    if products == "cublas":  # the cuBLAS recompute has cuBLAS products only: compare like with like
        for x, y in zip(got, grads(e, c, "cublas")):
            assert rel(x, y) < 1e-6

    e_nan = e.clone()
    e_nan[20, 3] = float("nan")  # an ignored row
    de, dc, db = grads(e_nan, c)
    assert de.isnan().any(dim=1).nonzero().flatten().tolist() == [20]
    assert dc.isnan().all() and db.isnan().all()
    de, dc, db = grads(e, c)
    assert not (de.isnan().any() or dc.isnan().any() or db.isnan().any())
    c_nan = c.clone()
    c_nan[7, 0] = float("nan")
    none_counted = torch.full_like(targets, IGNORE)
    de, dc, db = grads(e, c_nan, "triton", none_counted, torch.zeros_like(g))
    assert de.isnan().all() and dc.isnan().all() and db.isnan().all()


def test_pipeline_depth_fits_shared_memory():
    """fp32 operands take twice the shared memory of 16-bit ones: the dense recompute's default depth (4 stages
    of 128 x 64 + 256 x 64 tiles) fits in bf16 but would need 288 KB in fp32 (seen failing on an H200), so it is
    lowered there."""
    from cce_inductor.kernels._config import fit_num_stages

    assert fit_num_stages(4, 128, 256, 64, 2) == 4
    assert fit_num_stages(4, 128, 256, 64, 4) == 3
    assert fit_num_stages(3, 128, 256, 64, 4) == 3
    assert fit_num_stages(2, 512, 512, 256, 4) == 2  # never below double buffering


@pytest.mark.parametrize("products", ["cublas", "triton"])
@pytest.mark.parametrize("device", DEVICES)
def test_dense_backward_counts_rows_the_caller_compaction_counts(device, products):
    """The vocabulary-parallel loss hands the kernels local target codes where a row whose target another shard
    holds carries the ignore code, and a compaction from its own codes that counts that row: such a row has no
    one-hot term here but must still get its softmax gradient (the dense recompute must not skip it)."""
    _device_ok(device)
    n, v, d = 40, 120, 24
    e, c, targets, _ = make_inputs(n, v, d, torch.float32, device, seed=9)
    local_ignore = -1
    shard_codes = targets.clone()
    shard_codes[::3] = -2  # target on another shard: counts, no one-hot here
    shard_codes[1::5] = local_ignore  # ignored everywhere
    local_targets = torch.where(shard_codes >= 0, shard_codes, local_ignore)
    compaction = K._config.compact_rows(shard_codes, local_ignore)
    counted = shard_codes != local_ignore
    g = (torch.rand(n, generator=torch.Generator().manual_seed(2)).to(device) + 0.5) * counted
    lse, _, _ = K.forward(e, c, shard_codes, None, softcap=None, ignore_index=local_ignore, vocab_sort=False,
                          summaries=False, row_compaction=compaction)
    with K.override_config(dense_products=products):
        de, dc, _ = K.backward(e, c, local_targets, None, lse, torch.empty(0, device=device), g, softcap=None,
                               ignore_index=local_ignore, filter_eps=0.0, vocab_sort=False, exact=False, need_e=True,
                               need_c=True, need_bias=False, row_compaction=compaction)
    logits = e.double().cpu() @ c.double().cpu().T
    grad = torch.softmax(logits, dim=-1)
    t = local_targets.cpu()
    here = t >= 0
    grad[here.nonzero()[:, 0], t[here]] -= 1.0
    grad *= g.double().cpu()[:, None]
    assert rel(de, grad @ c.double().cpu()) < 1e-5
    assert rel(dc, grad.T @ e.double().cpu()) < 1e-5
    # without the caller's compaction the "elsewhere" rows would be skipped: the test has teeth
    with K.override_config(dense_products=products):
        de_skip, _, _ = K.backward(e, c, local_targets, None, lse, torch.empty(0, device=device), g, softcap=None,
                                   ignore_index=local_ignore, filter_eps=0.0, vocab_sort=False, exact=False,
                                   need_e=True, need_c=False, need_bias=False)
    assert rel(de_skip, grad @ c.double().cpu()) > 1e-2


DENSE_CASES = [case for case in CPU_CASES if case[8] == "nofilter"]


@pytest.mark.parametrize("case", DENSE_CASES, ids=_case_id)
@pytest.mark.parametrize("device", DEVICES)
def test_triton_products_match_fp64_reference(case, device, monkeypatch):
    """The dense backward with its dE / dC products in Triton (``dense_products="triton"``, reading the device-side
    row count) meets the same fp64 checks as with cuBLAS, and really ran them (the C of these cases is aligned
    for the tensor-memory accelerator)."""
    _device_ok(device)
    from cce_inductor.kernels import _products

    calls = []
    for name in ("grad_e", "grad_c"):
        original = getattr(_products, name)
        monkeypatch.setattr(_products, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    with K.override_config(dense_products="triton"):
        check_case(case, device)
    assert {"grad_e", "grad_c"} <= set(calls)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_products_fall_back_to_cublas_for_unaligned_c(device, monkeypatch):
    """A C whose rows are not 16-byte aligned (D = 12 in bf16: 24-byte rows) cannot be read through a
    descriptor: the backward takes the cuBLAS products instead, with the same result."""
    _device_ok(device)
    from cce_inductor.kernels import _products

    monkeypatch.setattr(_products, "grad_c", lambda *a, **k: pytest.fail("Triton dC product on unaligned C"))
    case = (torch.bfloat16, 30, 70, 12, None, True, 0.3, False, "nofilter", False)
    with K.override_config(dense_products="triton"):
        check_case(case, device)
