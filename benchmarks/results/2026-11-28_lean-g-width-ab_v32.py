# v32: the lean path's G block width (vocab_chunk) 4096 / 8192 / 16384 at N 8192, same process, interleaved;
# torch.compile's fwd+bwd beside it (own function, fresh Dynamo state per head)
import sys, os, statistics
sys.path[:0] = ["benchmarks", "."]
import torch, triton, torch.nn.functional as F
import vocab_grid as G
import cce_inductor
from cce_inductor.kernels import _backward as B
heads = os.environ.get("HEADS", "gemma2,llama3,qwen25-7b,mistral-nemo,deepseek-v3,v65536").split(",")
widths = [int(w) for w in os.environ.get("WIDTHS", "4096,8192,16384").split(",")]
n = int(os.environ.get("N", "8192"))
print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, N {n}, bf16, lm data")
opts = cce_inductor.CCEOptions(path="lean")
rows = []
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
        return triton.testing.do_bench(fn, warmup=3, rep=60, grad_to_none=[e, c], return_mode="median")
    def peak(fn):
        e.grad = c.grad = None; torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated(); fn(); torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    res = {"compile": []}; mb = {}; grads = {}
    for w in widths: res[w] = []
    for rnd in range(3):
        res["compile"].append(bench(run_compile))
        if rnd == 0: mb["compile"] = peak(run_compile)
        for w in widths:
            B._TUNING["gpu"]["vocab_chunk"] = w
            res[w].append(bench(run_lean))
            if rnd == 0:
                mb[w] = peak(run_lean); grads[w] = (e.grad.float().clone(), c.grad.float().clone())
    B._TUNING["gpu"]["vocab_chunk"] = 4096
    cm = statistics.median(res["compile"])
    ref = grads[widths[0]]
    line = [f"{h} (D {d}, V {v}): compile {cm:.2f} ms {mb['compile']:.0f} MB"]
    for w in widths:
        m = statistics.median(res[w])
        dd = [((a - b).norm() / b.norm()).item() for a, b in zip(grads[w], ref)]
        line.append(f"w{w} {m:.2f} ms ({m / cm:.3f}x; rounds {' '.join(f'{x:.2f}' for x in res[w])}) {mb[w]:.0f} MB, vs w{widths[0]} dE {dd[0]:.1e} dC {dd[1]:.1e}")
    print(" | ".join(line), flush=True)
    del e, c, t, grads; torch.cuda.empty_cache()
