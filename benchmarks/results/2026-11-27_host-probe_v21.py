"""(session 18: + 75% ignored and the counted prefix) Host time of one lean backward (launch work, no sync) against its GPU time, Gemma-2 / Llama-3 heads, N 8192."""
import json, os, time, torch
import cce_inductor.kernels as K
from cce_inductor import CCEOptions
torch.manual_seed(0)
out = []
for name, d, v in (("gemma2", 2304, 256000), ("llama3", 4096, 128256)):
    n = 8192
    e = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
    c = (torch.randn(v, d, device="cuda") / d ** 0.5).to(torch.bfloat16)
    for ign in (0.0, 0.5, 0.75):
        t = torch.randint(0, v, (n,), device="cuda")
        t[torch.rand(n, device="cuda") < ign] = -100
        lse, *_ = K.forward(e, c, t, None, softcap=None, ignore_index=-100)
        g = (t != -100).float() / max(1, int((t != -100).sum()))
        share = float((t != -100).float().mean())
        for products in ("cublas", "triton", "prefix", "triton_hint"):
            if products in ("prefix", "triton_hint") and ign == 0.0:
                continue
            opts = CCEOptions(products="triton" if products.startswith("triton") else "cublas")
            hint = share if products in ("prefix", "triton_hint") else None
            run = lambda: K.backward(e, c, t, None, lse, g, softcap=None, ignore_index=-100, options=opts,
                                     need_e=True, need_c=True, need_bias=False, counted_hint=hint)
            for _ in range(3):
                run()
            torch.cuda.synchronize()
            host = []
            for _ in range(5):
                torch.cuda.synchronize()
                t0 = time.perf_counter(); run(); t1 = time.perf_counter()
                torch.cuda.synchronize(); t2 = time.perf_counter()
                host.append(((t1 - t0) * 1e3, (t2 - t0) * 1e3))
            # GPU time with the host far ahead: queue behind a long sleep kernel
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(int(2e9 * 0.05))  # ~50+ ms of GPU work queued first
            start.record(); run(); end.record(); torch.cuda.synchronize()
            row = dict(head=name, ignore=ign, products=products, host_ms=sorted(h for h, _ in host)[2],
                       wall_ms=sorted(w for _, w in host)[2], gpu_ms_queued=start.elapsed_time(end))
            out.append(row); print(json.dumps(row), flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "host_probe.json"), "w"), indent=1)
