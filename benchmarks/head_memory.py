"""What is alive at the peak of one whole training step: the CUDA allocator's blocks at the step's highest point,
the logits-sized ones named by the line of code that allocated them.

Why: the default path's memory budget is half of torch.compile's estimated head peak (``paths.compile_peak``). On
the vocabulary grid's loss-only code that estimate matches the measured peak (2 bytes per bf16 logit); in Hugging
Face models at full depth torch.compile's head holds 5.5-7.4 bytes per logit (inferred from step peaks; engineering
log v25), and Inductor's partition saves one bf16 buffer for both the returned and the saved logits (a CPU probe, v25).
This script finds which buffers make up the rest, so that the estimate can count what the graph proves.

    python benchmarks/head_memory.py --model gemma2-2b --batch 2 --method compile
    python benchmarks/head_memory.py --model gemma2-2b --batch 2 --method default --out $OUT/head_memory.jsonl

One model, method and batch per process (built as ``full_depth.py`` builds it: config only, fp32 master weights,
bf16 autocast, AdamW, seq 2048, labels = input_ids, checkpointing off unless --ckpt on, static shapes). Two steps
compile and warm up; the third runs under ``torch.cuda.memory._record_memory_history``. The allocator's trace of
that step is replayed: the peak is the highest sum of the blocks allocated during it (less those freed that were
allocated before it), and every block alive at that moment of at least ``N V`` bytes (N = batch x seq rows, V the
vocabulary: one byte per logit) is listed with its size in bytes per logit and the innermost Python line that
allocated it (Inductor's generated code names its buffers there: ``buf12 = empty_strided_cuda((4096, 256000),
...)``). One JSON line per run in --out: model, method, batch, rows, vocab, pick (the default's path), step_peak_gb
(max_memory_allocated), trace_peak_gb (the replayed peak above the blocks allocated before the step), logit_blocks
[{bytes, per_logit, where, line}], logit_bytes_per_logit (their sum over N V).
--stacks all records C++ frames too (slower to snapshot): a block allocated outside Python code (one of
torch.compile's three on Llama-3.2-1B's head had no Python frame, engineering log v26) is then named by its innermost
C++ frames that are not the allocator's or the dispatcher's own.
CUDA only (the allocator's history); --tiny checks the harness on CPU without it (no blocks listed).
"""

from __future__ import annotations

import argparse
import linecache
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C
import full_depth as FD


def peak_blocks(trace, min_bytes):
    """Replay one device's allocator trace (``torch.cuda.memory._snapshot()["device_traces"][i]``): the peak of the
    bytes allocated during the trace, and the blocks of at least ``min_bytes`` alive at it, largest first."""
    live, cur, peak, at = {}, 0, 0, -1
    for i, ev in enumerate(trace):
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            cur += ev["size"]
            if cur > peak:
                peak, at = cur, i
        elif ev["action"] == "free_completed":
            cur -= ev["size"]  # a block allocated before the trace lowers the sum too: it was part of the base
            live.pop(ev["addr"], None)
    live = {}
    for ev in trace[: at + 1]:  # the set alive at the peak, by a second replay up to it
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
        elif ev["action"] == "free_completed":
            live.pop(ev["addr"], None)
    big = sorted((ev for ev in live.values() if ev["size"] >= min_bytes), key=lambda ev: -ev["size"])
    return peak, big


# C++ frames of the allocator, of the history's own recording and of the dispatcher between an op's entry
# (``at::_ops::<op>::call``, kept) and its kernel, skipped when a block is named by C++ frames: v27's one C++-only
# block on Llama-3.2-1B showed only these in its eight innermost frames (its caller unnamed)
_PLUMBING_FRAMES = (
    "CUDACachingAllocator",
    "c10::cuda::",
    "CapturedTraceback",
    "unwind",
    "gather_with_cpp",
    "at::detail::empty",
    "wrapper_CUDA",
    "c10::impl::",
    "::redispatch(",
    "c10::Dispatcher",
    "c10::KernelFunction",
    "c10::BoxedKernel",
)


def allocation_site(frames, depth=4):
    """The innermost Python frames with a source line, innermost first (for Inductor's buffers the first is the
    generated code's ``buf = empty_strided_cuda(...)``): ``(["file:line (function)", ...], source of the first)``;
    where there is none (a block allocated outside Python code, its C++ frames recorded by --stacks all), the
    innermost C++ frames that are not the allocator's or the dispatcher's: ``(["function", ...], "(C++)")``."""
    where, src = [], ""
    for fr in frames:
        name = fr.get("filename", "")
        if name.endswith(".py") and fr.get("line", 0) > 0:
            if not where:
                src = linecache.getline(name, fr["line"]).strip()[:160]
            where.append(f"{os.path.basename(name)}:{fr['line']} ({fr.get('name', '')})")
            if len(where) == depth:
                break
    if where:
        return where, src
    native = [fr.get("name", "") for fr in frames if fr.get("name") and not fr.get("filename", "").endswith(".py")]
    named = [n[:120] for n in native if not any(skip in n for skip in _PLUMBING_FRAMES)]
    native = named or [n[:120] for n in native]
    return native[: 3 * depth], "(C++)" if native else ""  # the tensor factory's frames first, then its callers'


def run(args):
    C.setup_compile()
    backends = C.resolve_methods([args.method], quiet=True)
    dev = args.device
    model = FD.build_model(args.model, args)
    if args.ckpt == "on":
        FD.enable_checkpointing(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=dev == "cuda")
    vocab = model.config.vocab_size
    torch._dynamo.reset()
    compiled = FD.compile_model(model, args.method, backends, True)
    tokens = torch.randint(
        0, vocab, (args.batch, args.seq), device=dev, generator=torch.Generator(device=dev).manual_seed(args.seed)
    )
    step = FD.training_step(compiled, opt, tokens, dev)
    import cce_inductor

    cce_inductor.reset_stats()
    for _ in range(2):
        step()
    C.sync(dev)
    rows = args.batch * args.seq
    row = dict(
        kind="row",
        model=args.model,
        method=args.method,
        ckpt=args.ckpt,
        batch=args.batch,
        seq=args.seq,
        rows=rows,
        vocab=vocab,
        pick=None,
        pick_reason=None,
        logit_blocks=[],
    )
    if args.method != "compile":
        row["pick"], row["pick_reason"] = C.site_pick(cce_inductor.stats())
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks=args.stacks)
        step()
        C.sync(dev)
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        row["step_peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
        trace = snap["device_traces"][torch.cuda.current_device()]
        peak, big = peak_blocks(trace, rows * vocab)
        row["trace_peak_gb"] = peak / 2**30
        for ev in big:
            where, line = allocation_site(ev.get("frames", []))
            row["logit_blocks"].append(
                dict(bytes=ev["size"], per_logit=round(ev["size"] / (rows * vocab), 3), where=where, line=line)
            )
        row["logit_bytes_per_logit"] = round(sum(b["bytes"] for b in row["logit_blocks"]) / (rows * vocab), 3)
    else:
        step()
    C.append_row(args.out, row)
    print(
        f"{args.model} {args.method} batch {args.batch}: step peak {C.fmt(row.get('step_peak_gb'))} GB, "
        f"trace peak {C.fmt(row.get('trace_peak_gb'))} GB, logits-sized blocks at the peak "
        f"{row.get('logit_bytes_per_logit')} bytes per logit",
        flush=True,
    )
    for b in row["logit_blocks"]:
        print(f"   {b['bytes'] / 2**30:7.3f} GB  {b['per_logit']:5.2f} B/logit  {b['line']}", flush=True)
        print(f"       {' <- '.join(b['where'])}", flush=True)
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma2-2b", help=f"one of {', '.join(FD.MODELS)}")
    ap.add_argument("--method", default="compile", help="compile, default, lean or balanced")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048; tiny 64)")
    ap.add_argument("--ckpt", default="off", choices=("off", "on"))
    ap.add_argument("--attn", default=None, help="attn_implementation (default: per model)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON lines, appended (default $OUT/head_memory.jsonl)")
    ap.add_argument(
        "--stacks",
        default="python",
        choices=("python", "all"),
        help="frames recorded per allocation (all: C++ too, to name blocks allocated outside Python)",
    )
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run of the harness")
    args = ap.parse_args(argv)
    if args.model not in FD.MODELS:
        ap.error(f"unknown model {args.model!r}")
    if args.method != "compile" and not C.is_method(args.method):
        ap.error(f"unknown method {args.method!r}")
    args.device = "cpu" if args.tiny else "cuda"
    args.seq = args.seq or (64 if args.tiny else 2048)
    args.out = args.out or C.default_out("head_memory")
    C.append_row(
        args.out,
        C.header(
            args.device,
            dict(
                script="head_memory",
                model=args.model,
                method=args.method,
                batch=args.batch,
                seq=args.seq,
                ckpt=args.ckpt,
                stacks=args.stacks,
            ),
        ),
    )
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
