"""Run a loss with a random upstream gradient, compare two runs, measure a relative error, compile with Inductor's
caches off.

A comparison wants the same shape (and dtype), NaN and +-Inf at the same places, and the finite values close:
elementwise (``rtol`` / ``atol``), or for gradients in relative L2 when ``grad_l2`` is given.
"""

from __future__ import annotations

import contextlib

import torch


def run(fn, args, upstream_seed=1):
    """(output, grads of every leaf that requires grad) after a backward with a random upstream gradient."""
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    for leaf in leaves:
        leaf.grad = None
    out = fn(*args)
    if leaves and out.requires_grad:
        gen = torch.Generator().manual_seed(upstream_seed)
        upstream = (torch.rand(out.shape, generator=gen) + 0.5).to(out.device, out.dtype)
        (out * upstream).sum().backward()
    if out.is_cuda:
        torch.cuda.synchronize()
    return out.detach().clone(), [None if leaf.grad is None else leaf.grad.detach().clone() for leaf in leaves]


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` in fp64 on the CPU (the absolute norm where ``want`` is 0); the two must have one
    shape and be finite at the same time."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert got.shape == want.shape, (got.shape, want.shape)
    assert bool(got.isfinite().all()) == bool(want.isfinite().all()), "finite in one, not in the other"
    den = want.norm().item()
    num = (got - want).norm().item()
    return num if den == 0 else num / den


@contextlib.contextmanager
def inductor_caches_off():
    """Compile from scratch in this process: a hit in Inductor's FX-graph or AOTAutograd cache skips the pass (the
    cached code already calls the fused op), so the pass's decisions would not be seen."""
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield


def assert_same_values(got, want, what="", *, rtol=1e-5, atol=1e-6, grad_l2=None, check_dtype=True):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if check_dtype:
        assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    got, want = got.float(), want.float()
    assert torch.equal(got.isnan(), want.isnan()), f"{what}: NaN pattern differs\ngot  {got}\nwant {want}"
    for inf in (float("inf"), float("-inf")):
        assert torch.equal(got == inf, want == inf), f"{what}: {inf} pattern differs\ngot  {got}\nwant {want}"
    finite = want.isfinite()
    if grad_l2 is None:
        torch.testing.assert_close(got[finite], want[finite], rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")
    elif not finite.any():
        return
    elif want[finite].norm() == 0:
        assert got[finite].norm() == 0, f"{what}: the reference is exactly zero, got norm {got[finite].norm()}"
    else:
        err = rel_l2(got[finite], want[finite])
        assert err < grad_l2, f"{what}: relative L2 error {err:.3g} >= {grad_l2}"


def assert_same_run(got, want, *, grad_l2=None, **tol):
    """``got`` / ``want`` as :func:`run` returns them; ``grad_l2`` applies to the gradients only."""
    assert_same_values(got[0], want[0], "loss", **tol)
    assert len(got[1]) == len(want[1])
    for k, (g, w) in enumerate(zip(got[1], want[1])):
        assert (g is None) == (w is None), f"grad {k}: {g is None=} {w is None=}"
        if w is not None:
            assert_same_values(g, w, f"grad {k}", grad_l2=grad_l2, **tol)
