"""Tests of ``kernels/_targets.py`` (``cce_inductor.kernels.count_targets``): the count of counted rows and the
balanced path's row scale, under the interpreter on CPU (and on CUDA where there is one). The range check's
device-side assert needs a GPU (the interpreter compiles no asserts): ``tests/test_cuda.py``, "out-of-range
targets"."""

import pytest
import torch

from cce_inductor import kernels as K
from tests.support.inputs import IGNORE
from tests.support.kernels import DEVICES, device_ok


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 200])
@pytest.mark.parametrize("mean", [True, False])
def test_count_and_scale_match_eager(device, n, mean):
    device_ok(device)
    gen = torch.Generator().manual_seed(n)
    targets = torch.randint(0, 50, (n,), generator=gen)
    targets[torch.rand(n, generator=gen) < 0.4] = IGNORE
    targets = targets.to(device)
    num_counted, row_scale = K.count_targets(targets, IGNORE, mean=mean, check_vocab=50)
    want = (targets != IGNORE).sum(dtype=torch.float32)
    assert num_counted.shape == () and row_scale.shape == ()
    assert num_counted.dtype == row_scale.dtype == torch.float32
    assert num_counted.item() == want.item()
    assert row_scale.item() == ((1.0 / want).item() if mean else 1.0)  # inf where no row counts


@pytest.mark.parametrize("device", DEVICES)
def test_other_ignore_index_and_int32_targets(device):
    device_ok(device)
    targets = torch.tensor([3, 0, 0, 7, 0, 2] * 20, dtype=torch.int32, device=device)
    num_counted, _ = K.count_targets(targets, 0, mean=False)
    assert num_counted.item() == 60
    # without check_vocab nothing is checked: a vocabulary shard sees other shards' targets as out of its range
    num_counted, _ = K.count_targets(targets, 3, mean=False)
    assert num_counted.item() == 100


@pytest.mark.parametrize("device", DEVICES)
def test_every_row_ignored_scales_to_inf(device):
    device_ok(device)
    num_counted, row_scale = K.count_targets(torch.full((130,), IGNORE, device=device), IGNORE, mean=True)
    assert num_counted.item() == 0 and row_scale.item() == float("inf")
