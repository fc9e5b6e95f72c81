"""Benchmark of the CCE kernels against eager PyTorch and torch.compile (one process; CUDA, or CPU with --tiny).

    python benchmarks/benchmark.py --shapes gemma2 --regimes flat,lm,mixed,lm_ign50
    python benchmarks/benchmark.py --shapes gemma2,llama3,qwen25,phi35 --regimes flat,lm,mixed,lm_ign50,real \
        --methods matmul,eager,compile,cce,cce_rowskip,cce_exact --check --real-cache /tmp/realtext_head.pt
    python benchmarks/benchmark.py --sweep "products=cublas;products=triton;exact=1;lean.block_cols=4096" \
        --shapes gemma2 --regimes lm,lm_ign50 --check
    python benchmarks/benchmark.py --tiny --methods eager,cce,cce_exact --regimes lm,real --check --real-seconds 5

Methods (each timed as loss only = "fwd" and loss + gradients = "fwdbwd"):
    matmul       one bf16 N x D @ D x V product (the floor; fwd only, once per shape)
    eager        F.cross_entropy(F.linear(e, c).float(), t)
    compile      torch.compile(dynamic=False) of the same function
    cce          cce_inductor.linear_cross_entropy with CCEOptions() (the defaults): the Triton forward; the backward
                 a Triton recompute of the softmax gradient G per (row chunk x vocabulary chunk) block + cuBLAS dE / dC
    cce_rowskip  CCEOptions(products="triton"): the dE / dC products in Triton, skipping the ignored rows
    cce_exact    CCEOptions(exact=True): the lean path (G rounded once to bf16, dE and dC summed in fp32)
    cce_balanced CCEOptions(scratch_mb=1024) (cce_balanced512: 512): the balanced path where gradients are needed
                 (fwdbwd): per row chunk cuBLAS logits into the scratch, the softmax gradient in place, cuBLAS dE
                 and dC (summed in fp32 over chunks); the backward scales by the upstream gradient. fwd: the lean op
    pass_cce     torch.compile(torch_loss, backend=cce_inductor.make_backend(base options)): the pass rewrites the
                 loss into the op, Inductor compiles the rest (what a user of the product runs)
    pass_balanced  the same with scratch_mb=1024 (the balanced op; its backward's scaling fused by Inductor)
--direct calls cce_inductor.kernels.forward / .backward through a small autograd.Function instead of the custom op.
--profile: after each method's fwdbwd timing, one more forward + backward under torch.profiler, printed as GPU time per
kernel name (the largest ten, the rest as "other"; also in the JSON rows as "kernels"): the per-kernel breakdown.
--config "k=v,..." (syntax as one sweep config, below) sets CCEOptions fields under every cce method (the
method's own field wins) and _TUNING overrides for the whole run.
Time: median of CUDA-event timings after warm-up (triton.testing.do_bench).  Memory: peak allocated above what
was allocated before the call (inputs excluded; gradients included for fwdbwd).  --check: relative Frobenius
errors of dE and dC against fp32-logit gradients (true fp32 matmuls), for every method with gradients, eager and
compile included (their errors are the bar the CCE methods are held to).

Data regimes (synthetic ones: c Gaussian with unit-norm rows, e built from chosen token vectors):
    flat      e Gaussian, logits ~ N(0, 1), uniform targets
    lm        48 plausible tokens per row with logits 14 - log(rank) (p ~ 1/rank), drawn from a Zipf
              popularity over a randomly permuted vocabulary; target sampled from them
    mixed     85% confident rows (4 plausible tokens, top p ~0.9), 15% broad rows (128 plausible tokens)
    real      the output head of a small language model trained on real text (benchmarks/real_text.py: byte-level
              BPE on this Python installation's sources and docs, a decoder trained for --real-seconds): e (the
              states entering the head on held-out text), c (the head weight), the next tokens as targets.
              Ignores --shapes: its shape is the trained head's, named "realtext (D, V)"; trained once per
              process, and with --real-cache PATH saved there / loaded from there when the settings match.
    *_ign50   the same with 50% of the targets set to ignore_index
Each case first prints its softmax statistics: real_text.softmax_stats over the counted rows (up to --stats-rows):
loss, entries with p >= 2^-12 per row, the share of 128 x 128 tiles holding such an entry, the probability mass
below it, and what a tile-skipping gradient filter would cost in dE error (no method here filters: the
statistics say how peaked each regime's softmax is), plus valid_frac; for `real` also the training metadata.

Sweep (--sweep "config;config;..."): times kernels.forward and kernels.backward directly, per case and config:
forward ms, backward ms (given that forward), the backward's peak memory, gradient errors with --check.  A config is
"k=v,k=v" with
    exact=0|1, products=cublas|triton, backward_row_chunk=N     CCEOptions fields (over --config's)
    fwd.KEY=N, bwd.KEY=N, prod.KEY=N, lean.KEY=N                _TUNING overrides of kernels/_forward.py,
        _backward.py, _products.py (lean: cce_inductor._layout.LEAN_LAYOUT), e.g. fwd.block_v=128,
        lean.block_cols=4096, prod.BLOCK_K=32: the entry in
        use ("gpu"; "interpret" under TRITON_INTERPRET=1) is replaced for that config and restored after
    need_e=0|1, need_c=0|1, fwd_only=0|1                        sweep only: what the backward computes
Output: a "# device ..." header; per case a "## shape N= D= V= regime=" line with the statistics (and for `real` a
"## realtext trained ..." line); per method and mode "ms, MB [err_dE err_dC]"; last a markdown table of every row
(x compile, x matmul, MB over the N*D + V*D lower bound).  --json PATH writes the rows, the cases (statistics,
real-text metadata) and the settings.

--tiny: a CPU smoke run (< 1 minute): shape "tiny" (D 64, V 2048), N 256, method cce unless --methods says
otherwise, perf_counter timings (median, --rep ms per measurement), no memory figures; the `real` head from
real_text.TINY (20 steps, also bounded by --real-seconds).  On CPU every cce method is the op's chunked PyTorch
path (its options change nothing there); with --direct or --sweep the Triton kernels run in the interpreter
(the script sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C
import real_text

SHAPES = {  # name: (D, V)
    "gemma2": (2304, 256000),
    "llama3": (4096, 128256),
    "qwen25": (3584, 152064),
    "phi35": (3072, 32064),
}
TINY_SHAPES = {"tiny": (64, 2048)}
REGIMES = ("flat", "lm", "mixed", "real")  # each also with the suffix "_ign50"
IGNORE = -100
CCE_METHODS = {  # name: CCEOptions fields over the base options (--config)
    "cce": {},
    "cce_rowskip": {"products": "triton"},
    "cce_exact": {"exact": True},
    "cce_balanced": {"scratch_mb": 1024},
    "cce_balanced512": {"scratch_mb": 512},
}
# torch.compile(torch_loss) with our backend: the pass rewrites the loss, Inductor compiles the rest (the op's
# backward formula included): what a user of the product runs
PASS_METHODS = {"pass_cce": {}, "pass_balanced": {"scratch_mb": 1024}}
METHODS = ("matmul", "eager", "compile", *CCE_METHODS, *PASS_METHODS)
# prefix: cce_inductor.kernels module (its _TUNING), or "lean": the lean G block's layout (kernels/_layout.py)
TUNING_FILES = {"fwd": "_forward", "bwd": "_backward", "prod": "_products", "lean": "_layout"}
SWEEP_KNOBS = ("need_e", "need_c", "fwd_only")
REAL_DEFAULTS = dict(real_seconds=90.0, real_vocab=65536, real_dim=2048)


def _kernels():
    from cce_inductor import kernels  # imports Triton; TRITON_INTERPRET must be set before (--tiny does it)

    return kernels


# --------------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------------
def _build_e(c, toks, alpha):
    """e[n] = sum_k alpha[n, k] * c[toks[n, k]] (fp32)."""
    n, k_max = toks.shape
    e = torch.zeros(n, c.shape[1], device=c.device, dtype=torch.float32)
    for k in range(k_max):
        e += alpha[:, k : k + 1] * c[toks[:, k]].float()
    return e


def make_data(n, d, v, base, device, seed=0, dtype=torch.bfloat16):
    """A synthetic regime (flat / lm / mixed) without ignored targets."""
    dev = device
    g = torch.Generator(device=dev).manual_seed(seed)
    c32 = torch.randn(v, d, device=dev, generator=g) / math.sqrt(d)
    if base == "flat":
        e32 = torch.randn(n, d, device=dev, generator=g)
        targets = torch.randint(0, v, (n,), device=dev, generator=g)
    else:
        rank = torch.arange(v, device=dev, dtype=torch.float32)
        popularity = torch.empty(v, device=dev)
        popularity[torch.randperm(v, device=dev, generator=g)] = (rank + 10.0) ** -1.1
        if base == "lm":
            k = 48
            alpha = (14.0 - torch.log(torch.arange(1, k + 1, device=dev, dtype=torch.float32))).expand(n, k).clone()
        elif base == "mixed":
            k = 128
            broad = torch.rand(n, device=dev, generator=g) < 0.15
            alpha = torch.zeros(n, k, device=dev)
            alpha[:, :4] = torch.tensor([16.0, 13.0, 12.0, 11.0], device=dev)
            broad_alpha = 10.0 - 0.5 * torch.log(torch.arange(1, k + 1, device=dev, dtype=torch.float32))
            alpha[broad] = broad_alpha
        else:
            raise ValueError(base)
        # k distinct plausible tokens per row, drawn from the popularity without replacement (in chunks)
        toks = torch.cat(
            [
                torch.multinomial(popularity.expand(min(1024, n - s), v), k, replacement=False, generator=g)
                for s in range(0, n, 1024)
            ]
        )
        e32 = _build_e(c32, toks, alpha)
        # target: one of the row's plausible tokens, chosen with probability ~ softmax(alpha)
        pick = torch.multinomial(torch.softmax(alpha.masked_fill(alpha == 0, -1e4), -1), 1, generator=g)[:, 0]
        targets = toks.gather(1, pick[:, None])[:, 0]
    return e32.to(dtype).contiguous(), c32.to(dtype).contiguous(), targets


def ignore_half(targets, seed=0):
    g = torch.Generator(device=targets.device).manual_seed(seed + 1)
    drop = torch.rand(targets.shape, device=targets.device, generator=g) < 0.5
    return torch.where(drop, torch.full_like(targets, IGNORE), targets)


_REAL_HEADS = {}  # settings -> (e, c, targets on the CPU, metadata): one training per process


def real_settings(args):
    """real_text_head keywords (--tiny: real_text.TINY, with --real-* flags given explicitly on top)."""
    kw = dict(getattr(real_text, "TINY", {})) if args.tiny else {}
    for flag, key in (("real_seconds", "train_seconds"), ("real_vocab", "vocab_size"), ("real_dim", "d_model")):
        value = getattr(args, flag)
        if value is not None:
            kw[key] = value
        elif not args.tiny:
            kw[key] = REAL_DEFAULTS[flag]
    kw.update(n_tokens=args.n, seed=args.seed, dtype=torch.bfloat16)
    return kw


def real_head(args):
    """``(e, c, targets, metadata)`` of the trained head on ``args.device``: from this process's memo, from
    --real-cache when it holds the same settings, else trained (and saved to --real-cache)."""
    kw = real_settings(args)
    key = json.dumps({k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in sorted(kw.items())})
    source = "memo"
    if key not in _REAL_HEADS:
        cached = None
        if args.real_cache and os.path.exists(args.real_cache):
            cached = torch.load(args.real_cache, map_location="cpu")
            if cached.get("key") != key:
                print(
                    f"# --real-cache {args.real_cache} holds other settings ({cached.get('key')}); retraining",
                    flush=True,
                )
                cached = None
        if cached is not None:
            source = f"cache {args.real_cache}"
        else:
            source = "trained"
            head = real_text.real_text_head(args.device, **kw)
            meta = {k: v for k, v in head.items() if not isinstance(v, torch.Tensor)}
            cached = dict(key=key, e=head["e"].cpu(), c=head["c"].cpu(), targets=head["targets"].cpu(), meta=meta)
            del head
            if args.device == "cuda":
                torch.cuda.empty_cache()
            if args.real_cache:
                torch.save(cached, args.real_cache)
                source = f"trained, saved to {args.real_cache}"
        _REAL_HEADS[key] = cached
    h = _REAL_HEADS[key]
    meta = dict(h["meta"], source=source, settings=json.loads(key))
    return h["e"].to(args.device), h["c"].to(args.device), h["targets"].to(args.device), meta


def regime_stats(e, c, t, rows):
    """real_text.softmax_stats over the counted rows (the first ``rows`` of them; 0: all), plus valid_frac."""
    valid = t != IGNORE
    idx = valid.nonzero()[:, 0]
    if rows:
        idx = idx[:rows]
    stats = real_text.softmax_stats(e[idx], c, t[idx]) if len(idx) else {}
    stats["valid_frac"] = valid.float().mean().item()
    return stats


def _fmt_stats(stats):
    def num(x):
        return f"{x:.4g}" if isinstance(x, float) else str(x)

    return " ".join(f"{k}={num(v)}" for k, v in stats.items())


def build_cases(args):
    """[(shape name, D, V, regime)]: every shape x synthetic regime, then the `real` regimes once."""
    shapes = {**SHAPES, **TINY_SHAPES}
    cases, real = [], []
    for regime in args.regimes.split(","):
        if regime.removesuffix("_ign50") not in REGIMES:
            raise SystemExit(f"unknown regime {regime!r}; regimes: {', '.join(REGIMES)} (each also with _ign50)")
    for shape in args.shapes.split(","):
        if shape not in shapes:
            raise SystemExit(f"unknown shape {shape!r}; shapes: {', '.join(shapes)}")
        for regime in args.regimes.split(","):
            if regime.removesuffix("_ign50") == "real":
                continue
            cases.append((shape, *shapes[shape], regime))
    for regime in args.regimes.split(","):
        if regime.removesuffix("_ign50") == "real":
            real.append((None, None, None, regime))
    return cases + real


def case_data(args, case):
    """``(shape label, e, c, targets, real-text metadata or None)`` on ``args.device``."""
    shape, d, v, regime = case
    base = regime.removesuffix("_ign50")
    meta = None
    if base == "real":
        e, c, t, meta = real_head(args)
        shape = f"realtext ({e.shape[1]}, {c.shape[0]})"
    else:
        e, c, t = make_data(args.n, d, v, base, args.device, seed=args.seed)
    if regime.endswith("_ign50"):
        t = ignore_half(t, args.seed)
    return shape, e, c, t, meta


# --------------------------------------------------------------------------------------------------
# options and kernel tuning
# --------------------------------------------------------------------------------------------------
def parse_config(text):
    """``"k=v,..."`` -> (CCEOptions fields, {(prefix, key): int} _TUNING overrides, sweep knobs)."""
    from cce_inductor import CCEOptions

    kinds = {f.name: f.type for f in dataclasses.fields(CCEOptions)}
    fields, tuning, knobs = {}, {}, {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"config item {item!r} is not key=value")
        prefix, dot, name = key.partition(".")
        if dot:
            if prefix not in TUNING_FILES:
                raise SystemExit(f"{key!r}: tuning keys start with {', '.join(p + '.' for p in TUNING_FILES)}")
            tuning[(prefix, name)] = int(raw)
        elif key in SWEEP_KNOBS:
            knobs[key] = bool(int(raw))
        elif key in kinds and key != "drop_logits":  # drop_logits changes the graph around the op, not the op
            kind = str(kinds[key])
            fields[key] = bool(int(raw)) if kind == "bool" else int(raw) if kind == "int" else raw
        else:
            raise SystemExit(
                f"unknown config key {key!r}: CCEOptions fields {[k for k in kinds if k != 'drop_logits']}, "
                f"tuning prefix.KEY ({', '.join(TUNING_FILES)}), sweep knobs {list(SWEEP_KNOBS)}"
            )
    return fields, tuning, knobs


class _LayoutTable:
    """``kernels/_layout.py``'s ``LEAN_LAYOUT`` seen as a kernel file's ``_TUNING`` (the same override mechanism)."""

    def __init__(self):
        from cce_inductor.kernels import _layout

        self._TUNING = _layout.LEAN_LAYOUT
        self.__name__ = _layout.__name__


def _tuning_entry(prefix):
    if TUNING_FILES[prefix] == "_layout":
        module = _LayoutTable()
    else:
        module = importlib.import_module(f"cce_inductor.kernels.{TUNING_FILES[prefix]}")
    return module, ("interpret" if _kernels().INTERPRET else "gpu")


def tuning_in_use():
    """{prefix: the _TUNING entry the kernels read now}."""
    out = {}
    for prefix in TUNING_FILES:
        module, which = _tuning_entry(prefix)
        out[prefix] = dict(module._TUNING[which])
    return out


def kernels_backward(e, c, t, lse, grad_rows, options, **kwargs):
    """``cce_inductor.kernels.backward`` with the plan the op would make from ``options`` (products "auto" as
    cuBLAS over every row: no earlier calls here)."""
    from cce_inductor import _planning

    K = _kernels()
    products = "triton" if options.products == "triton" else "cublas"
    plan = _planning.backward_plan(
        e.shape[0],
        c.shape[0],
        products=products,
        backward_row_chunk=options.backward_row_chunk,
        row_skipping=K.row_skipping_ok(e, c),
    )
    return K.backward(e, c, t, None, lse, grad_rows, softcap=None, ignore_index=IGNORE, **plan._asdict(), **kwargs)


@contextlib.contextmanager
def tuning_overrides(tuning):
    """Replace the entries in use of the kernel files' ``_TUNING`` dicts with overridden copies; restore after."""
    saved = []
    try:
        for (prefix, name), value in tuning.items():
            module, which = _tuning_entry(prefix)
            entry = module._TUNING[which]
            if name not in entry:
                raise KeyError(f"{prefix}.{name}: {module.__name__}._TUNING[{which!r}] has {', '.join(entry)}")
            saved.append((module, which, entry))
            module._TUNING[which] = {**entry, name: value}
        yield
    finally:
        for module, which, entry in reversed(saved):
            module._TUNING[which] = entry


# --------------------------------------------------------------------------------------------------
# methods
# --------------------------------------------------------------------------------------------------
def torch_loss(e, c, t):
    return F.cross_entropy(F.linear(e, c).float(), t, ignore_index=IGNORE)


class _DirectCCE(torch.autograd.Function):
    """cce_inductor.kernels called directly (mean reduction), bypassing the custom op."""

    @staticmethod
    def forward(ctx, e, c, t, options):
        lse, tgt, *_ = _kernels().forward(e, c, t, None, softcap=None, ignore_index=IGNORE)
        valid = t != IGNORE
        count = valid.sum().clamp(min=1)
        ctx.save_for_backward(e, c, t, lse, count)
        ctx.options = options
        return torch.where(valid, lse.float() - tgt.float(), 0.0).sum() / count

    @staticmethod
    def backward(ctx, grad):
        e, c, t, lse, count = ctx.saved_tensors
        grad_rows = (t != IGNORE).float() * (grad / count)
        de, dc, _ = kernels_backward(
            e,
            c,
            t,
            lse,
            grad_rows,
            ctx.options,
            need_e=ctx.needs_input_grad[0],
            need_c=ctx.needs_input_grad[1],
            need_bias=False,
        )
        return de, dc, None, None


def cce_fn(options, direct):
    if direct:
        return lambda e, c, t: _DirectCCE.apply(e, c, t, options)
    from cce_inductor import linear_cross_entropy

    return lambda e, c, t: linear_cross_entropy(e, c, t, ignore_index=IGNORE, options=options)


# --------------------------------------------------------------------------------------------------
# measurement
# --------------------------------------------------------------------------------------------------
def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def bench(fn, args, grad_to_none=None):
    """Median ms: triton.testing.do_bench on CUDA; on the CPU perf_counter over one warm-up call and then calls
    for --rep ms (3 to 50)."""
    if args.device == "cuda":
        import triton

        return triton.testing.do_bench(
            fn, warmup=args.warmup, rep=args.rep, grad_to_none=grad_to_none, return_mode="median"
        )
    times, start = [], time.perf_counter()
    for i in range(51):
        for x in grad_to_none or ():
            x.grad = None
        t0 = time.perf_counter()
        fn()
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
        if i >= 3 and (time.perf_counter() - start) * 1e3 > args.rep:
            break
    return statistics.median(times)


def measure(fn, e, c, t, mode, args):
    cuda = args.device == "cuda"
    if mode == "fwd":

        def run():
            with torch.no_grad():
                return fn(e, c, t)

        grads = None
    else:
        e.requires_grad_(True)
        c.requires_grad_(True)

        def run():
            loss = fn(e, c, t)
            loss.backward()
            return loss

        grads = [e, c]
    try:
        out = run()  # compile / warm up
        sync(args.device)
        e.grad = c.grad = None
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        out = run()
        sync(args.device)
        peak_mb = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else float("nan")
        result = dict(loss=float(out.detach().float()))
        if mode == "fwdbwd":
            result["grads"] = (e.grad.detach().clone(), c.grad.detach().clone())
        e.grad = c.grad = None
        del out
        ms = bench(run, args, grad_to_none=grads)
    finally:
        e.grad = c.grad = None
        e.requires_grad_(False)
        c.requires_grad_(False)
    result.update(ms=ms, mb=peak_mb)
    return result


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _print_case(shape, n, d, v, regime, stats, meta, tag="##"):
    print(f"{tag} {shape} N={n} D={d} V={v} regime={regime} stats: {_fmt_stats(stats)}", flush=True)
    if meta is not None:
        keep = {k: val for k, val in meta.items() if k != "settings"}
        print(f"{tag} realtext trained: {_fmt_stats(keep)} settings={meta['settings']}", flush=True)


# --------------------------------------------------------------------------------------------------
# sweep: the kernels called directly under several configs
# --------------------------------------------------------------------------------------------------
def sweep(args, base_options):
    K = _kernels()
    configs = [(text, *parse_config(text)) for text in args.sweep.split(";")]  # bad keys stop the run here
    out_rows = []
    for case in build_cases(args):
        shape, e, c, t, meta = case_data(args, case)
        regime = case[3]
        n, d, v = e.shape[0], e.shape[1], c.shape[0]
        stats = regime_stats(e, c, t, args.stats_rows)
        _print_case(shape, n, d, v, regime, stats, meta, tag="## sweep")
        ref = C.fp32_reference_grads(e, c, t, IGNORE) if args.check else None
        mm = bench(lambda: e @ c.T, args)
        print(f"  matmul {mm:.2f} ms", flush=True)
        valid = t != IGNORE
        grad_rows = valid.float() / valid.sum().clamp(min=1).float()
        for text, fields, tuning, knobs in configs:
            options = dataclasses.replace(base_options, **fields)
            need_e, need_c = knobs.get("need_e", True), knobs.get("need_c", True)
            row = dict(shape=shape, regime=regime, config=text, options=dataclasses.asdict(options), matmul_ms=mm)
            try:
                with tuning_overrides(tuning):

                    def fwd():
                        return K.forward(e, c, t, None, softcap=None, ignore_index=IGNORE)

                    lse = fwd().lse
                    row["fwd_ms"] = f_ms = bench(fwd, args)
                    line = f"  {text:60s} fwd {f_ms:7.2f} ms ({f_ms / mm:.2f}x mm)"
                    if not knobs.get("fwd_only", False):

                        def bwd():
                            return kernels_backward(
                                e, c, t, lse, grad_rows, options, need_e=need_e, need_c=need_c, need_bias=False
                            )

                        sync(args.device)
                        if args.device == "cuda":
                            torch.cuda.reset_peak_memory_stats()
                            base = torch.cuda.memory_allocated()
                        de, dc, _ = bwd()
                        sync(args.device)
                        b_mb = (
                            (torch.cuda.max_memory_allocated() - base) / 2**20
                            if args.device == "cuda"
                            else float("nan")
                        )
                        row["bwd_ms"] = b_ms = bench(bwd, args)
                        row["bwd_mb"] = b_mb
                        line += f" bwd {b_ms:7.2f} ms total {f_ms + b_ms:7.2f} bwd peak {b_mb:7.0f} MB"
                        if ref is not None:
                            if need_e:
                                row["err_de"] = rel(de, ref[0])
                                line += f" err_dE={row['err_de']:.2e}"
                            if need_c:
                                row["err_dc"] = rel(dc, ref[1])
                                line += f" err_dC={row['err_dc']:.2e}"
                        del de, dc
                    print(line, flush=True)
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                print(f"  {text:60s} FAILED {row['error']}", flush=True)
            out_rows.append(row)
        e = c = t = ref = None  # free the case before the next one
    return out_rows


# --------------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=None, help=f"comma-separated of {', '.join(SHAPES)} (default gemma2)")
    ap.add_argument(
        "--regimes",
        default=None,
        help="comma-separated of flat, lm, mixed, real, each also *_ign50 (default flat,lm,mixed,lm_ign50)",
    )
    ap.add_argument(
        "--methods",
        default=None,
        help=f"comma-separated of {', '.join(METHODS)} (default matmul,eager,compile,cce,cce_exact)",
    )
    ap.add_argument("--modes", default="fwd,fwdbwd")
    ap.add_argument("--n", type=int, default=None, help="rows (tokens) per case (default 8192)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--direct", action="store_true", help="call cce_inductor.kernels directly, not the custom op")
    ap.add_argument("--check", action="store_true", help="gradient errors against an fp32 reference")
    ap.add_argument(
        "--config",
        default="",
        help="CCEOptions fields and _TUNING overrides for the whole run, e.g. "
        "backward_row_chunk=4096,lean.block_cols=4096,fwd.block_v=128",
    )
    ap.add_argument("--sweep", default="", help='";"-separated configs: time the kernels directly under each')
    ap.add_argument("--stats-rows", type=int, default=0, help="counted rows for the softmax statistics (0: all)")
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warm-up (ms)")
    ap.add_argument("--rep", type=int, default=None, help="do_bench repetitions (ms; default 100, --tiny 50)")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="per method with gradients: one fwd+bwd under torch.profiler, the per-kernel time breakdown",
    )
    ap.add_argument("--json", default="", help="write the rows, cases and settings here")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny shapes, chunked path (< 1 minute)")
    real = ap.add_argument_group("real text", "the `real` regime's head (benchmarks/real_text.py)")
    real.add_argument("--real-seconds", type=float, default=None, help="training budget in seconds (default 90)")
    real.add_argument("--real-vocab", type=int, default=None, help="BPE vocabulary size V (default 65536)")
    real.add_argument("--real-dim", type=int, default=None, help="model width D (default 2048)")
    real.add_argument(
        "--real-cache", default="", help="torch.save the trained head here; a later run with the same settings loads it"
    )
    args = ap.parse_args(argv)
    tiny = args.tiny
    defaults = dict(
        shapes="tiny" if tiny else "gemma2",
        regimes="lm,lm_ign50" if tiny else "flat,lm,mixed,lm_ign50",
        methods="cce" if tiny else "matmul,eager,compile,cce,cce_exact",
        n=256 if tiny else 8192,
        rep=50 if tiny else 100,
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.device = "cpu" if tiny else "cuda"
    for m in args.methods.split(","):
        if m not in METHODS:
            ap.error(f"unknown method {m!r}; methods: {', '.join(METHODS)}")
    for mode in args.modes.split(","):
        if mode not in ("fwd", "fwdbwd"):
            ap.error(f"unknown mode {mode!r}; modes: fwd, fwdbwd")
    return args


def main(argv=None):
    args = parse_args(argv)
    uses_kernels = args.device == "cuda" or args.direct or bool(args.sweep)
    if args.device == "cpu" and uses_kernels:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before cce_inductor.kernels is imported
        if os.environ["TRITON_INTERPRET"] != "1":
            raise SystemExit(
                "--tiny with --direct / --sweep runs the kernels in the Triton interpreter: TRITON_INTERPRET=1"
            )
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --tiny for a CPU smoke run")
    from cce_inductor import CCEOptions

    fields, tuning, knobs = parse_config(args.config)
    if knobs:
        raise SystemExit(f"{list(knobs)} are sweep-only keys")
    base_options = CCEOptions(**fields)
    with contextlib.ExitStack() as stack:
        if tuning:
            stack.enter_context(tuning_overrides(tuning))
        header = dict(
            device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            torch=torch.__version__,
            path="direct kernels" if args.direct or args.sweep else "cce_inductor.linear_cross_entropy",
            base_options=dataclasses.asdict(base_options),
        )
        if uses_kernels:
            import triton

            header.update(triton=triton.__version__, tuning=tuning_in_use(), interpret=_kernels().INTERPRET)
        else:
            header.update(path="cce_inductor.linear_cross_entropy (chunked PyTorch on the CPU)")
        print("# " + ", ".join(f"{k} {v}" for k, v in header.items()), flush=True)
        settings = {k: v for k, v in vars(args).items()}
        if args.sweep:
            rows = sweep(args, base_options)
            if args.json:
                with open(args.json, "w") as fh:
                    json.dump(dict(header, settings=settings, sweep=rows), fh, indent=1)
            return
        rows, cases = run_methods(args, base_options)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(header, settings=settings, cases=cases, rows=rows), fh, indent=1)
    print_table(rows)


def run_methods(args, base_options):
    dyn = torch._dynamo.config  # every shape x grad mode is one more compiled graph of torch_loss
    if hasattr(dyn, "recompile_limit"):
        dyn.recompile_limit = max(dyn.recompile_limit, 64)
    else:
        dyn.cache_size_limit = max(dyn.cache_size_limit, 64)
    methods = {"eager": torch_loss, "compile": torch.compile(torch_loss, dynamic=False)}
    for name, fields in CCE_METHODS.items():
        methods[name] = cce_fn(dataclasses.replace(base_options, **fields), args.direct)
    import cce_inductor

    for name, fields in PASS_METHODS.items():
        backend = cce_inductor.make_backend(dataclasses.replace(base_options, **fields))
        methods[name] = torch.compile(torch_loss, backend=backend, dynamic=False)
    matmul_ms = {}  # (N, D, V) -> ms
    rows, cases = [], []
    for case in build_cases(args):
        if args.device == "cuda":
            torch.cuda.empty_cache()
        shape, e, c, t, meta = case_data(args, case)
        regime = case[3]
        n, d, v = e.shape[0], e.shape[1], c.shape[0]
        lower_bound_mb = (n * d + v * d) * e.element_size() / 2**20
        stats = regime_stats(e, c, t, args.stats_rows)
        _print_case(shape, n, d, v, regime, stats, meta)
        cases.append(dict(shape=shape, n=n, d=d, v=v, regime=regime, stats=stats, real_text=meta))
        ref = C.fp32_reference_grads(e, c, t, IGNORE) if args.check else None
        results = {}
        for mode in args.modes.split(","):
            for m in args.methods.split(","):
                if m == "matmul":
                    if mode != "fwd" or (n, d, v) in matmul_ms:
                        continue
                    matmul_ms[(n, d, v)] = ms = bench(lambda: e @ c.T, args)
                    r = results[(m, mode)] = dict(ms=ms, mb=n * v * e.element_size() / 2**20)
                else:
                    t0 = time.time()
                    try:
                        r = measure(methods[m], e, c, t, mode, args)
                    except torch.OutOfMemoryError:
                        r = dict(ms=float("nan"), mb=float("nan"), error="OutOfMemoryError")
                        if args.device == "cuda":
                            torch.cuda.empty_cache()
                    except Exception as exc:  # noqa: BLE001
                        r = dict(ms=float("nan"), mb=float("nan"), error=f"{type(exc).__name__}: {str(exc)[:200]}")
                    r["wall_s"] = time.time() - t0
                    results[(m, mode)] = r
                extra = ""
                if ref is not None and "grads" in r:
                    r["err_de"], r["err_dc"] = rel(r["grads"][0], ref[0]), rel(r["grads"][1], ref[1])
                    extra = f" err_dE={r['err_de']:.2e} err_dC={r['err_dc']:.2e}"
                r.pop("grads", None)
                if "error" in r:
                    extra += f" FAILED {r['error']}"
                print(f"  {m:12s} {mode:7s} {r['ms']:9.2f} ms {r['mb']:10.1f} MB{extra}", flush=True)
                if args.profile and mode == "fwdbwd" and m != "matmul" and "error" not in r:
                    try:
                        r["kernels"] = kernel_breakdown(methods[m], e, c, t)
                    except Exception as exc:  # noqa: BLE001 - a profiler problem must not lose the timings
                        print(f"      (no kernel breakdown: {type(exc).__name__}: {exc})")
                    for name, calls, ms in r.get("kernels") or []:
                        print(f"      {ms:8.2f} ms {calls:5d}x  {name}")
        for (m, mode), r in results.items():
            comp = results.get(("compile", mode))
            mm = matmul_ms.get((n, d, v))
            rows.append(
                dict(
                    shape=shape,
                    regime=regime,
                    n=n,
                    d=d,
                    v=v,
                    method=m,
                    mode=mode,
                    ms=r["ms"],
                    mb=r["mb"],
                    vs_compile=r["ms"] / comp["ms"] if comp else None,
                    vs_matmul=r["ms"] / mm if mm else None,
                    mb_vs_lower_bound=(r["mb"] / lower_bound_mb) if mode == "fwdbwd" else None,
                    err_de=r.get("err_de"),
                    err_dc=r.get("err_dc"),
                    error=r.get("error"),
                    stats=stats,
                    kernels=r.get("kernels"),
                )
            )
        e = c = t = ref = None  # free the case before the next one
    return rows, cases


def kernel_breakdown(fn, e, c, t, top=10):
    """GPU time per kernel name over one forward + backward (after the timed runs: compiled, warm):
    ``[(name, calls, ms)]``, the largest first, the rest summed as "other"."""
    e.requires_grad_(True)
    c.requires_grad_(True)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn(e, c, t).backward()
            torch.cuda.synchronize()
    finally:
        e.grad = c.grad = None
        e.requires_grad_(False)
        c.requires_grad_(False)
    per_kernel = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            calls, us = per_kernel.get(event.name, (0, 0.0))
            per_kernel[event.name] = (calls + 1, us + event.time_range.elapsed_us())
    ranked = sorted(((name[:90], calls, us / 1e3) for name, (calls, us) in per_kernel.items()), key=lambda x: -x[2])
    rest = ranked[top:]
    return ranked[:top] + ([("other", sum(r[1] for r in rest), sum(r[2] for r in rest))] if rest else [])


def print_table(rows):
    print()
    print("| shape | regime | method | mode | ms | MB | x compile | x matmul | MB / lower bound | err dE | err dC |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    f = lambda x, p=2: "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{p}f}"  # noqa: E731
    g = lambda x: "" if x is None else f"{x:.1e}"  # noqa: E731
    for r in rows:
        print(
            f"| {r['shape']} | {r['regime']} | {r['method']} | {r['mode']} | {f(r['ms'])} | {f(r['mb'], 0)} | "
            f"{f(r['vs_compile'])} | {f(r['vs_matmul'])} | {f(r['mb_vs_lower_bound'], 3)} | {g(r['err_de'])} | "
            f"{g(r['err_dc'])} |"
        )


if __name__ == "__main__":
    main()
