"""(session 19) Wider G blocks for every lean backward: do they cut the host-bound calls (moving shares, the
counted prefix at 50%) and cost nothing where the GPU is the limit (0%)? Same process per head, compile as the bar."""
import json, os, sys, torch
sys.path[:0] = ["benchmarks", "."]
import _common as C
import vocab_grid as VG
import cce_inductor
from cce_inductor.kernels import _backward as B
FORCE = {"w": 1}
orig = B.vocab_chunk_width
def patched(vocab_chunk, g_block_rows, rows, row_chunk, vocab, widen=1):
    return orig(vocab_chunk, g_block_rows, rows, row_chunk, vocab, max(widen, FORCE["w"]))
B.vocab_chunk_width = patched
out = open(os.path.join(os.environ.get("OUT", "."), "widen_probe.jsonl"), "a")
heads = {"gemma2": (2304, 256000), "llama3": (4096, 128256)}
for head in os.environ.get("HEADS", "gemma2,llama3").split(","):
    d, v = heads[head]
    n = 8192
    e, c, spread = VG.make_data(n, d, v, 50, "cuda", 0, torch.bfloat16, 25)
    _, _, t0 = VG.make_data(n, d, v, 0, "cuda", 0)
    _, _, t50 = VG.make_data(n, d, v, 50, "cuda", 0)
    _, _, t75 = VG.make_data(n, d, v, 75, "cuda", 0)
    cases = {"0": [t0], "50": [t50], "75": [t75], "50+-25": spread}
    e.requires_grad_(True); c.requires_grad_(True)
    fns = {}
    for i, m in enumerate(("compile", "default")):
        torch._dynamo.reset()
        f = C.fresh_loss(f"{head}{i}", -100)
        fns[m] = torch.compile(f) if m == "compile" else torch.compile(f, backend=cce_inductor.make_backend())
    for case, ts in cases.items():
        for m, w in (("compile", 1), ("default", 1), ("wide2", 2), ("wide3", 3), ("default", 1)):
            fn = fns["compile" if m == "compile" else "default"]
            FORCE["w"] = w
            def timed():
                for tt in ts:
                    e.grad = c.grad = None
                    fn(e, c, tt).backward()
            for _ in range(3):
                timed()
            torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
            timed(); torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            host, wall = C.host_and_wall_ms(timed, reps=5, warmup=1)
            ms = C.bench(timed, "cuda", grad_to_none=[e, c]) / len(ts)
            row = dict(head=head, case=case, method=m, widen=w, ms=round(ms, 2), peak_mb=round(peak),
                       host_ms=round(host / len(ts), 2), wall_ms=round(wall / len(ts), 2),
                       products=cce_inductor.stats()["backward_products"])
            print(json.dumps(row), flush=True); out.write(json.dumps(row) + "\n"); out.flush()
    FORCE["w"] = 1
    del e, c, fns; C.free("cuda")
