"""What Inductor does with an unaligned head's products (log v28 Next 3): the generated code's matmuls and buffers."""
import re, sys, torch, torch.nn.functional as F
from torch._inductor.utils import run_and_get_code
heads = {"gpt2": (768, 50257), "gpt2-medium": (1024, 50257), "v65535": (2048, 65535)}
for name, n in [("gpt2", 4096), ("gpt2", 8192), ("gpt2-medium", 4096), ("v65535", 8192)]:
    d, v = heads[name]
    torch._dynamo.reset()
    g = torch.Generator(device="cuda").manual_seed(0)
    e = (torch.randn(n, d, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    c = (torch.randn(v, d, device="cuda", generator=g) * 0.05).bfloat16().requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    def loss(e, c, t):
        return F.cross_entropy(F.linear(e, c).float(), t)
    fn = torch.compile(loss)
    def step():
        l = fn(e, c, t); l.backward(); return l
    _, codes = run_and_get_code(step)
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
    e.grad = c.grad = None
    step(); torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    print(f"== {name} N={n} D={d} V={v}: peak above inputs {peak:.0f} MiB ({torch.cuda.get_device_name()})")
    for k, code in enumerate(codes):
        for line in code.splitlines():
            s = line.strip()
            if re.search(r"extern_kernels\.(mm|addmm|bmm)|constant_pad|empty_strided_cuda\(\(", s) and not s.startswith("#"):
                print(f"  [{k}] {s[:200]}")
