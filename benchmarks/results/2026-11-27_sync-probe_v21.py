"""Does the lean backward synchronise? host time with 200 ms of GPU sleep queued in front, per products mode,
plus torch.cuda.set_sync_debug_mode('warn'); Gemma-2 head, N 8192, 50% / 75% ignored."""
import time, warnings, torch
import cce_inductor.kernels as K
from cce_inductor import CCEOptions
torch.manual_seed(0)
n, d, v = 8192, 2304, 256000
e = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
c = (torch.randn(v, d, device="cuda") / d ** 0.5).to(torch.bfloat16)
for ign in (0.5, 0.75):
    t = torch.randint(0, v, (n,), device="cuda")
    t[torch.rand(n, device="cuda") < ign] = -100
    lse, *_ = K.forward(e, c, t, None, softcap=None, ignore_index=-100)
    g = (t != -100).float() / max(1, int((t != -100).sum()))
    share = float((t != -100).float().mean())
    for rep in range(2):
        for mode in ("cublas", "triton", "prefix"):
            opts = CCEOptions(products="triton" if mode == "triton" else "cublas")
            hint = share if mode == "prefix" else None
            run = lambda: K.backward(e, c, t, None, lse, g, softcap=None, ignore_index=-100, options=opts,
                                     need_e=True, need_c=True, need_bias=False, counted_hint=hint)
            for _ in range(2):
                run()
            torch.cuda.synchronize()
            if rep == 0:
                torch.cuda.set_sync_debug_mode("warn")
                with warnings.catch_warnings(record=True) as w:
                    warnings.simplefilter("always")
                    run()
                torch.cuda.set_sync_debug_mode(0)
                syncs = [str(x.message)[:100] for x in w]
            torch.cuda.synchronize()
            hosts = []
            for _ in range(3):
                torch.cuda.synchronize(); t0 = time.perf_counter(); run(); hosts.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            torch.cuda._sleep(int(2e9 * 0.2))
            t0 = time.perf_counter(); run(); hq = time.perf_counter() - t0
            torch.cuda.synchronize()
            print(f"ign {ign} rep {rep} {mode:7s} host {min(hosts)*1e3:6.1f} ms  host behind 200ms sleep {hq*1e3:6.1f} ms"
                  + (f"  syncs {len(syncs)} {syncs[:3]}" if rep == 0 else ""), flush=True)
