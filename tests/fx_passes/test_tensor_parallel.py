"""Tests of the tensor-parallel pass (``cce_inductor/fx_passes/tensor_parallel.py``), on 2 CPU processes (gloo over
127.0.0.1; the worker pair of ``tests/support/distributed.py``):

* a compiled ``ColwiseParallel`` head (bias, softcap, label shift, upcast) under ``loss_parallel``, ``fullgraph``: the
  cce backend rewrites it into ``dtensor_linear_cross_entropy``, equal to eager ``loss_parallel`` (and the pass sees
  through both spellings of the output redistribute, torch 2.11's and 2.13's);
* a site whose head operands are DTensors (``F.linear`` on a ``Shard(0)`` weight) is routed there by the main pass.

The vocabulary-parallel loss itself: ``tests/test_distributed.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import cce_inductor
from tests.support.distributed import check_task, run_selected_tasks

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
    ),
]


def _tp_graph_pass_worker(rank, world):
    """The cce backend on a ColwiseParallel head (bias, softcap, label shift, upcast) under loss_parallel,
    fullgraph: rewritten into dtensor_linear_cross_entropy, equal to eager loss_parallel."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

    n, dim, vocab = 12, 16, 51  # uneven split: 26 / 25
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, n, dim, generator=gen)
    labels = torch.randint(0, vocab, (2, n), generator=gen)
    labels[:, ::3] = -100

    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        head = nn.Linear(dim, vocab, bias=True)
        parallelize_module(head, mesh, ColwiseParallel(use_local_output=False))

        def step(h, y):
            logits = torch.tanh(head(h) / 7.0) * 7.0  # noqa: B023 - compiled and run in this iteration
            return F.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), y[:, 1:].reshape(-1))

        if compiled:
            step = torch.compile(step, backend=cce_inductor.backend, fullgraph=True)
        h = hidden.clone().requires_grad_()
        with loss_parallel():
            loss = step(h, labels)
            loss.backward()
        results.append((loss.to_local().detach(), h.grad, head.weight.grad.full_tensor(), head.bias.grad.full_tensor()))
    stats = cce_inductor.stats()
    assert stats["rewritten"] == 1 and "tensor parallel" in stats["sites"][0]["reason"], stats
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

    # Through torch 2.11 Dynamo records ColwiseParallel's output redistribute as a call of a generated function
    # named prim_redistribute (torch 2.13: a call_method); the pass must see through both (H200 run, torch 2.11).
    from cce_inductor.fx_passes.tensor_parallel import _is_noop_redistribute

    def prim_redistribute(x):
        return x

    graph = torch.fx.Graph()
    source = graph.placeholder("logits")
    as_captured = graph.call_function(prim_redistribute, (source,))
    other = graph.call_function(torch.neg, (source,))
    for node in (source, as_captured, other):
        node.meta["example_value"] = head.weight.detach()
    assert _is_noop_redistribute(as_captured) and not _is_noop_redistribute(other)


def test_tensor_parallel_graph_pass(task_results):
    check_task(task_results, "tensor_parallel_graph_pass")


def _dtensor_routing_worker(rank, world):
    """F.linear on DTensors (weight Shard(0)) + loss_parallel, compiled with the cce backend alone."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    n, dim, vocab = 16, 8, 30
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(3)
    weight = distribute_tensor(torch.randn(vocab, dim, generator=gen), mesh, [Shard(0)])
    hidden = DTensor.from_local(torch.randn(n, dim, generator=gen), mesh, [Replicate()])
    targets = torch.randint(0, vocab, (n,), generator=gen)

    def step(h, w, y):
        return F.cross_entropy(F.linear(h, w).view(-1, vocab), y)

    with loss_parallel():
        want = step(hidden, weight, targets)
        got = torch.compile(step, backend=cce_inductor.backend)(hidden, weight, targets)
    torch.testing.assert_close(got.to_local(), want.to_local(), rtol=1e-5, atol=1e-6)


def test_main_pass_routes_dtensor_sites(task_results):
    """A site whose head operands are DTensors must not become ``cce_inductor::linear_cross_entropy`` with
    DTensor arguments (the op has no sharding rule: "got mixed torch.Tensor and DTensor"); the main pass
    routes it to dtensor_linear_cross_entropy."""
    check_task(task_results, "main_pass_routes_dtensor_sites")


# name -> (worker function, extra args); test_<name> checks the outcome (tests/support/distributed.py).
_TASKS = {
    "tensor_parallel_graph_pass": (_tp_graph_pass_worker, ()),
    "main_pass_routes_dtensor_sites": (_dtensor_routing_worker, ()),
}


@pytest.fixture(scope="module")
def task_results(request, tmp_path_factory):
    """The outcome of every selected test's task, run once by the worker pair: ``name -> outcome of rank 0 / 1``."""
    return run_selected_tasks(request, tmp_path_factory, _TASKS)
