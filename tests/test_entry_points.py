"""The ways in: ``backend=cce_inductor.backend``, ``make_backend`` (its options reach the pass), ``enable``/``disable``
(plain ``torch.compile``, also with ``mode="max-autotune-no-cudagraphs"``), chaining a user's pre-grad pass
(``cce_inductor/graph_pass.py``), ``CCE_INDUCTOR=1`` (the ``torch.backends`` entry point,
``cce_inductor_autoload.py``), ``backend="cce"`` (the ``torch_dynamo_backends`` entry point), and Inductor's FX graph /
AOTAutograd caches across processes.

In-process tests turn Inductor's FX graph and AOTAutograd caches off: a cache hit skips the pass, so a graph
compiled by an earlier run would not be counted in ``stats()``. Subprocess tests (marked ``slow``) share one
session-wide ``TORCHINDUCTOR_CACHE_DIR`` so that Inductor's compiled C++ kernels are reused between them; only
the cache test turns the FX graph and AOTAutograd caches on, and nothing else writes entries there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch._inductor.custom_graph_pass import CustomGraphPass

import cce_inductor
from cce_inductor.backend import mode_patches
from cce_inductor.graph_pass import CCEGraphPass
from cce_inductor.options import CCEOptions
from tests.support.head import inputs, make_fn
from tests.support.models import MODEL_SRC, TinyGPT, make_batch
from tests.support.processes import last_json, run_python, subprocess_env


def loss_and_grads(model, fn, *inputs):
    model.zero_grad(set_to_none=True)
    out = fn(*inputs)
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return out, grads


def assert_grads_close(got: dict, want: dict):
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")  # noqa: B023 - called in this iteration


def op_was_called(fn) -> bool:
    with torch.profiler.profile() as prof:
        fn()
    names = {event.name for event in prof.events()}
    return "cce_inductor::linear_cross_entropy" in names and "cce_inductor::linear_cross_entropy_backward" in names


# ----------------------------------------------------------------------------------------------------------------
# (a) backend=cce_inductor.backend
# ----------------------------------------------------------------------------------------------------------------


def test_backend_rewrites_tiny_gpt(no_inductor_caches, clean_env):
    torch.manual_seed(0)
    model = TinyGPT()
    idx, targets = make_batch()
    ref_loss, ref_grads = loss_and_grads(model, model, idx, targets)

    compiled = torch.compile(model, backend=cce_inductor.backend)
    cce_inductor.reset_stats()
    loss, grads = loss_and_grads(model, compiled, idx, targets)
    stats = cce_inductor.stats()
    assert stats["rewritten"] == 1, stats
    assert stats["skipped"] == 0, stats["reasons"]
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert_grads_close(grads, ref_grads)
    # the compiled code really calls the fused op (forward and backward)
    assert op_was_called(lambda: compiled(idx, targets).backward())


def test_backend_takes_torch_compiles_mode_and_options(no_inductor_caches, clean_env, monkeypatch):
    """``torch.compile(..., backend=cce_inductor.backend, mode=...)``: Dynamo hands a backend other than Inductor the
    mode (and ``options``) as keywords; they reach Inductor as its own wrapper applies them (``reduce-overhead``: CUDA
    graphs), and the loss is rewritten as without them (before, compile_fx refused the keyword)."""
    import torch._inductor.compile_fx as compile_fx_module

    seen = []
    real = compile_fx_module.compile_fx

    def recording(*args, **kwargs):
        seen.append((inductor_config.triton.cudagraphs, inductor_config.max_autotune))
        return real(*args, **kwargs)

    monkeypatch.setattr(compile_fx_module, "compile_fx", recording)
    fn = make_fn()
    hidden, weight, labels = inputs()
    want = fn(hidden, weight, labels)
    want_grads = torch.autograd.grad(want, (hidden, weight))
    cases = (("reduce-overhead", None, (True, False)), (None, {"max_autotune": True}, (False, True)))
    for mode, options, flags in cases:
        torch._dynamo.reset()
        cce_inductor.reset_stats()
        compiled = torch.compile(make_fn(), backend=cce_inductor.backend, mode=mode, options=options)
        got = compiled(hidden, weight, labels)
        grads = torch.autograd.grad(got, (hidden, weight))
        assert seen[-1] == flags, mode
        assert cce_inductor.stats()["rewritten"] == 1
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        for g, w in zip(grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert mode_patches("max-autotune", {"max_autotune": False})["max_autotune"] is False
    assert mode_patches(None, None) == {}


# ----------------------------------------------------------------------------------------------------------------
# (b) make_backend(drop_logits=...)
# ----------------------------------------------------------------------------------------------------------------


def test_make_backend_drop_logits(no_inductor_caches, clean_env):
    torch.manual_seed(0)
    model = TinyGPT(return_logits=True)
    idx, targets = make_batch()
    (ref_loss, ref_logits), ref_grads = loss_and_grads(model, model, idx, targets)

    compiled = torch.compile(model, backend=cce_inductor.make_backend(drop_logits=True))
    cce_inductor.reset_stats()
    (loss, logits), grads = loss_and_grads(model, compiled, idx, targets)
    stats = cce_inductor.stats()
    assert stats["rewritten"] == 1, stats
    assert isinstance(logits, cce_inductor.DroppedLogits) and logits.shape == ref_logits.shape
    with pytest.raises(RuntimeError, match="drop_logits"):
        logits.sum()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert_grads_close(grads, ref_grads)


def test_make_backend_without_drop_logits_leaves_site(no_inductor_caches, clean_env):
    torch.manual_seed(0)
    model = TinyGPT(return_logits=True)
    idx, targets = make_batch()
    (ref_loss, ref_logits), ref_grads = loss_and_grads(model, model, idx, targets)

    compiled = torch.compile(model, backend=cce_inductor.make_backend(lazy_logits=False))
    cce_inductor.reset_stats()
    (loss, logits), grads = loss_and_grads(model, compiled, idx, targets)
    stats = cce_inductor.stats()
    assert stats["rewritten"] == 0, stats
    assert stats["skipped"] == 1
    assert any("CCE_INDUCTOR_DROP_LOGITS" in reason for reason in stats["reasons"]), stats["reasons"]
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert_grads_close(grads, ref_grads)


def test_make_backend_reads_env_for_unset_options(monkeypatch, clean_env):
    monkeypatch.setenv("CCE_INDUCTOR_DROP_LOGITS", "1")
    monkeypatch.setenv("CCE_INDUCTOR_EXACT", "1")
    backend = cce_inductor.make_backend(exact=False)
    assert backend.options.drop_logits is True
    assert backend.options.exact is False  # keyword wins over env


@pytest.mark.slow
def test_backend_options_reach_the_pass(no_inductor_caches):
    """make_backend(...) compiles with a pass carrying exactly its options (what Inductor's cache key sees)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    seen = []

    class Spy(CustomGraphPass):  # chained before ours by the backend: sees the pass installed for this compile
        def __call__(self, graph):
            seen.append(inductor_config.pre_grad_custom_pass)

        def uuid(self):
            return "spy"

    options = CCEOptions(drop_logits=True, exact=True, products="triton", backward_row_chunk=1024)
    fn = make_fn()
    with inductor_config.patch(pre_grad_custom_pass=Spy()):
        torch.compile(fn, backend=cce_inductor.make_backend(options), fullgraph=True)(*inputs(4))
    assert len(seen) == 1 and isinstance(seen[0], CCEGraphPass)
    assert seen[0].options == options
    assert (
        seen[0].uuid()
        == CCEGraphPass(options, chained=seen[0].chained).uuid()
        != CCEGraphPass(CCEOptions(), chained=seen[0].chained).uuid()
    )


# ----------------------------------------------------------------------------------------------------------------
# (c) enable / disable, chaining a user pass, uuid
# ----------------------------------------------------------------------------------------------------------------


class CountingPass(CustomGraphPass):
    """A user's pre-grad pass: counts its calls; uuid given by the test (None = no uuid)."""

    def __init__(self, uuid="user-pass-v1"):
        self._uuid = uuid
        self.calls = 0

    def __call__(self, graph):
        self.calls += 1

    def uuid(self):
        return self._uuid


def _loss_fn(h, w, y):
    logits = F.linear(h, w)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-1)


def test_enable_then_plain_compile_rewrites_and_chains(no_inductor_caches, clean_env, restore_hook):
    user = CountingPass()
    inductor_config.pre_grad_custom_pass = user
    ours = cce_inductor.enable()
    try:
        assert cce_inductor.is_enabled()
        assert inductor_config.pre_grad_custom_pass is ours
        assert ours.chained is user

        torch.manual_seed(0)
        model = TinyGPT()
        idx, targets = make_batch()
        ref_loss, ref_grads = loss_and_grads(model, model, idx, targets)
        cce_inductor.reset_stats()
        loss, grads = loss_and_grads(model, torch.compile(model), idx, targets)
        assert cce_inductor.stats()["rewritten"] == 1
        assert user.calls >= 1, "the chained user pass did not run"
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
        assert_grads_close(grads, ref_grads)

        # enabling again (new options) replaces our pass and keeps the user's pass chained, not our old one
        again = cce_inductor.enable(exact=True)
        assert again.chained is user and again.options.exact
    finally:
        cce_inductor.disable()
    assert not cce_inductor.is_enabled()
    assert inductor_config.pre_grad_custom_pass is user

    # after disable, plain torch.compile runs the user's pass only
    calls = user.calls
    torch._dynamo.reset()
    cce_inductor.reset_stats()
    h, w = torch.randn(6, 8), torch.randn(11, 8)
    y = torch.randint(0, 11, (6,))
    torch.testing.assert_close(torch.compile(_loss_fn)(h, w, y), _loss_fn(h, w, y))
    assert cce_inductor.stats()["graphs"] == 0
    assert user.calls == calls + 1


def test_enable_disable_without_user_pass(clean_env, restore_hook):
    inductor_config.pre_grad_custom_pass = None
    ours = cce_inductor.enable(drop_logits=True)
    assert isinstance(ours, CCEGraphPass) and ours.chained is None and ours.options.drop_logits
    cce_inductor.disable()
    assert inductor_config.pre_grad_custom_pass is None
    cce_inductor.disable()  # idempotent
    assert inductor_config.pre_grad_custom_pass is None


def test_enable_reads_env(monkeypatch, clean_env, restore_hook):
    inductor_config.pre_grad_custom_pass = None
    monkeypatch.setenv("CCE_INDUCTOR_EXACT", "1")
    monkeypatch.setenv("CCE_INDUCTOR_BACKWARD_ROW_CHUNK", "4096")
    try:
        ours = cce_inductor.enable()
        assert ours.options == CCEOptions(exact=True, backward_row_chunk=4096)
        assert cce_inductor.enable(products="triton").options == CCEOptions(
            exact=True, products="triton", backward_row_chunk=4096
        )
    finally:
        cce_inductor.disable()


def test_backend_chains_enabled_users_pass_once(no_inductor_caches, clean_env, restore_hook):
    """backend=cce_inductor.backend while enable() is on: the user's pass runs once, our pass once."""
    user = CountingPass()
    inductor_config.pre_grad_custom_pass = user
    cce_inductor.enable()
    try:
        h, w = torch.randn(6, 8), torch.randn(11, 8)
        y = torch.randint(0, 11, (6,))
        cce_inductor.reset_stats()
        torch.testing.assert_close(torch.compile(_loss_fn, backend=cce_inductor.backend)(h, w, y), _loss_fn(h, w, y))
        assert user.calls == 1
        assert cce_inductor.stats()["graphs"] == 1 and cce_inductor.stats()["rewritten"] == 1
    finally:
        cce_inductor.disable()


def test_uuid_follows_chained_pass():
    plain = CCEGraphPass(CCEOptions()).uuid()
    v1 = CCEGraphPass(CCEOptions(), chained=CountingPass("user-v1")).uuid()
    v2 = CCEGraphPass(CCEOptions(), chained=CountingPass("user-v2")).uuid()
    assert len({plain, v1, v2}) == 3
    assert CCEGraphPass(CCEOptions(), chained=CountingPass("user-v1")).uuid() == v1
    both = CCEGraphPass(CCEOptions(), chained=[CountingPass("user-v1"), CountingPass("other")]).uuid()
    assert both and both not in (plain, v1, v2)


@pytest.mark.parametrize("kind", ["function", "uuid_none", "in_list"])
def test_uuid_none_when_chained_pass_has_none(kind):
    chained = {
        "function": lambda graph: None,
        "uuid_none": CountingPass(uuid=None),
        "in_list": [CountingPass("ok"), lambda graph: None],
    }[kind]
    assert CCEGraphPass(CCEOptions(), chained=chained).uuid() is None


_MAX_AUTOTUNE_SCRIPT = textwrap.dedent(
    """
    import torch, torch.nn.functional as F
    import cce_inductor
    torch._inductor.config.force_disable_caches = True
    cce_inductor.enable()
    torch.manual_seed(0)
    V, D = 13, 7
    head = torch.nn.Linear(D, V)
    def fn(hidden, labels):
        logits = torch.tanh(head(hidden) / 9.0) * 9.0
        return F.cross_entropy(logits[..., :-1, :].reshape(-1, V), labels[..., 1:].reshape(-1))
    hidden = torch.randn(2, 6, D, requires_grad=True)
    labels = torch.randint(0, V, (2, 6))
    compiled = torch.compile(fn, mode="max-autotune-no-cudagraphs", fullgraph=True)
    results = []
    for f in (fn, compiled):
        loss = f(hidden, labels)
        grads = torch.autograd.grad(loss, [hidden, head.weight, head.bias])
        results.append((loss, grads))
    torch.testing.assert_close(results[1][0], results[0][0])
    for g, w in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(g, w)
    print("REWRITTEN", cce_inductor.stats()["rewritten"])
    """
)


@pytest.mark.slow
def test_enable_with_max_autotune_no_cudagraphs():
    """``cce_inductor.enable()`` + ``torch.compile(mode="max-autotune-no-cudagraphs")`` (a subprocess: ``enable``
    is process-global). Skipped when it takes longer than 60 s on this machine."""
    env = dict(os.environ, CCE_INDUCTOR="0")
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _MAX_AUTOTUNE_SCRIPT], capture_output=True, text=True, timeout=60, env=env
        )
    except subprocess.TimeoutExpired:
        pytest.skip("max-autotune-no-cudagraphs compile took longer than 60 s")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "REWRITTEN 1" in proc.stdout, proc.stdout + proc.stderr[-2000:]


# ----------------------------------------------------------------------------------------------------------------
# Subprocesses
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def kernel_cache_dir(tmp_path_factory):
    """One Inductor cache dir for every subprocess: compiled C++ kernels are shared; see the module docstring."""
    return tmp_path_factory.mktemp("inductor_cache")


# (d) An unmodified nanoGPT-style training script: no cce_inductor until it reads the stats at the end.
NANOGPT_SCRIPT = """
import json
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.ln = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x):
        return x + self.mlp(self.ln(x))


class GPT(nn.Module):
    def __init__(self, vocab_size=97, block_size=16, n_embd=32, n_layer=1):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([Block(n_embd) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss


torch.manual_seed(1337)
data = torch.randint(0, 97, (4096,))


def get_batch(batch_size=4, block_size=16):
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x, y


model = GPT()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model = torch.compile(model)
losses = []
for step in range(3):
    X, Y = get_batch()
    logits, loss = model(X, Y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
    print(f"step {step}: loss {loss.item():.6f}")

import cce_inductor  # only to read what the pass did

print(json.dumps({"losses": losses, "rewritten": cce_inductor.stats()["rewritten"],
                  "reasons": cce_inductor.stats()["reasons"]}))
"""


@pytest.mark.slow
def test_env_autoload_rewrites_unmodified_script(tmp_path, kernel_cache_dir):
    script = tmp_path / "train_nanogpt.py"
    script.write_text(NANOGPT_SCRIPT)
    # nanoGPT returns the logits too, so the site is only rewritten with CCE_INDUCTOR_DROP_LOGITS=1
    env = subprocess_env(kernel_cache_dir, CCE_INDUCTOR="1", CCE_INDUCTOR_DROP_LOGITS="1")
    with_cce = last_json(run_python([str(script)], env, tmp_path).stdout)
    eager = last_json(
        run_python([str(script)], subprocess_env(kernel_cache_dir, TORCH_COMPILE_DISABLE="1"), tmp_path).stdout
    )
    assert with_cce["rewritten"] == 1, with_cce
    assert eager["rewritten"] == 0
    assert with_cce["losses"][0] == pytest.approx(eager["losses"][0], rel=1e-6)
    assert with_cce["losses"] == pytest.approx(eager["losses"], rel=1e-5)


@pytest.mark.slow
def test_autoload_off_costs_nothing(tmp_path, kernel_cache_dir):
    env = subprocess_env(kernel_cache_dir)
    code = "import torch, sys; print('cce_inductor' in sys.modules, 'torch._inductor.config' in sys.modules)"
    proc = run_python(["-c", code], env, tmp_path)
    assert proc.stdout.split() == ["False", "False"]
    env["CCE_INDUCTOR"] = "0"
    assert run_python(["-c", code], env, tmp_path).stdout.split() == ["False", "False"]


@pytest.mark.slow
def test_autoload_on_enables_at_import_torch(tmp_path, kernel_cache_dir):
    env = subprocess_env(kernel_cache_dir, CCE_INDUCTOR="1", CCE_INDUCTOR_EXACT="1")
    code = (
        "import torch, sys; import torch._inductor.config as c; "
        "print('cce_inductor' in sys.modules, type(c.pre_grad_custom_pass).__name__, "
        "c.pre_grad_custom_pass.options.exact)"
    )
    assert run_python(["-c", code], env, tmp_path).stdout.split() == ["True", "CCEGraphPass", "True"]


@pytest.mark.slow
def test_autoload_broken_install_warns_and_torch_still_imports(tmp_path, kernel_cache_dir):
    fake = tmp_path / "fake" / "cce_inductor"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('simulated broken install')\n")
    env = subprocess_env(kernel_cache_dir, CCE_INDUCTOR="1", PYTHONPATH=str(tmp_path / "fake"))
    proc = run_python(["-c", "import torch; print('torch ok', torch.__version__)"], env, tmp_path)
    assert "torch ok" in proc.stdout
    assert "RuntimeWarning" in proc.stderr, proc.stderr
    assert "simulated broken install" in proc.stderr
    assert "cce_inductor could not be enabled" in proc.stderr


# (e) backend="cce" through the torch_dynamo_backends entry point; (f) the caches.
BACKEND_SCRIPT = (
    MODEL_SRC
    + """
import json
import sys

import torch
from torch._dynamo.utils import counters

torch.manual_seed(0)
model = TinyGPT()
idx, targets = make_batch()
ref = model(idx, targets)
ref.backward()
ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
model.zero_grad(set_to_none=True)

if sys.argv[1] == "by_name":
    compiled = torch.compile(model, backend="cce")  # no import of cce_inductor before the compile
else:
    import cce_inductor
    compiled = torch.compile(model, backend=cce_inductor.backend)
loss = compiled(idx, targets)
loss.backward()
grad_err = max((p.grad - ref_grads[n]).abs().max().item() for n, p in model.named_parameters())

with torch.profiler.profile() as prof:  # after the compile: only the run is profiled
    compiled(idx, targets).backward()
names = {e.name for e in prof.events()}

import cce_inductor

print(json.dumps({
    "loss": loss.item(), "ref": ref.item(), "grad_err": grad_err,
    "rewritten": cce_inductor.stats()["rewritten"],
    "executions": cce_inductor.stats()["executions"]["linear_cross_entropy"],
    "summary": cce_inductor.stats()["summary"],
    "op_called": "cce_inductor::linear_cross_entropy" in names,
    "bwd_op_called": "cce_inductor::linear_cross_entropy_backward" in names,
    "balanced_op_called": "cce_inductor::linear_cross_entropy_with_grads" in names,
    "inductor": {k: v for k, v in counters["inductor"].items() if "cache" in k},
    "aot_autograd": {k: v for k, v in counters["aot_autograd"].items() if "cache" in k},
}))
"""
)


def _check_run(result, balanced=False):
    assert result["loss"] == pytest.approx(result["ref"], rel=1e-6)
    assert result["grad_err"] < 1e-6
    if balanced:  # the loss's gradients come out of the forward op; the backward only scales them
        assert result["balanced_op_called"] and not result["op_called"] and not result["bwd_op_called"]
    else:
        assert result["op_called"] and result["bwd_op_called"] and not result["balanced_op_called"]


@pytest.mark.slow
def test_backend_by_name_in_fresh_process(tmp_path, kernel_cache_dir):
    script = tmp_path / "by_name.py"
    script.write_text(BACKEND_SCRIPT)
    result = last_json(run_python([str(script), "by_name"], subprocess_env(kernel_cache_dir), tmp_path).stdout)
    _check_run(result)
    assert result["rewritten"] == 1


@pytest.mark.slow
def test_caches_hit_across_processes_and_miss_on_option_change(tmp_path, kernel_cache_dir):
    """Process 1 compiles (miss), process 2 loads it (hit: the pass is skipped, the op still runs and stats() counts
    it), then a process per option changed in the environment must not reuse it (miss, the pass runs again)."""
    script = tmp_path / "cached.py"
    script.write_text(BACKEND_SCRIPT)
    env = subprocess_env(kernel_cache_dir, caches=True)

    def run(**extra):
        result = last_json(run_python([str(script), "object"], {**env, **extra}, tmp_path).stdout)
        _check_run(result, balanced="CCE_INDUCTOR_SCRATCH_MB" in extra)
        return result

    def hits(result):
        return result["aot_autograd"].get("autograd_cache_hit", 0) + result["inductor"].get("fxgraph_cache_hit", 0)

    first = run()
    assert hits(first) == 0, first
    assert first["aot_autograd"].get("autograd_cache_miss", 0) >= 1, first
    assert first["aot_autograd"].get("autograd_cache_saved", 0) >= 1, first  # not bypassed
    assert first["rewritten"] == 1

    second = run()
    assert second["aot_autograd"].get("autograd_cache_hit", 0) >= 1, second
    assert second["inductor"].get("fxgraph_cache_miss", 0) == 0, second
    assert second["rewritten"] == 0  # a hit skips the pass: the cached code calls the op by name
    assert second["executions"] == 2, second  # ... which stats() still sees: the compiled run and the profiled one
    assert "the fused op ran 2 times" in second["summary"], second["summary"]

    # every option the op reads (drop_logits changes the graph: see the uuid tests in tests/test_options.py)
    for variable, value in [
        ("CCE_INDUCTOR_EXACT", "1"),
        ("CCE_INDUCTOR_PRODUCTS", "triton"),
        ("CCE_INDUCTOR_BACKWARD_ROW_CHUNK", "2048"),
        ("CCE_INDUCTOR_SCRATCH_MB", "64"),
    ]:
        changed = run(**{variable: value})
        assert hits(changed) == 0, (variable, changed)
        assert changed["rewritten"] == 1, (variable, changed)
