"""(session 19) Why the default's step costs more host time than path="lean" at GPT-2's head, N 4096 (H100)."""
import cProfile, pstats, io, sys, os, torch
sys.path[:0] = ["benchmarks", "."]
import _common as C
import cce_inductor
torch.manual_seed(0)
n, d, v = int(os.environ.get("N", 4096)), int(os.environ.get("D", 768)), int(os.environ.get("V", 50257))
e = (torch.randn(n, d, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_()
c = (torch.randn(v, d, device="cuda") * 0.05).to(torch.bfloat16).requires_grad_()
t = torch.randint(0, v, (n,), device="cuda")
def train_step(fn):
    def step():
        loss = fn(e, c, t); loss.backward(); e.grad = c.grad = None
    return step
methods = {"default": {}, "lean": {"path": "lean"}, "lean_auto": {"path": "lean", "products": "auto"},
           "default_cublas": {"products": "cublas"}}
steps = {}
for i, (name, kw) in enumerate(methods.items()):
    torch._dynamo.reset()
    fn = C.fresh_loss(i)
    steps[name] = train_step(torch.compile(fn, backend=cce_inductor.make_backend(**kw)))
    steps[name]()
    site = cce_inductor.stats()["sites"][-1]
    print(name, site.get("path"), str(site.get("reason"))[:200], flush=True)
rows = {k: [] for k in steps}
for rep in range(4):
    for name, step in steps.items():
        rows[name].append(C.host_and_wall_ms(step, reps=30))
for name, r in rows.items():
    print(f"{name:16s} host/wall ms: " + "  ".join(f"{h:.2f}/{w:.2f}" for h, w in r), flush=True)
for name in ("default", "lean"):
    pr = cProfile.Profile(); pr.enable()
    for _ in range(30):
        steps[name]()
    pr.disable(); torch.cuda.synchronize()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    print(f"==== {name}\n" + s.getvalue()[-5000:])
