"""Distributed benchmark (2 GPUs, NCCL): the cce_inductor pass under FSDP2, and the vocabulary-parallel loss under TP=2.

NOT RUN YET: written on a CPU-only machine; the code paths it uses are covered on CPU/gloo by
``tests/test_distributed.py`` (same FSDP2 wrapping, same vocab-parallel call), but no GPU figure exists.

    torchrun --standalone --nproc-per-node 2 examples/distributed_bench.py                 # both parts
    torchrun --standalone --nproc-per-node 2 examples/distributed_bench.py --part fsdp --steps 20
    torchrun --standalone --nproc-per-node 2 examples/distributed_bench.py --part tp --tokens 16384

Part ``fsdp``: a Llama-3-like model (RMSNorm, RoPE, GQA attention, SwiGLU, untied 128256-entry head,
``F.cross_entropy(logits.float().view(-1, V), labels.view(-1))`` in a ``HeadAndLoss`` module: see its
docstring for why it must not be inline in the root ``forward``) sharded with FSDP2
(``fully_shard`` per block and on the root; bf16 params, fp32 reduction), compiled with plain Inductor and
with ``cce_inductor.backend``: step time (median of CUDA-event timings) and peak memory per rank, the loss of
both runs on the same data, and ``cce_inductor.stats()``. The head stays in the root's FSDP unit: the output
``Linear`` as a unit of its own gets (dynamo-disabled) FSDP hooks that break the graph between head and loss,
and nothing is rewritten (``test_fsdp2_lm_head_unit_hides_the_loss``); ``fully_shard(model.head)`` (head
*and* loss) would be fine (``test_fsdp2_head_and_loss_unit_is_rewritten``).

Part ``tp``: the output head split by vocabulary over 2 GPUs (``ColwiseParallel``): forward + backward of
``torch.distributed.tensor.parallel.loss_parallel`` on materialised logits against
``cce_inductor.distributed.vocab_parallel_linear_cross_entropy`` on the local shard, and the same head + loss
compiled (plain Inductor; the cce backend with the prototype ``TensorParallelGraphPass``): time, peak memory
above the inputs, and the loss / gradient differences to eager ``loss_parallel``.

NCCL is kept off NVLink multicast (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``).
Rank 0 prints one JSON line per measurement.
"""

from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import cce_inductor  # noqa: E402
from cce_inductor.distributed import (  # noqa: E402
    TensorParallelGraphPass,
    vocab_parallel_linear_cross_entropy,
    vocab_shard_range,
)

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
# Helpers
# ----------------------------------------------------------------------------------------------------------------


def report(**fields):
    if dist.get_rank() == 0:
        print(json.dumps(fields), flush=True)


def timed(fn, steps: int, warmup: int):
    """Median milliseconds of ``fn()`` over ``steps`` runs after ``warmup``; CUDA events, no per-step sync."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def max_over_ranks(value: float) -> float:
    t = torch.tensor([value], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


# ----------------------------------------------------------------------------------------------------------------
# Part 1: FSDP2, plain Inductor vs the cce_inductor pass
# ----------------------------------------------------------------------------------------------------------------


def bench_fsdp(args):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator(device="cuda").manual_seed(1234 + rank)  # each rank its own data shard
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda", generator=gen)
    labels = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda", generator=gen)

    results = {}
    for variant in ("inductor", "cce"):
        torch._dynamo.reset()
        cce_inductor.reset_stats()
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = Llama(args.vocab, args.dim, args.layers, args.heads, args.kv_heads, args.ffn, args.seq)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.layers:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)  # tok_embeddings and head stay in the root unit (see docstring)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        backend = cce_inductor.backend if variant == "cce" else "inductor"
        compiled = torch.compile(model, backend=backend)

        losses = []

        def step():
            loss = compiled(tokens, labels)
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            losses.append(loss.detach())

        step()  # compile
        first_loss = losses[0].item()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        ms = timed(step, args.steps, args.warmup)
        peak = torch.cuda.max_memory_allocated() / 2**20
        stats = cce_inductor.stats()
        results[variant] = dict(
            step_ms=max_over_ranks(ms), peak_mib=max_over_ranks(peak), first_loss=first_loss,
            rewritten=stats["rewritten"], skipped_reasons=stats["reasons"], graphs=stats["graphs"],
        )  # fmt: skip
        report(part="fsdp", variant=variant, tokens_per_rank=args.batch * args.seq, **results[variant])
        del compiled, model, optim, losses
        torch.cuda.empty_cache()
    report(
        part="fsdp", summary=True,
        peak_saved_mib=results["inductor"]["peak_mib"] - results["cce"]["peak_mib"],
        speedup=results["inductor"]["step_ms"] / results["cce"]["step_ms"],
        first_loss_diff=abs(results["inductor"]["first_loss"] - results["cce"]["first_loss"]),
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# Part 2: TP=2, vocabulary-parallel CCE vs loss_parallel
# ----------------------------------------------------------------------------------------------------------------


def bench_tp(args):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

    world = dist.get_world_size()
    mesh = init_device_mesh("cuda", (world,))
    dtype = torch.bfloat16
    torch.manual_seed(0)
    head = nn.Linear(args.dim, args.vocab, bias=False, device="cuda", dtype=dtype)
    nn.init.normal_(head.weight, std=1.0 / math.sqrt(args.dim))
    parallelize_module(head, mesh, ColwiseParallel(use_local_output=False))
    local_w = head.weight.to_local()
    # ColwiseParallel shards the weight's dim 0 like torch.chunk
    vocab_start, v_local = vocab_shard_range(args.vocab, mesh.get_coordinate()[0], world)
    assert local_w.shape[0] == v_local, (local_w.shape, v_local)

    gen = torch.Generator(device="cuda").manual_seed(7)  # the same hidden states and targets on every rank
    hidden = torch.randn(args.tokens, args.dim, device="cuda", dtype=dtype, generator=gen)
    targets = torch.randint(0, args.vocab, (args.tokens,), device="cuda", generator=gen)
    targets[:: args.ignore_every] = -100

    def run_loss_parallel():
        h = hidden.detach().requires_grad_()
        head.weight.grad = None
        with loss_parallel():
            loss = F.cross_entropy(head(h).float(), targets)
            loss.backward()
        return loss.to_local(), h.grad, head.weight.grad.to_local()

    w_ours = local_w.detach().clone().requires_grad_()

    def run_ours():
        h = hidden.detach().requires_grad_()
        w_ours.grad = None
        loss = vocab_parallel_linear_cross_entropy(h, w_ours, targets, vocab_start=vocab_start, vocab_size=args.vocab)
        loss.backward()
        return loss, h.grad, w_ours.grad

    ref = run_loss_parallel()
    ours = run_ours()
    rel = [((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(ours, ref)]
    report(part="tp", check="ours vs loss_parallel", loss_rel=rel[0], dE_rel=rel[1], dC_shard_rel=rel[2])

    # Compiled: ColwiseParallel head + loss_parallel through plain Inductor, and through the cce backend with
    # the prototype TensorParallelGraphPass (rewrites the site into dtensor_linear_cross_entropy).
    import torch._inductor.config as inductor_config

    def tp_backend(gm, example_inputs, **kwargs):
        with inductor_config.patch(pre_grad_custom_pass=TensorParallelGraphPass()):
            return cce_inductor.backend(gm, example_inputs, **kwargs)

    def head_loss(h, y):
        return F.cross_entropy(head(h).float(), y)

    def compiled_runner(backend):
        compiled = torch.compile(head_loss, backend=backend, fullgraph=True)

        def run():
            h = hidden.detach().requires_grad_()
            head.weight.grad = None
            with loss_parallel():
                loss = compiled(h, targets)
                loss.backward()
            return loss.to_local(), h.grad, head.weight.grad.to_local()

        return run

    variants = [
        ("loss_parallel", run_loss_parallel),
        ("vocab_parallel_cce", run_ours),
        ("compiled_loss_parallel", compiled_runner("inductor")),
        ("compiled_tp_pass", compiled_runner(tp_backend)),
    ]
    for name, fn in variants:
        cce_inductor.reset_stats()
        got = fn()  # compiles the compiled variants
        rel = [((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(got, ref)]
        report(part="tp", variant=name, check="vs eager loss_parallel", loss_rel=rel[0], dE_rel=rel[1],
               dC_shard_rel=rel[2], rewritten=cce_inductor.stats()["rewritten"])  # fmt: skip
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
        ms = timed(fn, args.steps, args.warmup)
        peak = torch.cuda.max_memory_allocated() / 2**20 - base
        report(part="tp", variant=name, tokens=args.tokens, vocab=args.vocab, dim=args.dim,
               fwd_bwd_ms=max_over_ranks(ms), peak_above_inputs_mib=max_over_ranks(peak))  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("fsdp", "tp", "all"), default="all")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank (fsdp part)")
    parser.add_argument("--tokens", type=int, default=8192, help="rows of the TP loss (tp part)")
    parser.add_argument("--ignore-every", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        report(torch=torch.__version__, world=dist.get_world_size(), device=torch.cuda.get_device_name(),
               nccl_nvls=os.environ["NCCL_NVLS_ENABLE"], args=vars(args))  # fmt: skip
        if args.part in ("fsdp", "all"):
            bench_fsdp(args)
        if args.part in ("tp", "all"):
            bench_tp(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
