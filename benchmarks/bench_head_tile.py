"""Time the balanced path's logits and dE products of one row chunk on a head stored in fp32 (autocast: bf16
products), the head converted tile by tile inside the Triton products, against cuBLAS on a converted copy (CUDA only).

    python benchmarks/bench_head_tile.py --shapes llama3 --rows 2048
    python benchmarks/bench_head_tile.py --logits "128,256,64,8,3;128,128,64,8,4" --grad "128,128,64,8,4"

Per shape, for one chunk of ``--rows`` rows over the whole vocabulary (``kernels/_balanced.py``): the conversion
of the head to bf16 (what the copy route pays once per call), cuBLAS's logits (``mm`` into the padded scratch, the
tail apart), dE (``mm`` with an fp32 result) and dC (the same for both routes), and the Triton logits product
(``_products.logits_product``) and dE product (``_products.grad_products``) on the bf16 copy and on the fp32 head,
each under every tile config given (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages; the stages are fitted to the
tiles' bytes). Median of CUDA-event timings (``triton.testing.do_bench``); the Triton results are checked against
cuBLAS's. Prints one markdown table.
"""

from __future__ import annotations

import argparse

import torch
import triton

from cce_inductor import _planning
from cce_inductor.kernels import _products

SHAPES = {"llama3": (4096, 128256), "gemma2": (2304, 256000), "nemo": (5120, 131072), "llama2": (4096, 32000)}
KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")


def _configs(text: str) -> list[dict]:
    return [dict(zip(KEYS, map(int, one.split(",")))) for one in text.split(";")]


def _with(tuning: dict, config: dict, fn):
    saved = dict(tuning["gpu"])
    tuning["gpu"].update(config)
    try:
        return triton.testing.do_bench(fn)
    finally:
        tuning["gpu"].clear()
        tuning["gpu"].update(saved)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama3")
    ap.add_argument("--rows", type=int, default=2048, help="rows of the chunk")
    ap.add_argument("--logits", default="128,256,64,8,3;128,128,64,8,4", help='";"-separated logits tile configs')
    ap.add_argument("--grad", default="128,128,64,8,4;128,256,64,8,3", help='";"-separated dE tile configs')
    args = ap.parse_args()
    rows, table = args.rows, []
    for shape in args.shapes.split(","):
        d, v = SHAPES[shape]
        pitch = -(-v // _planning.VOCAB_ALIGN) * _planning.VOCAB_ALIGN
        split = v - v % _planning.VOCAB_ALIGN
        gen = torch.Generator(device="cuda").manual_seed(0)
        e = torch.randn(rows, d, device="cuda", generator=gen).bfloat16()
        c32 = torch.randn(v, d, device="cuda", generator=gen) / d**0.5
        c16 = c32.bfloat16()
        scratch = torch.empty(rows, pitch, device="cuda", dtype=torch.bfloat16)
        grad = (torch.randn(rows, pitch, device="cuda", generator=gen) * 1e-4).bfloat16()
        grad[:, v:] = 0
        de32 = torch.empty(rows, d, device="cuda")
        every_row = torch.full((1,), rows, dtype=torch.int32, device="cuda")
        order = torch.arange(rows, device="cuda")
        poison = torch.zeros(rows, device="cuda")
        flops = 2.0 * rows * v * d

        def row(what, ms, ref=None, got=None):
            err = "" if ref is None else f"{((got.float() - ref.float()).norm() / ref.float().norm()).item():.1e}"
            table.append((shape, what, ms, flops / ms / 1e9, err))

        def cublas_logits():
            torch.mm(e, c16[:split].T, out=scratch[:, :split])
            if split < v:
                torch.mm(e, c16[split:].T, out=scratch[:, split:v])

        def cublas_de():
            torch.mm(grad[:, :split], c16[:split], out=de32, out_dtype=torch.float32)
            if split < v:
                torch.addmm(de32, grad[:, split:v], c16[split:], out=de32, out_dtype=torch.float32)

        row("convert head fp32 -> bf16", triton.testing.do_bench(lambda: c32.to(torch.bfloat16)))
        row("cuBLAS logits (bf16 copy)", triton.testing.do_bench(cublas_logits))
        ref_logits = scratch[:, :v].clone()
        row("cuBLAS dE (bf16 copy)", triton.testing.do_bench(cublas_de))
        ref_de = de32.clone()
        dc = torch.empty(pitch, d, device="cuda")
        row("cuBLAS dC", triton.testing.do_bench(lambda: torch.mm(grad.T, e, out=dc, out_dtype=torch.float32)))
        for as_a in (False, True):
            _products._HEAD_AS_A = as_a
            for head, c in (("bf16 copy", c16), ("fp32 head", c32)):
                if head == "bf16 copy" and as_a:
                    continue
                tag = f"{head}{', head as A' if as_a else ''}"
                # the bf16 copy under the first config only: it is the reference for the tile shapes
                first = slice(None) if head == "fp32 head" else slice(0, 1)
                for config in _configs(args.logits)[first]:
                    ms = _with(
                        _products._LOGITS_TUNING,
                        config,
                        lambda: _products.logits_product(scratch[:, :v], e, c, every_row),
                    )
                    row(f"Triton logits, {tag}, {tuple(config.values())}", ms, ref_logits, scratch[:, :v])
                for config in _configs(args.grad)[first]:
                    ms = _with(
                        _products._TUNING,
                        config,
                        lambda: _products.grad_products(
                            grad[:, :v], every_row, c_chunk=c, de32=de32, row_order=order, row_poison=poison
                        ),
                    )
                    row(f"Triton dE, {tag}, {tuple(config.values())}", ms, ref_de, de32)
        _products._HEAD_AS_A = False
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}, rows {rows}")
    print("| head | product | ms | TFLOP/s | rel. L2 vs cuBLAS |\n|---|---|---|---|---|")
    for shape, what, ms, tflops, err in table:
        print(f"| {shape} | {what} | {ms:.3f} | {tflops:.0f} | {err} |")


if __name__ == "__main__":
    main()
