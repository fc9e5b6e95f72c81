"""Output-head inputs of a small language model trained on real text, and the softmax statistics that decide
how much a gradient filter can skip.

The synthetic regimes of ``benchmark.py`` choose how peaked the softmax is; this module measures it instead.
It builds, offline and in pure torch + stdlib:

1. a corpus: the Python installation's own sources and documentation (stdlib, then site-packages; sorted walk);
2. a byte-level BPE tokenizer trained on it (GPT-2 style pre-tokenising regex; 40 MB at V = 65536 train and
   encode in ~25 s on one CPU core);
3. a pre-norm decoder-only transformer (causal SDPA, GELU MLP, learned positions, untied head) trained for a
   time budget in bf16 autocast;
4. the head inputs on held-out text -- ``e`` (N x D states entering the head), ``c`` (V x D head weight) and
   the next-token ``targets`` -- which a benchmark times as ``F.cross_entropy(e @ c.T, targets)`` vs fused
   kernels.

``softmax_stats`` says what CCE's gradient filter (paper sec. 4) finds in that regime. The backward computes
dE = G @ C with G = softmax - onehot, one (row block x vocabulary tile) tile at a time; a tile whose off-target
probabilities are all < eps is skipped (the target entries are always kept, as in ``kernels/_backward.py``).
Few entries >= eps per row and a small share of active tiles mean much of the backward can be skipped; the
tail mass (probability in entries < eps) is what skipping drops, and the relative error in dE measures the
consequence. The error-bounded variant asks instead how many tiles could be skipped if each row may lose at
most ``b`` probability mass.

    python benchmarks/real_text.py --tiny                        # CPU smoke run, < 1 minute
    python benchmarks/real_text.py --self-check                  # statistics vs brute force
    python benchmarks/real_text.py --save /tmp/head.pt           # GPU: V 65536, D 2048, 8192 tokens, 90 s

Logs go to stderr; stdout gets one JSON line (metadata + statistics).
"""

from __future__ import annotations

import argparse
import heapq
import inspect
import itertools
import json
import math
import os
import re
import site
import sys
import sysconfig
import time
from array import array
from collections import Counter, defaultdict, deque

import torch
import torch.nn as nn
import torch.nn.functional as F

TEXT_SUFFIXES = (".py", ".md", ".rst", ".txt")
MAX_FILE_BYTES = 1 << 20  # larger files are generated tables / test data that would dominate the corpus
SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages"}  # site dirs are walked as their own roots
# GPT-2's pre-tokeniser in stdlib ``re`` ([^\W\d_] = letters); every character matches some branch, so the
# pieces concatenate back to the text.
PIECE = re.compile(r"""'(?:[sdmt]|ll|ve|re)| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+""")


def _log(msg: str) -> None:
    print(f"[real_text] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------------------------
# Corpus and tokenizer
# ------------------------------------------------------------------------------------------------------------------


def _text_files() -> list[str]:
    paths = sysconfig.get_paths()
    roots = [paths["stdlib"], paths["purelib"], paths["platlib"], *site.getsitepackages()]
    files, seen = [], set()
    for root in roots:
        root = os.path.realpath(root)
        if root in seen or not os.path.isdir(root):
            continue
        seen.add(root)
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
            files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(TEXT_SUFFIXES)]
    return files


def collect_corpus(max_bytes: int) -> str:
    """Concatenated UTF-8 text files of this Python installation (stdlib first), at most ``max_bytes`` bytes."""
    chunks, total = [], 0
    for path in _text_files():
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_FILE_BYTES + 1)
            data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not data or len(data) > MAX_FILE_BYTES or b"\0" in data:
            continue
        if not data.endswith(b"\n"):
            data += b"\n"
        chunks.append(data[: int(max_bytes) - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    return b"".join(chunks).decode("utf-8", "ignore")  # "ignore": a character cut by the byte budget


class Tokenizer:
    """Byte-level BPE: ids 0-255 are bytes, id 256 + k is the k-th merge."""

    def __init__(self, merges: dict[tuple[int, int], int], segmentations: dict[str, list[int]]):
        self.merges = merges
        self._cache = segmentations  # piece -> ids; training leaves every corpus piece here
        self._bytes = [bytes([i]) for i in range(256)]
        for a, b in merges:  # insertion order is id order
            self._bytes.append(self._bytes[a] + self._bytes[b])

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.merges)

    def _bpe(self, piece: str) -> list[int]:
        ids = list(piece.encode("utf-8"))
        while len(ids) > 1:
            pair = min(zip(ids, ids[1:]), key=lambda p: self.merges.get(p, math.inf))
            if pair not in self.merges:
                break
            ids = _merge(ids, pair, self.merges[pair])
        return ids

    def encode(self, text: str) -> torch.Tensor:
        ids, cache = array("q"), self._cache
        for piece in PIECE.findall(text):
            seg = cache.get(piece)
            if seg is None:
                seg = cache[piece] = self._bpe(piece)
            ids.extend(seg)
        return torch.frombuffer(ids, dtype=torch.int64).clone() if ids else torch.empty(0, dtype=torch.int64)

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        return b"".join(self._bytes[i] for i in torch.as_tensor(ids).tolist()).decode("utf-8", "replace")


def _merge(ids: list[int], pair: tuple[int, int], new: int) -> list[int]:
    out, i, n = [], 0, len(ids)
    while i < n:
        if i + 1 < n and ids[i] == pair[0] and ids[i + 1] == pair[1]:
            out.append(new)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def train_tokenizer(text: str, vocab_size: int) -> Tokenizer:
    """BPE on the distinct pre-tokenised pieces (weighted by frequency) with incremental pair counts: a merge
    only revisits the pieces that contain its pair, which keeps pure Python fast enough."""
    freq = Counter(PIECE.findall(text))
    pieces = sorted(freq)
    words = [list(p.encode("utf-8")) for p in pieces]
    counts: dict[tuple[int, int], int] = defaultdict(int)
    where: dict[tuple[int, int], set[int]] = defaultdict(set)  # may hold stale words; checked on use
    for w, ids in enumerate(words):
        for pair in zip(ids, ids[1:]):
            counts[pair] += freq[pieces[w]]
            where[pair].add(w)
    heap = [(-n, pair) for pair, n in counts.items()]  # ties -> smallest pair: deterministic
    heapq.heapify(heap)
    merges: dict[tuple[int, int], int] = {}
    while 256 + len(merges) < vocab_size and heap:
        neg, pair = heapq.heappop(heap)
        if counts.get(pair) != -neg:
            continue  # stale heap entry
        new = merges[pair] = 256 + len(merges)
        delta: dict[tuple[int, int], int] = defaultdict(int)
        for w in where.pop(pair):
            old, f = words[w], freq[pieces[w]]
            ids = _merge(old, pair, new)
            if len(ids) == len(old):
                continue
            for p in zip(old, old[1:]):
                delta[p] -= f
            for p in zip(ids, ids[1:]):
                delta[p] += f
                if new in p:
                    where[p].add(w)
            words[w] = ids
        for p, d in delta.items():
            if d:
                counts[p] += d
                if counts[p]:
                    heapq.heappush(heap, (-counts[p], p))
                else:
                    del counts[p]
    return Tokenizer(merges, dict(zip(pieces, words)))


# ------------------------------------------------------------------------------------------------------------------
# Model and training
# ------------------------------------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.fc, self.out = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class LM(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:  # GPT-2 init: residual outputs scaled down with depth
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        """The states that enter the head (after the final norm)."""
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)


def train_lm(
    model: LM,
    tokens: torch.Tensor,
    *,
    seq_len: int,
    batch_size: int,
    train_seconds: float,
    steps: int | None,
    lr: float,
    warmup: int,
    seed: int,
    log_every: int = 50,
) -> dict:
    """AdamW on random windows of ``tokens`` until ``train_seconds`` or ``steps`` (whichever comes first); the
    cosine schedule follows whichever of the two is further along. ``train_loss``: mean of the last
    ``log_every`` steps."""
    device = tokens.device
    decay = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )
    gen = torch.Generator(device=device).manual_seed(seed)
    offsets = torch.arange(seq_len + 1, device=device)
    recent: deque[torch.Tensor] = deque(maxlen=log_every)  # kept on the device: no sync per step
    step, t0 = 0, time.perf_counter()
    while True:
        progress = max((time.perf_counter() - t0) / train_seconds, step / steps if steps else 0.0)
        if progress >= 1.0:
            break
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))
        starts = torch.randint(0, len(tokens) - seq_len - 1, (batch_size,), device=device, generator=gen)
        window = tokens[starts[:, None] + offsets]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model.head(model.hidden(window[:, :-1]))
        loss = F.cross_entropy(logits.float().flatten(0, 1), window[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        recent.append(loss.detach())
        if step % log_every == 0:
            _log(
                f"step {step}  train loss {torch.stack(tuple(recent)).mean().item():.4f}  "
                f"{time.perf_counter() - t0:.1f} s"
            )
    train_loss = torch.stack(tuple(recent)).mean().item() if recent else math.nan
    return {"steps": step, "train_loss": train_loss, "train_wall_s": time.perf_counter() - t0}


def real_text_head(
    device: str | torch.device,
    *,
    vocab_size: int = 65536,
    d_model: int = 2048,
    n_layers: int = 2,
    n_heads: int | None = None,
    seq_len: int = 512,
    batch_size: int = 16,
    train_seconds: float = 90.0,
    steps: int | None = None,
    lr: float = 6e-4,
    warmup: int = 50,
    n_tokens: int = 8192,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    max_corpus_bytes: int = 40_000_000,
) -> dict:
    """Train tokenizer + LM, then return the head inputs ``e`` (n_tokens x D), ``c`` (V x D), ``targets`` on the
    held-out last 5% of the corpus, with metadata (losses in nats)."""
    device = torch.device(device)
    t0 = time.perf_counter()
    text = collect_corpus(max_corpus_bytes)
    tok = train_tokenizer(text, vocab_size)
    tokens = tok.encode(text).to(device)
    tokenizer_s = time.perf_counter() - t0
    _log(
        f"corpus {len(text.encode()) / 1e6:.1f} MB -> {len(tokens)} tokens, vocab {tok.vocab_size}, {tokenizer_s:.1f} s"
    )
    split = int(len(tokens) * 0.95)
    windows = -(-n_tokens // seq_len)
    if len(tokens) - split < windows * seq_len + 1:
        raise ValueError(
            f"held-out text has {len(tokens) - split} tokens; need {windows * seq_len + 1}: raise max_corpus_bytes"
        )
    torch.manual_seed(seed)
    model = LM(tok.vocab_size, d_model, n_layers, n_heads or max(1, d_model // 128), seq_len).to(device)
    info = train_lm(
        model,
        tokens[:split],
        seq_len=seq_len,
        batch_size=batch_size,
        train_seconds=train_seconds,
        steps=steps,
        lr=lr,
        warmup=warmup,
        seed=seed,
    )
    # Contiguous windows, so the targets are simply the next tokens of a held-out stretch.
    held = tokens[split : split + windows * seq_len + 1]
    model.eval()
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        e = model.hidden(held[:-1].view(windows, seq_len)).flatten(0, 1)[:n_tokens]
    e = e.to(dtype).contiguous()
    c = model.head.weight.detach().to(dtype).contiguous()
    targets = held[1 : n_tokens + 1].clone()
    eval_loss = (
        sum(
            F.cross_entropy(e[i : i + 1024].float() @ c.float().T, targets[i : i + 1024], reduction="sum")
            for i in range(0, n_tokens, 1024)
        ).item()
        / n_tokens
    )
    _log(
        f"trained {info['steps']} steps in {info['train_wall_s']:.1f} s: train loss {info['train_loss']:.4f}, "
        f"held-out loss {eval_loss:.4f}"
    )
    return {
        "e": e,
        "c": c,
        "targets": targets,
        "corpus_bytes": len(text.encode()),
        "corpus_tokens": len(tokens),
        "vocab_size": tok.vocab_size,
        "d_model": d_model,
        "n_layers": n_layers,
        "seq_len": seq_len,
        "batch_size": batch_size,
        "tokenizer_s": tokenizer_s,
        **info,
        "eval_loss": eval_loss,
    }


# ------------------------------------------------------------------------------------------------------------------
# Softmax statistics
# ------------------------------------------------------------------------------------------------------------------


def _as_tiles(p: torch.Tensor, tile: int, v_pad: int) -> torch.Tensor:
    """(rows, V) -> (row blocks, tile, vocabulary tiles, tile), zero-padded (zeros skip and drop nothing)."""
    p = F.pad(p, (0, v_pad - p.shape[1], 0, -p.shape[0] % tile))
    return p.view(p.shape[0] // tile, tile, v_pad // tile, tile)


def _dropped_sq(p_tiles: torch.Tensor, drop: torch.Tensor, c_pad: torch.Tensor, rows: int) -> torch.Tensor:
    """Squared norm of the dE part that the dropped tiles carry: (p in dropped tiles) @ C."""
    dropped = (p_tiles * drop[:, None, :, None]).flatten(0, 1).flatten(1)[:rows]
    return (dropped @ c_pad).square().sum(dtype=torch.float64)


def softmax_stats(
    e: torch.Tensor,
    c: torch.Tensor,
    targets: torch.Tensor,
    *,
    tile: int = 128,
    eps: float = 2**-12,
    bounds: tuple[float, ...] = (1e-3, 1e-4),
    chunk_rows: int = 1024,
) -> dict:
    """Statistics of p = softmax(e.float() @ c.float().T), ``chunk_rows`` rows at a time (see the module doc).

    Tiles are (``tile`` rows x ``tile`` vocabulary entries); "active" tiles hold an off-target p >= eps (the
    ones the paper's filter keeps). ``bounded_<b>_skip_share``: per row block, tiles sorted by their largest
    per-row mass are skipped while every row's skipped mass stays <= b -- a feasible filter, whose dE error is
    ``bounded_<b>_rel_err_dE``; ``bounded_<b>_skip_share_upper`` bounds every tile-granular filter with that
    guarantee (a block can skip no more tiles than its most constrained row could alone).
    """
    n, v = e.shape[0], c.shape[0]
    v_pad = -(-v // tile) * tile
    cf = c.float()
    c_pad = F.pad(cf, (0, 0, 0, v_pad - v))
    vocab_order = torch.argsort(cf @ e.float().mean(0), descending=True, stable=True)  # by mean logit
    c_sorted = F.pad(cf[vocab_order], (0, 0, 0, v_pad - v))
    rows_per_chunk = max(tile, chunk_rows // tile * tile)  # row blocks never straddle chunks
    above, tail, nll = [], [], 0.0
    tiles = active = active_sorted = 0
    de_sq = err_sq = err_sorted_sq = 0.0
    skipped = {b: 0 for b in bounds}
    upper = {b: 0 for b in bounds}
    bounded_sq = {b: 0.0 for b in bounds}
    for s in range(0, n, rows_per_chunk):
        t = targets[s : s + rows_per_chunk]
        m = len(t)
        logp = torch.log_softmax(e[s : s + m].float() @ cf.T, dim=1)
        nll -= logp.gather(1, t[:, None]).sum().item()
        p = logp.exp()
        above.append((p >= eps).sum(1))
        tail.append(torch.where(p < eps, p, 0.0).sum(1))
        g = p.scatter_add(1, t[:, None], -torch.ones(m, 1, device=p.device))
        de_sq += (g @ cf).square().sum(dtype=torch.float64).item()
        p_off = p.scatter(1, t[:, None], 0.0)  # the target entry is never filtered
        pt = _as_tiles(p_off, tile, v_pad)
        keep = pt.amax(dim=(1, 3)) >= eps
        tiles += keep.numel()
        active += keep.sum().item()
        err_sq += _dropped_sq(pt, ~keep, c_pad, m).item()
        pt_sorted = _as_tiles(p_off[:, vocab_order], tile, v_pad)
        keep_sorted = pt_sorted.amax(dim=(1, 3)) >= eps
        active_sorted += keep_sorted.sum().item()
        err_sorted_sq += _dropped_sq(pt_sorted, ~keep_sorted, c_sorted, m).item()
        mass = pt.sum(3)  # (blocks, rows, vocab tiles): each row's probability in each tile
        order = mass.amax(1).argsort(dim=1, stable=True)
        cum = mass.gather(2, order[:, None, :].expand_as(mass)).cumsum(2).amax(1)  # non-decreasing
        per_row = mass.sort(2).values.cumsum(2)
        for b in bounds:
            n_skip = (cum <= b).sum(1)
            skipped[b] += n_skip.sum().item()
            upper[b] += (per_row <= b).sum(2).amin(1).sum().item()
            drop = order.argsort(1) < n_skip[:, None]
            bounded_sq[b] += _dropped_sq(pt, drop, c_pad, m).item()
    above_t, tail_t = torch.cat(above).double(), torch.cat(tail).double()
    out = {
        "rows": n,
        "vocab": v,
        "tile": tile,
        "eps": eps,
        "loss": nll / n,
        "entries_ge_eps_median": above_t.quantile(0.5).item(),
        "entries_ge_eps_mean": above_t.mean().item(),
        "active_tile_share": active / tiles,
        "active_tile_share_sorted": active_sorted / tiles,
        "tail_mass_mean": tail_t.mean().item(),
        "tail_mass_median": tail_t.quantile(0.5).item(),
        "filter_rel_err_dE": math.sqrt(err_sq / de_sq),
        "filter_rel_err_dE_sorted": math.sqrt(err_sorted_sq / de_sq),
    }
    for b in bounds:
        out[f"bounded_{b:g}_skip_share"] = skipped[b] / tiles
        out[f"bounded_{b:g}_skip_share_upper"] = upper[b] / tiles
        out[f"bounded_{b:g}_rel_err_dE"] = math.sqrt(bounded_sq[b] / de_sq)
    return out


def _reference_stats(
    e: torch.Tensor, c: torch.Tensor, t: torch.Tensor, tile: int, eps: float, bounds: tuple[float, ...]
) -> dict:
    """``softmax_stats`` by loops over explicit tiles in float64 (slow; for ``_self_check``)."""
    n, v = len(t), len(c)
    p = torch.softmax(e.double() @ c.double().T, 1)
    g = p.clone()
    g[torch.arange(n), t] -= 1
    de = (g @ c.double()).norm()
    blocks = [range(i, min(i + tile, n)) for i in range(0, n, tile)]
    vtiles = [range(j, min(j + tile, v)) for j in range(0, v, tile)]
    mean_logit = (e.double() @ c.double().T).mean(0).tolist()
    by_mean = sorted(range(v), key=lambda k: -mean_logit[k])
    sorted_tiles = [by_mean[j : j + tile] for j in range(0, v, tile)]

    def off(r: int, k: int) -> float:
        return 0.0 if k == t[r] else p[r, k].item()

    def err(drops: list[tuple[range, list[int]]]) -> float:
        dropped = torch.zeros_like(p)
        for rows, cols in drops:
            for r in rows:
                for k in cols:
                    dropped[r, k] = off(r, k)
        return ((dropped @ c.double()).norm() / de).item()

    def inactive(tile_cols: list) -> list[tuple[range, list[int]]]:
        return [
            (rows, list(cols))
            for rows in blocks
            for cols in tile_cols
            if all(off(r, k) < eps for r in rows for k in cols)
        ]

    total = len(blocks) * len(vtiles)
    dropped_u, dropped_s = inactive(vtiles), inactive(sorted_tiles)
    out = {
        "entries_ge_eps_mean": (p >= eps).sum(1).double().mean().item(),
        "tail_mass_mean": torch.where(p < eps, p, 0).sum(1).mean().item(),
        "active_tile_share": 1 - len(dropped_u) / total,
        "active_tile_share_sorted": 1 - len(dropped_s) / total,
        "filter_rel_err_dE": err(dropped_u),
        "filter_rel_err_dE_sorted": err(dropped_s),
    }
    for b in bounds:
        greedy, joint, best, drops = 0, 0, 0, []
        for rows in blocks:
            mass = {j: [sum(off(r, k) for k in vt) for r in rows] for j, vt in enumerate(vtiles)}
            cum = [0.0] * len(rows)
            for j in sorted(mass, key=lambda j: max(mass[j])):
                cum = [x + y for x, y in zip(cum, mass[j])]
                if max(cum) > b:
                    break
                greedy += 1
                drops.append((rows, list(vtiles[j])))
            # by enumeration: the most tiles the whole block, and any one row alone, could lose within b
            subsets = [s for k in range(len(vtiles) + 1) for s in itertools.combinations(mass, k)]
            joint += max(len(s) for s in subsets if all(sum(mass[j][i] for j in s) <= b for i in range(len(rows))))
            best += min(max(len(s) for s in subsets if sum(mass[j][i] for j in s) <= b) for i in range(len(rows)))
        assert greedy <= joint <= best, (greedy, joint, best)
        out[f"bounded_{b:g}_skip_share"] = greedy / total
        out[f"bounded_{b:g}_skip_share_upper"] = best / total
        out[f"bounded_{b:g}_rel_err_dE"] = err(drops)
    return out


def _self_check() -> None:
    """softmax_stats against the loop reference on small random cases (padded last row block and vocabulary
    tile, several chunks), and the tokenizer's round trip and its cached vs. fresh segmentations."""
    for seed, scale in [(0, 1.0), (1, 2.0), (2, 3.0), (3, 4.0)]:
        gen = torch.Generator().manual_seed(seed)
        e, c = scale * torch.randn(11, 6, generator=gen), torch.randn(21, 6, generator=gen)
        t = torch.randint(0, 21, (11,), generator=gen)
        kw = dict(tile=4, eps=0.02, bounds=(0.05, 0.2))
        got, ref = softmax_stats(e, c, t, chunk_rows=4, **kw), _reference_stats(e, c, t, **kw)
        for key, want in ref.items():
            assert math.isclose(got[key], want, rel_tol=1e-4, abs_tol=1e-6), (seed, key, got[key], want)
        for b in kw["bounds"]:
            assert got[f"bounded_{b:g}_skip_share"] <= got[f"bounded_{b:g}_skip_share_upper"]
        _log(f"stats seed {seed}: " + json.dumps({k: round(v, 4) for k, v in got.items()}))
    text = collect_corpus(300_000)
    tok = train_tokenizer(text, 1024)
    assert tok.vocab_size == 1024
    sample = text[-20_000:] + " naïve Straße — ∑ 日本語 \t\r\n  x\n"
    assert tok.decode(tok.encode(sample)) == sample
    fresh = Tokenizer(tok.merges, {})
    pieces = PIECE.findall(text)[::97]
    assert all(fresh._bpe(p) == tok._cache[p] for p in pieces), "training and encoding segment differently"
    _log(f"tokenizer: {len(text.encode()) / len(tok.encode(text)):.2f} bytes/token at V=1024; round trip ok")
    print("self-check ok")


CLI_ARGS = (
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "seq_len",
    "batch_size",
    "train_seconds",
    "steps",
    "lr",
    "warmup",
    "n_tokens",
    "max_corpus_bytes",
    "seed",
)
TINY = dict(
    vocab_size=2048,
    d_model=64,
    n_layers=1,
    seq_len=64,
    batch_size=8,
    steps=20,
    train_seconds=math.inf,
    lr=3e-3,
    warmup=5,
    n_tokens=256,
    max_corpus_bytes=1_000_000,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    defaults = inspect.signature(real_text_head).parameters
    for name in CLI_ARGS:  # flags mirror real_text_head's keywords and defaults
        default = defaults[name].default
        kind = float if isinstance(default, float) else int
        ap.add_argument("--" + name.replace("_", "-"), default=default, type=kind)
    ap.add_argument("--tile", type=int, default=128)
    ap.add_argument("--save", default=None, help="torch.save {e, c, targets} here")
    ap.add_argument("--tiny", action="store_true", help="CPU-sized smoke run")
    ap.add_argument("--self-check", action="store_true", help="check the statistics and tokenizer, then exit")
    args = ap.parse_args()
    if args.self_check:
        _self_check()
        return
    if args.tiny:
        vars(args).update(TINY)
    head = real_text_head(args.device, **{name: getattr(args, name) for name in CLI_ARGS})
    if args.save:
        torch.save({k: head[k] for k in ("e", "c", "targets")}, args.save)
    meta = {k: v for k, v in head.items() if not isinstance(v, torch.Tensor)}
    stats = softmax_stats(head["e"], head["c"], head["targets"], tile=args.tile)
    print(json.dumps({**meta, **stats}))


if __name__ == "__main__":
    main()
