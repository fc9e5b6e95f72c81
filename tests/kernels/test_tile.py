"""Tests of the device helpers every kernel shares (``kernels/_tile.py``): TF32 rounding, and the fp32 dots it
serves where the user allowed TF32 for matmuls. Without CUDA the kernels run in the Triton interpreter (the
rounding is bit arithmetic, the same there); with CUDA on the GPU too."""

import pytest
import torch
import triton
import triton.language as tl

import cce_inductor.kernels as K
from cce_inductor.kernels._tile import round_to_tf32
from tests.support.kernels import DEVICES, device_ok


@triton.jit
def _round_kernel(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(Y + offs, round_to_tf32(tl.load(X + offs, mask=mask)), mask=mask)


def _tf32_reference(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest TF32, ties away from zero, in int64 bit arithmetic (no NaN here)."""
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    rounded = ((bits + 0x1000) & 0xFFFFE000).to(torch.int32)  # (wraps only for NaN payloads, not given here)
    return rounded.view(torch.float32)


@pytest.fixture
def allow_tf32():
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    yield
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("device", DEVICES)
def test_round_to_tf32_is_round_to_nearest_ties_away(device):
    device_ok(device)
    one = 1.0
    special = [
        one,
        one + 2**-11,
        one + 2**-11 + 2**-20,
        one + 2**-12,
        -(one + 2**-11),
        one - 2**-12,
        0.0,
        -0.0,
        float("inf"),
        float("-inf"),
        3.4028234663852886e38,
        1e-40,
        -1e-40,
    ]
    want_special = [
        one,
        one + 2**-10,
        one + 2**-10,
        one,
        -(one + 2**-10),
        one,
        0.0,
        -0.0,
        float("inf"),
        float("-inf"),
        float("inf"),
        None,
        None,
    ]
    x = torch.cat([torch.tensor(special), torch.randn(4000, generator=torch.Generator().manual_seed(0)) * 30])
    x = x.to(device)
    y = torch.empty_like(x)
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    assert torch.equal(y.view(torch.int32), _tf32_reference(x).view(torch.int32))
    for got, want in zip(y[: len(special)].tolist(), want_special):
        if want is not None:
            assert got == want
    assert (y.view(torch.int32) & 0x1FFF == 0).all()  # 10 mantissa bits left
    nan = torch.full((4,), float("nan"), device=device)
    _round_kernel[(1,)](nan, y, 4, BLOCK=1024)
    assert y[:4].isnan().all()


@pytest.mark.parametrize("device", DEVICES)
def test_fp32_forward_at_tf32_sees_rounded_operands(device, allow_tf32):
    """With TF32 allowed, the forward's log-sum-exp and target logit are those of the operands rounded to TF32
    (the tiles' dots and the target kernel alike), not of the fp32 operands: TF32 products of rounded operands
    are exact in fp32, so only the summation order is left between the kernels and an fp64 reference."""
    device_ok(device)
    gen = torch.Generator().manual_seed(1)
    n, d, v = 37, 96, 300
    e = (torch.randn(n, d, generator=gen) * 2).to(device)
    c = (torch.randn(v, d, generator=gen) / d**0.5).to(device)
    targets = torch.randint(0, v, (n,), generator=gen).to(device)
    stats = K.forward(e, c, targets, None, softcap=None, ignore_index=-100)

    def logits(e_, c_):
        return e_.double() @ c_.double().T

    rounded = logits(_tf32_reference(e.cpu()), _tf32_reference(c.cpu()))
    exact = logits(e.cpu(), c.cpu())
    rows = torch.arange(n)
    for ref, close in ((rounded, True), (exact, False)):
        lse_err = (stats.lse.cpu().double() - torch.logsumexp(ref, -1)).abs().max().item()
        target_err = (stats.target_logit.cpu().double() - ref[rows, targets.cpu()]).abs().max().item()
        if close:
            assert lse_err < 2e-6 and target_err < 2e-6, (lse_err, target_err)
        else:  # the rounding is visible: the test would fail on unrounded operands
            assert max(lse_err, target_err) > 1e-4, (lse_err, target_err)
