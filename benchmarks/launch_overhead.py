"""Host time per launch of what the lean path issues: where a small N (few rows, short kernels) waits on the host.

Tiny shapes, so the GPU keeps up and the host's own time per call is what is timed (perf_counter around a few
hundred asynchronous calls).  Prints one line per item, microseconds per call:

    cuBLAS products (torch.mm / addmm, bf16 and fp32 results; _launch.product_into), a tensor slice, a TMA
    descriptor, a Triton kernel that does nothing with 26 runtime arguments and with one descriptor, and the lean
    backward / forward at N 128 with 4 and 16 vocabulary chunks of 4096 (per-chunk host cost = the difference / 12),
    with and without TMA operands.

Reproduce (CUDA):  python benchmarks/launch_overhead.py
Measured (H100 hosts of the device pool, torch 2.11, Triton 3.6, 2026-11-25): a cuBLAS product 12-25 us, a Triton
launch with 26 arguments 87 us, the lean backward ~170 us of host time per vocabulary chunk (its recompute kernel
has 33 runtime arguments): benchmarks/results/2026-11-25_h100_launch-overhead_v14.txt.
"""

import os
import sys

import torch
import triton
import triton.language as tl

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
import _common as C  # noqa: E402  (benchmarks/ on the path first)

from cce_inductor import _planning  # noqa: E402
from cce_inductor.kernels import _backward, _backward_launch, _forward, _launch  # noqa: E402


def host_us(fn, reps=300):
    return 1e3 * C.host_and_wall_ms(fn, reps=reps, warmup=20)[0]


@triton.jit
def _noop(X, a, b, c, d, e, f, g, h, i, j, k, ll, m, n, o, p, q, r, s, t, u, w, x, y, z, A: tl.constexpr):
    pass


@triton.jit
def _noop_desc(D, X, A: tl.constexpr):
    pass


def main():
    dev = "cuda"
    a = torch.randn(256, 256, device=dev, dtype=torch.bfloat16)
    b = torch.randn(256, 256, device=dev, dtype=torch.bfloat16)
    o32 = torch.empty(256, 256, device=dev)
    o16 = torch.empty(256, 256, device=dev, dtype=torch.bfloat16)
    ptrs = [torch.empty(16, device=dev) for _ in range(13)]
    desc = _launch.descriptor(a, [64, 64])
    r = {
        "mm bf16 out=": host_us(lambda: torch.mm(a, b, out=o16)),
        "addmm out_dtype fp32": host_us(lambda: torch.addmm(o32, a, b, out=o32, out_dtype=torch.float32)),
        "product_into dE": host_us(
            lambda: _launch.product_into(o32, a, b, accumulate=True, vocab_dim="k", out_dtype=torch.float32)
        ),
        "slice": host_us(lambda: a[3:]),
        "descriptor": host_us(lambda: _launch.descriptor(a, [64, 64])),
        "triton noop 26 args": host_us(lambda: _noop[(1,)](ptrs[0], *ptrs, *range(12), A=1)),
        "triton noop + descriptor": host_us(lambda: _noop_desc[(1,)](desc, a, A=1)),
    }
    tuning = _backward._TUNING["gpu"]
    saved = dict(tuning)
    for tma in (True, False):
        tuning["tma"] = tma
        for v in (4096 * 4, 4096 * 16):
            e = torch.randn(128, 256, device=dev, dtype=torch.bfloat16)
            c = torch.randn(v, 256, device=dev, dtype=torch.bfloat16)
            t = torch.randint(0, v, (128,), device=dev)
            lse, *_ = _forward.forward(e, c, t, None, softcap=None, ignore_index=-100)
            g = torch.full((128,), 1 / 128, device=dev)
            # 4096-wide blocks (no short-batch widening): V / 4096 vocabulary steps
            plan = _planning.BackwardPlan(row_chunk=128, block_width=4096, products="cublas", counted_hint=None)
            r[f"backward {v // 4096} chunks tma={tma}"] = host_us(
                lambda: _backward_launch.backward(
                    e,
                    c,
                    t,
                    None,
                    lse,
                    g,
                    softcap=None,
                    ignore_index=-100,
                    need_e=True,
                    need_c=True,
                    need_bias=False,
                    **plan._asdict(),
                ),
                reps=30,
            )
            r[f"forward V {v} tma={tma}"] = host_us(
                lambda: _forward.forward(e, c, t, None, softcap=None, ignore_index=-100), reps=30
            )
    tuning.update(saved)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}")
    for k, x in r.items():
        print(f"{k:32s} {x:8.1f} us")


if __name__ == "__main__":
    main()
