"""Tests of the entropy pass (``cce_inductor/fx_passes/entropy.py``) by graph matching: the entropy of the head's
softmax alone (verl's ``entropy_from_logits``) and with the token log-probs of the same logits (TRL's GRPO scoring
with its chunked entropy, an entropy bonus sharing the log-softmax), Dynamo's graph before and after the pass and
parity with eager PyTorch (``tests/support/patterns.py``); entropies beside other uses of the logits left alone, each
with its reason; near misses of the entropy and token log-probs spellings (close in shape, different in value)
never rewritten.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import cce_inductor
from tests.support.patterns import B, D, PatternTestCase, T, V, rand_hidden, rand_labels, rand_weight


class TestMatchedPatterns(PatternTestCase):
    def setUp(self):
        super().setUp()
        torch.manual_seed(0)

    def test_verl_entropy_alone(self):
        """verl's ``entropy_from_logits`` (logsumexp minus the softmax-weighted logits, ``axis=`` keyword) of a
        temperature-scaled bf16 head, logged or used as a bonus on its own: one call, entropy from the op."""
        weight = torch.randn(V, D, dtype=torch.bfloat16, requires_grad=True)

        def f(hidden):
            logits = F.linear(hidden, weight).float() / 0.8
            pd = torch.nn.functional.softmax(logits, dim=-1)
            entropy = torch.logsumexp(logits, axis=-1) - torch.sum(pd * logits, axis=-1)
            return entropy.mean()

        hidden = torch.randn(B, T, D, dtype=torch.bfloat16, requires_grad=True)
        cap = self.run_pass(f, hidden, params=[weight], atol=1e-2, rtol=1e-2)
        self.assertExpectedInline(
            cap.after[0],
            """\
def forward(self, L_hidden_ : torch.Tensor, L_weight_ : torch.Tensor):
    l_hidden_ = L_hidden_
    l_weight_ = L_weight_
    mul_1 = l_hidden_ * 1.25
    size = mul_1.size()
    getitem = size[slice(None, -1, None)]
    new_zeros = mul_1.new_zeros(getitem, dtype = torch.int64)
    flatten = mul_1.flatten(0, -2)
    flatten_1 = new_zeros.flatten()
    linear_cross_entropy_default = torch.ops.cce_inductor.linear_cross_entropy.default(flatten, l_weight_, flatten_1, None, None, -9223372036854775808, 'none', 0.0, 'exact=False;products=auto;backward_row_chunk=8192;path=auto;scratch_mb=0', False, True)
    getitem_1 = linear_cross_entropy_default[2]
    view = getitem_1.view(getitem)
    mean = view.mean()
    return (mean,)""",
        )
        self.assertIn("entropy: linear: linear, scale=1.25", cce_inductor.stats()["sites"][0]["reason"])
        self.assertTrue(cce_inductor.stats()["summary"].startswith("rewrote 1 of 1 loss sites in 1 graphs"))

    def test_trl_grpo_log_probs_and_chunked_entropy(self):
        """TRL's GRPO scoring: ``selective_log_softmax`` of the completion ids and ``entropy_from_logits`` (the
        entropy over 4-row chunks of ``logits.reshape(-1, V)``, concatenated) of the same temperature-scaled
        logits; one call gives both, with the gradient of each."""
        weight = rand_weight(V, D)

        def selective_log_softmax(logits, index):
            return torch.gather(logits.log_softmax(-1), dim=-1, index=index.unsqueeze(-1)).squeeze(-1)

        def entropy_from_logits(logits, chunk_size=4):
            original_shape = logits.shape[:-1]
            num_classes = logits.shape[-1]
            flat_logits = logits.reshape(-1, num_classes)
            entropies = []
            for chunk in flat_logits.split(chunk_size, dim=0):
                logps = F.log_softmax(chunk, dim=-1)
                chunk_entropy = -(torch.exp(logps) * logps).sum(-1)
                entropies.append(chunk_entropy)
            return torch.cat(entropies, dim=0).reshape(original_shape)

        def f(hidden, ids, advantages, mask):
            logits = hidden @ weight.T
            logits = logits[:, :-1, :] / 0.7
            logps = selective_log_softmax(logits, ids[:, 1:])
            entropies = entropy_from_logits(logits)
            per_token = -torch.exp(logps - logps.detach()) * advantages[:, None] - 0.01 * entropies
            return (per_token * mask).sum() / mask.sum()

        ids = torch.randint(0, V, (B, T))
        mask = (torch.rand(B, T - 1) < 0.7).float()
        cap = self.run_pass(f, rand_hidden(B, T, D), ids, torch.randn(B), mask, params=[weight])
        after = cap.after[0]
        self.assertEqual(after.count("linear_cross_entropy.default("), 1)
        self.assertNotIn("log_softmax", after)
        self.assertNotIn("cat(", after)
        self.assertIn(
            "-9223372036854775808, 'none', 0.0, 'exact=False;products=auto;backward_row_chunk=8192;path=auto;scratch_mb=0', "
            "False, True)",
            after,
        )
        reason = cce_inductor.stats()["sites"][0]["reason"]
        self.assertIn("entropy and token log-probs", reason)

    def test_entropy_bonus_sharing_the_log_softmax_with_the_log_probs(self):
        """One log_softmax read by the gather and by the entropy (softmax times log-softmax, ``-torch.sum``),
        Gemma-2's softcap and a bias on the head: one call."""
        head = torch.nn.Linear(D, V)

        def f(hidden, ids):
            logits = torch.tanh(head(hidden) / 5.0) * 5.0
            log_probs = F.log_softmax(logits, dim=-1)
            logps = log_probs.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
            entropy = -torch.sum(F.softmax(logits, dim=-1) * log_probs, dim=-1)
            return (logps + 0.01 * entropy).mean()

        cap = self.run_pass(f, rand_hidden(B, T, D), torch.randint(0, V, (B, T)), params=list(head.parameters()))
        self.assertEqual(cap.after[0].count("linear_cross_entropy.default("), 1)
        self.assertIn("softcap=5", cce_inductor.stats()["sites"][0]["reason"])


class TestRefusals(PatternTestCase):
    """Sites the pass must leave alone, each with the reason it reports."""

    def setUp(self):
        super().setUp()
        torch.manual_seed(0)

    def test_entropy_next_to_a_cross_entropy_of_the_same_logits(self):
        """An SFT loss that also logs the entropy of its logits: neither is rewritten alone (the other would keep the
        logits alive); the cross-entropy reports the entropy's use of its logits."""
        weight = rand_weight(V, D)

        def f(hidden, labels):
            logits = F.linear(hidden, weight)
            entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
            return F.cross_entropy(logits, labels) + 0.0 * entropy.mean()

        cap = self.run_pass(f, rand_hidden(B * T, D), rand_labels(B * T), rewrites=0)
        self.assertEqual(cap.before, cap.after)
        reasons = [site["reason"] for site in cce_inductor.stats()["sites"]]
        self.assertEqual(len(reasons), 2, reasons)
        self.assertTrue(any("are also used by" in r and "softmax" in r for r in reasons), reasons)
        self.assertTrue(any(r.startswith("entropy: ") and "cross_entropy" in r for r in reasons), reasons)

    def test_entropy_with_an_epsilon_inside_the_log_is_not_an_entropy(self):
        """``-(p * log(p + 1e-8)).sum(-1)`` is not the entropy (it differs where p is tiny): left alone, and the
        log-probs beside it report why."""
        weight = rand_weight(V, D)

        def f(hidden, ids):
            logits = F.linear(hidden, weight)
            logps = logits.log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
            p = logits.softmax(-1)
            return (logps - 0.01 * (p * torch.log(p + 1e-8)).sum(-1)).mean()

        reason = self.assert_refused(f, rand_hidden(B, T, D), torch.randint(0, V, (B, T)), reason="token log-probs")
        self.assertIn("are also used by", reason)

    def test_entropy_and_a_top_k_of_the_logits(self):
        weight = rand_weight(V, D)

        def f(hidden):
            logits = F.linear(hidden, weight)
            entropy = torch.logsumexp(logits, -1) - (logits.softmax(-1) * logits).sum(-1)
            return entropy.mean() + logits.topk(2, dim=-1).values.mean()

        reason = self.assert_refused(f, rand_hidden(B, T, D), reason="entropy: ")
        self.assertIn("topk", reason)


# ----------------------------------------------------------------------------------------------------------------
# Near misses of the entropy and token log-probs spellings: close in shape, different in value; never rewritten
# ----------------------------------------------------------------------------------------------------------------


def _lp(logits_row, ids_row):
    return F.log_softmax(logits_row, dim=-1).gather(-1, ids_row.unsqueeze(-1)).squeeze(-1)


def _entropy_terms(logits):
    return -(torch.exp(F.log_softmax(logits, -1)) * F.log_softmax(logits, -1)).sum(-1)


_NEAR_MISSES = {
    # p and log p of different logits
    "entropy_of_two_logits": lambda logits, ids: -(logits.softmax(-1) * (2 * logits).log_softmax(-1)).sum(-1),
    # the softmax over the rows, not the vocabulary
    "softmax_over_rows": lambda logits, ids: -(logits.softmax(0) * logits.log_softmax(0)).sum(-1),
    # summed over the rows
    "summed_over_rows": lambda logits, ids: -(logits.softmax(-1) * logits.log_softmax(-1)).sum(0),
    # sum(p log p) without the minus is -H: must not become H
    "no_negation": lambda logits, ids: (logits.softmax(-1) * logits.log_softmax(-1)).sum(-1),
    # sum(p z) - logsumexp(z) is -H
    "reversed_difference": lambda logits, ids: (logits.softmax(-1) * logits).sum(-1) - torch.logsumexp(logits, -1),
    # logsumexp + sum(p z) is no entropy
    "sum_instead_of_difference": lambda logits, ids: (
        torch.logsumexp(logits, -1) + (logits.softmax(-1) * logits).sum(-1)
    ),
    # the softmax-weighted logits of other logits
    "weighted_other_logits": lambda logits, ids: (
        torch.logsumexp(logits, -1) - (logits.softmax(-1) * logits.exp()).sum(-1)
    ),
    # a gather minus the logsumexp of other logits
    "gather_minus_other_lse": lambda logits, ids: (
        torch.gather(logits, -1, ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits * 2, -1)
    ),
    # a row loop that stacks the rows out of order
    "rows_out_of_order": lambda logits, ids: torch.stack([_lp(logits[1], ids[1]), _lp(logits[0], ids[0])]),
    # a row loop that pairs each row with another row's ids
    "rows_with_other_ids": lambda logits, ids: torch.stack([_lp(logits[0], ids[1]), _lp(logits[1], ids[0])]),
    # TRL's chunked entropy, its chunks concatenated out of order
    "entropy_chunks_out_of_order": lambda logits, ids: torch.cat(
        [_entropy_terms(c) for c in logits.reshape(-1, logits.shape[-1]).split(3, dim=0)][::-1]
    ),
}


class TestNearMissesOfTheRLForms(PatternTestCase):
    """Each of these reads like an entropy or a token log-prob but computes something else: the graph stays as it is
    and the result is eager's."""

    def test_near_misses_are_left_alone(self):
        weight = rand_weight(V, D)
        for name, form in _NEAR_MISSES.items():
            with self.subTest(name):
                torch._dynamo.reset()
                cce_inductor.reset_stats()

                def f(hidden, ids, form=form):
                    return form(F.linear(hidden, weight), ids).sum()

                cap = self.run_pass(f, rand_hidden(2, 5, D), torch.randint(0, V, (2, 5)), params=[weight], rewrites=0)
                self.assertEqual(cap.before, cap.after)
                self.assertEqual(cce_inductor.stats()["rewritten"], 0)
