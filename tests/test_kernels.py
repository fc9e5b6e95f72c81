"""Tests of the CCE Triton kernels (``cce_inductor.kernels``: ``forward`` and ``backward``) against an fp64
PyTorch reference with materialised logits.

On a machine without CUDA the kernels run in the Triton interpreter (``TRITON_INTERPRET=1`` is set below, before
the kernels are imported) at tiny shapes with the kernels' tiny ``"interpret"`` block sizes.  With CUDA the same
checks run on the GPU, plus a ``gpu`` set at real LM-head shapes.

What is tested:

* parity with fp64 over a case table: fp32 / bf16 / fp16, softcap, bias, ignored rows (some, none, all), N not a
  multiple of the row block, N = 1, V not a multiple of the vocabulary block, a non-contiguous E; default and
  exact mode; the dE / dC products in cuBLAS (``options.products="cublas"``) and in Triton (``"triton"``,
  checked to have really run), and the fall-back to cuBLAS where C cannot be read by the tensor-memory
  accelerator (and in exact mode);
* the ``need_*`` flags and a missing bias, a sliced view of E, an empty batch;
* the backward is bitwise reproducible, and its chunking (``options.backward_row_chunk`` and the vocabulary
  chunk, ``_backward._TUNING[...]["vocab_chunk"]``, monkeypatched) changes only rounding;
* rows whose target is ``ignore_index`` are skipped (whole row blocks of them too) with eager's NaN pattern;
  targets outside ``[0, V)`` other than ``ignore_index`` count with no one-hot term (how the vocabulary-parallel
  loss passes "target on another shard") and read nothing outside C;
* ``_launch.fit_num_stages``.

Tolerances (relative L2 error against fp64 computed from the same, already rounded, inputs): log-sum-exp and
target logit 1e-5.  Gradients: default mode 1e-2 (no gradient is filtered; the softmax gradient G is rounded once
to the input dtype before the products, as eager PyTorch rounds the logits' gradient: ~4e-3 in bf16); exact mode
2e-3.

Exact mode with 16-bit outputs: merely rounding the fp64 gradient to bf16 costs ~1.6e-3 relative L2 (on a few
dozen elements it can exceed 2e-3), so exact mode is held to 2e-3 against the fp64 reference *rounded to the
output dtype* (the error the kernel adds beyond the unavoidable final rounding), and in addition to the
default-mode 1e-2 against the unrounded fp64 reference.  (With fp32 inputs exact mode is the default path.)
"""
import os

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
from typing import NamedTuple, Optional  # noqa: E402

import pytest  # noqa: E402
from tests.support.compare import rel_l2  # noqa: E402

import cce_inductor.kernels as K  # noqa: E402
from cce_inductor import CCEOptions  # noqa: E402
from cce_inductor.kernels import _backward, _launch, _products  # noqa: E402

IGNORE = -100
HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
DEFAULT_TOL = 1e-2
EXACT_TOL = 2e-3
LSE_TOL = 1e-5
# the default options, the Triton products, exact mode
OPTION_SETS = {"cublas": CCEOptions(), "triton": CCEOptions(products="triton"), "exact": CCEOptions(exact=True)}
TUNING_KEY = "interpret" if K.INTERPRET else "gpu"  # the block sizes the kernels use here

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


def _device_ok(device):
    if device == "cpu" and not K.INTERPRET:
        pytest.skip("CPU tensors need the Triton interpreter (run without CUDA)")
    if device == "cuda" and not HAS_CUDA:
        pytest.skip("needs CUDA")


def rel(got, ref):
    """Relative L2 error of ``got`` (which must be finite) against ``ref``, in fp64 on the CPU."""
    assert torch.isfinite(got).all(), "non-finite values"
    return rel_l2(got.cpu(), ref.cpu())


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


def softmax_grad_reference(e, c, targets, grad_rows):
    """fp64 G = g * (softmax - onehot), no bias / softcap; a target outside [0, V) has no one-hot term (the row
    still counts: set its ``grad_rows`` to 0 to drop it).  Returns lse, G."""
    logits = e.double().cpu() @ c.double().cpu().T
    grad = torch.softmax(logits, dim=-1)
    t = targets.cpu()
    here = (t >= 0) & (t < c.shape[0])
    grad[here.nonzero()[:, 0], t[here]] -= 1.0
    return torch.logsumexp(logits, dim=-1), grad * grad_rows.double().cpu()[:, None]


def mean_grad_rows(targets):
    valid = targets != IGNORE
    return valid.float() / valid.sum().clamp(min=1).float()


def run_kernels(e, c, targets, bias, grad_rows, *, softcap, opts=None, ignore_index=IGNORE,
                need_e=True, need_c=True, need_bias=True):
    lse, tgt, *_ = K.forward(e, c, targets, bias, softcap=softcap, ignore_index=ignore_index)
    grads = K.backward(e, c, targets, bias, lse, grad_rows, softcap=softcap, ignore_index=ignore_index,
                       options=opts or CCEOptions(), need_e=need_e, need_c=need_c, need_bias=need_bias)
    return lse, tgt, grads


class Case(NamedTuple):
    dtype: torch.dtype
    n: int
    v: int
    d: int
    softcap: Optional[float]
    bias: bool
    ignore_frac: float
    mode: str  # "default" or "exact" (16-bit inputs: G in hi + lo halves, dC summed in fp32)
    noncontig: bool = False
    triton: bool = False  # also run by test_triton_products_match_fp64_reference


CASES = [
    Case(torch.float32, 37, 150, 40, None, False, 0.0, "default"),
    Case(torch.float32, 37, 150, 40, 15.0, True, 0.3, "default", triton=True),
    Case(torch.bfloat16, 37, 150, 40, None, False, 0.0, "default"),
    Case(torch.bfloat16, 37, 150, 40, 15.0, True, 0.3, "default"),
    Case(torch.bfloat16, 37, 150, 40, 15.0, True, 0.3, "default", noncontig=True, triton=True),
    Case(torch.bfloat16, 64, 300, 64, 15.0, True, 0.3, "default"),
    Case(torch.bfloat16, 48, 257, 48, None, True, 0.5, "default", triton=True),
    Case(torch.bfloat16, 17, 300, 64, None, False, 0.0, "default", noncontig=True),
    Case(torch.bfloat16, 1, 150, 40, None, False, 0.0, "default"),
    Case(torch.bfloat16, 1, 77, 40, 15.0, True, 0.0, "default", triton=True),
    Case(torch.float16, 37, 150, 40, None, True, 0.3, "default"),
    Case(torch.float16, 33, 131, 24, None, False, 0.0, "default", noncontig=True, triton=True),
    Case(torch.float16, 33, 131, 24, 15.0, True, 0.2, "default", noncontig=True),
    Case(torch.float32, 64, 300, 64, 15.0, True, 1.0, "default"),
    Case(torch.float32, 64, 300, 64, None, True, 1.0, "default", triton=True),
    Case(torch.bfloat16, 37, 150, 40, 15.0, False, 0.3, "exact"),
    Case(torch.bfloat16, 37, 150, 40, 15.0, True, 0.3, "exact"),
    Case(torch.bfloat16, 37, 150, 40, None, True, 0.0, "exact", noncontig=True),
    Case(torch.float16, 33, 131, 24, 15.0, False, 0.0, "exact"),
    Case(torch.bfloat16, 1, 77, 40, 15.0, True, 0.0, "exact"),
    Case(torch.float32, 37, 150, 40, None, True, 0.3, "exact"),
]
TRITON_CASES = [case for case in CASES if case.triton]


def _case_id(case):
    return (f"{str(case.dtype).split('.')[-1]}-{case.n}x{case.v}x{case.d}-cap{case.softcap}-bias{int(case.bias)}"
            f"-ign{case.ignore_frac}-{case.mode}{'-noncontig' if case.noncontig else ''}")


def check_case(case, device, products="cublas", seed=0):
    e, c, targets, b = make_inputs(case.n, case.v, case.d, case.dtype, device, ignore_frac=case.ignore_frac,
                                   bias=case.bias, seed=seed, noncontig=case.noncontig)
    grad_rows = mean_grad_rows(targets)
    exact = case.mode == "exact"
    lse, tgt, (de, dc, db) = run_kernels(e, c, targets, b, grad_rows, softcap=case.softcap,
                                         opts=CCEOptions(exact=exact, products=products))
    lse_r, tgt_r, de_r, dc_r, db_r = reference(e, c, targets, b, grad_rows, case.softcap)
    valid = (targets != IGNORE).cpu()
    assert lse.shape == (case.n,) and lse.dtype == torch.float32 and tgt.shape == (case.n,)
    assert torch.isfinite(lse).all() and torch.isfinite(tgt).all()
    if valid.any():
        assert rel(lse.cpu()[valid], lse_r[valid]) < LSE_TOL
        assert rel(tgt.cpu()[valid], tgt_r[valid]) < LSE_TOL
    assert de.dtype == e.dtype and de.shape == e.shape
    assert dc.dtype == c.dtype and dc.shape == c.shape
    if case.bias:
        assert db.dtype == b.dtype and db.shape == b.shape
    else:
        assert db is None
    if not valid.any():
        assert de.abs().max() == 0 and dc.abs().max() == 0
        assert db is None or db.abs().max() == 0
        return
    assert (de.cpu()[~valid] == 0).all(), "ignored rows must get zero dE"
    check_grad(de, de_r, exact)
    check_grad(dc, dc_r, exact)
    if case.bias:
        check_grad(db, db_r, exact)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("device", DEVICES)
def test_matches_fp64_reference(case, device):
    """The default options: cuBLAS products."""
    _device_ok(device)
    check_case(case, device)


def _count_triton_products(monkeypatch):
    calls = []
    for name in ("grad_e", "grad_c"):
        original = getattr(_products, name)
        monkeypatch.setattr(_products, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    return calls


@pytest.mark.parametrize("case", TRITON_CASES, ids=_case_id)
@pytest.mark.parametrize("device", DEVICES)
def test_triton_products_match_fp64_reference(case, device, monkeypatch):
    """The backward with its dE / dC products in Triton (``products="triton"``, reading the device-side row count)
    meets the same fp64 checks as with cuBLAS, and really ran them (the C of these cases is aligned for the
    tensor-memory accelerator)."""
    _device_ok(device)
    calls = _count_triton_products(monkeypatch)
    check_case(case, device, products="triton")
    assert {"grad_e", "grad_c"} <= set(calls)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_products_fall_back_to_cublas(device, monkeypatch):
    """A C whose rows are not 16-byte aligned (D = 12 in bf16: 24-byte rows) cannot be read through a
    descriptor: the backward takes the cuBLAS products instead, with the same result.  Exact mode with 16-bit
    inputs always takes them (its G comes in two halves)."""
    _device_ok(device)

    def refuse(*args, **kwargs):
        pytest.fail("Triton product where the cuBLAS ones were due")

    monkeypatch.setattr(_products, "grad_e", refuse)
    monkeypatch.setattr(_products, "grad_c", refuse)
    check_case(Case(torch.bfloat16, 30, 70, 12, None, True, 0.3, "default"), device, products="triton")
    check_case(Case(torch.bfloat16, 30, 70, 16, 15.0, True, 0.3, "exact"), device, products="triton")


@pytest.mark.parametrize("opts", list(OPTION_SETS.values()), ids=list(OPTION_SETS))
@pytest.mark.parametrize("device", DEVICES)
def test_need_flags_and_no_bias(device, opts):
    _device_ok(device)
    e, c, targets, b = make_inputs(20, 70, 16, torch.bfloat16, device, bias=True)
    g = mean_grad_rows(targets)
    _, _, (de, dc, db) = run_kernels(e, c, targets, b, g, softcap=None, opts=opts,
                                     need_e=True, need_c=False, need_bias=False)
    assert dc is None and db is None and de is not None
    _, _, (de2, dc2, db2) = run_kernels(e, c, targets, b, g, softcap=None, opts=opts,
                                        need_e=False, need_c=True, need_bias=True)
    assert de2 is None and dc2 is not None and db2 is not None
    _, _, (de3, dc3, db3) = run_kernels(e, c, targets, None, g, softcap=None, opts=opts,
                                        need_e=True, need_c=True, need_bias=True)
    assert db3 is None
    _, _, nothing = run_kernels(e, c, targets, b, g, softcap=None, opts=opts,
                                need_e=False, need_c=False, need_bias=False)
    assert nothing == (None, None, None)
    _, _, de_r, dc_r, db_r = reference(e, c, targets, b, g, None)
    _, _, de_r3, dc_r3, _ = reference(e, c, targets, None, g, None)
    for got, want in ((de, de_r), (dc2, dc_r), (db2, db_r), (de3, de_r3), (dc3, dc_r3)):
        check_grad(got, want, opts.exact)


@pytest.mark.parametrize("device", DEVICES)
def test_sliced_e_view(device):
    """e as a row- and column-sliced view of a larger tensor (non-unit row stride)."""
    _device_ok(device)
    big, c, targets, _ = make_inputs(60, 90, 48, torch.bfloat16, device)
    e = big[::2, 8:40]
    c = c[:, 8:40].contiguous()
    targets = targets[::2].contiguous()
    g = mean_grad_rows(targets)
    lse, tgt, (de, dc, _) = run_kernels(e, c, targets, None, g, softcap=None)
    lse_r, _, de_r, dc_r, _ = reference(e, c, targets, None, g, None)
    assert rel(lse, lse_r) < LSE_TOL
    assert rel(de, de_r) < DEFAULT_TOL and rel(dc, dc_r) < DEFAULT_TOL


@pytest.mark.parametrize("opts", list(OPTION_SETS.values()), ids=list(OPTION_SETS))
@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch(device, opts):
    _device_ok(device)
    e = torch.randn(0, 16, device=device).to(torch.bfloat16)
    c = torch.randn(50, 16, device=device).to(torch.bfloat16)
    b = torch.randn(50, device=device).to(torch.bfloat16)
    t = torch.zeros(0, dtype=torch.int64, device=device)
    lse, tgt, (de, dc, db) = run_kernels(e, c, t, b, torch.zeros(0, device=device), softcap=None, opts=opts)
    assert lse.shape == (0,) and tgt.shape == (0,) and de.shape == (0, 16) and dc.shape == (50, 16)
    assert dc.dtype == c.dtype and db.dtype == b.dtype
    assert (dc == 0).all() and (db == 0).all()


@pytest.mark.parametrize("products", ["cublas", "triton"])
@pytest.mark.parametrize("device", DEVICES)
def test_backward_is_reproducible_and_chunking_invariant(device, products, monkeypatch):
    """The backward has no atomics: two runs agree bitwise (exact mode too).  Its row chunking
    (``options.backward_row_chunk``) and vocabulary chunking (``vocab_chunk``) only change how the products are
    cut: one block and many blocks agree to fp32 rounding (fp32 inputs); with bf16 inputs the chunked backward
    still meets the fp64 tolerances of its mode (row chunks add one rounding of dC each in default mode; exact
    mode sums dC of all row chunks in fp32)."""
    _device_ok(device)
    e, c, targets, b = make_inputs(45, 170, 24, torch.float32, device, ignore_frac=0.2, bias=True, seed=7)
    g = mean_grad_rows(targets)
    lse, *_ = K.forward(e, c, targets, b, softcap=20.0, ignore_index=IGNORE)
    e16, c16, b16 = e.bfloat16(), c.bfloat16(), b.bfloat16()
    lse16, *_ = K.forward(e16, c16, targets, b16, softcap=20.0, ignore_index=IGNORE)

    def grads(exact=False, row_chunk=0, sixteen=False):
        args = (e16, c16, targets, b16, lse16) if sixteen else (e, c, targets, b, lse)
        return K.backward(*args, g, softcap=20.0, ignore_index=IGNORE,
                          options=CCEOptions(exact=exact, products=products, backward_row_chunk=row_chunk),
                          need_e=True, need_c=True, need_bias=True)

    first, second = grads(), grads()
    for x, y in zip(first, second):
        assert torch.equal(x, y)
    # exact mode (16-bit: G in hi + lo halves through the same products) is just as reproducible
    for x, y in zip(grads(True, sixteen=True), grads(True, sixteen=True)):
        assert torch.equal(x, y)

    tuning = _backward._TUNING[TUNING_KEY]
    monkeypatch.setitem(tuning, "vocab_chunk", 1 << 20)
    whole = grads(row_chunk=0)
    monkeypatch.setitem(tuning, "vocab_chunk", 33)  # narrower than a vocabulary block, not a multiple of one
    pieces = grads(row_chunk=7)
    pieces16 = {exact: grads(exact, row_chunk=7, sixteen=True) for exact in (False, True)}
    for x, y in zip(whole, pieces):
        assert rel(y, x) < 1e-6
    _, _, de_r, dc_r, db_r = reference(e, c, targets, b, g, 20.0)
    for x, ref in zip(whole, (de_r, dc_r, db_r)):
        assert rel(x, ref) < 1e-5
    _, _, de_r, dc_r, db_r = reference(e16, c16, targets, b16, g, 20.0)
    for exact, got in pieces16.items():
        for x, ref in zip(got, (de_r, dc_r, db_r)):
            assert x.dtype == torch.bfloat16
            check_grad(x, ref, exact)


@pytest.mark.parametrize("products", ["cublas", "triton"])
@pytest.mark.parametrize("device", DEVICES)
def test_targets_outside_the_vocabulary_read_nothing(device, products):
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
    lse, tgt, (de, dc, _) = run_kernels(e, c, targets, None, g, softcap=None, opts=CCEOptions(products=products),
                                        need_bias=False)
    t = targets.cpu()
    counted = t != IGNORE
    here = (t >= 0) & (t < v)
    lse_r, grad = softmax_grad_reference(e, c, targets, g)
    assert torch.isfinite(lse).all()
    assert rel(lse.cpu()[counted], lse_r[counted]) < LSE_TOL
    logits = e.double().cpu() @ c.double().cpu().T
    assert rel(tgt.cpu()[here], logits[here.nonzero()[:, 0], t[here]]) < LSE_TOL
    assert rel(de, grad @ c.double().cpu()) < 1e-5
    assert rel(dc, grad.T @ e.double().cpu()) < 1e-5


@pytest.mark.parametrize("products", ["cublas", "triton"])
@pytest.mark.parametrize("device", DEVICES)
def test_backward_skips_ignored_rows_keeps_eager_nan_pattern(device, products):
    """The backward's recompute skips whole row blocks of ignored rows (compacted on the device) and partly
    ignored blocks alike; the gradients still match the fp64 reference.  NaN lands where eager's log-softmax
    backward puts it through 0 * NaN: an ignored row of E holding a NaN -> dE of that row and all of dC / dbias;
    a NaN in C with every row ignored -> everything (each row's log-sum-exp is NaN).  ``products``: the dE / dC
    products (cuBLAS, or the Triton ones that skip the ignored rows too)."""
    _device_ok(device)
    n, v, d = 53, 150, 24
    e, c, targets, b = make_inputs(n, v, d, torch.float32, device, bias=True, seed=11)
    targets[10:40] = IGNORE  # whole compacted blocks of ignored rows at any block size <= 16
    g = mean_grad_rows(targets)

    def grads(e_in, c_in, targets=targets, g=g):
        return run_kernels(e_in, c_in, targets, b, g, softcap=None, opts=CCEOptions(products=products))[2]

    got = grads(e, c)
    _, _, de_r, dc_r, db_r = reference(e, c, targets, b, g, None)
    for x, ref in zip(got, (de_r, dc_r, db_r)):
        assert rel(x, ref) < 1e-5

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
    de, dc, db = grads(e, c_nan, none_counted, torch.zeros_like(g))
    assert de.isnan().all() and dc.isnan().all() and db.isnan().all()


@pytest.mark.parametrize("products", ["cublas", "triton"])
@pytest.mark.parametrize("device", DEVICES)
def test_rows_with_targets_outside_the_vocabulary_count(device, products):
    """The vocabulary-parallel loss hands each shard its local target codes: ``ignore_index`` for rows ignored
    everywhere, and a code outside [0, V) (here -2) for a row whose target another shard holds.  Such a row
    counts: the forward gives its log-sum-exp, and the backward its softmax gradient with no one-hot term (the
    recompute must not skip it).  Here ``ignore_index`` is -1, so -2 differs from it by one."""
    _device_ok(device)
    n, v, d = 40, 120, 24
    e, c, targets, _ = make_inputs(n, v, d, torch.float32, device, seed=9)
    local_ignore = -1
    codes = targets.clone()
    codes[::3] = -2  # target on another shard: counts, no one-hot here
    codes[1::5] = local_ignore  # ignored everywhere
    counted = codes != local_ignore
    g = (torch.rand(n, generator=torch.Generator().manual_seed(2)).to(device) + 0.5) * counted
    lse, _, (de, dc, _) = run_kernels(e, c, codes, None, g, softcap=None, opts=CCEOptions(products=products),
                                      ignore_index=local_ignore, need_bias=False)
    lse_r, grad = softmax_grad_reference(e, c, codes, g)
    counted = counted.cpu()
    assert rel(lse.cpu()[counted], lse_r[counted]) < LSE_TOL
    assert (lse.cpu()[~counted] == 0).all()
    assert rel(de, grad @ c.double().cpu()) < 1e-5
    assert rel(dc, grad.T @ e.double().cpu()) < 1e-5
    # had the "elsewhere" rows been skipped like ignored ones, dE would be far off: the test has teeth
    skipped = torch.where(codes == -2, local_ignore, codes)
    _, _, (de_skip, _, _) = run_kernels(e, c, skipped, None, g, softcap=None, opts=CCEOptions(products=products),
                                        ignore_index=local_ignore, need_c=False, need_bias=False)
    assert rel(de_skip, grad @ c.double().cpu()) > 1e-2


def test_pipeline_depth_fits_shared_memory():
    """fp32 operands take twice the shared memory of 16-bit ones: the backward recompute's default depth (4 stages
    of 128 x 64 + 256 x 64 tiles) fits in bf16 but would need 288 KB in fp32 (seen failing on an H200), so it is
    lowered there."""
    fit_num_stages = _launch.fit_num_stages
    assert fit_num_stages(4, 128, 256, 64, 2) == 4
    assert fit_num_stages(4, 128, 256, 64, 4) == 3
    assert fit_num_stages(3, 128, 256, 64, 4) == 3
    assert fit_num_stages(2, 512, 512, 256, 4) == 2  # never below double buffering


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
@pytest.mark.parametrize("opts", list(OPTION_SETS.values()), ids=list(OPTION_SETS))
def test_gpu_real_shapes(shape, opts):
    n, v, d = shape
    e, c, targets, _ = make_inputs(n, v, d, torch.bfloat16, "cuda", ignore_frac=0.1, logit_std=1.0)
    grad_rows = mean_grad_rows(targets)
    lse, tgt, (de, dc, _) = run_kernels(e, c, targets, None, grad_rows, softcap=None, opts=opts)
    lse_r, de_r, dc_r = _gpu_reference_grads(e, c, targets, grad_rows, None)
    valid = targets != IGNORE
    assert rel(lse[valid], lse_r[valid]) < LSE_TOL
    check_grad(de, de_r, opts.exact)
    check_grad(dc, dc_r, opts.exact)


@pytest.mark.gpu
@requires_cuda
def test_gpu_no_host_sync():
    e, c, targets, b = make_inputs(1024, 32064, 512, torch.bfloat16, "cuda", ignore_frac=0.3, bias=True)
    g = mean_grad_rows(targets)
    every = [*OPTION_SETS.values(), CCEOptions(backward_row_chunk=384)]
    for opts in every:  # compile
        run_kernels(e, c, targets, b, g, softcap=30.0, opts=opts)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for opts in every:
            run_kernels(e, c, targets, b, g, softcap=30.0, opts=opts)
    finally:
        torch.cuda.set_sync_debug_mode(0)


# ----------------------------------------------------------------------------------------------------------------
# Label smoothing: the forward's per-row logit sum, the backward's uniform term
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype, softcap, opts",
    [(torch.float32, 15.0, CCEOptions()), (torch.bfloat16, None, CCEOptions()),
     (torch.bfloat16, 15.0, CCEOptions(products="triton")), (torch.bfloat16, 15.0, CCEOptions(exact=True))],
    ids=["fp32_cap", "bf16", "bf16_cap_triton_products", "bf16_cap_exact"],
)
def test_label_smoothing_matches_fp64_reference(device, dtype, softcap, opts):
    """``F.cross_entropy(..., label_smoothing=eps)`` from the kernels: lse, target logit and logit sum of the
    forward combined as the op combines them, the backward's G with (1 - eps) on the target and eps / V on
    every entry; against fp64 autograd through materialised logits."""
    _device_ok(device)
    eps = 0.2
    e, c, targets, b = make_inputs(37, 150, 40, dtype, device, ignore_frac=0.3, bias=True, seed=7)
    lse, tgt, logit_sum, _ = K.forward(e, c, targets, b, softcap=softcap, ignore_index=IGNORE, logit_sum=True)

    e64, c64, b64 = (x.detach().double().cpu().requires_grad_() for x in (e, c, b))
    logits = F.linear(e64, c64, b64)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    valid = targets.cpu() != IGNORE
    want_sum = logits.detach().sum(dim=1)
    assert rel(logit_sum.cpu()[valid], want_sum[valid]) < LSE_TOL * 10
    assert (logit_sum.cpu()[~valid] == 0).all()
    row_loss = lse.double().cpu() - (1 - eps) * tgt.double().cpu() - eps / c.shape[0] * logit_sum.double().cpu()
    want = F.cross_entropy(logits, targets.cpu(), ignore_index=IGNORE, label_smoothing=eps)
    torch.testing.assert_close(row_loss[valid].sum() / valid.sum(), want.detach(), rtol=1e-5, atol=1e-5)

    want.backward()
    grads = K.backward(e, c, targets, b, lse, mean_grad_rows(targets), softcap=softcap, ignore_index=IGNORE,
                       options=opts, need_e=True, need_c=True, need_bias=True, label_smoothing=eps)
    for got, ref in zip(grads, (e64.grad, c64.grad, b64.grad)):
        check_grad(got, ref, opts.exact and dtype != torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opts", [CCEOptions(), CCEOptions(products="triton"), CCEOptions(exact=True)],
                         ids=["cublas", "triton_products", "exact"])
def test_log_sum_exp_used_beyond_the_loss(device, opts):
    """A z-loss reads every row's lse, ignored rows too (``every_row``), and its gradient h_n enters G as
    ``(g_n + h_n) * softmax``; against fp64 autograd of ``sum(g * row_loss) + sum(h * lse)``."""
    _device_ok(device)
    e, c, targets, b = make_inputs(37, 150, 40, torch.bfloat16, device, ignore_frac=0.3, bias=True, seed=11)
    lse, tgt, *_ = K.forward(e, c, targets, b, softcap=15.0, ignore_index=IGNORE, every_row=True)
    e64, c64, b64 = (x.detach().double().cpu().requires_grad_() for x in (e, c, b))
    logits = 15.0 * torch.tanh(F.linear(e64, c64, b64) / 15.0)
    want_lse = torch.logsumexp(logits, dim=1)
    assert rel(lse.cpu(), want_lse.detach()) < LSE_TOL  # ignored rows included
    grad_rows = mean_grad_rows(targets)
    grad_lse = torch.rand(37, generator=torch.Generator().manual_seed(3)).to(device) * 2e-2
    row_loss = F.cross_entropy(logits, targets.cpu(), ignore_index=IGNORE, reduction="none")
    ((row_loss * grad_rows.double().cpu()).sum() + (want_lse * grad_lse.double().cpu()).sum()).backward()
    grads = K.backward(e, c, targets, b, lse, grad_rows, softcap=15.0, ignore_index=IGNORE, options=opts,
                       need_e=True, need_c=True, need_bias=True, grad_lse=grad_lse)
    for got, ref in zip(grads, (e64.grad, c64.grad, b64.grad)):
        check_grad(got, ref, opts.exact)


# ----------------------------------------------------------------------------------------------------------------
# Entropy of the softmax: the forward's softmax-weighted mean logit, the backward's entropy term
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype, softcap, opts",
    [(torch.float32, None, CCEOptions()), (torch.bfloat16, 15.0, CCEOptions()),
     (torch.bfloat16, 15.0, CCEOptions(products="triton")), (torch.bfloat16, None, CCEOptions(exact=True))],
    ids=["fp32", "bf16_cap", "bf16_cap_triton_products", "bf16_exact"],
)
def test_entropy_matches_fp64_reference(device, dtype, softcap, opts):
    """Every row's entropy ``lse - mean_logit`` (ignored rows too: ``every_row``) and its gradient k_n entering G as
    ``p * (g_n + k_n * (mean_logit - z))``, with the loss's gradient beside it; against fp64 autograd of
    ``sum(g * row_loss) + sum(k * entropy)``.  Sharp rows (large logits) and flat rows both occur."""
    _device_ok(device)
    e, c, targets, b = make_inputs(37, 150, 40, dtype, device, ignore_frac=0.3, bias=True, seed=5)
    e = (e * torch.linspace(0.2, 3.0, 37, device=device)[:, None].to(dtype)).contiguous()  # from flat to peaked
    lse, tgt, logit_sum, mean_logit = K.forward(e, c, targets, b, softcap=softcap, ignore_index=IGNORE,
                                                mean_logit=True, every_row=True)
    assert logit_sum is None
    e64, c64, b64 = (x.detach().double().cpu().requires_grad_() for x in (e, c, b))
    logits = F.linear(e64, c64, b64)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    want_entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    assert rel((lse - mean_logit).cpu(), want_entropy.detach()) < LSE_TOL * 10
    grad_rows = mean_grad_rows(targets)
    grad_entropy = torch.randn(37, generator=torch.Generator().manual_seed(4)).to(device) * 2e-2
    row_loss = F.cross_entropy(logits, targets.cpu(), ignore_index=IGNORE, reduction="none")
    ((row_loss * grad_rows.double().cpu()).sum() + (want_entropy * grad_entropy.double().cpu()).sum()).backward()
    grads = K.backward(e, c, targets, b, lse, grad_rows, softcap=softcap, ignore_index=IGNORE, options=opts,
                       need_e=True, need_c=True, need_bias=True, grad_entropy=grad_entropy, mean_logit=mean_logit)
    for got, ref in zip(grads, (e64.grad, c64.grad, b64.grad)):
        check_grad(got, ref, opts.exact)
