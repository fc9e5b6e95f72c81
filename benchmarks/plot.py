"""Plots of the benchmark results in ``benchmarks/results/`` (one PNG per input file).

    python benchmarks/plot.py ratios benchmarks/results/2026-11-24_h100_heads_v12.json --out /tmp/plots
    python benchmarks/plot.py ratios benchmarks/results/2026-11-24_h*_heads_v12.json --mode fwd
    python benchmarks/plot.py curves benchmarks/results/2026-12-03_h200_train-e2e-realtext-qwen25-0.5b_v54.json \
        --out docs
    python benchmarks/plot.py grid benchmarks/results/2026-11-25_h100_vocab-grid.jsonl --n 8192 --out /tmp/plots

``ratios``: a JSON written by ``benchmarks/benchmark.py --json``: per head (shape, data regime and loss form) one bar
per method, its time as a multiple of torch.compile's in the same process (the rows' ``vs_compile``), for one mode
(``fwdbwd`` by default). The methods ``compile`` (1.0 by definition) and ``matmul`` (forward only) are left out
unless named in ``--methods``. Also prints the plotted numbers as a markdown table.

``grid``: JSON lines written by ``benchmarks/vocab_grid.py`` (several files: a later file's row replaces an earlier
one's for the same head, N, ignored share, shapes and method): per head, the time and the peak of each method as a
multiple of torch.compile's in the same process (the same file's torch.compile row for that head), two panels, for
one N / ignored share / shapes; the default's pick
under its bar. One PNG for all the files (named after the first), and the plotted numbers as a markdown table.

``curves``: ``benchmarks/train_e2e.py``'s runs (its results folder, or the combined JSON of one): per weights and
ignored share, every run's training loss as a running mean over ``--window`` steps with its held-out losses, and
under it each run relative to stock's mean run; runs coloured by family, each family's mean run bold.

The title of each plot names the device, torch and Triton versions the file records.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import OrderedDict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as H

# benchmark.py's method names; the others are plotted under their own name
LABELS = {
    "cce": "linear_cross_entropy, lean",
    "pass_cce": "torch.compile + the pass, lean",
    "cce_balanced": "linear_cross_entropy, balanced",
    "pass_balanced": "torch.compile + the pass, balanced",
}


def _target(path: str, out: str, suffix: str) -> str:
    os.makedirs(out, exist_ok=True)
    return os.path.join(out, os.path.basename(path).rsplit(".", 1)[0] + suffix + ".png")


def _title(run: dict) -> str:
    parts = [run.get("device", "?"), f"torch {run.get('torch', '?')}"]
    if run.get("triton"):
        parts.append(f"Triton {run['triton']}")
    return ", ".join(parts)


def ratios(path: str, mode: str, methods: list[str] | None, out: str) -> str:
    """Bar chart of time / torch.compile's per head and method; returns the PNG's path."""
    with open(path) as handle:
        run = json.load(handle)
    rows = [r for r in run.get("rows", []) if r.get("mode") == mode and r.get("vs_compile") is not None]
    if not rows:
        raise SystemExit(
            f"{path}: no rows of mode {mode!r} with a ratio to torch.compile "
            "(is it a benchmarks/benchmark.py --json file?)"
        )
    skip = {"compile", "matmul"}
    keep = [m for m in OrderedDict.fromkeys(r["method"] for r in rows) if (m in methods if methods else m not in skip)]
    for r in rows:  # a loss form other than the plain cross-entropy names itself beside the regime
        r["regime"] += "" if r.get("form", "ce") == "ce" else f", {r['form']}"
    heads = list(OrderedDict.fromkeys((r["shape"], r["regime"]) for r in rows))
    value = {(r["shape"], r["regime"], r["method"]): r["vs_compile"] for r in rows}

    print(f"{path}: {mode}, time / torch.compile ({_title(run)})")
    print("| head, data | " + " | ".join(keep) + " |")
    print("| --- |" + " --- |" * len(keep))
    for shape, regime in heads:
        cells = [f"{value[(shape, regime, m)]:.2f}x" if (shape, regime, m) in value else "" for m in keep]
        print(f"| {shape}, {regime} | " + " | ".join(cells) + " |")

    figure, axis = plt.subplots(figsize=(max(6.0, 1.2 * len(heads) * max(1, len(keep)) / 2), 4))
    width = 0.8 / max(1, len(keep))
    for i, method in enumerate(keep):
        xs = [h + (i - (len(keep) - 1) / 2) * width for h in range(len(heads))]
        ys = [value.get((shape, regime, method), float("nan")) for shape, regime in heads]
        axis.bar(xs, ys, width, label=LABELS.get(method, method))
    axis.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    axis.set_xticks(range(len(heads)))
    axis.set_xticklabels([f"{shape}\n{regime}" for shape, regime in heads], fontsize=8)
    axis.set_ylabel(f"{mode} time / torch.compile's")
    n = run.get("settings", {}).get("n")
    axis.set_title(f"{_title(run)}" + (f", N {n}" if n else ""), fontsize=9)
    axis.legend(fontsize=8)
    figure.tight_layout()
    target = _target(path, out, f"_{mode}")
    figure.savefig(target, dpi=120)
    plt.close(figure)
    return target


GRID_METHODS = ("default", "lean", "balanced", "trl", "liger", "apple_cce")


def grid(paths: list[str], n: int, ignore: int, shapes: str, out: str) -> str:
    """Time and peak / torch.compile's per head and method of ``vocab_grid.py`` rows; returns the PNG's path."""
    latest, header = OrderedDict(), {}  # (head, method) -> (row, torch.compile's row of the same file)
    for path in paths:
        rows = H.read_rows(path)
        header = header or next((r for r in rows if r.get("kind") == "header"), {})
        case = [
            r
            for r in rows
            if r.get("kind") == "row"
            and r.get("fwdbwd_ms")
            and (r["n"], r["ignore_pct"], r["shapes"]) == (n, ignore, shapes)
        ]
        compiled = {r["head"]: r for r in case if r["method"] == "compile"}
        for row in case:  # a ratio only against torch.compile timed in the same process (the same file and head)
            if row["head"] in compiled:
                latest[(row["head"], row["method"])] = (row, compiled[row["head"]])
    heads = list(OrderedDict.fromkeys(head for head, method in latest if method == "compile"))
    if not heads:
        raise SystemExit(f"no vocab_grid.py rows with torch.compile at N {n}, {ignore}% ignored, {shapes} shapes")
    keep = [m for m in GRID_METHODS if any((h, m) in latest for h in heads)]

    def ratio(head, method, column):
        row, base = latest.get((head, method), (None, None))
        return row[column] / base[column] if row and row.get(column) and base.get(column) else float("nan")

    print(f"N {n}, {ignore}% ignored, {shapes} shapes ({_title(header)}): time / peak as multiples of torch.compile's")
    print("| head (D, V) | " + " | ".join(keep) + " |")
    print("| --- |" + " --- |" * len(keep))
    for head in heads:
        d, v = latest[(head, "compile")][0]["d"], latest[(head, "compile")][0]["v"]
        cells = [
            f"{ratio(head, m, 'fwdbwd_ms'):.2f}x / {ratio(head, m, 'peak_mb'):.2f}x" if (head, m) in latest else ""
            for m in keep
        ]
        print(f"| {head} ({d}, {v}) | " + " | ".join(cells) + " |")

    figure, axes = plt.subplots(2, 1, figsize=(max(7.0, 1.1 * len(heads)), 7), sharex=True)
    width = 0.8 / max(1, len(keep))
    top = 2.5  # the peers' slowest bars (up to ~8x) are cut here and labelled with their value
    for axis, column, label in ((axes[0], "fwdbwd_ms", "fwd+bwd time"), (axes[1], "peak_mb", "peak memory")):
        for i, method in enumerate(keep):
            xs = [h + (i - (len(keep) - 1) / 2) * width for h in range(len(heads))]
            ys = [ratio(head, method, column) for head in heads]
            axis.bar(xs, [min(y, top) for y in ys], width, label=method)
            for x, y in zip(xs, ys):
                if y > top:
                    axis.text(x, top, f"{y:.1f}", ha="center", va="bottom", fontsize=6)
        axis.set_ylim(0, top * 1.08)
        axis.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        if column == "peak_mb":
            axis.axhline(0.5, color="gray", linewidth=0.8, linestyle=":")
        axis.set_ylabel(f"{label} / torch.compile's")
    picks = [(latest.get((head, "default"), ({}, None))[0]).get("pick") or "" for head in heads]
    axes[1].set_xticks(range(len(heads)))
    axes[1].set_xticklabels([f"{head}\n{pick}" for head, pick in zip(heads, picks)], fontsize=7, rotation=30)
    axes[0].set_title(f"{_title(header)}; N {n}, {ignore}% ignored, {shapes} shapes", fontsize=9)
    axes[1].legend(fontsize=7, ncol=len(keep), loc="upper right")
    figure.tight_layout()
    target = _target(paths[0], out, f"_n{n}_ign{ignore}_{shapes}")
    figure.savefig(target, dpi=120)
    plt.close(figure)
    return target


def curves(path: str, window: int, out: str) -> str:
    """Loss curves of ``train_e2e.py`` runs (a results folder or the combined JSON of one): per (weights, ignored
    share) a panel of the training loss's running means over ``window`` steps with the held-out losses as points,
    and under it each run's running mean relative to stock's (torch.compile and eager, averaged step by step as
    ``train_e2e.compare`` judges them), with the issue's 1 % band. Runs are coloured by family (stock, each method):
    single runs thin, each family's mean run bold; returns the PNG's path."""
    import train_e2e

    runs = train_e2e.load_runs(path)
    groups = sorted({(r["weights"], r["prompt_mask"]) for r in runs}, key=lambda g: (g[1], g[0] != "bf16"))
    family_of = {"compile": "stock", "eager": "stock"}
    names = ["stock"] + sorted({r["method"] for r in runs} - set(family_of))
    colours = {name: "gray" if name == "stock" else f"C{k}" for k, name in enumerate(names)}
    figure, axes = plt.subplots(2, len(groups), figsize=(5 * len(groups), 7), squeeze=False, sharex=True)
    for column, (weights, mask) in enumerate(groups):
        members = [r for r in runs if (r["weights"], r["prompt_mask"]) == (weights, mask)]
        families = {}
        for run in members:
            families.setdefault(family_of.get(run["method"], run["method"]), []).append(run)
        stock_mean = train_e2e.running_means(train_e2e.mean_run(families["stock"])["losses"], window)
        top, bottom = axes[0][column], axes[1][column]
        for name in names:
            family = families.get(name, [])
            if not family:
                continue
            colour = colours[name]
            for run in family:
                mean = train_e2e.running_means(run["losses"], window)
                steps = range(window, len(run["losses"]) + 1)
                top.plot(steps, mean, color=colour, linewidth=0.6, alpha=0.35)
                top.plot(*zip(*run["held_out"]), "o", color=colour, markersize=2.5, alpha=0.6)
                relative = [100 * (m / b - 1) for m, b in zip(mean, stock_mean)]
                bottom.plot(steps, relative, color=colour, linewidth=0.6, alpha=0.35)
            mean = train_e2e.running_means(train_e2e.mean_run(family)["losses"], window)
            steps = range(window, len(mean) + window)
            label = f"{name} (mean of {len(family)})" if len(family) > 1 else name
            top.plot(steps, mean, color=colour, linewidth=1.6, label=label)
            bottom.plot(steps, [100 * (m / b - 1) for m, b in zip(mean, stock_mean)], color=colour, linewidth=1.6)
        top.set_ylim(min(stock_mean) * 0.97, stock_mean[min(len(stock_mean) - 1, 100)] * 1.05)
        top.set_title(f"{weights} weights, {100 * mask:.0f}% of targets ignored", fontsize=9)
        top.legend(fontsize=7)
        bottom.axhspan(-1, 1, color="gray", alpha=0.15)
        bottom.set_ylim(-3, 3)
        bottom.set_xlabel("step")
    axes[0][0].set_ylabel(f"training loss, {window}-step mean (points: held-out)")
    axes[1][0].set_ylabel("vs stock's mean run, %")
    first = runs[0]
    figure.suptitle(
        f"{first['model']} ({first['parameters'] / 1e6:.0f}M), batch {first['batch']} x {first['seq']} tokens of "
        f"real text, {first['device']}, torch {first['torch']}; thin: single runs, bold: each family's mean",
        fontsize=10,
    )
    figure.tight_layout()
    target = _target(path.rstrip("/"), out, "_curves")
    figure.savefig(target, dpi=110)
    plt.close(figure)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="kind", required=True)
    p_ratios = sub.add_parser("ratios", help="time / torch.compile per head, from a benchmark.py JSON")
    p_ratios.add_argument("files", nargs="+")
    p_ratios.add_argument("--mode", default="fwdbwd", choices=("fwd", "fwdbwd"))
    p_ratios.add_argument("--methods", default="", help="comma-separated methods (default: all but compile, matmul)")
    p_ratios.add_argument("--out", default=".")
    p_grid = sub.add_parser("grid", help="time and peak / torch.compile per head, from vocab_grid.py JSON lines")
    p_grid.add_argument("files", nargs="+")
    p_grid.add_argument("--n", type=int, default=8192)
    p_grid.add_argument("--ignore", type=int, default=0)
    p_grid.add_argument("--shapes", default="static", choices=("static", "dynamic"))
    p_grid.add_argument("--out", default=".")
    p_curves = sub.add_parser("curves", help="loss curves, from train_e2e.py's runs")
    p_curves.add_argument("files", nargs="+")
    p_curves.add_argument("--window", type=int, default=50)
    p_curves.add_argument("--out", default=".")
    args = parser.parse_args()
    if args.kind == "grid":
        print(grid(args.files, args.n, args.ignore, args.shapes, args.out))
        return
    for path in args.files:
        if args.kind == "ratios":
            print(ratios(path, args.mode, [m for m in args.methods.split(",") if m], args.out))
        else:
            print(curves(path, args.window, args.out))


if __name__ == "__main__":
    main()
