"""Tests of the Triton gradient products (``kernels/_products.py``, the option ``products="triton"``): the Triton
cases of the kernels' case table (``tests/support/kernels.py``) meet the same fp64 checks as with the cuBLAS products
and really run them; where C cannot be read through a tensor-memory descriptor the backward falls back to the cuBLAS
products.
"""

import pytest
import torch

from cce_inductor.kernels import _products
from tests.support.kernels import DEVICES, TRITON_CASES, Case, case_id, check_case, device_ok


def _count_triton_products(monkeypatch):
    """The products each ``_products.grad_products`` launch computes ("grad_e" / "grad_c"), as they are called."""
    calls = []
    original = _products.grad_products

    def counted(*args, **kwargs):
        calls.extend(name for name, out in (("grad_e", "de32"), ("grad_c", "dc_chunk")) if kwargs.get(out) is not None)
        return original(*args, **kwargs)

    monkeypatch.setattr(_products, "grad_products", counted)
    return calls


@pytest.mark.parametrize("case", TRITON_CASES, ids=case_id)
@pytest.mark.parametrize("device", DEVICES)
def test_triton_products_match_fp64_reference(case, device, monkeypatch):
    """The backward with its dE / dC products in Triton (``products="triton"``, reading the device-side row count)
    meets the same fp64 checks as with cuBLAS, and really ran them (the C of these cases is aligned for the
    tensor-memory accelerator)."""
    device_ok(device)
    calls = _count_triton_products(monkeypatch)
    check_case(case, device, products="triton")
    assert {"grad_e", "grad_c"} <= set(calls)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_products_fall_back_to_cublas(device, monkeypatch):
    """A C whose rows are not 16-byte aligned (D = 12 in bf16: 24-byte rows) cannot be read through a
    descriptor: the backward takes the cuBLAS products instead, with the same result."""
    device_ok(device)

    def refuse(*args, **kwargs):
        pytest.fail("Triton product where the cuBLAS ones were due")

    monkeypatch.setattr(_products, "grad_products", refuse)
    check_case(Case(torch.bfloat16, 30, 70, 12, None, True, 0.3, "default"), device, products="triton")
