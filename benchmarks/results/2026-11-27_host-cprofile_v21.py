"""cProfile of one lean backward's host work: Gemma-2 head, N 8192, 75% ignored, cublas / triton / prefix."""
import cProfile, pstats, io, time, torch
import cce_inductor.kernels as K
from cce_inductor import CCEOptions
torch.manual_seed(0)
n, d, v = 8192, 2304, 256000
e = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
c = (torch.randn(v, d, device="cuda") / d ** 0.5).to(torch.bfloat16)
t = torch.randint(0, v, (n,), device="cuda")
t[torch.rand(n, device="cuda") < 0.75] = -100
lse, *_ = K.forward(e, c, t, None, softcap=None, ignore_index=-100)
g = (t != -100).float() / max(1, int((t != -100).sum()))
share = float((t != -100).float().mean())
for mode in ("cublas", "triton", "prefix"):
    opts = CCEOptions(products="triton" if mode == "triton" else "cublas")
    hint = share if mode == "prefix" else None
    run = lambda: K.backward(e, c, t, None, lse, g, softcap=None, ignore_index=-100, options=opts,
                             need_e=True, need_c=True, need_bias=False, counted_hint=hint)
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    for _ in range(3):
        run()
    pr.disable()
    t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
    print(f"==== {mode}: host {(t1-t0)/3*1e3:.1f} ms per backward (profiled), wall {(t2-t0)/3*1e3:.1f}")
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
    print(s.getvalue()[-6000:])
