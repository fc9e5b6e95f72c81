"""Benchmark of the CCE kernels against eager PyTorch and torch.compile (one process, CUDA only).

    python examples/benchmark.py --shapes gemma2 --regimes flat,lm,mixed,lm_ign50

Methods (each timed as loss only = "fwd" and loss + gradients = "fwdbwd"):
    matmul     one bf16 N x D @ D x V product (the floor; fwd only)
    eager      F.cross_entropy(F.linear(e, c).float(), t)
    compile    torch.compile of the same function
    cce        cce_inductor.linear_cross_entropy with its defaults (no gradient filtering: the dense backward,
               a Triton recompute of the softmax gradient + cuBLAS products) -- or, with --direct or when the op is not
               importable, the kernels called directly through a small autograd.Function
    cce_cublas the same with the recompute's logits from cuBLAS (fp32) and a separate softmax-gradient kernel
    cce_rowskip the same with the dE / dC products in Triton, which skip the ignored rows (dense_products=triton)
    cce_tile   the same through the tile kernel (kernel config bwd_dense=0; the previous default path)
    cce_filter filter_eps="auto" (the paper's 2^-12 for bf16), vocab_sort=False (tiles skipped from the
               forward's per-tile max, no recompute)
    cce_filter_sort  the same with vocab_sort=True
    cce_exact  exact=True (no filtering; the dense path with G in bf16 hi + lo halves, fp32 dC sums)
Time: median of CUDA-event timings after warm-up (triton.testing.do_bench).  Memory: peak allocated
above what was allocated before the call (inputs excluded; gradients included for fwdbwd).

Data regimes (synthetic; c Gaussian with unit-norm rows, e built from chosen token vectors):
    flat      e Gaussian, logits ~ N(0, 1), uniform targets
    lm        48 plausible tokens per row with logits 14 - log(rank) (p ~ 1/rank), drawn from a Zipf
              popularity over a randomly permuted vocabulary; target sampled from them
    mixed     85% confident rows (4 plausible tokens, top p ~0.9), 15% broad rows (128 plausible tokens)
    *_ign50   the same with 50% of the targets set to ignore_index
The softmax statistics of each regime are printed (sampled rows).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

SHAPES = {  # name: (D, V)
    "gemma2": (2304, 256000),
    "llama3": (4096, 128256),
    "qwen25": (3584, 152064),
    "phi35": (3072, 32064),
}
IGNORE = -100


# --------------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------------
def _build_e(c, toks, alpha):
    """e[n] = sum_k alpha[n, k] * c[toks[n, k]] (fp32)."""
    n, k_max = toks.shape
    e = torch.zeros(n, c.shape[1], device=c.device, dtype=torch.float32)
    for k in range(k_max):
        e += alpha[:, k:k + 1] * c[toks[:, k]].float()
    return e


def make_data(n, d, v, regime, seed=0, dtype=torch.bfloat16):
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(seed)
    base = regime.replace("_ign50", "")
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
            raise ValueError(regime)
        # k distinct plausible tokens per row, drawn from the popularity without replacement (in chunks)
        toks = torch.cat([
            torch.multinomial(popularity.expand(min(1024, n - s), v), k, replacement=False, generator=g)
            for s in range(0, n, 1024)])
        e32 = _build_e(c32, toks, alpha)
        # target: one of the row's plausible tokens, chosen with probability ~ softmax(alpha)
        pick = torch.multinomial(torch.softmax(alpha.masked_fill(alpha == 0, -1e4), -1), 1, generator=g)[:, 0]
        targets = toks.gather(1, pick[:, None])[:, 0]
    if regime.endswith("_ign50"):
        targets = torch.where(torch.rand(n, device=dev, generator=g) < 0.5, torch.full_like(targets, IGNORE), targets)
    return e32.to(dtype).contiguous(), c32.to(dtype).contiguous(), targets


def softmax_stats(e, c, targets, rows=256):
    lg = e[:rows].float() @ c.float().T
    p = torch.softmax(lg, -1)
    top = p.topk(48, dim=-1).values
    t = targets[:rows]
    valid = t != IGNORE
    pt = p.gather(1, t.clamp(min=0)[:, None])[:, 0][valid]
    return dict(
        p_max=round(p.max(-1).values.mean().item(), 4),
        top48_mass=round(top.sum(-1).mean().item(), 4),
        above_eps_per_row=round((p >= 2.0**-12).sum(-1).float().mean().item(), 1),
        p_target=round(pt.mean().item(), 4) if valid.any() else None,
        lse_mean=round(torch.logsumexp(lg, -1).mean().item(), 2),
        valid_frac=round((targets != IGNORE).float().mean().item(), 3),
    )


# --------------------------------------------------------------------------------------------------
# methods
# --------------------------------------------------------------------------------------------------
def torch_loss(e, c, t):
    return F.cross_entropy(F.linear(e, c).float(), t, ignore_index=IGNORE)


class _DirectCCE(torch.autograd.Function):
    """Kernels called directly (mean reduction), for when the custom op is not available."""

    @staticmethod
    def forward(ctx, e, c, t, vocab_sort, exact):
        from cce_inductor import kernels as K
        lse, tgt, aux = K.forward(e, c, t, None, softcap=None, ignore_index=IGNORE, vocab_sort=vocab_sort)
        valid = t != IGNORE
        count = valid.sum().clamp(min=1)
        ctx.save_for_backward(e, c, t, lse, aux, count)
        ctx.flags = (vocab_sort, exact)
        return torch.where(valid, lse - tgt, 0.0).sum() / count

    @staticmethod
    def backward(ctx, grad):
        from cce_inductor import kernels as K
        e, c, t, lse, aux, count = ctx.saved_tensors
        vocab_sort, exact = ctx.flags
        grad_rows = (t != IGNORE).float() * (grad / count)
        de, dc, _ = K.backward(e, c, t, None, lse, aux, grad_rows, softcap=None, ignore_index=IGNORE,
                               filter_eps=K.default_filter_eps(e.dtype), vocab_sort=vocab_sort, exact=exact,
                               need_e=ctx.needs_input_grad[0], need_c=ctx.needs_input_grad[1], need_bias=False)
        return de, dc, None, None, None


def cce_fn(direct, vocab_sort, exact, filter_eps=None):
    if not direct:
        from cce_inductor import linear_cross_entropy

        def f(e, c, t):
            # filter_eps=None: the paper's per-dtype threshold; 0.0: no filtering (the op's default)
            return linear_cross_entropy(e, c, t, ignore_index=IGNORE, vocab_sort=vocab_sort, exact=exact,
                                        filter_eps=filter_eps)
        return f

    def g(e, c, t):
        return _DirectCCE.apply(e, c, t, vocab_sort, exact)
    return g


# --------------------------------------------------------------------------------------------------
# measurement
# --------------------------------------------------------------------------------------------------
def measure(fn, e, c, t, mode, warmup=25, rep=100):
    import triton
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
    out = run()  # compile / warm up
    torch.cuda.synchronize()
    e.grad = c.grad = None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = run()
    torch.cuda.synchronize()
    peak_mb = (torch.cuda.max_memory_allocated() - base) / 2**20
    result = dict(loss=float(out.detach().float()))
    if mode == "fwdbwd":
        result["grads"] = (e.grad.detach().clone(), c.grad.detach().clone())
    e.grad = c.grad = None
    del out
    ms = triton.testing.do_bench(run, warmup=warmup, rep=rep, grad_to_none=grads, return_mode="median")
    e.grad = c.grad = None
    e.requires_grad_(False)
    c.requires_grad_(False)
    result.update(ms=ms, mb=peak_mb)
    return result


def fp32_reference_grads(e, c, t, chunk=1024):
    """Mean-reduced cross-entropy gradients from fp32 logits (true fp32 matmuls), chunked over rows."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        c32 = c.float()
        valid = t != IGNORE
        count = valid.sum().clamp(min=1).float()
        de = torch.empty(e.shape, dtype=torch.float32, device=e.device)
        dc = torch.zeros(c.shape, dtype=torch.float32, device=e.device)
        for s in range(0, e.shape[0], chunk):
            e32 = e[s:s + chunk].float()
            grad = torch.softmax(e32 @ c32.T, -1)
            tt = t[s:s + chunk]
            vv = tt != IGNORE
            grad[vv.nonzero()[:, 0], tt[vv]] -= 1.0
            grad *= (vv.float() / count)[:, None]
            de[s:s + chunk] = grad @ c32
            dc += grad.T @ e32
            del grad
        return de, dc
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _parse_cfg(text):
    cfg = {}
    for kv in filter(None, text.split(",")):
        key, val = kv.split("=")
        if key == "eps":
            cfg[key] = float(val)
        else:
            try:
                cfg[key] = int(val)
            except ValueError:
                cfg[key] = val  # e.g. dense_recompute=cublas
    return cfg


def sweep(args):
    """Time the kernels called directly under several configs (``--sweep "k=v,k=v;k=v"``).

    Each config may set kernel CONFIG keys plus ``eps`` (filter_eps; -1 = default), ``sort`` (0/1), ``exact``,
    ``need_e``/``need_c`` (0/1), ``summ`` (0/1: forward summaries; default: as the op, only when filtering).  Prints forward ms, backward ms (given that forward) and gradient errors
    against the fp32 reference."""
    import triton
    from cce_inductor import kernels as K
    for shape in args.shapes.split(","):
        d, v = SHAPES[shape]
        n = args.n
        for regime in args.regimes.split(","):
            e, c, t = make_data(n, d, v, regime)
            print(f"## sweep {shape} N={n} D={d} V={v} regime={regime} stats={softmax_stats(e, c, t)}", flush=True)
            ref = fp32_reference_grads(e, c, t) if args.check else None
            mm = triton.testing.do_bench(lambda: e @ c.T, warmup=args.warmup, rep=args.rep, return_mode="median")
            print(f"  matmul {mm:.2f} ms", flush=True)
            valid = t != IGNORE
            grad_rows = valid.float() / valid.sum().clamp(min=1).float()
            for text in args.sweep.split(";"):
                cfg = _parse_cfg(text)
                eps = cfg.pop("eps", -1.0)
                eps = K.default_filter_eps(e.dtype) if eps < 0 else eps
                sort = bool(cfg.pop("sort", 0))
                exact = bool(cfg.pop("exact", 0))
                need_e = bool(cfg.pop("need_e", 1))
                need_c = bool(cfg.pop("need_c", 1))
                fwd_only = bool(cfg.pop("fwd_only", 0))
                summaries = bool(cfg.pop("summ", int(eps > 0 and not exact)))  # as the op asks for them
                try:
                    with K.override_config(**cfg):
                        fwd = lambda: K.forward(e, c, t, None, softcap=None, ignore_index=IGNORE,  # noqa: E731
                                                vocab_sort=sort, summaries=summaries)
                        lse, tgt, aux = fwd()
                        f_ms = triton.testing.do_bench(fwd, warmup=args.warmup, rep=args.rep, return_mode="median")
                        line = f"  {text:60s} fwd {f_ms:7.2f} ms ({f_ms / mm:.2f}x mm)"
                        if not fwd_only:
                            bwd = lambda: K.backward(e, c, t, None, lse, aux, grad_rows, softcap=None,  # noqa: E731
                                                     ignore_index=IGNORE, filter_eps=eps, vocab_sort=sort,
                                                     exact=exact, need_e=need_e, need_c=need_c, need_bias=False)
                            torch.cuda.synchronize()
                            torch.cuda.reset_peak_memory_stats()
                            base = torch.cuda.memory_allocated()
                            de, dc, _ = bwd()
                            torch.cuda.synchronize()
                            b_mb = (torch.cuda.max_memory_allocated() - base) / 2**20
                            del de, dc
                            b_ms = triton.testing.do_bench(bwd, warmup=args.warmup, rep=args.rep, return_mode="median")
                            line += f" bwd {b_ms:7.2f} ms total {f_ms + b_ms:7.2f} bwd peak {b_mb:7.0f} MB"
                            if ref is not None:
                                de, dc, _ = bwd()
                                if need_e:
                                    line += f" err_dE={rel(de, ref[0]):.2e}"
                                if need_c:
                                    line += f" err_dC={rel(dc, ref[1]):.2e}"
                                del de, dc
                        print(line, flush=True)
                except Exception as exc:  # noqa: BLE001
                    print(f"  {text:60s} FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            del e, c, t, ref


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="gemma2")
    ap.add_argument("--regimes", default="flat,lm,mixed,lm_ign50")
    ap.add_argument("--methods", default="matmul,eager,compile,cce,cce_filter")
    ap.add_argument("--modes", default="fwd,fwdbwd")
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--direct", action="store_true", help="call the kernels directly, not the custom op")
    ap.add_argument("--check", action="store_true", help="check CCE gradients against an fp32 reference")
    ap.add_argument("--config", default="", help="kernel config overrides, e.g. tile_v=256,bwd_num_warps=4")
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--json", default="")
    ap.add_argument("--sweep", default="", help='kernel configs to time directly, ";"-separated')
    args = ap.parse_args()
    if args.sweep:
        return sweep(args)

    from cce_inductor import kernels as K
    direct = args.direct
    if not direct:
        try:
            from cce_inductor import linear_cross_entropy  # noqa: F401
        except Exception as exc:  # noqa: BLE001
            print(f"custom op not importable ({exc!r}); calling the kernels directly", file=sys.stderr)
            direct = True
    if args.config:
        K.CONFIG.update(_parse_cfg(args.config))
    dev_name = torch.cuda.get_device_name()
    print(f"# device {dev_name}, torch {torch.__version__}, triton {__import__('triton').__version__}, "
          f"path {'direct kernels' if direct else 'cce_inductor.linear_cross_entropy'}, config {K.CONFIG}")
    compiled = torch.compile(torch_loss)
    # name -> (loss function, kernel config overrides held while it runs forward and backward)
    methods = {
        "eager": (torch_loss, {}),
        "compile": (compiled, {}),
        "cce": (cce_fn(direct, False, False, filter_eps=0.0), {}),  # the op's defaults: no filtering
        "cce_tile": (cce_fn(direct, False, False, filter_eps=0.0), {"bwd_dense": 0}),  # ... through the tile kernel
        # ... with the dense backward's logits from cuBLAS (fp32 out) and a separate softmax-gradient kernel
        "cce_cublas": (cce_fn(direct, False, False, filter_eps=0.0), {"dense_recompute": "cublas"}),
        # ... with the dE / dC products in Triton, skipping the ignored rows (kernels/_products.py)
        "cce_rowskip": (cce_fn(direct, False, False, filter_eps=0.0), {"dense_products": "triton"}),
        "cce_filter": (cce_fn(direct, False, False), {}),  # the paper's threshold (filter_eps="auto")
        "cce_filter_sort": (cce_fn(direct, True, False), {}),
        "cce_exact": (cce_fn(direct, False, True), {}),
    }
    rows = []
    for shape in args.shapes.split(","):
        d, v = SHAPES[shape]
        n = args.n
        lower_bound_mb = (n * d + v * d) * 2 / 2**20
        for regime in args.regimes.split(","):
            torch.cuda.empty_cache()
            e, c, t = make_data(n, d, v, regime)
            stats = softmax_stats(e, c, t)
            print(f"## {shape} N={n} D={d} V={v} regime={regime} stats={stats}", flush=True)
            ref = fp32_reference_grads(e, c, t) if args.check else None
            results = {}
            for mode in args.modes.split(","):
                for m in args.methods.split(","):
                    if m == "matmul":
                        if mode != "fwd" or regime != args.regimes.split(",")[0]:
                            continue
                        import triton
                        ms = triton.testing.do_bench(lambda: e @ c.T, warmup=args.warmup, rep=args.rep, return_mode="median")
                        results[(m, mode)] = dict(ms=ms, mb=n * v * 2 / 2**20)
                    else:
                        t0 = time.time()
                        try:
                            fn, overrides = methods[m]
                            with K.override_config(**overrides):
                                results[(m, mode)] = measure(fn, e, c, t, mode, args.warmup, args.rep)
                        except torch.OutOfMemoryError:
                            results[(m, mode)] = dict(ms=float("nan"), mb=float("nan"))
                            torch.cuda.empty_cache()
                        results[(m, mode)]["wall_s"] = time.time() - t0
                    r = results[(m, mode)]
                    extra = ""
                    if ref is not None and "grads" in r:
                        r["err_de"], r["err_dc"] = rel(r["grads"][0], ref[0]), rel(r["grads"][1], ref[1])
                        extra = f" err_dE={r['err_de']:.2e} err_dC={r['err_dc']:.2e}"
                    r.pop("grads", None)
                    print(f"  {m:18s} {mode:7s} {r['ms']:9.2f} ms {r['mb']:10.1f} MB{extra}", flush=True)
            for (m, mode), r in results.items():
                comp = results.get(("compile", mode))
                mm = next((rr for (mm_, _), rr in results.items() if mm_ == "matmul"), None)
                rows.append(dict(shape=shape, regime=regime, method=m, mode=mode, ms=r["ms"], mb=r["mb"],
                                 vs_compile=r["ms"] / comp["ms"] if comp else None,
                                 vs_matmul=r["ms"] / mm["ms"] if mm else None,
                                 mb_vs_lower_bound=(r["mb"] / lower_bound_mb) if mode == "fwdbwd" else None,
                                 err_de=r.get("err_de"), err_dc=r.get("err_dc"), stats=stats))
            del e, c, t, ref
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(device=dev_name, rows=rows), fh, indent=1)
    print()
    print(f"| shape | regime | method | mode | ms | MB | x compile | x matmul | MB / lower bound | err dE | err dC |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    f = lambda x, p=2: "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{p}f}"  # noqa: E731
    g = lambda x: "" if x is None else f"{x:.1e}"  # noqa: E731
    for r in rows:
        print(f"| {r['shape']} | {r['regime']} | {r['method']} | {r['mode']} | {f(r['ms'])} | {f(r['mb'], 0)} | "
              f"{f(r['vs_compile'])} | {f(r['vs_matmul'])} | {f(r['mb_vs_lower_bound'], 3)} | {g(r['err_de'])} | {g(r['err_dc'])} |")


if __name__ == "__main__":
    main()
