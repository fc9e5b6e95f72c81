"""Tests of ``cce_inductor/_counted_share.py``: how the lean backward picks its products per call, from the share of
rows an earlier call of the same head counted, read without waiting on the device.

* the choice as a table (forced options pass through; no earlier count, unaligned operands and deterministic
  algorithms take cuBLAS; the threshold);
* counts of CPU tensors are read at once, one record per head shape;
* what the op hands the kernels (stubbed, on the CPU): the products, and the low quantile that sizes the counted
  prefix or widens the row-skipping products' blocks;
* on CUDA: the first backward of a head takes cuBLAS, the next ones the counted-prefix products where half the targets
  are ignored (cuBLAS over the counted rows, no host synchronisation) and the row-skipping products alone where three
  quarters are, within the forced options' tolerance of each
  other, and ``stats()`` counts them; a backward where every row counts takes cuBLAS and teaches nothing.
"""

import itertools

import pytest
import torch

import cce_inductor
from cce_inductor import CCEOptions, _counted_share, _planning, paths
from cce_inductor.kernels import _layout
from tests.support.inputs import make_kernel_inputs

AT_MOST = _counted_share.COUNTED_PREFIX_AT_MOST
ROW_SKIPPING = _counted_share.ROW_SKIPPING_AT_MOST
MOVING = _counted_share.MOVING_ROW_SKIPPING_AT_MOST


def _steady(share):
    return _counted_share.Seen(typical=share, low=share)


def _moving(share):
    return _counted_share.Seen(typical=share, low=share - _counted_share.STEADY_SPREAD - 0.05)


@pytest.mark.parametrize(
    "asked, seen, ok, chosen",
    [
        ("cublas", _steady(0.1), True, "cublas"),  # forced: whatever was seen
        ("triton", _steady(1.0), True, "triton"),
        ("triton", None, False, "triton"),  # (the kernels fall back themselves where they cannot skip rows)
        ("auto", None, True, "cublas"),  # the head's first call: nothing seen yet
        ("auto", _steady(0.0), True, "triton"),  # every row ignored: the row-skipping products skip every row
        ("auto", _steady(ROW_SKIPPING), True, "triton"),
        ("auto", _steady(ROW_SKIPPING + 0.01), True, "counted_prefix"),
        ("auto", _moving(ROW_SKIPPING + 0.01), True, "triton"),  # a moving share: row skipping up to 0.6
        ("auto", _moving(MOVING), True, "triton"),
        ("auto", _moving(MOVING + 0.01), True, "counted_prefix"),
        ("auto", _steady(0.5), True, "counted_prefix"),
        ("auto", _steady(AT_MOST), True, "counted_prefix"),
        ("auto", _moving(AT_MOST), True, "counted_prefix"),
        ("auto", _steady(AT_MOST + 0.01), True, "cublas"),
        ("auto", _steady(1.0), True, "cublas"),
        ("auto", _steady(0.0), False, "cublas"),  # C / E rows the tensor-memory accelerator cannot read
    ],
)
def test_products_table(asked, seen, ok, chosen):
    assert _counted_share.products(asked, seen, row_skipping_ok=ok) == chosen


def test_deterministic_algorithms_take_cublas():
    """Bits that must not depend on when an earlier call's count reached the host: cuBLAS every call."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert _counted_share.products("auto", _steady(0.1), row_skipping_ok=True) == "cublas"
        assert _counted_share.products("triton", _steady(0.1), row_skipping_ok=True) == "triton"  # forced stays
    finally:
        torch.use_deterministic_algorithms(was)


def test_cpu_counts_are_read_at_once():
    share = _counted_share.CountedShare()
    assert share.latest() is None
    share.observe(torch.tensor([3], dtype=torch.int32), 12)
    assert share.latest() == 0.25
    share.observe(torch.tensor([12], dtype=torch.int32), 12)
    assert share.latest() == 1.0
    share.observe(torch.tensor([0], dtype=torch.int32), 0)  # no rows: nothing to learn
    assert share.latest() == 1.0


def test_seen_is_the_median_and_a_low_quantile_of_the_last_shares():
    """The choice reads the median of the last 8 shares, the counted prefix their 20th percentile (a prefix too long
    costs cuBLAS's full time per ignored row, one too short the Triton products' ~0.25x extra per counted row)."""
    share = _counted_share.CountedShare()
    assert share.seen() is None
    for count in (50, 75, 25, 100):  # of 100 rows
        share.observe(torch.tensor([count], dtype=torch.int32), 100)
    assert share.seen() == (0.5, 0.25) and share.latest() == 1.0
    for count in (60, 60, 60, 60, 10, 90, 60, 60):  # the first four fall out of the history
        share.observe(torch.tensor([count], dtype=torch.int32), 100)
    assert share.seen() == _counted_share.Seen(typical=0.6, low=0.6)  # sorted: .1 .6 .6 .6 .6 .6 .6 .9
    share.observe(torch.tensor([5], dtype=torch.int32), 100)
    share.observe(torch.tensor([5], dtype=torch.int32), 100)
    assert share.seen() == (0.6, 0.05)


_fresh_vocab = itertools.count(7001)  # head shapes no other test uses


@pytest.mark.parametrize(
    "asked, shares, every_row, products, hint, exact",
    [
        ("auto", [0.5] * 8, False, "prefix", 0.5, False),  # the counted prefix: cuBLAS over the low quantile's rows
        # a moving share: the row-skipping products, their blocks widened by the 20th percentile (the light calls)
        ("auto", [0.5, 0.75, 0.25, 0.33, 0.42, 0.5, 0.58, 0.67], False, "triton", 0.33, False),
        ("auto", [0.25] * 8, False, "triton", 0.25, False),
        ("auto", [0.25] * 8, False, "triton", 0.25, True),  # exact mode (bf16): the same products
        ("auto", [1.0] * 8, False, "cublas", None, False),  # every row counted: no prefix
        ("triton", [0.25] * 8, False, "triton", None, False),  # forced: the narrow blocks, not sized by earlier calls
        ("auto", [0.25] * 8, True, "cublas", None, False),  # a gradient for every row's lse: every row counts
    ],
)
def test_dispatch_passes_the_kernels_what_the_earlier_calls_counted(
    monkeypatch, asked, shares, every_row, products, hint, exact
):
    """``_dispatch.backward`` with the kernels stubbed (CPU): the products it hands them, and the hint, the 20th
    percentile of the head's last shares, that sizes the counted prefix or widens the row-skipping products' G blocks
    (``kernels/_backward.py``, ``row_skipping_widen``), and whether the call's own count is recorded.  Exact mode
    (16-bit operands) runs the lean backward as the default does: the same products and blocks."""
    from types import SimpleNamespace

    from cce_inductor import _dispatch

    vocab = next(_fresh_vocab)  # a head shape of its own per case: no other call's shares seen
    head = _counted_share.of_head(torch.device("cpu"), vocab, 16)
    for s in shares:
        head.observe(torch.tensor([round(100 * s)], dtype=torch.int32), 100)
    got = {}

    def backward(*args, products, counted_hint, observe_counted, block_width, **kwargs):
        got.update(products=products, hint=counted_hint, observes=observe_counted is not None, block_width=block_width)
        return None, None, None

    kernels = SimpleNamespace(row_skipping_ok=lambda e, c: True, backward=backward)
    monkeypatch.setattr(_dispatch, "uses_kernels", lambda device, dtype: True)
    monkeypatch.setattr(_dispatch, "triton_kernels", lambda: kernels)
    dtype = torch.bfloat16 if exact else torch.float32
    e, c, t = torch.zeros(4, 16, dtype=dtype), torch.zeros(vocab, 16, dtype=dtype), torch.zeros(4, dtype=torch.long)
    _dispatch.backward(
        e,
        c,
        t,
        None,
        torch.zeros(4),
        torch.zeros(4),
        softcap=None,
        ignore_index=-100,
        options=CCEOptions(products=asked, exact=exact),
        need_e=True,
        need_c=True,
        need_bias=False,
        grad_lse=torch.zeros(4) if every_row else None,
    )
    assert got["products"] == products
    assert got["hint"] == (None if hint is None else pytest.approx(hint))
    assert got["observes"] == (asked == "auto" and not every_row)
    # the narrow block (the interpreter's layout: no short-batch widening); the row-skipping products after an
    # earlier call widen by their own ceil(0.5 / hint)
    base = _layout.lean_layout()["block_cols"]
    widen = _planning.row_skipping_widen(hint) if products == "triton" and hint is not None else 1
    assert got["block_width"] == min(vocab, base * widen)


@pytest.mark.parametrize(
    "asked, seen, prefix",
    [
        ("auto", None, None),  # the head's first call: every row
        ("auto", _steady(AT_MOST + 0.01), None),  # nearly every row counts: nothing worth compacting
        ("auto", _steady(0.5), 512),  # the low quantile's share in whole 128-row blocks
        ("auto", _moving(0.5), 384),  # (0.5 - 0.15) x 1000 = 350 rows -> 384
        ("auto", _steady(0.0), 0),  # every row ignored: the row-skipping products alone
        ("auto", _steady(0.999), None),
        ("cublas", _steady(0.1), None),  # forced: every row, whatever was seen
        ("triton", None, 0),  # forced: the row-skipping products over every row
    ],
)
def test_balanced_prefix_table(asked, seen, prefix):
    assert _counted_share.balanced_prefix(asked, seen, 1000) == prefix


def test_balanced_prefix_deterministic_takes_every_row():
    torch.use_deterministic_algorithms(True)
    try:
        assert _counted_share.balanced_prefix("auto", _steady(0.5), 1000) is None
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize(
    "asked, shares, can_skip, prefix, counted",
    [
        ("auto", [], True, None, "every_row"),  # nothing seen: every row, and this call's count recorded
        ("auto", [0.5] * 8, True, 128, "counted_prefix"),
        ("auto", [0.5] * 8, False, None, "cannot_skip"),  # a bias gradient, autocast, fp32: said in stats()
        ("triton", [], False, None, "cannot_skip"),  # forced, where the kernels cannot skip rows
        ("auto", [1.0] * 8, False, None, "every_row"),  # nothing to skip: not a miss
        ("cublas", [0.5] * 8, True, None, "every_row"),
    ],
)
def test_dispatch_hands_the_balanced_kernels_the_counted_prefix(monkeypatch, asked, shares, can_skip, prefix, counted):
    """``_dispatch.loss_and_grads`` with the kernels stubbed (CPU): the counted prefix it hands the balanced kernels
    (the 20th percentile of the head's last shares, in 128-row blocks), whether it has the call's count recorded,
    and what ``stats()['balanced_rows']`` counts."""
    from types import SimpleNamespace

    from cce_inductor import _dispatch

    vocab = next(_fresh_vocab)
    head = _counted_share.of_head(torch.device("cpu"), vocab, 16)
    for s in shares:
        head.observe(torch.tensor([round(256 * s)], dtype=torch.int32), 256)
    got = {}

    def loss_and_grads(*args, counted_prefix_rows, observe_counted, **kwargs):
        got.update(prefix=counted_prefix_rows, observes=observe_counted is not None)
        return (None,) * 6

    kernels = SimpleNamespace(
        balanced_row_skipping_ok=lambda e, c, compute_dtype, need_bias: can_skip, loss_and_grads=loss_and_grads
    )
    monkeypatch.setattr(_dispatch, "uses_kernels", lambda device, dtype: True)
    monkeypatch.setattr(_dispatch, "triton_kernels", lambda: kernels)
    cce_inductor.reset_stats()
    e, c, t = torch.zeros(256, 16), torch.zeros(vocab, 16), torch.zeros(256, dtype=torch.long)
    _dispatch.loss_and_grads(
        e,
        c,
        t,
        None,
        softcap=None,
        ignore_index=-100,
        reduction="mean",
        label_smoothing=0.0,
        chunk_rows=256,
        plain_sum=False,
        de_pair=True,
        need_e=True,
        need_c=True,
        need_bias=False,
        products=asked,
    )
    assert got == {"prefix": prefix, "observes": asked == "auto"}
    stats = cce_inductor.stats()
    rows = stats["balanced_rows"]
    kinds = ("every_row", "counted_prefix", "cannot_skip", "lean_after_oom")
    assert rows == {kind: int(kind == counted) for kind in kinds}, rows
    assert ("could not skip" in stats["summary"]) == (counted == "cannot_skip")


def test_one_record_per_head_shape():
    cpu = torch.device("cpu")
    first = _counted_share.of_head(cpu, 1001, 64)
    assert _counted_share.of_head(cpu, 1001, 64) is first
    assert _counted_share.of_head(cpu, 1002, 64) is not first
    assert _counted_share.of_head(cpu, 1001, 32) is not first


def test_options_default_and_validation():
    assert CCEOptions().products == "auto"
    assert CCEOptions.decode(CCEOptions(products="cublas").encode()).products == "cublas"
    with pytest.raises(ValueError, match="'auto', 'cublas' or 'triton'"):
        CCEOptions(products="cutlass")


def test_lean_record_says_how_products_are_chosen():
    gemma2 = paths.HeadFacts(
        rows=8192, hidden=2304, vocab=256000, element_size=2, kernels=True, reduction="mean", needs_grad=True
    )
    assert "counted rows only" in paths.choose(gemma2, path="lean").reason
    assert "counted rows only" in paths.choose(gemma2, exact=True).reason
    assert "counted rows only" not in paths.choose(gemma2, path="lean", products="cublas").reason
    assert "counted rows only" not in paths.choose(gemma2).reason  # the default: balanced
    no_grad = paths.HeadFacts(**{**gemma2.__dict__, "needs_grad": False})
    assert "counted rows only" not in paths.choose(no_grad).reason  # no backward
    cpu = paths.HeadFacts(**{**gemma2.__dict__, "kernels": False})
    assert "counted rows only" not in paths.choose(cpu).reason  # the chunked path has no such products


def _grads(e, c, targets, options):
    e, c = e.detach().requires_grad_(), c.detach().requires_grad_()
    loss = cce_inductor.linear_cross_entropy(e, c, targets, options=CCEOptions(path="lean", **options))
    loss.backward()
    return loss.detach(), e.grad, c.grad


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("ignore_frac, later", [(0.5, "counted_prefix"), (0.75, "row_skipping"), (0.0, "cublas")])
def test_cuda_auto_follows_the_earlier_calls_share(ignore_frac, later):
    # a head shape of its own, so that no other test's calls were seen first
    vocab = 8192 + {0.0: 0, 0.5: 64, 0.75: 192}[ignore_frac]
    e, c, targets, _ = make_kernel_inputs(1024, vocab, 256, torch.bfloat16, "cuda", ignore_frac=ignore_frac, bias=False)
    forced = {kind: _grads(e, c, targets, {"products": kind}) for kind in ("cublas", "triton")}
    cce_inductor.reset_stats()
    first = _grads(e, c, targets, {})
    torch.cuda.synchronize()  # (the test's own wait: the op's read of the count never waits)
    torch.cuda.set_sync_debug_mode("error")
    try:
        second, third = _grads(e, c, targets, {}), _grads(e, c, targets, {})
    finally:
        torch.cuda.set_sync_debug_mode(0)
    counts = cce_inductor.stats()["backward_products"]
    assert counts == {
        "cublas": 1 + 2 * (later == "cublas"),
        "row_skipping": 2 * (later == "row_skipping"),
        "counted_prefix": 2 * (later == "counted_prefix"),
    }, counts
    for x, y in zip(first, forced["cublas"]):
        assert torch.equal(x, y)  # the first call: cuBLAS products, bitwise
    for x, y in zip(second, third):
        assert torch.equal(x, y)  # the same choice twice: the same bits
    for x, y in zip(second, forced["cublas"]):  # the products' summation order only: both ~2e-3 from fp32 logits'
        assert float((x.float() - y.float()).norm() / y.float().norm()) < 5e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_every_row_calls_take_cublas_and_teach_nothing():
    """A backward with a gradient for every row's log-sum-exp (a z-loss, per-token log-probs) counts every row: it
    takes cuBLAS whatever was seen, and leaves the head's share to the calls that can skip rows."""
    from cce_inductor import _dispatch

    e, c, targets, _ = make_kernel_inputs(1024, 8192 + 128, 256, torch.bfloat16, "cuda", ignore_frac=0.5, bias=False)
    share = _counted_share.of_head(e.device, c.shape[0], c.shape[1])
    share.observe(torch.tensor([256], dtype=torch.int32, device="cuda"), 1024)
    torch.cuda.synchronize()
    assert share.latest() == 0.25
    lse = torch.zeros(1024, device="cuda")
    cce_inductor.reset_stats()
    for grad_lse in (torch.ones(1024, device="cuda"), None):
        _dispatch.backward(
            e,
            c,
            targets,
            None,
            lse,
            torch.full((1024,), 1e-3, device="cuda"),
            softcap=None,
            ignore_index=-100,
            options=CCEOptions(),
            need_e=True,
            need_c=True,
            need_bias=False,
            grad_lse=grad_lse,
        )
        torch.cuda.synchronize()
    assert cce_inductor.stats()["backward_products"] == {"cublas": 1, "row_skipping": 1, "counted_prefix": 0}
    assert share.latest() == float((targets != -100).sum()) / 1024  # the second call's count, not the first's 1.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_balanced_path_skips_rows_after_the_first_call():
    """The balanced path with half the targets ignored: the first call multiplies every row; the next ones compact the
    rows, cuBLAS over the counted prefix and the row-skipping products past it, with no host synchronisation, within
    the products' summation order of the forced every-row call, and ``stats()`` counts them."""
    vocab = 8192 + 320  # a head shape of its own
    e, c, targets, _ = make_kernel_inputs(2048, vocab, 256, torch.bfloat16, "cuda", ignore_frac=0.5, bias=False)

    def grads(products):
        x, w = e.detach().requires_grad_(), c.detach().requires_grad_()
        options = CCEOptions(path="balanced", products=products)
        loss = cce_inductor.linear_cross_entropy(x, w, targets, options=options)
        loss.backward()
        return loss.detach(), x.grad, w.grad

    every = grads("cublas")
    cce_inductor.reset_stats()
    grads("auto")
    torch.cuda.synchronize()  # (the test's own wait: the op's read of the count never waits)
    torch.cuda.set_sync_debug_mode("error")
    try:
        second = grads("auto")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert cce_inductor.stats()["balanced_rows"] == {
        "every_row": 1,
        "counted_prefix": 1,
        "cannot_skip": 0,
        "lean_after_oom": 0,
    }
    for x, y in zip(second, every):
        assert float((x.float() - y.float()).norm() / y.float().norm()) < 5e-3
