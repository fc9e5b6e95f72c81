"""Where a small head's time goes on the host: a compiled fused call against its kernels called directly.

At small N (GPT-2's head, N 4096) a fused fwd+bwd takes longer on the host than its kernels take on the GPU, so the
wall time is the host's. This prints, per way of calling the same head (bf16, or ``--dtype autocast``; LM-like sizes,
random data):

    host ms   the Python side of one fwd+bwd step, steps issued back to back (nothing waits for the GPU; but where
              the steps' launches outrun the GPU by more than CUDA keeps pending, a launch blocks and this reads
              the GPU's time)
    wall ms   the same steps, until the GPU is done (host-bound when equal to host ms, unless a launch blocked:
              the ``--trace`` timelines tell which)

for torch.compile, the pass with each path forced (balanced in one chunk: a 4 GiB scratch), the default, the op
called eagerly (``cce_inductor.linear_cross_entropy``), and the kernels' launch helpers called directly
(``kernels._balanced_launch.loss_and_grads``; ``kernels._forward.forward`` +
``kernels._backward_launch.backward``), and the balanced op alone as the default's plan calls it (no autograd, no
compiled graph), back to back and one call at a time on an idle device (issue 62's host target: its own host time
against its GPU time). Then the
lean and the default compiled steps cut into segments by timestamps taken where the op enters and leaves
``_dispatch`` (median us): the layers around the kernels' launch helpers (Dynamo, AOTAutograd, the custom op, the
op's own checks and row losses) against the helpers themselves. ``--trace DIR`` also writes torch.profiler traces
of 4 lean and 4 default steps. ``--shapes dynamic``: each compiled method is first called with N - 64 rows, so it is
timed at N under automatic dynamic shapes (what a trainer whose lengths vary gets; the vocabulary grid's dynamic cells).

Reproduce (CUDA):  python benchmarks/host_time.py [--n 4096 --d 768 --v 50257] [--shapes dynamic] [--ignore 50]
                   [--dtype autocast] [--launches] [--out results.json]
``--launches``: the default's host time per step by Triton kernel (each launch timed on the host) and by aten op.
CPU smoke run of the harness (the compiled methods only, on the chunked path):  python benchmarks/host_time.py --tiny
Measured (an H200 host of the device pool, torch 2.11, Triton 3.6, 2026-11-25; engineering log v15): torch.compile
1.03 ms host / 2.23 ms wall; the lean path through the pass 4.32 / 4.34 (host-bound), its kernels' launch helpers
called directly 2.89 / 2.90; balanced in one chunk 2.08 / 2.16. benchmarks/results/2026-11-25_h200_host-time_v15.*
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
import _harness as H  # noqa: E402  (benchmarks/ on the path first)

import cce_inductor  # noqa: E402
from cce_inductor import CCEOptions, _dispatch, _planning, balanced_op  # noqa: E402
from cce_inductor.kernels import _backward_launch, _balanced_launch, _forward  # noqa: E402


def host_and_wall(step, device="cuda"):
    host_ms, wall_ms = H.host_and_wall_ms(step, device=device)
    return {"host_ms": host_ms, "wall_ms": wall_ms}


def timeline(step, reps=20, device="cuda"):
    """Median microseconds between the timestamps of a step: its start, the op's entries into / exits from
    ``_dispatch.forward`` / ``_dispatch.backward`` (the lean path's launch helpers) and ``_dispatch.loss_and_grads``
    (the balanced path's), the forward's return and the backward's."""
    marks = []

    def stamp(name, fn):
        def wrapped(*args, **kwargs):
            marks.append((name + " in", time.perf_counter()))
            out = fn(*args, **kwargs)
            marks.append((name + " out", time.perf_counter()))
            return out

        return wrapped

    saved = _dispatch.forward, _dispatch.backward, _dispatch.loss_and_grads
    _dispatch.forward, _dispatch.backward, _dispatch.loss_and_grads = (
        stamp("kernels fwd", saved[0]),
        stamp("kernels bwd", saved[1]),
        stamp("kernels fwd+grads", saved[2]),
    )
    try:
        H.sync(device)
        for _ in range(reps):
            marks.append(("step", time.perf_counter()))
            step(marks)
        H.sync(device)
    finally:
        _dispatch.forward, _dispatch.backward, _dispatch.loss_and_grads = saved
    segments = {}
    for (a, ta), (b, tb) in zip(marks, marks[1:]):
        if b != "step":
            segments.setdefault(f"{a} -> {b}", []).append(1e6 * (tb - ta))
    return {k: sorted(v)[len(v) // 2] for k, v in segments.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--v", type=int, default=50257)
    ap.add_argument(
        "--shapes",
        choices=["static", "dynamic"],
        default="static",
        help="dynamic: each compiled method is first called with N - 64 rows (automatic dynamic shapes)",
    )
    ap.add_argument(
        "--dtype",
        choices=["bf16", "autocast"],
        default="bf16",
        help="autocast: fp32 E and C, the loss under bf16 autocast (fp32 weights as the Trainer's bf16=True runs them)",
    )
    ap.add_argument("--ignore", type=float, default=0.0, help="%% of the targets set to -100 (at random)")
    ap.add_argument("--out", default=None, help="JSON results (default: print only)")
    ap.add_argument("--trace", default=None, help="directory for torch.profiler traces of the lean and default steps")
    ap.add_argument(
        "--launches",
        action="store_true",
        help="the default's host time per step split by Triton kernel (its launches' host time) and by aten op",
    )
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: N 256, D 64, V 1001, compiled methods only")
    args = ap.parse_args()
    torch.manual_seed(0)
    n, d, v, dev = (256, 64, 1001, "cpu") if args.tiny else (args.n, args.d, args.v, "cuda")
    stored = torch.float32 if args.dtype == "autocast" else torch.bfloat16
    e = (torch.randn(n, d, device=dev) * 0.5).to(stored).requires_grad_()
    c = (torch.randn(v, d, device=dev) * 0.05).to(stored).requires_grad_()
    t = torch.randint(0, v, (n,), device=dev)
    t[torch.rand(n, device=dev) < args.ignore / 100] = -100

    def train_step(fn, e=e, t=t):
        def step(marks=None):
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=args.dtype == "autocast"):
                loss = fn(e, c, t)
            if marks is not None:
                marks.append(("forward returned", time.perf_counter()))
            loss.backward()
            if marks is not None:
                marks.append(("backward returned", time.perf_counter()))
            e.grad = c.grad = None

        return step

    results = {}
    methods = {
        "torch.compile": None,
        "lean": {"path": "lean"},
        "balanced, one chunk": {"path": "balanced", "scratch_mb": 4096},
        "default": {},
    }
    steps = {}
    for i, (name, kw) in enumerate(methods.items()):
        torch._dynamo.reset()
        fn = H.fresh_loss(i)
        compiled = torch.compile(fn) if kw is None else torch.compile(fn, backend=cce_inductor.make_backend(**kw))
        if args.shapes == "dynamic":  # compiled for N - 64 rows first: the call at N recompiles with a dynamic N
            rows = max(n - 64, 1)
            train_step(compiled, e.detach()[:rows].clone().requires_grad_(), t[:rows].clone())()
        steps[name] = train_step(compiled)
        results[name] = host_and_wall(steps[name], dev)
        if name in ("lean", "default"):
            results[f"{name} timeline (us)"] = timeline(steps[name], device=dev)
    if not args.tiny and args.dtype == "bf16":  # the helpers are timed on bf16 operands
        kernel_helpers(results, train_step, e, c, t, n, dev)
    if args.launches:
        results["default launches"] = launch_breakdown(steps["default"], dev)
    if args.trace:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
        os.makedirs(args.trace, exist_ok=True)
        for name in ("lean", "default"):
            with profile(activities=activities) as prof:
                for _ in range(4):
                    steps[name]()
                H.sync(dev)
            prof.export_chrome_trace(os.path.join(args.trace, f"{name}_steps.json"))
    device = f"{torch.cuda.get_device_name() if dev == 'cuda' else 'CPU'}, torch {torch.__version__}"
    if args.out:
        settings = dict(script="host_time", n=n, d=d, v=v, dtype=args.dtype, shapes=args.shapes, ignore=args.ignore)
        H.write_json(args.out, dict(H.header(dev, settings), results=results))
    print(f"# {device}; N {n}, D {d}, V {v}, {args.dtype}, {args.shapes} shapes")
    print(f"{'way of calling':34s} {'host ms':>8s} {'wall ms':>8s}")
    for name, r in results.items():
        if "host_ms" in r:
            print(f"{name:34s} {r['host_ms']:8.2f} {r['wall_ms']:8.2f}")
    for name in ("lean", "default"):
        print(f"{name}, compiled, one step (median us):")
        for seg, us in results[f"{name} timeline (us)"].items():
            print(f"  {seg:40s} {us:8.0f}")
    if args.launches:
        print("default, compiled, host time per step (us): Triton launches by kernel, then aten ops (self CPU time)")
        for kind in ("triton", "aten"):
            for name, calls, us in results["default launches"][kind]:
                print(f"  {kind:6s} {name[:48]:48s} {calls:6.1f} calls {us:8.1f} us")


def launch_breakdown(step, device, reps=20, top=20):
    """Per step of ``step``, the host time of each Triton kernel's launches (``JITFunction.run`` timed around every
    call: the binder, the argument specialisation and the driver's launch) and the self CPU time of each aten op
    under torch.profiler (the launches of cuBLAS and torch's own kernels inside them): where the op's host time
    goes, kernel by kernel.  Returns ``{"triton": [[name, calls, us], ...], "aten": [...]}`` per step, costliest
    first."""
    import collections

    from torch.profiler import ProfilerActivity, profile
    from triton.runtime.jit import JITFunction

    spent = collections.defaultdict(lambda: [0, 0.0])
    run = JITFunction.run

    def timed_run(self, *args, **kwargs):
        began = time.perf_counter()
        try:
            return run(self, *args, **kwargs)
        finally:
            entry = spent[getattr(self.fn, "__name__", repr(self.fn))]
            entry[0] += 1
            entry[1] += time.perf_counter() - began

    step()  # warm: the first call of each kernel compiles
    H.sync(device)
    JITFunction.run = timed_run
    try:
        for _ in range(reps):
            step()
        H.sync(device)
    finally:
        JITFunction.run = run
    triton_rows = sorted(([k, n / reps, 1e6 * t / reps] for k, (n, t) in spent.items()), key=lambda r: -r[2])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            step()
        H.sync(device)
    aten = [
        [a.key, a.count / reps, a.self_cpu_time_total / reps]
        for a in prof.key_averages()
        if a.key.startswith(("aten::", "cu"))  # torch's ops, the CUDA runtime / driver calls
    ]
    return {"triton": triton_rows[:top], "aten": sorted(aten, key=lambda r: -r[2])[:top]}


def kernel_helpers(results, train_step, e, c, t, n, dev):
    """The op called eagerly (``train_step(fn)``: one fwd+bwd of ``fn`` on e, c, t), and the kernels' launch helpers
    called directly (CUDA only)."""
    opts = {"lean": CCEOptions(path="lean"), "balanced": CCEOptions(path="balanced", scratch_mb=4096)}
    for path, opt in opts.items():
        results[f"eager op, {path}"] = host_and_wall(
            train_step(lambda e_, c_, t_, opt=opt: cce_inductor.linear_cross_entropy(e_, c_, t_, options=opt)), dev
        )
    ed, cd = e.detach(), c.detach()
    results["kernels directly, balanced"] = host_and_wall(
        lambda: _balanced_launch.loss_and_grads(
            ed, cd, t, None, softcap=None, ignore_index=-100, reduction="mean", chunk_rows=n
        ),
        dev,
    )
    # the op alone as the default's plan calls it at GPT-2's head (a 16-bit dC summed over at most two chunks; at
    # other sizes the pass may take the pair), no autograd and no compiled graph around it: the op's own host time
    # against its GPU time, calls back to back and one call at a time on an idle device
    op_alone = balanced_op.balanced_call(
        ed, cd, t, options=CCEOptions().encode(), need_e=True, need_c=True, need_bias=False, plain_sum=True
    )  # an OpCall: calling it calls the op
    results["the op alone, default plan"] = host_and_wall(op_alone, dev)
    one_at_a_time = H.synced_calls(op_alone, dev, calls=20, warmup=3)
    results["the op alone, one call at a time"] = {
        "host_ms": statistics.median(one_at_a_time.host_ms),
        "wall_ms": one_at_a_time.median_ms(),
    }
    lse = _forward.forward(ed, cd, t, None, softcap=None, ignore_index=-100)[0]
    grad_rows = torch.full((n,), 1.0 / n, device=dev)

    plan = _planning.backward_plan(n, cd.shape[0], products="cublas", backward_row_chunk=8192)

    def lean_kernels():
        _forward.forward(ed, cd, t, None, softcap=None, ignore_index=-100)
        _backward_launch.backward(
            ed,
            cd,
            t,
            None,
            lse,
            grad_rows,
            softcap=None,
            ignore_index=-100,
            need_e=True,
            need_c=True,
            need_bias=False,
            **plan._asdict(),
        )

    results["kernels directly, lean"] = host_and_wall(lean_kernels, dev)


if __name__ == "__main__":
    main()
