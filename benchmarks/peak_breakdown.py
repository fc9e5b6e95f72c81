"""Name the allocations alive at one fwd + bwd step's peak: the default through the pass, one head (CUDA only).

    python benchmarks/peak_breakdown.py --n 8192 --d 4096 --v 128256 --dtype autocast [--path lean]

Records the CUDA caching allocator's history (``torch.cuda.memory._record_memory_history``) over one step after a
warm-up step, replays its alloc / free events to the moment the allocated bytes peak, and prints the blocks alive
then, above what was allocated before the step (the inputs, their gradients' buffers from the warm-up freed), largest
first, each with the innermost frames of the Python stack that allocated it. ``--dtype autocast``: fp32 hidden states
and head, the loss under bf16 autocast (a Trainer's ``bf16=True``); ``bf16``: both in bf16. The model of the peak of
the path the site took (``cce_inductor.paths``, every row counted) is printed beside the measured one.
"""

from __future__ import annotations

import argparse
import collections

import torch
import torch.nn.functional as F

import cce_inductor
from cce_inductor import paths


def _frames(event, depth: int) -> str:
    keep = [
        f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']} {f['name']}"
        for f in event.get("frames", [])
        if "cce_inductor" in f["filename"] or "kernels" in f["filename"] or "torch/_inductor" in f["filename"]
    ]
    return " < ".join(keep[:depth]) or "(no package frame)"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--v", type=int, default=128256)
    ap.add_argument("--dtype", default="autocast", choices=["autocast", "bf16"])
    ap.add_argument("--path", default="auto", choices=["auto", "lean", "balanced"])
    ap.add_argument("--depth", type=int, default=3, help="package frames shown per block")
    args = ap.parse_args()
    mixed = args.dtype == "autocast"
    stored = torch.float32 if mixed else torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    e = (torch.randn(args.n, args.d, device="cuda", generator=gen) / 2).to(stored).requires_grad_(True)
    c = (torch.randn(args.v, args.d, device="cuda", generator=gen) / args.d**0.5).to(stored).requires_grad_(True)
    t = torch.randint(0, args.v, (args.n,), device="cuda", generator=gen)

    def loss_fn(e, c, t):
        return F.cross_entropy(F.linear(e, c).float(), t)

    compiled = torch.compile(loss_fn, backend=cce_inductor.make_backend(path=args.path))

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mixed):
            loss = compiled(e, c, t)
        loss.backward()
        torch.cuda.synchronize()

    step()
    stats = cce_inductor.stats()
    print(stats["summary"])
    (taken,) = {site["path"] for site in stats["sites"]}
    e.grad = c.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=200000)
    step()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    measured = torch.cuda.max_memory_allocated() - base

    alive, level, peak, at_peak = {}, 0, 0, {}
    for event in (ev for trace in snapshot["device_traces"] for ev in trace):
        if event["action"] == "alloc":
            alive[event["addr"]] = event
            level += event["size"]
        elif event["action"] == "free_completed" and event["addr"] in alive:
            level -= alive.pop(event["addr"])["size"]
        if level > peak:
            peak, at_peak = level, dict(alive)
    mib = 2**20
    print(
        f"measured peak above the inputs: {measured / mib:.0f} MiB; replayed from the step's events: {peak / mib:.0f}"
    )
    f = paths.HeadFacts(
        rows=args.n,
        hidden=args.d,
        vocab=args.v,
        element_size=2,
        kernels=True,
        reduction="mean",
        needs_grad=True,
        **paths.storage_facts(stored, stored, torch.bfloat16),
    )
    # the model of the path the site took (the balanced path's plan as the op makes it at run time)
    model = paths.lean_peak(f) if taken == "lean" else paths.balanced_plan(f).peak
    print(f"model: {taken} {model / mib:.0f} MiB; LB {paths.gradient_bytes(f) / mib:.0f}")
    groups = collections.defaultdict(list)
    for event in at_peak.values():
        groups[_frames(event, args.depth)].append(event["size"])
    print("| MiB | blocks | allocated at |\n|---|---|---|")
    for where, sizes in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        print(f"| {sum(sizes) / mib:.1f} | {len(sizes)} | {where} |")


if __name__ == "__main__":
    main()
