"""Distributed training with cce_inductor: a compiled DDP model, and the vocabulary-parallel loss of a sharded head.

    torchrun --standalone --nproc-per-node 2 examples/distributed.py --device cpu     # gloo, tiny, < 1 minute
    torchrun --standalone --nproc-per-node 2 examples/distributed.py --device cuda    # NCCL, one GPU per process

1. DDP: ``torch.compile(DistributedDataParallel(model), backend=cce_inductor.backend)``. DDP's graph splitting
   never separates the head from its loss, so the loss is rewritten on every rank; each rank prints its
   ``stats()["summary"]``.
2. Tensor parallelism: each rank holds the rows ``[vocab_start, vocab_start + V / world)`` of the head (a
   vocabulary-sharded, ``ColwiseParallel`` head) and calls
   ``cce_inductor.distributed.vocab_parallel_linear_cross_entropy``: no rank forms any logits; one all-gather of
   ``2 x N`` floats combines the shards. Each rank checks its loss and gradients against ``F.cross_entropy`` on
   the whole head. (A compiled ``ColwiseParallel`` head under ``loss_parallel()`` is rewritten into the same loss by
   the pass.)
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import cce_inductor
from cce_inductor.distributed import vocab_parallel_linear_cross_entropy


class TinyLM(nn.Module):
    """Embedding, one MLP block, an untied head and the loss in ``forward``: the site the pass rewrites."""

    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.block = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids, labels):
        x = self.embed(ids)
        x = x + self.block(x)
        logits = self.lm_head(x)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)


def ddp_part(args, device, rank):
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts them)
    model = TinyLM(args.vocab, args.dim).to(device)
    compiled = torch.compile(DDP(model), backend=cce_inductor.backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1 + rank)  # each rank its own data
    for step in range(args.steps):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device)
        labels = torch.roll(ids, -1, dims=1)
        labels[:, -1] = -100
        loss = compiled(ids, labels)
        loss.backward()  # DDP averages the gradients over the ranks
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"[ddp] step {step}  loss {loss.item():.4f} (rank 0's batch)", flush=True)
    print(f"[ddp] rank {rank}: {cce_inductor.stats()['summary']}", flush=True)


def tp_part(args, device, rank, world):
    torch.manual_seed(0)
    n, dim, vocab = args.batch * args.seq, args.dim, args.vocab
    hidden = torch.randn(n, dim, device=device)  # the same on every rank, as the head's input is under TP
    weight = torch.randn(vocab, dim, device=device) / dim**0.5
    targets = torch.randint(0, vocab, (n,), device=device)
    targets[::10] = -100

    shard = vocab // world
    vocab_start = rank * shard
    e = hidden.clone().requires_grad_(True)
    c_shard = weight[vocab_start : vocab_start + shard].clone().requires_grad_(True)
    loss = vocab_parallel_linear_cross_entropy(e, c_shard, targets, vocab_start=vocab_start, vocab_size=vocab)
    loss.backward()

    # reference on one rank: the whole head, the logits materialised
    e_ref, c_ref = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    ref = F.cross_entropy(e_ref @ c_ref.T, targets, ignore_index=-100)
    ref.backward()
    c_ref_shard = c_ref.grad[vocab_start : vocab_start + shard]
    c_err = (c_shard.grad - c_ref_shard).norm() / c_ref_shard.norm()
    e_err = (e.grad - e_ref.grad).norm() / e_ref.grad.norm()
    print(
        f"[tp] rank {rank}: vocabulary rows [{vocab_start}, {vocab_start + shard}), loss {loss.item():.6f} "
        f"(F.cross_entropy on the whole head: {ref.item():.6f}); relative difference of dE {e_err.item():.1e}, "
        f"of this shard's dC {c_err.item():.1e}",
        flush=True,
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto (default: CUDA if available), cpu, cuda")
    parser.add_argument("--vocab", type=int, default=4096, help="divisible by the number of processes")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        raise SystemExit(
            "launch with torchrun, e.g. torchrun --standalone --nproc-per-node 2 examples/distributed.py --device cpu"
        )
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.vocab % world:
        raise SystemExit(f"--vocab {args.vocab} must be divisible by the {world} processes")
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda" if cuda else "cpu")
    try:
        ddp_part(args, device, rank)
        tp_part(args, device, rank, world)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
