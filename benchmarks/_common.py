"""Helpers shared by benchmarks/vocab_grid.py and benchmarks/full_depth.py: the methods as data, the results file
(JSON lines, appended as rows finish), the driver that runs one worker process per unit, timing and the pass's
per-site decisions. Nothing here imports from examples/."""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
import warnings

import torch

# make_backend keywords per method. CCEOptions.path ("auto" | "lean" | "balanced") is being added; until it is
# there, lean / balanced fall back to the scratch_mb spelling of the same choice (see resolve_methods).
METHODS = {
    "default": {},
    "lean": {"path": "lean"},
    "balanced": {"path": "balanced"},
    "rowskip": {"path": "lean", "products": "triton"},
    "lean_cublas": {"path": "lean", "products": "cublas"},
    "exact": {"exact": True},
}
FALLBACK = {
    "lean": {"scratch_mb": 0},
    "balanced": {"scratch_mb": 1024},
    "rowskip": {"products": "triton"},
    "lean_cublas": {"products": "cublas"},
}


# "balanced_mb<k>": the balanced path with a scratch of k MiB (as many row chunks as that scratch needs), for cells
# where the scratch the budget gives is the question (e.g. balanced_mb197: two chunks of GPT-2 medium's 4096 rows).
_SCRATCH_METHOD = re.compile(r"balanced_mb([1-9][0-9]*)$")
METHOD_NAMES = ", ".join([*METHODS, "balanced_mb<k>"])


def method_keywords(name):
    """make_backend keywords of a cce method name (METHODS or balanced_mb<k>); None for any other name."""
    if name in METHODS:
        return dict(METHODS[name])
    match = _SCRATCH_METHOD.match(name)
    return {"path": "balanced", "scratch_mb": int(match.group(1))} if match else None


def is_method(name):
    return method_keywords(name) is not None


def resolve_methods(names=None, quiet=False):
    """{method: make_backend keywords} for the cce methods named (all of METHODS by default), adapted to this
    CCEOptions."""
    from cce_inductor import CCEOptions

    has_path = "path" in {f.name for f in dataclasses.fields(CCEOptions)}
    out = {}
    for name in METHODS if names is None else [n for n in names if is_method(n)]:
        kw = method_keywords(name)
        if not has_path and "path" in kw:  # scratch_mb alone asks for the balanced path
            kw = dict(FALLBACK[name]) if name in FALLBACK else {k: v for k, v in kw.items() if k != "path"}
        out[name] = kw
    if not quiet:
        how = (
            "CCEOptions.path exists"
            if has_path
            else "CCEOptions has no `path` field: lean/balanced fall back to scratch_mb"
        )
        print(f"# methods ({how}): " + ", ".join(f"{k}={v}" for k, v in out.items()), flush=True)
    return out


def setup_compile():
    """Inductor's on-disk caches off (a cache hit skips the pass, so stats() would see no site, and a first step
    would not include its compile); room for the recompiles of one process; the global pass off (CCE_INDUCTOR=1)
    so that plain torch.compile stays plain."""
    import torch._dynamo.config as dyn
    import torch._inductor.config as ind

    import cce_inductor

    ind.force_disable_caches = True
    warnings.filterwarnings("ignore", message=".*force disabled by torch.compiler.config.force_disable_caches")
    if hasattr(dyn, "recompile_limit"):
        dyn.recompile_limit = max(dyn.recompile_limit, 64)
    else:
        dyn.cache_size_limit = max(dyn.cache_size_limit, 64)
    dyn.accumulated_recompile_limit = max(getattr(dyn, "accumulated_recompile_limit", 256), 512)
    cce_inductor.disable()


def site_pick(stats):
    """(path, reason) of the last site the pass saw since reset_stats() (the graph that was timed); raises when
    none was seen or any was left alone: a method that is not rewritten must not be reported as one."""
    sites = stats["sites"]
    if not sites:
        raise RuntimeError(f"NOT REWRITTEN: the pass saw no loss site ({stats['summary']})")
    bad = [s for s in sites if not s["rewritten"]]
    if bad:
        raise RuntimeError(f"NOT REWRITTEN: {bad[0]['node']}: {bad[0]['reason']}")
    return sites[-1]["path"], sites[-1]["reason"]


# ------------------------------------------------------------------------------------------------------------
# device, timing
# ------------------------------------------------------------------------------------------------------------
def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def synced_ms(fn, device, reps=10, grad_to_none=None):
    """Median ms of ``fn`` called on its own: the device synchronised before each call and CUDA events around it
    (what a training step's loss sees, the host's launch work included), after one warm-up call; on the CPU
    perf_counter. :func:`bench` times calls queued back to back instead: report both."""
    times = []
    for i in range(reps + 1):
        for x in grad_to_none or ():
            x.grad = None
        sync(device)
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
        if i:
            times.append(ms)
    return statistics.median(times)


def bench(fn, device, reps=2, grad_to_none=None):
    """Median ms: triton.testing.do_bench (CUDA events, after warm-up) on CUDA; on the CPU perf_counter over
    ``reps`` calls after one warm-up call."""
    if device == "cuda":
        import triton

        return triton.testing.do_bench(fn, grad_to_none=grad_to_none, return_mode="median")
    times = []
    for i in range(reps + 1):
        for x in grad_to_none or ():
            x.grad = None
        t0 = time.perf_counter()
        fn()
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def cuda_peak_mb(fn):
    """MB the CUDA allocator's peak rose above what was allocated before one call of ``fn`` (synchronised)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def fresh_loss(tag, ignore_index=-100):
    """``F.cross_entropy(F.linear(e, c).float(), t)`` as a new function with its own code object: Dynamo caches
    compiled code per code object, so two methods compiling one function would share it."""
    import torch.nn.functional as F

    src = (
        f"def loss_{tag}(e, c, t):\n"
        f"    return F.cross_entropy(F.linear(e, c).float(), t, ignore_index={ignore_index})\n"
    )
    scope = {"F": F}
    exec(compile(src, f"<benchmark loss_{tag}>", "exec"), scope)
    return scope[f"loss_{tag}"]


def host_and_wall_ms(fn, reps=30, warmup=5, device="cuda"):
    """``(host ms, wall ms)`` per call of ``fn``, calls issued back to back: the time until the last call returns on
    the host, and until the GPU has finished it (equal where the host is the limit; on the CPU, always)."""
    for _ in range(warmup):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    t1 = time.perf_counter()
    sync(device)
    t2 = time.perf_counter()
    return 1e3 * (t1 - t0) / reps, 1e3 * (t2 - t0) / reps


def free(device):
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def is_oom(exc):
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def fatal_cuda(exc):
    """Errors after which this process's CUDA context is not to be trusted: the worker exits, the next starts fresh."""
    text = str(exc)
    return "CUDA error" in text or "illegal memory access" in text or "device-side assert" in text


def err_text(exc):
    if is_oom(exc):
        return "OutOfMemoryError"
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300]}" if text else type(exc).__name__


def kernel_breakdown(step, device, top=10):
    """Device time per kernel name over one call of ``step`` under torch.profiler (CPU: self CPU time per op):
    ``[(name, calls, ms)]``, the largest ``top`` first, the rest summed as "other"."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        step()
        sync(device)
    per = {}
    for ev in prof.events():
        if cuda and ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = ev.time_range.elapsed_us() if cuda else ev.self_cpu_time_total
        calls, total = per.get(ev.name, (0, 0.0))
        per[ev.name] = (calls + 1, total + us)
    ranked = sorted(((n[:90], c, us / 1e3) for n, (c, us) in per.items()), key=lambda r: -r[2])
    rest = ranked[top:]
    return ranked[:top] + ([("other", sum(r[1] for r in rest), sum(r[2] for r in rest))] if rest else [])


def print_breakdown(title, rows):
    total = sum(r[2] for r in rows) or float("nan")
    print(f"## kernels {title}: {total:.2f} ms in all", flush=True)
    for name, calls, ms in rows:
        print(f"   {ms:9.3f} ms {100 * ms / total:5.1f}% {calls:5d}x  {name}", flush=True)


# ------------------------------------------------------------------------------------------------------------
# results file
# ------------------------------------------------------------------------------------------------------------
def default_out(name):
    """$OUT/<name>.jsonl where $OUT is set (the device machine's return folder), else ./<name>.jsonl."""
    return os.path.join(os.environ.get("OUT", "."), f"{name}.jsonl")


def header(device, extra=None):
    h = dict(
        kind="header",
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
        torch=torch.__version__,
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        command=" ".join(shlex.quote(a) for a in sys.argv),
        env={k: v for k, v in os.environ.items() if k.startswith(("CCE_INDUCTOR", "TORCHINDUCTOR"))},
    )
    try:
        import triton

        h["triton"] = triton.__version__
    except ImportError:
        h["triton"] = None
    try:
        import cce_inductor

        h["cce_inductor"] = cce_inductor.__version__
    except ImportError:
        pass
    h.update(extra or {})
    return h


def append_row(path, row):
    """Append one JSON line and flush it to disk, so a killed command keeps every finished row."""
    with open(path, "a") as fh:
        fh.write(json.dumps(row, default=_jsonable) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def _jsonable(x):
    if isinstance(x, float) and math.isnan(x):
        return None
    return str(x)


def read_rows(path):
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # a line cut by a kill
    return rows


def latest(rows, key):
    """The last row per key(row) (a re-run replaces an earlier result), in first-seen order."""
    out = {}
    for r in rows:
        if r.get("kind", "row") == "row":
            out[key(r)] = r
    return list(out.values())


# ------------------------------------------------------------------------------------------------------------
# driver: one worker process per unit
# ------------------------------------------------------------------------------------------------------------
def run_workers(units, argv, script, budget_s, out, crash_row):
    """Run ``python script ARGV --worker UNIT-ARGS --deadline T`` for each unit (a list of extra arguments),
    one at a time, output streamed; a worker that dies is recorded by ``crash_row(unit, rc)``. Stops launching
    when the budget is spent. Returns the units not started."""
    start = time.time()
    deadline = start + budget_s if budget_s else 0.0
    for i, unit in enumerate(units):
        if deadline and time.time() > deadline - 20:
            print(f"# budget of {budget_s:.0f} s spent: {len(units) - i} worker(s) not started", flush=True)
            return units[i:]
        cmd = [sys.executable, script, *argv, "--worker", *unit, "--deadline", f"{deadline:.0f}"]
        print(f"# worker: {' '.join(shlex.quote(a) for a in cmd[1:])}", flush=True)
        rc = subprocess.call(cmd)
        if rc != 0:
            row = crash_row(unit, rc)
            print(f"# worker exited with {rc}: recorded {row}", flush=True)
            append_row(out, row)
    return []


def strip_flags(argv, flags):
    """argv without the given options (each with its value, as ``--flag V`` or ``--flag=V``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in flags:
            skip = "=" not in a
            continue
        out.append(a)
    return out


def past_deadline(deadline, need_s=0.0):
    return bool(deadline) and time.time() + need_s > deadline


def md_table(head, rows):
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join("" if c is None else str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def fmt(x, spec=".2f"):
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def finish_args(ap, args, name, hint="--tiny"):
    """The arguments every driver script shares: --out's default (``$OUT/<name>[_tiny].jsonl``), and a clear error
    where a GPU run is asked for on a machine without CUDA (``hint``: the flags of the script's CPU run)."""
    args.out = args.out or default_out(f"{name}_tiny" if args.tiny else name)
    if args.device == "cuda" and not torch.cuda.is_available() and not args.report:
        ap.error(f"no CUDA device: use {hint} for a CPU run of the harness")
    return args


def main(argv, parse_args, worker, driver):
    """A benchmark script's entry: its arguments parsed, then its worker (one head / model in a fresh process) or
    the driver that starts the workers."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    return worker(args) if args.worker else driver(args, argv)


def fp32_reference_grads(e, c, t, ignore_index=-100, chunk=1024):
    """(dE, dC) of the mean cross-entropy from fp32 logits (true fp32 matmuls, no TF32), chunked over rows: the
    reference the benchmarks' gradient errors are measured against (torch.compile's included)."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        c32 = c.float()
        count = (t != ignore_index).sum().clamp(min=1).float()
        de = torch.empty(e.shape, dtype=torch.float32, device=e.device)
        dc = torch.zeros(c.shape, dtype=torch.float32, device=e.device)
        for s in range(0, e.shape[0], chunk):
            e32, tt = e[s : s + chunk].float(), t[s : s + chunk]
            grad = torch.softmax(e32 @ c32.T, -1)
            vv = tt != ignore_index
            grad[vv.nonzero()[:, 0], tt[vv]] -= 1.0
            grad *= (vv.float() / count)[:, None]
            de[s : s + chunk] = grad @ c32
            dc += grad.T @ e32
            del grad
        return de, dc
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
