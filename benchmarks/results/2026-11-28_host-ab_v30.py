# v30 A/B: torch.compile against the default through the pass, one process per (tree, shapes); host / wall ms per
# fwd+bwd step, 7 interleaved measurements of 30 steps each. usage: ab.py TREE_ROOT static|dynamic N D V
import sys, os, json, statistics, time
root, shapes, n, d, v = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
sys.path[:0] = [root, os.path.join(root, "benchmarks")]
import torch
import _common as C
import cce_inductor
assert os.path.abspath(cce_inductor.__file__).startswith(os.path.abspath(root)), cce_inductor.__file__
torch.manual_seed(0)
e = (torch.randn(n, d, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_()
c = (torch.randn(v, d, device="cuda") * 0.05).to(torch.bfloat16).requires_grad_()
t = torch.randint(0, v, (n,), device="cuda")
steps = {}
for i, name in enumerate(("torch.compile", "default")):
    torch._dynamo.reset()
    fn = C.fresh_loss(i)
    f = torch.compile(fn) if name == "torch.compile" else torch.compile(fn, backend=cce_inductor.backend)
    def step(f=f, e=e, t=t):
        f(e, c, t).backward()
        e.grad = c.grad = None
    if shapes == "dynamic":
        r = n - 64
        e2 = e.detach()[:r].clone().requires_grad_()
        f(e2, c, t[:r]).backward(); c.grad = None
    steps[name] = step
res = {k: [] for k in steps}
for _ in range(7):
    for k, s in steps.items():
        res[k].append(C.host_and_wall_ms(s, reps=30))
out = {k: {"host_ms": statistics.median(h for h, w in r), "wall_ms": statistics.median(w for h, w in r)} for k, r in res.items()}
st = cce_inductor.stats()
out["default path"] = [s.get("path") for s in st.get("sites", [])]
print(json.dumps({"tree": root, "shapes": shapes, "n": n, "d": d, "v": v, "device": torch.cuda.get_device_name(), **out}))
