"""TRL's fused head (``trl.kernels.chunked_logprob.ChunkedLogProbFunction``) against cce_inductor's adapter
(``integrations.trl.log_probs``, what ``install()`` puts in its place), the head alone: the outputs TRL's
``SFTTrainer`` asks for (log_probs, entropy, is_top1), loss ``-log_probs.mean()``, fwd+bwd. bf16, LM-like data
(vocab_grid's), every row labelled (TRL scores labelled rows only; its trainer hands it those), three interleaved
rounds per head in one process; ms = median of the rounds (each a triton do_bench of rep 300 ms), MB above the
inputs, dE / dC of the adapter against TRL's. CUDA and TRL only.

Usage: HEADS=qwen25-0.5b,llama32-1b N=8192 python benchmarks/trl_head_ab.py
"""

import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
import _common as C  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import vocab_grid as G  # noqa: E402

G.find_peers("cuda")  # stubs trl.trainer.utils where TRL's trainer stack does not import (the device)
from trl.kernels.chunked_logprob import ChunkedLogProbFunction  # noqa: E402

from cce_inductor.integrations import trl as cce_trl  # noqa: E402

HEADS = {"qwen25-0.5b": (896, 151936), "llama32-1b": (2048, 128256), "gemma2": (2304, 256000), "llama3": (4096, 128256)}
OUTPUTS = ("log_probs", "entropy", "is_top1")


def main():
    n = int(os.environ.get("N", "8192"))
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, bf16, lm data, "
        f"N {n}, outputs {OUTPUTS}"
    )
    for head in os.environ.get("HEADS", ",".join(HEADS)).split(","):
        d, v = HEADS[head]
        e, c, t = G.make_data(n, d, v, 0, "cuda", 0)
        e.requires_grad_(True)
        c.requires_grad_(True)
        fns = {"trl": ChunkedLogProbFunction.apply, "ours": cce_trl.log_probs}
        runs = {
            name: (lambda fn: lambda: (-fn(e, c, None, t, 1.0, 32768, None, 1.0, OUTPUTS)[0].mean()).backward())(fn)
            for name, fn in fns.items()
        }
        ms = {name: [] for name in runs}
        mb, grads = {}, {}
        for rnd in range(3):
            for name, run in runs.items():
                ms[name].append(
                    triton.testing.do_bench(run, warmup=3, rep=300, grad_to_none=[e, c], return_mode="median")
                )
                if rnd == 0:
                    e.grad = c.grad = None
                    mb[name] = C.cuda_peak_mb(run)
                    grads[name] = (e.grad.float().clone(), c.grad.float().clone())
        med = {name: statistics.median(x) for name, x in ms.items()}
        diff = [((a - b).norm() / b.norm()).item() for a, b in zip(grads["ours"], grads["trl"])]
        print(
            f"{head} (D {d}, V {v}): trl {med['trl']:.2f} ms ({' '.join(f'{x:.2f}' for x in ms['trl'])}) "
            f"{mb['trl']:.0f} MB | ours {med['ours']:.2f} ms ({' '.join(f'{x:.2f}' for x in ms['ours'])}) "
            f"{mb['ours']:.0f} MB | ours / trl {med['ours'] / med['trl']:.3f}x time, {mb['ours'] / mb['trl']:.2f}x "
            f"peak | grads vs trl: dE {diff[0]:.1e} dC {diff[1]:.1e}",
            flush=True,
        )
        e = c = t = grads = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
