"""transformers' Trainer, PEFT LoRA under it and TRL's SFTTrainer at real size: stock torch.compile against
``CCE_INDUCTOR=1`` (issue 29, item 7): step time, tokens/s, peak memory at the same batch, the largest batch each fits.

Qwen2.5-0.5B and Llama-3.2-1B from their published configs (full_depth.py's MODELS; nothing downloaded), fp32 master
weights, ``TrainingArguments(torch_compile=True, bf16=True)``, AdamW (the Trainer's default), sequences of 2048
random tokens, labels = input_ids (the model shifts them), a plain torch Dataset of dicts. Clients: trainer
(transformers.Trainer); peft (the same on get_peft_model(LoraConfig(r=16, q_proj, v_proj))); sft (trl.SFTTrainer,
its defaults: TRL's fused LM head, activation checkpointing on; needs `datasets`, else one error row). Methods:
stock; cce (CCE_INDUCTOR=1: trainer / peft must show the site rewritten, sft nothing: TRL calls the model without
labels); cce_trl (sft only: CCE_INDUCTOR=1 and cce_inductor.integrations.trl.install(), TRL's head by the op).

Reproduce, from the repository root. Each command fits one 10-minute device call (--deadline 480: no batch is started
that would end past 480 s, a worker still running then is killed, its batch unrecorded); re-run the SAME command with
--resume until it prints no "not done" line (rows in --out are skipped; a setting that hit OOM is finished):

    python benchmarks/trainers.py --clients trainer --models llama32-1b --resume   # then peft, sft; qwen25-0.5b
    python benchmarks/trainers.py --clients peft --models qwen25-0.5b --batches 8,16,32,64 --steps 6 --resume
    python benchmarks/trainers.py --clients trainer --models qwen25-0.5b --methods stock,cce --batches 4 \
        --compile-mode reduce-overhead --out $OUT/ro.jsonl                          # CUDA graphs (TrainingArguments)
    python benchmarks/trainers.py --report                                          # the tables of --out, no run
    python benchmarks/trainers.py --device cpu --tiny --clients trainer --models llama32-1b   # CPU smoke, ~2 min

Measured: one setting takes 40-100 s of compile per method and batch (H100 / H200; stock Trainer, Qwen2.5-0.5B,
batch 4: first step 66.6 s on an H100), so one 10-minute call holds ~4-6 (method, batch) pairs: pass --batches.
Results: docs/performance.md, "Trainers at real size" (H200 and H100, 2026-11-25). On a machine without
`datasets` (the device's), TRL needs it and its pure dependencies as wheels on PYTHONPATH (pyarrow, numpy and
huggingface_hub are there already), e.g. the cp312 wheels of datasets 4.7.0, dill, multiprocess, xxhash, fsspec,
pandas, python-dateutil, tzdata, aiohttp and its small dependencies:
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl-datasets/*.whl; export PYTHONPATH=/tmp/site

One worker process per (client, model, method), its environment fresh: CCE_INDUCTOR=1 for cce methods only,
Inductor's on-disk caches off (every first step compiles; stats() sees the site). Where the package's torch.backends
entry point is not installed (a checkout on PYTHONPATH) the worker calls cce_inductor.enable() as that entry point
does (the row's `switch` says which). Per batch (1, 2, 4, ... --max-batch until torch.OutOfMemoryError, or
--batches): torch._dynamo.reset(), a fresh model (same seed, same data), a new Trainer for --steps steps; a
TrainerCallback synchronises and times each step (on_step_begin -> on_step_end: forward, backward, optimizer).

Columns (JSON lines, one per client x model x method x batch, each with device, versions, date and command):
    first_step_s  step 1, its compile included;  step_ms  median of the steps after --warmup;  tokens_s;  times_ms
    every step;  graphs  the graphs Dynamo compiled (more than the first step's: a recompile in a later step)
    peak_gb  torch.cuda.max_memory_allocated over the timed steps;  warmup_peak_gb  over the warm-up steps (under
    --compile-mode reduce-overhead the CUDA graphs are recorded there and replays allocate nothing: the step's peak
    is warmup_peak_gb);  reserved_gb  torch.cuda.max_memory_reserved at the end (the allocator keeps what it
    reserved, so the warm-up's too);
    start_gb  allocated before the batch's model was built (what an earlier batch left: should be ~0)
    losses, grad_norms  each step's logged values;  rewritten, skipped, reasons, pick, pick_reason, executions
    stats() after the run;  check  what stats() shows against what the method must (NO KERNELS: the op ran the
    chunked path on the GPU);  oom / error  (the growth stops there)
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]
import _common as C  # noqa: E402  (benchmarks/ on the path first)
from full_depth import MODELS as FD_MODELS  # noqa: E402
from full_depth import build_model  # noqa: E402

MODELS = ("qwen25-0.5b", "llama32-1b")
CLIENTS = {"trainer": ("stock", "cce"), "peft": ("stock", "cce"), "sft": ("stock", "cce", "cce_trl")}
COLUMNS = (
    "client",
    "model",
    "method",
    "batch",
    "seq",
    "steps",
    "first_step_s",
    "step_ms",
    "times_ms",
    "tokens_s",
    "peak_gb",
    "warmup_peak_gb",
    "reserved_gb",
    "start_gb",
    "losses",
    "grad_norms",
    "rewritten",
    "skipped",
    "reasons",
    "pick",
    "pick_reason",
    "executions",
    "graphs",
    "check",
    "oom",
    "error",
    "wall_s",
)


def unit_key(r):
    return r["client"], r["model"], r["method"], r["batch"]


def versions():
    from importlib import metadata

    names = ("triton", "transformers", "accelerate", "peft", "trl", "datasets")
    have = {(d.metadata["Name"] or "").lower(): d.version for d in metadata.distributions()}
    return {"torch": torch.__version__, **{n: have.get(n) for n in names}}


# worker: one (client, model, method), the batches in turn ------------------------------------------------------
class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seq, vocab, seed):
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def step_timer(device, warmup, profile_to=None):
    """A callback timing each step; ``profile_to``: a file that gets the kernel table of the second timed step
    (``--profile``; that step is left out of ``step_ms``)."""
    import transformers

    class StepTimer(transformers.TrainerCallback):
        def __init__(self):
            self.times, self.warmup_peak = [], None

        def on_step_begin(self, args, state, control, **kw):
            C.sync(device)
            if device == "cuda" and len(self.times) == warmup:
                self.warmup_peak = torch.cuda.max_memory_allocated() / 2**30
                torch.cuda.reset_peak_memory_stats()
            self.profiler = None
            if profile_to and len(self.times) == warmup + 1:  # one timed step, profiled (left out of step_ms)
                self.profiler = torch.profiler.profile()
                self.profiler.__enter__()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            C.sync(device)
            self.times.append(time.perf_counter() - self.t0)
            if self.profiler is not None:
                self.profiler.__exit__(None, None, None)
                with open(profile_to, "a") as f:
                    f.write(self.profiler.key_averages().table(sort_by="self_device_time_total", row_limit=30))

    return StepTimer()


def word_tokenizer(vocab):
    """SFTTrainer wants a processing_class: a word-level tokenizer over w0 .. w{vocab-1} (w0 pads)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="w0", eos_token="w1", unk_token="w0")


def train_once(args, batch, outdir):
    """One Trainer run at this batch; returns the row's measured fields."""
    import transformers

    model = build_model(args.model, argparse.Namespace(tiny=args.tiny, seed=args.seed, device=args.device, attn=None))
    if args.client == "peft":
        import peft

        model = peft.get_peft_model(
            model,
            peft.LoraConfig(
                r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
            ),
        )
    vocab = model.config.vocab_size
    data = Tokens(batch * args.steps, args.seq, vocab, args.seed)
    kw = dict(
        output_dir=outdir,
        per_device_train_batch_size=batch,
        max_steps=args.steps,
        logging_steps=1,
        learning_rate=1e-5,
        bf16=True,
        torch_compile=True,
        use_cpu=args.device == "cpu",
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=args.seed,
        torch_compile_mode=args.compile_mode,
    )
    timer = step_timer(
        args.device,
        args.warmup,
        args.profile and f"{args.profile}_{args.client}_{args.model}_{args.method}_b{batch}.txt",
    )
    if args.client == "sft":
        import datasets
        import trl

        data = datasets.Dataset.from_list([{"input_ids": row.tolist()} for row in data.ids])
        trainer = trl.SFTTrainer(
            model=model,
            args=trl.SFTConfig(max_length=args.seq, **kw),
            train_dataset=data,
            processing_class=word_tokenizer(vocab),
            callbacks=[timer],
        )
    else:
        trainer = transformers.Trainer(
            model=model, args=transformers.TrainingArguments(**kw), train_dataset=data, callbacks=[timer]
        )
    trainer.remove_callback(transformers.PrinterCallback)  # the per-step log dicts: in the row instead
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    times = timer.times
    timed = [t for i, t in enumerate(times) if i >= args.warmup and not (args.profile and i == args.warmup + 1)]
    step_ms = statistics.median(timed) * 1e3
    return dict(
        first_step_s=times[0],
        step_ms=step_ms,
        tokens_s=batch * args.seq / (step_ms / 1e3),
        times_ms=[round(t * 1e3, 2) for t in times],
        graphs=torch._dynamo.utils.counters["stats"]["unique_graphs"],
        peak_gb=torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None,
        reserved_gb=torch.cuda.max_memory_reserved() / 2**30 if args.device == "cuda" else None,
        warmup_peak_gb=timer.warmup_peak,
        losses=[e["loss"] for e in logs],
        grad_norms=[e.get("grad_norm") for e in logs],
    )


def check_stats(args, st):
    """What cce_inductor.stats() says against what this method must show ("" when as expected)."""
    if args.method == "stock":
        return f"the pass ran in the stock run: {st['summary']}" if st["graphs"] else ""
    if args.method == "cce_trl":
        return "" if st["executions"]["linear_cross_entropy"] >= args.steps else f"op not run: {st['summary']}"
    if args.client == "sft":  # TRL calls the model without labels: nothing to rewrite, nothing left alone
        return "" if not st["rewritten"] and not st["skipped"] else f"unexpected: {st['summary']}"
    if not st["rewritten"] or st["skipped"]:
        return f"NOT REWRITTEN: {st['summary']}"
    # a CUDA run whose op found no Triton kernels (e.g. a checkout without them) measures the chunked path
    return next((f"NO KERNELS: {s['reason']}" for s in st["sites"] if "no Triton kernels" in s["reason"]), "")


def worker(args):
    import torch._dynamo.config as dyn
    import torch._inductor.config as ind

    meta = dict(
        device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        **versions(),
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        command=os.environ.get("TRAINERS_BENCH_COMMAND", ""),
        tiny=args.tiny,
        compile_mode=args.compile_mode,
        config=dict(FD_MODELS[args.model][1]) if not args.tiny else "tiny",
    )

    def new_row(batch, **kw):
        return dict(
            dict.fromkeys(COLUMNS),
            **meta,
            kind="row",
            client=args.client,
            model=args.model,
            method=args.method,
            batch=batch,
            seq=args.seq,
            steps=args.steps,
            **kw,
        )

    try:
        import transformers

        import cce_inductor

        transformers.logging.set_verbosity_error()
        meta.update(
            cce_inductor=cce_inductor.__version__,
            cce_inductor_path=os.path.dirname(cce_inductor.__file__),
            switch="stock",
        )
        if args.method != "stock":
            meta["switch"] = (
                "CCE_INDUCTOR=1 (entry point)"
                if cce_inductor.is_enabled()
                else "CCE_INDUCTOR=1 + enable() (entry point not installed)"
            )
            cce_inductor.enable()
        if args.method == "cce_trl":
            from cce_inductor.integrations import trl as cce_trl

            cce_trl.install()
        if args.client == "peft":
            import peft  # noqa: F401
        elif args.client == "sft":
            import datasets
            import trl  # noqa: F401

            datasets.disable_progress_bars()
    except Exception as exc:  # noqa: BLE001 - e.g. TRL without `datasets`: one error row, the driver goes on
        C.append_row(args.out, print_row(new_row(args.batches[0], error=f"import: {C.err_text(exc)}")))
        return 0
    ind.force_disable_caches = True
    dyn.recompile_limit = max(getattr(dyn, "recompile_limit", 8), 64)
    rows = [r for r in C.read_rows(args.out) if r.get("kind") == "row"]
    done = {unit_key(r): r for r in rows} if args.resume else {}
    if any(k[:3] == (args.client, args.model, args.method) and (r["oom"] or r["error"]) for k, r in done.items()):
        return 0
    slowest = 0.0
    for b in [b for b in args.batches if (args.client, args.model, args.method, b) not in done]:
        seen = [r["wall_s"] or 0 for r in rows if (r["client"], r["model"], r["batch"]) == (args.client, args.model, b)]
        if C.past_deadline(args.deadline, 1.2 * max(seen + [slowest])):
            print(f"# {args.client} {args.model} {args.method}: deadline: batch {b} not started", flush=True)
            return 0
        row = new_row(b)
        began = time.time()
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        cce_inductor.reset_stats()
        if args.device == "cuda":  # start_gb: what an earlier batch of this process left allocated (should be ~0)
            torch.cuda.reset_peak_memory_stats()
            row["start_gb"] = torch.cuda.memory_allocated() / 2**30
        fatal = False
        try:
            with tempfile.TemporaryDirectory() as outdir:
                row.update(train_once(args, b, outdir))
            st = cce_inductor.stats()
            row.update(
                rewritten=st["rewritten"],
                skipped=st["skipped"],
                reasons=st["reasons"] or None,
                executions=st["executions"]["linear_cross_entropy"],
                pick=next((s["path"] for s in st["sites"][::-1] if s["rewritten"]), None),
                pick_reason=next((s["reason"] for s in st["sites"][::-1] if s["rewritten"]), None),
            )
            row["check"] = check_stats(args, st) or None
        except Exception as exc:  # noqa: BLE001 - recorded; OOM ends the growth
            fatal = C.fatal_cuda(exc)  # not the exception itself: its frames hold the batch's tensors
            row["oom" if C.is_oom(exc) else "error"] = C.err_text(exc)
        torch._dynamo.reset()
        C.free(args.device)
        row["wall_s"] = round(time.time() - began, 1)
        slowest = max(slowest, row["wall_s"])
        C.append_row(args.out, print_row(row))
        if row["oom"] or row["error"]:
            return 3 if fatal else 0
    return 0


def print_row(r):
    f = C.fmt
    line = (
        f"  {r['client']:7s} {r['model']} {r['method']:7s} batch={r['batch']:<4d} first step "
        f"{f(r.get('first_step_s'), '.1f'):>6s} s  step {f(r.get('step_ms'), '.1f'):>8s} ms "
        f"{f(r.get('tokens_s'), '.0f'):>8s} tok/s  peak {f(step_peak(r), '.2f'):>6s} GB  "
        f"rewritten {r.get('rewritten')} {r.get('pick') or ''}  loss {f((r.get('losses') or [None])[-1], '.4f')}"
    )
    for key in ("check", "oom", "error"):
        if r.get(key):
            line += f"  {key.upper()}: {r[key]}"
    print(line, flush=True)
    return r


# driver -------------------------------------------------------------------------------------------------------
def rel_diff(a, b):
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)) if a and b else None


def step_peak(x):
    """The peak a row's tables report: the timed steps', or under CUDA graphs (``compile_mode``) the warm-up's, where
    the graphs were recorded (a replay allocates nothing)."""
    peak = x.get("peak_gb")
    return max(peak, x.get("warmup_peak_gb") or 0.0) if peak and x.get("compile_mode") else peak


def cell(x):
    if x.get("step_ms"):
        return f"{x['step_ms']:.0f}" + (f" / {step_peak(x):.1f}" if step_peak(x) else "")
    return "OOM" if x.get("oom") else "error" if x.get("error") else ""


def ratio(a, b, key):
    get = step_peak if key == "peak_gb" else (lambda row: row.get(key))
    return f"{get(a) / get(b):.2f}x" if get(a) and get(b) else ""


def tables(rows, batches):
    f = C.fmt
    by = {unit_key(r): r for r in rows}
    body = []
    for (client, model, method, b), r in sorted(by.items()):
        s = by.get((client, model, "stock", b), {})
        if method != "stock":
            body.append(
                [
                    client,
                    model,
                    method,
                    b,
                    cell(s),
                    cell(r),
                    ratio(r, s, "step_ms"),
                    ratio(r, s, "peak_gb"),
                    f(rel_diff(r.get("losses"), s.get("losses")), ".1e"),
                    r.get("rewritten"),
                    "!! " + r["check"] if r.get("check") else "",
                ]
            )
    steps = C.md_table(
        [
            "client",
            "model",
            "method",
            "batch",
            "stock ms / GB",
            "method ms / GB",
            "ms ratio",
            "GB ratio",
            "loss max rel diff",
            "rewritten",
            "check",
        ],
        body,
    )
    top = []

    def best(unit):
        return max((r["tokens_s"] for k, r in by.items() if k[:3] == unit and r.get("tokens_s")), default=None)

    for unit in sorted({k[:3] for k in by}):
        mine = [r for k, r in by.items() if k[:3] == unit]
        fit = max((r["batch"] for r in mine if r.get("step_ms")), default=None)
        end = next(("OOM" if r["oom"] else "error: " + r["error"][:80] for r in mine if r["oom"] or r["error"]), None)
        grown = "(cap)" if fit and fit >= max(batches) else "(not done)"
        largest = (str(fit) if end else f"≥{fit} {grown}") if fit else (end or "").split(":")[0]
        mine_best, stock_best = best(unit), best((*unit[:2], "stock"))
        ratio_best = f" ({mine_best / stock_best:.2f}x)" if mine_best and stock_best and unit[2] != "stock" else ""
        top.append([*unit, largest, f(mine_best, ".0f") + ratio_best, end if end and not fit else ""])
    return (
        steps
        + "\n\n"
        + C.md_table(["client", "model", "method", "largest batch", "best tok/s (x stock's)", "note"], top)
    )


def results(args, units):
    """The latest row per (client, model, method, batch) of these units in --out, and the units not finished."""
    rows = [
        r
        for r in C.latest(C.read_rows(args.out), unit_key)
        if r.get("seq") in (args.seq, None) and (r["client"], r["model"], r["method"]) in units
    ]
    ended = {unit_key(r)[:3] for r in rows if r.get("oom") or r.get("error")}
    have = {unit_key(r) for r in rows}
    return rows, [u for u in units if u not in ended and any((*u, b) not in have for b in args.batches)]


def driver(args, argv):
    os.environ["TRAINERS_BENCH_COMMAND"] = " ".join(shlex.quote(a) for a in [sys.argv[0], *argv])
    deadline = time.time() + args.deadline if args.deadline else 0.0
    child = C.strip_flags(argv, {"--clients", "--models", "--methods", "--out", "--deadline"})
    units = [(c, m, meth) for c in args.clients for m in args.models for meth in CLIENTS[c] if meth in args.methods]
    print(f"# results: {args.out}", flush=True)
    for i, (client, model, method) in enumerate([] if args.report else units):
        if args.resume and (client, model, method) not in results(args, units)[1]:
            continue
        if deadline and time.time() > deadline - 30:
            print(f"# deadline: {len(units) - i} worker(s) not started", flush=True)
            break
        env = {k: v for k, v in os.environ.items() if not k.startswith("CCE_INDUCTOR")}
        env.update(
            PYTHONPATH=os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            TOKENIZERS_PARALLELISM="false",
            TORCHINDUCTOR_FORCE_DISABLE_CACHES="1",
            **({} if method == "stock" else {"CCE_INDUCTOR": "1"}),
        )
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            *child,
            "--out",
            args.out,
            "--worker",
            "--client",
            client,
            "--model",
            model,
            "--method",
            method,
            "--until",
            f"{deadline:.0f}",
        ]
        print(f"# worker: {'CCE_INDUCTOR=1 ' if method != 'stock' else ''}{shlex.join(cmd[1:])}", flush=True)
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)  # its own group: its compile workers too
        try:
            rc = proc.wait(timeout=max(deadline - time.time() + 20, 1) if deadline else None)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            print(f"# {client} {model} {method}: killed at the deadline (its batch: not recorded)", flush=True)
            break
        if rc not in (0, 3):
            C.append_row(
                args.out,
                dict(
                    dict.fromkeys(COLUMNS),
                    kind="row",
                    client=client,
                    model=model,
                    method=method,
                    batch=0,
                    error=f"worker exited with {rc}",
                ),
            )
    rows, todo = results(args, units)
    print()
    if todo:
        print(f"# not done: {len(todo)} setting(s), e.g. {todo[:3]}; re-run the same command with --resume")
    print(tables(rows, args.batches), flush=True)
    return 1 if any(r.get("check") for r in rows) else 0


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default=",".join(CLIENTS), help="comma list of trainer, peft, sft")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
    ap.add_argument("--methods", default="stock,cce,cce_trl", help="comma list of stock, cce, cce_trl (sft only)")
    ap.add_argument("--batches", default=None, help="batch sizes, in order (default 1,2,4,... --max-batch)")
    ap.add_argument("--max-batch", type=int, default=128)
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048; --tiny 64)")
    ap.add_argument("--steps", type=int, default=None, help="Trainer steps per batch (default 10; --tiny 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed first steps (default 2; --tiny 1)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny configs (2 layers, hidden 64, vocab 1001), seq 64")
    ap.add_argument("--out", default=None, help="JSON lines, appended (default $OUT/trainers.jsonl)")
    ap.add_argument("--resume", action="store_true", help="skip the (client, model, method, batch) rows --out holds")
    ap.add_argument("--report", action="store_true", help="print the tables of --out's rows; run nothing")
    ap.add_argument("--deadline", type=float, default=None, help="seconds for the whole command (default 480; 0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--profile",
        default=None,
        help="path prefix: each worker writes the kernel table of its second timed step there",
    )
    ap.add_argument(
        "--compile-mode",
        default=None,
        help='TrainingArguments.torch_compile_mode, e.g. "reduce-overhead" (CUDA graphs); default: none',
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("--client", "--model", "--method", "--until"):  # the worker's unit; the driver's deadline
        ap.add_argument(name, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.clients, args.models, args.methods = (x.split(",") for x in (args.clients, args.models, args.methods))
    for name, got, known in (
        ("client", args.clients, CLIENTS),
        ("model", args.models, MODELS),
        ("method", args.methods, CLIENTS["sft"]),
    ):
        if not set(got) <= set(known):
            ap.error(f"unknown {name} in {got}; known: {', '.join(known)}")
    top = 2 if args.tiny else args.max_batch
    args.batches = (
        [int(b) for b in args.batches.split(",")]
        if args.batches
        else [2**i for i in range(top.bit_length()) if 2**i <= top]
    )
    args.seq, args.steps = args.seq or (64 if args.tiny else 2048), args.steps or (3 if args.tiny else 10)
    args.warmup = min(args.warmup if args.warmup is not None else (1 if args.tiny else 2), args.steps - 1)
    args.deadline = (0 if args.device == "cpu" else 480) if args.deadline is None else args.deadline
    args.deadline = float(args.until or 0) if args.worker else args.deadline
    return C.finish_args(ap, args, "trainers", hint="--device cpu --tiny")


if __name__ == "__main__":
    sys.exit(C.main(None, parse_args, worker, driver))
