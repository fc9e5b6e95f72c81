"""Tiny models, data and a tokenizer for the client tests: built in code, nothing downloaded."""

from __future__ import annotations

import math

import torch

VOCAB = 1001  # odd on purpose: no dimension is a multiple of anything


def tiny_config(family: str = "llama", **extra):
    import transformers

    if family == "gpt2":
        return transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2, **extra
        )
    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        head_dim=8,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    base.update(extra)
    return transformers.AutoConfig.for_model(family, **base)


def tiny_model(family: str = "llama", seed: int = 0, **extra):
    import transformers

    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(family, **extra))


def sequences(n: int = 16, length: int = 12, seed: int = 0) -> list[list[int]]:
    """Learnable data (each sequence repeats a token from a small set, so the token accuracy leaves 0 within a few
    steps), a few random tokens in each so that the loss stays away from 0."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for k in torch.randint(3, 8, (n,), generator=generator).tolist():
        row = [k] * length
        for i in torch.randint(0, length, (2,), generator=generator).tolist():
            row[i] = int(torch.randint(3, VOCAB, (1,), generator=generator))
        rows.append(row)
    return rows


class LMDataset(torch.utils.data.Dataset):
    """``input_ids`` / ``labels`` (the first 3 positions ignored: a prompt) / ``attention_mask``."""

    def __init__(self, rows: list[list[int]]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        ids = torch.tensor(self.rows[i])
        labels = ids.clone()
        labels[:3] = -100
        return dict(input_ids=ids, labels=labels, attention_mask=torch.ones_like(ids))


def tokenizer():
    """A word-level fast tokenizer over ``w0 .. w{VOCAB-1}`` (w0 pads, w1 / w2 begin / end)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="w0", bos_token="w1", eos_token="w2", unk_token="w0")


def training_logs(history: list[dict]) -> list[dict]:
    """``Trainer.state.log_history`` without the wall-clock entries."""
    timing = ("runtime", "per_second", "total_flos")
    return [{k: v for k, v in entry.items() if not any(t in k for t in timing)} for entry in history]


def assert_same_logs(
    got: list[dict],
    want: list[dict],
    *,
    rel: float,
    abs_: float = 1e-6,
    per_key: dict | None = None,
    abs_per_key: dict | None = None,
) -> None:
    """Every logged entry has the same keys and, per key, values within ``rel`` (``per_key[key]`` where given) /
    ``abs_`` (``abs_per_key[key]`` where given)."""
    assert len(got) == len(want), (got, want)
    for step, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys(), (step, g, w)
        for key in w:
            a, b = g[key], w[key]
            if isinstance(b, float) and not (math.isnan(a) and math.isnan(b)):
                tolerance = (per_key or {}).get(key, rel)
                message = f"entry {step}, {key}: {a} != {b}\n{got}\n{want}"
                assert math.isclose(a, b, rel_tol=tolerance, abs_tol=(abs_per_key or {}).get(key, abs_)), message
            else:
                assert a == b, (step, key, a, b)
