"""Registers, spills and shared memory of the lean Triton kernels on Hopper, compiled here (no GPU needed).

    pip install triton==3.6.0          # the device's Triton; ptxas ships with the wheel
    python benchmarks/kernel_registers.py
    python benchmarks/kernel_registers.py --num-stages 4 --block-v 128

Compiles ``_lse_forward_kernel`` and ``_recompute_grad_kernel`` ahead of time for ``sm_90a`` with their GPU tuning
(bf16 operands, D a multiple of the block, with and without softcap, with pointer loads and with tensor-memory-
accelerator descriptors, ``tma``: what the GPU runs for 16-bit inputs) and runs ``ptxas -v`` on the result.  A
software-pipelined tile loop shows as ``num_stages - 1`` or more operand buffers in shared memory (~48 KB each at
the GPU tuning); 48 KB means the loop was not pipelined.  Pointers
and the sizes / strides the launch specialises as multiples of 16 are declared so here (``tt.divisibility``), and
unit strides as the constant 1: without those hints the compiler cannot prove 16-byte alignment, does not pipeline
the loads, and the figures say nothing about the launched kernel.  With them they match what the device reported
(v10: 50 / 88 registers spilled, engineering log).  ``wgmma`` counts Hopper's warp-group MMA instructions (0 would
mean the slower mma.sync path).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from cce_inductor.kernels import _backward, _forward

_MULTIPLE_OF_16 = {"N", "V", "D", "stride_en", "stride_cv", "stride_g", "n_rows", "width", "vocab_start"}
_UNIT_STRIDES = {"stride_ed", "stride_cd"}
_FLOAT_ARGS = {"softcap", "target_weight", "uniform"}
_INT64_POINTERS = {"Targets", "RowOrder"}
_INT32_POINTERS = {"NumValid", "NumCounted"}
_BF16_POINTERS = {"E", "C", "Bias", "G"}


def _signature(fn, constants: dict) -> tuple[dict, dict, dict]:
    signature, attrs = {}, {}
    constants = dict(constants, **{name: 1 for name in _UNIT_STRIDES if name in fn.arg_names})
    # with TMA, E and C are descriptors of (rows x D) and (vocabulary x D) tiles
    descriptors = (
        {"E": (constants["BLOCK_N"], constants["BLOCK_D"]), "C": (constants["BLOCK_V"], constants["BLOCK_D"])}
        if constants.get("TMA")
        else {}
    )
    for index, name in enumerate(fn.arg_names):
        if name in constants:
            signature[name] = "constexpr"
            continue
        if name in descriptors:
            signature[name] = "tensordesc<bf16[{}, {}]>".format(*descriptors[name])
            continue
        if name in _FLOAT_ARGS:
            signature[name] = "fp32"
        elif name[0].isupper() and name not in ("N", "V", "D"):  # (N, V, D: sizes)
            signature[name] = (
                "*i64"
                if name in _INT64_POINTERS
                else "*i32"
                if name in _INT32_POINTERS
                else "*bf16"
                if name in _BF16_POINTERS
                else "*fp32"
            )
        else:
            signature[name] = "i32"
        if signature[name].startswith("*") or name in _MULTIPLE_OF_16:
            attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, constants, attrs


def compile_report(name: str, fn, constants: dict, num_warps: int, num_stages: int) -> str:
    signature, constants, attrs = _signature(fn, constants)
    source = ASTSource(
        fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()}, attrs=attrs
    )
    kernel = triton.compile(
        source, target=GPUTarget("cuda", 90, 64), options=dict(num_warps=num_warps, num_stages=num_stages)
    )
    ptxas = get_ptxas(90)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(kernel.asm["ptx"])
        ptx.flush()
        info = subprocess.run(
            [getattr(ptxas, "path", ptxas), "-v", "--gpu-name=sm_90a", ptx.name, "-o", "/dev/null"],
            capture_output=True,
            text=True,
        ).stderr
    registers = re.search(r"Used (\d+) registers", info)
    spilled = re.search(r"(\d+) bytes spill stores", info)
    return (
        f"{name:30s} registers {registers.group(1) if registers else '?':>4s}  spill stores "
        f"{spilled.group(1) if spilled else '?':>5s} B  shared {kernel.metadata.shared:>6d} B  "
        f"wgmma {kernel.asm['ptx'].count('wgmma.mma_async')}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for key in ("block_n", "block_v", "block_d", "num_warps", "num_stages"):
        parser.add_argument("--" + key.replace("_", "-"), type=int, default=None, help="override both kernels' tuning")
    args = parser.parse_args()
    print(f"Triton {triton.__version__}, sm_90a")
    for tuning, fn, extra in [
        (_forward._TUNING["gpu"], _forward._lse_forward_kernel, dict(LOGIT_SUM=False, MEAN_LOGIT=False, EVEN_V=True)),
        (
            _backward._TUNING["gpu"],
            _backward._recompute_grad_kernel,
            dict(
                HAS_LSE_GRAD=False,
                HAS_ENTROPY_GRAD=False,
                COMPACT_G=False,
                EVEN_TILE=True,
                GROUP_V=_backward._TUNING["gpu"]["recompute_group"] // _backward._TUNING["gpu"]["block_v"],
            ),
        ),
    ]:
        tune = {
            k: getattr(args, k) if getattr(args, k) is not None else tuning[k]
            for k in ("block_n", "block_v", "block_d", "num_warps", "num_stages")
        }
        for tma, softcap in ((False, False), (False, True), (True, False), (True, True)):
            constants = dict(
                extra,
                HAS_BIAS=False,
                HAS_SOFTCAP=softcap,
                TMA=tma,
                UPCAST=False,
                DOT_PRECISION="tf32",
                EVEN_D=True,
                BLOCK_N=tune["block_n"],
                BLOCK_V=tune["block_v"],
                BLOCK_D=tune["block_d"],
            )
            label = f"{fn.__name__.strip('_')}{' tma' if tma else ''}{' softcap' if softcap else ''}"
            print(compile_report(label, fn, constants, tune["num_warps"], tune["num_stages"]))


if __name__ == "__main__":
    main()
