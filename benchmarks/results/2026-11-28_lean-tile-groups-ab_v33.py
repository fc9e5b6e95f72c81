# v33 (H200, 2026-11-28): run with HEADS / CONFIGS as in the log header of each raw file; CONFIGS are vocab_chunk:recompute_group.
# The _v33 "wider-still" log ran before this script patched paths.lean_widen to 1, so its widths are 4x those named.
# v33: the lean recompute's tile groups (recompute_group columns) and the G block width (vocab_chunk) at N 8192,
# same process, interleaved rounds; torch.compile's fwd+bwd beside it (own function, fresh Dynamo state per head)
import sys, os, statistics
sys.path[:0] = ["benchmarks", "."]
import torch, triton, torch.nn.functional as F
import vocab_grid as G
import cce_inductor
from cce_inductor.kernels import _backward as B
heads = os.environ.get("HEADS", "gemma2,llama3,qwen25-7b,v65536").split(",")
# (vocab_chunk, recompute_group): 1 << 20 = one group over the block (the order before v33)
configs = [tuple(int(x) for x in c.split(":")) for c in
           os.environ.get("CONFIGS", "4096:1048576,4096:4096,8192:4096,16384:4096,16384:1048576").split(",")]
n = int(os.environ.get("N", "8192"))
rounds = int(os.environ.get("ROUNDS", "3"))
print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, N {n}, bf16, lm data")
opts = cce_inductor.CCEOptions(path="lean")
tune = B._TUNING["gpu"]
from cce_inductor import paths
paths.lean_widen = lambda *a, **k: 1  # (v33) vocab_chunk alone sets the width here
for h in heads:
    d, v = G.HEADS[h]
    e, c, t = G.make_data(n, d, v, 0, "cuda", 0)
    e.requires_grad_(True); c.requires_grad_(True)
    torch._dynamo.reset()
    def comp_fn(e, c, t):
        return F.cross_entropy(F.linear(e, c).float(), t)
    comp = torch.compile(comp_fn)
    def run_compile():
        comp(e, c, t).backward()
    def run_lean():
        cce_inductor.linear_cross_entropy(e, c, t, options=opts).backward()
    def bench(fn):
        return triton.testing.do_bench(fn, warmup=3, rep=300, grad_to_none=[e, c], return_mode="median")
    def peak(fn):
        e.grad = c.grad = None; torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated(); fn(); torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    res = {"compile": []}; mb = {}; grads = {}
    for cf in configs: res[cf] = []
    for rnd in range(rounds):
        res["compile"].append(bench(run_compile))
        if rnd == 0: mb["compile"] = peak(run_compile)
        for cf in configs:
            tune["vocab_chunk"], tune["recompute_group"] = cf
            res[cf].append(bench(run_lean))
            if rnd == 0:
                mb[cf] = peak(run_lean); grads[cf] = (e.grad.float().clone(), c.grad.float().clone())
    tune["vocab_chunk"], tune["recompute_group"] = 4096, 4096
    cm = statistics.median(res["compile"])
    ref = grads[configs[0]]
    line = [f"{h} (D {d}, V {v}): compile {cm:.2f} ms {mb['compile']:.0f} MB"]
    for cf in configs:
        m = statistics.median(res[cf])
        dd = [((a - b).norm() / b.norm()).item() for a, b in zip(grads[cf], ref)]
        line.append(f"w{cf[0]}/g{cf[1]} {m:.2f} ms ({m / cm:.3f}x; rounds {' '.join(f'{x:.2f}' for x in res[cf])}) "
                    f"{mb[cf]:.0f} MB, dE {dd[0]:.1e} dC {dd[1]:.1e}")
    print(" |\n  ".join(line), flush=True)
    del e, c, t, grads; torch.cuda.empty_cache()
