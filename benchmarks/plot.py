"""Plot the loss curves written by ``examples/train_e2e.py`` (one PNG per JSON file).

    python examples/plot_curves.py results/e2e_gemma2.json results/e2e_llama3.json --out docs/
"""

from __future__ import annotations

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def running_mean(values, window):
    return [sum(values[i : i + window]) / window for i in range(len(values) - window + 1)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("files", nargs="+")
    parser.add_argument("--out", default=".")
    parser.add_argument("--window", type=int, default=20)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for path in args.files:
        with open(path) as handle:
            run = json.load(handle)
        figure, axis = plt.subplots(figsize=(7, 4))
        for result in run["results"]:
            label = {"compile": "torch.compile", "cce": "cce_inductor"}.get(result["mode"], result["mode"])
            axis.plot(result["losses"], alpha=0.25, linewidth=0.8)
            axis.plot(
                range(args.window - 1, len(result["losses"])),
                running_mean(result["losses"], args.window),
                label=f"{label} ({args.window}-step mean)",
                color=axis.lines[-1].get_color(),
            )
        first = run["results"][0]
        axis.set_title(
            f"{first['model']}: batch {first['batch']} x {first['seq']} tokens, {first['layers']} layers, bf16, "
            f"{run['device']}",
            fontsize=9,
        )
        axis.set_xlabel("step")
        axis.set_ylabel("training loss")
        axis.legend()
        figure.tight_layout()
        target = os.path.join(args.out, os.path.basename(path).replace(".json", ".png"))
        figure.savefig(target, dpi=120)
        print(target)


if __name__ == "__main__":
    main()
