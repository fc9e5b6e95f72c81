"""What ``drop_logits`` saves on a Hugging Face causal-LM training step (CPU, no GPU needed).

    python benchmarks/drop_logits_memory.py [--vocab 32000] [--batch 2] [--seq 512]

For a tiny Llama (1 layer, hidden 64: the head and the loss dominate) it runs one training step (forward with labels,
``loss.backward()``) eagerly, under plain Inductor, under ``make_backend()`` (the site is left alone: the logits are
returned) and under ``make_backend(drop_logits=True)``, and reports:

* saved: bytes the forward saves for the backward (``torch.autograd.graph.saved_tensors_hooks``; unique storages);
* returned logits: bytes of storage behind ``outputs.logits``;
* step peak: the process's peak resident memory during the step above what it held before it (sampled every ms from
  ``/proc/self/statm``: Linux only; allocator caching makes it approximate);
* time: median of 3 steps (CPU: for orientation only).
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import torch

import cce_inductor


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    def __enter__(self):
        self.base = self.peak = _rss()
        self._stop = False
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop:
            self.peak = max(self.peak, _rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop = True
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def delta(self) -> int:
        return self.peak - self.base


def _saved_bytes(fn):
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, sum(storages.values())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    args = parser.parse_args()

    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq,
    )
    model = transformers.LlamaForCausalLM(config)
    input_ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    labels = input_ids.clone()
    logits_mb = args.batch * args.seq * args.vocab * 4 / 2**20
    print(
        f"torch {torch.__version__}, Llama 1 layer, D=64, V={args.vocab}, B={args.batch}, T={args.seq}: "
        f"fp32 logits = {logits_mb:.0f} MiB"
    )

    variants = {
        "eager": lambda: model,
        "inductor": lambda: torch.compile(model),
        "cce, drop_logits off": lambda: torch.compile(model, backend=cce_inductor.make_backend(drop_logits=False)),
        "cce, drop_logits on": lambda: torch.compile(model, backend=cce_inductor.make_backend(drop_logits=True)),
    }
    print(f"{'variant':<22} {'saved MiB':>10} {'logits MiB':>11} {'step peak MiB':>14} {'time s':>7}  rewritten")
    for name, make in variants.items():
        torch._dynamo.reset()
        cce_inductor.reset_stats()
        compiled = make()

        def step():
            model.zero_grad(set_to_none=True)
            out, saved = _saved_bytes(lambda: compiled(input_ids=input_ids, labels=labels))
            out.loss.backward()
            return out, saved

        out, _ = step()  # compile, warm up
        del out
        times, peaks = [], []
        for _ in range(3):
            start = time.perf_counter()
            with PeakRSS() as rss:
                out, saved = step()
            times.append(time.perf_counter() - start)
            peaks.append(rss.delta)
            logits_bytes = out.logits.untyped_storage().nbytes()
            del out
        print(
            f"{name:<22} {saved / 2**20:>10.1f} {logits_bytes / 2**20:>11.1f} {min(peaks) / 2**20:>14.1f} "
            f"{statistics.median(times):>7.2f}  {cce_inductor.stats()['rewritten']}"
        )


if __name__ == "__main__":
    main()
