"""A GRPO-style policy loss (token log-probs + an entropy bonus) through the cce_inductor pass.

RL fine-tuning scores sampled tokens with the log-probability the policy gives them and often adds the entropy of
the policy's softmax. Written the usual way, both read the ``N x V`` logits (and a ``log_softmax`` of them); the pass
rewrites the token log-probs and the entropy of the same logits into one call of the fused op, which computes both
and their gradients without the logits. The loss below is written as TRL writes it (temperature, clipped ratio
against detached old log-probs, per-sequence advantages, a completion mask, ``-(p * log p).sum(-1)`` entropy);
nothing in it mentions cce_inductor.

    python examples/rl_grpo.py --device cpu        # tiny sizes, < 1 minute on 2 CPU cores
    python examples/rl_grpo.py --device cuda --vocab 151936 --dim 2048 --batch 8 --seq 1024

Prints the loss and mean entropy per step, ``cce_inductor.stats()["summary"]`` (one site: token log-probs and
entropy) and, after the steps, the largest difference of the loss and of the head's gradient from eager PyTorch.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn

import cce_inductor

TEMPERATURE = 0.7
CLIP = 0.2
ENTROPY_COEF = 0.01


class Policy(nn.Module):
    """A stand-in policy: an embedding, one MLP block and an untied output head (any causal LM works the same)."""

    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.block = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def hidden(self, ids):
        x = self.embed(ids)
        return x + self.block(x)


def grpo_loss(policy, ids, old_logps, advantages, mask):
    """Clipped policy-gradient loss with an entropy bonus, per token, averaged over the completion mask."""
    logits = policy.lm_head(policy.hidden(ids)).float() / TEMPERATURE
    logps = logits.log_softmax(-1)
    token_logps = torch.gather(logps, -1, ids.unsqueeze(-1)).squeeze(-1)  # log-prob of each sampled token
    entropy = -(logps.exp() * logps).sum(-1)
    ratio = torch.exp(token_logps - old_logps)
    surrogate = torch.min(ratio * advantages[:, None], ratio.clamp(1 - CLIP, 1 + CLIP) * advantages[:, None])
    per_token = -surrogate - ENTROPY_COEF * entropy
    loss = (per_token * mask).sum() / mask.sum()
    return loss, (entropy * mask).sum() / mask.sum()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto (default: CUDA if available), cpu, cuda, ...")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4, help="completions per step")
    parser.add_argument("--seq", type=int, default=32, help="tokens per completion")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else "cpu"
        if args.device == "auto"
        else args.device
    )

    torch.manual_seed(0)
    policy = Policy(args.vocab, args.dim).to(device)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    compiled_loss = torch.compile(grpo_loss, backend=cce_inductor.backend)

    # One batch of "sampled" completions, their rewards turned into group-normalised advantages, and the
    # log-probs of the policy that sampled them (here: the initial policy, detached).
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    rewards = torch.randn(args.batch, device=device)
    advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
    mask = torch.ones(args.batch, args.seq, device=device)
    mask[:, : args.seq // 4] = 0  # the prompt's tokens do not count
    with torch.no_grad():
        logits = policy.lm_head(policy.hidden(ids)).float() / TEMPERATURE
        old_logps = torch.gather(logits.log_softmax(-1), -1, ids.unsqueeze(-1)).squeeze(-1)

    cce_inductor.reset_stats()
    for step in range(args.steps):
        loss, entropy = compiled_loss(policy, ids, old_logps, advantages, mask)
        loss.backward()
        if step < args.steps - 1:  # keep the last step's gradients for the check below
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        print(f"step {step}  loss {loss.item():+.5f}  mean entropy {entropy.item():.4f}")
    print(cce_inductor.stats()["summary"])

    fused_grad = policy.lm_head.weight.grad.clone()
    policy.zero_grad(set_to_none=True)
    eager, _ = grpo_loss(policy, ids, old_logps, advantages, mask)
    eager.backward()
    grad_err = (fused_grad - policy.lm_head.weight.grad).norm() / policy.lm_head.weight.grad.norm()
    print(
        f"against eager: loss {loss.item():+.6f} vs {eager.item():+.6f}, "
        f"lm_head gradient relative difference {grad_err.item():.1e}"
    )


if __name__ == "__main__":
    main()
