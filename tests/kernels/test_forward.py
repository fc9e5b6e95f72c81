"""Tests of ``cce_inductor.kernels.forward`` (``kernels/_forward.py``), and of the backward fed by its row statistics,
against an fp64 PyTorch reference with materialised logits (the harness and its tolerances:
``tests/support/kernels.py``). Without CUDA the kernels run in the Triton interpreter; with CUDA on the GPU too.

* parity with fp64 over a case table: fp32 / bf16 / fp16, softcap, bias, ignored rows (some, none, all), N not a
  multiple of the row block, N = 1, V not a multiple of the vocabulary block, a non-contiguous E; exact mode's
  contract, no more error than eager's in the input dtype (the same table with the Triton products:
  ``test_products.py``);
* a sliced view of E, an empty batch;
* targets outside ``[0, V)`` other than ``ignore_index`` count with no one-hot term (how the vocabulary-parallel
  loss passes "target on another shard") and read nothing outside C;
* the forward's optional row statistics and the backward terms they feed: each row's logit sum (label smoothing),
  every row's log-sum-exp (a z-loss), the softmax-weighted mean logit (the entropy).
"""

import pytest
import torch
import torch.nn.functional as F

import cce_inductor.kernels as K
from cce_inductor import CCEOptions
from tests.support.inputs import IGNORE, make_kernel_inputs
from tests.support.kernels import (
    CASES,
    DEFAULT_TOL,
    DEVICES,
    LSE_TOL,
    OPTION_SETS,
    case_id,
    check_case,
    check_grad,
    device_ok,
    eager_grads,
    mean_grad_rows,
    reference,
    rel,
    run_kernels,
)
from tests.support.kernels import backward as kbackward


def softmax_grad_reference(e, c, targets, grad_rows):
    """fp64 G = g * (softmax - onehot), no bias / softcap; a target outside [0, V) has no one-hot term (the row
    still counts: set its ``grad_rows`` to 0 to drop it).  Returns lse, G."""
    logits = e.double().cpu() @ c.double().cpu().T
    grad = torch.softmax(logits, dim=-1)
    t = targets.cpu()
    here = (t >= 0) & (t < c.shape[0])
    grad[here.nonzero()[:, 0], t[here]] -= 1.0
    return torch.logsumexp(logits, dim=-1), grad * grad_rows.double().cpu()[:, None]


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("device", DEVICES)
def test_matches_fp64_reference(case, device):
    """The default options: cuBLAS products."""
    device_ok(device)
    check_case(case, device)


@pytest.mark.parametrize("device", DEVICES)
def test_sliced_e_view(device):
    """e as a row- and column-sliced view of a larger tensor (non-unit row stride)."""
    device_ok(device)
    big, c, targets, _ = make_kernel_inputs(60, 90, 48, torch.bfloat16, device)
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
    device_ok(device)
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
def test_rows_with_targets_outside_the_vocabulary_count(device, products):
    """The vocabulary-parallel loss hands each shard its local target codes: ``ignore_index`` for rows ignored
    everywhere, and a code outside [0, V) (here -2) for a row whose target another shard holds.  Such a row
    counts: the forward gives its log-sum-exp, and the backward its softmax gradient with no one-hot term (the
    recompute must not skip it).  Here ``ignore_index`` is -1, so -2 differs from it by one."""
    device_ok(device)
    n, v, d = 40, 120, 24
    e, c, targets, _ = make_kernel_inputs(n, v, d, torch.float32, device, seed=9)
    local_ignore = -1
    codes = targets.clone()
    codes[::3] = -2  # target on another shard: counts, no one-hot here
    codes[1::5] = local_ignore  # ignored everywhere
    counted = codes != local_ignore
    g = (torch.rand(n, generator=torch.Generator().manual_seed(2)).to(device) + 0.5) * counted
    lse, _, (de, dc, _) = run_kernels(
        e,
        c,
        codes,
        None,
        g,
        softcap=None,
        opts=CCEOptions(products=products),
        ignore_index=local_ignore,
        need_bias=False,
    )
    lse_r, grad = softmax_grad_reference(e, c, codes, g)
    counted = counted.cpu()
    assert rel(lse.cpu()[counted], lse_r[counted]) < LSE_TOL
    assert (lse.cpu()[~counted] == 0).all()
    assert rel(de, grad @ c.double().cpu()) < 1e-5
    assert rel(dc, grad.T @ e.double().cpu()) < 1e-5
    # had the "elsewhere" rows been skipped like ignored ones, dE would be far off: the test has teeth
    skipped = torch.where(codes == -2, local_ignore, codes)
    _, _, (de_skip, _, _) = run_kernels(
        e,
        c,
        skipped,
        None,
        g,
        softcap=None,
        opts=CCEOptions(products=products),
        ignore_index=local_ignore,
        need_c=False,
        need_bias=False,
    )
    assert rel(de_skip, grad @ c.double().cpu()) > 1e-2


@pytest.mark.parametrize("products", ["cublas", "triton"])
@pytest.mark.parametrize("device", DEVICES)
def test_targets_outside_the_vocabulary_read_nothing(device, products):
    """A vocabulary shard sees targets outside [0, V) for rows whose target another shard holds (the
    vocabulary-parallel loss passes -2): such rows have no one-hot term and no kernel may read C[target].
    C is a view between NaN rows, so a stray read shows up as NaN (on the GPU it was an illegal address)."""
    device_ok(device)
    n, v, d = 24, 90, 16
    e, c_full, targets, _ = make_kernel_inputs(n, v + 8, d, torch.float32, device, seed=4)
    c_full[:4] = float("nan")
    c_full[-4:] = float("nan")
    c = c_full[4:-4]
    targets = targets.clamp(max=v - 1)
    targets[::3] = -2
    targets[1::5] = v + 2
    targets[2::7] = IGNORE
    g = torch.rand(n, generator=torch.Generator().manual_seed(1)).to(device) * (targets != IGNORE)
    lse, tgt, (de, dc, _) = run_kernels(
        e, c, targets, None, g, softcap=None, opts=CCEOptions(products=products), need_bias=False
    )
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


# ----------------------------------------------------------------------------------------------------------------
# Label smoothing: the forward's per-row logit sum, the backward's uniform term
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype, softcap, opts",
    [
        (torch.float32, 15.0, CCEOptions()),
        (torch.bfloat16, None, CCEOptions()),
        (torch.bfloat16, 15.0, CCEOptions(products="triton")),
        (torch.bfloat16, 15.0, CCEOptions(exact=True)),
    ],
    ids=["fp32_cap", "bf16", "bf16_cap_triton_products", "bf16_cap_exact"],
)
def test_label_smoothing_matches_fp64_reference(device, dtype, softcap, opts):
    """``F.cross_entropy(..., label_smoothing=eps)`` from the kernels: lse, target logit and logit sum of the
    forward combined as the op combines them, the backward's G with (1 - eps) on the target and eps / V on
    every entry; against fp64 autograd through materialised logits (in exact mode, no more error than eager's in
    the input dtype too)."""
    device_ok(device)
    eps = 0.2
    e, c, targets, b = make_kernel_inputs(37, 150, 40, dtype, device, ignore_frac=0.3, bias=True, seed=7)
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
    grads = kbackward(
        e,
        c,
        targets,
        b,
        lse,
        mean_grad_rows(targets),
        softcap=softcap,
        ignore_index=IGNORE,
        opts=opts,
        need_e=True,
        need_c=True,
        need_bias=True,
        label_smoothing=eps,
    )
    eager = eager_grads(e, c, targets, b, softcap, label_smoothing=eps) if opts.exact else (None, None, None)
    for got, ref, bound in zip(grads, (e64.grad, c64.grad, b64.grad), eager):
        check_grad(got, ref, bound)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opts", [CCEOptions(), CCEOptions(products="triton")], ids=["cublas", "triton_products"])
def test_log_sum_exp_used_beyond_the_loss(device, opts):
    """A z-loss reads every row's lse, ignored rows too (``every_row``), and its gradient h_n enters G as
    ``(g_n + h_n) * softmax``; against fp64 autograd of ``sum(g * row_loss) + sum(h * lse)``."""
    device_ok(device)
    e, c, targets, b = make_kernel_inputs(37, 150, 40, torch.bfloat16, device, ignore_frac=0.3, bias=True, seed=11)
    lse, tgt, *_ = K.forward(e, c, targets, b, softcap=15.0, ignore_index=IGNORE, every_row=True)
    e64, c64, b64 = (x.detach().double().cpu().requires_grad_() for x in (e, c, b))
    logits = 15.0 * torch.tanh(F.linear(e64, c64, b64) / 15.0)
    want_lse = torch.logsumexp(logits, dim=1)
    assert rel(lse.cpu(), want_lse.detach()) < LSE_TOL  # ignored rows included
    grad_rows = mean_grad_rows(targets)
    grad_lse = torch.rand(37, generator=torch.Generator().manual_seed(3)).to(device) * 2e-2
    row_loss = F.cross_entropy(logits, targets.cpu(), ignore_index=IGNORE, reduction="none")
    ((row_loss * grad_rows.double().cpu()).sum() + (want_lse * grad_lse.double().cpu()).sum()).backward()
    grads = kbackward(
        e,
        c,
        targets,
        b,
        lse,
        grad_rows,
        softcap=15.0,
        ignore_index=IGNORE,
        opts=opts,
        need_e=True,
        need_c=True,
        need_bias=True,
        grad_lse=grad_lse,
    )
    for got, ref in zip(grads, (e64.grad, c64.grad, b64.grad)):
        check_grad(got, ref)


# ----------------------------------------------------------------------------------------------------------------
# Entropy of the softmax: the forward's softmax-weighted mean logit, the backward's entropy term
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype, softcap, opts",
    [
        (torch.float32, None, CCEOptions()),
        (torch.bfloat16, 15.0, CCEOptions()),
        (torch.bfloat16, 15.0, CCEOptions(products="triton")),
        (torch.bfloat16, None, CCEOptions()),
    ],
    ids=["fp32", "bf16_cap", "bf16_cap_triton_products", "bf16"],
)
def test_entropy_matches_fp64_reference(device, dtype, softcap, opts):
    """Every row's entropy ``lse - mean_logit`` (ignored rows too: ``every_row``) and its gradient k_n entering G as
    ``p * (g_n + k_n * (mean_logit - z))``, with the loss's gradient beside it; against fp64 autograd of
    ``sum(g * row_loss) + sum(k * entropy)``.  Sharp rows (large logits) and flat rows both occur."""
    device_ok(device)
    e, c, targets, b = make_kernel_inputs(37, 150, 40, dtype, device, ignore_frac=0.3, bias=True, seed=5)
    e = (e * torch.linspace(0.2, 3.0, 37, device=device)[:, None].to(dtype)).contiguous()  # from flat to peaked
    lse, tgt, logit_sum, mean_logit = K.forward(
        e, c, targets, b, softcap=softcap, ignore_index=IGNORE, mean_logit=True, every_row=True
    )
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
    grads = kbackward(
        e,
        c,
        targets,
        b,
        lse,
        grad_rows,
        softcap=softcap,
        ignore_index=IGNORE,
        opts=opts,
        need_e=True,
        need_c=True,
        need_bias=True,
        grad_entropy=grad_entropy,
        mean_logit=mean_logit,
    )
    for got, ref in zip(grads, (e64.grad, c64.grad, b64.grad)):
        check_grad(got, ref)
