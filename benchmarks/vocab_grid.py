"""The vocabulary grid: the loss as users write it, ``F.cross_entropy(F.linear(e, c).float(), t)`` (e: N x D, c: V x D,
bf16, mean, ignore_index -100), compiled by plain torch.compile and by cce_inductor's backend, over real heads.

Reproduce: the grid is 14 heads x 3 N x 2 ignore x 2 shapes, each case 5 to 8 compiled methods. Each command below
is meant for one 10-minute device call (--budget-s 500: the driver starts no worker, and a worker no case or method,
past it); every row is appended to --out as it finishes. Re-run the SAME command with --resume until its output
has no "not done" line (finished cases are skipped, an unfinished one is redone whole):

    python benchmarks/vocab_grid.py --heads H --shapes static --resume     # for each head H, then
    python benchmarks/vocab_grid.py --heads H --shapes dynamic --resume
        H: gpt2 gpt2-medium llama2 phi35 v62421 v65535 v65536 v100277 v100352 llama3 qwen25-0.5b qwen25-7b gemma2 gemma3
           deepseek-v3 mistral-nemo (small heads can share a command: --heads gpt2,gpt2-medium,llama2)
    python benchmarks/vocab_grid.py --report                   # the table of everything in --out, nothing run
    python benchmarks/vocab_grid.py --heads gemma2 --n 8192 --ignore 0 --shapes static --profile   # kernel times
    python benchmarks/vocab_grid.py --tiny                     # CPU run of the harness (2-4 minutes on 2 cores)

Defaults: --n 4096,8192,32768 --ignore 0,50 --shapes static,dynamic --methods matmul,compile,auto_chunker,default,
exact,peers; --out $OUT/vocab_grid.jsonl ($OUT unset: ./vocab_grid.jsonl); --budget-s 500 (the driver starts no
worker, and a worker no case, that would end past it). One process per head: the driver runs
``vocab_grid.py --worker --head X`` in turn; a head that crashes is recorded as an error row and the next goes on.

Methods (each its own freshly created Python function, so no two share Dynamo's cache on one code object;
torch._dynamo.reset() before each method of each case):
    matmul    one bf16 N x D @ D x V product (forward only): the floor
    compile   torch.compile(loss), Inductor's default backend: the bar
    auto_chunker  the same with torch._inductor.config.auto_chunker.enable (Inductor's own large-logit rewrite)
    default / lean / balanced   torch.compile(loss, backend=cce_inductor.make_backend(**METHODS[name])) with
              METHODS = {"default": {}, "lean": {"path": "lean"}, "balanced": {"path": "balanced"}} (_harness.py;
              printed at start)
    balanced_mb<k>  make_backend(path="balanced", scratch_mb=k): the balanced path at a scratch of k MiB (as many row
              chunks as it needs; e.g. balanced_mb197 runs GPT-2 medium's 4096 rows in two chunks)
    exact     make_backend(exact=True): the lean path, gradients at no more than torch.compile's error
    rowskip   make_backend(path="lean", products="triton"): the lean path whose dE / dC products skip the ignored
              rows (Triton products reading the device-side count), for the ignored-target cells against TRL
    lean_cublas  make_backend(path="lean", products="cublas"): the lean path with cuBLAS products on every call (the
              default's products="auto" takes the counted prefix after a call with >= 10% ignored targets, the
              row-skipping products alone after one with >= 60%)
    peers     when importable (otherwise noted in the output and skipped), called eagerly, static cases only:
              trl       trl.kernels.chunked_logprob.ChunkedLogProbFunction as TRL's SFT calls it (valid rows only,
                        outputs log_probs, entropy, is_top1, TRL's chunk size); loss = mean over valid rows of -logprob
              liger     liger_kernel.transformers.functional.liger_fused_linear_cross_entropy (CUDA only)
              torch_lce F.linear_cross_entropy(..., options=torch.nn.LinearCrossEntropyOptions()): PyTorch's
                        chunked loss, where the installed torch has it
              apple_cce cut_cross_entropy.linear_cross_entropy with its defaults (CUDA only)
Shapes: static = torch.compile(dynamic=False), called at N only. dynamic = torch.compile() (dynamic=None), called
first with N-64 rows (forward + backward), then with N (Dynamo's automatic dynamic-shape recompile), timed at N.

Data ("lm" regime): c Gaussian with unit-norm rows; each row of e a sum of 48 plausible tokens' vectors with
weights 14 - log(rank) drawn from a Zipf popularity; its target sampled from them; --ignore P sets P% of the
targets (random rows) to -100. Seeded (--seed). --ignore-spread S: each timed call runs 8 target sets in turn whose
ignored shares are spread over P +- S % (a batch whose prompt share moves from step to step), fwd+bwd_ms is its time
over 8 (errors are those of the first set, at P %). The cce methods' rows carry stats()['backward_products'] and
stats()['balanced_rows'] (which products the calls took).

Columns (JSON lines in --out; the first line of each run is a header: device, torch / triton versions, date,
command line, the methods' keywords, the peers found):
    head, d, v, n, ignore_pct, shapes, method
    pick          the path stats() reports for the timed graph's site (cce methods; pick_reason: why). A cce method
                  whose site was not rewritten is an error ("NOT REWRITTEN: ...") and makes the command exit 1.
    fwd_ms        forward only, under no_grad (matmul, compile, default)
    fwdbwd_ms     loss + loss.backward() (grads of e and c), calls queued back to back: median of CUDA-event
                  timings after warm-up (triton.testing.do_bench, return_mode="median", grads set to None between reps)
    sync_ms       the same, each call on its own: synchronised before, CUDA events around it (what a training
                  step's loss sees, host launch work included; _harness.synced_ms, median of >= 10 calls)
    peak_mb       torch.cuda.max_memory_allocated() during one fwd+bwd above what was allocated before it
                  (inputs excluded, gradients included)
    x_compile_ms, x_compile_sync, x_compile_mb   fwdbwd_ms, sync_ms and peak_mb over compile's, same process,
                  case and shapes
    err_de, err_dc  relative L2 (Frobenius) errors of dE, dC against gradients from fp32 logits (computed from the
                  bf16 inputs, chunked over rows); compile's is the bar
    lower_bound_mb  (N*D + V*D) * 2 / 2**20: the inputs' size, what a gradient-returning method must at least write
    error         what failed (OutOfMemoryError, NOT REWRITTEN, ...)
The markdown table printed last has one row per case x method (latest result per key in --out).

--dtype fp32 (default bf16): e and c in fp32 (no autocast), the loss as written; --dtype autocast: e and c in fp32,
every method's loss (the peers' too) called under torch.autocast(dtype=torch.bfloat16), as a Trainer's bf16=True
runs an fp32 model (lower_bound_mb counts the fp32 gradients); --matmul-precision high sets
torch.set_float32_matmul_precision("high") (TF32 for fp32 matmuls: torch.compile's cuBLAS products and, since
2026-11-26, the kernels' own) in every worker. The reference stays fp32 logits with IEEE products, so for fp32 inputs
errors below ~1e-6 are not resolved (the TF32 errors, ~1e-3, are). Rows carry both; --resume keys on them.
--tiny: CPU, heads tiny2003 / tiny2048 (D 64), N 256, two reps, perf_counter timing, no memory figures.
--profile [M,...]: for the default method (or the methods listed), one fwd+bwd under torch.profiler: device time per
kernel (top 10 + other).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as H

HEADS = {  # name: (D, V)
    "gpt2": (768, 50257),
    "gpt2-medium": (1024, 50257),
    "llama2": (4096, 32000),
    "phi35": (3072, 32064),
    "v65535": (2048, 65535),
    "v62421": (2048, 62421),
    "v65536": (2048, 65536),
    "v100277": (4096, 100277),
    "v100352": (2048, 100352),
    "llama3": (4096, 128256),
    "llama32-1b": (2048, 128256),
    "qwen25-0.5b": (896, 151936),
    "qwen25-7b": (3584, 152064),
    "gemma2": (2304, 256000),
    "gemma3": (2560, 262208),
    "deepseek-v3": (7168, 129280),
    "mistral-nemo": (5120, 131072),
}
TINY_HEADS = {"tiny2003": (64, 2003), "tiny2048": (64, 2048)}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "autocast": torch.float32}
IGNORE = -100
BASE = ("matmul", "compile", "auto_chunker")
FWD_TOO = ("matmul", "compile", "default")  # methods also timed forward-only
COLUMNS = (
    "head",
    "d",
    "v",
    "n",
    "ignore_pct",
    "shapes",
    "method",
    "pick",
    "fwd_ms",
    "fwdbwd_ms",
    "sync_ms",
    "peak_mb",
    "x_compile_ms",
    "x_compile_mb",
    "err_de",
    "err_dc",
    "lower_bound_mb",
    "error",
    "ignore_spread",
    "backward_products",
    "balanced_rows",
)


# ------------------------------------------------------------------------------------------------------------
# data and reference
# ------------------------------------------------------------------------------------------------------------
def make_data(n, d, v, ignore_pct, device, seed, dtype=torch.bfloat16, spread=0, variants=8):
    """The "lm" regime: ``(e, c, targets)``, e and c in ``dtype``; with ``spread``, ``targets`` is a list of
    ``variants`` target tensors whose ignored shares are spread evenly over ``ignore_pct +- spread`` %, the first
    at ``ignore_pct`` (a batch whose prompt share moves from step to step)."""
    g = torch.Generator(device=device).manual_seed(seed)
    c32 = F.normalize(torch.randn(v, d, device=device, generator=g), dim=1)
    popularity = torch.empty(v, device=device)
    rank = torch.arange(v, device=device, dtype=torch.float32)
    popularity[torch.randperm(v, device=device, generator=g)] = (rank + 10.0) ** -1.1
    k = 48
    alpha = (14.0 - torch.log(torch.arange(1, k + 1, device=device, dtype=torch.float32))).expand(n, k).contiguous()
    toks = torch.cat(
        [
            torch.multinomial(popularity.expand(min(1024, n - s), v), k, replacement=False, generator=g)
            for s in range(0, n, 1024)
        ]
    )
    e32 = torch.zeros(n, d, device=device)
    for j in range(k):
        e32 += alpha[:, j : j + 1] * c32[toks[:, j]]
    pick = torch.multinomial(torch.softmax(alpha, -1), 1, generator=g)[:, 0]
    t = toks.gather(1, pick[:, None])[:, 0]
    shares = (
        [ignore_pct] + [ignore_pct - spread + 2 * spread * j / (variants - 2) for j in range(variants - 1)]
        if spread
        else [ignore_pct]
    )
    ts = []
    for pct in shares:
        drop = torch.randperm(n, device=device, generator=g)[: round(n * max(0.0, min(100.0, pct)) / 100)]
        ts.append(t.clone().index_fill_(0, drop, IGNORE))
    return e32.to(dtype).contiguous(), c32.to(dtype).contiguous(), (ts if spread else ts[0])


# ------------------------------------------------------------------------------------------------------------
# methods
# ------------------------------------------------------------------------------------------------------------
def find_peers(device):
    """({name: loss fn}, [notes]) for the peers that import (and run on this device)."""
    peers, notes = {}, []
    try:
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction

        try:
            from trl.trainer import utils as trl_utils  # the function's backward imports from it

            chunk = getattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", 32768)
        except Exception as exc:  # noqa: BLE001 - trl.trainer needs `datasets` & co., absent on the device: its backward only
            # needs maybe_gather_lm_head_ctx, which TRL makes a null context outside DeepSpeed ZeRO-3
            import contextlib
            import types

            stub = types.ModuleType("trl.trainer.utils")
            stub.maybe_gather_lm_head_ctx = lambda *params: contextlib.nullcontext()
            sys.modules["trl.trainer.utils"] = stub
            chunk = 32768  # trl/trainer/utils.py's _CHUNKED_LOGPROB_CHUNK_SIZE in TRL 1.16.0
            notes.append(
                f"trl: trl.trainer not importable ({H.err_text(exc)}); maybe_gather_lm_head_ctx stubbed "
                "as the null context TRL uses outside ZeRO-3"
            )

        def trl_loss(e, c, t):
            valid = t != IGNORE
            lp = ChunkedLogProbFunction.apply(
                e[valid], c, None, t[valid], 1.0, chunk, None, 1.0, ("log_probs", "entropy", "is_top1")
            )[0]
            return -lp.sum() / valid.sum().clamp(min=1)

        peers["trl"] = trl_loss
    except Exception as exc:  # noqa: BLE001
        notes.append(f"trl: {H.err_text(exc)}")
    if hasattr(F, "linear_cross_entropy"):  # PyTorch's own chunked loss, where this torch has it
        try:
            options = getattr(torch.nn, "LinearCrossEntropyOptions", None) or F.LinearCrossEntropyOptions
            peers["torch_lce"] = lambda e, c, t: F.linear_cross_entropy(e, c, t, ignore_index=IGNORE, options=options())
        except Exception as exc:  # noqa: BLE001
            notes.append(f"torch_lce: {H.err_text(exc)}")
    else:
        notes.append("torch_lce: this torch has no F.linear_cross_entropy")
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as liger

        if device != "cuda":
            raise ImportError("needs CUDA")
        peers["liger"] = lambda e, c, t: liger(e, c, t, ignore_index=IGNORE)
    except Exception as exc:  # noqa: BLE001
        notes.append(f"liger: {H.err_text(exc)}")
    try:
        from cut_cross_entropy import linear_cross_entropy as apple

        if device != "cuda":
            raise ImportError("needs CUDA")
        peers["apple_cce"] = lambda e, c, t: apple(e, c, t, ignore_index=IGNORE)
    except Exception as exc:  # noqa: BLE001
        notes.append(f"apple_cce: {H.err_text(exc)}")
    return peers, notes


def build(name, backends, peers, dynamic, tag):
    if name in peers:
        return peers[name]
    fn = H.fresh_loss(tag, IGNORE)
    if name == "compile":
        return torch.compile(fn, dynamic=dynamic)
    if name == "auto_chunker":  # Inductor's own rewrite of large-logit losses, where this torch has it
        import torch._inductor.config as inductor_config

        if not hasattr(inductor_config, "auto_chunker"):
            raise RuntimeError("torch._inductor.config has no auto_chunker in this torch")
        compiled = torch.compile(fn, dynamic=dynamic)

        def chunked(*a):
            with inductor_config.patch({"auto_chunker.enable": True}):
                return compiled(*a)

        return chunked
    import cce_inductor

    return torch.compile(fn, backend=cce_inductor.make_backend(**backends[name]), dynamic=dynamic)


def measure(fn, e, c, t, args, dynamic, ref, is_cce, fwd, profile):
    """One method on one case: fwd+bwd ms, peak MB, errors, pick; fwd ms where asked."""
    import cce_inductor

    dev, r = args.device, {}
    e.requires_grad_(True)
    c.requires_grad_(True)
    # --ignore-spread: one timed call runs every target set in turn (do_bench times only a few ~30 ms calls, which
    # would see a few of the sets: a median biased toward whichever), its time divided by their number
    variants = t if isinstance(t, list) else [t]
    t = variants[0]

    mixed = args.dtype == "autocast"  # fp32 e and c, the loss under bf16 autocast (a Trainer's bf16=True)

    def step(ee=e, cc=c, tt=t):
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=mixed):
            loss = fn(ee, cc, tt)
        loss.backward()

    def timed_step():
        for tt in variants:
            e.grad = c.grad = None
            step(tt=tt)

    try:
        cce_inductor.reset_stats()
        if dynamic:  # as a trainer whose lengths vary: a first shape, then N (the automatic-dynamic recompile)
            m = e.shape[0] - 64
            step(e[:m].detach().requires_grad_(True), c.detach().requires_grad_(True), t[:m])
        step()
        H.sync(dev)
        pick = H.checked_pick(cce_inductor.stats(), is_cce)
        if pick:
            r["pick"], r["pick_reason"] = pick
        e.grad = c.grad = None
        H.free(dev)
        r["peak_mb"] = H.peak_above_mb(step, dev)
        r["err_de"], r["err_dc"] = H.rel_err(e.grad, ref[0]), H.rel_err(c.grad, ref[1])
        e.grad = c.grad = None
        r["fwdbwd_ms"] = H.queued_ms(timed_step, dev, args.reps, grad_to_none=[e, c]) / len(variants)
        r["sync_ms"] = H.synced_ms(timed_step, dev, max(args.reps, 10), grad_to_none=[e, c]) / len(variants)
        if is_cce:  # the lean backward's products per call, every call so far (cce_inductor/_counted_share.py)
            r["backward_products"] = cce_inductor.stats()["backward_products"]
            r["balanced_rows"] = cce_inductor.stats()["balanced_rows"]
        if profile:
            e.grad = c.grad = None
            r["kernels"] = H.kernel_breakdown(timed_step, dev)  # (--ignore-spread: over all the target sets)
    finally:
        e.grad = c.grad = None
        e.requires_grad_(False)
        c.requires_grad_(False)
    if fwd:

        def fwd_only():
            with torch.no_grad(), torch.autocast(dev, dtype=torch.bfloat16, enabled=mixed):
                return fn(e, c, t)

        fwd_only()
        r["fwd_ms"] = H.queued_ms(fwd_only, dev, args.reps)
    return r


# ------------------------------------------------------------------------------------------------------------
# worker: one head
# ------------------------------------------------------------------------------------------------------------
def case_key(r):
    return (
        r["head"],
        r["n"],
        r["ignore_pct"],
        r["shapes"],
        r.get("dtype") or "bf16",
        r.get("matmul_precision") or "highest",
        r.get("ignore_spread") or 0,
    )


def method_names(args, backends, peers):
    return [m for m in args.methods if m in BASE or m in backends] + [
        p for p in peers if "peers" in args.methods_raw or p in args.methods
    ]


def finished(rows, names, peers):
    """The case keys whose every method has a row (peers run in static cases only)."""
    have = {}
    for r in rows:
        if r.get("kind") == "row" and r.get("n") is not None:
            have.setdefault(case_key(r), set()).add(r["method"])
    return {k for k, got in have.items() if all(m in got for m in names if m not in peers or k[3] == "static")}


def case_of(args, head, n, ign, shapes):
    return (head, n, ign, shapes, args.dtype, args.matmul_precision, args.ignore_spread)


def worker(args):
    H.setup_compile()
    torch.set_float32_matmul_precision(args.matmul_precision)
    d, v = {**HEADS, **TINY_HEADS}[args.head]
    backends = H.resolve_methods(args.methods, quiet=True)
    peers, notes = find_peers(args.device)
    if "peers" in args.methods_raw:
        print(
            f"# peers: {', '.join(peers) or 'none'}" + (f" (skipped: {'; '.join(notes)})" if notes else ""), flush=True
        )
    names = method_names(args, backends, peers)
    done = finished(H.read_rows(args.out), names, peers) if args.resume else set()
    slowest, bad = 0.0, 0
    for n in args.n:
        for ign in args.ignore:
            cases = [s for s in args.shapes if case_of(args, args.head, n, ign, s) not in done]
            if not cases:
                continue
            if H.past_deadline(args.deadline, 1.2 * slowest):
                print(f"# {args.head}: deadline: stopping before N={n} ignore={ign}%", flush=True)
                return 0
            began = time.time()
            try:
                e, c, t = make_data(n, d, v, ign, args.device, args.seed, DTYPES[args.dtype], args.ignore_spread)
                ref = [x.cpu() for x in H.fp32_reference_grads(e, c, t[0] if args.ignore_spread else t, IGNORE)]
                mm_ms = H.queued_ms(lambda: e @ c.T, args.device, args.reps)
            except Exception as exc:  # noqa: BLE001 - every method of these cases gets the error; next N goes on
                for shapes in cases:
                    for name in names:
                        H.append_row(
                            args.out,
                            dict(
                                dict.fromkeys(COLUMNS),
                                kind="row",
                                head=args.head,
                                d=d,
                                v=v,
                                n=n,
                                ignore_pct=ign,
                                shapes=shapes,
                                method=name,
                                dtype=args.dtype,
                                matmul_precision=args.matmul_precision,
                                error=f"data: {H.err_text(exc)}",
                            ),
                        )
                print(f"# {args.head} N={n} ignore={ign}%: data / reference FAILED: {H.err_text(exc)}", flush=True)
                e = c = t = ref = None
                H.free(args.device)
                if H.fatal_cuda(exc):
                    return 3
                continue
            for shapes in cases:
                dynamic = None if shapes == "dynamic" else False
                results = {}
                for name in names:
                    if name in peers and shapes != "static":
                        continue
                    if H.past_deadline(args.deadline):  # an unfinished case is redone whole by --resume
                        print(f"# {args.head}: deadline: stopping in N={n} ignore={ign}% {shapes}", flush=True)
                        return 0
                    row = dict(
                        dict.fromkeys(COLUMNS),
                        kind="row",
                        head=args.head,
                        d=d,
                        v=v,
                        n=n,
                        ignore_pct=ign,
                        shapes=shapes,
                        method=name,
                        dtype=args.dtype,
                        matmul_precision=args.matmul_precision,
                        lower_bound_mb=(n * d + v * d) * e.element_size() / 2**20,
                        ignore_spread=args.ignore_spread,
                    )
                    t0 = time.time()
                    if name == "matmul":  # (for fp32: at the worker's matmul precision)
                        row["fwd_ms"] = mm_ms
                    else:
                        torch._dynamo.reset()
                        H.free(args.device)
                        try:
                            fn = build(name, backends, peers, dynamic, f"{name}_{n}_{ign}_{shapes}")
                            row.update(
                                measure(
                                    fn,
                                    e,
                                    c,
                                    t,
                                    args,
                                    dynamic,
                                    ref,
                                    name in backends,
                                    fwd=name in FWD_TOO,
                                    profile=name in args.profile,
                                )
                            )
                        except Exception as exc:  # noqa: BLE001 - recorded; the next method goes on
                            row["error"] = H.err_text(exc)
                            bad += "NOT REWRITTEN" in row["error"]
                            fatal = H.fatal_cuda(exc)
                        else:
                            fatal = False
                        fn = None
                        H.free(args.device)
                    row["wall_s"] = round(time.time() - t0, 1)
                    base = results.get("compile", {})
                    for key, col in (
                        ("fwdbwd_ms", "x_compile_ms"),
                        ("sync_ms", "x_compile_sync"),
                        ("peak_mb", "x_compile_mb"),
                    ):
                        if row.get(key) and base.get(key):
                            row[col] = row[key] / base[key]
                    results[name] = row
                    H.append_row(args.out, row)
                    print_row(row)
                    if row.get("kernels"):
                        H.print_breakdown(f"{args.head} N={n} {shapes} {name} fwd+bwd", row["kernels"])
                    if name != "matmul" and fatal:
                        print("# the CUDA context is broken: this worker stops", flush=True)
                        return 3
            e = c = t = ref = None
            H.free(args.device)
            slowest = max(slowest, time.time() - began)
    return 1 if bad else 0


def print_row(r):
    f = H.fmt

    def x(ratio):
        return f"({ratio:.2f}x)" if ratio else "       "

    spread = f"+-{r['ignore_spread']}" if r.get("ignore_spread") else ""
    line = (
        f"  {r['head']} N={r['n']} ign={r['ignore_pct']}{spread}% {r['shapes']:7s} {r['method']:10s} "
        f"fwd {f(r.get('fwd_ms')):>8s} fwd+bwd {f(r.get('fwdbwd_ms')):>8s} ms {x(r.get('x_compile_ms'))} "
        f"synced {f(r.get('sync_ms')):>8s} ms {x(r.get('x_compile_sync'))} "
        f"peak {f(r.get('peak_mb'), '.0f'):>7s} MB {x(r.get('x_compile_mb'))} "
        f"err dE {f(r.get('err_de'), '.2e')} dC {f(r.get('err_dc'), '.2e')} {r.get('pick') or ''}"
    )
    if r.get("error"):
        line += f"  FAILED {r['error']}"
    print(line, flush=True)


# ------------------------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------------------------
def table(rows):
    f = H.fmt
    body = [
        (
            r["head"],
            r["n"],
            f"{r['ignore_pct']}" + (f"+-{r['ignore_spread']}" if r.get("ignore_spread") else ""),
            r["shapes"],
            r["method"],
            f(r.get("fwdbwd_ms")) or (f(r.get("fwd_ms")) + " (fwd)" if r.get("fwd_ms") else ""),
            f(r.get("x_compile_ms")),
            f(r.get("sync_ms")),
            f(r.get("x_compile_sync")),
            f(r.get("peak_mb"), ".0f"),
            f(r.get("x_compile_mb")),
            f(r.get("err_de"), ".1e"),
            f(r.get("err_dc"), ".1e"),
            ("ERROR " + r["error"][:60]) if r.get("error") else r.get("pick") or "",
        )
        for r in rows
    ]
    return H.md_table(
        [
            "head",
            "N",
            "ign %",
            "shapes",
            "method",
            "fwd+bwd ms",
            "x compile",
            "synced ms",
            "x compile",
            "peak MB",
            "x compile",
            "err dE",
            "err dC",
            "pick",
        ],
        body,
    )


def driver(args, argv):
    import cce_inductor  # noqa: F401 (fails early, before any worker, when the package is missing)

    backends = H.resolve_methods(args.methods)
    peers, notes = find_peers(args.device)
    if not args.report:
        H.append_row(
            args.out,
            H.header(
                args.device,
                dict(
                    script="vocab_grid",
                    heads=args.heads,
                    n=args.n,
                    ignore=args.ignore,
                    shapes=args.shapes,
                    methods=args.methods_raw,
                    backends=backends,
                    peers=list(peers),
                    peers_skipped=notes,
                ),
            ),
        )
    print(f"# results: {args.out}", flush=True)
    child_argv = H.strip_flags(argv, {"--heads", "--out", "--budget-s"}) + ["--out", args.out]
    units = [["--head", h] for h in args.heads]

    def crash_row(unit, rc):
        return dict(dict.fromkeys(COLUMNS), kind="row", head=unit[1], method="*", error=f"worker exited with {rc}")

    left = (
        []
        if args.report
        else H.run_workers(units, child_argv, os.path.abspath(__file__), args.budget_s, args.out, crash_row)
    )
    names = method_names(args, backends, peers)

    def wanted(r):
        return (
            r["head"] in args.heads
            and r["method"] in names + ["*"]
            and (
                r["n"] is None
                or (
                    r["n"] in args.n
                    and r["ignore_pct"] in args.ignore
                    and r["shapes"] in args.shapes
                    and case_key(r)[4:] == (args.dtype, args.matmul_precision, args.ignore_spread)
                )
            )
        )

    rows = [r for r in H.latest(H.read_rows(args.out), lambda r: (*case_key(r), r["method"])) if wanted(r)]
    done = finished(rows, names, peers)
    todo = [
        case_of(args, h, n, i, s)
        for h in args.heads
        for n in args.n
        for i in args.ignore
        for s in args.shapes
        if case_of(args, h, n, i, s) not in done
    ]
    bad = [r for r in rows if "NOT REWRITTEN" in str(r.get("error", ""))]
    print()
    if notes:
        print(f"# peers skipped: {'; '.join(notes)}")
    if todo:
        started = f" ({len(left)} worker(s) not started)" if left else ""
        print(f"# not done: {len(todo)} case(s){started}, e.g. {todo[:3]}; re-run the same command with --resume")
    for r in bad:
        print(f"# !!! {r['head']} N={r['n']} {r['shapes']} {r['method']}: {r['error']}")
    print(table(rows), flush=True)
    return 1 if bad else 0


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", default=None, help=f"comma list of {', '.join(HEADS)} (default: all)")
    ap.add_argument("--n", default=None, help="rows per case, comma list (default 4096,8192,32768)")
    ap.add_argument("--ignore", default="0,50", help="%% of targets set to -100, comma list")
    ap.add_argument("--shapes", default="static,dynamic", help="static, dynamic or both")
    ap.add_argument("--methods", default="matmul,compile,auto_chunker,default,exact,peers")
    ap.add_argument("--out", default=None, help="JSON lines, appended (default $OUT/vocab_grid.jsonl)")
    ap.add_argument("--resume", action="store_true", help="skip the cases --out already holds")
    ap.add_argument("--report", action="store_true", help="print the table of --out's rows; run nothing")
    ap.add_argument("--budget-s", type=float, default=None, help="seconds for the whole command (default 500)")
    ap.add_argument("--reps", type=int, default=2, help="CPU timing repetitions (CUDA: do_bench decides)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--ignore-spread",
        type=int,
        default=0,
        help="time 8 target sets in turn whose ignored %% spread over --ignore +- this",
    )
    ap.add_argument(
        "--profile",
        nargs="?",
        const="default",
        default="",
        help="per-kernel breakdown of the fwd+bwd of the methods listed (flag alone: default)",
    )
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="e and c's dtype (default bf16)")
    ap.add_argument(
        "--matmul-precision",
        default="highest",
        choices=["highest", "high"],
        help="torch.set_float32_matmul_precision in the workers (fp32 products: IEEE or TF32)",
    )
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run of the harness")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--head", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.device = "cpu" if args.tiny else "cuda"
    heads = TINY_HEADS if args.tiny else HEADS
    args.heads = (args.heads or ",".join(heads)).split(",")
    for h in args.heads:
        if h not in heads:
            ap.error(f"unknown head {h!r}; heads: {', '.join(heads)}")
    args.n = [int(x) for x in (args.n or ("256" if args.tiny else "4096,8192,32768")).split(",")]
    args.ignore = [int(x) for x in args.ignore.split(",")]
    args.shapes = args.shapes.split(",")
    if not set(args.shapes) <= {"static", "dynamic"}:
        ap.error("--shapes: static, dynamic")
    args.methods_raw = args.methods.split(",")
    args.methods = [m for m in args.methods_raw if m != "peers"]
    args.profile = [m for m in args.profile.split(",") if m]
    unknown = {m for m in args.methods if not H.is_method(m)} - set(BASE) - {"trl", "liger", "apple_cce"}
    if unknown:
        ap.error(f"unknown methods {sorted(unknown)}")
    if args.budget_s is None:
        args.budget_s = 0 if args.tiny else 500
    return H.finish_args(ap, args, "vocab_grid")


if __name__ == "__main__":
    sys.exit(H.main(None, parse_args, worker, driver))
