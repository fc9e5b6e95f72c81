"""Tests of the choice between the lean and the balanced path (``cce_inductor/paths.py``; the balanced path where
``CCEOptions.scratch_mb > 0``):

* ``cce_inductor.linear_cross_entropy`` calls ``linear_cross_entropy_with_grads`` exactly where the balanced path
  applies, with the lean path's numbers (bit for bit where the upstream gradient is 1 or a power of two);
* the pass: the balanced path is chosen exactly for mean / sum losses whose head needs gradients (and an lse not
  used elsewhere), ``stats()`` says which path each site got and why, and compiled results match eager (frozen and
  tied weights, dynamic shapes, CPU autocast, a softcap and label smoothing).

The balanced kernels: ``tests/kernels/test_balanced.py``; its op: ``tests/test_ops.py``.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import cce_inductor
from cce_inductor import CCEOptions
from tests.support.compare import rel_l2
from tests.support.inputs import BALANCED, IGNORE, make_balanced_inputs


# ----------------------------------------------------------------------------------------------------------------
# The op and the public function
# ----------------------------------------------------------------------------------------------------------------


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _ops_called(fn):
    with _OpLog() as log:
        fn()
    return {name for name in log.names if name.startswith("cce_inductor.")}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_public_function_chooses_the_path_and_matches_the_lean_one(dtype):
    e, c, t, b = make_balanced_inputs(23, 40, 8, dtype, bias=True)
    leaves = [x.requires_grad_() for x in (e, c, b)]

    def run(options, upstream):
        loss = cce_inductor.linear_cross_entropy(e, c, t, bias=b, softcap=3.0, options=options)
        return loss, torch.autograd.grad(loss * upstream, leaves)

    assert _ops_called(lambda: run(BALANCED, 1.0)) == {"cce_inductor.linear_cross_entropy_with_grads.default"}
    assert "cce_inductor.linear_cross_entropy.default" in _ops_called(lambda: run(CCEOptions(), 1.0))
    with torch.no_grad():
        assert _ops_called(lambda: cce_inductor.linear_cross_entropy(e, c, t, options=BALANCED)) == {
            "cce_inductor.linear_cross_entropy.default"}
    assert _ops_called(lambda: cce_inductor.linear_cross_entropy(e, c, t, reduction="none", options=BALANCED)) == {
        "cce_inductor.linear_cross_entropy.default"}

    for upstream in (1.0, 0.25, 3.0):
        lean_loss, lean = run(CCEOptions(), upstream)
        loss, grads = run(BALANCED, upstream)
        assert loss.item() == lean_loss.item()
        for mine, theirs in zip(grads, lean):
            if upstream == 3.0:  # the scaling rounds once more (README, "The balanced path")
                # (each within ~2 units of rounding of the exact gradient)
                assert rel_l2(mine, theirs) <= 4 * (2.0**-9 if dtype == torch.bfloat16 else 2.0**-24)
            else:  # CPU: both are the chunked path's gradients; scaling by a power of two is exact
                assert torch.equal(mine, theirs)


# ----------------------------------------------------------------------------------------------------------------
# The pass
# ----------------------------------------------------------------------------------------------------------------


class Head(torch.nn.Module):
    def __init__(self, d=16, v=50, tied=False):
        super().__init__()
        self.embed = torch.nn.Embedding(v, d)
        self.proj = torch.nn.Linear(d, d)
        self.head = torch.nn.Linear(d, v, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids, labels, reduction="mean", z_loss=0.0):
        h = torch.tanh(self.proj(self.embed(ids)))
        logits = self.head(h).float().view(-1, self.head.out_features)
        loss = F.cross_entropy(logits, labels.view(-1), reduction=reduction)
        if z_loss:
            loss = loss + z_loss * torch.logsumexp(logits, -1).pow(2).mean()
        return loss


def _compiled_run(model, ids, labels, options, **kwargs):
    cce_inductor.reset_stats()
    compiled = torch.compile(model, backend=cce_inductor.make_backend(options), **kwargs.pop("compile", {}))
    loss = compiled(ids, labels, **kwargs)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss.sum(), params) if loss.requires_grad else []
    return loss, grads, cce_inductor.stats()


def _eager_run(model, ids, labels, **kwargs):
    loss = model(ids, labels, **kwargs)
    params = [p for p in model.parameters() if p.requires_grad]
    return loss, (torch.autograd.grad(loss.sum(), params) if loss.requires_grad else [])


def _data(b=3, t=7, v=50, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, v, (b, t), generator=gen)
    labels = torch.randint(0, v, (b, t), generator=gen)
    labels[0, :3] = IGNORE
    return ids, labels


@pytest.mark.parametrize("setting", ["mean", "sum", "tied", "frozen_head", "dynamic"])
def test_pass_takes_the_balanced_path_and_matches_eager(setting, no_inductor_caches):
    torch.manual_seed(0)
    model = Head(tied=setting == "tied")
    if setting == "frozen_head":
        model.head.weight.requires_grad_(False)
    reduction = "sum" if setting == "sum" else "mean"
    ids, labels = _data()
    want_loss, want = _eager_run(model, ids, labels, reduction=reduction)
    compile_kwargs = {"dynamic": True} if setting == "dynamic" else {}
    loss, grads, stats = _compiled_run(model, ids, labels, BALANCED, reduction=reduction, compile=compile_kwargs)
    # (dynamic=True: Dynamo may restart its analysis after calling the backend once: the site is then seen twice)
    assert {s["path"] for s in stats["sites"]} == {"balanced"}, stats["sites"]
    assert "balanced path (1 MiB scratch)" in stats["sites"][0]["reason"]
    assert f"({len(stats['sites'])} on the balanced path)" in stats["summary"]
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(grads, want):
        assert rel_l2(mine, theirs) < 1e-5
    if setting == "dynamic":  # another batch size reuses the dynamic graph
        ids2, labels2 = _data(b=5, t=4, seed=1)
        want_loss2, want2 = _eager_run(model, ids2, labels2)
        compiled = torch.compile(model, backend=cce_inductor.make_backend(BALANCED), dynamic=True)
        loss2 = compiled(ids2, labels2)
        grads2 = torch.autograd.grad(loss2, [p for p in model.parameters() if p.requires_grad])
        torch.testing.assert_close(loss2, want_loss2, rtol=1e-5, atol=1e-6)
        for mine, theirs in zip(grads2, want2):
            assert rel_l2(mine, theirs) < 1e-5


@pytest.mark.parametrize("setting, reason", [
    ("none", "lean path: reduction='none'"),
    ("no_grad", "lean path: no gradient is needed"),
    ("frozen_all", "lean path: no gradient is needed"),
    ("z_loss", "lean path: the log-sum-exp is used beyond the loss"),
    ("scratch_0", None),
])
def test_pass_keeps_the_lean_path_where_the_balanced_one_does_not_apply(setting, reason, no_inductor_caches):
    torch.manual_seed(0)
    model = Head()
    if setting == "frozen_all":
        model.requires_grad_(False)
    ids, labels = _data()
    kwargs = {"reduction": "none"} if setting == "none" else {"z_loss": 1e-2} if setting == "z_loss" else {}
    options = CCEOptions() if setting == "scratch_0" else BALANCED
    want_loss, want = _eager_run(model, ids, labels, **kwargs)
    if setting == "no_grad":
        with torch.no_grad():
            loss, grads, stats = _compiled_run(model, ids, labels, options, **kwargs)
        want = []
    else:
        loss, grads, stats = _compiled_run(model, ids, labels, options, **kwargs)
    assert [s["path"] for s in stats["sites"]] == ["lean"], stats["sites"]
    assert stats["sites"][0]["rewritten"]
    if reason is None:
        assert "path" not in stats["sites"][0]["reason"] and "balanced" not in stats["summary"]
    else:
        assert reason in stats["sites"][0]["reason"], stats["sites"][0]["reason"]
    torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(grads, want):
        assert rel_l2(mine, theirs) < 1e-5


def test_per_row_sites_say_they_keep_the_lean_path(no_inductor_caches):
    """Token log-probs (RL) are per-row outputs: the lean path, and stats() says why when a scratch was asked for."""

    def log_probs(hidden, weight, ids):
        logits = hidden @ weight.T
        return torch.gather(logits.log_softmax(-1), -1, ids.unsqueeze(-1)).squeeze(-1)

    hidden = torch.randn(2, 5, 8, requires_grad=True)
    weight = torch.randn(30, 8, requires_grad=True)
    ids = torch.randint(0, 30, (2, 5))
    cce_inductor.reset_stats()
    out = torch.compile(log_probs, backend=cce_inductor.make_backend(BALANCED))(hidden, weight, ids)
    torch.testing.assert_close(out, log_probs(hidden, weight, ids), rtol=1e-5, atol=1e-5)
    (site,) = cce_inductor.stats()["sites"]
    assert site["rewritten"] and site["path"] == "lean" and "lean path: per-row outputs" in site["reason"]


def test_pass_under_autocast_is_no_less_accurate_than_eager(no_inductor_caches):
    """CPU autocast (bf16 head over fp32 weights): the balanced path is taken, and its loss and gradients are at
    least as close to the fp32 computation as eager autocast's."""
    torch.manual_seed(0)
    model = Head(d=32, v=300)
    ids, labels = _data(b=4, t=16, v=300)
    ref_loss, ref = _eager_run(model, ids, labels)  # fp32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager_loss, eager = _eager_run(model, ids, labels)
        loss, grads, stats = _compiled_run(model, ids, labels, BALANCED)
    assert {s["path"] for s in stats["sites"]} == {"balanced"}, stats["sites"]
    assert abs(loss.item() - ref_loss.item()) <= abs(eager_loss.item() - ref_loss.item()) + 1e-6
    for mine, theirs, want in zip(grads, eager, ref):
        assert mine.dtype == want.dtype
        assert rel_l2(mine, want) <= rel_l2(theirs, want) + 1e-6


def test_pass_balanced_gemma_style_softcap_and_label_smoothing(no_inductor_caches):
    """Gemma-2's final-logit softcap and a label-smoothed loss, through the pass on the balanced path."""

    class SoftcapHead(Head):
        def forward(self, ids, labels):
            h = torch.tanh(self.proj(self.embed(ids)))
            logits = torch.tanh(self.head(h) / 30.0) * 30.0
            return F.cross_entropy(logits.float().view(-1, self.head.out_features), labels.view(-1),
                                   label_smoothing=0.1)

    torch.manual_seed(0)
    model = SoftcapHead()
    ids, labels = _data()
    want_loss, want = _eager_run(model, ids, labels)
    loss, grads, stats = _compiled_run(model, ids, labels, BALANCED)
    assert {s["path"] for s in stats["sites"]} == {"balanced"}, stats["sites"]
    assert "softcap=30" in stats["sites"][0]["reason"] and "label_smoothing=0.1" in stats["sites"][0]["reason"]
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(grads, want):
        assert rel_l2(mine, theirs) < 1e-5


def test_pass_loss_under_no_grad_after_a_head_with_grad_stays_lean(no_inductor_caches):
    """The head computed with grad, its loss taken under torch.no_grad (an evaluation metric in a training step):
    the loss needs no gradient, so no gradients are computed for it."""

    class MetricHead(Head):
        def forward(self, ids, labels):
            h = torch.tanh(self.proj(self.embed(ids)))
            logits = self.head(h)
            with torch.no_grad():
                metric = F.cross_entropy(logits.float().view(-1, self.head.out_features), labels.view(-1))
            return h.sum() * 0.0 + metric

    torch.manual_seed(0)
    model = MetricHead()
    ids, labels = _data()
    want = model(ids, labels)
    cce_inductor.reset_stats()
    got = torch.compile(model, backend=cce_inductor.make_backend(BALANCED))(ids, labels)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    (site,) = cce_inductor.stats()["sites"]
    assert site["rewritten"] and site["path"] == "lean", site
    assert "lean path: no gradient is needed" in site["reason"], site
