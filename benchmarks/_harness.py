"""The benchmarks' harness: every script in benchmarks/ times, measures peaks, checks gradients, reads the pass's
stats() and writes its rows through this module, so that a figure means the same thing whichever script printed it.

    timing      synced_ms / synced_calls / SyncedTimer: each call on its own, the device synchronised before it and
                waited for after it (what a training step's loss sees, the host's launch work included), with the
                host's own time beside it; queued_ms: calls queued back to back (triton.testing.do_bench on CUDA:
                the device's time); host_and_wall_ms: queued calls, until the host returns and until the device is
                done. A script reports synced and queued times side by side where both mean something.
    memory      Peak: the CUDA allocator's peak over a block, as allocated and above what was allocated when the
                block began (peak_above_mb: one call's, its inputs excluded, its outputs and gradients included)
    accuracy    rel_err of a gradient against fp32_reference_grads (the loss the scripts write, chunked) or
                fp32_grads (any loss), both from true fp32 matmuls
    the pass    setup_compile, the cce methods as data (METHODS), checked_pick and stats_fields of
                cce_inductor.stats()
    rows        header, append_row, read_rows, latest (JSON lines), write_json, md_table, fmt
    processes   main / run_workers: a driver that runs one worker process per unit, a crashed worker a row
On the CPU every time is perf_counter's and there are no memory figures (None): a CPU run checks a script, its
numbers mean nothing. Nothing here imports from examples/."""

from __future__ import annotations

import collections
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
import traceback
import warnings

import torch

# ------------------------------------------------------------------------------------------------------------
# methods and compile settings
# ------------------------------------------------------------------------------------------------------------
# make_backend keywords per cce method
METHODS = {
    "default": {},
    "lean": {"path": "lean"},
    "balanced": {"path": "balanced"},
    "rowskip": {"path": "lean", "products": "triton"},
    "lean_cublas": {"path": "lean", "products": "cublas"},
    "exact": {"exact": True},
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
    """{method: make_backend keywords} for the cce methods named (all of METHODS by default); printed unless
    ``quiet`` (the run's record of what each name meant)."""
    out = {name: method_keywords(name) for name in (METHODS if names is None else [n for n in names if is_method(n)])}
    if not quiet:
        print("# methods: " + ", ".join(f"{k}={v}" for k, v in out.items()), flush=True)
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
    dyn.recompile_limit = max(dyn.recompile_limit, 64)
    dyn.accumulated_recompile_limit = max(dyn.accumulated_recompile_limit, 512)
    cce_inductor.disable()


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


# ------------------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------------------
def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _clear_grads(tensors):
    for x in tensors or ():
        x.grad = None


class SyncedTimer:
    """Per-call synchronised timing of the work between start() and stop(): start() synchronises the device;
    stop() takes the host's time (the call has returned: ``host_ms``), then waits for the device (``wall_ms``:
    CUDA events on CUDA, the host's clock on the CPU). Host ms near wall ms: the call waits on the host. For loops
    a script does not own (a trainer's callbacks, a collective between steps); synced_calls owns one."""

    def __init__(self, device):
        self.device, self.wall_ms, self.host_ms = device, [], []

    def start(self):
        sync(self.device)
        if self.device == "cuda":
            self._began = torch.cuda.Event(enable_timing=True)
            self._began.record()
        self._t0 = time.perf_counter()

    def stop(self):
        host = (time.perf_counter() - self._t0) * 1e3
        if self.device == "cuda":
            ended = torch.cuda.Event(enable_timing=True)
            ended.record()
            ended.synchronize()
            wall = self._began.elapsed_time(ended)
        else:
            wall = host
        self.host_ms.append(host)
        self.wall_ms.append(wall)
        return wall

    def median_ms(self):
        return statistics.median(self.wall_ms)


def synced_calls(fn, device, calls=10, warmup=1, min_s=0.0, max_calls=100, grad_to_none=None):
    """A SyncedTimer over ``calls`` calls of ``fn`` after ``warmup`` untimed ones, and more while the timed ones add
    up to less than ``min_s`` seconds (at most ``max_calls``: a step that waits on the host stalls now and then,
    which a median of a few calls does not outvote). ``grad_to_none``: tensors whose .grad is cleared before each
    call."""
    for _ in range(warmup):
        _clear_grads(grad_to_none)
        fn()
    timer = SyncedTimer(device)
    while len(timer.wall_ms) < calls or (sum(timer.wall_ms) < 1e3 * min_s and len(timer.wall_ms) < max_calls):
        _clear_grads(grad_to_none)
        timer.start()
        fn()
        timer.stop()
    return timer


def synced_ms(fn, device, reps=10, grad_to_none=None):
    """Median ms of ``fn`` called on its own (synced_calls, after one warm-up call)."""
    return synced_calls(fn, device, reps, grad_to_none=grad_to_none).median_ms()


def queued_ms(fn, device, reps=3, grad_to_none=None, warmup_ms=25, rep_ms=100):
    """Median ms of ``fn`` over calls queued back to back: on CUDA triton.testing.do_bench (``warmup_ms`` of
    warm-up, ``rep_ms`` of repetitions, CUDA events, the L2 cache flushed between calls: the device's time where
    the host keeps ahead); on the CPU perf_counter over ``reps`` calls after one warm-up call."""
    if device == "cuda":
        import triton

        return triton.testing.do_bench(
            fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none, return_mode="median"
        )
    times = []
    for i in range(reps + 1):
        _clear_grads(grad_to_none)
        t0 = time.perf_counter()
        fn()
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def host_and_wall_ms(fn, device, reps=30, warmup=5):
    """``(host ms, wall ms)`` per call of ``fn``, calls issued back to back: the time until the last call returns on
    the host, and until the device has finished it (equal where the host is the limit; on the CPU, always)."""
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
# memory
# ------------------------------------------------------------------------------------------------------------
class Peak:
    """The CUDA allocator's peak over a ``with`` block (or from start() to stop()), the device synchronised at both
    ends: ``mb`` / ``gb`` the peak as allocated (parameters, optimizer state, activations: everything), ``above_mb``
    its rise above what was allocated at start() (a call's own memory: inputs excluded), ``start_gb`` what was
    allocated at start(), ``reserved_gb`` the most the allocator held from the device (its cache included). None on
    the CPU."""

    def __init__(self, device):
        self.cuda = device == "cuda"
        self.base = self.peak = self.reserved = None

    def start(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        return self

    def stop(self):
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
            self.reserved = torch.cuda.max_memory_reserved()
        return self

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    @property
    def mb(self):
        return None if self.peak is None else self.peak / 2**20

    @property
    def gb(self):
        return None if self.peak is None else self.peak / 2**30

    @property
    def above_mb(self):
        return None if self.peak is None else (self.peak - self.base) / 2**20

    @property
    def reserved_gb(self):
        return None if self.reserved is None else self.reserved / 2**30

    @property
    def start_gb(self):
        return None if self.base is None else self.base / 2**30


def peak_above_mb(fn, device):
    """MB the allocator's peak rose above what was allocated before one call of ``fn`` (None on the CPU)."""
    with Peak(device) as peak:
        fn()
    return peak.above_mb


def free(device):
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------------------
# accuracy
# ------------------------------------------------------------------------------------------------------------
def rel_err(a, ref, chunk=4096):
    """||a - ref|| / ||ref|| (Frobenius, in float64), ``chunk`` rows at a time; ``ref`` may live on the CPU."""
    a = a.detach().reshape(1) if a.dim() == 0 else a.detach()
    ref = ref.reshape(1) if ref.dim() == 0 else ref
    num = den = 0.0
    for s in range(0, a.shape[0], chunk):
        b = ref[s : s + chunk].to(a.device).double()
        num += (a[s : s + chunk].double() - b).pow(2).sum().item()
        den += b.pow(2).sum().item()
    return math.sqrt(num / den) if den else float("nan")


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


def fp32_grads(loss_fn, tensors, *rest):
    """The gradients of ``loss_fn(*tensors in fp32, *rest)`` with respect to those fp32 copies, eagerly with true
    fp32 matmuls: the reference of a loss that fp32_reference_grads does not write (it holds every logit)."""
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        leaves = [x.detach().float().requires_grad_(True) for x in tensors]
        loss_fn(*leaves, *rest).backward()
        return [x.grad for x in leaves]
    finally:
        torch.set_float32_matmul_precision(prev)


# ------------------------------------------------------------------------------------------------------------
# the pass's stats()
# ------------------------------------------------------------------------------------------------------------
def checked_pick(stats, cce):
    """``stats``: cce_inductor.stats() since reset_stats(), over the compile of the graph being measured. For a cce
    method the (path, reason) of the last site the pass saw; raises "NOT REWRITTEN" where it saw none or left one
    alone (a method that is not rewritten must not be reported as one). For a plain method None; raises where the
    pass rewrote anything (a baseline must be plain)."""
    if not cce:
        if stats["rewritten"]:
            raise RuntimeError(f"the pass rewrote a plain method's loss: {stats['summary']}")
        return None
    sites = stats["sites"]
    if not sites:
        raise RuntimeError(f"NOT REWRITTEN: the pass saw no loss site ({stats['summary']})")
    bad = [s for s in sites if not s["rewritten"]]
    if bad:
        raise RuntimeError(f"NOT REWRITTEN: {bad[0]['node']}: {bad[0]['reason']}")
    return sites[-1]["path"], sites[-1]["reason"]


def stats_fields(stats):
    """A row's record of cce_inductor.stats(): the graphs the pass saw, the sites rewritten and left alone (with the
    reasons), the last rewritten site's path and why, the fused ops' calls, the summary line."""
    done = [s for s in stats["sites"] if s["rewritten"]]
    return dict(
        pass_graphs=stats["graphs"],
        rewritten=stats["rewritten"],
        skipped=stats["skipped"],
        reasons=stats["reasons"] or None,
        pick=done[-1]["path"] if done else None,
        pick_reason=done[-1]["reason"] if done else None,
        executions=stats["executions"],
        summary=stats["summary"],
    )


class MemoryHistory:
    """What holds the memory at a peak or at an out-of-memory error: the CUDA allocator's history recorded from start()
    to stop() (``torch.cuda.memory._record_memory_history``, Python stacks),
    replayed to the moment the most was allocated (:meth:`at_peak`), or the blocks alive now (:meth:`live_now`,
    inside the ``except`` of an out-of-memory error: the failed call's tensors are still held). Each returns the
    largest groups of live blocks, a group being one size allocated from one place: ``[count, MiB each, MiB in all,
    where]`` (:func:`allocation_site`), and first ``["before", ...]``, what was allocated before the recording
    began and still is (:meth:`at_peak`), or ``["allocated", ...]``, all that is and what the allocator reserves,
    then ``["segment", MiB, MiB free, live blocks]`` for the segments with the most free bytes (:meth:`live_now`: a
    cache whose free memory is split around live blocks fails a request below its free total). Nothing on the CPU."""

    def __init__(self, device, max_entries: int = 2_000_000):
        self.cuda, self.max_entries = device == "cuda", max_entries
        self.base = 0

    def start(self):
        if self.cuda:
            torch.cuda.synchronize()
            self.base = torch.cuda.memory_allocated()
            torch.cuda.memory._record_memory_history(max_entries=self.max_entries, stacks="python")
        return self

    def stop(self):
        if self.cuda:
            torch.cuda.memory._record_memory_history(enabled=None)
        return self

    def restart(self):
        """A new recording from here (turning the history off clears the allocator's trace)."""
        return self.stop().start()

    def at_peak(self, top: int = 25):
        return None if not self.cuda else peak_holders(torch.cuda.memory._snapshot(), self.base, top)

    def live_now(self, top: int = 25):
        if not self.cuda:
            return None
        segments = torch.cuda.memory._snapshot()["segments"]
        mib = 2**20

        def sizes(segment, state):
            return [b["size"] for b in segment["blocks"] if b["state"] == state]

        blocks = [
            (b["size"], b.get("frames", [])) for s in segments for b in s["blocks"] if b["state"] == "active_allocated"
        ]
        reserved = sum(s["total_size"] for s in segments)  # the rest of it: the cache's free blocks (fragments)
        largest_free = max((size for s in segments for size in sizes(s, "inactive")), default=0)
        held = [
            "allocated",
            None,
            round(sum(size for size, _ in blocks) / mib, 1),
            f"of {reserved / mib:.1f} MiB reserved in {len(segments)} segments; its largest free block"
            f" {largest_free / mib:.1f} MiB",
        ]
        # the segments with the most free bytes: where a cached block is split around a live one
        by_free = sorted(((sum(sizes(s, "inactive")), s) for s in segments), key=lambda p: -p[0])
        split = [
            [
                "segment",
                round(s["total_size"] / mib, 1),
                round(free / mib, 1),
                "free; live in it: " + ", ".join(f"{size / mib:.1f}" for size in sizes(s, "active_allocated"))[:200],
            ]
            for free, s in by_free[:8]
            if free
        ]
        return [held] + split + group_blocks(blocks, top)


def allocation_site(frames) -> str:
    """Where a block was allocated: its innermost Python frame and, where that is torch's own Python (autograd, an
    autotuner's copies, dispatch), the innermost frame outside it as well (``frames`` innermost first, as the
    allocator records them; Inductor's generated code counts as outside)."""

    def own(f):
        return "/torch/" not in f["filename"] or "torchinductor" in f["filename"]

    def name(f):
        return f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}"

    if not frames:
        return "?"
    outside = next((f for f in frames if own(f)), None)
    return name(frames[0]) if outside is None or outside is frames[0] else f"{name(frames[0])} <- {name(outside)}"


def group_blocks(blocks, top: int, before: int | None = None):
    """``blocks``: (bytes, frames) pairs; the ``top`` largest groups of one size from one place (MiB)."""
    groups = collections.Counter()
    for size, frames in blocks:
        groups[(size, allocation_site(frames))] += 1
    rows = sorted(((n, size, site) for (size, site), n in groups.items()), key=lambda r: -r[0] * r[1])
    mib = 2**20
    head = [] if before is None else [["before", None, round(before / mib, 1), "allocated before the recording, alive"]]
    return head + [[n, round(size / mib, 1), round(n * size / mib, 1), site] for n, size, site in rows[:top]]


def peak_holders(snapshot, base: int, top: int = 25):
    """Replays the allocator's trace (``snapshot["device_traces"]``, device 0) to the moment the most was allocated
    and groups the blocks alive then (:func:`group_blocks`); a block freed during the trace but allocated before it
    began counts against ``base``, what was allocated at its start."""
    events = snapshot["device_traces"][0] if snapshot.get("device_traces") else []
    live, before, total = {}, base, base
    best, best_at = total, -1
    for i, event in enumerate(events):
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = event
            total += event["size"]
        elif action == "free_completed":
            if live.pop(event["addr"], None) is None:
                before -= event["size"]
            total -= event["size"]
        if total > best:
            best, best_at = total, i
    live, before = {}, base
    for event in events[: best_at + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed" and live.pop(event["addr"], None) is None:
            before -= event["size"]
    return group_blocks([(e["size"], e.get("frames", [])) for e in live.values()], top, before)


# ------------------------------------------------------------------------------------------------------------
# failures
# ------------------------------------------------------------------------------------------------------------
def is_oom(exc):
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def fatal_cuda(exc):
    """Errors after which this process's CUDA context is not to be trusted: the worker exits, the next starts fresh."""
    text = str(exc)
    return "CUDA error" in text or "illegal memory access" in text or "device-side assert" in text


def err_text(exc):
    text = str(exc).strip()
    if is_oom(exc):  # the allocation that failed and the frame that asked for it: the op's own, or the model's
        frames = traceback.extract_tb(exc.__traceback__)
        where = f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
        # the allocator's own split at that moment: what its cache held free is what a fragmented cache wastes
        split = re.search(
            r"([\d.]+ \w+) is allocated by PyTorch, and ([\d.]+ \w+) is reserved by PyTorch but unallocated", text
        )
        cache = f" ({split[1]} allocated, {split[2]} reserved but unallocated)" if split else ""
        return f"OutOfMemoryError: {text.splitlines()[0][:160] if text else ''}{where}{cache}"
    return f"{type(exc).__name__}: {text.splitlines()[0][:300]}" if text else type(exc).__name__


# ------------------------------------------------------------------------------------------------------------
# results: JSON lines (a header, then rows), single JSON documents, tables
# ------------------------------------------------------------------------------------------------------------
def default_out(name, ext="jsonl"):
    """$OUT/<name>.<ext> where $OUT is set (the device machine's return folder), else ./<name>.<ext>."""
    return os.path.join(os.environ.get("OUT", "."), f"{name}.{ext}")


def versions():
    """torch, Triton (None without it), cce_inductor."""
    out = {"torch": torch.__version__, "triton": None}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    import cce_inductor

    out["cce_inductor"] = cce_inductor.__version__
    return out


def header(device, extra=None):
    """The record every results file starts with: the device, versions, date, command line, the environment's
    CCE_INDUCTOR* / TORCHINDUCTOR* settings, and ``extra`` (the script's settings)."""
    return dict(
        kind="header",
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
        **versions(),
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        command=" ".join(shlex.quote(a) for a in sys.argv),
        env={k: v for k, v in os.environ.items() if k.startswith(("CCE_INDUCTOR", "TORCHINDUCTOR"))},
        **(extra or {}),
    )


def append_row(path, row):
    """Append one JSON line and flush it to disk, so a killed command keeps every finished row."""
    with open(path, "a") as fh:
        fh.write(json.dumps(row, default=_jsonable) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def write_json(path, document):
    """Write one JSON document whole (through a temporary file: a killed command leaves the previous version)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as fh:
        json.dump(document, fh, indent=1, default=_jsonable)
    os.replace(path + ".tmp", path)


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


def md_table(head, rows):
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join("" if c is None else str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def fmt(x, spec=".2f"):
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


# ------------------------------------------------------------------------------------------------------------
# processes: a driver, one worker process per unit
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


def finish_args(ap, args, name, hint="--tiny"):
    """The arguments every driver script shares: --out's default (``$OUT/<name>[_tiny].jsonl``), and a clear error
    where a GPU run is asked for on a machine without CUDA (``hint``: the flags of the script's CPU run)."""
    args.out = args.out or default_out(f"{name}_tiny" if args.tiny else name)
    if args.device == "cuda" and not torch.cuda.is_available() and not args.report:
        ap.error(f"no CUDA device: use {hint} for a CPU run of the harness")
    return args


def main(argv, parse_args, worker, driver):
    """A benchmark script's entry: its arguments parsed, then its worker (one unit in a fresh process) or the
    driver that starts the workers."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    return worker(args) if args.worker else driver(args, argv)
