"""Tests of the cross-entropy pass (``cce_inductor/fx_passes/linear_cross_entropy.py``) by graph matching: for every
form of ``linear -> [softcap] -> cross_entropy`` the pass claims (head spellings, row views, upcasts, constant
scales, softcaps, label shifts, label smoothing, a z-loss, chunked heads, several sites, returned logits dropped) and
every refusal (each with the reason it reports), Dynamo's graph before and after the pass, plus parity of the loss and
of every gradient against eager PyTorch (``tests/support/patterns.py``); and the same rewrite through the real
backend with dynamic shapes.

The RL forms: ``test_token_log_probs.py`` and ``test_entropy.py``. Regenerate the expected graphs after an intended
change with ``EXPECTTEST_ACCEPT=1 python -m pytest tests/fx_passes`` and review the diff.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import cce_inductor
from cce_inductor.options import CCEOptions
from tests.support.compare import inductor_caches_off
from tests.support.graphs import PassCapture
from tests.support.inputs import BALANCED
from tests.support.patterns import B, D, PatternTestCase, T, V, rand_hidden, rand_labels, rand_weight


class TestMatchedPatterns(PatternTestCase):
    def setUp(self):
        super().setUp()
        torch.manual_seed(0)

    def test_functional_linear_no_bias(self):
        weight = rand_weight(V, D)

        def f(hidden, labels):
            return F.cross_entropy(F.linear(hidden, weight), labels)

        cap = self.run_pass(f, rand_hidden(B * T, D), rand_labels(B * T), params=[weight])
        self.assertExpectedInline(
            cap.before[0],
            """\
def forward(self, L_hidden_ : torch.Tensor, L_labels_ : torch.Tensor, L_weight_ : torch.Tensor):
    l_hidden_ = L_hidden_
    l_labels_ = L_labels_
    l_weight_ = L_weight_
    linear = torch._C._nn.linear(l_hidden_, l_weight_)
    cross_entropy = torch.nn.functional.cross_entropy(linear, l_labels_)
    return (cross_entropy,)""",
        )
        self.assertExpectedInline(
            cap.after[0],
            """\
def forward(self, L_hidden_ : torch.Tensor, L_labels_ : torch.Tensor, L_weight_ : torch.Tensor):
    l_hidden_ = L_hidden_
    l_labels_ = L_labels_
    l_weight_ = L_weight_
    linear_cross_entropy_default = torch.ops.cce_inductor.linear_cross_entropy.default(l_hidden_, l_weight_, l_labels_, None, None, -100, 'mean', 0.0, 'exact=False;products=auto;backward_row_chunk=8192;path=auto;scratch_mb=0', False, False)
    getitem = linear_cross_entropy_default[0]
    return (getitem,)""",
        )

    def test_nn_linear_with_bias_and_cross_entropy_module(self):
        head = nn.Linear(D, V)
        criterion = nn.CrossEntropyLoss()

        def f(hidden, labels):
            return criterion(head(hidden), labels)

        cap = self.run_pass(f, rand_hidden(B * T, D), rand_labels(B * T), params=list(head.parameters()))
        self.assertExpectedInline(
            cap.after[0],
            """\
def forward(self, L_head_parameters_bias_ : torch.nn.parameter.Parameter, L_head_parameters_weight_ : torch.nn.parameter.Parameter, L_hidden_ : torch.Tensor, L_labels_ : torch.Tensor):
    l_head_parameters_bias_ = L_head_parameters_bias_
    l_head_parameters_weight_ = L_head_parameters_weight_
    l_hidden_ = L_hidden_
    l_labels_ = L_labels_
    linear_cross_entropy_default = torch.ops.cce_inductor.linear_cross_entropy.default(l_hidden_, l_head_parameters_weight_, l_labels_, l_head_parameters_bias_, None, -100, 'mean', 0.0, 'exact=False;products=auto;backward_row_chunk=8192;path=auto;scratch_mb=0', False, False)
    getitem = linear_cross_entropy_default[0]
    return (getitem,)""",
        )

    def test_matmul_with_transposed_weight(self):
        weight = rand_weight(V, D)

        def f(hidden, labels):
            logits = hidden @ weight.T
            return F.cross_entropy(logits.view(-1, V), labels.view(-1))

        cap = self.run_pass(f, rand_hidden(B, T, D), rand_labels(B, T), params=[weight])
        self.assertExpectedInline(
            cap.before[0],
            """\
def forward(self, L_hidden_ : torch.Tensor, L_labels_ : torch.Tensor, L_weight_ : torch.Tensor):
    l_hidden_ = L_hidden_
    l_labels_ = L_labels_
    l_weight_ = L_weight_
    numpy_t = torch.ops.aten.numpy_T(l_weight_)
    logits = l_hidden_ @ numpy_t
    view = logits.view(-1, 37)
    view_1 = l_labels_.view(-1)
    cross_entropy = torch.nn.functional.cross_entropy(view, view_1)
    return (cross_entropy,)""",
        )
        self.assertExpectedInline(
            cap.after[0],
            """\
def forward(self, L_hidden_ : torch.Tensor, L_labels_ : torch.Tensor, L_weight_ : torch.Tensor):
    l_hidden_ = L_hidden_
    l_labels_ = L_labels_
    l_weight_ = L_weight_
    view_1 = l_labels_.view(-1)
    reshape = l_hidden_.reshape(-1, 16)
    linear_cross_entropy_default = torch.ops.cce_inductor.linear_cross_entropy.default(reshape, l_weight_, view_1, None, None, -100, 'mean', 0.0, 'exact=False;products=auto;backward_row_chunk=8192;path=auto;scratch_mb=0', False, False)
    getitem = linear_cross_entropy_default[0]
    return (getitem,)""",
        )

    def test_torch_matmul_with_t_and_weight_stored_transposed(self):
        weight = rand_weight(V, D)
        weight_t = rand_weight(D, V)  # a head stored as (D, V): the op gets weight_t.t()

        def f(hidden, labels):
            first = F.cross_entropy(torch.matmul(hidden, weight.t()), labels)
            second = F.cross_entropy(torch.matmul(hidden, weight_t), labels, reduction="sum")
            return first + second

        cap = self.run_pass(f, rand_hidden(B * T, D), rand_labels(B * T), rewrites=2, params=[weight, weight_t])
        self.assertExpectedInline(
            cap.after[0],
            """\
def forward(self, L_hidden_ : torch.Tensor, L_labels_ : torch.Tensor, L_weight_ : torch.Tensor, L_weight_t_ : torch.Tensor):
    l_hidden_ = L_hidden_
    l_labels_ = L_labels_
    l_weight_ = L_weight_
    l_weight_t_ = L_weight_t_
    linear_cross_entropy_default = torch.ops.cce_inductor.linear_cross_entropy.default(l_hidden_, l_weight_, l_labels_, None, None, -100, 'mean', 0.0, 'exact=False;products=auto;backward_row_chunk=8192;path=auto;scratch_mb=0', False, False)
    getitem = linear_cross_entropy_default[0]
    t_1 = l_weight_t_.t()
    linear_cross_entropy_default_1 = torch.ops.cce_inductor.linear_cross_entropy.default(l_hidden_, t_1, l_labels_, None, None, -100, 'sum', 0.0, 'exact=False;products=auto;backward_row_chunk=8192;path=auto;scratch_mb=0', False, False)
    getitem_1 = linear_cross_entropy_default_1[0]
    add = getitem + getitem_1
    return (add,)""",
        )

    def test_views_contiguous_flatten_and_upcast(self):
        weight = rand_weight(V, D)

        def f(hidden, labels):
            logits = F.linear(hidden, weight.to(torch.bfloat16).float())  # not a param: still a (V, D) tensor
            return F.cross_entropy(logits.contiguous().flatten(0, 1).to(torch.float32), labels.flatten())

        cap = self.run_pass(f, rand_hidden(B, T, D), rand_labels(B, T), params=[weight])
        self.assertExpectedInline(
            cap.after[0],
            """\
def forward(self, L_hidden_ : torch.Tensor, L_labels_ : torch.Tensor, L_weight_ : torch.Tensor):
    l_hidden_ = L_hidden_
    l_labels_ = L_labels_
    l_weight_ = L_weight_
    to = l_weight_.to(torch.bfloat16)
    float_1 = to.float()
    flatten_1 = l_labels_.flatten()
    flatten_2 = l_hidden_.flatten(0, 1)
    linear_cross_entropy_default = torch.ops.cce_inductor.linear_cross_entropy.default(flatten_2, float_1, flatten_1, None, None, -100, 'mean', 0.0, 'exact=False;products=auto;backward_row_chunk=8192;path=auto;scratch_mb=0', False, False)
    getitem = linear_cross_entropy_default[0]
    return (getitem,)""",
        )

    def test_bf16_logits_upcast_with_float(self):
        weight = torch.randn(V, D, dtype=torch.bfloat16, requires_grad=True)

        def f(hidden, labels):
            logits = F.linear(hidden, weight)
            return F.cross_entropy(logits.float().view(-1, V), labels.view(-1))

        hidden = torch.randn(B, T, D, dtype=torch.bfloat16, requires_grad=True)
        # eager rounds the logits to bf16 before the loss; the op keeps them in fp32: bf16 tolerance
        cap = self.run_pass(f, hidden, rand_labels(B, T), params=[weight], atol=2e-2, rtol=2e-2)
        self.assertExpectedInline(
            cap.after[0],
            """\
def forward(self, L_hidden_ : torch.Tensor, L_labels_ : torch.Tensor, L_weight_ : torch.Tensor):
    l_hidden_ = L_hidden_
    l_labels_ = L_labels_
    l_weight_ = L_weight_
    view_1 = l_labels_.view(-1)
    reshape = l_hidden_.reshape(-1, 16)
    linear_cross_entropy_default = torch.ops.cce_inductor.linear_cross_entropy.default(reshape, l_weight_, view_1, None, None, -100, 'mean', 0.0, 'exact=False;products=auto;backward_row_chunk=8192;path=auto;scratch_mb=0', False, False)
    getitem = linear_cross_entropy_default[0]
    return (getitem,)""",
        )

    def test_bf16_loss_dtype_is_kept(self):
        weight = torch.randn(V, D, dtype=torch.bfloat16, requires_grad=True)

        def f(hidden, labels):
            return F.cross_entropy(F.linear(hidden, weight), labels)  # bf16 logits -> bf16 loss in eager

        hidden = torch.randn(B * T, D, dtype=torch.bfloat16, requires_grad=True)
        cap = self.run_pass(f, hidden, rand_labels(B * T), params=[weight], atol=2e-2, rtol=2e-2)
        self.assertExpectedInline(
            cap.after[0],
            """\
def forward(self, L_hidden_ : torch.Tensor, L_labels_ : torch.Tensor, L_weight_ : torch.Tensor):
    l_hidden_ = L_hidden_
    l_labels_ = L_labels_
    l_weight_ = L_weight_
    linear_cross_entropy_default = torch.ops.cce_inductor.linear_cross_entropy.default(l_hidden_, l_weight_, l_labels_, None, None, -100, 'mean', 0.0, 'exact=False;products=auto;backward_row_chunk=8192;path=auto;scratch_mb=0', False, False)
    getitem = linear_cross_entropy_default[0]
    to = getitem.to(torch.bfloat16)
    return (to,)""",
        )

    def test_softcap_divide_form(self):
        weight = rand_weight(V, D)

        def f(hidden, labels):
            logits = F.linear(hidden, weight).float()
            logits = torch.tanh(logits / 3.0) * 3.0
            return F.cross_entropy(logits.view(-1, V), labels.view(-1))

        cap = self.run_pass(f, rand_hidden(B, T, D), rand_labels(B, T), params=[weight])
        self.assertExpectedInline(
            cap.before[0],
            """\
def forward(self, L_hidden_ : torch.Tensor, L_labels_ : torch.Tensor, L_weight_ : torch.Tensor):
    l_hidden_ = L_hidden_
    l_labels_ = L_labels_
    l_weight_ = L_weight_
    linear = torch._C._nn.linear(l_hidden_, l_weight_)
    logits = linear.float()
    truediv = logits / 3.0
    tanh = torch.tanh(truediv)
    logits_1 = tanh * 3.0
    view = logits_1.view(-1, 37)
    view_1 = l_labels_.view(-1)
    cross_entropy = torch.nn.functional.cross_entropy(view, view_1)
    return (cross_entropy,)""",
        )
        self.assertExpectedInline(
            cap.after[0],
            """\
def forward(self, L_hidden_ : torch.Tensor, L_labels_ : torch.Tensor, L_weight_ : torch.Tensor):
    l_hidden_ = L_hidden_
    l_labels_ = L_labels_
    l_weight_ = L_weight_
    view_1 = l_labels_.view(-1)
    reshape = l_hidden_.reshape(-1, 16)
    linear_cross_entropy_default = torch.ops.cce_inductor.linear_cross_entropy.default(reshape, l_weight_, view_1, None, 3.0, -100, 'mean', 0.0, 'exact=False;products=auto;backward_row_chunk=8192;path=auto;scratch_mb=0', False, False)
    getitem = linear_cross_entropy_default[0]
    return (getitem,)""",
        )

    def test_softcap_multiply_by_reciprocal_after_views(self):
        weight = rand_weight(V, D)
        cap_value = 2.5

        def f(hidden, labels):
            logits = F.linear(hidden, weight).view(-1, V)
            logits = cap_value * (logits * (1.0 / cap_value)).tanh()
            return F.cross_entropy(logits, labels.view(-1))

        cap = self.run_pass(f, rand_hidden(B, T, D), rand_labels(B, T), params=[weight])
        self.assertExpectedInline(
            cap.after[0],
            """\
def forward(self, L_hidden_ : torch.Tensor, L_labels_ : torch.Tensor, L_weight_ : torch.Tensor):
    l_hidden_ = L_hidden_
    l_labels_ = L_labels_
    l_weight_ = L_weight_
    view_1 = l_labels_.view(-1)
    reshape = l_hidden_.reshape(-1, 16)
    linear_cross_entropy_default = torch.ops.cce_inductor.linear_cross_entropy.default(reshape, l_weight_, view_1, None, 2.5, -100, 'mean', 0.0, 'exact=False;products=auto;backward_row_chunk=8192;path=auto;scratch_mb=0', False, False)
    getitem = linear_cross_entropy_default[0]
    return (getitem,)""",
        )

    def test_constant_logit_scale_then_softcap(self):
        head = nn.Linear(D, V)

        def f(hidden, labels):
            logits = head(hidden) * 0.25  # Cohere's logit_scale; Granite divides by logits_scaling
            logits = logits / 2.0
            logits = torch.tanh(logits / 3.0) * 3.0
            return F.cross_entropy(logits.view(-1, V), labels.view(-1))

        cap = self.run_pass(f, rand_hidden(B, T, D), rand_labels(B, T), params=list(head.parameters()))
        self.assertExpectedInline(
            cap.after[0],
            """\
def forward(self, L_head_parameters_bias_ : torch.nn.parameter.Parameter, L_head_parameters_weight_ : torch.nn.parameter.Parameter, L_hidden_ : torch.Tensor, L_labels_ : torch.Tensor):
    l_head_parameters_bias_ = L_head_parameters_bias_
    l_head_parameters_weight_ = L_head_parameters_weight_
    l_hidden_ = L_hidden_
    l_labels_ = L_labels_
    view_1 = l_labels_.view(-1)
    mul_2 = l_hidden_ * 0.125
    reshape = mul_2.reshape(-1, 16)
    mul_3 = l_head_parameters_bias_ * 0.125
    linear_cross_entropy_default = torch.ops.cce_inductor.linear_cross_entropy.default(reshape, l_head_parameters_weight_, view_1, mul_3, 3.0, -100, 'mean', 0.0, 'exact=False;products=auto;backward_row_chunk=8192;path=auto;scratch_mb=0', False, False)
    getitem = linear_cross_entropy_default[0]
    return (getitem,)""",
        )

    def test_hf_shift_by_slicing_logits_and_labels(self):
        weight = rand_weight(V, D)

        def f(hidden, labels):
            logits = F.linear(hidden, weight)
            shift_logits = logits[..., :-1, :].contiguous()
            shift_labels = labels[..., 1:].contiguous()
            return F.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))

        cap = self.run_pass(f, rand_hidden(B, T, D), rand_labels(B, T), params=[weight])
        self.assertExpectedInline(
            cap.before[0],
            """\
def forward(self, L_hidden_ : torch.Tensor, L_labels_ : torch.Tensor, L_weight_ : torch.Tensor):
    l_hidden_ = L_hidden_
    l_labels_ = L_labels_
    l_weight_ = L_weight_
    logits = torch._C._nn.linear(l_hidden_, l_weight_)
    getitem = logits[(Ellipsis, slice(None, -1, None), slice(None, None, None))]
    shift_logits = getitem.contiguous()
    getitem_1 = l_labels_[(Ellipsis, slice(1, None, None))]
    shift_labels = getitem_1.contiguous()
    view = shift_logits.view(-1, 37)
    view_1 = shift_labels.view(-1)
    cross_entropy = torch.nn.functional.cross_entropy(view, view_1)
    return (cross_entropy,)""",
        )
        self.assertExpectedInline(
            cap.after[0],
            """\
def forward(self, L_hidden_ : torch.Tensor, L_labels_ : torch.Tensor, L_weight_ : torch.Tensor):
    l_hidden_ = L_hidden_
    l_labels_ = L_labels_
    l_weight_ = L_weight_
    getitem_1 = l_labels_[(Ellipsis, slice(1, None, None))]
    shift_labels = getitem_1.contiguous()
    view_1 = shift_labels.view(-1)
    getitem_2 = l_hidden_[(Ellipsis, slice(None, -1, None), slice(None, None, None))]
    reshape = getitem_2.reshape(-1, 16)
    linear_cross_entropy_default = torch.ops.cce_inductor.linear_cross_entropy.default(reshape, l_weight_, view_1, None, None, -100, 'mean', 0.0, 'exact=False;products=auto;backward_row_chunk=8192;path=auto;scratch_mb=0', False, False)
    getitem_3 = linear_cross_entropy_default[0]
    return (getitem_3,)""",
        )

    def test_hf_shift_by_padding_labels_and_num_items_in_batch(self):
        weight = rand_weight(V, D)

        def f(hidden, labels, num_items_in_batch):
            logits = F.linear(hidden, weight).float()
            labels = F.pad(labels, (0, 1), value=-100)
            shift_labels = labels[..., 1:].contiguous()
            loss = F.cross_entropy(logits.view(-1, V), shift_labels.view(-1), ignore_index=-100, reduction="sum")
            return loss / num_items_in_batch

        cap = self.run_pass(f, rand_hidden(B, T, D), rand_labels(B, T), torch.tensor(7), params=[weight])
        self.assertExpectedInline(
            cap.before[0],
            """\
def forward(self, L_hidden_ : torch.Tensor, L_labels_ : torch.Tensor, L_num_items_in_batch_ : torch.Tensor, L_weight_ : torch.Tensor):
    l_hidden_ = L_hidden_
    l_labels_ = L_labels_
    l_num_items_in_batch_ = L_num_items_in_batch_
    l_weight_ = L_weight_
    linear = torch._C._nn.linear(l_hidden_, l_weight_)
    logits = linear.float()
    labels = torch._C._nn.pad(l_labels_, (0, 1), 'constant', -100)
    getitem = labels[(Ellipsis, slice(1, None, None))]
    shift_labels = getitem.contiguous()
    view = logits.view(-1, 37)
    view_1 = shift_labels.view(-1)
    loss = torch.nn.functional.cross_entropy(view, view_1, ignore_index = -100, reduction = 'sum')
    truediv = loss / l_num_items_in_batch_
    return (truediv,)""",
        )
        self.assertExpectedInline(
            cap.after[0],
            """\
def forward(self, L_hidden_ : torch.Tensor, L_labels_ : torch.Tensor, L_num_items_in_batch_ : torch.Tensor, L_weight_ : torch.Tensor):
    l_hidden_ = L_hidden_
    l_labels_ = L_labels_
    l_num_items_in_batch_ = L_num_items_in_batch_
    l_weight_ = L_weight_
    labels = torch._C._nn.pad(l_labels_, (0, 1), 'constant', -100)
    getitem = labels[(Ellipsis, slice(1, None, None))]
    shift_labels = getitem.contiguous()
    view_1 = shift_labels.view(-1)
    reshape = l_hidden_.reshape(-1, 16)
    linear_cross_entropy_default = torch.ops.cce_inductor.linear_cross_entropy.default(reshape, l_weight_, view_1, None, None, -100, 'sum', 0.0, 'exact=False;products=auto;backward_row_chunk=8192;path=auto;scratch_mb=0', False, False)
    getitem_1 = linear_cross_entropy_default[0]
    truediv = getitem_1 / l_num_items_in_batch_
    return (truediv,)""",
        )

    def test_label_smoothing(self):
        """SFT recipes' label smoothing (any epsilon, reduction and ignore_index): the smoothing term needs only
        each row's sum of logits, which the fused forward computes beside the log-sum-exp."""
        weight = rand_weight(V, D)

        def f(hidden, labels):
            logits = torch.tanh(F.linear(hidden, weight) / 4.0) * 4.0
            return F.cross_entropy(
                logits.view(-1, V), labels.view(-1), label_smoothing=0.1, ignore_index=3, reduction="sum"
            )

        cap = self.run_pass(f, rand_hidden(B, T, D), rand_labels(B, T, ignore_index=3), params=[weight])
        self.assertExpectedInline(
            cap.after[0],
            """\
def forward(self, L_hidden_ : torch.Tensor, L_labels_ : torch.Tensor, L_weight_ : torch.Tensor):
    l_hidden_ = L_hidden_
    l_labels_ = L_labels_
    l_weight_ = L_weight_
    view_1 = l_labels_.view(-1)
    reshape = l_hidden_.reshape(-1, 16)
    linear_cross_entropy_default = torch.ops.cce_inductor.linear_cross_entropy.default(reshape, l_weight_, view_1, None, 4.0, 3, 'sum', 0.1, 'exact=False;products=auto;backward_row_chunk=8192;path=auto;scratch_mb=0', False, False)
    getitem = linear_cross_entropy_default[0]
    return (getitem,)""",
        )
        for reduction, eps in (("mean", 0.25), ("none", 1.0)):
            g = lambda h, y: F.cross_entropy(F.linear(h, weight), y, label_smoothing=eps, reduction=reduction)  # noqa: E731, B023 - called in this iteration
            self.run_pass(g, rand_hidden(B * T, D), rand_labels(B * T), params=[weight])

    def test_z_loss_reuses_the_log_sum_exp(self):
        """OLMo / PaLM's z-loss next to the cross-entropy: ``logsumexp(logits)`` is fed by the op's per-row lse
        (every row's, ignored ones too), with its gradient; the logits are never formed."""
        weight = rand_weight(V, D)

        def f(hidden, labels):
            logits = F.linear(hidden, weight).float().view(-1, V)
            ce = F.cross_entropy(logits, labels.view(-1), ignore_index=-100)
            z_squared = logits.logsumexp(-1).pow(2)
            return ce + 1e-2 * (z_squared * (labels.view(-1) != -100)).mean() + 1e-3 * z_squared.mean()

        cap = self.run_pass(f, rand_hidden(B, T, D), rand_labels(B, T), params=[weight])
        self.assertExpectedInline(
            cap.after[0],
            """\
def forward(self, L_hidden_ : torch.Tensor, L_labels_ : torch.Tensor, L_weight_ : torch.Tensor):
    l_hidden_ = L_hidden_
    l_labels_ = L_labels_
    l_weight_ = L_weight_
    view_1 = l_labels_.view(-1)
    reshape = l_hidden_.reshape(-1, 16)
    linear_cross_entropy_default = torch.ops.cce_inductor.linear_cross_entropy.default(reshape, l_weight_, view_1, None, None, -100, 'mean', 0.0, 'exact=False;products=auto;backward_row_chunk=8192;path=auto;scratch_mb=0', True, False)
    getitem = linear_cross_entropy_default[1]
    getitem_1 = linear_cross_entropy_default[0]
    z_squared = getitem.pow(2)
    view_2 = l_labels_.view(-1)
    ne = view_2 != -100
    mul = z_squared * ne
    mean = mul.mean()
    mul_1 = 0.01 * mean
    add = getitem_1 + mul_1
    mean_1 = z_squared.mean()
    mul_2 = 0.001 * mean_1
    add_1 = add + mul_2
    return (add_1,)""",
        )
        self.assertIn("log-sum-exp reused", cce_inductor.stats()["sites"][0]["reason"])

    def test_torchtune_chunked_head_is_one_call(self):
        """torchtune's chunked output: the head on 4 chunks of the sequence, a summed cross-entropy per chunk; one
        fused call over the concatenated rows, each chunk's loss a slice of its per-row losses."""
        weight = rand_weight(V, D)

        def f(hidden, labels):
            logits = [F.linear(chunk, weight) for chunk in hidden.chunk(4, dim=1)]
            logits = [chunk.reshape(-1, chunk.size(-1)) for chunk in logits]
            label_chunks = [chunk.reshape(-1) for chunk in labels.chunk(4, dim=1)]
            total = 0.0
            for logits_chunk, labels_chunk in zip(logits, label_chunks):
                total += F.cross_entropy(logits_chunk.float(), labels_chunk, ignore_index=-100, reduction="sum")
            return total / (labels != -100).sum()

        cap = self.run_pass(f, rand_hidden(B, 8, D), rand_labels(B, 8), params=[weight], rewrites=4)
        self.assertEqual(cap.after[0].count("linear_cross_entropy.default("), 1)
        self.assertExpectedInline(
            cap.after[0],
            """\
def forward(self, L_hidden_ : torch.Tensor, L_labels_ : torch.Tensor, L_weight_ : torch.Tensor):
    l_hidden_ = L_hidden_
    l_labels_ = L_labels_
    l_weight_ = L_weight_
    chunk = l_hidden_.chunk(4, dim = 1)
    chunk_1 = chunk[0]
    chunk_2 = chunk[1]
    chunk_3 = chunk[2]
    chunk_4 = chunk[3]
    chunk_9 = l_labels_.chunk(4, dim = 1)
    chunk_10 = chunk_9[0]
    chunk_11 = chunk_9[1]
    chunk_12 = chunk_9[2]
    chunk_13 = chunk_9[3]
    labels_chunk = chunk_10.reshape(-1)
    labels_chunk_1 = chunk_11.reshape(-1)
    labels_chunk_2 = chunk_12.reshape(-1)
    labels_chunk_3 = chunk_13.reshape(-1)
    reshape_8 = chunk_1.reshape(-1, 16)
    reshape_9 = chunk_2.reshape(-1, 16)
    reshape_10 = chunk_3.reshape(-1, 16)
    reshape_11 = chunk_4.reshape(-1, 16)
    cat = torch.cat([reshape_8, reshape_9, reshape_10, reshape_11], 0)
    cat_1 = torch.cat([labels_chunk, labels_chunk_1, labels_chunk_2, labels_chunk_3], 0)
    linear_cross_entropy_default = torch.ops.cce_inductor.linear_cross_entropy.default(cat, l_weight_, cat_1, None, None, -100, 'none', 0.0, 'exact=False;products=auto;backward_row_chunk=8192;path=auto;scratch_mb=0', False, False)
    getitem_8 = linear_cross_entropy_default[0]
    split = torch.functional.split(getitem_8, [4, 4, 4, 4])
    getitem_9 = split[0]
    sum_2 = getitem_9.sum()
    getitem_10 = split[1]
    sum_3 = getitem_10.sum()
    getitem_11 = split[2]
    sum_4 = getitem_11.sum()
    getitem_12 = split[3]
    sum_5 = getitem_12.sum()
    total = 0.0 + sum_2
    total += sum_3;  total_1 = total
    total_1 += sum_4;  total_2 = total_1
    total_2 += sum_5;  total_3 = total_2
    ne = l_labels_ != -100
    sum_1 = ne.sum()
    truediv = total_3 / sum_1
    return (truediv,)""",
        )
        self.assertIn("one call with 3 other chunk(s)", cce_inductor.stats()["sites"][0]["reason"])

    def test_chunks_with_mean_reductions(self):
        weight = rand_weight(V, D)

        def f(hidden, labels):
            losses = [F.cross_entropy(F.linear(h, weight), y) for h, y in zip(hidden.split(3), labels.split(3))]
            return torch.stack(losses) * torch.arange(1.0, 1.0 + len(losses))

        labels = rand_labels(7)
        labels[3:6] = -100  # a chunk with every target ignored: its mean is NaN, as in eager
        self.run_pass(f, rand_hidden(7, D), labels, params=[weight], rewrites=3)

    def test_ignore_index_inside_vocabulary(self):
        weight = rand_weight(V, D)

        def f(hidden, labels):
            return F.cross_entropy(F.linear(hidden, weight), labels, ignore_index=0)

        labels = rand_labels(B * T, ignore_index=0, fraction_ignored=0.5)
        cap = self.run_pass(f, rand_hidden(B * T, D), labels, params=[weight])
        self.assertIn(", 0, 'mean', ", cap.after[0])  # ignore_index=0, reduction=mean in the op call
        self.assertExpectedInline(
            cap.after[0],
            """\
def forward(self, L_hidden_ : torch.Tensor, L_labels_ : torch.Tensor, L_weight_ : torch.Tensor):
    l_hidden_ = L_hidden_
    l_labels_ = L_labels_
    l_weight_ = L_weight_
    linear_cross_entropy_default = torch.ops.cce_inductor.linear_cross_entropy.default(l_hidden_, l_weight_, l_labels_, None, None, 0, 'mean', 0.0, 'exact=False;products=auto;backward_row_chunk=8192;path=auto;scratch_mb=0', False, False)
    getitem = linear_cross_entropy_default[0]
    return (getitem,)""",
        )

    def test_reduction_none_then_mask_and_mean(self):
        head = nn.Linear(D, V, bias=True)

        def f(hidden, labels):
            per_token = F.cross_entropy(head(hidden).view(-1, V), labels.view(-1), reduction="none")
            return per_token.view(B, T).sum(dim=1).mean()

        cap = self.run_pass(f, rand_hidden(B, T, D), rand_labels(B, T), params=list(head.parameters()))
        self.assertExpectedInline(
            cap.after[0],
            """\
def forward(self, L_head_parameters_bias_ : torch.nn.parameter.Parameter, L_head_parameters_weight_ : torch.nn.parameter.Parameter, L_hidden_ : torch.Tensor, L_labels_ : torch.Tensor):
    l_head_parameters_bias_ = L_head_parameters_bias_
    l_head_parameters_weight_ = L_head_parameters_weight_
    l_hidden_ = L_hidden_
    l_labels_ = L_labels_
    view_1 = l_labels_.view(-1)
    reshape = l_hidden_.reshape(-1, 16)
    linear_cross_entropy_default = torch.ops.cce_inductor.linear_cross_entropy.default(reshape, l_head_parameters_weight_, view_1, l_head_parameters_bias_, None, -100, 'none', 0.0, 'exact=False;products=auto;backward_row_chunk=8192;path=auto;scratch_mb=0', False, False)
    getitem = linear_cross_entropy_default[0]
    view_2 = getitem.view(2, 5)
    sum_1 = view_2.sum(dim = 1)
    mean = sum_1.mean()
    return (mean,)""",
        )

    def test_all_targets_ignored(self):
        weight = rand_weight(V, D)

        def f(hidden, labels):
            return F.cross_entropy(F.linear(hidden, weight), labels, reduction="mean")

        labels = torch.full((B * T,), -100)
        self.run_pass(f, rand_hidden(B * T, D), labels, params=[weight])
        self.assertTrue(torch.isnan(self.compiled_output))

    def test_several_loss_sites(self):
        heads = nn.ModuleList([nn.Linear(D, V, bias=False) for _ in range(3)])

        def f(hidden, labels):
            losses = [F.cross_entropy(head(hidden), labels) for head in heads]  # e.g. multi-token prediction
            return sum(losses)

        params = [p for head in heads for p in head.parameters()]
        cap = self.run_pass(f, rand_hidden(B * T, D), rand_labels(B * T), rewrites=3, params=params)
        self.assertEqual(cap.after[0].count("cce_inductor.linear_cross_entropy"), 3)
        self.assertExpectedInline(
            cap.after[0],
            """\
def forward(self, L_heads_modules_0_parameters_weight_ : torch.nn.parameter.Parameter, L_heads_modules_1_parameters_weight_ : torch.nn.parameter.Parameter, L_heads_modules_2_parameters_weight_ : torch.nn.parameter.Parameter, L_hidden_ : torch.Tensor, L_labels_ : torch.Tensor):
    l_heads_modules_0_parameters_weight_ = L_heads_modules_0_parameters_weight_
    l_heads_modules_1_parameters_weight_ = L_heads_modules_1_parameters_weight_
    l_heads_modules_2_parameters_weight_ = L_heads_modules_2_parameters_weight_
    l_hidden_ = L_hidden_
    l_labels_ = L_labels_
    linear_cross_entropy_default = torch.ops.cce_inductor.linear_cross_entropy.default(l_hidden_, l_heads_modules_0_parameters_weight_, l_labels_, None, None, -100, 'mean', 0.0, 'exact=False;products=auto;backward_row_chunk=8192;path=auto;scratch_mb=0', False, False)
    getitem = linear_cross_entropy_default[0]
    linear_cross_entropy_default_1 = torch.ops.cce_inductor.linear_cross_entropy.default(l_hidden_, l_heads_modules_1_parameters_weight_, l_labels_, None, None, -100, 'mean', 0.0, 'exact=False;products=auto;backward_row_chunk=8192;path=auto;scratch_mb=0', False, False)
    getitem_1 = linear_cross_entropy_default_1[0]
    linear_cross_entropy_default_2 = torch.ops.cce_inductor.linear_cross_entropy.default(l_hidden_, l_heads_modules_2_parameters_weight_, l_labels_, None, None, -100, 'mean', 0.0, 'exact=False;products=auto;backward_row_chunk=8192;path=auto;scratch_mb=0', False, False)
    getitem_2 = linear_cross_entropy_default_2[0]
    value = 0 + getitem
    value_1 = value + getitem_1
    value_2 = value_1 + getitem_2
    return (value_2,)""",
        )

    def test_frozen_head(self):
        weight = rand_weight(V, D, requires_grad=False)

        def f(hidden, labels):
            return F.cross_entropy(F.linear(hidden, weight), labels)

        hidden = rand_hidden(B * T, D)
        self.run_pass(f, hidden, rand_labels(B * T))
        self.assertIsNone(weight.grad)

    def test_tied_embedding_and_head(self):
        embedding = nn.Embedding(V, D)

        def f(tokens, labels):
            hidden = torch.tanh(embedding(tokens))
            logits = F.linear(hidden, embedding.weight)
            return F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-1)

        tokens = torch.randint(0, V, (B, T))
        self.run_pass(f, tokens, rand_labels(B, T, ignore_index=-1), params=[embedding.weight])

    def test_escaping_logits_dropped_on_opt_in(self):
        weight = rand_weight(V, D)

        def f(hidden, labels):
            logits = F.linear(hidden, weight)
            loss = F.cross_entropy(logits.float().view(-1, V), labels.view(-1))
            return loss, logits

        capture = PassCapture(CCEOptions(drop_logits=True))
        hidden, labels = rand_hidden(B, T, D), rand_labels(B, T)
        loss, logits = torch.compile(f, backend=capture, fullgraph=True)(hidden, labels)
        self.assertEqual(capture.rewrites, [1])
        torch.testing.assert_close(loss, f(hidden, labels)[0])
        # a placeholder of the logits' shape and dtype that raises on use (tests/test_dropped_logits.py)
        self.assertIsInstance(logits, cce_inductor.DroppedLogits)
        self.assertEqual((logits.shape, logits.dtype), (f(hidden, labels)[1].shape, torch.float32))
        self.assertFalse(logits.requires_grad)
        with self.assertRaisesRegex(RuntimeError, "drop_logits"):
            logits.sum()
        self.assertExpectedInline(
            capture.after[0],
            """\
def forward(self, L_hidden_ : torch.Tensor, L_labels_ : torch.Tensor, L_weight_ : torch.Tensor):
    l_hidden_ = L_hidden_
    l_labels_ = L_labels_
    l_weight_ = L_weight_
    view_1 = l_labels_.view(-1)
    reshape = l_hidden_.reshape(-1, 16)
    linear_cross_entropy_default = torch.ops.cce_inductor.linear_cross_entropy.default(reshape, l_weight_, view_1, None, None, -100, 'mean', 0.0, 'exact=False;products=auto;backward_row_chunk=8192;path=auto;scratch_mb=0', False, False)
    getitem = linear_cross_entropy_default[0]
    dropped_logits_default = torch.ops.cce_inductor.dropped_logits.default(view_1, [2, 5, 37], torch.float32)
    return (getitem, dropped_logits_default)""",
        )


def _bias_forms():
    """Every way real code (and peers' reference formulas) adds a (V,) bias to the head's product: name -> (fn of
    (hidden (B, T, D), labels (B, T)), its tensors), each head stored (V, D) or (D, V)."""
    weight, weight_t, bias = rand_weight(V, D), rand_weight(D, V), torch.randn(V, requires_grad=True)

    def add_after(hidden, labels):
        logits = hidden @ weight.T
        logits = logits + bias
        return F.cross_entropy(logits.view(-1, V), labels.view(-1))

    def add_in_place(hidden, labels):
        logits = hidden @ weight.T
        logits += bias
        return F.cross_entropy(logits.view(-1, V), labels.view(-1))

    def add_in_place_method(hidden, labels):
        logits = hidden @ weight.T
        logits.add_(bias)  # read afterwards through `logits`
        return F.cross_entropy(logits.view(-1, V), labels.view(-1))

    def add_in_place_after_a_view(hidden, labels):
        logits = (hidden @ weight.T).view(-1, V)
        logits += bias
        return F.cross_entropy(logits, labels.view(-1))

    def bias_first_after_views(hidden, labels):
        logits = torch.matmul(hidden.view(-1, D), weight_t).view(-1, V)
        return F.cross_entropy(bias + logits, labels.view(-1))

    def torch_add_and_method(hidden, labels):
        first = F.cross_entropy(torch.add(hidden @ weight.T, bias).flatten(0, 1), labels.flatten())
        return first + F.cross_entropy((hidden @ weight_t).add(bias).view(-1, V), labels.view(-1), reduction="sum")

    def addmm(hidden, labels):
        return F.cross_entropy(torch.addmm(bias, hidden.view(-1, D), weight.t()), labels.view(-1))

    def addmm_weight_stored_transposed(hidden, labels):
        return F.cross_entropy(torch.addmm(bias, hidden.view(-1, D), weight_t), labels.view(-1))

    def bias_then_gemma_softcap_and_shift(hidden, labels):
        logits = F.linear(hidden, weight) + bias
        logits = torch.tanh(logits.float() / 30.0) * 30.0
        return F.cross_entropy(logits[..., :-1, :].reshape(-1, V), labels[..., 1:].reshape(-1))

    def in_place_bias_then_scale_and_softcap(hidden, labels):
        logits = hidden @ weight.T
        logits += bias
        logits = torch.tanh(logits * 0.5 / 10.0) * 10.0
        return F.cross_entropy(logits.view(-1, V), labels.view(-1), label_smoothing=0.1)

    forms = dict(
        add_after=add_after,
        add_in_place=add_in_place,
        add_in_place_method=add_in_place_method,
        add_in_place_after_a_view=add_in_place_after_a_view,
        bias_first_after_views=bias_first_after_views,
        torch_add_and_method=torch_add_and_method,
        addmm=addmm,
        addmm_weight_stored_transposed=addmm_weight_stored_transposed,
        bias_then_gemma_softcap_and_shift=bias_then_gemma_softcap_and_shift,
        in_place_bias_then_scale_and_softcap=in_place_bias_then_scale_and_softcap,
    )
    return forms, [weight, weight_t, bias]


class TestBiasAddedToTheProduct(PatternTestCase):
    """A (V,) bias added to the head's product, in every spelling, is the fused op's bias: graphs, then parity with
    eager on both paths (the rewritten graph runs the chunked CPU path)."""

    def setUp(self):
        super().setUp()
        torch.manual_seed(0)

    def test_every_form_is_rewritten_with_eager_numbers_on_both_paths(self):
        forms, params = _bias_forms()
        for name, fn in forms.items():
            for path in ("lean", "balanced"):
                with self.subTest(form=name, path=path):
                    torch._dynamo.reset()
                    cce_inductor.reset_stats()
                    rewrites = 2 if name == "torch_add_and_method" else 1
                    cap = self.run_pass(
                        fn,
                        rand_hidden(B, T, D),
                        rand_labels(B, T),
                        rewrites=rewrites,
                        params=params,
                        options=CCEOptions(path=path),
                    )
                    for product_or_bias in (" @ ", "matmul", "addmm", "+=", "add_(", "add(", "+ l_bias_", "l_bias_ +"):
                        self.assertNotIn(product_or_bias, cap.after[0])
                    sites = cce_inductor.stats()["sites"]
                    self.assertTrue(
                        all(
                            site["path"] == path
                            and ": matmul, bias" in site["reason"]
                            or ": linear, bias" in site["reason"]
                            for site in sites
                        ),
                        sites,
                    )

    def test_in_place_add_graph(self):
        forms, params = _bias_forms()
        cap = self.run_pass(forms["add_in_place"], rand_hidden(B, T, D), rand_labels(B, T), params=params)
        self.assertExpectedInline(
            cap.before[0],
            """\
def forward(self, L_bias_ : torch.Tensor, L_hidden_ : torch.Tensor, L_labels_ : torch.Tensor, L_weight_ : torch.Tensor):
    l_bias_ = L_bias_
    l_hidden_ = L_hidden_
    l_labels_ = L_labels_
    l_weight_ = L_weight_
    numpy_t = torch.ops.aten.numpy_T(l_weight_)
    logits = l_hidden_ @ numpy_t
    logits += l_bias_;  logits_1 = logits
    view = logits_1.view(-1, 37)
    view_1 = l_labels_.view(-1)
    cross_entropy = torch.nn.functional.cross_entropy(view, view_1)
    return (cross_entropy,)""",
        )
        self.assertExpectedInline(
            cap.after[0],
            """\
def forward(self, L_bias_ : torch.Tensor, L_hidden_ : torch.Tensor, L_labels_ : torch.Tensor, L_weight_ : torch.Tensor):
    l_bias_ = L_bias_
    l_hidden_ = L_hidden_
    l_labels_ = L_labels_
    l_weight_ = L_weight_
    view_1 = l_labels_.view(-1)
    reshape = l_hidden_.reshape(-1, 16)
    linear_cross_entropy_default = torch.ops.cce_inductor.linear_cross_entropy.default(reshape, l_weight_, view_1, l_bias_, None, -100, 'mean', 0.0, 'exact=False;products=auto;backward_row_chunk=8192;path=auto;scratch_mb=0', False, False)
    getitem = linear_cross_entropy_default[0]
    return (getitem,)""",
        )

    def test_add_in_place_method_graph(self):
        forms, params = _bias_forms()
        cap = self.run_pass(forms["add_in_place_method"], rand_hidden(B, T, D), rand_labels(B, T), params=params)
        self.assertExpectedInline(
            cap.before[0],
            """\
def forward(self, L_bias_ : torch.Tensor, L_hidden_ : torch.Tensor, L_labels_ : torch.Tensor, L_weight_ : torch.Tensor):
    l_bias_ = L_bias_
    l_hidden_ = L_hidden_
    l_labels_ = L_labels_
    l_weight_ = L_weight_
    numpy_t = torch.ops.aten.numpy_T(l_weight_)
    logits = l_hidden_ @ numpy_t
    add_ = logits.add_(l_bias_)
    view = logits.view(-1, 37)
    view_1 = l_labels_.view(-1)
    cross_entropy = torch.nn.functional.cross_entropy(view, view_1)
    return (cross_entropy,)""",
        )
        self.assertExpectedInline(
            cap.after[0],
            """\
def forward(self, L_bias_ : torch.Tensor, L_hidden_ : torch.Tensor, L_labels_ : torch.Tensor, L_weight_ : torch.Tensor):
    l_bias_ = L_bias_
    l_hidden_ = L_hidden_
    l_labels_ = L_labels_
    l_weight_ = L_weight_
    view_1 = l_labels_.view(-1)
    reshape = l_hidden_.reshape(-1, 16)
    linear_cross_entropy_default = torch.ops.cce_inductor.linear_cross_entropy.default(reshape, l_weight_, view_1, l_bias_, None, -100, 'mean', 0.0, 'exact=False;products=auto;backward_row_chunk=8192;path=auto;scratch_mb=0', False, False)
    getitem = linear_cross_entropy_default[0]
    return (getitem,)""",
        )

    def test_addmm_graph(self):
        forms, params = _bias_forms()
        cap = self.run_pass(forms["addmm"], rand_hidden(B, T, D), rand_labels(B, T), params=params)
        self.assertExpectedInline(
            cap.before[0],
            """\
def forward(self, L_bias_ : torch.Tensor, L_hidden_ : torch.Tensor, L_labels_ : torch.Tensor, L_weight_ : torch.Tensor):
    l_bias_ = L_bias_
    l_hidden_ = L_hidden_
    l_labels_ = L_labels_
    l_weight_ = L_weight_
    view = l_hidden_.view(-1, 16)
    t = l_weight_.t()
    addmm = torch.addmm(l_bias_, view, t)
    view_1 = l_labels_.view(-1)
    cross_entropy = torch.nn.functional.cross_entropy(addmm, view_1)
    return (cross_entropy,)""",
        )
        self.assertExpectedInline(
            cap.after[0],
            """\
def forward(self, L_bias_ : torch.Tensor, L_hidden_ : torch.Tensor, L_labels_ : torch.Tensor, L_weight_ : torch.Tensor):
    l_bias_ = L_bias_
    l_hidden_ = L_hidden_
    l_labels_ = L_labels_
    l_weight_ = L_weight_
    view = l_hidden_.view(-1, 16)
    t = l_weight_.t()
    view_1 = l_labels_.view(-1)
    linear_cross_entropy_default = torch.ops.cce_inductor.linear_cross_entropy.default(view, l_weight_, view_1, l_bias_, None, -100, 'mean', 0.0, 'exact=False;products=auto;backward_row_chunk=8192;path=auto;scratch_mb=0', False, False)
    getitem = linear_cross_entropy_default[0]
    return (getitem,)""",
        )

    def test_bias_then_softcap_graph(self):
        forms, params = _bias_forms()
        cap = self.run_pass(
            forms["bias_then_gemma_softcap_and_shift"], rand_hidden(B, T, D), rand_labels(B, T), params=params
        )
        self.assertExpectedInline(
            cap.before[0],
            """\
def forward(self, L_bias_ : torch.Tensor, L_hidden_ : torch.Tensor, L_labels_ : torch.Tensor, L_weight_ : torch.Tensor):
    l_bias_ = L_bias_
    l_hidden_ = L_hidden_
    l_labels_ = L_labels_
    l_weight_ = L_weight_
    linear = torch._C._nn.linear(l_hidden_, l_weight_)
    logits = linear + l_bias_
    float_1 = logits.float()
    truediv = float_1 / 30.0
    tanh = torch.tanh(truediv)
    logits_1 = tanh * 30.0
    getitem = logits_1[(Ellipsis, slice(None, -1, None), slice(None, None, None))]
    reshape = getitem.reshape(-1, 37)
    getitem_1 = l_labels_[(Ellipsis, slice(1, None, None))]
    reshape_1 = getitem_1.reshape(-1)
    cross_entropy = torch.nn.functional.cross_entropy(reshape, reshape_1)
    return (cross_entropy,)""",
        )
        self.assertExpectedInline(
            cap.after[0],
            """\
def forward(self, L_bias_ : torch.Tensor, L_hidden_ : torch.Tensor, L_labels_ : torch.Tensor, L_weight_ : torch.Tensor):
    l_bias_ = L_bias_
    l_hidden_ = L_hidden_
    l_labels_ = L_labels_
    l_weight_ = L_weight_
    getitem_1 = l_labels_[(Ellipsis, slice(1, None, None))]
    reshape_1 = getitem_1.reshape(-1)
    getitem_2 = l_hidden_[(Ellipsis, slice(None, -1, None), slice(None, None, None))]
    reshape_2 = getitem_2.reshape(-1, 16)
    linear_cross_entropy_default = torch.ops.cce_inductor.linear_cross_entropy.default(reshape_2, l_weight_, reshape_1, l_bias_, 30.0, -100, 'mean', 0.0, 'exact=False;products=auto;backward_row_chunk=8192;path=auto;scratch_mb=0', False, False)
    getitem_3 = linear_cross_entropy_default[0]
    return (getitem_3,)""",
        )

    def test_returned_logits_with_an_added_bias_come_back_lazy(self):
        weight, bias = rand_weight(V, D), torch.randn(V, requires_grad=True)

        def f(hidden, labels):
            logits = hidden @ weight.T
            logits += bias
            return F.cross_entropy(logits.view(-1, V), labels.view(-1)), logits

        hidden = rand_hidden(B, T, D)
        self.run_pass(f, hidden, rand_labels(B, T), params=[weight, bias])
        logits = self.compiled_output[1]
        self.assertIsInstance(logits, cce_inductor.LazyLogits)
        torch.testing.assert_close(logits.materialize(), (hidden @ weight.T + bias).detach())

    def test_refused_bias_forms(self):
        weight, bias = rand_weight(V, D), torch.randn(V, requires_grad=True)
        cases = {
            "scaled first": (
                lambda h, y: F.cross_entropy((h @ weight.T) * 2.0 + bias, y),
                "logits are scaled before the bias is added",
            ),
            "soft-capped first": (
                lambda h, y: F.cross_entropy(torch.tanh(h @ weight.T / 5.0) * 5.0 + bias, y),
                "logits are soft-capped before the bias is added",
            ),
            "two biases": (
                lambda h, y: F.cross_entropy(F.linear(h, weight, bias) + bias, y),
                "linear has a bias and add adds another",
            ),
            "addmm beta": (
                lambda h, y: F.cross_entropy(torch.addmm(bias, h, weight.t(), beta=0.5), y),
                "addmm (addmm) scales its bias or its product (beta, alpha)",
            ),
            "add alpha": (
                lambda h, y: F.cross_entropy(torch.add(h @ weight.T, bias, alpha=2.0), y),
                "the input of cross_entropy comes from add (add)",
            ),
        }
        for name, (f, reason) in cases.items():
            with self.subTest(name):
                torch._dynamo.reset()
                cce_inductor.reset_stats()
                self.assertIn(reason, self.assert_refused(f, rand_hidden(B * T, D), rand_labels(B * T), reason=reason))

    def test_in_place_bias_on_logits_read_before_the_add_is_refused(self):
        weight, bias = rand_weight(V, D), torch.randn(V, requires_grad=True)

        def f(hidden, labels):
            logits = hidden @ weight.T
            accuracy = (logits.argmax(-1) == labels).float().mean()  # of the logits without the bias
            logits += bias
            return F.cross_entropy(logits, labels) + accuracy

        reason = self.assert_refused(f, rand_hidden(B * T, D), rand_labels(B * T), reason="in place")
        self.assertExpectedInline(reason, """logits_1 adds the bias in place to logits, which argmax reads too""")

    def test_bias_of_another_dtype_than_the_product_is_refused(self):
        weight, bias = rand_weight(V, D).bfloat16(), torch.randn(V)  # bf16 + fp32: the add promotes to fp32

        def f(hidden, labels):
            return F.cross_entropy(hidden.bfloat16() @ weight.T + bias, labels)

        reason = self.assert_refused(f, rand_hidden(B * T, D), rand_labels(B * T), reason="bias to")
        self.assertExpectedInline(
            reason,
            """add adds a torch.float32 bias to torch.bfloat16 logits (into torch.float32): only a bias in the head's dtype is fused""",
        )


class TestRefusals(PatternTestCase):
    """Sites the pass must leave alone, each with the reason it reports."""

    def setUp(self):
        super().setUp()
        torch.manual_seed(0)

    def test_chunks_are_not_merged_across_an_in_place_update(self):
        """One call for both chunks would run before the update that the second chunk's head reads in eager."""
        weight = rand_weight(V, D)

        def f(hidden, labels):
            h0, h1 = hidden[:5], hidden[5:].clone()
            y0, y1 = labels[:5], labels[5:]
            first = F.cross_entropy(F.linear(h0, weight), y0)
            h1.mul_(2.0)
            return first + F.cross_entropy(F.linear(h1, weight), y1)

        cap = self.run_pass(f, rand_hidden(10, D), rand_labels(10), params=[weight], rewrites=2)
        self.assertEqual(cap.after[0].count("linear_cross_entropy.default("), 2)
        self.assertNotIn("other chunk", str(cce_inductor.stats()["sites"]))

    def test_class_weights_with_label_smoothing(self):
        weight, class_weight = rand_weight(V, D), torch.rand(V)
        f = lambda h, y: F.cross_entropy(F.linear(h, weight), y, weight=class_weight, label_smoothing=0.1)  # noqa: E731
        reason = self.assert_refused(f, rand_hidden(B * T, D), rand_labels(B * T, fraction_ignored=0), reason="weight")
        self.assertExpectedInline(
            reason,
            """cross_entropy has class weights and label_smoothing: eager's weighted label smoothing (the smoothing term weighted per class) is not implemented""",
        )

    def test_probability_targets(self):
        weight = rand_weight(V, D)
        f = lambda h, y: F.cross_entropy(F.linear(h, weight), y)  # noqa: E731
        probabilities = torch.softmax(torch.randn(B * T, V), dim=-1)
        reason = self.assert_refused(f, rand_hidden(B * T, D), probabilities, reason="probability")
        self.assertExpectedInline(reason, """cross_entropy has probability (floating-point) targets""")

    def test_logits_used_for_a_metric(self):
        weight = rand_weight(V, D)

        def f(hidden, labels):
            logits = F.linear(hidden, weight)
            confidence = logits.softmax(-1).amax(-1).mean()  # (a token accuracy, argmax, is fused: tests/clients)
            return F.cross_entropy(logits, labels) + confidence

        reason = self.assert_refused(f, rand_hidden(B * T, D), rand_labels(B * T), reason="also used by")
        self.assertExpectedInline(
            reason, """the logits (logits) are also used by softmax (.softmax()), not only by the loss"""
        )

    def test_logits_returned_with_lazy_logits_off(self):
        weight = rand_weight(V, D)

        def f(hidden, labels):
            logits = F.linear(hidden, weight)
            return F.cross_entropy(logits, labels), logits

        cap = self.run_pass(
            f, rand_hidden(B * T, D), rand_labels(B * T), rewrites=0, options=CCEOptions(lazy_logits=False)
        )
        self.assertEqual(cap.before, cap.after)
        (reason,) = cce_inductor.stats()["reasons"]
        self.assertExpectedInline(
            reason,
            """logits escape the compiled region (logits is a graph output, as in Hugging Face models) and lazy_logits is off (CCE_INDUCTOR_LAZY_LOGITS=0); turn it back on to return them computed on first use, or set CCE_INDUCTOR_DROP_LOGITS=1 or cce_inductor.make_backend(drop_logits=True) to return, in their place, a placeholder that raises on use""",
        )

    def test_non_tanh_softcap(self):
        weight = rand_weight(V, D)
        f = lambda h, y: F.cross_entropy(torch.sigmoid(F.linear(h, weight) / 3.0) * 3.0, y)  # noqa: E731
        reason = self.assert_refused(f, rand_hidden(B * T, D), rand_labels(B * T), reason="which is not a linear layer")
        self.assertExpectedInline(
            reason,
            """the input of cross_entropy comes from sigmoid (sigmoid), which is not a linear layer""",
        )

    def test_softcap_with_mismatched_constants(self):
        weight = rand_weight(V, D)
        f = lambda h, y: F.cross_entropy(torch.tanh(F.linear(h, weight) / 3.0) * 5.0, y)  # noqa: E731
        self.assert_refused(f, rand_hidden(B * T, D), rand_labels(B * T), reason="which is not a linear layer")

    def test_linear_output_is_not_the_cross_entropy_input(self):
        weight = rand_weight(V, D)
        offset = torch.randn(B * T, V)  # a tensor per row, not a bias (a (V,) one is: TestBiasAddedToTheProduct)
        f = lambda h, y: F.cross_entropy(F.linear(h, weight) + offset, y)  # noqa: E731
        reason = self.assert_refused(f, rand_hidden(B * T, D), rand_labels(B * T), reason="which is not a linear layer")
        self.assertExpectedInline(
            reason,
            """the input of cross_entropy comes from add (add), which is not a linear layer""",
        )

    def test_logits_are_a_graph_input(self):
        f = lambda logits, y: F.cross_entropy(logits.float(), y)  # noqa: E731
        logits = torch.randn(B * T, V, requires_grad=True)
        reason = self.assert_refused(f, logits, rand_labels(B * T), reason="graph break")
        self.assertExpectedInline(
            reason,
            """the input of cross_entropy comes from l_logits_ (placeholder), not from a linear layer in the same graph (a graph break between the head and the loss?)""",
        )

    def test_vocabulary_slice(self):
        weight = rand_weight(V + 3, D)  # a padded vocabulary, sliced back before the loss
        f = lambda h, y: F.cross_entropy(F.linear(h, weight)[..., :V], y)  # noqa: E731
        reason = self.assert_refused(f, rand_hidden(B * T, D), rand_labels(B * T), reason="vocabulary")
        self.assertExpectedInline(reason, """getitem slices the vocabulary dimension""")

    def test_downcast_logits(self):
        weight = rand_weight(V, D)
        f = lambda h, y: F.cross_entropy(F.linear(h, weight).bfloat16(), y)  # noqa: E731
        reason = self.assert_refused(f, rand_hidden(B * T, D), rand_labels(B * T), reason="casts the logits down")
        self.assertExpectedInline(reason, """bfloat16 casts the logits down from torch.float32 to torch.bfloat16""")

    def test_scale_after_softcap(self):
        weight = rand_weight(V, D)
        f = lambda h, y: F.cross_entropy(torch.tanh(F.linear(h, weight) / 3.0) * 3.0 * 2.0, y)  # noqa: E731
        reason = self.assert_refused(f, rand_hidden(B * T, D), rand_labels(B * T), reason="after the softcap")
        self.assertExpectedInline(reason, """logits are scaled after the softcap""")

    def test_class_dimension_not_last(self):
        weight = rand_weight(V, D)
        f = lambda h, y: F.cross_entropy(F.linear(h, weight).transpose(1, 2), y)  # noqa: E731
        reason = self.assert_refused(f, rand_hidden(B, T, D), rand_labels(B, T), reason="only (N, V) logits")
        self.assertExpectedInline(
            reason,
            """cross_entropy input is 3-D and target 2-D; only (N, V) logits with (N,) class targets are matched""",
        )

    def test_unsupported_device(self):
        weight = torch.randn(V, D, device="meta")

        def f(hidden, labels):
            return F.cross_entropy(F.linear(hidden, weight), labels)

        capture = PassCapture()
        torch.compile(f, backend=capture, fullgraph=True)(
            torch.randn(B * T, D, device="meta"), torch.zeros(B * T, dtype=torch.long, device="meta")
        )
        self.assertEqual(capture.rewrites, [0])
        self.assertExpectedInline(next(iter(cce_inductor.stats()["reasons"])), """device meta is not supported""")


class TestThroughInductor(PatternTestCase):
    """The same rewrite through the real backend (AOTAutograd + Inductor), with dynamic shapes."""

    def test_gemma_style_head_dynamic_sequence_length(self):
        torch.manual_seed(0)
        head = nn.Linear(D, V, bias=False)

        def f(hidden, labels):
            logits = head(hidden).float()
            logits = torch.tanh(logits / 30.0) * 30.0
            shift_logits = logits[..., :-1, :].contiguous()
            shift_labels = labels[..., 1:].contiguous()
            return F.cross_entropy(shift_logits.view(-1, V), shift_labels.view(-1))

        compiled = torch.compile(f, backend=cce_inductor.backend, dynamic=True)
        torch._dynamo.utils.counters.clear()
        # A cache hit skips the pass (the cached code calls the op already): count rewrites on a cold cache.
        caches_off = inductor_caches_off()
        caches_off.__enter__()
        self.addCleanup(caches_off.__exit__, None, None, None)
        for seq in (5, 9, 12):
            hidden, labels = rand_hidden(B, seq, D), rand_labels(B, seq)
            expected = f(hidden, labels)
            expected_grads = torch.autograd.grad(expected, [hidden, head.weight])
            actual = compiled(hidden, labels)
            actual_grads = torch.autograd.grad(actual, [hidden, head.weight])
            torch.testing.assert_close(actual, expected)
            for got, want in zip(actual_grads, expected_grads):
                torch.testing.assert_close(got, want)
        self.assertEqual(cce_inductor.stats()["rewritten"], 1)  # compiled once for all lengths
        self.assertEqual(torch._dynamo.utils.counters["stats"]["unique_graphs"], 1)

    def test_bias_added_in_place_then_softcap_both_paths(self):
        """``logits += b`` then the Gemma-2 softcap through AOTAutograd + Inductor (which functionalises the in-place
        add before the rewritten graph is compiled), on each path: eager's loss and gradients."""
        torch.manual_seed(0)
        forms, params = _bias_forms()
        f = forms["in_place_bias_then_scale_and_softcap"]
        caches_off = inductor_caches_off()
        caches_off.__enter__()
        self.addCleanup(caches_off.__exit__, None, None, None)
        hidden, labels = rand_hidden(B, T, D), rand_labels(B, T)
        leaves = [hidden] + params
        expected = f(hidden, labels)
        expected_grads = torch.autograd.grad(expected, leaves, allow_unused=True)
        for path in ("lean", "balanced"):
            with self.subTest(path=path):
                torch._dynamo.reset()
                cce_inductor.reset_stats()
                actual = torch.compile(f, backend=cce_inductor.make_backend(path=path), fullgraph=True)(hidden, labels)
                actual_grads = torch.autograd.grad(actual, leaves, allow_unused=True)
                self.assertEqual([site["path"] for site in cce_inductor.stats()["sites"]], [path])
                torch.testing.assert_close(actual, expected)
                for got, want in zip(actual_grads, expected_grads):
                    if want is None:
                        self.assertIsNone(got)
                    else:
                        torch.testing.assert_close(got, want)


class TestEinsumHeads(PatternTestCase):
    """``torch.einsum`` heads (``fx_passes/head_chain.py``, ``_einsum_operands``): the weight as (V, D) or (D, V),
    batched hidden states, on the lean and the balanced path; an equation that is not a head is refused with a reason
    that names it."""

    def setUp(self):
        super().setUp()
        torch.manual_seed(0)

    def test_einsum_head_is_the_fused_op(self):
        weight = rand_weight(V, D)

        def f(hidden, labels):
            logits = torch.einsum("btd,vd->btv", hidden, weight)
            return F.cross_entropy(logits.float().reshape(-1, V), labels.reshape(-1))

        cap = self.run_pass(f, rand_hidden(B, T, D), rand_labels(B, T), params=[weight])
        self.assertIn("torch.ops.cce_inductor.linear_cross_entropy.default", cap.after[0])
        self.assertNotIn("einsum", cap.after[0])

    def test_einsum_spellings_and_both_paths(self):
        weight, weight_dv = rand_weight(V, D), rand_weight(D, V)

        def vd(hidden, labels):
            return F.cross_entropy(torch.einsum("nd,vd->nv", hidden, weight), labels)

        def dv(hidden, labels):  # the weight held as (D, V), the ellipsis, spaces, the operands as a list
            return F.cross_entropy(torch.einsum("... d, d v -> ... v", [hidden, weight_dv]), labels, reduction="sum")

        for options in (None, BALANCED):
            self.run_pass(vd, rand_hidden(B * T, D), rand_labels(B * T), params=[weight], options=options)
            self.run_pass(dv, rand_hidden(B * T, D), rand_labels(B * T), params=[weight_dv], options=options)

    def test_a_loss_scaled_after_the_cross_entropy_has_its_gradients_computed_at_the_scale(self):
        """A bf16 head whose loss the graph scales after the cross-entropy (Hugging Face's ``sum /
        num_items_in_batch``, a weight of 0.7, a count then a weight, a count the graph takes after the loss): the
        balanced op is given the scale as ``grad_scale``, formed as autograd forms the loss's gradient (a factor
        computed after the loss computed again before the call), so that its plain 16-bit dC sum is rounded as at
        upstream gradient 1 (its error budget) and kept; stats() names the scale. A power of two (and a sum with
        another term) is no scale."""
        weight = rand_weight(V, D).bfloat16().detach().requires_grad_()

        def by_count(hidden, labels, count):
            return F.cross_entropy(F.linear(hidden, weight).float(), labels, reduction="sum") / count

        def by_weight(hidden, labels):
            return F.cross_entropy(F.linear(hidden, weight).float(), labels) * 0.7

        def by_count_and_weight(hidden, labels, count):
            return (F.cross_entropy(F.linear(hidden, weight).float(), labels, reduction="sum") / count + 1.0) * 0.7

        def counted_after(hidden, labels):
            loss = F.cross_entropy(F.linear(hidden, weight).float(), labels, reduction="sum")
            return loss / (labels != -100).sum().float()

        def by_power_of_two(hidden, labels):
            return (F.cross_entropy(F.linear(hidden, weight).float(), labels) + 1.0) / 4

        count = torch.tensor(float(B * T + 3))
        for fn, extra, scale in (
            (by_count, (count,), "(truediv) by l_count_"),
            (by_weight, (), "(mul) by 0.7"),
            (by_count_and_weight, (count,), "(truediv) by l_count_, mul (mul) by 0.7"),
            (counted_after, (), "(truediv) by float_2"),
            (by_power_of_two, (), None),
        ):
            cce_inductor.reset_stats()
            hidden = rand_hidden(B * T, D).bfloat16().detach().requires_grad_()
            self.run_pass(
                fn, hidden, rand_labels(B * T), *extra, params=[weight], options=BALANCED, atol=2e-2, rtol=2e-2
            )
            (site,) = cce_inductor.stats()["sites"]
            self.assertEqual(site["path"], "balanced")
            self.assertIn("in its own 16-bit dtype", site["reason"])
            self.assertNotIn("scaled after the cross-entropy (", site["reason"])
            self.assertEqual(
                scale is not None, "computed at the loss's scale after the cross-entropy" in site["reason"]
            )
            if scale is not None:
                self.assertIn(scale, site["reason"])

    def test_a_symbolic_count_is_a_scale_the_op_is_given(self):
        """``sum / n`` with ``n`` a Python int that Dynamo makes symbolic (``dynamic=True``): the SymInt is a factor
        of ``grad_scale`` like a tensor count; loss and gradients as eager's for every count the graph serves."""
        weight = rand_weight(V, D).bfloat16().detach().requires_grad_()

        def f(hidden, labels, n):
            return F.cross_entropy(F.linear(hidden, weight).float(), labels, reduction="sum") / n

        torch._dynamo.reset()
        cce_inductor.reset_stats()
        compiled = torch.compile(f, backend=cce_inductor.make_backend(BALANCED), dynamic=True)
        with inductor_caches_off():  # (a cache hit skips the pass, and stats() with it)
            for n in (5, 7):
                hidden = rand_hidden(B * T, D).bfloat16().detach().requires_grad_()
                labels = rand_labels(B * T)
                got = compiled(hidden, labels, n)
                got_grads = torch.autograd.grad(got, [hidden, weight])
                want = f(hidden, labels, n)
                for mine, theirs in zip((got, *got_grads), (want, *torch.autograd.grad(want, [hidden, weight]))):
                    torch.testing.assert_close(mine, theirs, atol=2e-2, rtol=2e-2)
        (site,) = cce_inductor.stats()["sites"]
        self.assertEqual(site["path"], "balanced")
        self.assertIn(
            "computed at the loss's scale after the cross-entropy (truediv (truediv) by l_n_)", site["reason"]
        )

    def test_the_grad_scale_is_formed_in_the_graph_as_autograd_forms_the_gradient(self):
        """The graph the balanced op gets for ``cross_entropy(..., reduction="sum") / count * 0.7``: ``grad_scale =
        ones() * 0.7 / count``, the outermost factor first, before the call."""
        weight = rand_weight(V, D).bfloat16().detach().requires_grad_()

        def f(hidden, labels, count):
            return F.cross_entropy(F.linear(hidden, weight).float(), labels, reduction="sum") / count * 0.7

        hidden = rand_hidden(B * T, D).bfloat16().detach().requires_grad_()
        cap = self.run_pass(
            f, hidden, rand_labels(B * T), torch.tensor(17.0), params=[weight], options=BALANCED, atol=2e-2, rtol=2e-2
        )
        self.assertExpectedInline(
            cap.after[0],
            """\
def forward(self, L_count_ : torch.Tensor, L_hidden_ : torch.Tensor, L_labels_ : torch.Tensor, L_weight_ : torch.Tensor):
    l_count_ = L_count_
    l_hidden_ = L_hidden_
    l_labels_ = L_labels_
    l_weight_ = L_weight_
    ones = torch.ones((), dtype = torch.float32, device = device(type='cpu'))
    mul_1 = ones * 0.7
    truediv_1 = mul_1 / l_count_
    linear_cross_entropy_with_grads_default = torch.ops.cce_inductor.linear_cross_entropy_with_grads.default(l_hidden_, l_weight_, l_labels_, None, None, -100, 'sum', 0.0, 'exact=False;products=auto;backward_row_chunk=8192;path=auto;scratch_mb=1', True, True, False, False, plain_sum = True, grad_scale = truediv_1)
    getitem = linear_cross_entropy_with_grads_default[0]
    truediv = getitem / l_count_
    mul = truediv * 0.7
    return (mul,)""",
        )

    def test_a_scale_the_op_cannot_be_given_gets_the_exact_pair(self):
        """Where the loss's gradient cannot be formed before the call (its uses branch, a factor needs a gradient, a
        factor is computed from the loss itself, the loss is broadcast before a sum), the site sums dC as the exact
        pair and stats() names the scale."""
        weight = rand_weight(V, D).bfloat16().detach().requires_grad_()
        learned = torch.tensor(0.7, requires_grad=True)

        def branching(hidden, labels, count):
            loss = F.cross_entropy(F.linear(hidden, weight).float(), labels, reduction="sum")
            return loss / count + loss * 0.3

        def learned_weight(hidden, labels, count):
            return F.cross_entropy(F.linear(hidden, weight).float(), labels) * learned

        def by_itself(hidden, labels, count):
            loss = F.cross_entropy(F.linear(hidden, weight).float(), labels, reduction="sum")
            return loss / loss.detach()

        def broadcast(hidden, labels, count):  # (its sum's gradient to the loss is 3)
            loss = F.cross_entropy(F.linear(hidden, weight).float(), labels, reduction="sum")
            return (loss + torch.zeros(3)).sum() / count

        count = torch.tensor(float(B * T + 3))
        for fn, params, scale in (
            (branching, [weight], "by l_count_"),
            (learned_weight, [weight, learned], "by l_learned_"),
            (by_itself, [weight], "(truediv) by detach"),
            (broadcast, [weight], "broadcasts the loss to (3,)"),
        ):
            cce_inductor.reset_stats()
            hidden = rand_hidden(B * T, D).bfloat16().detach().requires_grad_()
            self.run_pass(fn, hidden, rand_labels(B * T), count, params=params, options=BALANCED, atol=2e-2, rtol=2e-2)
            (site,) = cce_inductor.stats()["sites"]
            self.assertEqual(site["path"], "balanced")
            self.assertIn("as a 16-bit pair", site["reason"])
            self.assertIn("dE as a pair too", site["reason"])
            self.assertIn("the loss is scaled after the cross-entropy (", site["reason"])
            self.assertIn(scale, site["reason"])
            self.assertNotIn("computed at the loss's scale", site["reason"])

    def test_a_pair_for_memory_rounds_de_once(self):
        """Where dC is the pair because the plain sum's two chunks do not fit (here a 1 MiB scratch holds 128 of 512
        rows) and nothing scales the loss, dE leaves the op rounded once (each of its rows one chunk's sum, as
        torch.compile's product): the call says ``de_pair = False`` and stats() says so; loss and gradients as
        eager's."""
        v, n = 4096, 512
        weight = rand_weight(v, D).bfloat16().detach().requires_grad_()

        def f(hidden, labels):
            return F.cross_entropy(F.linear(hidden, weight).float(), labels)

        cce_inductor.reset_stats()
        hidden = rand_hidden(n, D).bfloat16().detach().requires_grad_()
        labels = torch.randint(0, v, (n,))
        cap = self.run_pass(f, hidden, labels, params=[weight], options=BALANCED, atol=2e-2, rtol=2e-2)
        (site,) = cce_inductor.stats()["sites"]
        self.assertIn("4 row chunks of 128 rows", site["reason"])
        self.assertIn("as a 16-bit pair", site["reason"])
        self.assertIn("dE rounded once", site["reason"])
        self.assertIn("de_pair = False)", cap.after[0])
        self.assertNotIn("plain_sum", cap.after[0])

    def test_einsum_that_is_not_a_head_is_refused_by_name(self):
        weight = torch.randn(V, D, 2, requires_grad=True)

        def f(hidden, labels):  # a weight of three dimensions, one summed: not a linear head
            return F.cross_entropy(torch.einsum("nd,vde->nv", hidden, weight), labels)

        cce_inductor.reset_stats()
        self.run_pass(f, rand_hidden(B * T, D), rand_labels(B * T), params=[weight], rewrites=0)
        (site,) = cce_inductor.stats()["sites"]
        self.assertIn("equation 'nd,vde->nv' is not a linear head", site["reason"])
