# v31: the balanced helper before (HEAD's kernels as package `basekernels`) and after (working tree), one process:
# host us per call and GPU ms per call, interleaved; parity of the outputs
import sys, time, statistics, shutil, os
shutil.rmtree("/tmp/bk", ignore_errors=True); shutil.copytree(".devrun/base/kernels", "/tmp/bk/basekernels")
sys.path[:0] = ["/tmp/bk", "."]
import torch, triton
import basekernels._balanced as B0
from cce_inductor.kernels import _balanced as B1

def host_us(fn, calls=10, reps=7):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls): fn()
        out.append(1e6 * (time.perf_counter() - t0) / calls)
        torch.cuda.synchronize()
    return statistics.median(out)

def gpu_ms(fn):
    return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")

print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
for n, d, v, chunks in ((4096, 768, 50257, 2), (4096, 1024, 50257, 2), (2048, 1024, 50257, 1), (8192, 2048, 65535, 2), (8192, 2048, 65536, 2)):
    torch.manual_seed(0)
    e = (torch.randn(n, d, device="cuda") * 0.5).to(torch.bfloat16)
    c = (torch.randn(v, d, device="cuda") * 0.05).to(torch.bfloat16)
    t = torch.randint(0, v, (n,), device="cuda")
    cr = -(-n // chunks)
    kw = dict(softcap=None, ignore_index=-100, reduction="mean", chunk_rows=cr, check_range=True)
    fns = {"base": lambda: B0.loss_and_grads(e, c, t, None, **kw), "new": lambda: B1.loss_and_grads(e, c, t, None, **kw)}
    host = {k: [] for k in fns}; gpu = {k: [] for k in fns}
    for _ in range(3):
        for k, f in fns.items():
            host[k].append(host_us(f)); gpu[k].append(gpu_ms(f))
    a, b = fns["base"](), fns["new"]()
    diff = [((x.float() - y.float()).norm() / y.float().norm()).item() for x, y in zip(a, b) if x is not None]
    same = [torch.equal(x, y) for x, y in zip(a, b) if x is not None]
    print(f"N {n} D {d} V {v} chunks {chunks}: host us base {' '.join(f'{x:7.0f}' for x in host['base'])} | new {' '.join(f'{x:7.0f}' for x in host['new'])};"
          f" gpu ms base {' '.join(f'{x:.3f}' for x in gpu['base'])} | new {' '.join(f'{x:.3f}' for x in gpu['new'])}; rel diff loss/dE/dC {' '.join(f'{x:.1e}' for x in diff)} bitwise {same}")
