"""Bad input gets eager's error, and the edges get eager's numbers (``cce_inductor/_checks.py``: the argument checks
of the public function and of the ops, and autocast), calling the op directly and through the pass:

* argument errors: the exception type and message for every bad shape, dtype, device, reduction, softcap, label
  smoothing, option and target;
* out-of-range targets raise eager's ``IndexError: Target X is out of bounds.`` (direct op and compiled); int32
  targets raise where eager raises;
* NaN / Inf in the inputs propagate exactly where eager puts them; empty batches (N = 0);
* CPU autocast (bf16), on and off.

Compiled runs through the real backend turn Inductor's caches off (the ``no_inductor_caches`` fixture): a cache hit
skips the pass, so ``cce_inductor.stats()`` would not see the rewrite.

Regressions of bugs found here keep a test each (a ``Regression`` comment, or int32 targets: eager raises, compiled
computed).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cce_inductor
from cce_inductor import _checks
from tests.support.compare import assert_same_run, run
from tests.support.head import REDUCTIONS, V, compile_capture, inputs, make_fn
from tests.support.inputs import make_op_inputs
from tests.support.reference import eager_loss

lce = cce_inductor.linear_cross_entropy


# ----------------------------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("label_smoothing", [-0.1, 1.5])
def test_label_smoothing_out_of_range_is_value_error(label_smoothing):
    e, c, t, _ = make_op_inputs((6,), 10, 4, torch.float32)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\]"):
        lce(e, c, t, label_smoothing=label_smoothing)


def _small():
    e, c, t, b = make_op_inputs((6,), 10, 4, torch.float32, bias=True, ignore="none")
    return e, c, t, b


@pytest.mark.parametrize("bad", [10, 11, -1, -101])
def test_target_out_of_range_is_index_error(bad):
    e, c, t, _ = _small()
    t = t.clone()
    t[3] = bad
    with pytest.raises(IndexError, match="out of bounds"):
        eager_loss(e, c, t)
    with pytest.raises(IndexError, match=f"Target {bad} is out of bounds"):
        lce(e, c, t)


def test_target_range_check_on_traced_targets_is_a_device_assert():
    """Where the targets' values are unknown (a fake tensor: AOTAutograd tracing the vocabulary-parallel loss, which
    some torch releases trace without ``torch.compiler.is_compiling()`` set), the range check is an async assert, not
    a Python branch on their values (which would raise a data-dependent error and fail the compile)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        targets = torch.randint(0, 10, (8,))
        assert not torch.compiler.is_compiling()
        _checks.check_target_range(targets, 10, -100)  # a Python branch here raises DataDependentOutputException


def test_target_equal_to_ignore_index_is_fine_even_out_of_vocab():
    e, c, t, _ = _small()
    t = t.clone()
    t[2] = 1000
    torch.testing.assert_close(lce(e, c, t, ignore_index=1000), eager_loss(e, c, t, ignore_index=1000))


@pytest.mark.parametrize(
    "case, exc, match",
    [
        ("c_3d", ValueError, r"c of shape \(V, D\)"),
        ("targets_shape", ValueError, r"targets must have shape \(6,\)"),
        ("targets_2d", ValueError, r"targets must have shape"),
        ("e_0d", ValueError, r"e of shape"),
        ("c_dtype", TypeError, r"c has dtype torch.float64 but e has torch.float32"),
        ("bias_dtype", TypeError, r"bias has dtype torch.float16"),
        ("bias_2d", ValueError, r"bias of shape \(V,\)"),
        ("int_inputs", TypeError, r"unsupported dtype"),
        ("reduction", ValueError, r"reduction must be one of"),
        ("softcap_zero", ValueError, r"softcap must be positive"),
        ("softcap_negative", ValueError, r"softcap must be positive"),
        ("options", TypeError, r"options must be a cce_inductor.CCEOptions"),
        ("retired_option", TypeError, r"unexpected keyword argument 'filter_eps'"),
    ],
)
def test_bad_input_errors(case, exc, match):
    e, c, t, b = _small()
    call = {
        "c_3d": lambda: lce(e, c[None], t),
        "targets_shape": lambda: lce(e, c, t[:-1]),
        "targets_2d": lambda: lce(e, c, t[:, None]),
        "e_0d": lambda: lce(e[0, 0], c, t),
        "c_dtype": lambda: lce(e, c.double(), t),
        "bias_dtype": lambda: lce(e, c, t, bias=b.half()),
        "bias_2d": lambda: lce(e, c, t, bias=b[None]),
        "int_inputs": lambda: lce(e.long(), c.long(), t),
        "reduction": lambda: lce(e, c, t, reduction="avg"),
        "softcap_zero": lambda: lce(e, c, t, softcap=0.0),
        "softcap_negative": lambda: lce(e, c, t, softcap=-2.0),
        "options": lambda: lce(e, c, t, options={"exact": True}),
        "retired_option": lambda: lce(e, c, t, filter_eps=1.5),
    }[case]
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool], ids=str)
def test_non_integer_targets_are_rejected(dtype):
    # Regression: the public wrapper called `targets.reshape(-1).long()` before the op's dtype check, so float /
    # bool targets were silently truncated to class indices (2.7 -> 2, True -> 1) and a wrong loss returned
    # (eager F.cross_entropy reads float targets as probabilities).
    e, c, t, _ = _small()
    with pytest.raises(TypeError, match="targets must hold class indices"):
        lce(e, c, t.to(dtype))


@pytest.mark.parametrize(
    "case, match",
    [("hidden_size", r"hidden size mismatch"), ("bias_len", r"bias has 11 entries")],
)
def test_shape_mismatch_is_value_error(case, match):
    # Regression (consistency): a hidden-size mismatch or a bias of the wrong length raised RuntimeError (from
    # `torch._check`) while every other bad shape raises ValueError; now `torch._check_value`.
    e, c, t, b = _small()
    call = {
        "hidden_size": lambda: lce(e, torch.randn(10, 5), t),
        "bias_len": lambda: lce(e, c, t, bias=torch.randn(11)),
    }[case]
    with pytest.raises(ValueError, match=match):
        call()


def test_device_mismatch_is_value_error():
    e, c, t, _ = _small()
    with pytest.raises(ValueError, match="targets is on meta"):
        _checks.check_inputs(e, c, t.to("meta"), None)


# ----------------------------------------------------------------------------------------------------------------
# Bad input: targets out of range
# ----------------------------------------------------------------------------------------------------------------


BAD_TARGETS = [  # (bad target, ignore_index): never the ignore_index, outside [0, V)
    (V, -100),
    (V + 5, -100),
    (-5, -100),
    (-1, -100),
    (-100, 0),  # -100 is not ignored when ignore_index is 0
    (-100, 5),  # ... nor when ignore_index is inside the vocabulary
    (V + 1, V),  # ignore_index == V is fine, V + 1 is not
]


def _eager_error(fn, args) -> BaseException:
    with pytest.raises(Exception) as info:
        fn(*args)
    return info.value


def _with_bad_target(bad, ignore_index, reduction, dtype=torch.float32):
    hidden, weight, labels = inputs(6, dtype=dtype, ignore_index=ignore_index)
    labels[3] = bad
    return hidden, weight, labels


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("bad,ignore_index", BAD_TARGETS)
def test_out_of_range_target_direct_op_raises_like_eager(bad, ignore_index, reduction):
    hidden, weight, labels = _with_bad_target(bad, ignore_index, reduction)
    want = _eager_error(make_fn(ignore_index=ignore_index, reduction=reduction), (hidden, weight, labels))
    assert type(want) is IndexError and str(want) == f"Target {bad} is out of bounds."  # eager's contract
    with pytest.raises(IndexError) as got:
        lce(hidden, weight, labels, ignore_index=ignore_index, reduction=reduction)
    assert str(got.value) == str(want)


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("bad,ignore_index", BAD_TARGETS[:1] + BAD_TARGETS[2:5])
def test_out_of_range_target_compiled_raises_like_eager(bad, ignore_index, reduction, softcap):
    hidden, weight, labels = _with_bad_target(bad, ignore_index, reduction)
    fn = make_fn(softcap=softcap, ignore_index=ignore_index, reduction=reduction)
    want = _eager_error(fn, (hidden, weight, labels))
    compiled, capture = compile_capture(fn)
    with pytest.raises(type(want)) as got:
        compiled(hidden, weight, labels)
    assert capture.rewrites == [1]
    assert str(got.value) == str(want)


@pytest.mark.slow
@pytest.mark.parametrize("bad,ignore_index", [(V, -100), (-100, 0)])
def test_out_of_range_target_through_inductor_raises_like_eager(no_inductor_caches, bad, ignore_index):
    hidden, weight, labels = _with_bad_target(bad, ignore_index, "mean")
    fn = make_fn(ignore_index=ignore_index)
    want = _eager_error(fn, (hidden, weight, labels))
    compiled = torch.compile(fn, backend=cce_inductor.backend, fullgraph=True)
    good = labels.clone()
    good[3] = 0
    assert_same_run(run(compiled, (hidden, weight, good)), run(fn, (hidden, weight, good)))  # compiles, works
    with pytest.raises(type(want)) as got:
        compiled(hidden, weight, labels)  # the same compiled code, now with a bad target
    assert str(got.value) == str(want)
    assert cce_inductor.stats()["rewritten"] == 1


def test_int32_targets_raise_like_eager():
    hidden, weight, labels = inputs(6)
    labels = labels.int()
    fn = make_fn()
    want = _eager_error(fn, (hidden, weight, labels))
    assert type(want) is RuntimeError and "expected target dtype to be Long" in str(want)
    compiled, capture = compile_capture(fn)
    try:
        compiled(hidden, weight, labels)
    except RuntimeError as got:
        assert "expected target dtype to be Long" in str(got)
    else:
        raise AssertionError(f"eager raises {want!r}; the compiled model (rewrites: {capture.rewrites}) does not")


# ----------------------------------------------------------------------------------------------------------------
# Operands eager refuses: dtypes autocast does not reconcile, devices
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "hidden, weight, bias, autocast, refused",
    [
        (torch.float32, torch.float32, None, None, False),
        (torch.float32, torch.bfloat16, None, None, True),
        (torch.bfloat16, torch.float16, None, None, True),
        (torch.float32, torch.float32, torch.bfloat16, None, True),
        (torch.float64, torch.float32, None, None, True),
        (torch.float32, torch.bfloat16, None, torch.bfloat16, False),
        (torch.bfloat16, torch.float16, torch.float32, torch.bfloat16, False),
        (torch.float64, torch.float32, None, torch.bfloat16, True),
        (torch.float64, torch.float64, None, torch.bfloat16, False),
    ],
)
def test_head_dtype_error_follows_eager(hidden, weight, bias, autocast, refused):
    """Eager's linear / matmul / addmm: one dtype for every operand, after autocast cast fp16 / bf16 / fp32 ones."""
    why = _checks.head_dtype_error(hidden, weight, bias, autocast)
    assert (why is not None) == refused, why
    if refused:
        assert why.startswith("the head's operands have two dtypes (hidden states ") and "eager raises" in why


def _linear_head(h, w, y):
    return F.cross_entropy(F.linear(h, w).float(), y)


def _linear_head_with_bias(h, w, b, y):
    return F.cross_entropy(F.linear(h, w, b).float(), y)


def _matmul_head(h, w, y):
    return F.cross_entropy((h @ w.T).float(), y)


def _addmm_head(h, w, b, y):
    return F.cross_entropy(torch.addmm(b, h, w.t()).float(), y)


def _autocast_off_inside(h, w, y):
    with torch.autocast("cpu", enabled=False):
        logits = F.linear(h, w)
    return F.cross_entropy(logits.float(), y)


def _dtype_case(dtypes, with_bias):
    hidden, weight, labels, bias = inputs(6, bias=True)
    tensors = [hidden.detach().to(dtypes[0]), weight.detach().to(dtypes[1])]
    if with_bias:
        tensors.append(bias.detach().to(dtypes[2]))
    return tuple(tensors) + (labels,)


EAGER_REFUSES = {  # name: (fn, (hidden, weight, bias) dtypes), run without autocast unless the name says so
    "fp32_hidden_bf16_weight": (_linear_head, (torch.float32, torch.bfloat16)),
    "bf16_hidden_fp16_weight": (_linear_head, (torch.bfloat16, torch.float16)),
    "bias_of_another_dtype": (_linear_head_with_bias, (torch.float32, torch.float32, torch.bfloat16)),
    "matmul_fp32_hidden_bf16_weight": (_matmul_head, (torch.float32, torch.bfloat16)),
    "addmm_bias_of_another_dtype": (_addmm_head, (torch.float32, torch.float32, torch.float16)),
    "autocast_off_inside_autocast": (_autocast_off_inside, (torch.float32, torch.bfloat16)),
}


@pytest.mark.parametrize("case", list(EAGER_REFUSES))
def test_operand_dtypes_eager_refuses_are_left_to_eager(case):
    """Regression (issue 55): the rewrite computed in the head's dtype, upcasting the odd operand, and returned a loss
    where eager raises ``expected m1 and m2 to have the same dtype``. Now the site is left alone and eager's error is
    the compiled code's."""
    fn, dtypes = EAGER_REFUSES[case]
    args = _dtype_case(dtypes, with_bias=len(dtypes) == 3)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.startswith("autocast")):
        want = _eager_error(fn, args)
        compiled, capture = compile_capture(fn)
        with pytest.raises(type(want)) as got:
            compiled(*args)
    assert str(got.value) == str(want)
    assert capture.rewrites == [0]
    (reason,) = cce_inductor.stats()["reasons"]
    assert "the head's operands have two dtypes" in reason and "eager raises" in reason, reason


@pytest.mark.slow
def test_fp32_hidden_bf16_weight_through_inductor_raises_like_eager(no_inductor_caches):
    fn, dtypes = EAGER_REFUSES["fp32_hidden_bf16_weight"]
    args = _dtype_case(dtypes, with_bias=False)
    want = _eager_error(fn, args)
    with pytest.raises(type(want), match="expected m1 and m2 to have the same dtype"):
        torch.compile(fn, backend=cce_inductor.backend, fullgraph=True)(*args)
    assert cce_inductor.stats()["rewritten"] == 0


AUTOCAST_RECONCILES = {  # under CPU bf16 autocast eager casts every operand: rewritten, with eager's numbers
    "fp32_hidden_bf16_weight": (_linear_head, (torch.float32, torch.bfloat16)),
    "bf16_hidden_fp32_weight": (_matmul_head, (torch.bfloat16, torch.float32)),
    "fp16_hidden_and_weight": (_linear_head, (torch.float16, torch.float16)),
    "bias_of_another_dtype": (_linear_head_with_bias, (torch.float32, torch.float32, torch.float16)),
}


@pytest.mark.parametrize("case", list(AUTOCAST_RECONCILES))
def test_operand_dtypes_autocast_reconciles_are_rewritten(case):
    fn, dtypes = AUTOCAST_RECONCILES[case]
    args = _dtype_case(dtypes, with_bias=len(dtypes) == 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = fn(*args)
        compiled, capture = compile_capture(fn)
        got = compiled(*args)
    assert capture.rewrites == [1], cce_inductor.stats()["reasons"]
    torch.testing.assert_close(got, want, **AUTOCAST_TOL)


def test_head_on_two_devices_is_left_alone():
    """Dynamo refuses a head on two devices while tracing (below), so the pass never sees one; should it, the walk
    leaves it to eager's error rather than moving an operand. A graph as Dynamo records it, example values on a
    CUDA device (fake: no GPU needed) but for the bias."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cce_inductor.fx_passes.head_chain import NoMatch, walk_logits

    graph = torch.fx.Graph()
    h, w, b, y = (graph.placeholder(name) for name in ("h", "w", "b", "y"))
    linear = graph.call_function(torch._C._nn.linear, (h, w, b))
    ce = graph.call_function(F.cross_entropy, (linear, y))
    graph.output((ce,))
    with FakeTensorMode():
        values = {
            h: torch.empty(6, 7, device="cuda"),
            w: torch.empty(V, 7, device="cuda"),
            b: torch.empty(V),
            y: torch.empty(6, dtype=torch.long, device="cuda"),
            linear: torch.empty(6, V, device="cuda"),
            ce: torch.empty((), device="cuda"),
        }
    for node, value in values.items():
        node.meta["example_value"] = value
    with pytest.raises(NoMatch, match="the head's bias on cpu, its output on cuda"):
        walk_logits(linear, ce)


def test_targets_on_another_device_fail_as_stock_torch_compile():
    """Targets on another device than the logits: Dynamo's tracing raises before any pass runs, with our backend as
    with Inductor's."""
    hidden, weight, labels = (t.detach() for t in inputs(6))
    errors = []
    for backend in ("inductor", cce_inductor.backend):
        torch._dynamo.reset()
        with pytest.raises(Exception, match="Expected all tensors to be on the same device") as info:
            torch.compile(make_fn(), backend=backend, fullgraph=True)(hidden, weight, labels.to("meta"))
        errors.append(type(info.value))
    assert errors[0] is errors[1]
    assert cce_inductor.stats()["graphs"] == 0


# ----------------------------------------------------------------------------------------------------------------
# Bad input: NaN and Inf
# ----------------------------------------------------------------------------------------------------------------


POISON = {  # where, what: a NaN/Inf in one place of the inputs
    "hidden_nan": ("hidden", (1, 2), float("nan")),
    "hidden_inf": ("hidden", (1, 2), float("inf")),
    "hidden_-inf": ("hidden", (2, 0), float("-inf")),
    "hidden_inf_and_-inf": ("hidden", [(1, 2), (1, 3)], [float("inf"), float("-inf")]),
    "ignored_row_nan": ("hidden", (1, 0), float("nan")),  # row 1 is ignored
    "weight_nan": ("weight", (4, 1), float("nan")),
    "weight_inf": ("weight", (4, 1), float("inf")),
    "bias_inf": ("bias", (4,), float("inf")),
    "bias_-inf": ("bias", (4,), float("-inf")),
    "bias_-inf_target": ("bias", "target", float("-inf")),  # -inf logit exactly at a target
}


def _poisoned(case: str, seed=0):
    hidden, weight, labels, bias = inputs(6, bias=True, seed=seed)
    which, index, value = POISON[case]
    tensor = {"hidden": hidden, "weight": weight, "bias": bias}[which]
    with torch.no_grad():
        if index == "target":
            index = (int(labels[0]),)
        for i, v in zip(index if isinstance(index, list) else [index], value if isinstance(value, list) else [value]):
            tensor[i] = v
    return hidden, weight, labels, bias


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", list(POISON))
def test_nan_inf_propagate_as_in_eager_direct_op(case, reduction, softcap):
    hidden, weight, labels, bias = _poisoned(case)
    want = run(make_fn(softcap=softcap, reduction=reduction, bias=True), (hidden, weight, labels, bias))
    got = run(
        lambda h, w, y, b: lce(h, w, y, bias=b, softcap=softcap, reduction=reduction), (hidden, weight, labels, bias)
    )
    assert_same_run(got, want)


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", list(POISON))
def test_nan_inf_propagate_as_in_eager_compiled(case, reduction, softcap):
    hidden, weight, labels, bias = _poisoned(case)
    fn = make_fn(softcap=softcap, reduction=reduction, bias=True)
    want = run(fn, (hidden, weight, labels, bias))
    compiled, capture = compile_capture(fn)
    got = run(compiled, (hidden, weight, labels, bias))
    assert capture.rewrites == [1]
    assert_same_run(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("case,reduction", [("hidden_nan", "none"), ("hidden_inf_and_-inf", "mean")])
def test_nan_inf_propagate_as_in_eager_through_inductor(no_inductor_caches, case, reduction):
    hidden, weight, labels, bias = _poisoned(case)
    fn = make_fn(softcap=3.0, reduction=reduction, bias=True)
    want = run(fn, (hidden, weight, labels, bias))
    got = run(torch.compile(fn, backend=cce_inductor.backend, fullgraph=True), (hidden, weight, labels, bias))
    assert cce_inductor.stats()["rewritten"] == 1
    assert_same_run(got, want)


# ----------------------------------------------------------------------------------------------------------------
# Empty batches
# ----------------------------------------------------------------------------------------------------------------


EMPTY_EXPECTED = {"mean": "nan", "sum": 0.0, "none": (0,)}


def _check_empty_result(out: torch.Tensor, reduction: str):
    expected = EMPTY_EXPECTED[reduction]
    if expected == "nan":
        assert out.shape == () and out.isnan(), out
    elif reduction == "sum":
        assert out.shape == () and out.item() == 0.0, out
    else:
        assert out.shape == expected, out.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_empty_batch_direct_op(reduction, dtype):
    hidden, weight, labels = inputs(0, dtype=dtype)
    want = run(make_fn(reduction=reduction), (hidden, weight, labels))
    _check_empty_result(want[0], reduction)
    got = run(lambda h, w, y: lce(h, w, y, reduction=reduction).to(want[0].dtype), (hidden, weight, labels))
    assert_same_run(got, want)


@pytest.mark.parametrize("softcap", [None, 7.0])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("lead", [(0,), (2, 0), (0, 3)])
def test_empty_batch_compiled(lead, reduction, softcap):
    hidden, weight, labels = inputs(dtype=torch.float32, lead=lead)
    fn = make_fn(softcap=softcap, reduction=reduction)
    want = run(fn, (hidden, weight, labels))
    _check_empty_result(want[0], reduction)
    compiled, capture = compile_capture(fn)
    got = run(compiled, (hidden, weight, labels))
    assert capture.rewrites == [1]
    assert_same_run(got, want)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_empty_after_label_shift_compiled(reduction):
    """Sequence length 1: the HF shift leaves no token at all."""

    def fn(hidden, weight, labels):
        logits = F.linear(hidden, weight)[..., :-1, :].contiguous()
        return F.cross_entropy(logits.view(-1, V), labels[..., 1:].contiguous().view(-1), reduction=reduction)

    hidden, weight, labels = inputs(lead=(3, 1))
    want = run(fn, (hidden, weight, labels))
    _check_empty_result(want[0], reduction)
    compiled, capture = compile_capture(fn)
    got = run(compiled, (hidden, weight, labels))
    assert capture.rewrites == [1]
    assert_same_run(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_empty_batch_through_inductor(no_inductor_caches, reduction):
    hidden, weight, labels = inputs(0)
    fn = make_fn(reduction=reduction)
    want = run(fn, (hidden, weight, labels))
    got = run(torch.compile(fn, backend=cce_inductor.backend, fullgraph=True), (hidden, weight, labels))
    assert_same_run(got, want)
    assert cce_inductor.stats()["rewritten"] == 1


# ----------------------------------------------------------------------------------------------------------------
# Autocast
# ----------------------------------------------------------------------------------------------------------------


AUTOCAST_TOL = dict(rtol=2e-2, atol=2e-2)  # eager rounds the logits to bf16; the op accumulates in fp32


@pytest.mark.parametrize("inside", [False, True], ids=["autocast_outside", "autocast_inside"])
@pytest.mark.parametrize("enabled", [True, False], ids=["on", "off"])
def test_autocast_cpu_bf16_capture(enabled, inside):
    inner = make_fn(softcap=20.0, bias=True)
    if inside:

        def fn(*args):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
                return inner(*args)
    else:
        fn = inner
    args = inputs(10, bias=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled and not inside):
        want = run(fn, args)
        compiled, capture = compile_capture(fn)
        got = run(compiled, args)
    assert capture.rewrites == [1]
    assert want[0].dtype == torch.float32  # cross_entropy runs in fp32 under autocast
    assert_same_run(got, want, **(AUTOCAST_TOL if enabled else {}))


@pytest.mark.slow
@pytest.mark.parametrize("enabled", [True, False], ids=["on", "off"])
def test_autocast_cpu_bf16_through_inductor(no_inductor_caches, enabled):
    fn = make_fn(softcap=20.0, bias=True)
    args = inputs(10, bias=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
        want = run(fn, args)
        got = run(torch.compile(fn, backend=cce_inductor.backend, fullgraph=True), args)
    assert cce_inductor.stats()["rewritten"] == 1
    assert_same_run(got, want, **(AUTOCAST_TOL if enabled else dict(rtol=1e-5, atol=1e-5)))
