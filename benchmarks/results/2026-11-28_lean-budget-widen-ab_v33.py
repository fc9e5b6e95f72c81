# v33: the lean default with the budget's G block widening (paths.lean_widen) against the same code with it off,
# per (head, N) cell, same process, interleaved rounds; torch.compile beside it (own function, fresh Dynamo state)
import sys, os, statistics
sys.path[:0] = ["benchmarks", "."]
import torch, triton, torch.nn.functional as F
import vocab_grid as G
import cce_inductor
from cce_inductor import paths
cells = [(h, int(n)) for h, n in (c.split(":") for c in os.environ.get(
    "CELLS", "gemma2:8192,gemma3:8192,mistral-nemo:8192,llama3:16384,qwen25-7b:16384,gemma2:4096,qwen25-7b:2048").split(","))]
rounds = int(os.environ.get("ROUNDS", "3"))
print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, bf16, lm data, 0% ignored")
real = paths.lean_widen
opts = cce_inductor.CCEOptions()
for h, n in cells:
    d, v = G.HEADS[h]
    f = paths.HeadFacts(rows=n, hidden=d, vocab=v, element_size=2, kernels=True, reduction="mean", needs_grad=True)
    pick = paths.choose(f).path
    k = real(f)
    e, c, t = G.make_data(n, d, v, 0, "cuda", 0)
    e.requires_grad_(True); c.requires_grad_(True)
    torch._dynamo.reset()
    def comp_fn(e, c, t):
        return F.cross_entropy(F.linear(e, c).float(), t)
    comp = torch.compile(comp_fn)
    def run_compile():
        comp(e, c, t).backward()
    def run_default():
        cce_inductor.linear_cross_entropy(e, c, t, options=opts).backward()
    def bench(fn):
        return triton.testing.do_bench(fn, warmup=3, rep=300, grad_to_none=[e, c], return_mode="median")
    def peak(fn):
        e.grad = c.grad = None; torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated(); fn(); torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    res = {"compile": [], 1: [], k: []}; mb = {}; grads = {}
    for rnd in range(rounds):
        res["compile"].append(bench(run_compile))
        if rnd == 0: mb["compile"] = peak(run_compile)
        for w in (1, k) if k != 1 else (1,):
            paths.lean_widen = (lambda f, brc=8192, w=w: w)
            res[w].append(bench(run_default))
            if rnd == 0:
                mb[w] = peak(run_default); grads[w] = (e.grad.float().clone(), c.grad.float().clone())
            paths.lean_widen = real
    cm = statistics.median(res["compile"])
    line = [f"{h} N {n} (D {d}, V {v}) pick {pick} widen {k}: compile {cm:.2f} ms {mb['compile']:.0f} MB"]
    for w in (1, k) if k != 1 else (1,):
        m = statistics.median(res[w])
        dd = [((a - b).norm() / b.norm()).item() for a, b in zip(grads[w], grads[1])]
        line.append(f"widen {w} {m:.2f} ms ({m / cm:.3f}x; rounds {' '.join(f'{x:.2f}' for x in res[w])}) "
                    f"{mb[w]:.0f} MB ({mb[w] / mb['compile']:.2f}x; model {paths.lean_peak(f, 8192, w) / 2**20:.0f}), "
                    f"vs widen 1: dE {dd[0]:.1e} dC {dd[1]:.1e}")
    print(" |\n  ".join(line), flush=True)
    del e, c, t, grads; torch.cuda.empty_cache()
