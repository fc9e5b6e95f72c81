"""Where the counted prefix starts to pay: Gemma-2 / Llama-3 heads at N 8192 with 5 / 10 / 20% of the targets
ignored, the default's products forced to cuBLAS over every row or to the counted prefix by moving
``_counted_share.COUNTED_PREFIX_AT_MOST`` (0.0 / 0.999), each twice, torch.compile beside them; one process per call,
bf16, LM-like data (vocab_grid's). One JSON row per (head, ignored %, method): fwd+bwd ms, peak MB above the inputs,
host / wall ms, and the backward products that ran. CUDA only.

Usage: HEADS=gemma2,llama3 OUT=DIR python benchmarks/prefix_threshold_ab.py  (rows appended to
DIR/prefix_threshold_ab.jsonl; HEADS are vocab_grid's names)
"""

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
import _common as C  # noqa: E402
import vocab_grid as VG  # noqa: E402

import cce_inductor  # noqa: E402
from cce_inductor import _counted_share as S  # noqa: E402

AT_MOST = S.COUNTED_PREFIX_AT_MOST


def main():
    out = open(os.path.join(os.environ.get("OUT", "."), "prefix_threshold_ab.jsonl"), "a")
    dev = torch.cuda.get_device_name()
    for head in os.environ.get("HEADS", "gemma2,llama3").split(","):
        d, v = VG.HEADS[head]
        n = 8192
        e, c, _ = VG.make_data(n, d, v, 0, "cuda", 0)
        cases = {p: VG.make_data(n, d, v, p, "cuda", 0)[2] for p in (5, 10, 20)}
        e.requires_grad_(True)
        c.requires_grad_(True)
        fns = {}
        for i, m in enumerate(("compile", "default")):
            torch._dynamo.reset()
            f = C.fresh_loss(f"{head}{i}", -100)
            fns[m] = torch.compile(f) if m == "compile" else torch.compile(f, backend=cce_inductor.make_backend())
        for pct, t in cases.items():
            for m, at_most in (
                ("compile", None),
                ("cublas", 0.0),
                ("prefix", 0.999),
                ("cublas", 0.0),
                ("prefix", 0.999),
            ):
                fn = fns["compile" if m == "compile" else "default"]
                if at_most is not None:
                    S.COUNTED_PREFIX_AT_MOST = at_most

                def timed():
                    e.grad = c.grad = None
                    fn(e, c, t).backward()

                for _ in range(10):
                    timed()
                before = dict(cce_inductor.stats()["backward_products"])
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                timed()
                torch.cuda.synchronize()
                peak = (torch.cuda.max_memory_allocated() - base) / 2**20
                host, wall = C.host_and_wall_ms(timed, reps=5, warmup=1)
                ms = C.bench(timed, "cuda", grad_to_none=[e, c])
                after = cce_inductor.stats()["backward_products"]
                ran = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
                row = dict(
                    device=dev,
                    head=head,
                    ignored_pct=pct,
                    method=m,
                    at_most=at_most,
                    ms=round(ms, 2),
                    peak_mb=round(peak),
                    host_ms=round(host, 2),
                    wall_ms=round(wall, 2),
                    products_ran=ran,
                )
                print(json.dumps(row), flush=True)
                out.write(json.dumps(row) + "\n")
                out.flush()
        S.COUNTED_PREFIX_AT_MOST = AT_MOST
        e = c = fns = None
        C.free("cuda")


if __name__ == "__main__":
    main()
