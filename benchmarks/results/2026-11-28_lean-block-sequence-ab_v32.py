# v32: the lean backward's per-block sequence (write G, dE addmm fp32, dC mm) by block width: does G's L2 residency
# (a 64 MB block written just before its products) explain why wider blocks did not help?
import torch, triton
print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
b = lambda f: triton.testing.do_bench(f, warmup=3, rep=40, return_mode="median")
for name, n, d, v in (("gemma2", 8192, 2304, 256000), ("llama3", 8192, 4096, 128256)):
    torch.manual_seed(0)
    e = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
    c = torch.randn(v, d, device="cuda", dtype=torch.bfloat16)
    de32 = torch.empty(n, d, device="cuda", dtype=torch.float32)
    dc = torch.empty(v, d, device="cuda", dtype=torch.bfloat16)
    for w in (2048, 4096, 8192, 16384):
        src = torch.randn(n, w, device="cuda", dtype=torch.bfloat16) * 1e-3
        g = torch.empty_like(src)
        blocks = [(v0, min(w, v - v0)) for v0 in range(0, v, w)]
        def writes():
            for v0, k in blocks: g[:, :k].copy_(src[:, :k])
        def seq(products=True):
            for i, (v0, k) in enumerate(blocks):
                gk = g[:, :k]
                gk.copy_(src[:, :k])
                if i == 0: torch.mm(gk, c[v0:v0 + k], out=de32, out_dtype=torch.float32)
                else: torch.addmm(de32, gk, c[v0:v0 + k], out=de32, out_dtype=torch.float32)
                torch.mm(gk.T, e, out=dc[v0:v0 + k])
        tw, ts = b(writes), b(seq)
        print(f"{name} w{w:5d}: G writes {tw:6.2f} ms, write + dE + dC per block {ts:6.2f} ms, products {ts - tw:6.2f} ms", flush=True)
        del src, g
    del e, c, de32, dc; torch.cuda.empty_cache()
