"""Train a Hugging Face ``LlamaForCausalLM`` with the cce_inductor backend, its code unchanged.

The model is built from a config (random weights, nothing downloaded) and compiled with ``cce_inductor.backend``.
A Hugging Face causal LM returns its logits next to the loss; the compiled model returns them as a
``cce_inductor.LazyLogits`` (the default, ``lazy_logits``): no ``N x V`` logits in the training step, and the real
values, computed from the hidden states the first time something reads them. This example reads them once, after
training, for a token accuracy, and checks them against the uncompiled model's. The same switch for a plain
``torch.compile(model)``: ``CCE_INDUCTOR=1 python train.py``.

    python examples/hf_llama.py --device cpu            # tiny config, ~1 minute on 2 CPU cores
    python examples/hf_llama.py --device cuda --vocab 128256 --hidden 1024 --layers 2 --seq 2048

Prints the loss per step (one fixed batch, memorised: it falls from ln(V)), ``cce_inductor.stats()["summary"]``, what
``outputs.logits`` is, and the token accuracy read from it.
"""

from __future__ import annotations

import argparse

import torch
import transformers

import cce_inductor


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto (default: CUDA if available), cpu, cuda, ...")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else "cpu"
        if args.device == "auto"
        else args.device
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq,
    )
    model = transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # one fixed batch of random tokens, so that the loss visibly falls below ln(V) as the model memorises it
    input_ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)

    compiled = torch.compile(model, backend=cce_inductor.backend)
    cce_inductor.reset_stats()
    for step in range(args.steps):
        outputs = compiled(input_ids=input_ids, labels=input_ids)  # the model shifts the labels itself
        outputs.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}  loss {outputs.loss.item():.4f}")

    stats = cce_inductor.stats()
    print(stats["summary"])
    if stats["rewritten"] == 0 and stats["executions"]["linear_cross_entropy"]:
        print(
            "(a warm start: Inductor's cache served the graph compiled by an earlier run, so the pass did not run "
            "again; the fused op's count shows the cached graph uses it)"
        )
    print(f"outputs.logits is a {type(outputs.logits).__name__} of shape {tuple(outputs.logits.shape)}")

    # one more forward, its logits read before any optimizer step (a weight changed in place in between would make
    # the read raise instead of giving other numbers than the graph's)
    outputs = compiled(input_ids=input_ids, labels=input_ids)
    with torch.no_grad():
        predicted = outputs.logits[:, :-1].argmax(-1)  # the first read computes the values
        accuracy = (predicted == input_ids[:, 1:]).float().mean().item()
        eager_logits = model(input_ids=input_ids).logits
    print(
        f"token accuracy from the lazy logits: {accuracy:.3f}; largest difference from the uncompiled model's "
        f"logits: {(outputs.logits.float() - eager_logits.float()).abs().max().item():.1e}"
    )


if __name__ == "__main__":
    main()
