"""Tests of the kernels' host-side launch helpers (``kernels/_launch.py``)."""

from cce_inductor.kernels import _launch


def test_pipeline_depth_fits_shared_memory():
    """fp32 operands take twice the shared memory of 16-bit ones: the backward recompute's default depth (4 stages
    of 128 x 64 + 256 x 64 tiles) fits in bf16 but would need 288 KB in fp32 (seen failing on an H200), so it is
    lowered there."""
    fit_num_stages = _launch.fit_num_stages
    assert fit_num_stages(4, 128, 256, 64, 2) == 4
    assert fit_num_stages(4, 128, 256, 64, 4) == 3
    assert fit_num_stages(3, 128, 256, 64, 4) == 3
    assert fit_num_stages(2, 512, 512, 256, 4) == 2  # never below double buffering
