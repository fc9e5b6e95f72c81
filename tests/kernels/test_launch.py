"""Tests of the kernels' host-side launch helpers (``kernels/_launch.py``)."""

import pytest
import torch

from cce_inductor.kernels import _launch


@pytest.fixture
def restore_matmul_precision():
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize(("precision", "fp32_dots"), [("highest", "ieee"), ("high", "tf32_rn"), ("medium", "tf32_rn")])
def test_fp32_dots_follow_torchs_matmul_precision(restore_matmul_precision, precision, fp32_dots):
    """fp32 operands are multiplied as torch's CUDA matmuls are: IEEE at "highest" (the default), TF32 with the
    operands rounded to nearest (as cuBLAS rounds them) where the user allowed TF32 for cuBLAS, so a fp32 loss is
    not run on the CUDA cores while torch.compile's matmuls of it run on the tensor cores. 16-bit operands are
    unaffected."""
    torch.set_float32_matmul_precision(precision)
    assert _launch.dot_precision(torch.float32) == fp32_dots
    assert _launch.dot_precision(torch.bfloat16) == _launch.dot_precision(torch.float16) == "tf32"


def test_fp32_dots_follow_the_cuda_matmul_flag(restore_matmul_precision):
    """The per-backend switch decides, as it does for cuBLAS (``torch.backends.cuda.matmul``)."""
    torch.backends.cuda.matmul.allow_tf32 = True
    assert _launch.dot_precision(torch.float32) == "tf32_rn"
    torch.backends.cuda.matmul.allow_tf32 = False
    assert _launch.dot_precision(torch.float32) == "ieee"


def test_pipeline_depth_fits_shared_memory():
    """fp32 operands take twice the shared memory of 16-bit ones: the backward recompute's default depth (4 stages
    of 128 x 64 + 256 x 64 tiles) fits in bf16 but not in fp32, where the pipeline keeps a buffer pair per stage
    (TF32 dots: 3 stages asked for 3 x 96 KB on an H100; IEEE dots: 4 stages asked for 288 KB on an H200), so it
    is lowered there to double buffering."""
    fit_num_stages = _launch.fit_num_stages
    assert fit_num_stages(4, 128, 256, 64, 2) == 4  # the 16-bit tunings keep their depth
    assert fit_num_stages(3, 128, 256, 64, 2) == 3
    assert fit_num_stages(4, 128, 128, 64, 2) == 4
    assert fit_num_stages(4, 128, 256, 64, 4) == 2
    assert fit_num_stages(3, 128, 256, 64, 4) == 2
    assert fit_num_stages(4, 128, 128, 64, 4) == 3  # the Triton products' tiles in fp32: 3 x 64 KB
    assert fit_num_stages(2, 512, 512, 256, 4) == 2  # never below double buffering


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_poison_is_zero_for_finite_inputs_and_nan_for_any_nonfinite(dtype):
    c = torch.randn(50, 8).to(dtype)
    e = torch.randn(6, 8).to(dtype)
    bias = torch.full((50,), 60000.0).to(dtype)  # finite, but its fp16 sum is not: the bias is summed in fp32
    assert _launch.weight_poison(c, None).item() == 0.0
    assert _launch.weight_poison(c, bias).item() == 0.0
    assert torch.equal(_launch.nonfinite_rows(e), torch.zeros(6))
    e[2, 3], c[7, 1] = float("inf"), float("nan")
    rows = _launch.nonfinite_rows(e)
    assert rows.dtype == torch.float32 and torch.isnan(rows[2]) and (rows[torch.arange(6) != 2] == 0).all()
    assert torch.isnan(_launch.weight_poison(c, None))
    c[7, 1] = 0.0
    c[4, 0] = float("-inf")
    assert torch.isnan(_launch.weight_poison(c, None))
    c[4, 0] = 0.0
    bias[3] = float("-inf")
    assert torch.isnan(_launch.weight_poison(c, bias))
    assert _launch.weight_poison(c[:0], None).item() == 0.0


@pytest.mark.parametrize("products", [torch.float16, torch.bfloat16])
def test_poison_of_a_wider_head_is_that_of_its_conversion(products):
    """Autocast converts an fp32 head to the products' dtype: an entry finite in fp32 but past the products' range
    becomes inf there, and eager's logits hold NaN / inf in every row."""
    c = torch.randn(50, 8)
    big = min(torch.finfo(products).max * 1.01, torch.finfo(torch.float32).max)  # finite in fp32, inf converted
    bias = torch.zeros(50)
    assert _launch.weight_poison(c, bias, products).item() == 0.0
    c[9, 5] = -big
    assert torch.isinf(c.to(products)).any()
    assert _launch.weight_poison(c, None).item() == 0.0  # fp32 products: finite
    assert torch.isnan(_launch.weight_poison(c, None, products))
    c[9, 5] = 0.0
    bias[1] = big
    assert _launch.weight_poison(c, bias).item() == 0.0
    assert torch.isnan(_launch.weight_poison(c, bias, products))
