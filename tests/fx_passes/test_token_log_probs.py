"""Tests of the token log-probs pass (``cce_inductor/fx_passes/token_log_probs.py``) by graph matching: the
log-probabilities of sampled tokens after a temperature (GRPO / PPO: gather of a log-softmax with ratios, clipping,
advantages and a mask; TRL's ``selective_log_softmax`` in both its branches; OpenRLHF's ``logprobs_from_logits``; a
gather minus a logsumexp), Dynamo's graph before and after the pass and parity with eager PyTorch
(``tests/support/patterns.py``); a gather that is not a token log-prob is left alone.

With the entropy of the same logits: ``test_entropy.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import cce_inductor
from tests.support.graphs import PassCapture
from tests.support.patterns import B, D, PatternTestCase, T, V, rand_hidden, rand_weight


class TestMatchedPatterns(PatternTestCase):
    def setUp(self):
        super().setUp()
        torch.manual_seed(0)

    def test_grpo_token_log_probs(self):
        """GRPO / PPO: log-probabilities of the sampled tokens after a temperature, then ratios against detached
        old log-probabilities, clipping, advantages and a mask; a token's log-probability is minus its
        cross-entropy, so the op computes it without the logits."""
        weight = rand_weight(V, D)

        def f(hidden, ids, old_logps, advantages, mask):
            logits = F.linear(hidden, weight)[:, :-1, :]
            logits = logits / 0.7
            logps = torch.gather(logits.log_softmax(-1), dim=-1, index=ids[:, 1:].unsqueeze(-1)).squeeze(-1)
            ratio = torch.exp(logps - old_logps)
            clipped = torch.clamp(ratio, 0.8, 1.2)
            per_token = -torch.min(ratio * advantages[:, None], clipped * advantages[:, None])
            return (per_token * mask).sum() / mask.sum()

        ids = torch.randint(0, V, (B, T))
        old_logps = -torch.rand(B, T - 1) * 4
        mask = (torch.rand(B, T - 1) < 0.7).float()
        cap = self.run_pass(f, rand_hidden(B, T, D), ids, old_logps, torch.randn(B), mask, params=[weight])
        self.assertExpectedInline(
            cap.after[0],
            """\
def forward(self, L_advantages_ : torch.Tensor, L_hidden_ : torch.Tensor, L_ids_ : torch.Tensor, L_mask_ : torch.Tensor, L_old_logps_ : torch.Tensor, L_weight_ : torch.Tensor):
    l_advantages_ = L_advantages_
    l_hidden_ = L_hidden_
    l_ids_ = L_ids_
    l_mask_ = L_mask_
    l_old_logps_ = L_old_logps_
    l_weight_ = L_weight_
    getitem_1 = l_ids_[(slice(None, None, None), slice(1, None, None))]
    unsqueeze = getitem_1.unsqueeze(-1)
    mul_3 = l_hidden_ * 1.4285714285714286
    getitem_4 = mul_3[(slice(None, None, None), slice(None, -1, None), slice(None, None, None))]
    squeeze_1 = unsqueeze.squeeze(-1)
    flatten = getitem_4.flatten(0, -2)
    flatten_1 = squeeze_1.flatten()
    linear_cross_entropy_default = torch.ops.cce_inductor.linear_cross_entropy.default(flatten, l_weight_, flatten_1, None, None, -9223372036854775808, 'none', 0.0, 'exact=False;products=auto;backward_row_chunk=8192;path=auto;scratch_mb=0', False, False)
    getitem_5 = linear_cross_entropy_default[0]
    neg_1 = -getitem_5
    view_as = neg_1.view_as(squeeze_1)
    sub = view_as - l_old_logps_
    ratio = torch.exp(sub)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    getitem_2 = l_advantages_[(slice(None, None, None), None)]
    mul = ratio * getitem_2
    getitem_3 = l_advantages_[(slice(None, None, None), None)]
    mul_1 = clipped * getitem_3
    min_1 = torch.min(mul, mul_1)
    per_token = -min_1
    mul_2 = per_token * l_mask_
    sum_1 = mul_2.sum()
    sum_2 = l_mask_.sum()
    truediv_1 = sum_1 / sum_2
    return (truediv_1,)""",
        )
        self.assertIn("token log-probs", cce_inductor.stats()["sites"][0]["reason"])

    @staticmethod
    def _trl_selective_log_softmax(logits, index):
        """TRL's ``selective_log_softmax``, as TRL writes it: gather minus a row loop of logsumexp in fp32 / fp64, a
        loop over the batch rows of log_softmax-gather otherwise."""
        if logits.dtype in [torch.float32, torch.float64]:
            selected_logits = torch.gather(logits, dim=-1, index=index.unsqueeze(-1)).squeeze(-1)
            logsumexp_values = torch.stack([torch.logsumexp(lg, dim=-1) for lg in logits])
            per_token_logps = selected_logits - logsumexp_values
        else:
            per_token_logps = []
            for row_logits, row_labels in zip(logits, index, strict=True):
                row_logps = F.log_softmax(row_logits, dim=-1)
                row_per_token_logps = row_logps.gather(dim=-1, index=row_labels.unsqueeze(-1)).squeeze(-1)
                per_token_logps.append(row_per_token_logps)
            per_token_logps = torch.stack(per_token_logps)
        return per_token_logps

    def test_trl_selective_log_softmax_fp32(self):
        """The fp32 branch: ``gather(logits, ids) - stack([logsumexp(row) for row in logits])``."""
        weight = rand_weight(V, D)

        def f(hidden, ids):
            logits = (hidden @ weight.T)[:, :-1, :] / 0.7
            return self._trl_selective_log_softmax(logits, ids[:, 1:]).mean()

        cap = self.run_pass(f, rand_hidden(B, T, D), torch.randint(0, V, (B, T)), params=[weight])
        self.assertExpectedInline(
            cap.after[0],
            """\
def forward(self, L_hidden_ : torch.Tensor, L_ids_ : torch.Tensor, L_weight_ : torch.Tensor):
    l_hidden_ = L_hidden_
    l_ids_ = L_ids_
    l_weight_ = L_weight_
    getitem_1 = l_ids_[(slice(None, None, None), slice(1, None, None))]
    unsqueeze = getitem_1.unsqueeze(-1)
    mul = l_hidden_ * 1.4285714285714286
    getitem_4 = mul[(slice(None, None, None), slice(None, -1, None), slice(None, None, None))]
    squeeze_1 = unsqueeze.squeeze(-1)
    flatten = getitem_4.flatten(0, -2)
    flatten_1 = squeeze_1.flatten()
    linear_cross_entropy_default = torch.ops.cce_inductor.linear_cross_entropy.default(flatten, l_weight_, flatten_1, None, None, -9223372036854775808, 'none', 0.0, 'exact=False;products=auto;backward_row_chunk=8192;path=auto;scratch_mb=0', False, False)
    getitem_5 = linear_cross_entropy_default[0]
    neg = -getitem_5
    view_as = neg.view_as(squeeze_1)
    mean = view_as.mean()
    return (mean,)""",
        )

    def test_trl_selective_log_softmax_bf16_row_loop(self):
        """The 16-bit branch: a loop over the batch rows, each row's log_softmax-gather, stacked. Eager computes it in
        bf16; the op in fp32: against an fp32 reference its error is no larger than eager's own."""
        weight = torch.randn(V, D, dtype=torch.bfloat16, requires_grad=True)

        def f(hidden, ids, w):
            return self._trl_selective_log_softmax(F.linear(hidden, w) / 0.7, ids)

        hidden = torch.randn(B, T, D, dtype=torch.bfloat16)
        ids = torch.randint(0, V, (B, T))
        cap = PassCapture()
        got = torch.compile(f, backend=cap, fullgraph=True)(hidden, ids, weight)
        self.assertEqual(cap.rewrites, [1])
        self.assertEqual(cap.after[0].count("linear_cross_entropy.default("), 1)
        self.assertNotIn("stack", cap.after[0])
        want = f(hidden.float(), ids, weight.float())
        eager = f(hidden, ids, weight)
        self.assertEqual((got.dtype, got.shape), (eager.dtype, eager.shape))
        self.assertLessEqual((got.float() - want).norm(), (eager.float() - want).norm())
        self.assertIn("token log-probs of l_ids_", cce_inductor.stats()["sites"][0]["reason"])

    def test_gather_minus_logsumexp(self):
        """The vectorised ``gather - logsumexp`` spelling (OpenRLHF's logprobs_from_logits for fp32 logits)."""
        weight = rand_weight(V, D)

        def f(hidden, ids):
            logits = F.linear(hidden, weight).float()
            logps = torch.gather(logits, dim=-1, index=ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
            return logps.sum()

        self.run_pass(f, rand_hidden(B, T, D), torch.randint(0, V, (B, T)), params=[weight])

    def test_openrlhf_log_probs_from_logits(self):
        """OpenRLHF's form: bf16 head, upcast, F.log_softmax, .gather(dim=-1, ...), no squeeze."""
        weight = torch.randn(V, D, dtype=torch.bfloat16, requires_grad=True)

        def f(hidden, labels):
            log_probs = F.log_softmax(F.linear(hidden, weight).float(), dim=-1)
            return log_probs.gather(dim=-1, index=labels.unsqueeze(-1)) * 0.5

        hidden = torch.randn(B, T, D, dtype=torch.bfloat16, requires_grad=True)
        self.run_pass(f, hidden, torch.randint(0, V, (B, T)), params=[weight], atol=1e-2, rtol=1e-2)


class TestRefusals(PatternTestCase):
    """Sites the pass must leave alone, each with the reason it reports."""

    def setUp(self):
        super().setUp()
        torch.manual_seed(0)

    def test_gather_over_the_rows_minus_logsumexp_is_not_a_log_prob(self):
        """``gather(logits, 0, ids) - logsumexp(logits, -1)`` picks entries down a column, not a token per row: not
        the token log-probs spelling, left alone (no site at all)."""
        weight = rand_weight(V, D)

        def f(hidden, ids):
            logits = F.linear(hidden, weight)
            return (torch.gather(logits, 0, ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, -1)).sum()

        cap = self.run_pass(f, rand_hidden(12, D), torch.randint(0, 12, (12,)), rewrites=0)
        self.assertEqual(cap.before, cap.after)
        self.assertEqual(cce_inductor.stats()["sites"], [])
