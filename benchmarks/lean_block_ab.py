"""The lean backward's G block, A/B in one process per call: interleaved rounds of each variant with torch.compile's
fwd+bwd beside it (its own function, a fresh Dynamo state per cell); bf16, LM-like data (vocab_grid's), IGNORE % of
the targets ignored (default 0); ms = median of the rounds (each a triton do_bench of rep 300 ms), MB above the
inputs. CUDA only.

    MODE=tiles  the lean path called directly; CONFIGS = vocab_chunk:recompute_group pairs (the kernels' _TUNING
                patched, the budget's widening off); recompute_group 1048576 = one group over the whole block (the
                recompute's tiles without column groups). HEADS (vocab_grid's names), N.
    MODE=widen  the default through the op, paths.lean_widen as decided against it forced to 1; CELLS = head:N.
                With IGNORE >= 10 the op's later calls take the counted-prefix products, whose widening is decided
                with their fp32 dC sums counted (>= 60% ignored, or >= 40% with SPREAD: the row-skipping products);
                SPREAD = S runs vocab_grid's 8 target sets, IGNORE +- S %, in each timed run (ms per set);
                WIDENS=1,2,4 forces those widths instead; PEERS=trl adds TRL's head (vocab_grid's, on the valid rows)
                to each round.
    ROUNDS      interleaved rounds (default 3).

Usage: MODE=tiles HEADS=gemma2,llama3 CONFIGS=4096:4096,16384:4096 python benchmarks/lean_block_ab.py
       MODE=widen IGNORE=50 WIDENS=1,2,4 PEERS=trl CELLS=gemma2:8192 python benchmarks/lean_block_ab.py
"""

import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
import _common as C  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import vocab_grid as G  # noqa: E402

import cce_inductor  # noqa: E402
from cce_inductor import _planning, paths  # noqa: E402
from cce_inductor.kernels import _backward as B  # noqa: E402

MODE = os.environ.get("MODE", "tiles")
ROUNDS = int(os.environ.get("ROUNDS", "3"))
IGNORE = float(os.environ.get("IGNORE", "0"))
SPREAD = float(os.environ.get("SPREAD", "0"))  # > 0: a timed run takes vocab_grid's 8 target sets, IGNORE +- SPREAD
# the op's counted-prefix products after the first call, else cuBLAS over every row or the row-skipping products
# alone (cce_inductor/_counted_share.py)
PREFIX = 10 <= IGNORE < (40 if SPREAD > 10 else 60)
TUNE = B._TUNING["gpu"]
LAYOUT = _planning.LEAN_LAYOUT["gpu"]
TUNED = (LAYOUT["block_cols"], TUNE["recompute_group"])
LEAN_WIDEN = paths.lean_widen


def tile_variants():
    """(label, setup) per CONFIGS pair: the lean path with that G block width and tile group, no budget widening."""
    pairs = os.environ.get("CONFIGS", "4096:1048576,4096:4096,8192:4096,16384:4096,16384:1048576").split(",")
    out = []
    for w, g in (tuple(int(x) for x in p.split(":")) for p in pairs):

        def setup(w=w, g=g):
            LAYOUT["block_cols"], TUNE["recompute_group"] = w, g
            paths.lean_widen = lambda *a, **k: 1

        out.append((f"w{w}/g{g}", setup))
    return out


def widen_variants(facts):
    """(label, setup): the budget's widening forced to 1, then as decided (where that is more than 1), or WIDENS."""
    k = LEAN_WIDEN(facts, 8192, PREFIX)

    def forced(w):
        def setup():
            paths.lean_widen = lambda *a, **kw: w

        return setup

    widens = (
        [int(w) for w in os.environ["WIDENS"].split(",")] if "WIDENS" in os.environ else ((1, k) if k != 1 else (1,))
    )
    return [(f"widen {w}", forced(w)) for w in widens]


def reset():
    LAYOUT["block_cols"], TUNE["recompute_group"] = TUNED
    paths.lean_widen = LEAN_WIDEN


def run_cell(head, n):
    d, v = G.HEADS[head]
    facts = paths.HeadFacts(rows=n, hidden=d, vocab=v, element_size=2, kernels=True, reduction="mean", needs_grad=True)
    if MODE == "tiles":
        opts, variants, title = cce_inductor.CCEOptions(path="lean"), tile_variants(), f"{head} (D {d}, V {v})"
    else:
        opts, variants = cce_inductor.CCEOptions(), widen_variants(facts)
        spread = f" +- {SPREAD:g}" if SPREAD else ""
        title = (
            f"{head} N {n} (D {d}, V {v}) ignored {IGNORE:g}{spread}% pick {paths.choose(facts).path} "
            f"widen {LEAN_WIDEN(facts, 8192, PREFIX)}"
        )
    e, c, t = G.make_data(n, d, v, IGNORE, "cuda", 0, spread=SPREAD)
    sets = t if SPREAD else [t]
    e.requires_grad_(True)
    c.requires_grad_(True)
    torch._dynamo.reset()

    def loss(e, c, t):
        return F.cross_entropy(F.linear(e, c).float(), t, ignore_index=G.IGNORE)

    compiled = torch.compile(loss)

    def every_set(fn):  # one run: a fwd+bwd per target set (timings below are per set)
        def run():
            for tt in sets:
                e.grad = c.grad = None
                fn(e, c, tt).backward()

        return run

    runs = {
        "compile": every_set(compiled),
        "ours": every_set(
            lambda e, c, t: cce_inductor.linear_cross_entropy(e, c, t, ignore_index=G.IGNORE, options=opts)
        ),
    }
    peers = G.find_peers("cuda")[0] if os.environ.get("PEERS") else {}
    for name in os.environ.get("PEERS", "").split(",") if peers else ():
        runs[name] = every_set(peers[name])

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=3, rep=300, grad_to_none=[e, c], return_mode="median") / len(sets)

    def peak(fn):
        e.grad = c.grad = None
        return C.cuda_peak_mb(fn)

    plain = [name for name in runs if name != "ours"]  # torch.compile, then the peers
    ms = {name: [] for name in plain}
    ms.update({label: [] for label, _ in variants})
    mb, grads = {}, {}
    for rnd in range(ROUNDS):
        for name in plain:
            ms[name].append(bench(runs[name]))
            if rnd == 0:
                mb[name] = peak(runs[name])
        for label, setup in variants:
            setup()
            ms[label].append(bench(runs["ours"]))
            if rnd == 0:
                mb[label] = peak(runs["ours"])
                grads[label] = (e.grad.float().clone(), c.grad.float().clone())
            reset()
    base_ms = statistics.median(ms["compile"])
    first = grads[variants[0][0]]
    line = [f"{title}: compile {base_ms:.2f} ms {mb['compile']:.0f} MB"]
    line += [
        f"{name} {statistics.median(ms[name]):.2f} ms ({statistics.median(ms[name]) / base_ms:.3f}x) {mb[name]:.0f} MB"
        for name in plain[1:]
    ]
    for label, _ in variants:
        m = statistics.median(ms[label])
        diff = [((a - b).norm() / b.norm()).item() for a, b in zip(grads[label], first)]
        model = (
            f"; model {paths.lean_peak(facts, 8192, int(label.split()[1]), PREFIX) / 2**20:.0f}"
            if MODE == "widen"
            else ""
        )
        line.append(
            f"{label} {m:.2f} ms ({m / base_ms:.3f}x; rounds {' '.join(f'{x:.2f}' for x in ms[label])}) "
            f"{mb[label]:.0f} MB ({mb[label] / mb['compile']:.2f}x{model}), vs {variants[0][0]}: "
            f"dE {diff[0]:.1e} dC {diff[1]:.1e}"
        )
    print(" |\n  ".join(line), flush=True)


def main():
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, bf16, lm data, "
        f"{IGNORE:g}% ignored, MODE {MODE}"
    )
    if MODE == "tiles":
        n = int(os.environ.get("N", "8192"))
        cells = [(h, n) for h in os.environ.get("HEADS", "gemma2,llama3,qwen25-7b,v65536").split(",")]
    else:
        spec = os.environ.get(
            "CELLS", "gemma2:8192,gemma3:8192,mistral-nemo:8192,llama3:16384,qwen25-7b:16384,gemma2:4096,qwen25-7b:2048"
        )
        cells = [(h, int(n)) for h, n in (cell.split(":") for cell in spec.split(","))]
    for head, n in cells:
        run_cell(head, n)
        torch.cuda.empty_cache()
    print(f"# backward products over the run: {cce_inductor.stats()['backward_products']}")


if __name__ == "__main__":
    main()
