"""Tests of ``nll_loss(log_softmax(logits))`` normalised into ``cross_entropy(logits)`` (``cce_inductor/fx_passes/
nll_loss.py``): Dynamo's graph before and after the pass, parity of the loss and every gradient with eager
PyTorch (``tests/support/patterns.py``) on the lean path and the balanced one, and the refusals with the reason
``stats()`` gives, naming what the pass saw. Regenerate the expected graphs with ``EXPECTTEST_ACCEPT=1``."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import cce_inductor
from tests.support.inputs import BALANCED
from tests.support.patterns import B, D, PatternTestCase, T, V, rand_hidden, rand_labels, rand_weight


class TestNllLossOfLogSoftmax(PatternTestCase):
    def setUp(self):
        super().setUp()
        torch.manual_seed(0)

    def test_nll_loss_of_log_softmax_is_the_fused_op(self):
        weight = rand_weight(V, D)

        def f(hidden, labels):
            return F.nll_loss(F.log_softmax(F.linear(hidden, weight).float(), dim=-1), labels, reduction="sum")

        cap = self.run_pass(f, rand_hidden(B * T, D), rand_labels(B * T), params=[weight])
        self.assertExpectedInline(
            cap.before[0],
            """\
def forward(self, L_hidden_ : torch.Tensor, L_labels_ : torch.Tensor, L_weight_ : torch.Tensor):
    l_hidden_ = L_hidden_
    l_labels_ = L_labels_
    l_weight_ = L_weight_
    linear = torch._C._nn.linear(l_hidden_, l_weight_)
    float_1 = linear.float()
    log_softmax = torch.nn.functional.log_softmax(float_1, dim = -1)
    nll_loss = torch.nn.functional.nll_loss(log_softmax, l_labels_, reduction = 'sum')
    return (nll_loss,)""",
        )
        self.assertExpectedInline(
            cap.after[0],
            """\
def forward(self, L_hidden_ : torch.Tensor, L_labels_ : torch.Tensor, L_weight_ : torch.Tensor):
    l_hidden_ = L_hidden_
    l_labels_ = L_labels_
    l_weight_ = L_weight_
    linear_cross_entropy_default = torch.ops.cce_inductor.linear_cross_entropy.default(l_hidden_, l_weight_, l_labels_, None, None, -100, 'sum', 0.0, 'exact=False;products=auto;backward_row_chunk=8192;path=auto;scratch_mb=0', False, False)
    getitem = linear_cross_entropy_default[0]
    return (getitem,)""",
        )

    def test_log_softmax_module_nll_loss_module_weights_sum_and_dtype_argument(self):
        """``nn.LogSoftmax`` + ``nn.NLLLoss`` with class weights and a sum; the method spelling with a dtype (its
        upcast); both on the balanced path too."""
        head = nn.Linear(D, V, bias=False)
        log_softmax = nn.LogSoftmax(dim=1)
        criterion = nn.NLLLoss(weight=torch.rand(V) + 0.5, reduction="sum")

        def modules(hidden, labels):
            return criterion(log_softmax(head(hidden)), labels)

        def method(hidden, labels):
            return F.nll_loss(head(hidden).log_softmax(-1, dtype=torch.float32), labels, reduction="sum")

        for options in (None, BALANCED):
            self.run_pass(modules, rand_hidden(B * T, D), rand_labels(B * T), params=[head.weight], options=options)
            self.run_pass(method, rand_hidden(B * T, D), rand_labels(B * T), params=[head.weight], options=options)

    def test_refusals_name_what_the_pass_saw(self):
        """Left alone, with the reason in ``stats()``: log-probabilities read by something else too, log-probs over
        another dimension, an nll_loss of something that is not a log_softmax."""
        weight = rand_weight(V, D)

        def also_read(hidden, labels):
            log_probs = F.log_softmax(F.linear(hidden, weight), -1)
            return F.nll_loss(log_probs, labels) + log_probs.mean()

        def other_dim(hidden, labels):
            return F.nll_loss(F.log_softmax(F.linear(hidden, weight), 0), labels)

        def not_log_softmax(hidden, labels):
            return F.nll_loss(torch.log(torch.softmax(F.linear(hidden, weight), -1)), labels)

        for fn, reason in (
            (also_read, "the log-probabilities log_probs of nll_loss (nll_loss) are also read by mean"),
            (other_dim, "log_softmax normalises over dimension 0, not the vocabulary"),
            (not_log_softmax, "nll_loss (nll_loss) does not read a log_softmax"),
        ):
            cce_inductor.reset_stats()
            torch._dynamo.reset()
            self.run_pass(fn, rand_hidden(B * T, D), rand_labels(B * T), params=[weight], rewrites=0)
            (site,) = cce_inductor.stats()["sites"]
            self.assertFalse(site["rewritten"])
            self.assertIn(reason, site["reason"])
