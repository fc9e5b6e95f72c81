"""Tests of the 16-bit pair sums (``kernels/_pair_sums.py``): the balanced path's dC summed over many row chunks as
``hi + lo`` against an fp64 reference; the fallback for
operands the tensor-memory accelerator cannot read (``_balanced_launch._pair_sums_into``); bf16 and fp16."""

import pytest
import torch

from cce_inductor.kernels import _balanced_launch, _pair_sums
from tests.support.compare import rel_l2
from tests.support.kernels import DEVICES, device_ok

CHUNKS = 32
# hi + lo keeps ~16 mantissa bits: after CHUNKS additions the relative error stays near 2^-16 ~ 1.5e-5, where one
# 16-bit rounding of the sum is ~1e-3 and a 16-bit running sum (a rounding per chunk) several times that
PAIR_TOL = 5e-5


def _chunks(k, m, n, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(CHUNKS):
        # uneven magnitudes across chunks, as row chunks' gradients are
        scale = float(torch.rand((), generator=gen)) * 4 + 0.1
        a = (torch.randn(k, m, generator=gen) * scale).to(dtype).to(device)
        b = torch.randn(k, n, generator=gen).to(dtype).to(device)
        yield a, b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("device", DEVICES)
def test_pair_sums_hold_the_fp64_sum_over_many_chunks(device, dtype):
    """``hi + lo`` after 32 chunks is the fp64 sum of the chunk products to ~2^-16 (a 16-bit running sum, one
    rounding per chunk, is off by far more: the bound fails for it), and ``hi`` alone is that sum rounded once: no
    further from it than the fp64 sum rounded to the 16-bit dtype, within a rounding of ties."""
    device_ok(device)
    k, m, n = (40, 48, 24) if device == "cpu" else (1100, 4160, 256)
    hi = torch.empty(m, n, dtype=dtype, device=device)
    lo = torch.empty_like(hi)
    exact = torch.zeros(m, n, dtype=torch.float64)
    plain = torch.zeros(m, n, dtype=dtype, device=device)
    for i, (a, b) in enumerate(_chunks(k, m, n, dtype, device)):
        _pair_sums.pair_product(hi, lo, a, b, accumulate=i > 0)
        product = a.double().cpu().T @ b.double().cpu()
        exact += product
        plain = (plain.float() + product.float().to(device)).to(dtype)
    pair = hi.double().cpu() + lo.double().cpu()
    assert rel_l2(pair, exact) < PAIR_TOL
    assert rel_l2(plain.cpu(), exact) > 10 * PAIR_TOL  # what the bound rules out
    assert rel_l2(hi.cpu(), exact) <= 1.001 * rel_l2(exact.to(dtype), exact) + 1e-7
    assert (lo.double().abs() <= hi.double().abs() * 2.0**-7 + 1e-30).all()  # lo is below hi's last bit


@pytest.mark.parametrize("device", DEVICES)
def test_fallback_holds_the_same_bound(device):
    """Operands the tensor-memory accelerator cannot read (a row stride not a multiple of 16 bytes) take the fp32-slab
    fallback: its pair meets the kernel's bound against the fp64 sum. (The two pairs need not agree bit for bit: their
    fp32 products sum in another order, which may move a remainder's last bit.)"""
    device_ok(device)
    k, m, n = 40, 64, 24
    chunks = list(_chunks(k, m, n, torch.bfloat16, device, seed=3))
    exact = sum(a.double().cpu().T @ b.double().cpu() for a, b in chunks)
    for name, operand in (("kernel", lambda b: b), ("fallback", lambda b: torch.nn.functional.pad(b, (0, 1))[:, :n])):
        hi = torch.empty(m, n, dtype=torch.bfloat16, device=device)
        lo = torch.empty_like(hi)
        for i, (a, b) in enumerate(chunks):
            b = operand(b)
            assert (name == "kernel") == _balanced_launch._launch.tma_ok(a, b)
            _balanced_launch._pair_sums_into(hi, lo, a, b, accumulate=i > 0, upcast=device == "cpu")
        assert rel_l2(hi.double().cpu() + lo.double().cpu(), exact) < PAIR_TOL, name


@pytest.mark.parametrize("device", DEVICES)
def test_without_lo_the_sum_rounds_once_a_chunk(device):
    """``lo`` None: the plain 16-bit sum, ``hi = round(hi + product)`` with the fp32 product and hi added before the
    one rounding (the balanced path's plain sum over its later chunks); a sum that rounds the product first (as
    cuBLAS's 16-bit ``addmm`` was seen to) is further off than the bound."""
    device_ok(device)
    k, m, n = (40, 48, 24) if device == "cpu" else (1100, 4160, 256)
    chunks = list(_chunks(k, m, n, torch.bfloat16, device, seed=5))[:4]
    hi = torch.empty(m, n, dtype=torch.bfloat16, device=device)
    once = twice = None
    for i, (a, b) in enumerate(chunks):
        _pair_sums.pair_product(hi, None, a, b, accumulate=i > 0)
        product = a.double().cpu().T @ b.double().cpu()
        once = product.bfloat16() if once is None else (once.double() + product).bfloat16()
        twice = product.bfloat16() if twice is None else (twice.double() + product.bfloat16().double()).bfloat16()
    bound = 2.0**-12  # fp32 accumulation in another order may move a tie's last bit
    assert rel_l2(hi.double().cpu(), once.double()) <= bound
    assert rel_l2(twice.double(), once.double()) > 4 * bound  # what the bound rules out


def test_split_pair_is_exact_for_a_complete_sum():
    x = torch.randn(100, 30, dtype=torch.float32)
    hi, lo = torch.empty(100, 30, dtype=torch.bfloat16), torch.empty(100, 30, dtype=torch.bfloat16)
    want = x.clone()
    _pair_sums.split_pair(x, hi, lo)
    assert torch.equal(hi, want.bfloat16())
    assert rel_l2(hi.double() + lo.double(), want.double()) < 2.0**-15
