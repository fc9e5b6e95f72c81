# v32: where the lean backward's dE / dC products lose against torch.compile's single products (cuBLAS only)
import torch, triton
print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
b = lambda f: triton.testing.do_bench(f, warmup=3, rep=40, return_mode="median")
for name, n, d, v in (("gemma2", 8192, 2304, 256000), ("llama3", 8192, 4096, 128256)):
    torch.manual_seed(0)
    e = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
    c = torch.randn(v, d, device="cuda", dtype=torch.bfloat16)
    gfull = torch.randn(n, v, device="cuda", dtype=torch.bfloat16) * 1e-3
    res = {}
    res["logits E C^T (one)"] = b(lambda: torch.mm(e, c.T))
    res["dE G C (one, bf16 out)"] = b(lambda: torch.mm(gfull, c))
    res["dC G^T E (one, bf16 out)"] = b(lambda: torch.mm(gfull.T, e))
    for w in (4096, 16384):
        blocks = [(v0, min(w, v - v0)) for v0 in range(0, v, w)]
        gb = [gfull[:, v0:v0 + k].contiguous() for v0, k in blocks]
        cb = [c[v0:v0 + k] for v0, k in blocks]
        de32 = torch.empty(n, d, device="cuda", dtype=torch.float32)
        de16 = torch.empty(n, d, device="cuda", dtype=torch.bfloat16)
        dc = torch.empty(v, d, device="cuda", dtype=torch.bfloat16)
        def de_fp32():
            torch.mm(gb[0], cb[0], out=de32, out_dtype=torch.float32)
            for g, cc in zip(gb[1:], cb[1:]): torch.addmm(de32, g, cc, out=de32, out_dtype=torch.float32)
        def de_bf16():
            torch.mm(gb[0], cb[0], out=de16)
            for g, cc in zip(gb[1:], cb[1:]): torch.addmm(de16, g, cc, out=de16)
        def de_fp32_noacc():
            for g, cc in zip(gb, cb): torch.mm(g, cc, out=de32, out_dtype=torch.float32)
        def dc_chunks():
            for (v0, k), g in zip(blocks, gb): torch.mm(g.T, e, out=dc[v0:v0 + k])
        res[f"dE chunked w{w}: addmm fp32 out (the lean path)"] = b(de_fp32)
        res[f"dE chunked w{w}: mm fp32 out, no accumulate"] = b(de_fp32_noacc)
        res[f"dE chunked w{w}: addmm bf16 out"] = b(de_bf16)
        res[f"dC chunked w{w}: mm bf16 out"] = b(dc_chunks)
        del gb
    for k, t in res.items(): print(f"{name} N {n} D {d} V {v}: {k:55s} {t:7.2f} ms", flush=True)
    del gfull, e, c; torch.cuda.empty_cache()
