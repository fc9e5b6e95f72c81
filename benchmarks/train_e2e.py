"""End-to-end training of Gemma-2-like and Llama-3-like models: plain torch.compile vs cce_inductor, one process.

The models are Hugging Face models built from config (real vocabulary and hidden sizes, a few layers, bf16),
trained unmodified on synthetic tokens with learnable structure, same seed and data for both runs. Reports
per-step peak memory, median step time, the largest batch that fits, and both loss curves (JSON; plot with
``python benchmarks/plot.py curves FILE``).

    python benchmarks/train_e2e.py --model gemma2 --steps 200 --seq 4096 --batch 2 --out /tmp/e2e/
    python benchmarks/train_e2e.py --model gemma2 --modes compile,cce,cce_balanced     # the balanced path too
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
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
        attn_implementation="eager",  # transformers runs Gemma-2's attention softcap only in eager attention
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
        attn_implementation="sdpa",
    ),
}


DEVICE = "cuda"


def build_model(name: str, layers: int, seq: int):
    import transformers

    spec = dict(MODELS[name])
    family = spec.pop("family")
    if DEVICE == "cpu":  # a smoke test of this script: same code, toy sizes
        spec.update(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        )
        spec.pop("query_pre_attn_scalar", None)
    config = transformers.AutoConfig.for_model(
        family,
        num_hidden_layers=layers,
        max_position_embeddings=seq,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **spec,
    )
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.config.use_cache = False
    return model.train()


class MarkovTokens:
    """Token streams from a fixed sparse Markov chain: each token has 8 likely successors (learnable)."""

    def __init__(self, vocab: int, seed: int = 0, fanout: int = 8):
        generator = torch.Generator(device=DEVICE).manual_seed(seed)
        self.vocab = vocab
        self.successors = torch.randint(0, vocab, (vocab, fanout), device=DEVICE, generator=generator)
        self.generator = generator

    def batch(self, batch: int, seq: int) -> torch.Tensor:
        tokens = torch.empty(batch, seq, dtype=torch.long, device=DEVICE)
        tokens[:, 0] = torch.randint(0, self.vocab, (batch,), device=DEVICE, generator=self.generator)
        choice = torch.randint(0, self.successors.shape[1], (batch, seq), device=DEVICE, generator=self.generator)
        for t in range(1, seq):
            tokens[:, t] = self.successors[tokens[:, t - 1], choice[:, t]]
        return tokens


# cce: the lean path (default options); cce_balanced: the balanced path with a 1 GiB logits scratch
CCE_MODES = {"cce": {}, "cce_balanced": {"scratch_mb": 1024}}


def compile_model(model, mode: str):
    if mode == "compile":
        return torch.compile(model)
    import cce_inductor

    return torch.compile(model, backend=cce_inductor.make_backend(drop_logits=True, **CCE_MODES[mode]))


def train(name: str, mode: str, steps: int, batch: int, seq: int, layers: int, lr: float = 3e-4) -> dict:
    model = build_model(name, layers, seq)
    compiled = compile_model(model, mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), foreach=True)
    data = MarkovTokens(model.config.vocab_size, seed=1)
    losses, times, peaks = [], [], []
    cuda = DEVICE == "cuda"
    for _ in range(steps):
        tokens = data.batch(batch, seq)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        began = time.perf_counter()
        loss = compiled(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - began))  # the step, synchronised: host clock is exact enough
        losses.append(loss.item())
        peaks.append(torch.cuda.max_memory_allocated() / 2**20 if cuda else 0.0)
    result = dict(model=name, mode=mode, batch=batch, seq=seq, layers=layers, losses=losses)
    warm = times[3:] or times
    result["step_ms_median"] = statistics.median(warm)
    result["peak_mib"] = max(peaks[3:] or peaks)
    if mode in CCE_MODES:
        import cce_inductor

        result["rewritten"] = cce_inductor.stats()["rewritten"]
        result["paths"] = sorted({site["path"] for site in cce_inductor.stats()["sites"] if site["rewritten"]})
        cce_inductor.reset_stats()
    compiled = model = optimizer = None
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return result


def largest_batch(name: str, mode: str, seq: int, layers: int, start: int, limit: int = 512) -> int:
    """Largest batch (of ``seq`` tokens each) for which one training step fits, probed in this process.

    The batch dimension is marked dynamic so the probes share one compiled graph; after an out-of-memory error
    the allocator's cache is emptied before the next, smaller probe.
    """
    model = build_model(name, layers, seq)
    compiled = compile_model(model, mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    data = MarkovTokens(model.config.vocab_size, seed=2)

    def step_fits(batch: int) -> bool:
        try:
            tokens = data.batch(batch, seq)
            torch._dynamo.mark_dynamic(tokens, 0)
            compiled(input_ids=tokens, labels=tokens).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            return True
        except torch.OutOfMemoryError:
            optimizer.zero_grad(set_to_none=True)
            return False
        finally:
            if DEVICE == "cuda":
                torch.cuda.empty_cache()

    good, batch = 0, start
    while batch <= limit and step_fits(batch):
        good, batch = batch, batch * 2
    low, high = good, min(batch, limit + 1)  # low fits (or is 0), high does not
    while high - low > max(1, low // 8):
        middle = (low + high) // 2
        low, high = (middle, high) if step_fits(middle) else (low, middle)
    compiled = model = optimizer = None
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
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
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--device", default="cuda", help="cuda; cpu runs toy sizes as a smoke test of the script")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("this benchmark needs a CUDA device (--device cpu smoke-tests it at toy sizes)")
    device_name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    modes = args.modes.split(",")

    results = []
    for mode in modes:
        began = time.time()
        result = train(args.model, mode, args.steps, args.batch, args.seq, args.layers)
        result["wall_s"] = time.time() - began
        if args.find_max_batch:
            result["max_batch"] = largest_batch(args.model, mode, args.seq, args.layers, start=args.batch)
        results.append(result)
        print(
            f"{mode}: step {result['step_ms_median']:.1f} ms, peak {result['peak_mib']:.0f} MiB, "
            f"final loss {result['losses'][-1]:.4f}",
            flush=True,
        )
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"e2e_{args.model}.json")
    with open(path, "w") as handle:
        json.dump(dict(device=device_name, torch=torch.__version__, results=results), handle)

    by_mode = {r["mode"]: r for r in results}
    print(
        f"\n{args.model}: batch {args.batch} x seq {args.seq}, {args.layers} layers, bf16, "
        f"{device_name}, torch {torch.__version__}"
    )
    print("| mode | step ms | peak MiB | max batch | final loss |")
    print("| --- | --- | --- | --- | --- |")
    for r in results:
        print(
            f"| {r['mode']} | {r['step_ms_median']:.1f} | {r['peak_mib']:.0f} | {r.get('max_batch', '-')} | "
            f"{r['losses'][-1]:.4f} |"
        )
    for cce_mode in (m for m in CCE_MODES if {"compile", m} <= by_mode.keys()):
        base, ours = by_mode["compile"], by_mode[cce_mode]
        window = 20
        means = [
            [statistics.fmean(r["losses"][i : i + window]) for i in range(len(r["losses"]) - window + 1)]
            for r in (base, ours)
        ]
        gap = max((abs(a - b) / a for a, b in zip(*means)), default=math.nan)
        peak_ratio = ours["peak_mib"] / base["peak_mib"] if base["peak_mib"] else math.nan
        print(
            f"{cce_mode}/compile: time {ours['step_ms_median'] / base['step_ms_median']:.2f}x, "
            f"peak {peak_ratio:.2f}x; max |diff| of {window}-step running means: "
            f"{100 * gap:.2f}% of the loss; sites rewritten: {ours.get('rewritten')} {ours.get('paths')}"
        )


if __name__ == "__main__":
    main()
