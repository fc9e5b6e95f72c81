"""One row chunk's dC product, ``dC (+)= G^T @ E``, as the balanced path can sum it over its row chunks: cuBLAS into an
fp32 running sum (``addmm``, out_dtype fp32: the sums the balanced path kept until it summed 16-bit gradients as
pairs), cuBLAS into a bf16 sum (``addmm`` in bf16: one rounding per chunk, what Liger-Kernel does), and the pair
product of ``kernels/_pair_sums.py`` (a 16-bit sum and its 16-bit remainder, in the product's epilogue) in the
launch variants and tile configs of ``PAIR_CONFIGS``; a plain bf16 product (``mm``, no sum) is the floor.

    python benchmarks/pair_sums_ab.py [--shapes gemma2,llama3,mistral-nemo] [--rows 1024,2048,4096] [--out F]

Timing: triton.testing.do_bench, median, after one warm-up; the same process for every variant. Prints one table
(ms, and each variant over cuBLAS's fp32 sum) and writes its rows as JSON lines to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C
import vocab_grid as G

from cce_inductor.kernels import _pair_sums

PAIR_CONFIGS = {  # name: _pair_sums._TUNING["gpu"] entries over the default's
    "pair (default: 128x256, 3 stages)": {},
    "pair, 128x256, 4 stages": dict(num_stages=4),
    "pair, 256x128, 3 stages": dict(BLOCK_M=256, BLOCK_N=128),
    "pair, 128x256, GROUP_M 16": dict(GROUP_M=16),
    "pair, 128x128, 4 stages": dict(BLOCK_N=128, num_stages=4),
}


def variants(hi, lo, acc32, acc16, g, e):
    def pair(config):
        def run():
            saved = _pair_sums._TUNING["gpu"]
            _pair_sums._TUNING["gpu"] = {**saved, **config}
            try:
                _pair_sums.pair_product(hi, lo, g, e, accumulate=True)
            finally:
                _pair_sums._TUNING["gpu"] = saved

        return run

    return {
        "mm bf16 (floor)": lambda: torch.mm(g.T, e, out=acc16),
        "addmm fp32 sums": lambda: torch.addmm(acc32, g.T, e, out=acc32, out_dtype=torch.float32),
        "addmm bf16 sums": lambda: torch.addmm(acc16, g.T, e, out=acc16),
        **{name: pair(config) for name, config in PAIR_CONFIGS.items()},
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="gemma2,llama3,mistral-nemo")
    ap.add_argument("--rows", default="1024,2048,4096")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "pair_sums_ab.jsonl"))
    args = ap.parse_args()
    rows_out = []
    for head in args.shapes.split(","):
        d, v = G.HEADS[head]
        pitch = triton.cdiv(v, 64) * 64
        for k in (int(x) for x in args.rows.split(",")):
            gen = torch.Generator(device="cuda").manual_seed(0)
            g = (torch.randn(k, pitch, device="cuda", generator=gen) * 1e-4).bfloat16()
            e = torch.randn(k, d, device="cuda", generator=gen).bfloat16()
            hi = torch.zeros(pitch, d, device="cuda", dtype=torch.bfloat16)
            lo, acc16 = torch.zeros_like(hi), torch.zeros_like(hi)
            acc32 = torch.zeros(pitch, d, device="cuda")
            timings = {}
            for name, fn in variants(hi, lo, acc32, acc16, g, e).items():
                fn()
                torch.cuda.synchronize()
                timings[name] = triton.testing.do_bench(fn, return_mode="median")
            base = timings["addmm fp32 sums"]
            for name, ms in timings.items():
                row = dict(
                    head=head,
                    v=v,
                    d=d,
                    k=k,
                    variant=name,
                    ms=ms,
                    x_fp32_sums=ms / base,
                    tflops=2 * k * pitch * d / ms / 1e9,
                )
                rows_out.append(row)
            del g, e, hi, lo, acc16, acc32
            torch.cuda.empty_cache()
    with open(args.out, "a") as f:
        f.write(json.dumps(C.header("cuda", dict(script="pair_sums_ab", shapes=args.shapes, rows=args.rows))) + "\n")
        for row in rows_out:
            f.write(json.dumps(row) + "\n")
    print(
        C.md_table(
            ["head", "K", "variant", "ms", "x fp32 sums", "TFLOP/s"],
            [
                (r["head"], r["k"], r["variant"], f"{r['ms']:.3f}", f"{r['x_fp32_sums']:.2f}", f"{r['tflops']:.0f}")
                for r in rows_out
            ],
        )
    )


if __name__ == "__main__":
    main()
