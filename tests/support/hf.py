"""Tiny Hugging Face causal LMs built from configs (no download): one per family, each with a different head
(softcap, logit scaling, tied weights, ...), and a batch whose first tokens are not trained on.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 96
TINY = dict(
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

# family -> extra config; each one exercises a different head (softcap, scaling, tied weights, ...)
FAMILIES = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "phi3": {},
    "gemma2": {"final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
    "gpt2": None,  # its own config class below
    "qwen3": {},
    "gemma3_text": {"final_logit_softcapping": 30.0},
    "granite": {"logits_scaling": 4.0},
    "cohere": {"logit_scale": 0.125},
    "olmo2": {},
}


def hf_config(family: str):
    if family == "gpt2":
        return transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0
        )
    return transformers.AutoConfig.for_model(family, **TINY, **FAMILIES[family])


def hf_model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family))
    return model.eval()  # no dropout: eager and compiled must see the same function


def hf_batch(batch=2, seq=12, pad=3, seed=1):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (batch, seq), generator=generator)
    labels = input_ids.clone()
    labels[:, :pad] = -100  # e.g. a prompt that is not trained on
    return input_ids, labels
