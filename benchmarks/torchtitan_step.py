"""torchtitan at real size: its own model, parallelisation and loss wiring, stock loss against ``CCELoss`` (issue 29).

torchtitan's llama3 "1B" model (Llama-3.2-1B: 16 layers, D 2048, V 128256) from its model registry, built on the meta
device and parallelised by torchtitan's own ``parallelize_llama`` on one rank: per-block ``torch.compile``, selective
activation checkpointing, FSDP2's mixed precision (bf16 parameters, fp32 reductions), as ``llama3_8b()``'s config
does; AdamW; trained through torchtitan's own ``Trainer._forward_backward_body`` with the loss wired as
``Trainer.__init__`` wires a ``ChunkedLossWrapper`` (``set_lm_head``, ``model._skip_lm_head = True``). Methods:

    stock   ChunkedLossWrapper(CrossEntropyLoss)   torchtitan's default for language models (its head in eager chunks)
    cce     CCELoss                               cce_inductor.integrations.torchtitan: head + loss as one fused op
    plain   CrossEntropyLoss                      the model's head, then torchtitan's compiled loss on the logits
                                                  (no chunks: the baseline where ChunkedLossWrapper fails, below)

The ratios are against the first method of ``--methods``. Attention: torchtitan's SDPA (causal) on every device,
in place of the FlexAttention of its llama3 flavours, whose block masks its dataloader builds.

Data: random tokens and labels (5% set to -100), sequences of --seq. Per batch size: the median step time (forward,
backward, optimizer) after --warmup steps, tokens/s, peak GB (``torch.cuda.max_memory_allocated``), each step's loss.
One worker process per (method, batch): fresh Dynamo state, every compile from scratch.

What this does not use from torchtitan: its ``Trainer`` object (dataloader, tokenizer, checkpointing, metrics), which
needs its repository's assets; the model, parallelisation, loss and forward / backward body are torchtitan's.

Reproduce (one CUDA GPU; torchtitan 0.3.0 and what it imports beyond a torch + transformers install on PYTHONPATH:
torchtitan, spmd_types, tyro, docstring_parser, rich, pygments, markdown-it-py, mdurl, typeguard, shtab, torchdata,
tensorboard, tensorboard-data-server, absl-py, protobuf, markdown, werkzeug, einops, torch_checkpointing, and
``datasets`` with its dependencies, as cp312 wheels: the device calls keep them in ``.whl-titan/`` and
``.whl-datasets/``):

    python -m pip install -q --no-index --no-deps --target /tmp/site .whl-titan/*.whl .whl-datasets/*.whl
    PYTHONPATH=/tmp/site python benchmarks/torchtitan_step.py --methods plain,cce,stock --batches 1,2,4,8 \
        --out $OUT/torchtitan.jsonl
    python benchmarks/torchtitan_step.py --device cpu --tiny          # CPU smoke: the debug model, 2 layers, ~30 s

Run on an H100 and an H200 with torch 2.11 (2026-11-25, engineering log v17; ``benchmarks/results/*torchtitan*_v17*``):
there torchtitan 0.3.0 needs ``_older_torch_shim`` below, and its ``ChunkedLossWrapper`` (``stock``) fails in its
backward, so ``plain`` is the baseline; on torch >= 2.12 neither applies.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
import types

IGNORE_INDEX = -100


def _older_torch_shim() -> None:
    """torchtitan 0.3.0 imports ``torch.distributed.fsdp.DataParallelMeshDims`` (torch >= 2.12) at module level. On an
    older torch (the device's 2.11) a stand-in class lets it import; on one rank torchtitan never builds one (the
    stand-in raises if it did), so its default SPMD backend runs unchanged. Idempotent."""
    import torch.distributed.fsdp as fsdp

    if hasattr(fsdp, "DataParallelMeshDims"):
        return

    class DataParallelMeshDims:  # never instantiated on one rank
        def __init__(self, *args, **kwargs):
            raise RuntimeError("DataParallelMeshDims needs torch >= 2.12")

    fsdp.DataParallelMeshDims = DataParallelMeshDims


def build(flavor: str, layers: int, device: str, seq: int, method: str, compile_model: bool):
    """The model (parallelised, initialised), the loss and the optimizer, as torchtitan's Trainer builds them."""
    import torch

    _older_torch_shim()
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import parallel_dims as dims_module
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry, parallelize_llama

    config = model_registry(flavor).model
    if layers:
        config.layers = config.layers[:layers]
    if device == "cpu":
        dims_module.device_type = "cpu"  # torchtitan assumes an accelerator for its meshes
    # torchtitan's SDPA attention (causal), not its FlexAttention: that reads the block masks torchtitan's dataloader
    # builds from document boundaries (and has no backward on the CPU); the loss head is the same either way
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    parallelism = ParallelismConfig()
    training = TrainingConfig(seq_len=seq, mixed_precision_param="bfloat16")
    compile_config = CompileConfig(enable=compile_model, components=["model", "loss"])
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
        dump_folder="/tmp/torchtitan_step",
    )
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    if method == "plain":  # the model's own head, then the (compiled) loss on the logits
        loss_fn = CrossEntropyLoss.Config(global_vocab_size=config.vocab_size).build(compile_config=compile_config)
    else:
        if method == "stock":
            loss_config = ChunkedLossWrapper.Config(
                loss_fn=CrossEntropyLoss.Config(global_vocab_size=config.vocab_size)
            )
        else:
            from cce_inductor.integrations.torchtitan import CCELoss

            loss_config = CCELoss.Config()
        loss_fn = loss_config.build(compile_config=compile_config)
        loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    return model, loss_fn, optimizer, config.vocab_size


def worker(args) -> dict:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1)
    if args.device == "cuda":
        torch.cuda.set_device(0)
    _older_torch_shim()
    from torchtitan.trainer import Trainer

    import cce_inductor

    row = {"method": args.method, "batch": args.batch, "seq": args.seq, "flavor": args.flavor}
    try:
        torch.manual_seed(args.seed)  # the same initial weights in every worker
        model, loss_fn, optimizer, vocab = build(
            args.flavor, args.layers, args.device, args.seq, args.method, compile_model=not args.no_compile
        )
        if args.method == "cce":  # the path the op takes for these rows (CCELoss calls it directly: no pass)
            from cce_inductor import _dispatch, paths

            facts = _dispatch.head_facts(
                args.batch * args.seq,
                model.lm_head.weight.shape[1],
                vocab,
                torch.bfloat16,
                torch.device(args.device),
                "sum",
                needs_grad=True,
            )
            row["pick"] = paths.choose(facts).path
        trainer = types.SimpleNamespace(train_context=contextlib.nullcontext, model_parts=[model], loss_fn=loss_fn)
        gen = torch.Generator().manual_seed(args.seed)
        times, losses = [], []
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for _ in range(args.warmup + args.steps):
            tokens = torch.randint(0, vocab, (args.batch, args.seq), generator=gen).to(args.device)
            labels = torch.randint(0, vocab, (args.batch, args.seq), generator=gen)
            labels[torch.rand(labels.shape, generator=gen) < 0.05] = IGNORE_INDEX
            labels = labels.to(args.device)
            _sync(args.device)
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = Trainer._forward_backward_body(trainer, tokens, labels, (labels != IGNORE_INDEX).sum(), {})
            optimizer.step()
            _sync(args.device)
            times.append(1e3 * (time.perf_counter() - t0))
            losses.append(float(loss))
        timed = sorted(times[args.warmup :])
        row.update(
            first_step_s=times[0] / 1e3,
            step_ms=timed[len(timed) // 2],
            times_ms=times,
            losses=losses,
            tokens_s=args.batch * args.seq / (timed[len(timed) // 2] / 1e3),
            peak_gb=torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None,
            stats=cce_inductor.stats().get("executions"),
        )
    except torch.OutOfMemoryError:
        row["oom"] = True
    finally:
        dist.destroy_process_group()
    return row


def _sync(device):
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="stock,cce")
    ap.add_argument("--batches", default="1,2,4")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048; --tiny 64)")
    ap.add_argument("--flavor", default=None, help="torchtitan llama3 flavour (default 1B; --tiny debugmodel)")
    ap.add_argument("--layers", type=int, default=0, help="keep the first LAYERS layers (default all; --tiny 2)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the debug model, 2 layers, seq 64 (a smoke run)")
    ap.add_argument("--no-compile", action="store_true", help="leave torchtitan's per-block compile off")
    ap.add_argument("--out", default=None, help="JSON lines, appended (default: print only)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--method", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.seq = args.seq or (64 if args.tiny else 2048)
    args.flavor = args.flavor or ("debugmodel" if args.tiny else "1B")
    args.layers = args.layers or (2 if args.tiny else 0)
    if args.worker:
        print("ROW " + json.dumps(worker(args)), flush=True)
        return
    rows = []
    for batch in map(int, args.batches.split(",")):
        for method in args.methods.split(","):
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--worker",
                "--method",
                method,
                "--batch",
                str(batch),
                "--seq",
                str(args.seq),
                "--flavor",
                args.flavor,
                "--layers",
                str(args.layers),
                "--steps",
                str(args.steps),
                "--warmup",
                str(args.warmup),
                "--device",
                args.device,
                "--seed",
                str(args.seed),
            ]
            cmd += ["--no-compile"] if args.no_compile else []
            proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
            found = [line[4:] for line in proc.stdout.splitlines() if line.startswith("ROW ")]
            row = (
                json.loads(found[-1])
                if found
                else {"method": method, "batch": batch, "error": (proc.stderr or proc.stdout)[-2000:]}
            )
            rows.append(row)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
            print(_line(row), flush=True)
    baseline = args.methods.split(",")[0]  # the ratios' denominator: the first method named
    stock = {r["batch"]: r for r in rows if r["method"] == baseline and "step_ms" in r}
    print(
        f"\n| batch | method | step ms | tokens/s | peak GB | x {baseline} time | x {baseline} peak | loss rel. diff |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "step_ms" not in r:
            continue
        base = stock.get(r["batch"])
        ratios = [f"{r[k] / base[k]:.2f}x" if base and base.get(k) and r.get(k) else "" for k in ("step_ms", "peak_gb")]
        diff = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], base["losses"])) if base else None
        peak = f"{r['peak_gb']:.1f}" if r.get("peak_gb") is not None else ""
        print(
            f"| {r['batch']} | {r['method']} | {r['step_ms']:.1f} | {r['tokens_s']:.0f} | {peak} | "
            f"{ratios[0]} | {ratios[1]} | {'' if diff is None else f'{diff:.1e}'} |"
        )


def _line(row):
    if "error" in row:
        return f"{row['method']} batch={row['batch']}: ERROR {row['error'][-600:]}"
    if row.get("oom"):
        return f"{row['method']} batch={row['batch']}: out of memory"
    return (
        f"{row['method']:6s} batch={row['batch']} first step {row['first_step_s']:.1f} s, step {row['step_ms']:.1f}"
        f" ms, {row['tokens_s']:.0f} tok/s, peak {row['peak_gb']} GB, losses {row['losses'][:3]}"
    )


if __name__ == "__main__":
    main()
