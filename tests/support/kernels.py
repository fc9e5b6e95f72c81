"""The kernel tests' harness: devices, option sets, the fp64 reference with materialised logits, the case table and
its check (``tests/kernels``).

On a machine without CUDA the kernels run in the Triton interpreter (``TRITON_INTERPRET=1``, set by
``tests/conftest.py`` before the kernels are imported) at tiny shapes with the kernels' tiny ``"interpret"`` block
sizes. With CUDA the same checks run on the GPU too (``DEVICES``).

Tolerances (relative L2 error against fp64 computed from the same, already rounded, inputs): log-sum-exp and
target logit 1e-5.  Gradients 1e-2 (no gradient is filtered; the softmax gradient G is rounded once to the input
dtype before the products, as eager PyTorch rounds the logits' gradient: ~4e-3 in bf16).

Exact mode (``exact=True``) is the lean path, these kernels with nothing changed; its contract is gradients with
no more error than torch.compile's.  The table's 16-bit "exact" cases hold the kernels to it: besides the 1e-2,
each gradient's error against the fp64 reference is at most that of eager PyTorch in the input dtype
(``tests.support.reference.eager_loss``, whose logits, log-softmax and their gradient are rounded to it) from the
same inputs.
"""

from typing import NamedTuple

import pytest
import torch

import cce_inductor.kernels as K
from cce_inductor import CCEOptions, _planning
from cce_inductor.kernels import _layout

from .compare import rel_l2
from .inputs import IGNORE, make_kernel_inputs
from .reference import eager_loss, run_fresh

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
DEFAULT_TOL = 1e-2
LSE_TOL = 1e-5
# the cuBLAS products, the Triton products (exact mode runs the kernels as the default options do)
OPTION_SETS = {
    "cublas": CCEOptions(products="cublas"),
    "triton": CCEOptions(products="triton"),
}
TUNING_KEY = "interpret" if K.INTERPRET else "gpu"  # the block sizes the kernels use here
LEAN_LAYOUT = _layout.LEAN_LAYOUT[TUNING_KEY]  # the lean G block's layout here (tests monkeypatch its entries)

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


def device_ok(device):
    """Skip where ``device`` cannot run the kernels here."""
    if device == "cpu" and not K.INTERPRET:
        pytest.skip("CPU tensors need the Triton interpreter (run without CUDA)")
    if device == "cuda" and not HAS_CUDA:
        pytest.skip("needs CUDA")


def rel(got, ref):
    """Relative L2 error of ``got`` (which must be finite) against ``ref``, in fp64 on the CPU."""
    assert torch.isfinite(got).all(), "non-finite values"
    return rel_l2(got.cpu(), ref.cpu())


def check_grad(out, ref, eager=None):
    """A gradient against fp64: the tolerance, and where ``eager`` (the same gradient from eager PyTorch in the
    input dtype) is given, no more error than eager's: exact mode's contract (module docstring)."""
    assert rel(out, ref) < DEFAULT_TOL
    if eager is not None:
        assert rel(out, ref) <= rel(eager, ref)


def eager_grads(e, c, targets, bias, softcap, **kwargs):
    """``(dE, dC, dbias)`` of eager PyTorch's mean loss in the inputs' dtype (``kwargs``: ``eager_loss``'s), on the
    inputs' device: the error that exact mode's gradients must not exceed."""
    return run_fresh(eager_loss, e, c, targets, bias, softcap=softcap, ignore_index=IGNORE, **kwargs)[1:]


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
    """``grad_rows`` of a mean over the rows that count."""
    valid = targets != IGNORE
    return valid.float() / valid.sum().clamp(min=1).float()


def plan_for(e, c, opts=None, *, counted_hint=None):
    """The kernels' backward plan for ``opts`` (:class:`CCEOptions`): ``products`` "auto" / "cublas" with a
    ``counted_hint`` is the counted prefix, without one cuBLAS over every row; "triton" the row-skipping products
    (widened by the hint where given)."""
    opts = opts or CCEOptions()
    products = "triton" if opts.products == "triton" else "counted_prefix" if counted_hint is not None else "cublas"
    return _planning.backward_plan(
        e.shape[0],
        c.shape[0],
        products=products,
        backward_row_chunk=opts.backward_row_chunk,
        counted_hint=counted_hint,
        row_skipping=K.row_skipping_ok(e, c),
    )


def backward(
    e,
    c,
    targets,
    bias,
    lse,
    grad_rows,
    *,
    softcap,
    opts=None,
    counted_hint=None,
    ignore_index=IGNORE,
    need_e=True,
    need_c=True,
    need_bias=True,
    **more,
):
    """``K.backward`` with the plan of ``opts`` (:func:`plan_for`)."""
    plan = plan_for(e, c, opts, counted_hint=counted_hint)
    return K.backward(
        e,
        c,
        targets,
        bias,
        lse,
        grad_rows,
        softcap=softcap,
        ignore_index=ignore_index,
        need_e=need_e,
        need_c=need_c,
        need_bias=need_bias,
        **plan._asdict(),
        **more,
    )


def run_kernels(
    e, c, targets, bias, grad_rows, *, softcap, opts=None, ignore_index=IGNORE, need_e=True, need_c=True, need_bias=True
):
    """``K.forward`` then ``K.backward``: (lse, target logit, (dE, dC, dbias))."""
    lse, tgt, *_ = K.forward(e, c, targets, bias, softcap=softcap, ignore_index=ignore_index)
    grads = backward(
        e,
        c,
        targets,
        bias,
        lse,
        grad_rows,
        softcap=softcap,
        ignore_index=ignore_index,
        opts=opts,
        need_e=need_e,
        need_c=need_c,
        need_bias=need_bias,
    )
    return lse, tgt, grads


class Case(NamedTuple):
    dtype: torch.dtype
    n: int
    v: int
    d: int
    softcap: float | None
    bias: bool
    ignore_frac: float
    mode: str  # "default" or "exact" (16-bit inputs: no more error than eager's in their dtype too)
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
]
TRITON_CASES = [case for case in CASES if case.triton]


def case_id(case):
    return (
        f"{str(case.dtype).split('.')[-1]}-{case.n}x{case.v}x{case.d}-cap{case.softcap}-bias{int(case.bias)}"
        f"-ign{case.ignore_frac}-{case.mode}{'-noncontig' if case.noncontig else ''}"
    )


def check_case(case, device, products="cublas", seed=0):
    """One case of the table against the fp64 reference: the forward's row statistics and the gradients (zero for
    ignored rows; all zero when every row is ignored)."""
    e, c, targets, b = make_kernel_inputs(
        case.n,
        case.v,
        case.d,
        case.dtype,
        device,
        ignore_frac=case.ignore_frac,
        bias=case.bias,
        seed=seed,
        noncontig=case.noncontig,
    )
    grad_rows = mean_grad_rows(targets)
    lse, tgt, (de, dc, db) = run_kernels(
        e, c, targets, b, grad_rows, softcap=case.softcap, opts=CCEOptions(products=products)
    )
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
    eager = eager_grads(e, c, targets, b, case.softcap) if case.mode == "exact" else (None, None, None)
    check_grad(de, de_r, eager[0])
    check_grad(dc, dc_r, eager[1])
    if case.bias:
        check_grad(db, db_r, eager[2])
