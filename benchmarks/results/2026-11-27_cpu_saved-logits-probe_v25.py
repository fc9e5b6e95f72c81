"""What torch.compile (Inductor) keeps of the N x V logits between forward and backward: the forward graph's outputs
(user outputs + saved tensors) after Inductor's partition, per graph form. CPU, tiny shapes."""
import sys, torch, torch.nn.functional as F
from torch._inductor import config as ic

N_V = {}
records = []

def post_pass(g):
    out = next(n for n in g.nodes if n.op == "output")
    vals = []
    for a in out.args[0]:
        v = getattr(a, "meta", {}).get("val") if hasattr(a, "meta") else None
        if isinstance(v, torch.Tensor):
            vals.append((tuple(v.shape), str(v.dtype).replace("torch.", ""), a.name))
    records.append(vals)

ic.post_grad_custom_post_pass = post_pass
ic.force_disable_caches = True

def report(title, n, v):
    print(f"== {title} (N {n}, V {v})")
    for i, vals in enumerate(records):
        big = [(s, d, nm) for s, d, nm in vals if torch.Size(s).numel() >= n * v]
        print(f"  graph {i}: {len(vals)} outputs; N x V-sized: {big}")
    records.clear()

form = sys.argv[1]
torch.manual_seed(0)
if form == "grid":
    n, d, v = 128, 64, 1001
    e = torch.randn(n, d, dtype=torch.bfloat16, requires_grad=True)
    c = torch.randn(v, d, dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, v, (n,))
    f = torch.compile(lambda e, c, t: F.cross_entropy(F.linear(e, c).float(), t))
    f(e, c, t).backward()
    report("grid: cross_entropy(linear(e, c).float(), t)", n, v)
else:
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=1001, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    m = LlamaForCausalLM(cfg)
    x = torch.randint(0, 1001, (2, 64))
    cm = torch.compile(m)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = cm(input_ids=x, labels=x)
    out.loss.backward()
    print("returned logits:", out.logits.shape, out.logits.dtype)
    report("HF LlamaForCausalLM(input_ids, labels) under autocast bf16", 128, 1001)
"""Peak bytes above the start during one compiled fwd+bwd on CPU (torch.profiler memory events), per logit."""
import sys, torch, torch.nn.functional as F
from torch.profiler import profile, ProfilerActivity
torch._inductor.config.force_disable_caches = True

def peak_of(fn):
    fn()  # compile + warm
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    cur = peak = 0
    evs = sorted((e for e in prof.events() if getattr(e, "cpu_memory_usage", 0)), key=lambda e: e.time_range.start)
    for e in evs:
        cur += e.cpu_memory_usage
        peak = max(peak, cur)
    return peak

form = sys.argv[1]
n, v, d = 2048, 32000, 64
torch.manual_seed(0)
if form == "grid":
    e = torch.randn(n, d, dtype=torch.bfloat16, requires_grad=True)
    c = torch.randn(v, d, dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, v, (n,))
    f = torch.compile(lambda e, c, t: F.cross_entropy(F.linear(e, c).float(), t))
    def step():
        f(e, c, t).backward(); e.grad = c.grad = None
else:
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=v, hidden_size=d, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    m = LlamaForCausalLM(cfg)
    x = torch.randint(0, v, (2, n // 2))
    cm = torch.compile(m)
    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cm(input_ids=x, labels=x).loss.backward()
        m.zero_grad(set_to_none=True)
p = peak_of(step)
print(f"{form}: peak {p / 2**20:.1f} MiB = {p / (n * v):.2f} bytes per logit (N {n}, V {v}, D {d})")
