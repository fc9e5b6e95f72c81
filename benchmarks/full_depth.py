"""Whole training steps of full-depth Hugging Face models: plain torch.compile vs cce_inductor's backend.

The models are built from config in code (the published hyper-parameters, no weights, nothing downloaded), fp32
master parameters, the forward under torch.autocast(bfloat16) (``--weights bf16``: bf16 parameters, no autocast),
AdamW (fused on CUDA), sequences of 2048 random
tokens, labels = input_ids (the model shifts them), ``model(input_ids=x, labels=x).loss.backward()``.

Reproduce: one worker process per (model, method), run in turn by the driver; every row is appended to --out as it
finishes. Each command below is meant for one 10-minute device call (--budget-s 500: no worker, and no batch, is
started that would end past it); re-run the SAME command with --resume until its output has no "not done" line
(the batches --out holds are skipped; a setting that hit OOM is finished):

    python benchmarks/full_depth.py --models gpt2-medium --ckpt off --resume       # then --ckpt on, and so on for
    python benchmarks/full_depth.py --models gemma2-2b --ckpt on --resume          # qwen25-0.5b, llama32-1b
    python benchmarks/full_depth.py --models llama32-1b --methods lean,balanced --resume   # the paths forced
    python benchmarks/full_depth.py --models gemma2-2b --batch-shapes static --batches 1,2 --resume
    python benchmarks/full_depth.py --models gpt2-medium --methods compile,default --batch-shapes static \
        --batches 1 --rounds 3 --kernels 12                   # host-bound cells: the methods' workers alternate;
                                                              # the table of host / kernel time after the main one
    python benchmarks/full_depth.py --report                  # the table of everything in --out, nothing run
    python benchmarks/full_depth.py --tiny                    # CPU run of the harness (~15-20 min on 2 busy cores;
                                                              # --tiny --models gemma2-2b --ckpt off: ~2 min)

Defaults: --methods compile,default (also lean, balanced, balanced_mb<k>: METHODS of _harness.py, each with
drop_logits=True) --ckpt off,on --max-batch 256 --steps 5 --min-timed-s 2 --seq 2048 --batch-shapes dynamic
--rounds 1; --out $OUT/full_depth.jsonl ($OUT unset: ./full_depth.jsonl); --budget-s 500 (no worker, and no
batch, is started that would end past it).

Methods: compile = torch.compile(model); liger = the same over the model with Liger-Kernel's fused linear
cross-entropy alone (``apply_liger_kernel_to_<family>``, every other kernel off; CUDA; no GPT-2 patch);
liger-eager = Liger's patch without torch.compile; liger-break = Liger's patch under torch.compile with its loss
kept out of the graph (``torch.compiler.disable``: a graph break, the rest compiled) -- both for where its kernels
fail inside Inductor's graph (an illegal memory access, Liger-Kernel issue 916);
default = torch.compile(model, backend=cce_inductor.make_backend(drop_logits=True)) (HF models return their
logits: the pass needs that opt-in); lean / balanced add METHODS' keywords. A cce method whose loss site stats()
does not report rewritten is an error ("NOT REWRITTEN").
Per model x method x activation checkpointing (off; on = model.activation_checkpointing_enable(), called
gradient_checkpointing_enable before transformers 5.2x; non-reentrant),
the batch grows 1, 2, 4, ... sequences until torch.OutOfMemoryError (caught; memory freed) or --max-batch.
--batch-shapes dynamic: one torch.compile(model) per checkpointing setting, called at every batch (batch 1 compiles,
batch 2 is Dynamo's automatic-dynamic recompile, later batches reuse it), as a trainer whose batch changes.
--batch-shapes static: torch._dynamo.reset() and torch.compile(model, dynamic=False) at every batch: a trainer
with that fixed batch; every first step is a cold compile (slower to run: split with --batches).
Inductor's on-disk caches are off (force_disable_caches), so a first step always includes its compile.
--rounds R: every (model, method) worker R times, the methods alternating (compile, default, compile, default, ...
for R = 2): a step that waits on the host (batch 1 of the small models) drifts by 10-30% within one process and
between processes on the same machine (engineering log v26), so one process per method cannot resolve a few
percent; rows carry their round, and the table pools the rounds (the median of every timed step of every round,
each round's median beside it).

Columns (JSON lines; the first line of each run is a header: device, versions, date, command line):
    model, method, ckpt (off / on), batch, seq, tokens (batch * seq), round (1 .. --rounds), weights
                  (fp32-autocast / bf16: the rows of one --weights are reported apart from the other's)
    first_step_s  the first step at this batch, wall clock, synchronised (its compile or recompile included)
    step_ms       median over the further steps (forward, backward, optimizer step, zero_grad), synchronised: at
                  least --steps of them and as many more as --min-timed-s seconds take, up to 100
                  (step_ms_all: each of them, in order)
    host_ms       median over the same steps of the host's own time: the step call returning, before the
                  synchronisation (nothing in the step waits for the GPU); near step_ms: the step waits on the host
                  (host_ms_all: each);  kernels, kernel_ms  with --kernels K: one more step under torch.profiler,
                  its K costliest kernels [name, calls, ms] (the rest as "other") and their sum: the GPU's busy time
    tokens_s      tokens / step_ms;  peak_gb  torch.cuda.max_memory_allocated() over those steps (parameters,
                  gradients, optimizer state, activations: everything), after reset_peak_memory_stats()
    pick, pick_reason  the path stats() reports for the loss site (cce methods);  loss  the last step's loss
    oom / error   the batch did not fit (the growth stops there) / what else failed
    compile_mode  --compile-mode ("reduce-overhead": CUDA graphs, each step marked as a new replay);
    memory_fraction  --memory-fraction (the allocator's cap, a smaller GPU);  lean_after_oom  (cce methods) the
                  op's calls whose balanced buffers did not fit and that ran the lean path (stats()'s count)
    memory_at_first_peak, memory_at_peak / memory_at_oom  with --memory-history: the largest groups of blocks
                  alive where the first step / the timed steps allocated the most / when an allocation failed, each
                  [count, MiB each, MiB, where] (``_harness.MemoryHistory``)
--seqs S1,S2,...: the sequence grows instead, at batch 1 (the longest sequence that fits; one compile and one
recompile per setting under dynamic shapes, where one invocation per --seq would compile at each).
Final table, per model and method: the largest batch (of the powers of two tried) that fit without / with
checkpointing ("≥B (cap)": --max-batch fit; "≥B (not done)": not grown to OOM yet; "OOM" / "error": not even the
first); step ms at each batch that both this method and compile fit (same checkpointing), with its ratio to
compile's step ms at that batch; the best tokens/s over every setting that fit, with its ratio to compile's
best; the first step at the smallest batch without checkpointing, with its ratio to compile's.

--tiny: CPU, tiny configs (2 layers, hidden 64, vocab 1001), seq 64, batches 1-2, one timed step.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as H

# The published configs (config.json of each model on the Hugging Face Hub; transformers' config classes).
MODELS = {
    # openai-community/gpt2-medium: n_embd 1024, n_layer 24, n_head 16, vocab 50257, tied head. Its n_positions is
    # 1024; 2048 here so that sequences of 2048 fit (one more row block of the position table, nothing else).
    "gpt2-medium": ("gpt2", dict(n_embd=1024, n_layer=24, n_head=16, vocab_size=50257, n_positions=2048), "sdpa"),
    # Qwen/Qwen2.5-0.5B config.json
    "qwen25-0.5b": (
        "qwen2",
        dict(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            use_sliding_window=False,
            tie_word_embeddings=True,
        ),
        "sdpa",
    ),
    # meta-llama/Llama-3.2-1B config.json
    "llama32-1b": (
        "llama",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=128256,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            rope_scaling=dict(
                rope_type="llama3",
                factor=32.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
            tie_word_embeddings=True,
        ),
        "sdpa",
    ),
    # google/gemma-2-2b config.json (also transformers' Gemma2Config defaults). Attention softcapping runs only in
    # transformers' eager attention, as Gemma-2 trainers are told to use.
    "gemma2-2b": (
        "gemma2",
        dict(
            hidden_size=2304,
            intermediate_size=9216,
            num_hidden_layers=26,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            vocab_size=256000,
            max_position_embeddings=8192,
            final_logit_softcapping=30.0,
            attn_logit_softcapping=50.0,
            query_pre_attn_scalar=256,
            sliding_window=4096,
            hidden_activation="gelu_pytorch_tanh",
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
        "eager",
    ),
}
# meta-llama/Llama-3.2-3B config.json (issue 64's model of 3B or more): Llama-3.2-1B's but for its sizes
MODELS["llama32-3b"] = (
    "llama",
    dict(
        MODELS["llama32-1b"][1],
        hidden_size=3072,
        num_hidden_layers=28,
        num_attention_heads=24,
        head_dim=128,
    ),
    "sdpa",
)
TINY = dict(
    gpt2=dict(n_embd=64, n_layer=2, n_head=4, vocab_size=1001, n_positions=64),
    other=dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=1001,
        max_position_embeddings=64,
    ),
)


# methods without the pass: stock torch.compile, and Liger-Kernel's fused linear cross-entropy under it (CUDA only)
PLAIN_METHODS = ("compile", "liger", "liger-eager", "liger-break")

COLUMNS = (
    "model",
    "method",
    "ckpt",
    "batch",
    "seq",
    "tokens",
    "round",
    "weights",
    "first_step_s",
    "step_ms",
    "tokens_s",
    "peak_gb",
    "pick",
    "pick_reason",
    "loss",
    "oom",
    "error",
    "compile_mode",
    "memory_fraction",
    "lean_after_oom",
)


def build_model(name, args):
    import transformers

    family, kw, attn = MODELS[name]
    kw = dict(kw)
    if args.tiny:
        kw.update(TINY["gpt2" if family == "gpt2" else "other"], bos_token_id=None, eos_token_id=None)
        if "query_pre_attn_scalar" in kw:
            kw["query_pre_attn_scalar"] = 16
        if "rope_scaling" in kw:
            kw["rope_scaling"] = dict(kw["rope_scaling"], original_max_position_embeddings=32)
    config = transformers.AutoConfig.for_model(family, **kw)
    config.use_cache = False
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=args.attn or attn)
    if args.weights == "bf16":
        model = model.to(torch.bfloat16)
    if args.method.startswith("liger"):
        apply_liger(model, family, outside_graph=args.method == "liger-break")
    return model.train()


# Liger-Kernel's patch of each family's model (its fused linear cross-entropy in the causal-LM forward)
LIGER_PATCH = {
    "llama": "apply_liger_kernel_to_llama",
    "qwen2": "apply_liger_kernel_to_qwen2",
    "gemma2": "apply_liger_kernel_to_gemma2",
}


def apply_liger(model, family, outside_graph=False):
    """Liger-Kernel's fused linear cross-entropy alone: its ``apply_liger_kernel_to_<family>`` with every other
    kernel off (each patch names its own: rope, rms_norm, swiglu / geglu, cross_entropy, ...). It replaces the
    causal-LM class's forward, which then returns no logits where labels are given (the peer of ``drop_logits``).
    ``outside_graph``: the patched forward's loss (``LigerForCausalLMLoss``, looked up in its module at each call)
    runs under ``torch.compiler.disable``, so Dynamo breaks the graph there and Liger's kernels run as in eager."""
    import importlib
    import inspect

    import liger_kernel.transformers as liger

    if family not in LIGER_PATCH:
        raise ValueError(f"Liger-Kernel has no patch for {family} models")
    patch = getattr(liger, LIGER_PATCH[family])
    params = inspect.signature(patch).parameters
    off = {k: False for k, p in params.items() if isinstance(p.default, bool) and k != "fused_linear_cross_entropy"}
    patch(**off, fused_linear_cross_entropy=True, model=model)
    if outside_graph:
        forward_module = importlib.import_module(f"liger_kernel.transformers.model.{family}")
        forward_module.LigerForCausalLMLoss = torch.compiler.disable(forward_module.LigerForCausalLMLoss)


def compile_model(model, method, backends, static, mode=None):
    dynamic = False if static else None
    if method == "liger-eager":
        return model
    if method in PLAIN_METHODS:  # Liger's patch is on the model (build_model): its compile is stock torch.compile
        return torch.compile(model, dynamic=dynamic, mode=mode)
    import cce_inductor

    return torch.compile(
        model, dynamic=dynamic, mode=mode, backend=cce_inductor.make_backend(drop_logits=True, **backends[method])
    )


def enable_checkpointing(model):
    """Non-reentrant activation checkpointing (transformers >= 5.x names it activation_checkpointing_enable; the
    old name warns)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def training_step(compiled, opt, tokens, device, autocast=True, cuda_graphs=False):
    """One whole step as a trainer runs it: the forward (under bf16 autocast for fp32 parameters), backward, AdamW,
    zero_grad; returns the loss (detached).  ``cuda_graphs`` (``mode="reduce-overhead"``): each step begins a new
    replay of the recorded graphs, as a training loop tells Inductor's CUDA graph trees; the loss returned is a
    copy, since the next replay overwrites the graph's own output."""

    def step():
        if cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            loss = compiled(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach().clone() if cuda_graphs else loss.detach()

    return step


# ------------------------------------------------------------------------------------------------------------
# worker: one (model, method)
# ------------------------------------------------------------------------------------------------------------
def unit_key(r):
    """(model, method, ckpt, batch, seq, round): the first five are the setting a row measured (cell_key)."""
    return (r["model"], r["method"], r["ckpt"], r["batch"], r.get("seq"), r.get("round") or 1)


def cell_key(r):
    return unit_key(r)[:5]


def pool_rounds(rows):
    """One row per (model, method, ckpt, batch) from its rounds' rows (those that timed steps): step_ms the median
    of every timed step of every round (of each round's step_ms where it lacks step_ms_all), round_ms each round's
    median, peak_gb the highest, first_step_s and pick the first round's."""
    groups = {}
    for r in sorted(rows, key=lambda r: r.get("round") or 1):
        groups.setdefault(cell_key(r), []).append(r)
    pooled = []
    for group in groups.values():
        steps = [t for r in group for t in (r.get("step_ms_all") or [r["step_ms"]])]
        host = [t for r in group for t in (r.get("host_ms_all") or [])]
        row = dict(
            group[0],
            step_ms=statistics.median(steps),
            round_ms=[r["step_ms"] for r in group],
            host_ms=statistics.median(host) if host else None,
            peak_gb=max((r["peak_gb"] for r in group if r.get("peak_gb") is not None), default=None),
        )
        row["tokens_s"] = row["tokens"] / (row["step_ms"] / 1e3)
        pooled.append(row)
    return pooled


def worker(args):
    import cce_inductor

    H.setup_compile()
    backends = H.resolve_methods(args.methods, quiet=True)
    dev, cuda, is_cce = args.device, args.device == "cuda", args.method in backends
    if cuda and args.memory_fraction:
        torch.cuda.set_per_process_memory_fraction(args.memory_fraction)
    done = {}
    if args.resume:
        for r in H.read_rows(args.out):
            if (
                r.get("kind") == "row"
                and r.get("model") == args.model
                and r.get("method") == args.method
                and (r.get("round") or 1) == args.round
                and r.get("weights", "fp32-autocast") == args.weights
                and (r.get("batch"), r.get("seq")) in args.sizes  # (a growth over other sizes is another run's)
            ):
                done[unit_key(r)] = r
    slowest, bad = 0.0, 0
    for ckpt in args.ckpt:
        stopped = [r for k, r in done.items() if k[2] == ckpt and (r.get("oom") or r.get("error"))]
        todo = [(b, s) for b, s in args.sizes if (args.model, args.method, ckpt, b, s, args.round) not in done]
        if stopped or not todo:
            continue
        try:
            model = build_model(args.model, args)
        except Exception as exc:  # noqa: BLE001
            row = dict(
                dict.fromkeys(COLUMNS),
                kind="row",
                model=args.model,
                method=args.method,
                ckpt=ckpt,
                batch=args.sizes[0][0],
                seq=args.sizes[0][1],
                round=args.round,
                error=f"building the model: {H.err_text(exc)}",
            )
            H.append_row(args.out, row)
            print_row(row)
            H.free(dev)
            continue
        if ckpt == "on":
            enable_checkpointing(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)
        vocab = model.config.vocab_size
        gen = torch.Generator(device=dev).manual_seed(args.seed)
        torch._dynamo.reset()
        compiled = None if args.static else compile_model(model, args.method, backends, False, args.compile_mode)
        pick, last, ran = None, 0.0, 0
        for b, seq in todo:
            # the next size's cost: a compile (static shapes; dynamic: the first size, then the recompile of the
            # second) is the slowest seen so far; later dynamic sizes reuse the graph and cost about the last
            # one's timed steps
            expect = slowest if args.static or ran < 2 else last
            if H.past_deadline(args.deadline, 1.5 * expect):
                print(
                    f"# {args.model} {args.method}: deadline: stopping before ckpt={ckpt} batch={b} seq={seq}",
                    flush=True,
                )
                return 0
            row = dict(
                dict.fromkeys(COLUMNS),
                kind="row",
                model=args.model,
                method=args.method,
                ckpt=ckpt,
                batch=b,
                seq=seq,
                tokens=b * seq,
                round=args.round,
                weights=args.weights,
                compile_mode=args.compile_mode,
                memory_fraction=args.memory_fraction,
            )
            began = time.time()
            if args.static:
                torch._dynamo.reset()
                compiled = compile_model(model, args.method, backends, True, args.compile_mode)
            tokens = torch.randint(0, vocab, (b, seq), device=dev, generator=gen)

            step = training_step(
                compiled,
                opt,
                tokens,
                dev,
                autocast=args.weights == "fp32-autocast",
                cuda_graphs=args.compile_mode == "reduce-overhead" and cuda,
            )
            failed, fatal = False, False
            history = H.MemoryHistory(dev).start() if args.memory_history else None
            try:
                cce_inductor.reset_stats()
                first = H.SyncedTimer(dev)
                first.start()
                step()
                row["first_step_s"] = first.stop() / 1e3
                if history:  # the first step apart: its compile and first runs, no optimizer state until its end
                    row["memory_at_first_peak"] = history.at_peak()
                    history.restart()
                st = cce_inductor.stats()
                if st["sites"] or pick is None:  # a (re)compile happened: its site must be as the method says
                    pick = H.checked_pick(st, is_cce)
                if pick:
                    row["pick"], row["pick_reason"] = pick
                losses = []
                with H.Peak(dev) as peak:
                    timer = H.synced_calls(
                        lambda: losses.append(step()), dev, args.steps, warmup=0, min_s=args.min_timed_s
                    )
                row["step_ms"] = timer.median_ms()
                row["step_ms_all"] = [round(t, 2) for t in timer.wall_ms]
                row["host_ms"] = statistics.median(timer.host_ms)  # nothing in the step waits for the device
                row["host_ms_all"] = [round(t, 2) for t in timer.host_ms]
                row["tokens_s"] = b * seq / (row["step_ms"] / 1e3)
                row["peak_gb"] = peak.gb
                row["loss"] = float(losses[-1])
                row["losses"] = [round(float(x), 5) for x in losses]  # step by step: runs of one seed compare
                if is_cce:  # the calls whose balanced buffers did not fit and that ran the lean path instead
                    row["lean_after_oom"] = cce_inductor.stats()["balanced_rows"]["lean_after_oom"]
                if history:  # the timed steps: what is alive where the most is allocated
                    row["memory_at_peak"] = history.at_peak()
                if args.kernels:  # after the peak is read: the profiler's buffers are not the step's memory
                    row["kernels"] = H.kernel_breakdown(step, dev, top=args.kernels)
                    row["kernel_ms"] = sum(k[2] for k in row["kernels"])
            except Exception as exc:  # noqa: BLE001 - recorded; OOM ends this setting's growth
                failed, fatal = True, H.fatal_cuda(exc)  # not the exception: its frames hold the batch's tensors
                row["oom" if H.is_oom(exc) else "error"] = H.err_text(exc)
                if history and H.is_oom(exc):  # the failed step's tensors are still held here
                    row["memory_at_oom"] = history.live_now()
                bad += "NOT REWRITTEN" in str(exc)
            finally:
                if history:
                    history.stop()
            losses = tokens = None
            opt.zero_grad(set_to_none=True)
            H.free(dev)
            row["wall_s"] = round(time.time() - began, 1)
            wall, ran = time.time() - began, ran + 1
            slowest = max(slowest, wall)
            last = wall - (row["first_step_s"] or 0.0)  # without its first step: a later size compiles nothing
            H.append_row(args.out, row)
            print_row(row)
            if failed:
                if fatal:
                    print("# the CUDA context is broken: this worker stops", flush=True)
                    return 3
                break
        model = opt = compiled = None
        torch._dynamo.reset()
        H.free(dev)
    return 1 if bad else 0


def print_row(r):
    f = H.fmt
    line = (
        f"  {r['model']} {r['method']:8s} ckpt={r['ckpt']:3s} batch={r['batch']:<4d} seq={r.get('seq')} first step "
        f"{f(r.get('first_step_s'), '.1f'):>6s} s  step {f(r.get('step_ms'), '.1f'):>8s} ms "
        f"{f(r.get('tokens_s'), '.0f'):>8s} tok/s  host {f(r.get('host_ms'), '.1f'):>7s} ms  "
        f"peak {f(r.get('peak_gb'), '.2f'):>6s} GB  {r.get('pick') or ''}"
    )
    if r.get("oom") or r.get("error"):
        line += f"  {'OOM' if r.get('oom') else 'FAILED ' + r['error']}"
    print(line, flush=True)


# ------------------------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------------------------
def summary(rows, args):
    """The final table: one row per model and method; with --seqs the growth is the sequence's at batch 1."""
    f = H.fmt
    grow, tag = ("seq", "s") if args.seqs else ("batch", "b")
    fits = {cell_key(r): r for r in pool_rounds([r for r in rows if r.get("step_ms")])}
    ended = {
        (r["model"], r["method"], r["ckpt"]): "OOM" if r.get("oom") else "error"
        for r in rows
        if r.get("oom") or r.get("error")
    }
    body = []
    for model in args.models:
        for method in args.methods:
            mine = [r for k, r in fits.items() if k[:2] == (model, method)]
            if not mine and not any(r["model"] == model and r["method"] == method for r in rows):
                continue
            cells = [model, method]
            for ckpt in ("off", "on"):
                sizes = [r[grow] for r in mine if r["ckpt"] == ckpt]
                top = max(sizes) if sizes else 0
                if (model, method, ckpt) in ended:  # the next batch did not fit (or failed: see the rows)
                    cells.append(f"{top}" if top else ended[(model, method, ckpt)])
                elif top:
                    cells.append(
                        f"≥{top}" + (" (cap)" if top >= max(args.sizes)[0 if grow == "batch" else 1] else " (not done)")
                    )
                else:
                    cells.append("")
            for ckpt in ("off", "on"):
                parts = []
                for r in sorted((r for r in mine if r["ckpt"] == ckpt), key=lambda r: r[grow]):
                    base = fits.get((model, "compile", ckpt, r["batch"], r["seq"]))
                    if base:
                        ratio = "" if method == "compile" else f" ({r['step_ms'] / base['step_ms']:.2f}x)"
                        rounds = (
                            ""
                            if len(r["round_ms"]) < 2
                            else " [rounds " + " / ".join(f"{t:.1f}" for t in r["round_ms"]) + "]"
                        )
                        parts.append(f"{tag}{r[grow]} {r['step_ms']:.0f}{ratio}{rounds}")
                cells.append(", ".join(parts))
            best = max((r["tokens_s"] for r in mine), default=None)
            base_best = max((r["tokens_s"] for k, r in fits.items() if k[:2] == (model, "compile")), default=None)
            cells.append(
                f(best, ".0f") + (f" ({best / base_best:.2f}x)" if best and base_best and method != "compile" else "")
            )
            first = sorted((r for r in mine if r["ckpt"] == "off"), key=lambda r: r[grow])
            cell = ""
            if first:
                r = first[0]
                base = fits.get((model, "compile", "off", r["batch"], r["seq"]))
                cell = f"{tag}{r[grow]} {r['first_step_s']:.1f} s"
                if base and method != "compile":
                    cell += f" ({r['first_step_s'] / base['first_step_s']:.2f}x)"
            cells.append(cell)
            cells.append(next((r["pick"] for r in mine if r.get("pick")), ""))
            body.append(cells)
    return H.md_table(
        [
            "model",
            "method",
            f"max {grow}",
            f"max {grow} (ckpt)",
            f"step ms at common {'batches' if grow == 'batch' else 'lengths'} (x compile)",
            "same, ckpt",
            "best tok/s (x compile's best)",
            "first step (x compile)",
            "pick",
        ],
        body,
    )


def time_split(rows):
    """Where each setting's step goes (rows with host_ms, i.e. since v27), pooled over rounds: the host's own time
    (the step call returning before its synchronisation: a step whose host ms is near its step ms waits on the
    host), and with --kernels the profiled step's kernel time with its three costliest kernels (the first round's)."""
    body = []
    for r in pool_rounds([r for r in rows if r.get("step_ms")]):
        if r.get("host_ms") is None:
            continue
        top = "; ".join(f"{n[:40]} {ms:.2f}" for n, _, ms in (r.get("kernels") or [])[:3])
        body.append(
            [
                r["model"],
                r["method"],
                r["ckpt"],
                f"{r['batch']} x {r['seq']}",
                f"{r['step_ms']:.1f}",
                f"{r['host_ms']:.1f}",
                H.fmt(r.get("kernel_ms"), ".1f"),
                top,
            ]
        )
    return (
        H.md_table(
            [
                "model",
                "method",
                "ckpt",
                "batch x seq",
                "step ms",
                "host ms",
                "kernel ms (one step)",
                "costliest kernels (ms)",
            ],
            body,
        )
        if body
        else ""
    )


def driver(args, argv):
    import cce_inductor  # noqa: F401 (fails early when the package is missing)

    backends = H.resolve_methods(args.methods)
    if not args.report:
        H.append_row(
            args.out,
            H.header(
                args.device,
                dict(
                    script="full_depth",
                    models=args.models,
                    methods=args.methods,
                    backends=backends,
                    ckpt=args.ckpt,
                    batches=args.batches,
                    seq=args.seq,
                    seqs=args.seqs,
                    steps=args.steps,
                    min_timed_s=args.min_timed_s,
                    static=args.static,
                    rounds=args.rounds,
                    configs={m: MODELS[m][1] for m in args.models},
                    tiny=args.tiny,
                    weights=args.weights,
                ),
            ),
        )
    print(f"# results: {args.out}", flush=True)
    child_argv = H.strip_flags(argv, {"--models", "--methods", "--out", "--budget-s", "--rounds"}) + [
        "--out",
        args.out,
        "--methods",
        ",".join(args.methods),
    ]
    units = [
        ["--model", m, "--method", meth, "--round", str(k)]
        for m in args.models
        for k in range(1, args.rounds + 1)
        for meth in args.methods
    ]

    def crash_row(unit, rc):
        return dict(
            dict.fromkeys(COLUMNS),
            kind="row",
            model=unit[1],
            method=unit[3],
            ckpt="*",
            batch=0,
            round=int(unit[5]),
            error=f"worker exited with {rc}",
        )

    left = (
        []
        if args.report
        else H.run_workers(units, child_argv, os.path.abspath(__file__), args.budget_s, args.out, crash_row)
    )
    rows = [
        r
        for r in H.latest(H.read_rows(args.out), unit_key)
        if r.get("model") in args.models
        and r.get("method") in args.methods
        and r.get("seq") in {s for _, s in args.sizes} | {None}
        and r.get("weights", "fp32-autocast") == args.weights
    ]
    ended = {(r["model"], r["method"], r["ckpt"]) for r in rows if r.get("oom") or r.get("error")}
    have = {unit_key(r) for r in rows}
    todo = [
        (m, meth, ck)
        for m in args.models
        for meth in args.methods
        for ck in args.ckpt
        if (m, meth, ck) not in ended
        and any((m, meth, ck, b, s, k) not in have for b, s in args.sizes for k in range(1, args.rounds + 1))
    ]
    bad = [r for r in rows if "NOT REWRITTEN" in str(r.get("error", ""))]
    print()
    if todo:
        print(
            f"# not done: {len(todo)} setting(s), e.g. {todo[:3]}"
            f"{f' (workers not started: {len(left)})' if left else ''}; re-run the same command with --resume"
        )
    for r in bad:
        print(f"# !!! {r['model']} {r['method']} ckpt={r['ckpt']} batch={r['batch']}: {r['error']}")
    print(summary(rows, args), flush=True)
    split = time_split(rows)
    if split:
        print("\n" + split, flush=True)
    return 1 if bad else 0


def _flag_names(argv):
    return [a.split("=", 1)[0] for a in (argv if argv is not None else sys.argv[1:]) if a.startswith("--")]


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
    ap.add_argument(
        "--methods",
        default="compile,default",
        help="comma list of compile, liger, liger-eager, liger-break, default, lean, balanced",
    )
    ap.add_argument("--ckpt", default="off,on", help="activation checkpointing settings: off, on or both")
    ap.add_argument("--batches", default=None, help="batch sizes to try, in order (default 1,2,4,... --max-batch)")
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048)")
    ap.add_argument(
        "--seqs",
        default=None,
        help="sequence lengths to try at batch 1, in order, in place of --batches: the longest sequence that fits",
    )
    ap.add_argument("--steps", type=int, default=None, help="timed steps per batch, at least (default 5)")
    ap.add_argument(
        "--min-timed-s",
        type=float,
        default=None,
        help="more timed steps until they add up to this many seconds, at most 100 (default 2; tiny 0)",
    )
    ap.add_argument("--batch-shapes", choices=("dynamic", "static"), default="dynamic")
    ap.add_argument(
        "--weights",
        choices=("fp32-autocast", "bf16"),
        default="fp32-autocast",
        help="fp32 parameters with the forward under bf16 autocast (default), or bf16 parameters without autocast",
    )
    ap.add_argument("--rounds", type=int, default=1, help="run every worker this many times, methods alternating")
    ap.add_argument(
        "--kernels",
        type=int,
        default=0,
        metavar="K",
        help="one more step under torch.profiler: its K costliest kernels and their sum in the row",
    )
    ap.add_argument("--attn", default=None, help="attn_implementation for every model (default: per model)")
    ap.add_argument(
        "--compile-mode", default=None, help='torch.compile(mode=...) for every method; "reduce-overhead": CUDA graphs'
    )
    ap.add_argument(
        "--memory-fraction",
        type=float,
        default=None,
        help="torch.cuda.set_per_process_memory_fraction in each worker: a smaller GPU (the OOM fallback's test)",
    )
    ap.add_argument(
        "--memory-history",
        action="store_true",
        help="record the allocator's history over each size's steps: what holds the memory at the peak, or at an OOM",
    )
    ap.add_argument("--out", default=None, help="JSON lines, appended (default $OUT/full_depth.jsonl)")
    ap.add_argument("--resume", action="store_true", help="skip the batches --out already holds")
    ap.add_argument("--report", action="store_true", help="print the table of --out's rows; run nothing")
    ap.add_argument("--budget-s", type=float, default=None, help="seconds for the whole command (default 500)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run of the harness")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--method", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--round", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.report and args.out and set(_flag_names(argv)) <= {"--report", "--out"}:
        # --report --out FILE alone: the table of the command that wrote FILE (its models, methods and sizes)
        header = next((r for r in H.read_rows(args.out) if r.get("kind") == "header"), None)
        if header:
            written = H.strip_flags(shlex.split(header["command"])[1:], {"--out", "--budget-s", "--resume"})
            args = ap.parse_args([*written, "--report", "--out", args.out])
    args.device = "cpu" if args.tiny else "cuda"
    args.models = args.models.split(",")
    args.methods = args.methods.split(",")
    args.ckpt = args.ckpt.split(",")
    for m in args.models:
        if m not in MODELS:
            ap.error(f"unknown model {m!r}; models: {', '.join(MODELS)}")
    for m in args.methods:
        if m not in PLAIN_METHODS and not H.is_method(m):
            ap.error(f"unknown method {m!r}; methods: {', '.join(PLAIN_METHODS)}, {H.METHOD_NAMES}")
    if not set(args.ckpt) <= {"off", "on"}:
        ap.error("--ckpt: off, on")
    if args.rounds < 1:
        ap.error("--rounds: at least 1")
    if args.seqs and args.batches:
        ap.error("--seqs grows the sequence at batch 1: give it or --batches, not both")
    if args.batches:
        args.batches = [int(b) for b in args.batches.split(",")]
    else:
        top = 2 if args.tiny else args.max_batch
        args.batches = [2**i for i in range(top.bit_length()) if 2**i <= top]
    args.seq = args.seq or (64 if args.tiny else 2048)
    args.seqs = [int(x) for x in args.seqs.split(",")] if args.seqs else None
    # the settings each (model, method, ckpt) grows through until one does not fit: (batch, seq) pairs
    args.sizes = [(1, x) for x in args.seqs] if args.seqs else [(b, args.seq) for b in args.batches]
    args.steps = args.steps or (1 if args.tiny else 5)
    if args.min_timed_s is None:
        args.min_timed_s = 0.0 if args.tiny else 2.0
    args.static = args.batch_shapes == "static"
    if args.budget_s is None:
        args.budget_s = 0 if args.tiny else 500
    return H.finish_args(ap, args, "full_depth")


if __name__ == "__main__":
    sys.exit(H.main(None, parse_args, worker, driver))
