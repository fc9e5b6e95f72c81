"""Time the dE / dC products of the backward for one (row chunk x vocabulary chunk) block alone (CUDA only).

    python benchmarks/bench_dense_parts.py --shapes gemma2,llama3
    python benchmarks/bench_dense_parts.py --shapes gemma2 --counted 1.0,0.5 --prod "128,128,64,8,4;128,256,64,8,3"

Per shape, for one block of ``--rows`` rows x ``--width`` vocabulary entries (default: the backward's own,
``cce_inductor._layout.LEAN_LAYOUT["gpu"]["block_cols"]``): the cuBLAS products of the default backward
(``addmm`` into fp32 dE rows, ``mm`` for a dC chunk; ``CCEOptions(products="cublas")``) and the Triton products of
``kernels/_products.py`` (``products="triton"``: descriptor-fed, dC over E in compacted order, ignored rows
skipped) under each ``--prod`` tile config (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages; written into
``_products._TUNING["gpu"]`` for that config, restored after), with the given fractions of counted rows (the rest
ignored).  Median of CUDA-event timings (``triton.testing.do_bench``); TFLOP/s counts the counted rows only.  The
Triton products are checked against an fp32 product of the counted rows.  Prints one markdown table.
"""

from __future__ import annotations

import argparse

import torch
import triton

from cce_inductor.kernels import _launch, _layout, _products

SHAPES = {"gemma2": (2304, 256000), "llama3": (4096, 128256), "qwen25": (3584, 152064), "phi35": (3072, 32064)}
PROD_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="gemma2")
    ap.add_argument("--rows", type=int, default=8192, help="rows of the block (CCEOptions.backward_row_chunk)")
    ap.add_argument("--width", type=int, default=0, help="vocabulary chunk (default: the backward's)")
    ap.add_argument("--counted", default="1.0,0.5", help="fractions of counted (not ignored) rows")
    ap.add_argument("--prod", default="128,128,64,8,4", help='";"-separated BLOCK_M,BLOCK_N,BLOCK_K,warps,stages')
    args = ap.parse_args()
    width = args.width or _layout.LEAN_LAYOUT["gpu"]["block_cols"]
    rows = args.rows
    table = []
    for shape in args.shapes.split(","):
        d, _ = SHAPES[shape]
        gen = torch.Generator(device="cuda").manual_seed(0)
        e = torch.randn(rows, d, device="cuda", generator=gen).bfloat16()
        c_chunk = torch.randn(width, d, device="cuda", generator=gen).bfloat16() / d**0.5
        grad = (torch.randn(rows, width, device="cuda", generator=gen) * 1e-4).bfloat16()
        de32 = torch.zeros(rows, d, device="cuda")
        dc = torch.empty(width, d, device="cuda", dtype=torch.bfloat16)
        poison = torch.zeros(rows, device="cuda")
        flops = 2.0 * rows * width * d
        ms = lambda fn: triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")  # noqa: E731
        t_de = ms(lambda: torch.addmm(de32, grad, c_chunk, out=de32, out_dtype=torch.float32))
        t_dc = ms(lambda: torch.mm(grad.T, e, out=dc))
        table.append((shape, "cublas addmm dE", "", 1.0, t_de, flops / t_de / 1e9))
        table.append((shape, "cublas mm dC", "", 1.0, t_dc, flops / t_dc / 1e9))
        for frac in map(float, args.counted.split(",")):
            k = int(rows * frac)
            counted = torch.zeros(rows, dtype=torch.bool, device="cuda")
            counted[torch.randperm(rows, device="cuda", generator=gen)[:k]] = True
            row_order, num_counted = _launch.compact_counted(counted)
            ref_de = grad[:k].float() @ c_chunk.float()
            ref_dc = grad[:k].float().T @ e[row_order[:k]].float()
            e_compact = e[row_order]
            grad_k = grad.clone()
            grad_k[k:] = 0  # the ignored rows' G (their poison) past the count
            ignored_zero = poison.new_zeros(1)
            for spec in args.prod.split(";"):
                saved = _products._TUNING["gpu"]
                _products._TUNING["gpu"] = {**saved, **dict(zip(PROD_KEYS, map(int, spec.split(","))))}
                try:
                    de32.zero_()
                    _products.grad_products(
                        grad,
                        num_counted,
                        c_chunk=c_chunk,
                        de32=de32,
                        row_order=row_order,
                        row_poison=poison,
                        accumulate_e=True,
                    )
                    err_de = ((de32[row_order[:k]] - ref_de).norm() / ref_de.norm()).item()
                    _products.grad_products(
                        grad_k, num_counted, e_compact=e_compact, dc_chunk=dc, ignored_poison=ignored_zero
                    )
                    err_dc = ((dc.float() - ref_dc).norm() / ref_dc.norm()).item()
                    t_e = ms(
                        lambda: _products.grad_products(
                            grad,
                            num_counted,
                            c_chunk=c_chunk,
                            de32=de32,
                            row_order=row_order,
                            row_poison=poison,
                            accumulate_e=True,
                        )
                    )
                    t_c = ms(
                        lambda: _products.grad_products(
                            grad_k, num_counted, e_compact=e_compact, dc_chunk=dc, ignored_poison=ignored_zero
                        )
                    )
                except Exception as exc:  # noqa: BLE001
                    print(f"{shape} {spec} FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    continue
                finally:
                    _products._TUNING["gpu"] = saved
                kflops = flops * k / rows
                table.append((shape, f"triton dE (err {err_de:.1e})", spec, frac, t_e, kflops / t_e / 1e9))
                table.append((shape, f"triton dC (err {err_dc:.1e})", spec, frac, t_c, kflops / t_c / 1e9))
                print(*table[-2:], flush=True)
    print(f"\nblock: {rows} rows x {width} vocabulary, bf16, {torch.cuda.get_device_name()}")
    print("| shape | part | tiles (M,N,K,warps,stages) | counted | ms | TFLOP/s |")
    print("|---|---|---|---|---|---|")
    for shape, part, spec, frac, t, tflops in table:
        print(f"| {shape} | {part} | {spec} | {frac:.2f} | {t:.3f} | {tflops:.0f} |")


if __name__ == "__main__":
    main()
