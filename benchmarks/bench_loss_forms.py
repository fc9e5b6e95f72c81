"""The loss forms of issue 16 on a GPU: step time, peak memory and accuracy of eager, plain torch.compile and
torch.compile with the cce_inductor pass, for each form the pass rewrites beyond the plain cross-entropy.

    python benchmarks/bench_loss_forms.py --out benchmarks/results/$(date +%F)_h100_loss-forms.json
    python benchmarks/bench_loss_forms.py --tiny --out /tmp/lf.json          # CPU smoke run (~1.5 min on 2 cores)

Cases (bf16 hidden states and head weight, both requiring grad; every time is forward + backward of the loss):
    grpo     GRPO policy loss (TRL's vectorised selective_log_softmax): logits = hidden @ W.T, / 0.7, per-token
             log-probs torch.gather(logits.log_softmax(-1), -1, ids[..., None]).squeeze(-1), ratio against
             detached old log-probs, clipped surrogate with per-row advantages, mean over the completion mask.
             B=8, T=1024, D=2048, V=151936 (Qwen2.5 vocabulary). A second variant adds TRL's entropy bonus:
             entropy_from_logits (the entropy of 128-row chunks of logits.reshape(-1, V), concatenated) of the same
             logits, -0.01 * entropy per token in the loss.
    ls_sft   F.cross_entropy(F.linear(h, W).float(), labels, ignore_index=-100, label_smoothing=0.1), N=8192,
             Gemma-2-2B head (D 2304, V 256000) and Llama-3-8B head (D 4096, V 128256); 50% of the labels -100
             (the first half of each 2048-token sequence: a masked prompt) and 0% ignored.
    chunked  torchtune's chunked output: F.linear on hidden.chunk(8, dim=1), CEWithChunkedOutputLoss (labels chunked
             alike, .float(), reduction sum, / non-ignored tokens). B=4, T=2048, D=2048, V=128256, the first 512
             tokens of each sequence ignored. Methods: eager / compile / ours on the chunked code, and ours on the
             equivalent unchunked code (one linear, one cross_entropy); target: ours chunked <= 1.05x unchunked.
    zloss    OLMo-style z-loss: CE + 1e-4 * logsumexp(logits, -1).pow(2).mean(), Llama-3 head, N=8192.
    hf       (needs transformers) LlamaForCausalLM, hidden 1024, 2 layers, vocab 128256, batch 2 x seq 2048, bf16,
             forward + backward of model(input_ids, labels=labels).loss (no optimizer step): eager, compile,
             ours = make_backend(drop_logits=True).

Methods: eager (the function as written), compile (torch.compile(fn, dynamic=False): Inductor, the pass disabled),
ours (torch.compile(fn, dynamic=False, backend=cce_inductor.make_backend())). Each compiled function is compiled
once per shape and reused for every iteration and variant. Inductor's FX-graph and AOTAutograd caches are turned
off so that every run goes through the pass and stats() shows its decisions.

Per method: median step time over --iters CUDA-event timings after --warmup steps (the first warm-up step
compiles; its wall time is "first_call_s"); peak memory = torch.cuda.max_memory_allocated() during one step minus
the memory allocated before it (inputs and reference excluded; the gradients included); loss error = |loss -
ref| / |ref| and gradient error = max over the leaves of ||g - g_ref|| / ||g_ref||, against the same function in
eager fp32 (fp32 copies of the inputs, true fp32 matmuls). After each method: cce_inductor.stats() (sites rewritten,
its summary) and the fused op's calls per step (stats()["executions"]); an "ours" run whose sites were not all
rewritten, or that did not call the fused op once per step, is marked "!! NOT REWRITTEN" (a baseline that called
the op is marked "!! PASS ACTIVE"). Every ratio compares methods timed in this process.

Output: per-method lines as the run goes, the JSON (--out, rewritten after each case), and last a table.
--tiny: CPU shapes, bf16, 1 warm-up + 1 timed step, no memory figures: exercises every code path and check.
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import json
import math
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

import cce_inductor

IGNORE = -100
TEMPERATURE = 0.7
CLIP_EPS = 0.2
LABEL_SMOOTHING = 0.1
Z_WEIGHT = 1e-4
N_CHUNKS = 8
CASES = ("grpo", "ls_sft", "chunked", "zloss", "hf")

FULL = dict(
    grpo=dict(B=8, T=1024, D=2048, V=151936),
    ls_sft=dict(N=8192, seq=2048, heads={"gemma2": (2304, 256000), "llama3": (4096, 128256)}),
    chunked=dict(B=4, T=2048, D=2048, V=128256, prompt=512),
    zloss=dict(N=8192, D=4096, V=128256),
    hf=dict(
        hidden=1024, layers=2, heads=16, kv_heads=8, intermediate=4096, vocab=128256, batch=2, seq=2048, prompt=256
    ),
)
TINY = dict(
    grpo=dict(B=2, T=16, D=32, V=512),
    ls_sft=dict(N=64, seq=16, heads={"gemma2": (48, 1000), "llama3": (64, 512)}),
    chunked=dict(B=2, T=32, D=32, V=512, prompt=8),
    zloss=dict(N=64, D=64, V=512),
    hf=dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512, batch=2, seq=32, prompt=8),
)


# ------------------------------------------------------------------------------------------------------------------
# the loss functions, written as the trainers write them
# ------------------------------------------------------------------------------------------------------------------
def grpo_loss(hidden, weight, ids, old_logps, advantages, mask):
    """TRL's GRPO: temperature-scaled logits, selective log-softmax (vectorised), clipped surrogate, masked mean."""
    logits = hidden @ weight.T
    logits = logits / TEMPERATURE
    logps = torch.gather(logits.log_softmax(-1), dim=-1, index=ids.unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(logps - old_logps.detach())
    clipped = torch.clamp(ratio, 1 - CLIP_EPS, 1 + CLIP_EPS)
    per_token = -torch.min(ratio * advantages[:, None], clipped * advantages[:, None])
    return (per_token * mask).sum() / mask.sum()


def entropy_from_logits(logits, chunk_size=128):
    """TRL's entropy_from_logits: the entropy over row chunks of the flattened logits."""
    original_shape = logits.shape[:-1]
    num_classes = logits.shape[-1]
    flat_logits = logits.reshape(-1, num_classes)
    entropies = []
    for chunk in flat_logits.split(chunk_size, dim=0):
        logps = F.log_softmax(chunk, dim=-1)
        chunk_entropy = -(torch.exp(logps) * logps).sum(-1)
        entropies.append(chunk_entropy)
    return torch.cat(entropies, dim=0).reshape(original_shape)


def grpo_entropy_loss(hidden, weight, ids, old_logps, advantages, mask):
    """GRPO as above with TRL's entropy of the same logits as a bonus."""
    logits = hidden @ weight.T
    logits = logits / TEMPERATURE
    logps = torch.gather(logits.log_softmax(-1), dim=-1, index=ids.unsqueeze(-1)).squeeze(-1)
    entropies = entropy_from_logits(logits)
    ratio = torch.exp(logps - old_logps.detach())
    clipped = torch.clamp(ratio, 1 - CLIP_EPS, 1 + CLIP_EPS)
    per_token = -torch.min(ratio * advantages[:, None], clipped * advantages[:, None]) - 0.01 * entropies
    return (per_token * mask).sum() / mask.sum()


def ls_sft_loss(hidden, weight, labels):
    logits = F.linear(hidden, weight)
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE, label_smoothing=LABEL_SMOOTHING)


def ce_with_chunked_output(logits, labels, ignore_index=IGNORE):
    """torchtune's CEWithChunkedOutputLoss.forward: a list of chunk logits, labels chunked the same way."""
    total_elements = (labels != ignore_index).sum()
    labels = [target_chunk.reshape(-1) for target_chunk in labels.chunk(len(logits), dim=1)]
    logits = [logit_chunk.reshape(-1, logit_chunk.size(-1)) for logit_chunk in logits]
    total_loss = 0.0
    for logits_chunk, labels_chunk in zip(logits, labels):
        total_loss += F.cross_entropy(logits_chunk.float(), labels_chunk, ignore_index=ignore_index, reduction="sum")
    return total_loss / total_elements


def chunked_loss(hidden, weight, labels):
    """torchtune's TransformerDecoder with num_output_chunks: the output projection per chunk of the sequence."""
    logits = [F.linear(chunk, weight) for chunk in hidden.chunk(N_CHUNKS, dim=1)]
    return ce_with_chunked_output(logits, labels)


def unchunked_loss(hidden, weight, labels):
    """The same loss without chunks: one linear, one cross_entropy over all rows."""
    logits = F.linear(hidden, weight)
    total = F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1), ignore_index=IGNORE, reduction="sum"
    )
    return total / (labels != IGNORE).sum()


def zloss_loss(hidden, weight, labels):
    """OLMo's z-loss next to the cross-entropy."""
    logits = F.linear(hidden, weight).float()
    ce = F.cross_entropy(logits, labels, ignore_index=IGNORE)
    z_squared = torch.logsumexp(logits, dim=-1).pow(2)
    return ce + Z_WEIGHT * z_squared.mean()


# ------------------------------------------------------------------------------------------------------------------
# measurement
# ------------------------------------------------------------------------------------------------------------------
class Bench:
    def __init__(self, args):
        self.args = args
        self.cuda = args.device == "cuda"
        self.rows = []
        self.checks = []
        self.case_errors = {}
        self.compile_stats = {}  # id(compiled fn) -> (stats() after its compile, where)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def free(self):
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def compiled(self, fn, method, **backend_options):
        if method == "eager":
            return fn
        if method == "compile":
            return torch.compile(fn, dynamic=False)
        if method == "ours":
            return torch.compile(fn, dynamic=False, backend=cce_inductor.make_backend(**backend_options))
        raise ValueError(method)

    def reference(self, forward, leaves):
        """``(loss, {name: grad})`` of ``forward()`` in eager with true fp32 matmuls; ``leaves`` are fp32."""
        prec = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
        try:
            for leaf in leaves.values():
                leaf.grad = None
            loss = forward()
            loss.backward()
            self.sync()
            return loss.item(), {name: leaf.grad.detach() for name, leaf in leaves.items() if leaf.grad is not None}
        finally:
            torch.set_float32_matmul_precision(prec)

    def measure(self, case, variant, method, forward, leaves, ref, expect=None, key=None):
        """Time ``forward() + backward`` and check accuracy and rewrite; appends a row and returns it. ``key``: the
        compiled function, so that a later call reusing it (no new compile, the pass does not run again) is judged
        by the decisions of its compile."""
        row = dict(case=case, variant=variant, method=method)
        label = f"{case} {variant} {method}"
        print(f"-- {label}", flush=True)
        cce_inductor.reset_stats()

        def step():
            for leaf in leaves.values():
                leaf.grad = None
            loss = forward()
            loss.backward()
            return loss

        steps = 0
        try:
            t0 = time.perf_counter()
            step()
            self.sync()
            row["first_call_s"] = time.perf_counter() - t0
            steps += 1
            for _ in range(self.args.warmup - 1):
                step()
                steps += 1
            times = []
            if self.cuda:
                events = []
                for _ in range(self.args.iters):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    step()
                    end.record()
                    events.append((start, end))
                torch.cuda.synchronize()
                times = [s.elapsed_time(e) for s, e in events]
            else:
                for _ in range(self.args.iters):
                    t1 = time.perf_counter()
                    step()
                    times.append((time.perf_counter() - t1) * 1e3)
            steps += self.args.iters
            row["ms"] = statistics.median(times)
            row["ms_all"] = times
            # one more step for the peak and the values checked against the reference
            for leaf in leaves.values():
                leaf.grad = None
            self.free()
            if self.cuda:
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            loss = step()
            self.sync()
            steps += 1
            row["peak_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20 if self.cuda else None
            row.update(accuracy(loss, leaves, ref))
            del loss
        except Exception as exc:  # noqa: BLE001  (OOM and anything else: reported, the run goes on)
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(f"!! {label} FAILED: {row['error']}", flush=True)
            if not isinstance(exc, torch.OutOfMemoryError):
                traceback.print_exc()
        finally:
            for leaf in leaves.values():
                leaf.grad = None
            self.free()
        st = cce_inductor.stats()
        if key is not None:
            if st["graphs"]:
                # (the key is kept alive with its entry: a freed function's id may be given to a new one)
                self.compile_stats[id(key)] = (st, f"{case} {variant}", key)
            elif id(key) in self.compile_stats:  # reused: the site decisions are those of its compile
                prior, where, _ = self.compile_stats[id(key)]
                st = dict(
                    prior,
                    executions=st["executions"],
                    summary=f"compiled during {where}: {prior['summary']}; reused here, the fused op ran "
                    f"{sum(st['executions'].values())} times in this method's steps",
                )
        row.update(rewrite_report(method, steps, expect, st))
        self.rows.append(row)
        print(
            f"   {_fmt(row.get('ms'))} ms, peak {_fmt(row.get('peak_mb'), 0)} MB, first call "
            f"{_fmt(row.get('first_call_s'), 1)} s, loss err {_fmt_e(row.get('loss_err'))}, grad err "
            f"{_fmt_e(row.get('grad_err'))} ({row.get('grad_err_leaf', '')}); {row['rewrite']}",
            flush=True,
        )
        if method != "eager":
            print(f"   stats: {row['stats_summary']}", flush=True)
        if row["rewrite"].startswith("!!"):
            print(f"!! {label}: {row['rewrite']} -- this row does not measure the intended configuration", flush=True)
        return row


def accuracy(loss, leaves, ref):
    if ref is None:
        return {}
    ref_loss, ref_grads = ref
    out = dict(loss=loss.item(), ref_loss=ref_loss)
    out["loss_err"] = abs(loss.item() - ref_loss) / max(abs(ref_loss), 1e-30)
    errs = {}
    for name, want in ref_grads.items():
        got = leaves[name].grad
        if got is None:
            errs[name] = float("inf")
            continue
        den = want.norm().item()
        num = (got.float() - want).norm().item()
        errs[name] = num / den if den else num
    out["grad_errs"] = errs
    if errs:
        worst = max(errs, key=errs.get)
        out["grad_err"], out["grad_err_leaf"] = errs[worst], worst
    return out


def rewrite_report(method, steps, expect, st):
    """What the pass did (``st``: stats() of this method's steps); loud when it is not what the case intends."""
    calls = st["executions"].get("linear_cross_entropy", 0) + st["executions"].get("vocab_parallel", 0)
    per_step = calls / steps if steps else 0.0
    rep = dict(
        sites_rewritten=st["rewritten"],
        sites_skipped=st["skipped"],
        graphs=st["graphs"],
        skip_reasons=st["reasons"],
        site_reasons=[s["reason"] for s in st["sites"]],
        executions=st["executions"],
        fused_calls_per_step=per_step,
        stats_summary=st["summary"],
    )
    sites = f"{st['rewritten']}/{st['rewritten'] + st['skipped']} sites rewritten, {per_step:g} fused call(s)/step"
    if method != "ours":
        rep["rewrite"] = "pass off" if calls == 0 and st["rewritten"] == 0 else f"!! PASS ACTIVE ({sites})"
        return rep
    problems = []
    if expect is not None:
        if st["rewritten"] != expect["sites"] or st["skipped"]:
            problems.append(f"expected {expect['sites']} rewritten, 0 skipped")
        if steps and per_step != expect.get("calls_per_step", 1):
            problems.append(f"expected {expect.get('calls_per_step', 1)} fused call(s)/step")
        text = expect.get("reason")
        if text and not any(text in reason for reason in rep["site_reasons"]):
            problems.append(f"no site reason mentions {text!r}")
    rep["rewrite"] = f"!! NOT REWRITTEN as intended: {sites}; {'; '.join(problems)}" if problems else sites
    return rep


def _fmt(x, p=2):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{p}f}"


def _fmt_e(x):
    return "-" if x is None else f"{x:.1e}"


def fp32_leaves(tensors):
    return {name: t.detach().float().requires_grad_(t.requires_grad) for name, t in tensors.items()}


def bf16_param(shape, device, scale=1.0, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(shape, device=device, generator=g) * scale).to(torch.bfloat16).requires_grad_()


# ------------------------------------------------------------------------------------------------------------------
# cases
# ------------------------------------------------------------------------------------------------------------------
def run_loss_methods(bench, case, variant, fn_by_method, inputs, leaf_names, ref, expect, methods=None):
    """Measure each method of ``fn_by_method`` ({method: compiled fn}) on ``inputs`` (a dict, in call order)."""
    leaves = {name: inputs[name] for name in leaf_names}
    args = list(inputs.values())
    for method, fn in fn_by_method.items():
        if methods is not None and method not in methods:
            continue
        bench.measure(case, variant, method, lambda fn=fn: fn(*args), leaves, ref, expect, key=fn)


def make_ref(bench, fn, inputs, leaf_names):
    ref_inputs = {name: (fp32_leaves({name: t})[name] if name in leaf_names else t) for name, t in inputs.items()}
    ref_leaves = {name: ref_inputs[name] for name in leaf_names}
    try:
        ref = bench.reference(functools.partial(fn, *ref_inputs.values()), ref_leaves)
    except torch.OutOfMemoryError:
        print("!! the fp32 reference ran out of memory: no accuracy figures for this case", flush=True)
        ref = None
    del ref_inputs, ref_leaves
    bench.free()
    return ref


def methods_for(bench, fn, **backend_options):
    return {m: bench.compiled(fn, m, **backend_options) for m in bench.args.methods}


def case_grpo(bench, shapes):
    s, dev = shapes["grpo"], bench.args.device
    B, T, D, V = s["B"], s["T"], s["D"], s["V"]
    g = torch.Generator(device=dev).manual_seed(1)
    hidden = bf16_param((B, T, D), dev, seed=2)
    weight = bf16_param((V, D), dev, scale=D**-0.5, seed=3)
    ids = torch.randint(0, V, (B, T), device=dev, generator=g)
    with torch.no_grad():  # old log-probs: this policy's own (fp32, by row blocks) plus noise, so ratios are ~1
        w32 = weight.float()
        lp = torch.cat(
            [
                torch.gather((h.float() @ w32.T / TEMPERATURE).log_softmax(-1), -1, i[:, None])[:, 0]
                for h, i in zip(hidden.detach().reshape(-1, D).split(1024), ids.reshape(-1).split(1024))
            ]
        ).view(B, T)
        old_logps = lp + 0.05 * torch.randn(B, T, device=dev, generator=g)
        del w32, lp
    advantages = torch.randn(B, device=dev, generator=g)
    lengths = torch.randint(T // 4, T + 1, (B,), device=dev, generator=g)
    mask = (torch.arange(T, device=dev)[None, :] < lengths[:, None]).float()
    inputs = dict(hidden=hidden, weight=weight, ids=ids, old_logps=old_logps, advantages=advantages, mask=mask)
    leaf_names = ("hidden", "weight")
    ref = make_ref(bench, grpo_loss, inputs, leaf_names)
    variant = f"B{B} T{T} D{D} V{V}"
    run_loss_methods(
        bench,
        "grpo",
        variant,
        methods_for(bench, grpo_loss),
        inputs,
        leaf_names,
        ref,
        dict(sites=1, reason="token log-probs"),
    )
    bench.free()
    ref = make_ref(bench, grpo_entropy_loss, inputs, leaf_names)
    run_loss_methods(
        bench,
        "grpo",
        variant + " +entropy",
        methods_for(bench, grpo_entropy_loss),
        inputs,
        leaf_names,
        ref,
        dict(sites=1, reason="entropy and token log-probs"),
    )


def case_ls_sft(bench, shapes):
    s, dev = shapes["ls_sft"], bench.args.device
    N, seq = s["N"], s["seq"]
    for head, (D, V) in s["heads"].items():
        g = torch.Generator(device=dev).manual_seed(1)
        hidden = bf16_param((N, D), dev, seed=2)
        weight = bf16_param((V, D), dev, scale=D**-0.5, seed=3)
        labels0 = torch.randint(0, V, (N,), device=dev, generator=g)
        prompt = (torch.arange(N, device=dev) % seq) < seq // 2  # the first half of every sequence: a prompt
        labels50 = torch.where(prompt, torch.full_like(labels0, IGNORE), labels0)
        fns = methods_for(bench, ls_sft_loss)  # compiled once per head, reused for both label variants
        for tag, labels in (("ign50", labels50), ("ign0", labels0)):
            inputs = dict(hidden=hidden, weight=weight, labels=labels)
            ref = make_ref(bench, ls_sft_loss, inputs, ("hidden", "weight"))
            run_loss_methods(
                bench,
                "ls_sft",
                f"{head} D{D} V{V} N{N} {tag}",
                fns,
                inputs,
                ("hidden", "weight"),
                ref,
                dict(sites=1, reason=f"label_smoothing={LABEL_SMOOTHING}"),
            )
            del ref
            bench.free()
        del fns, hidden, weight
        torch._dynamo.reset()
        bench.free()


def case_chunked(bench, shapes):
    s, dev = shapes["chunked"], bench.args.device
    B, T, D, V = s["B"], s["T"], s["D"], s["V"]
    g = torch.Generator(device=dev).manual_seed(1)
    hidden = bf16_param((B, T, D), dev, seed=2)
    weight = bf16_param((V, D), dev, scale=D**-0.5, seed=3)
    labels = torch.randint(0, V, (B, T), device=dev, generator=g)
    labels[:, : s["prompt"]] = IGNORE
    inputs = dict(hidden=hidden, weight=weight, labels=labels)
    leaf_names = ("hidden", "weight")
    ref = make_ref(bench, chunked_loss, inputs, leaf_names)
    variant = f"B{B} T{T} D{D} V{V} {N_CHUNKS} chunks"
    run_loss_methods(
        bench,
        "chunked",
        variant,
        methods_for(bench, chunked_loss),
        inputs,
        leaf_names,
        ref,
        dict(sites=N_CHUNKS, reason=f"one call with {N_CHUNKS - 1} other chunk(s)", calls_per_step=1),
    )
    run_loss_methods(
        bench,
        "chunked",
        variant.replace(f"{N_CHUNKS} chunks", "unchunked"),
        {"ours": bench.compiled(unchunked_loss, "ours")},
        inputs,
        leaf_names,
        ref,
        dict(sites=1),
    )
    by = {(r["variant"].endswith("unchunked"), r["method"]): r for r in bench.rows if r["case"] == "chunked"}
    ours_c, ours_u, comp_c = by.get((False, "ours")), by.get((True, "ours")), by.get((False, "compile"))
    check = dict(check="chunked ours / unchunked ours (target <= 1.05)")
    if ours_c and ours_u and ours_c.get("ms") and ours_u.get("ms"):
        check["time_ratio"] = ours_c["ms"] / ours_u["ms"]
        check["met"] = check["time_ratio"] <= 1.05
        if ours_c.get("peak_mb") and ours_u.get("peak_mb"):
            check["peak_ratio"] = ours_c["peak_mb"] / ours_u["peak_mb"]
    if comp_c and ours_c and comp_c.get("ms") and ours_c.get("ms"):
        check["ours_chunked_vs_compile_chunked"] = ours_c["ms"] / comp_c["ms"]
    bench.checks.append(check)


def case_zloss(bench, shapes):
    s, dev = shapes["zloss"], bench.args.device
    N, D, V = s["N"], s["D"], s["V"]
    g = torch.Generator(device=dev).manual_seed(1)
    hidden = bf16_param((N, D), dev, seed=2)
    weight = bf16_param((V, D), dev, scale=D**-0.5, seed=3)
    labels = torch.randint(0, V, (N,), device=dev, generator=g)
    inputs = dict(hidden=hidden, weight=weight, labels=labels)
    leaf_names = ("hidden", "weight")
    ref = make_ref(bench, zloss_loss, inputs, leaf_names)
    run_loss_methods(
        bench,
        "zloss",
        f"llama3 D{D} V{V} N{N}",
        methods_for(bench, zloss_loss),
        inputs,
        leaf_names,
        ref,
        dict(sites=1, reason="log-sum-exp reused"),
    )


def hf_loss(model, input_ids, labels):
    return model(input_ids=input_ids, labels=labels).loss


def case_hf(bench, shapes):
    try:
        import transformers
    except ImportError:
        print("hf: skipped: transformers not installed", flush=True)
        bench.rows.append(
            dict(
                case="hf",
                variant="-",
                method="-",
                skipped="transformers not installed",
                rewrite="skipped: transformers not installed",
            )
        )
        return
    s, dev = shapes["hf"], bench.args.device
    config = transformers.LlamaConfig(
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        max_position_embeddings=s["seq"],
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    with torch.device(dev):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    g = torch.Generator(device=dev).manual_seed(1)
    input_ids = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), device=dev, generator=g)
    labels = input_ids.clone()
    labels[:, : s["prompt"]] = IGNORE

    ref_model = copy.deepcopy(model).float()  # the bf16 model's weights, in fp32
    ref_leaves = dict(ref_model.named_parameters())
    ref = bench.reference(functools.partial(hf_loss, ref_model, input_ids, labels), ref_leaves)
    del ref_model, ref_leaves
    bench.free()

    leaves = dict(model.named_parameters())
    variant = f"Llama h{s['hidden']} L{s['layers']} V{s['vocab']} {s['batch']}x{s['seq']}"
    for method in bench.args.methods:
        fn = bench.compiled(model, method, drop_logits=True)
        bench.measure(
            "hf", variant, method, functools.partial(hf_loss, fn, input_ids, labels), leaves, ref, dict(sites=1), key=fn
        )
        del fn
        bench.free()


CASE_FNS = dict(grpo=case_grpo, ls_sft=case_ls_sft, chunked=case_chunked, zloss=case_zloss, hf=case_hf)


# ------------------------------------------------------------------------------------------------------------------
# output
# ------------------------------------------------------------------------------------------------------------------
def add_ratios(rows):
    """x compile: this method's time and peak over the compile row of the same case and variant."""
    comp = {(r["case"], r["variant"]): r for r in rows if r.get("method") == "compile"}
    for r in rows:
        c = comp.get((r["case"], r["variant"]))
        if r["case"] == "chunked" and r["variant"].endswith("unchunked"):  # against compile of the chunked code
            c = next((x for x in rows if x["case"] == "chunked" and x.get("method") == "compile"), None)
        if c and c.get("ms") and r.get("ms"):
            r["time_vs_compile"] = r["ms"] / c["ms"]
        if c and c.get("peak_mb") and r.get("peak_mb"):
            r["peak_vs_compile"] = r["peak_mb"] / c["peak_mb"]


def print_table(rows, checks):
    print()
    print(
        "| case | variant | method | ms | peak MB | time x compile | peak x compile | loss err | grad err | rewrite |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        status = r.get("error") and f"FAILED {r['error'][:80]}" or r.get("rewrite", "")
        if r.get("error") and r.get("rewrite", "").startswith("!!"):
            status += f"; {r['rewrite']}"
        print(
            f"| {r['case']} | {r['variant']} | {r['method']} | {_fmt(r.get('ms'))} | {_fmt(r.get('peak_mb'), 0)} | "
            f"{_fmt(r.get('time_vs_compile'))} | {_fmt(r.get('peak_vs_compile'))} | {_fmt_e(r.get('loss_err'))} | "
            f"{_fmt_e(r.get('grad_err'))} | {status} |"
        )
    for c in checks:
        if "time_ratio" in c:
            print(
                f"{c['check']}: time {c['time_ratio']:.3f}x ({'met' if c['met'] else 'NOT MET'}), peak "
                f"{_fmt(c.get('peak_ratio'), 3)}x; ours chunked / compile chunked: "
                f"{_fmt(c.get('ours_chunked_vs_compile_chunked'), 3)}x"
            )
        else:
            print(f"{c['check']}: not measured (a method failed)")
    bad = [r for r in rows if r.get("rewrite", "").startswith("!!") or r.get("error")]
    print(f"{len(rows)} rows, {len(bad)} failed or not rewritten as intended" + (" !!" if bad else ""))


def header(args):
    h = dict(
        script="benchmarks/bench_loss_forms.py",
        torch=torch.__version__,
        cce_inductor=cce_inductor.__version__,
        python=sys.version.split()[0],
        device=args.device,
        time=time.strftime("%Y-%m-%d %H:%M:%S"),
        settings={k: v for k, v in vars(args).items()},
    )
    if args.device == "cuda":
        from cce_inductor import _dispatch

        h["gpu"] = torch.cuda.get_device_name()
        kernels = _dispatch.triton_kernels()
        h["op_path"] = "triton kernels" if kernels is not None else "!! chunked PyTorch (Triton unavailable)"
        try:
            import triton

            h["triton"] = triton.__version__
        except ImportError:
            h["triton"] = None
    else:
        h["op_path"] = "chunked PyTorch (CPU)"
    return h


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated of {', '.join(CASES)}")
    ap.add_argument("--methods", default="eager,compile,ours", help="comma-separated of eager, compile, ours")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny shapes, 1 warm-up + 1 timed step")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps, the first one compiles (default 3)")
    ap.add_argument("--iters", type=int, default=None, help="timed steps, median reported (default 10)")
    ap.add_argument("--out", default="", help="write the JSON here (rewritten after every case)")
    args = ap.parse_args(argv)
    args.cases = [c for c in args.cases.split(",") if c]
    args.methods = [m for m in args.methods.split(",") if m]
    for c in args.cases:
        if c not in CASES:
            ap.error(f"unknown case {c!r}; cases: {', '.join(CASES)}")
    for m in args.methods:
        if m not in ("eager", "compile", "ours"):
            ap.error(f"unknown method {m!r}; methods: eager, compile, ours")
    args.warmup = max(1, args.warmup if args.warmup is not None else (1 if args.tiny else 3))
    args.iters = max(1, args.iters if args.iters is not None else (1 if args.tiny else 10))
    args.device = "cpu" if args.tiny else "cuda"
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --tiny for a CPU smoke run")
    cce_inductor.disable()  # plain torch.compile must be plain Inductor (CCE_INDUCTOR=1 would have enabled it)
    assert not cce_inductor.is_enabled()
    # every compile goes through the pass (a cache hit would skip it, and stats() would not show the rewrite)
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    dyn = torch._dynamo.config
    if hasattr(dyn, "recompile_limit"):
        dyn.recompile_limit = max(dyn.recompile_limit, 64)
    else:
        dyn.cache_size_limit = max(dyn.cache_size_limit, 64)
    shapes = TINY if args.tiny else FULL
    head = header(args)
    print("# " + ", ".join(f"{k} {v}" for k, v in head.items() if k != "settings"), flush=True)
    bench = Bench(args)
    t_start = time.perf_counter()
    case_times = {}

    def write():
        add_ratios(bench.rows)
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(
                    dict(
                        head,
                        case_seconds=case_times,
                        case_errors=bench.case_errors,
                        checks=bench.checks,
                        rows=bench.rows,
                    ),
                    fh,
                    indent=1,
                    default=str,
                )

    for case in args.cases:
        t0 = time.perf_counter()
        print(f"## {case}", flush=True)
        try:
            CASE_FNS[case](bench, shapes)
        except Exception as exc:  # noqa: BLE001  (a failed case is reported; the next one runs)
            bench.case_errors[case] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(f"!! case {case} FAILED: {bench.case_errors[case]}", flush=True)
            traceback.print_exc()
            bench.rows.append(dict(case=case, variant="-", method="-", error=bench.case_errors[case], rewrite=""))
        torch._dynamo.reset()
        bench.compile_stats.clear()
        bench.free()
        case_times[case] = time.perf_counter() - t0
        print(f"## {case} done in {case_times[case]:.1f} s (total {time.perf_counter() - t_start:.1f} s)", flush=True)
        write()
    write()
    print_table(bench.rows, bench.checks)


if __name__ == "__main__":
    main()
