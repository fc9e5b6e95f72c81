"""End-to-end training of Gemma-2-like and Llama-3-like models: plain torch.compile vs cce_inductor, one process.

The models are Hugging Face models built from config (real vocabulary and hidden sizes, a few layers, bf16),
trained unmodified on synthetic tokens with learnable structure, same seed and data for both runs. Reports
per-step peak memory, median step time, the largest batch that fits, and both loss curves (JSON; plot with
``examples/plot_curves.py``).

    python examples/train_e2e.py --model gemma2 --steps 200 --seq 4096 --batch 2 --out results/
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch

MODELS = {
    # Real vocabulary / hidden / MLP / head sizes; few layers so that the head dominates, as in small models.
    "gemma2": dict(
        family="gemma2",
        vocab_size=256000,
        hidden_size=2304,
        intermediate_size=9216,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0,
        query_pre_attn_scalar=256,
        sliding_window=4096,
    ),
    "llama3": dict(
        family="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rope_theta=500000.0,
    ),
}


def build_model(name: str, layers: int, seq: int):
    import transformers

    spec = dict(MODELS[name])
    family = spec.pop("family")
    config = transformers.AutoConfig.for_model(
        family, num_hidden_layers=layers, max_position_embeddings=seq, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, attn_implementation="sdpa", **spec,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.config.use_cache = False
    return model.train()


class MarkovTokens:
    """Token streams from a fixed sparse Markov chain: each token has 8 likely successors (learnable)."""

    def __init__(self, vocab: int, seed: int = 0, fanout: int = 8):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        self.vocab = vocab
        self.successors = torch.randint(0, vocab, (vocab, fanout), device="cuda", generator=generator)
        self.generator = generator

    def batch(self, batch: int, seq: int) -> torch.Tensor:
        tokens = torch.empty(batch, seq, dtype=torch.long, device="cuda")
        tokens[:, 0] = torch.randint(0, self.vocab, (batch,), device="cuda", generator=self.generator)
        choice = torch.randint(0, self.successors.shape[1], (batch, seq), device="cuda", generator=self.generator)
        for t in range(1, seq):
            tokens[:, t] = self.successors[tokens[:, t - 1], choice[:, t]]
        return tokens


def compile_model(model, mode: str):
    if mode == "compile":
        return torch.compile(model)
    import cce_inductor

    return torch.compile(model, backend=cce_inductor.make_backend(drop_logits=True))


def train(name: str, mode: str, steps: int, batch: int, seq: int, layers: int, lr: float = 3e-4) -> dict:
    model = build_model(name, layers, seq)
    compiled = compile_model(model, mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), foreach=True)
    data = MarkovTokens(model.config.vocab_size, seed=1)
    losses, times, peaks = [], [], []
    for step in range(steps):
        tokens = data.batch(batch, seq)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        loss = compiled(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        end.record()
        torch.cuda.synchronize()
        losses.append(loss.item())
        times.append(start.elapsed_time(end))
        peaks.append(torch.cuda.max_memory_allocated() / 2**20)
    result = dict(model=name, mode=mode, batch=batch, seq=seq, layers=layers, losses=losses)
    warm = times[3:] or times
    result["step_ms_median"] = statistics.median(warm)
    result["peak_mib"] = max(peaks[3:] or peaks)
    if mode == "cce":
        import cce_inductor

        result["rewritten"] = cce_inductor.stats()["rewritten"]
    del compiled, model, optimizer
    torch.cuda.empty_cache()
    return result


def fits(name: str, mode: str, batch: int, seq: int, layers: int) -> bool:
    """Two training steps of this batch in a fresh process (an OOM leaves the allocator fragmented)."""
    cmd = [sys.executable, __file__, "--model", name, "--modes", mode, "--steps", "2", "--batch", str(batch),
           "--seq", str(seq), "--layers", str(layers), "--probe"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return proc.returncode == 0


def largest_batch(name: str, mode: str, seq: int, layers: int, start: int, limit: int = 256) -> int:
    good, batch = 0, start
    while batch <= limit and fits(name, mode, batch, seq, layers):
        good, batch = batch, batch * 2
    if good == 0:
        return 0
    low, high = good, min(batch, limit + 1)  # good fits, high does not (or is past the limit)
    while high - low > max(1, good // 4):  # a few probes, each a process and a compile
        middle = (low + high) // 2
        low, high = (middle, high) if fits(name, mode, middle, seq, layers) else (low, middle)
    return low


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="gemma2")
    parser.add_argument("--modes", default="compile,cce")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--find-max-batch", action="store_true")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("this benchmark needs a CUDA device; examples/train_tiny_lm.py runs anywhere")
    modes = args.modes.split(",")
    if args.probe:
        train(args.model, modes[0], args.steps, args.batch, args.seq, args.layers)
        return

    results = []
    for mode in modes:
        began = time.time()
        result = train(args.model, mode, args.steps, args.batch, args.seq, args.layers)
        result["wall_s"] = time.time() - began
        if args.find_max_batch:
            result["max_batch"] = largest_batch(args.model, mode, args.seq, args.layers, start=args.batch)
        results.append(result)
        print(f"{mode}: step {result['step_ms_median']:.1f} ms, peak {result['peak_mib']:.0f} MiB, "
              f"final loss {result['losses'][-1]:.4f}", flush=True)  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"e2e_{args.model}.json")
    with open(path, "w") as handle:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, results=results), handle)

    by_mode = {r["mode"]: r for r in results}
    print(f"\n{args.model}: batch {args.batch} x seq {args.seq}, {args.layers} layers, bf16, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}")  # fmt: skip
    print("| mode | step ms | peak MiB | max batch | final loss |")
    print("| --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['mode']} | {r['step_ms_median']:.1f} | {r['peak_mib']:.0f} | {r.get('max_batch', '-')} | "
              f"{r['losses'][-1]:.4f} |")  # fmt: skip
    if {"compile", "cce"} <= by_mode.keys():
        base, ours = by_mode["compile"], by_mode["cce"]
        window = 20
        means = [
            [statistics.fmean(r["losses"][i : i + window]) for i in range(len(r["losses"]) - window + 1)]
            for r in (base, ours)
        ]
        gap = max((abs(a - b) / a for a, b in zip(*means)), default=math.nan)
        print(f"cce/compile: time {ours['step_ms_median'] / base['step_ms_median']:.2f}x, "
              f"peak {ours['peak_mib'] / base['peak_mib']:.2f}x; max |diff| of {window}-step running means: "
              f"{100 * gap:.2f}% of the loss; sites rewritten: {ours.get('rewritten')}")  # fmt: skip


if __name__ == "__main__":
    main()
