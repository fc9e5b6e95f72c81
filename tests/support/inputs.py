"""Inputs of the op, the kernels, the balanced path and the CUDA suite: one function each, as they differ.

* :func:`make_op_inputs` (the op against eager): hidden states ``(*lead, D)``, some rows confident, targets of any
  ``ignore_index`` (kept out of the real targets), some / all / no rows ignored;
* :func:`make_kernel_inputs` (the kernels against fp64): logits of std ``logit_std``, half the rows confident (their
  target logit raised by ~12), a share of ignored rows, E optionally a non-contiguous view, on any device;
* :func:`make_balanced_inputs` (the balanced path): unscaled C, E of norm ~3, row 0 and ~30% of the others ignored;
* :func:`make_cuda_inputs` (``tests/test_cuda.py``): leaves on the GPU, every ``ignore_every``-th target ignored.

They are not one function: each draws its own distribution in its own order, and tests hold their numbers to
fixed expectations (a row that must be ignored, a NaN placed in a counted row), so each keeps its draws.
"""

import math

import torch

from cce_inductor import CCEOptions

IGNORE = -100
BALANCED = CCEOptions(scratch_mb=1)  # the balanced path, with a 1 MiB scratch


def make_op_inputs(lead, vocab, dim, dtype, *, bias=False, ignore="some", ignore_index=-100, seed=0):
    """Hidden states ``(*lead, dim)``, weight ``(vocab, dim)``, targets ``lead``, optional bias, in ``dtype``.

    Logits have a spread of a few units (some rows confident), so softmax is neither uniform nor one-hot.
    """
    gen = torch.Generator().manual_seed(seed)
    n = math.prod(lead)
    c = torch.randn(vocab, dim, generator=gen) / math.sqrt(dim)
    e = torch.randn(n, dim, generator=gen) * 2.0
    targets = torch.randint(0, vocab, (n,), generator=gen)
    if ignore_index in range(vocab):  # keep the ignored class out of the "real" targets
        targets = torch.where(targets == ignore_index, (ignore_index + 1) % vocab, targets)
    confident = torch.rand(n, generator=gen) < 0.4
    e[confident] += 3.0 * math.sqrt(dim) * c[targets[confident]]
    if ignore == "some":
        ignored = torch.rand(n, generator=gen) < 0.3
        if n >= 2:
            ignored[0], ignored[1] = True, False
        targets[ignored] = ignore_index
    elif ignore == "all":
        targets[:] = ignore_index
    else:
        assert ignore == "none"
    b = (torch.randn(vocab, generator=gen) * 0.5).to(dtype) if bias else None
    return e.reshape(*lead, dim).to(dtype), c.to(dtype), targets.reshape(lead), b


def make_kernel_inputs(n, v, d, dtype, device, *, ignore_frac=0.0, bias=False, logit_std=3.0, seed=0, noncontig=False):
    """E ``(n, d)``, C ``(v, d)``, targets ``(n,)`` (a share ``ignore_frac`` ignored), optional bias, on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    c = torch.randn(v, d, generator=gen) / math.sqrt(d)
    e = torch.randn(n, d, generator=gen) * logit_std
    # make some rows confident: add their target's vector (|c| ~ 1), raising the target logit by ~12
    targets = torch.randint(0, v, (n,), generator=gen)
    confident = torch.rand(n, generator=gen) < 0.5
    e[confident] += 12.0 * c[targets[confident]]
    if ignore_frac > 0:
        ignored = torch.rand(n, generator=gen) < ignore_frac
        if ignore_frac >= 1.0:
            ignored[:] = True
        targets[ignored] = IGNORE
    b = (torch.randn(v, generator=gen) * 0.5).to(dtype).to(device) if bias else None
    e = e.to(dtype)
    if noncontig:
        # a transposed-then-transposed view: strides (1, n)
        e = e.t().contiguous().to(device).t()
    else:
        e = e.to(device)
    return e, c.to(dtype).to(device), targets.to(device), b


def make_balanced_inputs(n, v, d, dtype, device="cpu", *, bias=False, ignore="some", seed=0):
    """E ``(n, d)``, C ``(v, d)``, targets ``(n,)`` (``ignore``: "some", "all" or "none"), optional bias."""
    gen = torch.Generator().manual_seed(seed)
    c = torch.randn(v, d, generator=gen)
    e = torch.randn(n, d, generator=gen) * 3.0 / d**0.5
    t = torch.randint(0, v, (n,), generator=gen)
    if ignore == "some" and n > 1:
        t[torch.rand(n, generator=gen) < 0.3] = IGNORE
        t[0] = IGNORE
    elif ignore == "all":
        t[:] = IGNORE
    b = torch.randn(v, generator=gen) * 0.5 if bias else None
    cast = lambda x: None if x is None else x.to(device, dtype)  # noqa: E731
    return cast(e), cast(c), t.to(device), cast(b)


def make_cuda_inputs(
    lead=(96,),
    d=64,
    v=1000,
    *,
    dtype=torch.float32,
    seed=0,
    bias=False,
    ignore_every=7,
    ignore_index=-100,
    weight_grad=True,
):
    """hidden (*lead, d), weight (v, d), labels (*lead) with every ``ignore_every``-th ignored, [bias (v,)], on CUDA."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*lead, d, generator=gen) * 2.0
    weight = torch.randn(v, d, generator=gen) / d**0.5
    labels = torch.randint(0, v, lead, generator=gen)
    if ignore_every and labels.numel():
        labels.view(-1)[::ignore_every] = ignore_index
    out = [
        hidden.to("cuda", dtype).requires_grad_(),
        weight.to("cuda", dtype).requires_grad_(weight_grad),
        labels.to("cuda"),
    ]
    if bias:
        out.append((torch.randn(v, generator=gen) * 0.5).to("cuda", dtype).requires_grad_())
    return out
