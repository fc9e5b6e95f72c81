# v30: A/B of the balanced helper's host pieces in one process (base = HEAD's kernels as package `basekernels`)
import sys, time, statistics, shutil, os
shutil.rmtree("/tmp/bk", ignore_errors=True); shutil.copytree(".devrun/base/kernels", "/tmp/bk/basekernels")
sys.path[:0] = ["/tmp/bk", "."]
import torch, triton, triton.language as tl
import basekernels._balanced as B0
from cce_inductor.kernels import _balanced as B1, _targets, _launch
from cce_inductor import _checks

n, d, v = [int(x) for x in os.environ.get("SHAPE", "4096,768,50257").split(",")]
torch.manual_seed(0)
e = (torch.randn(n, d, device="cuda") * 0.5).to(torch.bfloat16)
c = (torch.randn(v, d, device="cuda") * 0.05).to(torch.bfloat16)
t = torch.randint(0, v, (n,), device="cuda")

@triton.jit
def _empty_kernel(X):
    pass

@triton.jit(debug=True)
def _empty_debug_kernel(X):
    pass

def host_us(fn, calls=40, reps=7):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls): fn()
        out.append(1e6 * (time.perf_counter() - t0) / calls)
        torch.cuda.synchronize()
    return statistics.median(out)

def eager_counted():
    cnt = t != -100
    return (1.0 / cnt.sum(dtype=torch.float32)).reshape(1)
def base_poison():
    w = _launch.nonfinite_rows(c).sum() + 0.0
    return [_launch.nonfinite_rows(e[r:r + n // 2]) + w for r in (0, n // 2)]
def new_poison():
    z = torch.zeros(d, dtype=e.dtype, device="cuda")
    return torch.mv(e, z), torch.mv(c, z).sum()
x = torch.empty(1, device="cuda")
cases = {
    "torch: one small op (t != -100)": lambda: t != -100,
    "triton: empty kernel": lambda: _empty_kernel[(1,)](x),
    "triton: empty kernel, debug": lambda: _empty_debug_kernel[(1,)](x),
    "eager check_target_range": lambda: _checks.check_target_range(t, v, -100),
    "eager counted + scale": eager_counted,
    "count_targets (count only)": lambda: _targets.count_targets(t, -100, mean=True),
    "count_targets (count + check)": lambda: _targets.count_targets(t, -100, mean=True, check_vocab=v),
    "poison, base (2 chunks)": base_poison,
    "poison, new": new_poison,
}
for chunks in (1, 2):
    cr = -(-n // chunks)
    cases[f"helper base, {chunks} chunk(s)"] = lambda cr=cr: B0.loss_and_grads(e, c, t, None, softcap=None, ignore_index=-100, reduction="mean", chunk_rows=cr)
    cases[f"helper new, {chunks} chunk(s)"] = lambda cr=cr: B1.loss_and_grads(e, c, t, None, softcap=None, ignore_index=-100, reduction="mean", chunk_rows=cr)
    cases[f"helper new+check, {chunks} chunk(s)"] = lambda cr=cr: B1.loss_and_grads(e, c, t, None, softcap=None, ignore_index=-100, reduction="mean", chunk_rows=cr, check_range=True)
res = {k: [] for k in cases}
for rnd in range(3):  # interleaved rounds
    for k, fn in cases.items():
        res[k].append(host_us(fn, calls=10 if "helper" in k else 40))
# parity of base and new helpers
a = B0.loss_and_grads(e, c, t, None, softcap=None, ignore_index=-100, reduction="mean", chunk_rows=n // 2)
b = B1.loss_and_grads(e, c, t, None, softcap=None, ignore_index=-100, reduction="mean", chunk_rows=n // 2, check_range=True)
print("bitwise equal base/new:", all(torch.equal(x, y) for x, y in zip(a, b) if x is not None))
print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; N {n} D {d} V {v}; host us per call, 3 interleaved rounds (median of 7 x N calls each)")
for k, r in res.items():
    print(f"{k:40s} " + " ".join(f"{x:8.1f}" for x in r))
