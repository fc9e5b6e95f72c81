"""transformers' Trainer, PEFT LoRA under it, TRL's SFTTrainer and torchtitan at real size: stock torch.compile
against ``CCE_INDUCTOR=1`` (torchtitan: its losses against ``CCELoss``; issue 29): step time, tokens/s, peak memory
at the same batch, the largest batch each fits.

Qwen2.5-0.5B and Llama-3.2-1B from their published configs (full_depth.py's MODELS; nothing downloaded), fp32 master
weights, ``TrainingArguments(torch_compile=True, bf16=True)``, AdamW (the Trainer's default), sequences of 2048
random tokens, labels = input_ids (the model shifts them), a plain torch Dataset of dicts. Clients: trainer
(transformers.Trainer); peft (the same on get_peft_model(LoraConfig(r=16, q_proj, v_proj))); sft (trl.SFTTrainer,
its defaults: TRL's fused LM head, activation checkpointing on; needs `datasets`, else one error row). Methods:
stock; cce (CCE_INDUCTOR=1: trainer / peft must show the site rewritten, sft nothing: TRL calls the model without
labels); cce_trl (sft only: CCE_INDUCTOR=1 and cce_inductor.integrations.trl.install(), TRL's head by the op).

Client titan (Llama-3.2-1B only: torchtitan's llama3 "1B"; --tiny its "debugmodel", 2 layers): torchtitan's model from
its registry, built on the meta device and parallelised by its own ``parallelize_llama`` on one rank (per-block
torch.compile, selective activation checkpointing, FSDP2's bf16 mixed precision, as ``llama3_8b()``'s config does),
AdamW, trained through its ``Trainer._forward_backward_body`` with the loss wired as ``Trainer.__init__`` wires a
``ChunkedLossWrapper``; random labels, 5% of them -100; attention torchtitan's SDPA (causal), not the FlexAttention of
its flavours, whose block masks its dataloader builds. Methods: plain (the model's head, then torchtitan's compiled
``CrossEntropyLoss`` on the logits: the baseline of the titan rows), stock (its ``ChunkedLossWrapper``: the head in
eager chunks, its default for language models; fails in its backward on torch 2.11), cce (``CCELoss`` from
cce_inductor.integrations.torchtitan: head and loss as one fused op; the row's pick is the path the op takes). No
CCE_INDUCTOR in its workers. torchtitan 0.3.0 imports ``torch.distributed.fsdp.DataParallelMeshDims`` (torch >= 2.12):
on an older torch a stand-in lets it import (one rank never builds one). Where torchtitan is not installed (the
device's), its wheels and what it imports beyond a torch + transformers install go on PYTHONPATH (torchtitan,
spmd_types, tyro, docstring_parser, rich, pygments, markdown-it-py, mdurl, typeguard, shtab, torchdata, tensorboard,
tensorboard-data-server, absl-py, protobuf, markdown, werkzeug, einops, torch_checkpointing, and ``datasets`` with its
dependencies; the device calls keep them in ``.whl-titan/`` and ``.whl-datasets/``):
    python -m pip install -q --no-index --no-deps --target /tmp/site .whl-titan/*.whl .whl-datasets/*.whl
    PYTHONPATH=/tmp/site python benchmarks/trainers.py --clients titan --models llama32-1b \
        --methods plain,cce,stock --batches 1,2,4,8 --steps 8

Reproduce, from the repository root. Each command fits one 10-minute device call (--deadline 480: no batch is started
that would end past 480 s, a worker still running then is killed, its batch unrecorded); re-run the SAME command with
--resume until it prints no "not done" line (rows in --out are skipped; a setting that hit OOM is finished):

    python benchmarks/trainers.py --clients trainer --models llama32-1b --resume   # then peft, sft; qwen25-0.5b
    python benchmarks/trainers.py --clients peft --models qwen25-0.5b --batches 8,16,32,64 --steps 6 --resume
    python benchmarks/trainers.py --clients trainer --models qwen25-0.5b --methods stock,cce --batches 4 \
        --compile-mode reduce-overhead --out $OUT/ro.jsonl                          # CUDA graphs (TrainingArguments)
    python benchmarks/trainers.py --clients trainer --models qwen25-0.5b --methods stock,cce --batches 16 \
        --weights bf16 --out $OUT/bf16.jsonl       # bf16 weights: 16-bit gradients (plain sums at the loss's scale)
    python benchmarks/trainers.py --report                                          # the tables of --out, no run
    python benchmarks/trainers.py --device cpu --tiny --clients trainer --models llama32-1b   # CPU smoke, ~2 min
    python benchmarks/trainers.py --device cpu --tiny --clients titan --models llama32-1b     # CPU smoke, ~3 min

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
TrainerCallback times each step on its own (_harness.SyncedTimer, on_step_begin -> on_step_end: forward, backward,
optimizer); titan's loop times its steps the same way.

Columns (JSON lines, one per client x model x method x batch, each with device, versions, date and command):
    first_step_s  step 1, its compile included;  step_ms  median of the steps after --warmup;  tokens_s;  times_ms
    every step;  graphs  the graphs Dynamo compiled (more than the first step's: a recompile in a later step)
    peak_gb  the allocator's peak over the timed steps (_harness.Peak);  warmup_peak_gb  over the warm-up steps (under
    --compile-mode reduce-overhead the CUDA graphs are recorded there and replays allocate nothing: the step's peak
    is warmup_peak_gb);  reserved_gb  the most the allocator reserved over the timed steps (it keeps what it
    reserved, so the warm-up's too);
    start_gb  allocated before the batch's model was built (what an earlier batch left: should be ~0)
    losses, grad_norms  each step's logged values;  rewritten, skipped, reasons, pick, pick_reason, executions,
    pass_graphs, summary  stats() after the run (_harness.stats_fields; titan's cce: pick is the op's path);
    check  what stats() shows against what the method must (NO KERNELS: the op ran the chunked path on the GPU);
    oom / error  (the growth stops there)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import types

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]
import _harness as H  # noqa: E402  (benchmarks/ on the path first)
from full_depth import MODELS as FD_MODELS  # noqa: E402
from full_depth import build_model  # noqa: E402

MODELS = ("qwen25-0.5b", "llama32-1b")
CLIENTS = {
    "trainer": ("stock", "cce"),
    "peft": ("stock", "cce"),
    "sft": ("stock", "cce", "cce_trl"),
    "titan": ("plain", "stock", "cce"),
}
BASELINE = {"titan": "plain"}  # the method a client's ratios are against (the others': stock)
TITAN_FLAVORS = {"llama32-1b": "1B"}  # torchtitan's llama3 flavour of a model (--tiny: "debugmodel", 2 layers)
IGNORE_INDEX = -100
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
    "pass_graphs",
    "rewritten",
    "skipped",
    "reasons",
    "pick",
    "pick_reason",
    "executions",
    "summary",
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

    names = ("triton", "transformers", "accelerate", "peft", "trl", "datasets", "torchtitan")
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


def step_timer(device, warmup, peak, profile_to=None):
    """A callback timing each step on its own (H.SyncedTimer); ``peak`` (an H.Peak, started) is read at the end of
    the warm-up steps (``warmup_peak``) and started again for the timed ones. ``profile_to``: a file that gets the
    kernel table of the second timed step (``--profile``; that step is left out of ``step_ms``)."""
    import transformers

    class StepTimer(transformers.TrainerCallback):
        def __init__(self):
            self.timer, self.warmup_peak = H.SyncedTimer(device), None

        @property
        def times(self):
            return [ms / 1e3 for ms in self.timer.wall_ms]

        def on_step_begin(self, args, state, control, **kw):
            if len(self.timer.wall_ms) == warmup:
                self.warmup_peak = peak.stop().gb
                peak.start()
            self.profiler = None
            if profile_to and len(self.timer.wall_ms) == warmup + 1:  # one timed step, profiled (not in step_ms)
                self.profiler = torch.profiler.profile()
                self.profiler.__enter__()
            self.timer.start()

        def on_step_end(self, args, state, control, **kw):
            self.timer.stop()
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


def train_once(args, batch, outdir, peak):
    """One Trainer run at this batch; returns the row's measured fields. ``peak``: an H.Peak, started."""
    import transformers

    model = build_model(
        args.model,
        argparse.Namespace(
            tiny=args.tiny, seed=args.seed, device=args.device, attn=None, weights=args.weights, method=args.method
        ),
    )  # fp32 master weights: TrainingArguments(bf16=True) runs the forward under autocast (--weights bf16: bf16 ones)
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
        peak,
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
        peak_gb=peak.stop().gb,
        reserved_gb=peak.reserved_gb,
        warmup_peak_gb=timer.warmup_peak,
        losses=[e["loss"] for e in logs],
        grad_norms=[e.get("grad_norm") for e in logs],
    )


def titan_shim():
    """torchtitan 0.3.0 imports ``torch.distributed.fsdp.DataParallelMeshDims`` (torch >= 2.12) at module level. On an
    older torch a stand-in class lets it import; on one rank torchtitan never builds one (the stand-in raises if it
    did), so its default SPMD backend runs unchanged."""
    import torch.distributed.fsdp as fsdp

    if hasattr(fsdp, "DataParallelMeshDims"):
        return

    class DataParallelMeshDims:  # never instantiated on one rank
        def __init__(self, *args, **kwargs):
            raise RuntimeError("DataParallelMeshDims needs torch >= 2.12")

    fsdp.DataParallelMeshDims = DataParallelMeshDims


@contextlib.contextmanager
def one_rank(device):
    """The process group of one rank that torchtitan's parallelisation needs."""
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    if device == "cuda":
        torch.cuda.set_device(0)
    try:
        yield
    finally:
        dist.destroy_process_group()


def build_titan(args, outdir):
    """torchtitan's model (parallelised by its own parallelize_llama, initialised), the method's loss and AdamW, as
    its Trainer builds them; returns them with the vocabulary size."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import parallel_dims as dims_module
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry, parallelize_llama

    config = model_registry("debugmodel" if args.tiny else TITAN_FLAVORS[args.model]).model
    if args.tiny:
        config.layers = config.layers[:2]
    if args.device == "cpu":
        dims_module.device_type = "cpu"  # torchtitan assumes an accelerator for its meshes
    # torchtitan's SDPA attention (causal), not its FlexAttention: that reads the block masks torchtitan's dataloader
    # builds from document boundaries (and has no backward on the CPU); the loss head is the same either way
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    parallelism = ParallelismConfig()
    training = TrainingConfig(seq_len=args.seq, mixed_precision_param="bfloat16")
    compile_config = CompileConfig(enable=True, components=["model", "loss"])
    parallel_dims = dims_module.ParallelDims.from_config(parallelism, world_size=1)
    config.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
    with torch.device("meta"):
        model = config.build()
    model = parallelize_llama(
        model,
        parallel_dims=parallel_dims,
        training=training,
        parallelism=parallelism,
        compile_config=compile_config,
        ac_config=SelectiveAC.Config(),  # llama3_8b()'s
        dump_folder=outdir,
    )
    model.to_empty(device=args.device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    if args.method == "plain":  # the model's own head, then the (compiled) loss on the logits
        loss_fn = CrossEntropyLoss.Config(global_vocab_size=config.vocab_size).build(compile_config=compile_config)
    else:
        if args.method == "stock":
            loss_config = ChunkedLossWrapper.Config(
                loss_fn=CrossEntropyLoss.Config(global_vocab_size=config.vocab_size)
            )
        else:
            from cce_inductor.integrations.torchtitan import CCELoss

            loss_config = CCELoss.Config()
        loss_fn = loss_config.build(compile_config=compile_config)
        loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
    return model, loss_fn, torch.optim.AdamW(model.parameters(), lr=3e-4), config.vocab_size


def train_titan(args, batch, outdir, peak):
    """--steps steps of torchtitan's forward / backward body and AdamW at this batch; returns the row's measured
    fields. ``peak``: an H.Peak, started."""
    from torchtitan.trainer import Trainer

    torch.manual_seed(args.seed)  # the same initial weights in every worker
    model, loss_fn, optimizer, vocab = build_titan(args, outdir)
    measured = {}
    if args.method == "cce":  # the path the op takes for these rows (CCELoss calls it directly: no pass)
        from cce_inductor import _dispatch, paths

        facts = _dispatch.head_facts(
            batch * args.seq,
            model.lm_head.weight.shape[1],
            vocab,
            torch.bfloat16,
            torch.device(args.device),
            "sum",
            needs_grad=True,
        )
        measured["pick"] = paths.choose(facts).path
    trainer = types.SimpleNamespace(train_context=contextlib.nullcontext, model_parts=[model], loss_fn=loss_fn)
    gen = torch.Generator().manual_seed(args.seed)
    timer, losses, warmup_peak = H.SyncedTimer(args.device), [], None
    for i in range(args.steps):
        if i == args.warmup:
            warmup_peak = peak.stop().gb
            peak.start()
        tokens = torch.randint(0, vocab, (batch, args.seq), generator=gen).to(args.device)
        labels = torch.randint(0, vocab, (batch, args.seq), generator=gen)
        labels[torch.rand(labels.shape, generator=gen) < 0.05] = IGNORE_INDEX
        labels = labels.to(args.device)
        timer.start()
        optimizer.zero_grad(set_to_none=True)
        loss = Trainer._forward_backward_body(trainer, tokens, labels, (labels != IGNORE_INDEX).sum(), {})
        optimizer.step()
        timer.stop()
        losses.append(float(loss))
    step_ms = statistics.median(timer.wall_ms[args.warmup :])
    return dict(
        measured,
        first_step_s=timer.wall_ms[0] / 1e3,
        step_ms=step_ms,
        tokens_s=batch * args.seq / (step_ms / 1e3),
        times_ms=[round(t, 2) for t in timer.wall_ms],
        peak_gb=peak.stop().gb,
        warmup_peak_gb=warmup_peak,
        losses=losses,
    )


def check_stats(args, st):
    """What cce_inductor.stats() says against what this method must show ("" when as expected)."""
    if args.method in ("stock", "plain"):
        return f"the pass ran in the {args.method} run: {st['summary']}" if st["graphs"] else ""
    if args.method == "cce_trl" or args.client == "titan":  # the op called directly: no site, its calls counted
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
        weights=args.weights,
        config="tiny" if args.tiny else dict(FD_MODELS[args.model][1]),
    )
    if args.client == "titan":
        meta["config"] = f"torchtitan llama3 {'debugmodel' if args.tiny else TITAN_FLAVORS[args.model]}"

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
        if args.client == "titan":
            titan_shim()
            import torchtitan.trainer  # noqa: F401

            meta["switch"] = "none: torchtitan's losses, CCELoss calls the op"
        elif args.method != "stock":
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
        H.append_row(args.out, print_row(new_row(args.batches[0], error=f"import: {H.err_text(exc)}")))
        return 0
    ind.force_disable_caches = True
    dyn.recompile_limit = max(getattr(dyn, "recompile_limit", 8), 64)
    rows = [r for r in H.read_rows(args.out) if r.get("kind") == "row"]
    done = {unit_key(r): r for r in rows} if args.resume else {}
    if any(k[:3] == (args.client, args.model, args.method) and (r["oom"] or r["error"]) for k, r in done.items()):
        return 0
    with one_rank(args.device) if args.client == "titan" else contextlib.nullcontext():
        return grow(args, new_row, rows, done)


def grow(args, new_row, rows, done):
    """The batches in turn, each a row, until one does not fit or fails; the worker's exit code."""
    import cce_inductor

    train = train_titan if args.client == "titan" else train_once
    slowest = 0.0
    for b in [b for b in args.batches if (args.client, args.model, args.method, b) not in done]:
        seen = [r["wall_s"] or 0 for r in rows if (r["client"], r["model"], r["batch"]) == (args.client, args.model, b)]
        if H.past_deadline(args.deadline, 1.2 * max(seen + [slowest])):
            print(f"# {args.client} {args.model} {args.method}: deadline: batch {b} not started", flush=True)
            return 0
        row = new_row(b)
        began = time.time()
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        cce_inductor.reset_stats()
        peak = H.Peak(args.device).start()
        row["start_gb"] = peak.start_gb  # what an earlier batch of this process left allocated (should be ~0)
        fatal = False
        try:
            with tempfile.TemporaryDirectory() as outdir:
                measured = train(args, b, outdir, peak)
            st = cce_inductor.stats()
            row.update(H.stats_fields(st))
            row.update(measured)
            row["check"] = check_stats(args, st) or None
        except Exception as exc:  # noqa: BLE001 - recorded; OOM ends the growth
            fatal = H.fatal_cuda(exc)  # not the exception itself: its frames hold the batch's tensors
            row["oom" if H.is_oom(exc) else "error"] = H.err_text(exc)
        torch._dynamo.reset()
        H.free(args.device)
        row["wall_s"] = round(time.time() - began, 1)
        slowest = max(slowest, row["wall_s"])
        H.append_row(args.out, print_row(row))
        if row["oom"] or row["error"]:
            return 3 if fatal else 0
    return 0


def print_row(r):
    f = H.fmt
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
    f = H.fmt
    by = {unit_key(r): r for r in rows}
    body = []
    for (client, model, method, b), r in sorted(by.items()):
        base = BASELINE.get(client, "stock")
        s = by.get((client, model, base, b), {})
        if method != base:
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
    steps = H.md_table(
        [
            "client",
            "model",
            "method",
            "batch",
            "baseline ms / GB",
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
        base = BASELINE.get(unit[0], "stock")
        mine_best, base_best = best(unit), best((*unit[:2], base))
        ratio_best = f" ({mine_best / base_best:.2f}x)" if mine_best and base_best and unit[2] != base else ""
        top.append([*unit, largest, f(mine_best, ".0f") + ratio_best, end if end and not fit else ""])
    return (
        steps
        + "\n\n"
        + H.md_table(["client", "model", "method", "largest batch", "best tok/s (x the baseline's)", "note"], top)
    )


def results(args, units):
    """The latest row per (client, model, method, batch) of these units in --out, and the units not finished."""
    rows = [
        r
        for r in H.latest(H.read_rows(args.out), unit_key)
        if r.get("seq") in (args.seq, None) and (r["client"], r["model"], r["method"]) in units
    ]
    ended = {unit_key(r)[:3] for r in rows if r.get("oom") or r.get("error")}
    have = {unit_key(r) for r in rows}
    return rows, [u for u in units if u not in ended and any((*u, b) not in have for b in args.batches)]


def driver(args, argv):
    os.environ["TRAINERS_BENCH_COMMAND"] = " ".join(shlex.quote(a) for a in [sys.argv[0], *argv])
    deadline = time.time() + args.deadline if args.deadline else 0.0
    child = H.strip_flags(argv, {"--clients", "--models", "--methods", "--out", "--deadline"})
    units = [
        (c, m, meth)
        for c in args.clients
        for m in args.models
        for meth in CLIENTS[c]
        if meth in args.methods and (c != "titan" or m in TITAN_FLAVORS)
    ]
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
            **({} if method == "stock" or client == "titan" else {"CCE_INDUCTOR": "1"}),
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
        print(f"# worker: {'CCE_INDUCTOR=1 ' if 'CCE_INDUCTOR' in env else ''}{shlex.join(cmd[1:])}", flush=True)
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)  # its own group: its compile workers too
        try:
            rc = proc.wait(timeout=max(deadline - time.time() + 20, 1) if deadline else None)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            print(f"# {client} {model} {method}: killed at the deadline (its batch: not recorded)", flush=True)
            break
        if rc not in (0, 3):
            H.append_row(
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
    ap.add_argument("--clients", default="trainer,peft,sft", help="comma list of trainer, peft, sft, titan")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
    ap.add_argument(
        "--methods",
        default=",".join(dict.fromkeys(m for ms in CLIENTS.values() for m in ms)),
        help="comma list of stock, cce, cce_trl (sft only), plain (titan only); each client runs those it has "
        "(default: all)",
    )
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
    ap.add_argument(
        "--weights",
        choices=("fp32-autocast", "bf16"),
        default="fp32-autocast",
        help="the model's weights: fp32 under the Trainer's bf16 autocast (default), or bf16 themselves (their "
        "gradients 16-bit: the balanced path's plain sums, computed at num_items_in_batch's scale); rows do not key "
        "on it: give each its own --out",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("--client", "--model", "--method", "--until"):  # the worker's unit; the driver's deadline
        ap.add_argument(name, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.clients, args.models, args.methods = (x.split(",") for x in (args.clients, args.models, args.methods))
    for name, got, known in (
        ("client", args.clients, CLIENTS),
        ("model", args.models, MODELS),
        ("method", args.methods, {m for ms in CLIENTS.values() for m in ms}),
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
    return H.finish_args(ap, args, "trainers", hint="--device cpu --tiny")


if __name__ == "__main__":
    sys.exit(H.main(None, parse_args, worker, driver))
