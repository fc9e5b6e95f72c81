"""Hand-written training steps as real code writes them (nanoGPT, torchtitan, torchtune, a large-class classifier,
TRL-style GRPO with and without an entropy bonus, torchtune's chunked output head), compiled: each case checks that
the loss site is rewritten (or, where expected, left alone with the right reason) and that the loss and every
parameter gradient equal eager PyTorch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cce_inductor
from cce_inductor.options import CCEOptions
from tests.support.compare import inductor_caches_off
from tests.support.graphs import PassCapture

VOCAB = 96


class NanoGPT(nn.Module):
    """nanoGPT's shape of things: tied wte/lm_head, loss inside forward with ignore_index=-1."""

    def __init__(self, vocab=VOCAB, dim=32):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.block = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        x = self.wte(idx)
        x = self.ln_f(x + self.block(x))
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


class TitanStyle(nn.Module):
    """torchtitan: bf16-friendly head, loss on pred.flatten(0, 1).float()."""

    def __init__(self, vocab=VOCAB, dim=32):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        return self.output(self.norm(self.tok_embeddings(tokens)))


def _nanogpt_batch():
    idx = torch.randint(0, VOCAB, (2, 10))
    targets = torch.randint(0, VOCAB, (2, 10))
    targets[0, -3:] = -1
    return idx, targets


def _compare_training_step(module, step, *args, atol=2e-5, rtol=1e-4):
    """``step(module, *args)`` returns the loss; compare compiled (PassCapture) against eager."""
    params = [p for p in module.parameters() if p.requires_grad]
    expected = step(module, *args)
    expected_grads = torch.autograd.grad(expected, params)
    capture = PassCapture(CCEOptions(drop_logits=True))
    compiled_step = torch.compile(step, backend=capture)
    actual = compiled_step(module, *args)
    actual_grads = torch.autograd.grad(actual, params)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
    for got, want in zip(actual_grads, expected_grads):
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    return capture


def test_nanogpt_tied_head():
    torch.manual_seed(0)
    capture = _compare_training_step(NanoGPT(), lambda m, idx, y: m(idx, y)[1], *_nanogpt_batch())
    assert sum(capture.rewrites) == 1  # the returned logits are dropped (opt-in), as nanoGPT ignores them


def test_nanogpt_without_opt_in_is_left_alone():
    torch.manual_seed(0)
    model = NanoGPT()
    capture = PassCapture(CCEOptions(lazy_logits=False))  # (the default, lazy logits: tests/clients)
    idx, targets = _nanogpt_batch()
    torch.compile(model, backend=capture)(idx, targets)
    assert sum(capture.rewrites) == 0
    assert "logits escape" in next(iter(cce_inductor.stats()["reasons"]))


def test_torchtitan_flatten_float():
    torch.manual_seed(0)

    def step(model, tokens, labels):
        pred = model(tokens)
        return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))

    tokens, labels = _nanogpt_batch()
    capture = _compare_training_step(TitanStyle(), step, tokens, labels.clamp(min=0))
    assert sum(capture.rewrites) == 1


def test_torchtune_style_loss_outside_model_inside_compiled_region():
    torch.manual_seed(0)
    model = TitanStyle()

    def step(model, tokens, labels):
        logits = model(tokens)
        labels = torch.hstack((labels[..., 1:], torch.full_like(labels[..., :1], -100)))  # torchtune's shift
        return nn.CrossEntropyLoss(ignore_index=-100)(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1))

    tokens, labels = _nanogpt_batch()
    capture = _compare_training_step(model, step, tokens, labels.clamp(min=0))
    assert sum(capture.rewrites) == 1


def test_large_class_classifier_head():
    torch.manual_seed(0)
    classes, dim = 1000, 24
    backbone = nn.Sequential(nn.Linear(12, dim), nn.ReLU())
    head = nn.Linear(dim, classes)
    model = nn.Sequential(backbone, head)

    def step(model, features, labels):
        return F.cross_entropy(model(features), labels, reduction="sum")

    capture = _compare_training_step(model, step, torch.randn(33, 12), torch.randint(0, classes, (33,)))
    assert sum(capture.rewrites) == 1


@pytest.mark.slow
def test_grpo_style_step_through_inductor():
    """TRL-style GRPO loss on a small decoder, compiled with the real backend (AOTAutograd + Inductor): the
    per-token log-probabilities of the sampled completion, after the temperature, against detached old ones, with
    clipping, advantages and a completion mask; loss and every parameter gradient equal eager."""
    torch.manual_seed(0)
    model = TitanStyle()
    temperature, eps = 0.9, 0.2

    def step(model, tokens, old_logps, advantages, mask):
        logits = model(tokens)[:, :-1, :] / temperature
        logps = torch.gather(logits.log_softmax(dim=-1), dim=-1, index=tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
        ratio = torch.exp(logps - old_logps)
        per_token = -torch.min(ratio * advantages[:, None], torch.clamp(ratio, 1 - eps, 1 + eps) * advantages[:, None])
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()

    tokens, _ = _nanogpt_batch()
    b, t = tokens.shape
    inputs = (tokens, -torch.rand(b, t - 1) * 5, torch.randn(b), (torch.rand(b, t - 1) < 0.8).float())
    expected = step(model, *inputs)
    expected.backward()
    expected_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with inductor_caches_off():
        actual = torch.compile(step, backend=cce_inductor.backend, fullgraph=True)(model, *inputs)
    actual.backward()
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected_grads[name], atol=2e-5, rtol=1e-4, msg=name)
    assert cce_inductor.stats()["rewritten"] == 1, cce_inductor.stats()["summary"]
    assert "token log-probs" in cce_inductor.stats()["sites"][0]["reason"]


@pytest.mark.parametrize("dynamic", [False, True])
def test_grpo_step_with_entropy_bonus_through_inductor(dynamic):
    """TRL's GRPO scoring with its entropy: ``selective_log_softmax`` and the row-chunked ``entropy_from_logits`` of
    the same temperature-scaled logits, an entropy bonus in the loss, through the real backend: one fused call,
    eager's loss and every parameter gradient."""
    torch.manual_seed(0)
    model = TitanStyle()
    temperature = 0.9

    def entropy_from_logits(logits, chunk_size=8):
        flat_logits = logits.reshape(-1, logits.shape[-1])
        entropies = []
        for chunk in flat_logits.split(chunk_size, dim=0):
            logps = F.log_softmax(chunk, dim=-1)
            entropies.append(-(torch.exp(logps) * logps).sum(-1))
        return torch.cat(entropies, dim=0).reshape(logits.shape[:-1])

    def step(model, tokens, advantages, mask):
        logits = model(tokens)[:, :-1, :] / temperature
        logps = torch.gather(logits.log_softmax(dim=-1), dim=-1, index=tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
        entropies = entropy_from_logits(logits)
        per_token = -torch.exp(logps - logps.detach()) * advantages[:, None] - 0.01 * entropies
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean(), entropies.detach()

    tokens, _ = _nanogpt_batch()
    b, t = tokens.shape
    inputs = (tokens, torch.randn(b), (torch.rand(b, t - 1) < 0.8).float())
    expected, expected_entropies = step(model, *inputs)
    expected.backward()
    expected_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with inductor_caches_off():
        actual, entropies = torch.compile(step, backend=cce_inductor.backend, fullgraph=True, dynamic=dynamic)(
            model, *inputs
        )
    actual.backward()
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(entropies, expected_entropies, atol=2e-5, rtol=1e-4)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected_grads[name], atol=2e-5, rtol=1e-4, msg=name)
    stats = cce_inductor.stats()
    # (with dynamic shapes the pass may see the graph twice)
    assert stats["skipped"] == 0 and stats["rewritten"] >= 1, stats["summary"]
    assert stats["executions"]["linear_cross_entropy"] == 1  # one call for the log-probs and every entropy chunk
    assert "entropy and token log-probs" in stats["sites"][0]["reason"]


@pytest.mark.slow
@pytest.mark.parametrize("dynamic", [False, True])
def test_torchtune_chunked_output_through_inductor(dynamic):
    """torchtune's chunked output head (the head on 8 chunks of the sequence, a summed cross-entropy per chunk,
    normalised by the counted tokens) through the real backend: one fused call, eager's loss and gradients."""
    torch.manual_seed(0)
    model = TitanStyle()

    def step(model, tokens, labels):
        hidden = model.norm(model.tok_embeddings(tokens))
        logits = [model.output(chunk) for chunk in hidden.chunk(8, dim=1)]
        label_chunks = [chunk.reshape(-1) for chunk in labels.chunk(8, dim=1)]
        total = 0.0
        for logits_chunk, labels_chunk in zip(logits, label_chunks):
            total += F.cross_entropy(
                logits_chunk.reshape(-1, logits_chunk.size(-1)).float(),
                labels_chunk,
                ignore_index=-100,
                reduction="sum",
            )
        return total / (labels != -100).sum()

    tokens, labels = torch.randint(0, VOCAB, (2, 16)), torch.randint(0, VOCAB, (2, 16))
    labels[:, ::3] = -100
    expected = step(model, tokens, labels)
    expected.backward()
    expected_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with inductor_caches_off():
        actual = torch.compile(step, backend=cce_inductor.backend, fullgraph=True, dynamic=dynamic)(
            model, tokens, labels
        )
    actual.backward()
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected_grads[name], atol=2e-5, rtol=1e-4, msg=name)
    stats = cce_inductor.stats()
    # (dynamic=True: Dynamo may trace the frame twice, the pass then sees 8 sites each time)
    assert stats["skipped"] == 0 and stats["rewritten"] % 8 == 0 and stats["rewritten"] > 0, stats["summary"]
    assert stats["executions"]["linear_cross_entropy"] == 1  # one call for the 8 chunks
