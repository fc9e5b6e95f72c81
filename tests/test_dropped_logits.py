"""``drop_logits``: returned logits become a placeholder that keeps their shape/dtype and raises on any use.

The placeholder (``cce_inductor.DroppedLogits``, returned by ``torch.ops.cce_inductor.dropped_logits``) is checked
on its own, then through both entry points (``make_backend(drop_logits=True)`` and ``enable(drop_logits=True)`` with
a plain ``torch.compile``), with dynamic shapes, after a warm Inductor/AOTAutograd cache in a fresh process, and on a
Hugging Face causal LM.
"""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import cce_inductor
from cce_inductor import DroppedLogits
from tests.support.graphs import PassCapture
from tests.support.models import MODEL_SRC, TinyGPT, make_batch
from tests.support.processes import last_json, run_python, subprocess_env

# What every error must say: the option, and how to turn it off.
MUST_NAME = ("drop_logits", "CCE_INDUCTOR_DROP_LOGITS", "unset CCE_INDUCTOR_DROP_LOGITS", "drop_logits=False")


def _placeholder(shape=(2, 3, 5), dtype=torch.float32):
    return torch.ops.cce_inductor.dropped_logits(torch.zeros(1, dtype=torch.long), list(shape), dtype)


def assert_raises_on_use(logits, use=lambda x: x.sum()):
    with pytest.raises(RuntimeError, match="drop_logits") as info:
        use(logits)
    for needle in MUST_NAME:
        assert needle in str(info.value), (needle, str(info.value))


# ----------------------------------------------------------------------------------------------------------------
# The placeholder
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_placeholder_metadata(dtype):
    x = _placeholder((2, 3, 5), dtype)
    assert isinstance(x, DroppedLogits) and isinstance(x, torch.Tensor)
    assert x.shape == (2, 3, 5) and x.size() == torch.Size([2, 3, 5]) and x.size(-1) == 5
    assert x.dtype == dtype and x.device == torch.device("cpu")
    assert x.dim() == 3 and x.ndim == 3 and x.numel() == 30 and len(x) == 2
    assert x.requires_grad is False and x.grad_fn is None
    assert repr(x) == f"DroppedLogits(shape=(2, 3, 5), dtype={dtype}, device=cpu)"
    assert str(x) == repr(x) and f"{x}" == repr(x)
    # no logits memory: one element of storage, zero strides
    assert x.stride() == (0, 0, 0)
    assert x.untyped_storage().nbytes() == x.element_size()
    # detaching keeps the placeholder (the use comes later, and raises then)
    assert isinstance(x.detach(), DroppedLogits) and x.detach().shape == x.shape


USES = {
    "add": lambda x: x + 1,
    "radd": lambda x: 1 + x,
    "sum": lambda x: x.sum(),
    "softmax": lambda x: torch.softmax(x, -1),
    "log_softmax_method": lambda x: x.log_softmax(-1),
    "F.cross_entropy": lambda x: F.cross_entropy(x.flatten(0, 1), torch.zeros(6, dtype=torch.long)),
    "argmax": lambda x: x.argmax(-1),
    "index": lambda x: x[0],
    "slice": lambda x: x[:, :-1],
    "view": lambda x: x.view(-1, 5),
    "float": lambda x: x.float(),
    "to": lambda x: x.to(torch.float64),
    "cpu": lambda x: x.cpu(),
    "numpy": lambda x: x.numpy(),
    "np.asarray": lambda x: np.asarray(x),
    "item": lambda x: x.item(),
    "tolist": lambda x: x.tolist(),
    "clone": lambda x: x.clone(),
    "eq": lambda x: x == 0,
    "bool": lambda x: bool(x),
    "torch.cat": lambda x: torch.cat([x, x]),
    "pickle": lambda x: pickle.dumps(x),
    "deepcopy": lambda x: copy.deepcopy(x),
    "after detach": lambda x: x.detach().mean(),
}


@pytest.mark.parametrize("use", sorted(USES))
def test_placeholder_raises_on_use(use):
    assert_raises_on_use(_placeholder(), USES[use])


def test_placeholder_values_are_nan_underneath():
    """Whatever reads the storage without going through Python (C++ code) sees NaN, not plausible numbers."""
    x = _placeholder()
    with torch._C.DisableTorchFunctionSubclass():
        assert torch.isnan(x).all()


def test_fake_impl_allocates_nothing():
    with FakeTensorMode() as mode:
        like = mode.from_tensor(torch.zeros(4, dtype=torch.long))
        fake = torch.ops.cce_inductor.dropped_logits(like, [4, 7, 11], torch.bfloat16)
    assert type(fake).__name__ == "FakeTensor"
    assert fake.shape == (4, 7, 11) and fake.dtype == torch.bfloat16 and fake.stride() == (0, 0, 0)
    assert not fake.requires_grad


# ----------------------------------------------------------------------------------------------------------------
# Through the compilers
# ----------------------------------------------------------------------------------------------------------------


def _training_step(model, fn, idx, targets):
    model.zero_grad(set_to_none=True)
    loss, logits = fn(idx, targets)
    loss.backward()  # while the placeholder is unused
    return loss, logits, {name: p.grad.clone() for name, p in model.named_parameters()}


def _check_against_eager(model, compiled, shapes=((2, 16),)):
    for batch, seq in shapes:
        idx, targets = make_batch(batch=batch, seq=seq)
        ref_loss, ref_logits, ref_grads = _training_step(model, model, idx, targets)
        loss, logits, grads = _training_step(model, compiled, idx, targets)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        assert grads.keys() == ref_grads.keys()
        for name in ref_grads:
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)
        assert isinstance(logits, DroppedLogits), type(logits)
        assert logits.shape == ref_logits.shape and logits.dtype == ref_logits.dtype
        assert logits.device == ref_logits.device and not logits.requires_grad
        assert_raises_on_use(logits, lambda x: torch.softmax(x, -1))
        assert_raises_on_use(logits, lambda x: (x.argmax(-1) == targets).float().mean())  # noqa: B023 - called in this iteration
    stats = cce_inductor.stats()
    # (with dynamic=True, torch 2.13 runs the pre-grad pass twice for one compilation: >= 1)
    assert stats["rewritten"] >= 1 and stats["skipped"] == 0, stats


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_make_backend_returns_raising_placeholder(no_inductor_caches, clean_env, dynamic):
    torch.manual_seed(0)
    model = TinyGPT(return_logits=True)
    compiled = torch.compile(model, backend=cce_inductor.make_backend(drop_logits=True), dynamic=dynamic)
    shapes = ((2, 16), (3, 9)) if dynamic else ((2, 16),)
    _check_against_eager(model, compiled, shapes)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_enable_then_plain_compile_returns_raising_placeholder(no_inductor_caches, clean_env, restore_hook, dynamic):
    torch.manual_seed(0)
    model = TinyGPT(return_logits=True)
    cce_inductor.enable(drop_logits=True)
    try:
        compiled = torch.compile(model, dynamic=dynamic)
        shapes = ((2, 16), (3, 9)) if dynamic else ((2, 16),)
        _check_against_eager(model, compiled, shapes)
    finally:
        cce_inductor.disable()


def test_no_grad_forward_returns_placeholder(no_inductor_caches, clean_env):
    torch.manual_seed(0)
    model = TinyGPT(return_logits=True)
    idx, targets = make_batch()
    compiled = torch.compile(model, backend=cce_inductor.make_backend(drop_logits=True))
    with torch.no_grad():
        loss, logits = compiled(idx, targets)
        ref_loss, ref_logits = model(idx, targets)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert isinstance(logits, DroppedLogits) and logits.shape == ref_logits.shape
    assert_raises_on_use(logits)


def test_flattened_and_upcast_logits_returned(clean_env):
    """The escaping node is a view/upcast of the head output: the placeholder has that node's shape and dtype, also
    when its row count is symbolic (the product of the hidden states' leading sizes)."""
    weight = torch.randn(11, 8, requires_grad=True)

    def f(hidden, labels):
        flat = F.linear(hidden.to(torch.bfloat16), weight.to(torch.bfloat16)).view(-1, 11).float()
        return F.cross_entropy(flat, labels.view(-1)), flat

    capture = PassCapture(cce_inductor.CCEOptions(drop_logits=True))
    compiled = torch.compile(f, backend=capture, dynamic=True, fullgraph=True)
    for batch, seq in ((2, 5), (3, 4)):
        hidden, labels = torch.randn(batch, seq, 8), torch.randint(0, 11, (batch, seq))
        loss, flat = compiled(hidden, labels)
        ref_loss, ref_flat = f(hidden, labels)
        torch.testing.assert_close(loss, ref_loss, atol=2e-2, rtol=2e-2)
        assert flat.dtype == ref_flat.dtype == torch.float32
        assert isinstance(flat, DroppedLogits) and flat.shape == ref_flat.shape == (batch * seq, 11)
        assert_raises_on_use(flat)
    assert capture.rewrites == [1]
    assert "dropped_logits" in capture.after[0]


def test_placeholder_shape_not_expressible_is_refused(clean_env):
    """A returned slice whose symbolic size (T - 1) is no size of the hidden states, targets or weight: the site is
    left alone with the reason, nothing crashes, the real logits come back."""
    weight = torch.randn(11, 8)

    def f(hidden, labels):
        shifted = F.linear(hidden, weight)[:, :-1, :]
        loss = F.cross_entropy(shifted.reshape(-1, 11), labels[:, 1:].reshape(-1))
        return loss, shifted

    capture = PassCapture(cce_inductor.CCEOptions(drop_logits=True))
    compiled = torch.compile(f, backend=capture, dynamic=True, fullgraph=True)
    hidden, labels = torch.randn(2, 6, 8), torch.randint(0, 11, (2, 6))
    loss, shifted = compiled(hidden, labels)
    torch.testing.assert_close(shifted, f(hidden, labels)[1])
    assert capture.rewrites == [0]
    (reason,) = cce_inductor.stats()["reasons"]
    assert reason.startswith("the returned logits cannot be replaced by a placeholder: "), reason
    assert "is not a size of the hidden states or targets" in reason, reason

    # the same code with static shapes is rewritten
    torch._dynamo.reset()
    cce_inductor.reset_stats()
    static = PassCapture(cce_inductor.CCEOptions(drop_logits=True))
    loss, shifted = torch.compile(f, backend=static, dynamic=False, fullgraph=True)(hidden, labels)
    assert static.rewrites == [1]
    assert shifted.shape == (2, 5, 11)
    assert_raises_on_use(shifted)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_site_without_targets(no_inductor_caches, clean_env, dynamic):
    """An entropy alone (no token ids: the placeholder's device comes from the hidden states, detached) with the
    logits returned, through Inductor with gradients."""
    pytest.importorskip("cce_inductor.fx_passes.entropy")
    weight = torch.randn(11, 8, requires_grad=True)

    def f(hidden):
        logits = F.linear(hidden, weight)
        entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
        return entropy.mean(), logits

    compiled = torch.compile(f, backend=cce_inductor.make_backend(drop_logits=True), dynamic=dynamic)
    for batch in (2, 3):
        hidden = torch.randn(batch, 5, 8, requires_grad=True)
        want, want_logits = f(hidden)
        (want_grad,) = torch.autograd.grad(want, hidden)
        got, logits = compiled(hidden)
        (got_grad,) = torch.autograd.grad(got, hidden)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got_grad, want_grad)
        assert isinstance(logits, DroppedLogits) and logits.shape == want_logits.shape and not logits.requires_grad
        assert_raises_on_use(logits)
    assert cce_inductor.stats()["skipped"] == 0, cce_inductor.stats()["reasons"]


def test_without_opt_in_reason_names_placeholder(clean_env):
    model = TinyGPT(return_logits=True)
    idx, targets = make_batch()
    torch.compile(model, backend=PassCapture(cce_inductor.CCEOptions(lazy_logits=False)))(idx, targets)
    (reason,) = cce_inductor.stats()["reasons"]
    assert "CCE_INDUCTOR_DROP_LOGITS=1" in reason and "a placeholder that raises on use" in reason, reason


# ----------------------------------------------------------------------------------------------------------------
# Warm cache: a fresh process loads the compiled graph (the pass does not run) and still gets the placeholder
# ----------------------------------------------------------------------------------------------------------------


WARM_SCRIPT = (
    MODEL_SRC
    + """
import json
import sys

import torch
from torch._dynamo.utils import counters

import cce_inductor

torch.manual_seed(0)
model = TinyGPT(return_logits=True)
idx, targets = make_batch()
ref_loss, ref_logits = model(idx, targets)
if sys.argv[1] == "backend":
    compiled = torch.compile(model, backend=cce_inductor.make_backend(drop_logits=True), dynamic=sys.argv[2] == "1")
else:
    cce_inductor.enable(drop_logits=True)
    compiled = torch.compile(model, dynamic=sys.argv[2] == "1")
loss, logits = compiled(idx, targets)
loss.backward()
try:
    logits.softmax(-1)
    error = ""
except RuntimeError as exc:
    error = str(exc)
print(json.dumps({
    "loss_err": abs(loss.item() - ref_loss.item()),
    "type": type(logits).__name__, "shape": list(logits.shape), "ref_shape": list(ref_logits.shape),
    "error": error, "rewritten": cce_inductor.stats()["rewritten"],
    "source_hash": cce_inductor.graph_pass._source_hash(),
    "aot": {k: v for k, v in counters["aot_autograd"].items() if "cache" in k},
    "inductor": {k: v for k, v in counters["inductor"].items() if "cache" in k},
}))
"""
)


@pytest.mark.slow
@pytest.mark.parametrize("entry,dynamic", [("backend", "0"), ("enable", "0"), ("enable", "1")])
def test_warm_cache_still_returns_placeholder(tmp_path, entry, dynamic):
    script = tmp_path / "warm.py"
    script.write_text(WARM_SCRIPT)
    env = subprocess_env(tmp_path / "cache", caches=True)
    results = [last_json(run_python([str(script), entry, dynamic], env, tmp_path).stdout) for _ in range(2)]
    first, second = results
    if first["source_hash"] != second["source_hash"]:
        pytest.skip("the package's sources changed between the two processes (someone is editing them)")
    assert first["aot"].get("autograd_cache_saved", 0) >= 1 and first["rewritten"] >= 1, first
    assert second["aot"].get("autograd_cache_hit", 0) >= 1, second
    assert second["inductor"].get("fxgraph_cache_miss", 0) == 0, second
    if dynamic == "0":
        # the pass did not run: the cached code calls the op by name. (With dynamic=True, torch 2.13 calls the
        # pre-grad passes twice per compilation, once even on a warm start; the cached code is used all the same.)
        assert second["rewritten"] == 0, second
    for result in results:
        assert result["loss_err"] < 1e-5, result
        assert result["type"] == "DroppedLogits" and result["shape"] == result["ref_shape"], result
        assert "CCE_INDUCTOR_DROP_LOGITS" in result["error"] and "drop_logits=False" in result["error"], result


# ----------------------------------------------------------------------------------------------------------------
# A Hugging Face causal LM
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_hf_causal_lm_logits_raise(no_inductor_caches, clean_env, family):
    from tests.support.hf import VOCAB, hf_batch, hf_model

    model = hf_model(family)
    input_ids, labels = hf_batch()
    compiled = torch.compile(model, backend=cce_inductor.make_backend(drop_logits=True))
    expected = model(input_ids=input_ids, labels=labels)
    expected.loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    out = compiled(input_ids=input_ids, labels=labels)
    out.loss.backward()
    assert cce_inductor.stats()["rewritten"] == 1, cce_inductor.stats()["reasons"]
    torch.testing.assert_close(out.loss, expected.loss, atol=1e-4, rtol=1e-3)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], atol=1e-4, rtol=1e-3, msg=name)
    assert isinstance(out.logits, DroppedLogits)
    assert out.logits.shape == expected.logits.shape == (2, 12, VOCAB) and out.logits.dtype == expected.logits.dtype
    assert out["logits"] is out.logits and out.to_tuple()[1] is out.logits  # ModelOutput plumbing still works
    # what training code does with outputs.logits (TRL's SFTTrainer: entropy, token accuracy) fails loudly
    assert_raises_on_use(out.logits, lambda x: -(x.softmax(-1) * x.log_softmax(-1)).sum(-1).mean())
    assert_raises_on_use(out.logits, lambda x: (x[:, :-1].argmax(-1) == labels[:, 1:]).float().mean())


@pytest.mark.parametrize("graph_partition", [True, False])
def test_cuda_graph_compiles_drop_the_logits_only_between_the_graphs(no_inductor_caches, graph_partition):
    """Under CUDA graphs (mode="reduce-overhead" sets triton.cudagraphs while compiling) a placeholder recorded in a
    graph would come back as a plain tensor that cannot raise. The placeholder op is tagged cudagraph_unsafe, so with
    Inductor's graph partition (the default) it runs between the graphs and the site is rewritten; without it the
    site is left alone with that reason (the config is patched here on the CPU, where no graph is recorded;
    tests/test_cuda.py runs the real thing)."""
    assert torch._C.Tag.cudagraph_unsafe in torch.ops.cce_inductor.dropped_logits.default.tags
    torch.manual_seed(0)
    model = TinyGPT(return_logits=True)
    idx, targets = make_batch(2, 16)
    with inductor_config.patch({"triton.cudagraphs": True, "graph_partition": graph_partition}):
        loss, logits = torch.compile(model, backend=cce_inductor.make_backend(drop_logits=True))(idx, targets)
    want_loss, want_logits = model(idx, targets)
    torch.testing.assert_close(loss, want_loss)
    stats = cce_inductor.stats()
    if graph_partition:
        assert isinstance(logits, DroppedLogits) and logits.shape == want_logits.shape
        assert_raises_on_use(logits, lambda x: x.sum())
        assert stats["rewritten"] == 1
        (site,) = [s for s in stats["sites"] if s["rewritten"]]
        assert "dropped from the outputs (their op runs between Inductor's CUDA graphs)" in site["reason"], site
    else:
        assert not isinstance(logits, DroppedLogits)
        torch.testing.assert_close(logits, want_logits)
        assert stats["rewritten"] == 0
        assert any(
            "compiled with CUDA graphs" in reason and "graph_partition" in reason for reason in stats["reasons"]
        ), stats["reasons"]
