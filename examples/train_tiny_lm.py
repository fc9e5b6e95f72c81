"""Train a small GPT-style language model with ``torch.compile(model, backend=cce_inductor.backend)``.

The model code is ordinary PyTorch (tied embeddings, pre-LN attention blocks, ``F.cross_entropy`` on the logits);
the cce_inductor backend rewrites its ``lm_head -> cross_entropy`` into the fused op, so the ``N x V`` logits are
never materialised. The data are synthetic tokens from a fixed random Markov chain (each token has 4 likely
successors), so the loss visibly drops from ``ln(V)`` towards the chain's entropy (at most 0.94 nats).

    python examples/train_tiny_lm.py                      # auto device: CUDA if available, else CPU
    python examples/train_tiny_lm.py --device cpu --steps 100
    python examples/train_tiny_lm.py --device cuda --steps 200 --batch 16 --seq 1024

Prints the loss every few steps, how many loss sites the pass rewrote (``cce_inductor.stats()``) and, on CUDA,
the peak memory of one training step next to the same model (same seed) under plain ``torch.compile``.
Defaults: CPU -- vocabulary 8192, 2 layers, width 128, fp32, batch 8 x 64 tokens, 30 steps;
CUDA -- vocabulary 32768, 4 layers, width 512, bf16, batch 8 x 1024 tokens, 100 steps.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import cce_inductor

# ------------------------------------------------------------------------------------------------------------------
# Model
# ------------------------------------------------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.tok.weight  # tied embeddings
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))


# ------------------------------------------------------------------------------------------------------------------
# Data: a fixed random Markov chain over the vocabulary
# ------------------------------------------------------------------------------------------------------------------

SUCCESSOR_PROBS = torch.tensor([0.7, 0.1, 0.1, 0.1])  # each token's next token: one of 4 successors
ZIPF_EXPONENT = 1.2  # successors are drawn from a Zipf law over a random permutation of the vocabulary


class MarkovTokens:
    """Token streams from a fixed random Markov chain: ``next = successors[prev, j]``, ``j ~ SUCCESSOR_PROBS``.

    Successors are Zipf-distributed, so a few hundred tokens carry most of the mass (the loss drops fast from
    ``ln V`` as the model learns them) and the rest of the structure is learned token by token.
    """

    def __init__(self, vocab: int, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        zipf = torch.arange(1, vocab + 1, dtype=torch.float64) ** -ZIPF_EXPONENT
        ranks = torch.multinomial(zipf.float(), vocab * len(SUCCESSOR_PROBS), replacement=True, generator=gen)
        self.successors = torch.randperm(vocab, generator=gen)[ranks].view(vocab, len(SUCCESSOR_PROBS))
        self.vocab = vocab
        self.gen = torch.Generator().manual_seed(seed + 1)

    def batch(self, batch: int, seq: int, device):
        tokens = torch.empty(batch, seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, self.vocab, (batch,), generator=self.gen)
        choices = torch.multinomial(SUCCESSOR_PROBS, batch * seq, replacement=True, generator=self.gen).view(batch, seq)
        for i in range(seq):
            tokens[:, i + 1] = self.successors[tokens[:, i], choices[:, i]]
        tokens = tokens.to(device)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


# ------------------------------------------------------------------------------------------------------------------
# Training
# ------------------------------------------------------------------------------------------------------------------


def build(args, device, dtype):
    torch.manual_seed(args.seed)
    model = TinyLM(args.vocab, args.dim, args.layers, args.heads, args.seq).to(device=device, dtype=dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, fused=device.type == "cuda")
    return model, optimizer


def train_step(compiled, optimizer, x, y):
    loss = compiled(x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def step_peak_memory(compiled, optimizer, data, args, device) -> float:
    """Peak GPU memory (MiB) of one training step after a warm-up (compile) step."""
    x, y = data.batch(args.batch, args.seq, device)
    train_step(compiled, optimizer, x, y)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    train_step(compiled, optimizer, x, y)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) / 2**20


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:1, ...")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: 30 on CPU, 100 on CUDA)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: 64 on CPU, 1024 on CUDA)")
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary (default: 8192 on CPU, 32768 on CUDA)")
    parser.add_argument("--dim", type=int, default=None, help="model width (default: 128 on CPU, 512 on CUDA)")
    parser.add_argument("--layers", type=int, default=None, help="blocks (default: 2 on CPU, 4 on CUDA)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="parameter dtype (default: float32 on CPU, bfloat16 on CUDA)",
    )
    parser.add_argument("--log-every", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-baseline", action="store_true", help="CUDA: skip the plain torch.compile comparison")
    args = parser.parse_args(argv)

    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else "cpu"
        if args.device == "auto"
        else args.device
    )
    cuda = device.type == "cuda"
    args.steps = args.steps if args.steps is not None else (100 if cuda else 30)
    args.seq = args.seq if args.seq is not None else (1024 if cuda else 64)
    args.vocab = args.vocab if args.vocab is not None else (32768 if cuda else 8192)
    args.dim = args.dim if args.dim is not None else (512 if cuda else 128)
    args.layers = args.layers if args.layers is not None else (4 if cuda else 2)
    args.log_every = args.log_every or max(1, args.steps // 10)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)

    print(
        f"device={device} dtype={str(dtype).removeprefix('torch.')} vocab={args.vocab} dim={args.dim} "
        f"layers={args.layers} batch={args.batch}x{args.seq} steps={args.steps}"
    )
    print(
        f"loss starts near ln(V) = {math.log(args.vocab):.2f}; the data's entropy is at most "
        f"{-(SUCCESSOR_PROBS * SUCCESSOR_PROBS.log()).sum():.2f} nats"
    )

    model, optimizer = build(args, device, dtype)
    compiled = torch.compile(model, backend=cce_inductor.backend)
    data = MarkovTokens(args.vocab, seed=args.seed)

    cce_inductor.reset_stats()
    start = time.perf_counter()
    first_step_s = None
    for step in range(args.steps):
        x, y = data.batch(args.batch, args.seq, device)
        loss = train_step(compiled, optimizer, x, y)
        if step == 0:
            first_step_s = time.perf_counter() - start
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}")
    total_s = time.perf_counter() - start
    steady = (total_s - first_step_s) / max(1, args.steps - 1)
    print(f"first step (compile) {first_step_s:.1f} s, then {1000 * steady:.1f} ms/step")

    stats = cce_inductor.stats()
    print(f"cce_inductor: rewritten {stats['rewritten']} loss site(s) -- {stats.get('summary', stats['reasons'])}")

    if cuda and not args.no_baseline:
        cce_peak = step_peak_memory(compiled, optimizer, data, args, device)
        del compiled, model, optimizer
        torch.cuda.empty_cache()
        # plain torch.compile: make sure the pass is not on globally (CCE_INDUCTOR=1 would turn it on)
        was_enabled = cce_inductor.is_enabled()
        cce_inductor.disable()
        base_model, base_optimizer = build(args, device, dtype)
        base_compiled = torch.compile(base_model)
        base_peak = step_peak_memory(base_compiled, base_optimizer, data, args, device)
        if was_enabled:
            cce_inductor.enable()
        logits_mib = args.batch * args.seq * args.vocab * 4 / 2**20
        print(
            f"peak memory of a training step: cce_inductor {cce_peak:.0f} MiB, plain torch.compile "
            f"{base_peak:.0f} MiB ({base_peak / cce_peak:.2f}x; fp32 logits alone are {logits_mib:.0f} MiB)"
        )
    elif not cuda:
        print("(peak-memory comparison with plain torch.compile runs on CUDA only)")


if __name__ == "__main__":
    main()
