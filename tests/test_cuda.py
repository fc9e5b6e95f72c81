"""CUDA-only behaviour: the Triton kernels behind the op and the pass under CUDA-specific compile modes.

Run on a GPU machine (skipped elsewhere):

    python -m pytest tests/test_cuda.py -q

* out-of-range targets fail loudly (device-side assert) as in eager, direct op and compiled (subprocesses: a
  device-side assert poisons the CUDA context of the process that triggered it);
* ``cce_inductor.enable()`` with ``mode="reduce-overhead"`` (CUDA graphs) over several training steps (the lean
  path, the balanced path, returned logits lazy or dropped between the recorded graphs), and with
  ``mode="max-autotune"``;
* CUDA autocast (bf16) over fp32 weights; ``dynamic=True`` over three sequence lengths with one compile;
* NaN propagation and empty batches; ``reduction="none"``, every target ignored, a frozen head, a bias.

Tolerances (each comparison is against eager PyTorch on the same device and inputs):

* fp32 (``FP32``): at torch's default matmul precision ("highest") the kernels use IEEE fp32 products
  (``kernels/_launch.py: dot_precision``; TF32 only where the user allows it for cuBLAS too, tested against
  torch.compile's own error) and cuBLAS runs fp32 matmuls in fp32; what is left is summation order, ~1e-6 relative,
  so 1e-4 on the loss and 1e-4 relative L2 on the gradients leaves two orders of magnitude of margin.
* bf16 (``BF16``): eager rounds the logits (and, without an upcast, the loss) to bf16 (8 bits of mantissa,
  relative step 2^-8 = 3.9e-3) while the op keeps them in fp32; the gradients are rounded to bf16 on both
  sides. 2e-2 relative on the loss and 2e-2 relative L2 on the gradients is ~5 bf16 steps; the kernel
  benchmark measured at most 8.1e-3 against an fp64 reference (README "Performance").

Compiled runs turn Inductor's caches off (a cache hit skips the pass, so ``stats()`` would not see the rewrite).
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch._inductor.config as inductor_config
import torch.nn as nn
import torch.nn.functional as F

import cce_inductor
from tests.support.compare import assert_same_run, assert_same_values, rel_l2, run
from tests.support.inputs import make_cuda_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEVICE = "cuda"
REPO = Path(__file__).resolve().parents[1]
lce = cce_inductor.linear_cross_entropy

# (loss rtol, loss atol, gradient relative-L2 bound); see the module docstring for why.
FP32 = dict(rtol=1e-4, atol=1e-5, grad_l2=1e-4)
BF16 = dict(rtol=2e-2, atol=2e-2, grad_l2=2e-2)
TOL = {torch.float32: FP32, torch.bfloat16: BF16}


@pytest.fixture(autouse=True)
def _no_inductor_caches():
    with inductor_config.patch(force_disable_caches=True):
        yield


# ----------------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------------


def make_fn(softcap=None, ignore_index=-100, reduction="mean", upcast=False):
    """linear -> [upcast] -> [softcap] -> cross_entropy with the constants baked in, as model code has them."""

    def fn(hidden, weight, labels, bias=None):
        logits = F.linear(hidden, weight, bias)
        if upcast:
            logits = logits.float()
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=ignore_index, reduction=reduction
        )

    return fn


def direct(softcap=None, ignore_index=-100, reduction="mean"):
    def fn(hidden, weight, labels, bias=None):
        loss = lce(hidden, weight, labels, bias=bias, softcap=softcap, ignore_index=ignore_index, reduction=reduction)
        return loss.reshape(-1) if reduction == "none" else loss  # as make_fn's flattened logits give it

    return fn


def compile_cce(fn, **kwargs):
    return torch.compile(fn, backend=cce_inductor.backend, fullgraph=True, **kwargs)


def assert_rewritten(count=1):
    stats = cce_inductor.stats()
    assert stats["rewritten"] == count, stats["summary"]


# ----------------------------------------------------------------------------------------------------------------
# The kernels are what runs
# ----------------------------------------------------------------------------------------------------------------


def test_triton_kernels_are_used_on_cuda():
    """Every other test here means little if CUDA silently took the chunked PyTorch path (cce_inductor.kernels
    imports only from an installed package: ``pip install -e .``)."""
    from cce_inductor import _dispatch

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert _dispatch.uses_kernels(torch.device(DEVICE), dtype), (
            f"CUDA {dtype} does not take the Triton kernels: cce_inductor.kernels did not import "
            "(is the package installed, and is triton importable?)"
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("softcap", [None, 15.0])
def test_direct_op_matches_eager_odd_shapes(dtype, softcap):
    """Shapes that are multiples of no tile size (tails in rows, hidden and vocabulary), bias, ignored rows."""
    args = make_cuda_inputs((3, 101), d=72, v=3001, dtype=dtype, bias=True)
    want = run(make_fn(softcap=softcap), args)
    got = run(lambda h, w, y, b: direct(softcap=softcap)(h, w, y, b).to(want[0].dtype), args)
    assert_same_run(got, want, **TOL[dtype])


# ----------------------------------------------------------------------------------------------------------------
# a. out-of-range targets: a device-side assert, never a number
# ----------------------------------------------------------------------------------------------------------------

_BAD_TARGET_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch, torch.nn.functional as F
    import cce_inductor

    torch._inductor.config.force_disable_caches = True
    mode, bad = sys.argv[1], sys.argv[2]
    V, D, N = 257, 64, 96
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, D, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    weight = (torch.randn(V, D, generator=gen) / 8).to("cuda", torch.bfloat16).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=gen).to("cuda")
    labels[5] = -100

    def eager(h, w, y):
        return F.cross_entropy(F.linear(h, w).float(), y)

    if mode == "eager":
        f = eager
    elif mode == "direct":
        options = cce_inductor.CCEOptions.from_env()  # CCE_INDUCTOR_PATH: the path under test
        f = lambda h, w, y: cce_inductor.linear_cross_entropy(h, w, y, options=options)
    else:
        f = torch.compile(eager, backend=cce_inductor.backend, fullgraph=True)
        # compile and run on in-range targets first: the same compiled code then meets the bad target
        got, want = f(hidden, weight, labels), eager(hidden, weight, labels)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        got.backward()
        torch.cuda.synchronize()
        assert cce_inductor.stats()["rewritten"] == 1, cce_inductor.stats()["summary"]
        forced = os.environ["CCE_INDUCTOR_PATH"]
        assert forced == "auto" or cce_inductor.stats()["sites"][0]["path"] == forced, cce_inductor.stats()["sites"]
        print("WARMUP_OK", float(got.detach()), flush=True)
        hidden.grad = weight.grad = None

    if bad != "none":
        labels[7] = int(bad)
    loss = f(hidden, weight, labels)
    loss.backward()
    value = loss.item()  # a host sync: an asynchronous device-side assert surfaces here at the latest
    torch.cuda.synchronize()
    print("LOSS", value, flush=True)
    """
)

_V_IN_SCRIPT = 257


def _run_bad_target_script(mode: str, bad: str, path: str = "auto") -> subprocess.CompletedProcess:
    env = dict(os.environ, CCE_INDUCTOR="0", CCE_INDUCTOR_PATH=path, PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run(
        [sys.executable, "-c", _BAD_TARGET_SCRIPT, mode, bad],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=str(REPO),
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode,bad,path",
    [
        ("eager", str(_V_IN_SCRIPT), "auto"),  # the contract: eager PyTorch itself asserts on the device
        ("direct", str(_V_IN_SCRIPT), "auto"),
        ("direct", "-1", "auto"),
        ("compiled", str(_V_IN_SCRIPT), "auto"),
        ("compiled", "-5", "auto"),
        # each path checks in its own way (the balanced helper in the launch that counts the rows)
        ("direct", str(_V_IN_SCRIPT), "lean"),
        ("direct", "-1", "balanced"),
        ("compiled", str(_V_IN_SCRIPT), "balanced"),
        ("compiled", "-5", "lean"),
    ],
)
def test_out_of_range_target_fails_loudly(mode, bad, path):
    proc = _run_bad_target_script(mode, bad, path)
    log = f"exit {proc.returncode}\nstdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert "LOSS" not in proc.stdout, f"a loss was computed for target {bad}:\n{log}"
    assert proc.returncode != 0, log
    assert re.search(r"device-side assert|CUDA error|Assertion", proc.stderr), log
    if mode == "compiled":
        assert "WARMUP_OK" in proc.stdout, f"the compiled model failed before the bad batch:\n{log}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode,path",
    [
        ("eager", "auto"),
        ("direct", "auto"),
        ("compiled", "auto"),
        ("direct", "lean"),
        ("direct", "balanced"),
        ("compiled", "lean"),
        ("compiled", "balanced"),
    ],
)
def test_in_range_targets_pass_in_the_same_harness(mode, path):
    """The harness above can fail: with every target in range the same script exits 0 with a finite loss."""
    proc = _run_bad_target_script(mode, "none", path)
    log = f"exit {proc.returncode}\nstdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, log
    match = re.search(r"^LOSS (\S+)$", proc.stdout, re.M)
    assert match is not None and torch.isfinite(torch.tensor(float(match.group(1)))), log


# ----------------------------------------------------------------------------------------------------------------
# b. enable() + mode="reduce-overhead" (CUDA graphs), several training steps
# ----------------------------------------------------------------------------------------------------------------


class TinyShiftLM(nn.Module):
    """A body layer, the head, the Hugging Face label shift and an upcast before the loss."""

    def __init__(self, dim=64, vocab=1000, head_bias=False):
        super().__init__()
        self.body = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=head_bias)

    def forward(self, x, labels):
        logits = self.head(F.gelu(self.body(x)))[:, :-1, :]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1))


class NormHead(nn.Module):
    """LayerNorm + head + loss: nothing but the head's matmul, which the pass removes, for autotuning to chew on."""

    def __init__(self, dim=64, vocab=1000):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x, labels):
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def _batch(step, shape, dim, vocab, dtype):
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(*shape, dim, generator=gen).to(DEVICE, dtype)
    labels = torch.randint(0, vocab, shape, generator=gen)
    labels[:, ::5] = -100
    return x, labels.to(DEVICE)


def _recorded_cuda_graphs() -> int:
    """CUDA graphs recorded by Inductor's cudagraph trees on the current device (0 when there is no manager)."""
    from torch._inductor import cudagraph_trees

    index = torch.cuda.current_device()
    try:
        manager = cudagraph_trees.get_manager(index, create_if_none_exists=False)
    except TypeError:  # an older/newer signature: the container holds the same manager
        manager = cudagraph_trees.get_container(index).tree_manager
    if manager is None:
        return 0
    stack = [node for nodes in manager.roots.values() for node in nodes]
    count = 0
    while stack:
        node = stack.pop()
        count += 1
        stack.extend(child for children in getattr(node, "children", {}).values() for child in children)
    return count


def _train_and_compare(model, compiled, steps, shape, dim, vocab, dtype, tol, lr=0.1):
    """SGD steps on ``model`` through ``compiled`` and on an eager copy; loss and every gradient compared at each
    step (outputs are cloned before the next step: CUDA-graph outputs are overwritten by the next replay)."""
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=lr)
    for step in range(steps):
        x, labels = _batch(step, shape, dim, vocab, dtype)
        torch.compiler.cudagraph_mark_step_begin()
        loss = compiled(x, labels)
        loss.backward()
        got = (loss.detach().clone(), [p.grad.detach().clone() for p in model.parameters()])
        want_loss = reference(x, labels)
        want_loss.backward()
        want = (want_loss.detach(), [p.grad.detach() for p in reference.parameters()])
        try:
            assert_same_run(got, want, **tol)
        except AssertionError as error:
            raise AssertionError(f"step {step}: {error}") from None
        opt.step()
        opt_ref.step()
        opt.zero_grad(set_to_none=True)
        opt_ref.zero_grad(set_to_none=True)


def _cudagraph_or_error():
    """Make a CUDA-graph skip an error where this torch has the switch (it has since 2.5)."""
    if hasattr(inductor_config.triton, "cudagraph_or_error"):
        return inductor_config.patch({"triton.cudagraph_or_error": True})
    return inductor_config.patch({})


@pytest.mark.slow
def test_enable_reduce_overhead_uses_cuda_graphs():
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    dim, vocab, shape = 64, 1000, (4, 33)
    model = TinyShiftLM(dim, vocab).to(DEVICE)
    counters.clear()
    cce_inductor.enable()
    try:
        with _cudagraph_or_error():
            compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
            # fp32: CUDA graphs replay the same kernels, so eager's fp32 tolerance applies
            _train_and_compare(model, compiled, 5, shape, dim, vocab, torch.float32, FP32)
    finally:
        cce_inductor.disable()
    assert not cce_inductor.is_enabled()
    assert_rewritten(1)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    # warm-up on step 0, recording on step 1, replays after: a forward and a backward graph at least
    assert _recorded_cuda_graphs() >= 2, dict(counters["inductor"])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_balanced_path_under_cuda_graphs(dtype):
    """The balanced path (the gradients computed in the forward, scaled in the backward) recorded and replayed."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    dim, vocab, shape = 64, 1000, (4, 33)
    model = TinyShiftLM(dim, vocab).to(DEVICE, dtype)
    counters.clear()
    cce_inductor.enable(scratch_mb=1)
    try:
        with _cudagraph_or_error():
            compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
            _train_and_compare(model, compiled, 5, shape, dim, vocab, dtype, FP32 if dtype == torch.float32 else BF16)
    finally:
        cce_inductor.disable()
    assert {site["path"] for site in cce_inductor.stats()["sites"] if site["rewritten"]} == {"balanced"}
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert _recorded_cuda_graphs() >= 2, dict(counters["inductor"])


class LogitsLM(nn.Module):
    """Returns its logits beside the loss, as Hugging Face models do."""

    def __init__(self, dim=64, vocab=1000):
        super().__init__()
        self.body = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, x, labels):
        logits = self.head(F.gelu(self.body(x)))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1)), logits


def _logits_model_step(compiled, model, reference, step, shape, dim, vocab):
    """One fp32 step of a LogitsLM through ``compiled`` and eager ``reference``, loss and gradients compared; returns
    the two logits (the compiled one unread)."""
    x, labels = _batch(step, shape, dim, vocab, torch.float32)
    torch.compiler.cudagraph_mark_step_begin()
    loss, logits = compiled(x, labels)
    want_loss, want_logits = reference(x, labels)
    loss.backward()
    want_loss.backward()
    assert_same_run(
        (loss.detach().clone(), [p.grad.clone() for p in model.parameters()]),
        (want_loss.detach(), [p.grad for p in reference.parameters()]),
        **FP32,
    )
    return logits, want_logits


@pytest.mark.slow
@pytest.mark.parametrize("returned", ["lazy", "drop"])
def test_returned_logits_under_cuda_graphs(returned):
    """mode="reduce-overhead" on a model that returns its logits: the placeholder op (tagged cudagraph_unsafe) runs
    between Inductor's recorded graphs (graph partition, the default), so lazy logits compute on first use and a
    dropped-logits placeholder raises, replay after replay, instead of coming back as a plain tensor over recorded
    memory (a placeholder recorded in the graph came back NaN-filled, H100). Loss and gradients match eager at every
    step, the graphs are recorded and replayed, and logits read after the next optimizer step raise."""
    from torch._dynamo.utils import counters

    from cce_inductor._dropped_logits import DroppedLogits

    torch.manual_seed(0)
    dim, vocab, shape = 64, 1000, (4, 32)
    model = LogitsLM(dim, vocab).to(DEVICE)
    reference = copy.deepcopy(model)
    opt, opt_ref = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    counters.clear()
    cce_inductor.enable(drop_logits=returned == "drop")
    try:
        with _cudagraph_or_error():
            compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
            for step in range(4):
                logits, want_logits = _logits_model_step(compiled, model, reference, step, shape, dim, vocab)
                late = returned == "lazy" and step == 2  # read only after the optimizer step: must raise
                if returned == "lazy":
                    assert type(logits) is cce_inductor.LazyLogits, type(logits)
                    if not late:
                        torch.testing.assert_close(
                            logits.float(), want_logits, **{k: FP32[k] for k in ("rtol", "atol")}
                        )
                else:
                    assert isinstance(logits, DroppedLogits), type(logits)
                    with pytest.raises(RuntimeError, match="drop"):
                        logits.sum()
                for o in (opt, opt_ref):
                    o.step()
                    o.zero_grad(set_to_none=True)
                if late:  # its head has been changed by the optimizer since the forward
                    with pytest.raises(RuntimeError, match="modified in place"):
                        logits.sum()
    finally:
        cce_inductor.disable()
    assert_rewritten(1)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert _recorded_cuda_graphs() >= 2, dict(counters["inductor"])


@pytest.mark.slow
def test_returned_logits_left_alone_under_cuda_graphs_without_graph_partition():
    """Without Inductor's graph partition the placeholder op would be recorded in the graph (whose outputs come
    back as plain tensors): the pass leaves such a site alone and says why; the real logits come back, the graphs
    are recorded, and loss and gradients match eager."""
    torch.manual_seed(0)
    dim, vocab, shape = 64, 1000, (4, 32)
    model = LogitsLM(dim, vocab).to(DEVICE)
    reference = copy.deepcopy(model)
    cce_inductor.enable(drop_logits=True)
    try:
        with _cudagraph_or_error(), inductor_config.patch({"graph_partition": False}):
            compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
            for step in range(3):
                logits, want_logits = _logits_model_step(compiled, model, reference, step, shape, dim, vocab)
                assert type(logits) is torch.Tensor, type(logits)
                torch.testing.assert_close(logits, want_logits, **{k: FP32[k] for k in ("rtol", "atol")})
                for m in (model, reference):
                    m.zero_grad(set_to_none=True)
    finally:
        cce_inductor.disable()
    assert_rewritten(0)
    assert any(
        "compiled with CUDA graphs" in reason and "graph_partition" in reason
        for reason in cce_inductor.stats()["reasons"]
    )
    assert _recorded_cuda_graphs() >= 2


# ----------------------------------------------------------------------------------------------------------------
# c. mode="max-autotune"
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_enable_max_autotune():
    torch.manual_seed(0)
    dim, vocab, shape = 64, 1000, (4, 32)
    model = NormHead(dim, vocab).to(DEVICE, torch.bfloat16)
    cce_inductor.enable()
    try:
        compiled = torch.compile(model, mode="max-autotune", fullgraph=True)
        _train_and_compare(model, compiled, 3, shape, dim, vocab, torch.bfloat16, BF16)
    finally:
        cce_inductor.disable()
    assert_rewritten(1)


@pytest.mark.parametrize("path", ["lean", "balanced"])
def test_fp32_with_tf32_matmuls_within_compiles_error(path):
    """fp32 inputs where the user allowed TF32 for matmuls (``set_float32_matmul_precision("high")``, what torch's
    own warning suggests): the kernels' fp32 products follow it (``kernels/_launch.py: dot_precision``) as
    torch.compile's cuBLAS matmuls do, instead of running on the CUDA cores. Against an fp64 reference, the loss and
    gradients stay within torch.compile's own error at the same setting (TF32's 10-bit inputs dominate both; the
    25% covers summation order)."""
    args = make_cuda_inputs((4, 512), d=256, v=8003, dtype=torch.float32)
    reference = [a.detach().double().requires_grad_() if a.is_floating_point() else a for a in args]
    want = run(make_fn(), reference)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        torch._dynamo.reset()
        stock = run(torch.compile(make_fn(), fullgraph=True), args)
        torch._dynamo.reset()
        cce_inductor.reset_stats()
        got = run(torch.compile(make_fn(), backend=cce_inductor.make_backend(path=path), fullgraph=True), args)
    finally:
        torch.set_float32_matmul_precision(before)
    assert_rewritten(1)
    assert [s["path"] for s in cce_inductor.stats()["sites"] if s["rewritten"]] == [path]
    for name, g, s, w in zip(("loss", "dE", "dC"), [got[0], *got[1]], [stock[0], *stock[1]], [want[0], *want[1]]):
        ours, theirs = rel_l2(g, w.to(g.dtype)), rel_l2(s, w.to(s.dtype))
        assert ours <= 1.25 * theirs + 1e-7, (name, ours, theirs)


# ----------------------------------------------------------------------------------------------------------------
# d. CUDA autocast (bf16) over fp32 weights
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("inside", [False, True], ids=["autocast_outside", "autocast_inside"])
def test_autocast_bf16_fp32_weights(inside):
    inner = make_fn(softcap=20.0)
    if inside:

        def fn(*args):
            with torch.autocast(DEVICE, dtype=torch.bfloat16):
                return inner(*args)
    else:
        fn = inner
    args = make_cuda_inputs((2, 48), d=64, v=1000, dtype=torch.float32, bias=True)
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=not inside):
        want = run(fn, args)
        got = run(compile_cce(fn), args)
    assert want[0].dtype == torch.float32  # cross_entropy runs in fp32 under autocast
    assert all(g.dtype == torch.float32 for g in want[1])  # fp32 leaves get fp32 gradients
    assert_rewritten(1)
    assert_same_run(got, want, **BF16)  # the products run in bf16 on both sides


# ----------------------------------------------------------------------------------------------------------------
# e. dynamic=True: three sequence lengths, one compile
# ----------------------------------------------------------------------------------------------------------------


def test_dynamic_shapes_one_compile():
    def fn(hidden, weight, labels):
        logits = F.linear(hidden, weight)[..., :-1, :].contiguous()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels[..., 1:].contiguous().view(-1))

    compiles = []

    def counting_backend(gm, example_inputs, **kwargs):
        compiles.append(gm)
        return cce_inductor.backend(gm, example_inputs, **kwargs)

    compiled = torch.compile(fn, backend=counting_backend, fullgraph=True, dynamic=True)
    for seq in (17, 40, 129):  # none equal to another size (duck sizing) or to 0 / 1 (specialised)
        args = make_cuda_inputs((3, seq), d=56, v=999, dtype=torch.float32, seed=seq)
        want = run(fn, args)
        got = run(compiled, args)
        assert_same_run(got, want, **FP32)
    assert len(compiles) == 1, f"{len(compiles)} compiles for 3 sequence lengths under dynamic=True"
    assert_rewritten(1)


# ----------------------------------------------------------------------------------------------------------------
# f. NaN propagation; empty batches
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["direct", "compiled"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_nan_in_hidden_propagates_like_eager(path, reduction):
    """A NaN in one (non-ignored) row of the hidden states: the mean is NaN, per-row losses are NaN in that row
    only, and the gradients have eager's NaN pattern (dE: that row; dC: everything)."""
    hidden, weight, labels = make_cuda_inputs((64,), d=64, v=1000, dtype=torch.float32)
    assert labels[3] != -100
    with torch.no_grad():
        hidden[3, 5] = float("nan")
    args = (hidden, weight, labels)
    want = run(make_fn(reduction=reduction), args)
    fn = direct(reduction=reduction) if path == "direct" else compile_cce(make_fn(reduction=reduction))
    got = run(fn, args)
    if reduction == "mean":
        assert want[0].isnan()
    else:
        assert want[0].isnan().nonzero().flatten().tolist() == [3]
    assert_same_run(got, want, **FP32)
    if path == "compiled":
        assert_rewritten(1)


def _nan_in_an_ignored_row():
    hidden, weight, labels = make_cuda_inputs((64,), d=64, v=1000, dtype=torch.float32)
    assert labels[0] == -100
    with torch.no_grad():
        hidden[0, 1] = float("nan")
    return hidden, weight, labels


@pytest.mark.parametrize("path", ["direct", "compiled"])
def test_nan_in_an_ignored_row_leaves_the_loss_alone(path):
    """An ignored row's NaN does not reach eager's loss, nor ours."""
    args = _nan_in_an_ignored_row()
    want = run(make_fn(), args)
    assert want[0].isfinite()
    got = run(direct() if path == "direct" else compile_cce(make_fn()), args)
    assert_same_values(got[0], want[0], "loss", rtol=FP32["rtol"], atol=FP32["atol"])


@pytest.mark.parametrize("path", ["direct", "compiled"])
def test_nan_in_an_ignored_row_gradients_like_eager(path):
    """Eager's log-softmax backward gives an ignored row with a NaN logit NaN gradients (g - exp(out) * sum(g)
    with 0 * NaN); the default (dense) CUDA backward does the same.  (The filtering tile backward skips
    ignored rows altogether.)"""
    args = _nan_in_an_ignored_row()
    want = run(make_fn(), args)
    got = run(direct() if path == "direct" else compile_cce(make_fn()), args)
    assert_same_run(got, want, **FP32)


EMPTY_EXPECTED = {"mean": "nan", "sum": 0.0, "none": (0,)}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(
    "path,dtype",
    [("direct", torch.float32), ("direct", torch.bfloat16), ("compiled", torch.float32)],
    ids=["direct-fp32", "direct-bf16", "compiled-fp32"],
)
def test_empty_batch_like_eager(path, dtype, reduction):
    args = make_cuda_inputs((0,), d=64, v=1000, dtype=dtype, bias=True)
    want = run(make_fn(reduction=reduction), args)
    expected = EMPTY_EXPECTED[reduction]
    if expected == "nan":
        assert want[0].shape == () and want[0].isnan(), want[0]  # eager: mean over nothing is 0/0
    elif reduction == "sum":
        assert want[0].shape == () and want[0].item() == 0.0, want[0]
    else:
        assert want[0].shape == expected, want[0].shape
    if path == "direct":
        got = run(lambda *a: direct(reduction=reduction)(*a).to(want[0].dtype), args)
    else:
        got = run(compile_cce(make_fn(reduction=reduction)), args)
        assert_rewritten(1)
    assert_same_run(got, want, **TOL[dtype])


# ----------------------------------------------------------------------------------------------------------------
# g. reduction="none", every target ignored, frozen head, bias
# ----------------------------------------------------------------------------------------------------------------

EDGE_CASES = {
    # name: (make_inputs keywords, make_fn / direct keywords)
    "none_bias": (dict(bias=True), dict(reduction="none")),
    "none_bias_softcap": (dict(bias=True), dict(reduction="none", softcap=10.0)),
    "all_ignored_mean": (dict(bias=True, ignore_every=1), dict(reduction="mean")),
    "all_ignored_sum": (dict(bias=True, ignore_every=1), dict(reduction="sum")),
    "all_ignored_none": (dict(bias=True, ignore_every=1), dict(reduction="none")),
    "frozen_weight": (dict(weight_grad=False), dict(reduction="mean")),
    "frozen_weight_bias_sum": (dict(weight_grad=False, bias=True), dict(reduction="sum")),
    "ignore_index_in_vocab": (dict(ignore_index=0, bias=True), dict(reduction="mean", ignore_index=0)),
}


@pytest.mark.parametrize("case", list(EDGE_CASES))
@pytest.mark.parametrize(
    "path,dtype",
    [("direct", torch.float32), ("direct", torch.bfloat16), ("compiled", torch.float32)],
    ids=["direct-fp32", "direct-bf16", "compiled-fp32"],
)
def test_edge_cases_like_eager(case, path, dtype):
    input_kwargs, fn_kwargs = EDGE_CASES[case]
    args = make_cuda_inputs((5, 37), d=80, v=2050, dtype=dtype, **input_kwargs)
    want = run(make_fn(**fn_kwargs), args)
    if path == "direct":
        got = run(lambda *a: direct(**fn_kwargs)(*a).to(want[0].dtype), args)
    else:
        got = run(compile_cce(make_fn(**fn_kwargs)), args)
        assert_rewritten(1)
    if case.startswith("all_ignored"):
        assert want[0].isnan().all() if fn_kwargs["reduction"] == "mean" else (want[0] == 0).all(), want[0]
        assert all((g == 0).all() for g in want[1])  # eager: no target, no gradient
    if case.startswith("frozen_weight"):
        assert args[1].grad is None and len(want[1]) == len(args) - 2  # no weight gradient anywhere
    assert_same_run(got, want, **TOL[dtype])
