"""Distributed benchmark (2 GPUs, NCCL): the cce_inductor pass under FSDP2, and the vocabulary-parallel loss under TP=2.

GPU figures (two H200): docs/performance.md; ``--device cpu`` is a dry run with tiny sizes (gloo).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 torchrun --standalone --nproc-per-node 2 \\
        benchmarks/distributed_bench.py --out benchmarks/results/$(date +%F)_2xh200_distributed.json --budget-s 240
    torchrun --standalone --nproc-per-node 2 benchmarks/distributed_bench.py --device cpu --out /tmp/d.json   # tiny

Part ``fsdp``: a Llama-3-like model (RMSNorm, RoPE, GQA attention, SwiGLU, untied 128256-entry head, by
default 2 layers of Llama-3 8B: D 4096, 32 heads / 8 KV heads, FFN 14336; 2 x 4096 tokens per rank) with
``F.cross_entropy(logits.float().view(-1, V), labels.view(-1))`` in a ``HeadAndLoss`` module (see its
docstring for why it must not be inline in the root ``forward``), sharded with FSDP2 (``fully_shard`` per
block and on the root; bf16 params, fp32 reduction), AdamW, compiled with plain Inductor and with
``cce_inductor.make_backend(drop_logits=True)``: median step time (fwd + bwd + optimizer, warm-up excluded),
peak memory per rank over the measured steps, the loss of both runs on the same data and init at every step,
and ``cce_inductor.stats()`` (whether the head site was rewritten). The head stays in the root's FSDP unit:
the output ``Linear`` as a unit of its own gets (dynamo-disabled) FSDP hooks that break the graph between
head and loss, and nothing would be rewritten (``tests/test_distributed.py``).

Part ``tp``: the output head split by vocabulary over the ranks (``ColwiseParallel``): forward + backward of
``torch.distributed.tensor.parallel.loss_parallel`` on materialised logits against
``cce_inductor.distributed.vocab_parallel_linear_cross_entropy`` on the local shard, and the same head + loss
compiled (plain Inductor; the cce backend, whose ``fx_passes/tensor_parallel.py`` rewrites the site into
``dtensor_linear_cross_entropy``): time, peak memory above the inputs, and the loss / gradient differences to
eager ``loss_parallel`` (default 8192 rows, the same on every rank). The eager TP variants run first (cheap),
then FSDP, then the compiled TP variants.

Every variant runs in its own ``try``: a failure prints the traceback (each rank) and the table says FAILED;
``--budget-s`` skips what would start after the budget (and cuts timed loops short, on all ranks together).
Rank 0 prints timestamped progress, the final table, and rewrites the ``--out`` JSON after every variant.
A failure on one rank only, before a collective the other rank is waiting in, cannot be recovered: that rank
waits ``--pg-timeout-s`` and the job aborts (the JSON keeps what finished before).
NCCL is kept off NVLink multicast (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``).
"""

from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import argparse
import datetime
import json
import math
import statistics
import sys
import time
import traceback

_T0 = time.monotonic()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import cce_inductor  # noqa: E402
from cce_inductor.distributed import (  # noqa: E402
    vocab_parallel_linear_cross_entropy,
    vocab_shard_range,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as H  # noqa: E402

# ----------------------------------------------------------------------------------------------------------------
# A Llama-3-like decoder
# ----------------------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_tables(head_dim: int, seq: int, theta: float = 500000.0, device=None):
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):  # x: (B, H, T, hd)
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[None, None], sin[None, None]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, ffn):
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = FeedForward(dim, ffn)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class HeadAndLoss(nn.Module):
    """Final norm, output head and loss in one module. Needed under FSDP2 + torch.compile(model): the FSDP
    hooks of the blocks called in the layer loop make Dynamo skip the root forward (a graph break in a for
    loop), so code written inline there runs eagerly; this module's forward is a frame of its own that Dynamo
    compiles, with head and loss in one graph (tests/test_distributed.py::test_fsdp2_layer_loop_*)."""

    def __init__(self, dim, vocab):
        super().__init__()
        self.vocab = vocab
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, h, labels):
        logits = self.output(self.norm(h))
        return F.cross_entropy(logits.float().view(-1, self.vocab), labels.view(-1))


class Llama(nn.Module):
    def __init__(self, vocab, dim, layers, n_heads, n_kv_heads, ffn, seq):
        super().__init__()
        self.vocab = vocab
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, n_kv_heads, ffn) for _ in range(layers))
        self.head = HeadAndLoss(dim, vocab)
        cos, sin = rope_tables(dim // n_heads, seq)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens, labels):
        t = tokens.shape[1]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.head(h, labels)


# ----------------------------------------------------------------------------------------------------------------
# Plumbing: logging, results, collectives over the ranks, timing, memory
# ----------------------------------------------------------------------------------------------------------------


class Ctx:
    """Process-wide state: args, device, results (written by rank 0 after every update), the time budget."""

    def __init__(self, args):
        self.args = args
        cuda = args.device == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.results = {"meta": {}, "fsdp": {}, "tp": {}, "errors": {}}

    # -- output
    def log(self, msg, all_ranks=False):
        if all_ranks or self.rank == 0:
            stamp = time.strftime("%H:%M:%S")
            print(f"[{stamp} +{time.monotonic() - _T0:6.1f}s r{self.rank}] {msg}", flush=True)

    def save(self):
        if self.rank == 0 and self.args.out:
            H.write_json(self.args.out, self.results)

    # -- collectives (on the communication device: CUDA for NCCL, CPU for gloo)
    def gather(self, values) -> list[list[float]]:
        """Every rank's list of floats (same length on every rank), as ``[rank][i]``; NaN stands for None."""
        t = torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float64, device=self.device)
        out = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(out, t)
        return [[None if math.isnan(x) else x for x in o.tolist()] for o in out]

    def all_true(self, flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def out_of_time(self) -> bool:
        """True on every rank once any rank is past ``--budget-s`` (a collective: call on all ranks together)."""
        if self.args.budget_s <= 0:
            return False
        return not self.all_true(time.monotonic() - _T0 < self.args.budget_s)

    # -- device
    def sync(self):
        H.sync(self.device.type)

    def free(self):
        self.sync()
        H.free(self.device.type)


def run_variant(ctx: Ctx, part: str, name: str, fn) -> None:
    """Run one variant on all ranks; record ``status`` ok / FAILED / SKIPPED in ``results[part][name]``."""
    entry = ctx.results[part].setdefault(name, {})
    if ctx.out_of_time():
        entry["status"] = "SKIPPED (budget)"
        ctx.log(f"{part}/{name}: skipped, past --budget-s {ctx.args.budget_s}")
        ctx.save()
        return
    ctx.log(f"{part}/{name}: start")
    started = time.monotonic()
    error = None
    try:
        fn(entry)
    except Exception:  # noqa: BLE001 - report it, keep the other variants and parts running
        error = traceback.format_exc()
        ctx.log(f"{part}/{name}: FAILED on this rank:\n{error}", all_ranks=True)
    ctx.free()
    ok = ctx.all_true(error is None)  # a variant that failed on any rank failed
    entry["status"] = "ok" if ok else "FAILED"
    entry["wall_s"] = round(time.monotonic() - started, 1)
    if error is not None:
        ctx.results["errors"][f"{part}/{name}/rank{ctx.rank}"] = error.strip().splitlines()[-1]
        entry["error"] = error.strip().splitlines()[-1]
    # rank 0 saves; make sure it knows about another rank's failure
    errs = ctx.gather([0.0 if error is None else 1.0])
    for r, (failed,) in enumerate(errs):
        if failed and r != ctx.rank:
            ctx.results["errors"].setdefault(f"{part}/{name}/rank{r}", "failed (see that rank's log)")
    ctx.log(f"{part}/{name}: {entry['status']} in {entry['wall_s']} s")
    ctx.save()


def time_steps(ctx: Ctx, fn, warmup: int, steps: int, on_step=None) -> tuple[list[float], int]:
    """``warmup`` untimed calls, then up to ``steps`` timed ones, each on its own (H.SyncedTimer). Past the budget
    all ranks stop together, after at least 1 warm-up and 2 timed calls. Returns the per-step milliseconds and the
    number of warm-up calls run."""
    done_warmup = 0
    for i in range(warmup):
        if i > 0 and ctx.out_of_time():  # at least one warm-up step
            break
        out = fn()
        done_warmup += 1
        if on_step is not None:
            on_step(f"warm-up {i + 1}/{warmup}", out, None)
    timer = H.SyncedTimer(ctx.device.type)
    for i in range(steps):
        if i > 1 and ctx.out_of_time():  # at least two timed steps
            ctx.log(f"budget reached: {i} of {steps} timed steps")
            break
        timer.start()
        out = fn()
        ms = timer.stop()
        if on_step is not None:
            on_step(f"step {i + 1}/{steps}", out, ms)
    return timer.wall_ms, done_warmup


def _mib(nbytes):
    return None if nbytes is None else nbytes / 2**20


def _max(values):
    values = [v for v in values if v is not None]
    return max(values) if values else None


def _no_graph_caches():
    """The pass must see every graph: an FX-graph / AOTAutograd cache hit skips it (and stats() stays empty).
    Inductor's kernel caches stay on (the second FSDP variant reuses the blocks' kernels)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    if hasattr(inductor_config, "fx_graph_cache"):
        inductor_config.fx_graph_cache = False
    if hasattr(functorch_config, "enable_autograd_cache"):
        functorch_config.enable_autograd_cache = False


# ----------------------------------------------------------------------------------------------------------------
# Part 1: FSDP2, plain Inductor vs the cce_inductor pass
# ----------------------------------------------------------------------------------------------------------------


def fsdp_variant(ctx: Ctx, variant: str, entry: dict) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    args, device = ctx.args, ctx.device
    torch._dynamo.reset()
    cce_inductor.reset_stats()
    ctx.free()
    before = H.Peak(device.type).start()
    entry["mem_before_model_mib"] = _max(r[0] for r in ctx.gather([_mib(before.base)]))

    gen = torch.Generator(device=device).manual_seed(1234 + ctx.rank)  # each rank its own data shard
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=device, generator=gen)
    labels = torch.randint(0, args.vocab, (args.batch, args.seq), device=device, generator=gen)

    torch.manual_seed(0)  # the same init on every rank and in both variants
    with torch.device(device):
        model = Llama(args.vocab, args.dim, args.layers, args.heads, args.kv_heads, args.ffn, args.seq)
    mp = MixedPrecisionPolicy(param_dtype=args.torch_dtype, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)  # tok_embeddings and head stay in the root unit (see the docstring)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=True)
    backend = cce_inductor.make_backend(drop_logits=True) if variant == "cce" else "inductor"
    compiled = torch.compile(model, backend=backend, dynamic=False)

    def step():
        loss = compiled(tokens, labels)
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        return loss.detach()

    losses = []

    def on_step(what, loss, ms):
        losses.append(loss.item())
        ctx.log(f"fsdp/{variant}: {what} loss {losses[-1]:.5f}" + ("" if ms is None else f" {ms:.1f} ms"))

    # the first step compiles (forward and backward)
    t0 = time.monotonic()
    losses.append(step().item())
    ctx.sync()
    entry["first_step_s"] = round(time.monotonic() - t0, 1)
    ctx.log(f"fsdp/{variant}: first step (compile) {entry['first_step_s']} s, loss {losses[0]:.5f}")
    stats = cce_inductor.stats()
    entry.update(H.stats_fields(stats))
    ctx.log(f"fsdp/{variant}: cce_inductor.stats(): {stats['summary']}")

    with H.Peak(device.type) as peak:  # its base: sharded params + grads-to-be-freed + AdamW states
        times, done_warmup = time_steps(ctx, step, args.warmup, args.steps, on_step)

    per_rank = ctx.gather([statistics.median(times), peak.mb, _mib(peak.base)])
    all_losses = ctx.gather(losses)  # [rank][step]; the same count on every rank
    entry.update(
        tokens_per_rank=args.batch * args.seq,
        warmup=done_warmup,
        timed_steps=len(times),
        step_ms=_max(r[0] for r in per_rank),
        step_ms_per_rank=[r[0] for r in per_rank],
        step_ms_all_rank0=[round(t, 2) for t in times] if ctx.rank == 0 else None,
        peak_mib=_max(r[1] for r in per_rank),
        peak_mib_per_rank=[r[1] for r in per_rank],
        static_mib_per_rank=[r[2] for r in per_rank],
        losses_per_rank=all_losses,
        losses_mean=[sum(s) / len(s) for s in zip(*all_losses)],
    )
    compiled = model = optim = step = None
    torch._dynamo.reset()


def fsdp_compare(ctx: Ctx) -> None:
    res = ctx.results["fsdp"]
    a, b = res.get("inductor", {}), res.get("cce", {})
    if a.get("status") != "ok" or b.get("status") != "ok":
        return
    la, lb = a["losses_per_rank"], b["losses_per_rank"]
    n = min(len(la[0]), len(lb[0]))
    diffs = [abs(x - y) for ra, rb in zip(la, lb) for x, y in zip(ra[:n], rb[:n])]
    rels = [abs(x - y) / max(abs(y), 1e-30) for ra, rb in zip(la, lb) for x, y in zip(ra[:n], rb[:n])]
    first = [abs(ra[0] - rb[0]) for ra, rb in zip(la, lb)]
    res["comparison"] = dict(
        steps_compared=n,
        loss_max_abs_diff=max(diffs),
        loss_max_rel_diff=max(rels),
        first_step_abs_diff=max(first),
        peak_ratio_cce_over_inductor=(b["peak_mib"] / a["peak_mib"]) if a.get("peak_mib") else None,
        peak_saved_mib=(a["peak_mib"] - b["peak_mib"]) if a.get("peak_mib") is not None else None,
        step_time_ratio_cce_over_inductor=b["step_ms"] / a["step_ms"],
    )
    ctx.log(f"fsdp comparison: {json.dumps(res['comparison'])}")
    ctx.save()


# ----------------------------------------------------------------------------------------------------------------
# Part 2: TP, vocabulary-parallel CCE vs loss_parallel
# ----------------------------------------------------------------------------------------------------------------


class TPBench:
    """A ``ColwiseParallel`` head of ``vocab x dim`` over all ranks, replicated hidden states and targets, and
    the eager ``loss_parallel`` reference (loss, dE, this rank's dC shard)."""

    def __init__(self, ctx: Ctx):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        self.ctx = ctx
        args, device = ctx.args, ctx.device
        self.mesh = init_device_mesh(device.type, (ctx.world,))
        torch.manual_seed(0)
        self.head = nn.Linear(args.dim, args.vocab, bias=False, device=device, dtype=args.torch_dtype)
        nn.init.normal_(self.head.weight, std=1.0 / math.sqrt(args.dim))
        parallelize_module(self.head, self.mesh, ColwiseParallel(use_local_output=False))
        local_w = self.head.weight.to_local()
        # ColwiseParallel shards the weight's dim 0 like torch.chunk
        self.vocab_start, v_local = vocab_shard_range(args.vocab, self.mesh.get_local_rank(), ctx.world)
        assert local_w.shape[0] == v_local, (local_w.shape, v_local)
        self.w_ours = local_w.detach().clone().requires_grad_()

        gen = torch.Generator(device=device).manual_seed(7)  # the same hidden states and targets on every rank
        self.hidden = torch.randn(args.tokens, args.dim, device=device, dtype=args.torch_dtype, generator=gen)
        self.targets = torch.randint(0, args.vocab, (args.tokens,), device=device, generator=gen)
        self.targets[:: args.ignore_every] = -100
        self.ref = tuple(t.detach().clone() for t in self.run_loss_parallel())
        self.clear()

    def clear(self):
        self.head.weight.grad = None
        self.w_ours.grad = None

    def run_loss_parallel(self):
        from torch.distributed.tensor.parallel import loss_parallel

        h = self.hidden.detach().requires_grad_()
        self.head.weight.grad = None
        with loss_parallel():
            loss = F.cross_entropy(self.head(h).float(), self.targets)
            loss.backward()
        return loss.to_local(), h.grad, self.head.weight.grad.to_local()

    def run_ours(self):
        h = self.hidden.detach().requires_grad_()
        self.w_ours.grad = None
        loss = vocab_parallel_linear_cross_entropy(
            h, self.w_ours, self.targets, vocab_start=self.vocab_start, vocab_size=self.ctx.args.vocab
        )
        loss.backward()
        return loss, h.grad, self.w_ours.grad

    def compiled_runner(self, backend):
        from torch.distributed.tensor.parallel import loss_parallel

        head = self.head

        def head_loss(h, y):
            return F.cross_entropy(head(h).float(), y)

        compiled = torch.compile(head_loss, backend=backend, fullgraph=True, dynamic=False)

        def run():
            h = self.hidden.detach().requires_grad_()
            head.weight.grad = None
            with loss_parallel():
                loss = compiled(h, self.targets)
                loss.backward()
            return loss.to_local(), h.grad, head.weight.grad.to_local()

        return run

    def measure(self, name: str, fn, entry: dict) -> None:
        ctx, args = self.ctx, self.ctx.args
        cce_inductor.reset_stats()
        t0 = time.monotonic()
        got = fn()  # compiles the compiled variants
        ctx.sync()
        entry["first_call_s"] = round(time.monotonic() - t0, 1)
        rel = ctx.gather([H.rel_err(a, b) for a, b in zip(got, self.ref)])
        stats = cce_inductor.stats()
        entry.update(
            loss=got[0].item(),
            ref_loss=self.ref[0].item(),
            loss_rel_diff=_max(r[0] for r in rel),
            dE_rel_diff=_max(r[1] for r in rel),
            dC_shard_rel_diff=_max(r[2] for r in rel),
        )
        if stats["graphs"]:
            entry.update(H.stats_fields(stats))
        ctx.log(
            f"tp/{name}: first call {entry['first_call_s']} s; vs eager loss_parallel: "
            f"loss {entry['loss_rel_diff']:.2e}"
            f" dE {entry['dE_rel_diff']:.2e} dC {entry['dC_shard_rel_diff']:.2e}; rewritten {stats['rewritten']}"
        )
        del got
        self.clear()
        ctx.free()
        with H.Peak(ctx.device.type) as peak:
            times, done_warmup = time_steps(ctx, fn, args.warmup, args.steps)
        self.clear()
        per_rank = ctx.gather([statistics.median(times), peak.above_mb])
        entry.update(
            tokens=args.tokens,
            vocab=args.vocab,
            dim=args.dim,
            warmup=done_warmup,
            timed_steps=len(times),
            fwd_bwd_ms=_max(r[0] for r in per_rank),
            fwd_bwd_ms_per_rank=[r[0] for r in per_rank],
            peak_above_inputs_mib=_max(r[1] for r in per_rank),
            peak_above_inputs_mib_per_rank=[r[1] for r in per_rank],
        )
        ctx.log(
            f"tp/{name}: {entry['fwd_bwd_ms']:.2f} ms fwd+bwd, "
            f"peak above inputs {_fmt(entry['peak_above_inputs_mib'], '.0f')} MiB"
        )


def tp_variants(ctx: Ctx, names: list[str]) -> None:
    holder = {}

    def setup(entry):
        holder["bench"] = TPBench(ctx)

    setup_name = "_setup" if "loss_parallel" in names else "_setup_compiled"
    run_variant(ctx, "tp", setup_name, setup)
    bench = holder.get("bench")
    setup_status = ctx.results["tp"][setup_name]["status"]

    def make_fn(name):
        if name == "loss_parallel":
            return bench.run_loss_parallel
        if name == "vocab_parallel_cce":
            return bench.run_ours
        if name == "compiled_loss_parallel":
            torch._dynamo.reset()
            return bench.compiled_runner("inductor")
        if name == "compiled_cce_tp_pass":
            torch._dynamo.reset()
            return bench.compiled_runner(cce_inductor.backend)
        raise ValueError(name)

    for name in names:
        if setup_status != "ok":  # the same on every rank
            entry = ctx.results["tp"].setdefault(name, {})
            entry["status"] = setup_status if setup_status.startswith("SKIPPED") else "FAILED"
            entry["error"] = f"setup: {setup_status}"
            continue
        run_variant(ctx, "tp", name, lambda entry, name=name: bench.measure(name, make_fn(name), entry))
    bench = holder = None
    torch._dynamo.reset()
    ctx.free()


# ----------------------------------------------------------------------------------------------------------------
# Table
# ----------------------------------------------------------------------------------------------------------------


def _fmt(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def print_table(ctx: Ctx) -> None:
    if ctx.rank != 0:
        return
    res = ctx.results
    unit = "" if ctx.device.type == "cuda" else " (CPU: no memory figures)"
    lines = ["", f"== distributed_bench: world {ctx.world}, {res['meta'].get('device_name')}{unit} =="]
    lines.append(
        f"{'part':5} {'variant':24} {'status':17} {'ms/step':>9} {'n':>3} {'peak MiB':>9} {'rewritten':>9}  agreement"
    )
    for name in ("inductor", "cce"):
        e = res["fsdp"].get(name)
        if e is None:
            continue
        ok = e.get("status") == "ok"
        agree = ""
        if name == "cce" and "comparison" in res["fsdp"]:
            c = res["fsdp"]["comparison"]
            agree = (
                f"loss vs inductor over {c['steps_compared']} steps: max|d| {c['loss_max_abs_diff']:.2e} "
                f"(rel {c['loss_max_rel_diff']:.1e})"
            )
        lines.append(
            f"{'fsdp':5} {name:24} {e.get('status', '?'):17} {_fmt(e.get('step_ms') if ok else None):>9} "
            f"{_fmt(e.get('timed_steps') if ok else None, 'd'):>3} "
            f"{_fmt(e.get('peak_mib') if ok else None, '.0f'):>9} "
            f"{str(e.get('rewritten', '-')) if ok else '-':>9}  {agree}"
        )
    for name in ("loss_parallel", "vocab_parallel_cce", "compiled_loss_parallel", "compiled_cce_tp_pass"):
        e = res["tp"].get(name)
        if e is None:
            continue
        ok = e.get("status") == "ok"
        agree = ""
        if ok and name != "loss_parallel":
            agree = (
                f"vs loss_parallel rel: loss {e['loss_rel_diff']:.1e} dE {e['dE_rel_diff']:.1e} "
                f"dC {e['dC_shard_rel_diff']:.1e}"
            )
        rw = str(e.get("rewritten", "-")) if ok else "-"
        lines.append(
            f"{'tp':5} {name:24} {e.get('status', '?'):17} {_fmt(e.get('fwd_bwd_ms') if ok else None, '.2f'):>9} "
            f"{_fmt(e.get('timed_steps') if ok else None, 'd'):>3} "
            f"{_fmt(e.get('peak_above_inputs_mib') if ok else None, '.0f'):>9} {rw:>9}  {agree}"
        )
    if "comparison" in res["fsdp"]:
        c = res["fsdp"]["comparison"]
        lines.append(
            f"fsdp: peak cce/inductor {_fmt(c['peak_ratio_cce_over_inductor'], '.3f')}, "
            f"step time cce/inductor {c['step_time_ratio_cce_over_inductor']:.3f}"
        )
    lines.append(
        "fsdp: ms/step = median fwd+bwd+AdamW over n timed steps (after warm-up), peak = max over ranks of "
        "max_memory_allocated over warm-up + timed steps; tp: ms = median fwd+bwd, peak above the inputs"
    )
    for key, err in res["errors"].items():
        lines.append(f"error {key}: {err}")
    print("\n".join(lines), flush=True)


# ----------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------

SIZES = {
    # Llama-3 8B widths, 2 layers, untied 128256 head (~1.5 B parameters)
    "llama3": dict(vocab=128256, dim=4096, layers=2, heads=32, kv_heads=8, ffn=14336, seq=4096, batch=2, tokens=8192),
    "small": dict(vocab=128256, dim=2048, layers=2, heads=16, kv_heads=8, ffn=8192, seq=2048, batch=1, tokens=4096),
    "tiny": dict(vocab=1000, dim=64, layers=2, heads=4, kv_heads=2, ffn=128, seq=64, batch=2, tokens=256),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda: NCCL, one GPU per rank; cpu: gloo (a dry run, tiny sizes by default)",
    )
    parser.add_argument(
        "--size", choices=tuple(SIZES), default=None, help="preset (default: llama3 on cuda, tiny on cpu)"
    )
    parser.add_argument("--parts", default="fsdp,tp", help="comma-separated: fsdp, tp")
    parser.add_argument("--no-tp-compiled", action="store_true", help="skip the compiled TP variants")
    for name in ("vocab", "dim", "layers", "heads", "kv_heads", "ffn", "seq", "batch", "tokens"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=None, help="overrides the preset")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--ignore-every", type=int, default=10, help="TP: every n-th target is ignore_index")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps after the compiling first call")
    parser.add_argument("--quick", action="store_true", help="1 warm-up + 3 timed steps")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=0.0,
        help="skip variants that would start later than this many seconds after launch, and cut "
        "timed loops short (0: no budget)",
    )
    parser.add_argument(
        "--pg-timeout-s",
        type=float,
        default=180.0,
        help="collective timeout (a rank stuck in a collective aborts after this long)",
    )
    parser.add_argument("--out", default="distributed_bench.json", help="JSON of the results (rank 0 writes it)")
    args = parser.parse_args(argv)
    preset = SIZES[args.size or ("llama3" if args.device == "cuda" else "tiny")]
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.quick:
        args.warmup, args.steps = 1, 3
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(args.parts) - {"fsdp", "tp"}
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}")
    if args.dim % args.heads or args.heads % args.kv_heads:
        parser.error("dim must be a multiple of heads, heads a multiple of kv-heads")
    args.torch_dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    return args


def main():
    args = parse_args()
    timeout = datetime.timedelta(seconds=args.pg_timeout_s)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("--device cuda but no CUDA device")
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", local_rank))
    else:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", timeout=timeout)
    ctx = Ctx(args)
    try:
        _no_graph_caches()
        meta = ctx.results["meta"]
        meta.update(
            torch=torch.__version__,
            cce_inductor=cce_inductor.__version__,
            world=ctx.world,
            device=args.device,
            device_name=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"),
            torch_symm_mem_disable_multicast=os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST"),
            started=time.strftime("%Y-%m-%d %H:%M:%S"),
            args={k: v for k, v in vars(args).items() if k != "torch_dtype"},
        )
        try:
            import triton

            meta["triton"] = triton.__version__
        except ImportError:
            meta["triton"] = None
        ctx.log(
            f"torch {torch.__version__}, triton {meta['triton']}, world {ctx.world}, {meta['device_name']}; "
            f"args {json.dumps(meta['args'])}"
        )
        ctx.save()

        tp_compiled = [] if args.no_tp_compiled else ["compiled_loss_parallel", "compiled_cce_tp_pass"]
        if "tp" in args.parts:  # cheap eager variants first
            tp_variants(ctx, ["loss_parallel", "vocab_parallel_cce"])
        if "fsdp" in args.parts:
            for variant in ("inductor", "cce"):
                run_variant(ctx, "fsdp", variant, lambda entry, v=variant: fsdp_variant(ctx, v, entry))
            fsdp_compare(ctx)
        if "tp" in args.parts and tp_compiled:
            tp_variants(ctx, tp_compiled)
        ctx.results["meta"]["total_s"] = round(time.monotonic() - _T0, 1)
        ctx.save()
        print_table(ctx)
        if ctx.rank == 0 and args.out:
            print(f"results: {os.path.abspath(args.out)}", flush=True)
        dist.barrier()
    except Exception:
        ctx.log(f"FAILED outside the variants:\n{traceback.format_exc()}", all_ranks=True)
        ctx.save()
        print_table(ctx)
        raise
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
