"""The fused op against eager PyTorch and torch.compile on single heads (one process; CUDA, or CPU with --tiny), and
the loss forms the pass rewrites beyond the plain cross-entropy.

    python benchmarks/benchmark.py --shapes gemma2 --regimes flat,lm,mixed,lm_ign50
    python benchmarks/benchmark.py --shapes gemma2,llama3,qwen25,phi35 --regimes lm,lm_ign50 \
        --methods matmul,eager,compile,cce,cce_rowskip,cce_exact --check
    python benchmarks/benchmark.py --sweep "products=cublas;products=triton;exact=1;lean.block_cols=4096" \
        --shapes gemma2 --regimes lm,lm_ign50 --check
    python benchmarks/benchmark.py --forms label_smoothing,z_loss,chunked,grpo,grpo_entropy --shapes gemma2,llama3 \
        --regimes lm,lm_ign50 --methods eager,compile,pass_cce --check
    python benchmarks/benchmark.py --tiny --methods eager,compile,cce,pass_cce --regimes lm,lm_ign50 --check

Methods (each timed as loss only = "fwd" and loss + gradients = "fwdbwd"):
    matmul       one bf16 N x D @ D x V product (the floor; fwd only, once per shape)
    eager        F.cross_entropy(F.linear(e, c).float(), t) (or the --forms loss as written)
    compile      torch.compile(dynamic=False) of the same function
    cce          cce_inductor.linear_cross_entropy with CCEOptions() (the defaults): the Triton forward; the backward
                 a Triton recompute of the softmax gradient G per (row chunk x vocabulary chunk) block + cuBLAS dE / dC
    cce_rowskip  CCEOptions(products="triton"): the dE / dC products in Triton, skipping the ignored rows
    cce_exact    CCEOptions(exact=True): the lean path (G rounded once to bf16, dE and dC summed in fp32)
    cce_balanced CCEOptions(scratch_mb=1024) (cce_balanced512: 512): the balanced path where gradients are needed
                 (fwdbwd): per row chunk cuBLAS logits into the scratch, the softmax gradient in place, cuBLAS dE
                 and dC (summed in fp32 over chunks); the backward scales by the upstream gradient. fwd: the lean op
    pass_cce     torch.compile(loss, backend=cce_inductor.make_backend(base options)): the pass rewrites the loss
                 into the op, Inductor compiles the rest (what a user of the product runs); every site the pass saw
                 must be rewritten and the op run once per call, or the row is an error ("NOT REWRITTEN")
    pass_balanced  the same with scratch_mb=1024 (the balanced op; its backward's scaling fused by Inductor)
eager and compile must leave the pass out (an error where it rewrote anything).
--direct calls cce_inductor.kernels.forward / .backward through a small autograd.Function instead of the custom op.
--profile: after each method's fwdbwd timing, one more forward + backward under torch.profiler, printed as GPU time per
kernel name (the largest ten, the rest as "other"; also in the JSON rows as "kernels"): the per-kernel breakdown.
--config "k=v,..." (syntax as one sweep config, below) sets CCEOptions fields under every cce method (the
method's own field wins) and _TUNING overrides for the whole run.
Time (_harness.py): queued_ms, the median of calls queued back to back (triton.testing.do_bench: --warmup / --rep ms,
CUDA events, gradients set to None between calls); with --synced also synced_ms, each call on its own (synchronised
before, waited for after: what a training step's loss sees). Memory: peak_above_mb, the allocator's peak above what
was allocated before one call (inputs excluded; gradients included for fwdbwd). --check: relative Frobenius errors of
dE and dC against fp32-logit gradients (true fp32 matmuls), for every method with gradients, eager and compile
included (their errors are the bar the cce methods are held to).

Data regimes (c Gaussian with unit-norm rows, e built from chosen token vectors):
    flat      e Gaussian, logits ~ N(0, 1), uniform targets
    lm        48 plausible tokens per row with logits 14 - log(rank) (p ~ 1/rank), drawn from a Zipf
              popularity over a randomly permuted vocabulary; target sampled from them
    mixed     85% confident rows (4 plausible tokens, top p ~0.9), 15% broad rows (128 plausible tokens)
    *_ign50   the same with 50% of the targets set to ignore_index

Loss forms (--forms; default ce, the plain cross-entropy), each written as trainers write it, on the case's e, c, t:
    label_smoothing  F.cross_entropy(..., label_smoothing=0.1)
    z_loss           the cross-entropy + 1e-4 * logsumexp(logits)^2 (OLMo's z-loss)
    chunked          torchtune's chunked head: F.linear per 8 chunks of each 2048-row sequence, a summed
                     cross-entropy per chunk, over the counted targets (CEWithChunkedOutputLoss); the pass gathers
                     the chunks into one call
    grpo             TRL's GRPO policy loss: logits / 0.7, token log-probs by gather(log_softmax), the ratio against
                     old log-probs (this policy's own plus noise: ratios near 1), clipped at 0.2, per-row advantages,
                     the mean over the counted rows (ignored targets masked)
    grpo_entropy     the same with TRL's entropy_from_logits (128-row chunks) as a -0.01 bonus per token
A form other than ce runs eager, compile and the pass_* methods (the cce_* methods call the plain op) and checks its
gradients against the same loss in fp32 (_harness.fp32_grads).

Sweep (--sweep "config;config;..."): times kernels.forward and kernels.backward directly, per case and config:
forward ms, backward ms (given that forward), the backward's peak memory, gradient errors with --check.  A config is
"k=v,k=v" with
    exact=0|1, products=cublas|triton, backward_row_chunk=N     CCEOptions fields (over --config's)
    fwd.KEY=N, bwd.KEY=N, prod.KEY=N, lean.KEY=N                _TUNING overrides of kernels/_forward.py,
        _backward.py, _products.py (lean: cce_inductor._layout.LEAN_LAYOUT), e.g. fwd.block_v=128,
        lean.block_cols=4096, prod.BLOCK_K=32: the entry in
        use ("gpu"; "interpret" under TRITON_INTERPRET=1) is replaced for that config and restored after
    need_e=0|1, need_c=0|1, fwd_only=0|1                        sweep only: what the backward computes
Output: a "# device ..." header; per case a "## shape N= D= V= regime=" line; per form, method and mode "ms, MB
[err_dE err_dC]"; last a markdown table of every row (x compile, x matmul, MB over the N*D + V*D lower bound).
--json PATH writes the header (device, versions, options, tuning, settings), the cases and the rows.

--tiny: a CPU smoke run (< 2 minutes): shape "tiny" (D 64, V 2048), N 256, perf_counter timings (median of three
calls), no memory figures. On CPU every cce method is the op's chunked PyTorch path (its options change nothing
there); with --direct or --sweep the Triton kernels run in the interpreter (the script sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as H

SHAPES = {  # name: (D, V)
    "gemma2": (2304, 256000),
    "llama3": (4096, 128256),
    "qwen25": (3584, 152064),
    "phi35": (3072, 32064),
}
TINY_SHAPES = {"tiny": (64, 2048)}
REGIMES = ("flat", "lm", "mixed")  # each also with the suffix "_ign50"
IGNORE = -100
CCE_METHODS = {  # name: CCEOptions fields over the base options (--config)
    "cce": {},
    "cce_rowskip": {"products": "triton"},
    "cce_exact": {"exact": True},
    "cce_balanced": {"scratch_mb": 1024},
    "cce_balanced512": {"scratch_mb": 512},
}
# torch.compile(loss) with our backend: the pass rewrites the loss, Inductor compiles the rest (the op's backward
# formula included): what a user of the product runs
PASS_METHODS = {"pass_cce": {}, "pass_balanced": {"scratch_mb": 1024}}
METHODS = ("matmul", "eager", "compile", *CCE_METHODS, *PASS_METHODS)
# prefix: cce_inductor.kernels module (its _TUNING), or "lean": the lean G block's layout (kernels/_layout.py)
TUNING_FILES = {"fwd": "_forward", "bwd": "_backward", "prod": "_products", "lean": "_layout"}
SWEEP_KNOBS = ("need_e", "need_c", "fwd_only")
CPU_REPS = 3  # timed calls per CPU measurement (after one warm-up call)


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


def build_cases(args):
    """[(shape name, D, V, regime)]: every shape x regime."""
    shapes = {**SHAPES, **TINY_SHAPES}
    for regime in args.regimes.split(","):
        if regime.removesuffix("_ign50") not in REGIMES:
            raise SystemExit(f"unknown regime {regime!r}; regimes: {', '.join(REGIMES)} (each also with _ign50)")
    cases = []
    for shape in args.shapes.split(","):
        if shape not in shapes:
            raise SystemExit(f"unknown shape {shape!r}; shapes: {', '.join(shapes)}")
        cases += [(shape, *shapes[shape], regime) for regime in args.regimes.split(",")]
    return cases


def case_data(args, case):
    """``(e, c, targets)`` of a case on ``args.device``."""
    _, d, v, regime = case
    e, c, t = make_data(args.n, d, v, regime.removesuffix("_ign50"), args.device, seed=args.seed)
    if regime.endswith("_ign50"):
        t = ignore_half(t, args.seed)
    return e, c, t


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
# loss forms and methods
# --------------------------------------------------------------------------------------------------
TEMPERATURE = 0.7
CLIP_EPS = 0.2
CHUNKS, CHUNKED_SEQ = 8, 2048  # torchtune's output chunks per sequence; the sequence length the rows are cut into


def ce_loss(e, c, t):
    return F.cross_entropy(F.linear(e, c).float(), t, ignore_index=IGNORE)


def label_smoothing_loss(e, c, t):
    return F.cross_entropy(F.linear(e, c).float(), t, ignore_index=IGNORE, label_smoothing=0.1)


def z_loss(e, c, t):
    logits = F.linear(e, c).float()
    return F.cross_entropy(logits, t, ignore_index=IGNORE) + 1e-4 * torch.logsumexp(logits, dim=-1).pow(2).mean()


def chunked_loss(e, c, t):
    """torchtune's TransformerDecoder with num_output_chunks (the projection per chunk of each sequence), then its
    CEWithChunkedOutputLoss (a summed cross-entropy per chunk, over the counted targets), as torchtune writes them."""
    seq = min(CHUNKED_SEQ, e.shape[0])
    logits = [F.linear(chunk, c) for chunk in e.view(-1, seq, e.shape[1]).chunk(CHUNKS, dim=1)]
    labels = [y.reshape(-1) for y in t.view(-1, seq).chunk(len(logits), dim=1)]
    total = 0.0
    for chunk, y in zip(logits, labels):
        total += F.cross_entropy(chunk.reshape(-1, chunk.shape[-1]).float(), y, ignore_index=IGNORE, reduction="sum")
    return total / (t != IGNORE).sum()


def _token_logps(logits, ids):
    return torch.gather(logits.log_softmax(-1), dim=-1, index=ids.unsqueeze(-1)).squeeze(-1)


def _clipped_surrogate(logps, old_logps, advantages):
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - CLIP_EPS, 1 + CLIP_EPS)
    return -torch.min(ratio * advantages, clipped * advantages)


def grpo_loss(e, c, ids, old_logps, advantages, mask):
    """TRL's GRPO: temperature-scaled logits, selective log-softmax, clipped surrogate, masked mean."""
    logits = (e @ c.T) / TEMPERATURE
    per_token = _clipped_surrogate(_token_logps(logits, ids), old_logps, advantages)
    return (per_token * mask).sum() / mask.sum()


def entropy_from_logits(logits, chunk_size=128):
    """TRL's entropy_from_logits: the entropy over row chunks of the logits."""
    entropies = []
    for chunk in logits.split(chunk_size, dim=0):
        logps = F.log_softmax(chunk, dim=-1)
        entropies.append(-(torch.exp(logps) * logps).sum(-1))
    return torch.cat(entropies)


def grpo_entropy_loss(e, c, ids, old_logps, advantages, mask):
    """GRPO as above with TRL's entropy of the same logits as a bonus."""
    logits = (e @ c.T) / TEMPERATURE
    per_token = _clipped_surrogate(_token_logps(logits, ids), old_logps, advantages)
    per_token = per_token - 0.01 * entropy_from_logits(logits)
    return (per_token * mask).sum() / mask.sum()


def grpo_inputs(e, c, t, seed):
    """The GRPO losses' arguments after e and c: the targets as token ids (ignored ones at 0, masked out), the
    old policy's log-probs (this one's, fp32, by row blocks, plus noise: ratios near 1), per-row advantages, the
    mask of counted rows."""
    g = torch.Generator(device=e.device).manual_seed(seed + 2)
    ids = t.clamp(min=0)
    with torch.no_grad():
        c32 = c.float()
        logps = torch.cat(
            [_token_logps(h.float() @ c32.T / TEMPERATURE, i) for h, i in zip(e.split(1024), ids.split(1024))]
        )
    old_logps = logps + 0.05 * torch.randn(logps.shape, device=e.device, generator=g)
    advantages = torch.randn(logps.shape, device=e.device, generator=g)
    return ids, old_logps, advantages, (t != IGNORE).float()


FORMS = {  # name: (loss(e, c, ...), its arguments after e and c from the case's (e, c, t, seed); None: t alone)
    "ce": (ce_loss, None),
    "label_smoothing": (label_smoothing_loss, None),
    "z_loss": (z_loss, None),
    "chunked": (chunked_loss, None),
    "grpo": (grpo_loss, grpo_inputs),
    "grpo_entropy": (grpo_entropy_loss, grpo_inputs),
}


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


def build_methods(args, base_options):
    """{form: {method: (callable, kind)}}, kind "plain" (the pass must stay out), "pass" (it must rewrite every
    site) or "op" (the op called directly); each form's functions compiled once, reused for every case."""
    import cce_inductor

    out = {}
    for form in args.forms.split(","):
        loss = FORMS[form][0]
        methods = {"eager": (loss, "plain"), "compile": (torch.compile(loss, dynamic=False), "plain")}
        if form == "ce":
            for name, fields in CCE_METHODS.items():
                methods[name] = (cce_fn(dataclasses.replace(base_options, **fields), args.direct), "op")
        for name, fields in PASS_METHODS.items():
            backend = cce_inductor.make_backend(dataclasses.replace(base_options, **fields))
            methods[name] = (torch.compile(loss, backend=backend, dynamic=False), "pass")
        out[form] = methods
    return out


# --------------------------------------------------------------------------------------------------
# measurement
# --------------------------------------------------------------------------------------------------
def queued(fn, args, grad_to_none=None):
    return H.queued_ms(fn, args.device, CPU_REPS, grad_to_none=grad_to_none, warmup_ms=args.warmup, rep_ms=args.rep)


def measure(fn, kind, e, c, rest, mode, args, picks):
    """One method on one case and mode: ms (queued; sync_ms with --synced), peak MB above the inputs, the gradients
    (fwdbwd), the pass's pick and its op calls per call (kind "pass"). ``picks``: {(fn, mode): pick} of the graphs
    compiled so far; a case that reuses one (same shapes: no compile, no site in stats()) is judged by its compile."""
    import cce_inductor

    if mode == "fwd":

        def run():
            with torch.no_grad():
                return fn(e, c, *rest)

        grads = None
    else:
        e.requires_grad_(True)
        c.requires_grad_(True)

        def run():
            loss = fn(e, c, *rest)
            loss.backward()
            return loss

        grads = [e, c]
    result = {}
    try:
        cce_inductor.reset_stats()
        run()  # compile / warm up
        H.sync(args.device)
        stats = cce_inductor.stats()
        if kind != "op" and (stats["graphs"] or (fn, mode) not in picks):
            picks[fn, mode] = H.checked_pick(stats, kind == "pass")
        pick = picks.get((fn, mode))
        if pick:
            result["pick"], result["pick_reason"] = pick
        e.grad = c.grad = None
        H.free(args.device)
        cce_inductor.reset_stats()
        result["mb"] = H.peak_above_mb(run, args.device)
        if kind == "pass":
            calls = sum(cce_inductor.stats()["executions"].values())
            if calls != 1:
                raise RuntimeError(f"NOT REWRITTEN as one call: the op ran {calls} times in one call of the loss")
        if mode == "fwdbwd":
            result["grads"] = (e.grad.detach().clone(), c.grad.detach().clone())
        e.grad = c.grad = None
        result["ms"] = queued(run, args, grad_to_none=grads)
        if args.synced:
            result["sync_ms"] = H.synced_ms(run, args.device, grad_to_none=grads)
    finally:
        e.grad = c.grad = None
        e.requires_grad_(False)
        c.requires_grad_(False)
    return result


def profile_fwdbwd(fn, e, c, rest, device):
    """Device time per kernel over one forward + backward (after the timed runs: compiled, warm)."""
    e.requires_grad_(True)
    c.requires_grad_(True)
    try:
        return H.kernel_breakdown(lambda: fn(e, c, *rest).backward(), device)
    finally:
        e.grad = c.grad = None
        e.requires_grad_(False)
        c.requires_grad_(False)


def run_methods(args, base_options):
    methods = build_methods(args, base_options)
    picks = {}  # (compiled fn, mode) -> the pass's pick at its compile
    matmul_ms = {}  # (N, D, V) -> ms
    rows, cases = [], []
    for case in build_cases(args):
        H.free(args.device)
        shape, regime = case[0], case[3]
        e, c, t = case_data(args, case)
        n, d, v = e.shape[0], e.shape[1], c.shape[0]
        lower_bound_mb = (n * d + v * d) * e.element_size() / 2**20
        counted = (t != IGNORE).float().mean().item()
        print(f"## {shape} N={n} D={d} V={v} regime={regime} counted={counted:.3f}", flush=True)
        cases.append(dict(shape=shape, n=n, d=d, v=v, regime=regime, counted=counted))
        for form, by_name in methods.items():
            loss, inputs = FORMS[form]
            rest = (t,) if inputs is None else inputs(e, c, t, args.seed)
            ref = None
            if args.check:
                ref = H.fp32_reference_grads(e, c, t, IGNORE) if form == "ce" else H.fp32_grads(loss, (e, c), *rest)
            results = {}
            for mode in args.modes.split(","):
                for m in args.methods.split(","):
                    if m == "matmul":
                        if mode != "fwd" or (n, d, v) in matmul_ms:
                            continue
                        matmul_ms[(n, d, v)] = ms = queued(lambda: e @ c.T, args)
                        r = dict(ms=ms, mb=n * v * e.element_size() / 2**20)
                    elif m not in by_name:  # a cce_* method: the plain op, not this form
                        continue
                    else:
                        fn, kind = by_name[m]
                        began = time.time()
                        try:
                            r = measure(fn, kind, e, c, rest, mode, args, picks)
                        except Exception as exc:  # noqa: BLE001 - recorded; the next method goes on
                            r = dict(error=H.err_text(exc))
                            H.free(args.device)
                        r["wall_s"] = time.time() - began
                    results[(m, mode)] = r
                    grads = r.pop("grads", None)
                    extra = ""
                    if ref is not None and grads is not None:
                        r["err_de"], r["err_dc"] = H.rel_err(grads[0], ref[0]), H.rel_err(grads[1], ref[1])
                        extra = f" err_dE={r['err_de']:.2e} err_dC={r['err_dc']:.2e}"
                    if "sync_ms" in r:
                        extra += f" synced {r['sync_ms']:.2f} ms"
                    if "error" in r:
                        extra += f" FAILED {r['error']}"
                    print(
                        f"  {form:15s} {m:15s} {mode:7s} {H.fmt(r.get('ms')):>9s} ms "
                        f"{H.fmt(r.get('mb'), '.1f'):>10s} MB {r.get('pick') or ''}{extra}",
                        flush=True,
                    )
                    if args.profile and mode == "fwdbwd" and m != "matmul" and "error" not in r:
                        try:
                            r["kernels"] = profile_fwdbwd(by_name[m][0], e, c, rest, args.device)
                        except Exception as exc:  # noqa: BLE001 - a profiler problem must not lose the timings
                            print(f"      (no kernel breakdown: {H.err_text(exc)})")
                        for name, calls, ms in r.get("kernels") or []:
                            print(f"      {ms:8.2f} ms {calls:5d}x  {name}")
            for (m, mode), r in results.items():
                comp = results.get(("compile", mode), {})
                mm = matmul_ms.get((n, d, v))
                ratio = r.get("ms") and comp.get("ms") and r["ms"] / comp["ms"]
                rows.append(
                    dict(
                        r,
                        shape=shape,
                        regime=regime,
                        form=form,
                        n=n,
                        d=d,
                        v=v,
                        method=m,
                        mode=mode,
                        vs_compile=ratio or None,
                        vs_matmul=r["ms"] / mm if mm and r.get("ms") else None,
                        mb_vs_lower_bound=r["mb"] / lower_bound_mb if mode == "fwdbwd" and r.get("mb") else None,
                    )
                )
            rest = ref = None
        e = c = t = None  # free the case before the next one
    return rows, cases


def print_table(rows):
    print()
    print(
        "| shape | regime | form | method | mode | ms | synced ms | MB | x compile | x matmul | MB / lower bound "
        "| err dE | err dC |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    f = H.fmt
    for r in rows:
        print(
            f"| {r['shape']} | {r['regime']} | {r['form']} | {r['method']} | {r['mode']} | {f(r.get('ms'))} | "
            f"{f(r.get('sync_ms'))} | {f(r.get('mb'), '.0f')} | {f(r['vs_compile'])} | {f(r['vs_matmul'])} | "
            f"{f(r['mb_vs_lower_bound'], '.3f')} | {f(r.get('err_de'), '.1e')} | {f(r.get('err_dc'), '.1e')} |"
            + (f" FAILED {r['error']}" if r.get("error") else "")
        )


# --------------------------------------------------------------------------------------------------
# sweep: the kernels called directly under several configs
# --------------------------------------------------------------------------------------------------
def sweep(args, base_options):
    K = _kernels()
    configs = [(text, *parse_config(text)) for text in args.sweep.split(";")]  # bad keys stop the run here
    out_rows = []
    for case in build_cases(args):
        shape, regime = case[0], case[3]
        e, c, t = case_data(args, case)
        print(f"## sweep {shape} N={e.shape[0]} D={e.shape[1]} V={c.shape[0]} regime={regime}", flush=True)
        ref = H.fp32_reference_grads(e, c, t, IGNORE) if args.check else None
        mm = queued(lambda: e @ c.T, args)
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
                    row["fwd_ms"] = f_ms = queued(fwd, args)
                    line = f"  {text:60s} fwd {f_ms:7.2f} ms ({f_ms / mm:.2f}x mm)"
                    if not knobs.get("fwd_only", False):

                        def bwd():
                            return kernels_backward(
                                e, c, t, lse, grad_rows, options, need_e=need_e, need_c=need_c, need_bias=False
                            )

                        with H.Peak(args.device) as peak:
                            de, dc, _ = bwd()
                        row["bwd_ms"] = b_ms = queued(bwd, args)
                        row["bwd_mb"] = peak.above_mb
                        line += (
                            f" bwd {b_ms:7.2f} ms total {f_ms + b_ms:7.2f} bwd peak {H.fmt(peak.above_mb, '.0f')} MB"
                        )
                        if ref is not None:
                            if need_e:
                                row["err_de"] = H.rel_err(de, ref[0])
                                line += f" err_dE={row['err_de']:.2e}"
                            if need_c:
                                row["err_dc"] = H.rel_err(dc, ref[1])
                                line += f" err_dC={row['err_dc']:.2e}"
                        de = dc = None
                    print(line, flush=True)
            except Exception as exc:  # noqa: BLE001
                row["error"] = H.err_text(exc)
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
        help="comma-separated of flat, lm, mixed, each also *_ign50 (default flat,lm,mixed,lm_ign50)",
    )
    ap.add_argument(
        "--methods",
        default=None,
        help=f"comma-separated of {', '.join(METHODS)} (default matmul,eager,compile,cce,cce_exact)",
    )
    ap.add_argument("--forms", default="ce", help=f"comma-separated of {', '.join(FORMS)} (default ce)")
    ap.add_argument("--modes", default="fwd,fwdbwd")
    ap.add_argument("--n", type=int, default=None, help="rows (tokens) per case (default 8192)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--direct", action="store_true", help="call cce_inductor.kernels directly, not the custom op")
    ap.add_argument("--check", action="store_true", help="gradient errors against an fp32 reference")
    ap.add_argument("--synced", action="store_true", help="also time each call on its own (sync_ms)")
    ap.add_argument(
        "--config",
        default="",
        help="CCEOptions fields and _TUNING overrides for the whole run, e.g. "
        "backward_row_chunk=4096,lean.block_cols=4096,fwd.block_v=128",
    )
    ap.add_argument("--sweep", default="", help='";"-separated configs: time the kernels directly under each')
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warm-up (ms)")
    ap.add_argument("--rep", type=int, default=100, help="do_bench repetitions (ms)")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="per method with gradients: one fwd+bwd under torch.profiler, the per-kernel time breakdown",
    )
    ap.add_argument("--json", default="", help="write the header, cases and rows here")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny shapes, chunked path")
    args = ap.parse_args(argv)
    tiny = args.tiny
    defaults = dict(
        shapes="tiny" if tiny else "gemma2",
        regimes="lm,lm_ign50" if tiny else "flat,lm,mixed,lm_ign50",
        methods="eager,compile,cce,pass_cce" if tiny else "matmul,eager,compile,cce,cce_exact",
        n=256 if tiny else 8192,
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.device = "cpu" if tiny else "cuda"
    for m in args.methods.split(","):
        if m not in METHODS:
            ap.error(f"unknown method {m!r}; methods: {', '.join(METHODS)}")
    for form in args.forms.split(","):
        if form not in FORMS:
            ap.error(f"unknown form {form!r}; forms: {', '.join(FORMS)}")
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

    H.setup_compile()
    fields, tuning, knobs = parse_config(args.config)
    if knobs:
        raise SystemExit(f"{list(knobs)} are sweep-only keys")
    base_options = CCEOptions(**fields)
    with contextlib.ExitStack() as stack:
        if tuning:
            stack.enter_context(tuning_overrides(tuning))
        extra = dict(
            script="benchmark",
            path="direct kernels" if args.direct or args.sweep else "cce_inductor.linear_cross_entropy",
            base_options=dataclasses.asdict(base_options),
            settings=vars(args),
        )
        if uses_kernels:
            extra.update(tuning=tuning_in_use(), interpret=_kernels().INTERPRET)
        else:
            extra.update(path="cce_inductor.linear_cross_entropy (chunked PyTorch on the CPU)")
        header = H.header(args.device, extra)
        print("# " + ", ".join(f"{k} {v}" for k, v in header.items() if k not in ("settings", "env")), flush=True)
        if args.sweep:
            rows = sweep(args, base_options)
            if args.json:
                H.write_json(args.json, dict(header, sweep=rows))
            return
        rows, cases = run_methods(args, base_options)
    if args.json:
        H.write_json(args.json, dict(header, cases=cases, rows=rows))
    print_table(rows)


if __name__ == "__main__":
    main()
