"""One-off device probe (engineering log v19): how Triton's TF32 dots round fp32 operands, against cuBLAS's, and
what each way costs the lean path on an fp32 head at set_float32_matmul_precision("high")."""
import json, os, sys, time
import torch, triton, triton.language as tl
import torch.nn.functional as F
sys.path.insert(0, "tests")
import cce_inductor
from cce_inductor.kernels import _launch
from cce_inductor.kernels._tile import dot
out = open(os.path.join(os.environ["OUT"], "tf32_probe.jsonl"), "w")
def emit(**r):
    print(json.dumps(r), flush=True); out.write(json.dumps(r) + "\n"); out.flush()

@triton.jit
def mm_kernel(A, B, Cout, M, N, K, P: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pm, pn = tl.program_id(0), tl.program_id(1)
    rm = pm * BM + tl.arange(0, BM); rn = pn * BN + tl.arange(0, BN); rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(A + rm[:, None] * K + (k0 + rk)[None, :])
        b = tl.load(B + rn[:, None] * K + (k0 + rk)[None, :])
        acc = dot(a, tl.trans(b), acc, False, P)
    tl.store(Cout + rm[:, None] * N + rn[None, :], acc)

def tri_mm(a, b, p):
    m, k = a.shape; n = b.shape[0]; c = torch.empty(m, n, device=a.device)
    mm_kernel[(m // 128, n // 128)](a, b, c, m, n, k, p, 128, 128, 32, num_warps=8, num_stages=3)
    return c

def rel(x, ref): return ((x.double() - ref).norm() / ref.norm()).item()
torch.backends.cuda.matmul.allow_tf32 = True
for name, shift in (("randn", 0.0), ("randn+0.5", 0.5)):
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(4096, 4096, device="cuda", generator=g) + shift
    b = torch.randn(4096, 4096, device="cuda", generator=g) + shift
    ref = a.double() @ b.double().T
    res = {"cublas_tf32": rel(a @ b.T, ref)}
    for p in ("ieee", "tf32", "tf32_rn", "tf32x3"):
        res[p] = rel(tri_mm(a, b, p), ref)
        res[p + "_ms"] = triton.testing.do_bench(lambda: tri_mm(a, b, p), rep=50)
    res["cublas_tf32_ms"] = triton.testing.do_bench(lambda: a @ b.T, rep=50)
    emit(probe="matmul 4096^3", data=name, **res)

def loss_fn(e, c, t):
    return F.cross_entropy(F.linear(e, c), t)

def grads(fn, e, c, t):
    e = e.detach().requires_grad_(); c = c.detach().requires_grad_()
    loss = fn(e, c, t); loss.backward(); return loss.detach(), e.grad, c.grad

real_dp = _launch.dot_precision
for case, (n, d, v) in {"test (2048, 256, 8003)": (2048, 256, 8003), "llama3 fp32 (4096, 4096, 128256)": (4096, 4096, 128256)}.items():
    gen = torch.Generator().manual_seed(0)
    e = (torch.randn(n, d, generator=gen) * 2.0).cuda(); c = (torch.randn(v, d, generator=gen) / d ** 0.5).cuda()
    t = torch.randint(0, v, (n,), generator=gen).cuda(); t[::7] = -100
    want = grads(loss_fn, e.double(), c.double(), t)
    torch.set_float32_matmul_precision("high")
    rows = {}
    for method in ("compile", "tf32", "tf32_rn", "tf32x3", "ieee"):
        torch._dynamo.reset(); cce_inductor.reset_stats()
        fn = (lambda e, c, t: loss_fn(e, c, t))  # a fresh code object per method
        if method == "compile":
            cfn = torch.compile(fn)
        else:
            _launch.dot_precision = (lambda m: (lambda dtype: m if dtype == torch.float32 else "tf32"))(method)
            cfn = torch.compile(fn, backend=cce_inductor.make_backend(path="lean"))
        if method == "ieee" and v > 10000:
            continue
        got = grads(cfn, e, c, t)
        errs = [rel(x, w) for x, w in zip(got, want)]
        ms = triton.testing.do_bench(lambda: grads(cfn, e, c, t), rep=200)
        emit(probe="lean loss fp32 high", case=case, method=method, err_loss=errs[0], err_de=errs[1], err_dc=errs[2],
             ms=ms, rewritten=cce_inductor.stats()["rewritten"] if method != "compile" else None)
        _launch.dot_precision = real_dp
    torch.set_float32_matmul_precision("highest")
