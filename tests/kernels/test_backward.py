"""Tests of ``cce_inductor.kernels.backward`` (``kernels/_backward.py``) against the fp64 reference (the harness and
its tolerances: ``tests/support/kernels.py``):

* the ``need_*`` flags and a missing bias;
* the backward is bitwise reproducible, and its chunking (``options.backward_row_chunk`` and the vocabulary
  block, ``LEAN_LAYOUT["block_cols"]``, monkeypatched) changes only rounding;
* rows whose target is ``ignore_index`` are skipped (whole row blocks of them too) with eager's NaN pattern;
* with CUDA, a ``gpu`` set: real LM-head shapes, and no host synchronisation.
"""

import pytest
import torch

import cce_inductor.kernels as K
from cce_inductor import CCEOptions, _planning, paths
from cce_inductor.kernels import _backward, _backward_launch, _layout
from tests.support.inputs import IGNORE, make_kernel_inputs
from tests.support.kernels import (
    DEVICES,
    LEAN_LAYOUT,
    LSE_TOL,
    OPTION_SETS,
    TUNING_KEY,
    check_grad,
    device_ok,
    eager_grads,
    mean_grad_rows,
    plan_for,
    reference,
    rel,
    requires_cuda,
    run_kernels,
)
from tests.support.kernels import backward as kbackward


@pytest.mark.parametrize("opts", list(OPTION_SETS.values()), ids=list(OPTION_SETS))
@pytest.mark.parametrize("device", DEVICES)
def test_need_flags_and_no_bias(device, opts):
    device_ok(device)
    e, c, targets, b = make_kernel_inputs(20, 70, 16, torch.bfloat16, device, bias=True)
    g = mean_grad_rows(targets)
    _, _, (de, dc, db) = run_kernels(
        e, c, targets, b, g, softcap=None, opts=opts, need_e=True, need_c=False, need_bias=False
    )
    assert dc is None and db is None and de is not None
    _, _, (de2, dc2, db2) = run_kernels(
        e, c, targets, b, g, softcap=None, opts=opts, need_e=False, need_c=True, need_bias=True
    )
    assert de2 is None and dc2 is not None and db2 is not None
    _, _, (de3, dc3, db3) = run_kernels(
        e, c, targets, None, g, softcap=None, opts=opts, need_e=True, need_c=True, need_bias=True
    )
    assert db3 is None
    _, _, nothing = run_kernels(
        e, c, targets, b, g, softcap=None, opts=opts, need_e=False, need_c=False, need_bias=False
    )
    assert nothing == (None, None, None)
    _, _, de_r, dc_r, db_r = reference(e, c, targets, b, g, None)
    _, _, de_r3, dc_r3, _ = reference(e, c, targets, None, g, None)
    for got, want in ((de, de_r), (dc2, dc_r), (db2, db_r), (de3, de_r3), (dc3, dc_r3)):
        check_grad(got, want)


@pytest.mark.parametrize("opts", list(OPTION_SETS.values()), ids=list(OPTION_SETS))
@pytest.mark.parametrize("v", [200, 257])
@pytest.mark.parametrize("device", DEVICES)
def test_unaligned_vocabulary_chunks(device, v, opts, monkeypatch):
    """A vocabulary chunk whose width is not a multiple of 64 (V 200 and 257 in chunks of 128: a last chunk of 72
    or 1 entries): its products are split at a multiple of 64 (``_launch.product_into``) and G keeps its aligned
    pitch; the gradients meet the fp64 reference's tolerance, over one row chunk and over several."""
    device_ok(device)
    monkeypatch.setitem(LEAN_LAYOUT, "block_cols", 128)
    e, c, targets, b = make_kernel_inputs(40, v, 16, torch.bfloat16, device, bias=True, ignore_frac=0.2)
    g = mean_grad_rows(targets)
    _, _, *want = reference(e, c, targets, b, g, 5.0)
    for row_chunk in (0, 16):
        chunked = CCEOptions(products=opts.products, backward_row_chunk=row_chunk)
        _, _, got = run_kernels(e, c, targets, b, g, softcap=5.0, opts=chunked)
        for mine, ref in zip(got, want):
            check_grad(mine, ref)


@pytest.mark.parametrize("products", ["cublas", "triton"])
@pytest.mark.parametrize("device", DEVICES)
def test_backward_is_reproducible_and_chunking_invariant(device, products, monkeypatch):
    """The backward has no atomics: two runs agree bitwise.  Its row chunking (``options.backward_row_chunk``) and
    vocabulary chunking (``vocab_chunk``) only change how the products are cut: one block and many blocks agree to
    fp32 rounding (fp32 inputs); with bf16 inputs the chunked backward still meets the fp64 tolerance (dC of
    several row chunks summed in fp32, rounded once)."""
    device_ok(device)
    e, c, targets, b = make_kernel_inputs(45, 170, 24, torch.float32, device, ignore_frac=0.2, bias=True, seed=7)
    g = mean_grad_rows(targets)
    lse, *_ = K.forward(e, c, targets, b, softcap=20.0, ignore_index=IGNORE)
    e16, c16, b16 = e.bfloat16(), c.bfloat16(), b.bfloat16()
    lse16, *_ = K.forward(e16, c16, targets, b16, softcap=20.0, ignore_index=IGNORE)

    def grads(row_chunk=0, sixteen=False):
        args = (e16, c16, targets, b16, lse16) if sixteen else (e, c, targets, b, lse)
        return kbackward(
            *args,
            g,
            softcap=20.0,
            ignore_index=IGNORE,
            opts=CCEOptions(products=products, backward_row_chunk=row_chunk),
            need_e=True,
            need_c=True,
            need_bias=True,
        )

    first, second = grads(), grads()
    for x, y in zip(first, second):
        assert torch.equal(x, y)

    monkeypatch.setitem(LEAN_LAYOUT, "block_cols", 1 << 20)
    whole = grads(row_chunk=0)
    monkeypatch.setitem(LEAN_LAYOUT, "block_cols", 33)  # narrower than a vocabulary block, not a multiple of one
    pieces = grads(row_chunk=7)
    pieces16 = grads(row_chunk=7, sixteen=True)
    for x, y in zip(whole, pieces):
        assert rel(y, x) < 1e-6
    _, _, de_r, dc_r, db_r = reference(e, c, targets, b, g, 20.0)
    for x, ref in zip(whole, (de_r, dc_r, db_r)):
        assert rel(x, ref) < 1e-5
    _, _, de_r, dc_r, db_r = reference(e16, c16, targets, b16, g, 20.0)
    for x, ref in zip(pieces16, (de_r, dc_r, db_r)):
        assert x.dtype == torch.bfloat16
        check_grad(x, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_short_row_chunks_get_wider_vocabulary_blocks(device, monkeypatch):
    """Fewer rows than ``g_block_rows`` in one row chunk: the G block widens to the same bytes (fewer vocabulary
    steps, fewer launches), up to one block over all of V; the gradients are the narrow blocks' to fp32 rounding;
    several row chunks keep the narrow block.  The memory model (``cce_inductor.paths.lean_peak``) assumes the GPU
    tuning's widths."""
    device_ok(device)

    def width(block_cols, block_rows, rows, row_chunk, vocab):
        return _layout.block_width(rows, row_chunk, vocab, layout=dict(block_cols=block_cols, block_rows=block_rows))

    assert width(48, 0, 10, 10, 1000) == 48
    assert width(48, 64, 20, 20, 1000) == 144  # 64 // 20 = 3 blocks' width
    assert width(48, 64, 2, 8192, 1000) == 1000  # at most V
    # several row chunks (backward_row_chunk set to bound memory): narrow, or dC's fp32 chunk sums would grow
    assert width(48, 64, 20, 8, 1000) == 48
    e, c, targets, b = make_kernel_inputs(20, 170, 24, torch.float32, device, ignore_frac=0.2, bias=True, seed=3)
    g = mean_grad_rows(targets)
    lse, *_ = K.forward(e, c, targets, b, softcap=None, ignore_index=IGNORE)
    monkeypatch.setitem(LEAN_LAYOUT, "block_cols", 32)

    def grads(g_block_rows, row_chunk):
        monkeypatch.setitem(LEAN_LAYOUT, "block_rows", g_block_rows)
        return kbackward(
            e,
            c,
            targets,
            b,
            lse,
            g,
            softcap=None,
            ignore_index=IGNORE,
            opts=CCEOptions(backward_row_chunk=row_chunk),
            need_e=True,
            need_c=True,
            need_bias=True,
        )

    for row_chunk in (0, 8):
        narrow = grads(0, row_chunk)
        for g_block_rows in (
            64,
            1 << 12,
        ):  # one row chunk: blocks 3 times wider, one over all of V; 8-row chunks: narrow
            for x, y in zip(grads(g_block_rows, row_chunk), narrow):
                assert rel(x, y) < 1e-6


@pytest.mark.parametrize("device", DEVICES)
def test_recompute_tile_groups_cover_every_tile(device, monkeypatch):
    """The recompute deals its tiles in column groups (``recompute_group`` columns, row block by row block inside
    each), only an order: every group width, one narrower than the block with a narrower last group among them,
    gives the gradients of the ungrouped order bitwise, with G's buffer filled with NaN before each block (a tile
    that no program computed would put NaN into dE / dC).  Ignored row blocks (past the device-side count) take the
    same order."""
    device_ok(device)
    tuning = _backward._TUNING[TUNING_KEY]
    block_v = tuning["block_v"]
    # one G block 5 vocabulary tiles wide, a short last tile: groups of 2 tiles leave a last group of 1
    monkeypatch.setitem(LEAN_LAYOUT, "block_cols", 5 * block_v)
    monkeypatch.setitem(LEAN_LAYOUT, "block_rows", 0)
    n, v, d = (700, 5 * 256 - 100, 64) if TUNING_KEY == "gpu" else (70, 5 * 32 - 9, 24)
    e, c, targets, b = make_kernel_inputs(n, v, d, torch.bfloat16, device, ignore_frac=0.2, bias=True, seed=11)
    targets[n // 2 :] = IGNORE  # whole ignored row blocks past the counted ones
    g = mean_grad_rows(targets)
    lse, *_ = K.forward(e, c, targets, b, softcap=20.0, ignore_index=IGNORE)
    block = _backward_launch._block
    monkeypatch.setattr(_backward_launch, "_block", lambda buf, rows, cols: block(buf.fill_(float("nan")), rows, cols))

    def grads(group_tiles):
        monkeypatch.setitem(tuning, "recompute_group", group_tiles * block_v)
        return kbackward(
            e,
            c,
            targets,
            b,
            lse,
            g,
            softcap=20.0,
            ignore_index=IGNORE,
            need_e=True,
            need_c=True,
            need_bias=True,
        )

    ungrouped = grads(1 << 10)
    assert all(torch.isfinite(x).all() for x in ungrouped)
    for group_tiles in (1, 2, 3, 5):
        for x, y in zip(grads(group_tiles), ungrouped):
            assert torch.equal(x, y), group_tiles


@pytest.mark.parametrize("products", ["cublas", "triton", "prefix"])
@pytest.mark.parametrize("device", DEVICES)
def test_backward_skips_ignored_rows_keeps_eager_nan_pattern(device, products):
    """The backward's recompute skips whole row blocks of ignored rows (compacted on the device) and partly
    ignored blocks alike; the gradients still match the fp64 reference.  NaN lands where eager's log-softmax
    backward puts it through 0 * NaN: an ignored row of E holding a NaN -> dE of that row and all of dC / dbias;
    a NaN in C with every row ignored -> everything (each row's log-sum-exp is NaN).  ``products``: the dE / dC
    products (cuBLAS, or the Triton ones that skip the ignored rows too)."""
    device_ok(device)
    n, v, d = 53, 150, 24
    e, c, targets, b = make_kernel_inputs(n, v, d, torch.float32, device, bias=True, seed=11)
    targets[10:40] = IGNORE  # whole compacted blocks of ignored rows at any block size <= 16
    g = mean_grad_rows(targets)

    def grads(e_in, c_in, targets=targets, g=g):
        if products == "prefix":  # cuBLAS over a prefix shorter than the counted rows, the Triton tail the rest
            lse, *_ = K.forward(e_in, c_in, targets, b, softcap=None, ignore_index=IGNORE)
            return kbackward(
                e_in,
                c_in,
                targets,
                b,
                lse,
                g,
                softcap=None,
                ignore_index=IGNORE,
                opts=CCEOptions(),
                need_e=True,
                need_c=True,
                need_bias=True,
                counted_hint=0.3,
            )
        return run_kernels(e_in, c_in, targets, b, g, softcap=None, opts=CCEOptions(products=products))[2]

    got = grads(e, c)
    _, _, de_r, dc_r, db_r = reference(e, c, targets, b, g, None)
    for x, ref in zip(got, (de_r, dc_r, db_r)):
        assert rel(x, ref) < 1e-5

    e_nan = e.clone()
    e_nan[20, 3] = float("nan")  # an ignored row
    de, dc, db = grads(e_nan, c)
    assert de.isnan().any(dim=1).nonzero().flatten().tolist() == [20]
    assert dc.isnan().all() and db.isnan().all()
    de, dc, db = grads(e, c)
    assert not (de.isnan().any() or dc.isnan().any() or db.isnan().any())
    c_nan = c.clone()
    c_nan[7, 0] = float("nan")
    none_counted = torch.full_like(targets, IGNORE)
    de, dc, db = grads(e, c_nan, none_counted, torch.zeros_like(g))
    assert de.isnan().all() and dc.isnan().all() and db.isnan().all()


@pytest.mark.parametrize("need_bias", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_products_read_only_the_g_positions_stored(device, need_bias, monkeypatch):
    """With G in compacted order (the Triton products, the counted prefix), the recompute stores ignored positions
    only as far as some product reads them: the counted rows' row blocks and the cuBLAS prefix (every row where a
    bias gradient sums G's rows, and for cuBLAS over every row).  G's buffer is filled with NaN before each block,
    so a product reading an unstored position would put NaN into dE / dC: the gradients stay the fp64 reference's,
    whatever the products and the hint (a prefix shorter and longer than the counted rows, the row-skipping
    products' widened blocks, cuBLAS's over a short batch's wider blocks, over one row chunk and several)."""
    device_ok(device)
    tuning = _backward._TUNING[TUNING_KEY]
    # several vocabulary chunks, the row-skipping products' 4x widened blocks too: chunks one block_v wide and
    # no small-N widening (the interpreter's block_v 32: blocks of 32, 64, 128 of V 170; a GPU's 256: 256 .. 1024
    # of V 2600)
    monkeypatch.setitem(LEAN_LAYOUT, "block_cols", tuning["block_v"])
    monkeypatch.setitem(LEAN_LAYOUT, "block_rows", 0)
    n, v, d = (300, 2600, 64) if TUNING_KEY == "gpu" else (90, 170, 24)
    e, c, targets, b = make_kernel_inputs(n, v, d, torch.float32, device, bias=True, seed=3)
    assert _layout.block_width(n, n, v, widen=4) < v  # 4x: two chunks or more
    targets[5 : n - 10] = IGNORE  # 15 counted rows: one row block counted, the others ignored only
    g = mean_grad_rows(targets)
    bias = b if need_bias else None
    lse, *_ = K.forward(e, c, targets, bias, softcap=None, ignore_index=IGNORE)
    _, _, *ref = reference(e, c, targets, bias, g, None)
    block = _backward_launch._block
    monkeypatch.setattr(_backward_launch, "_block", lambda buf, rows, cols: block(buf.fill_(float("nan")), rows, cols))
    several = n // 3 + 1  # a row chunk that cuts the rows in three (dC summed in fp32 over them)
    # short: cuBLAS's products over a block that many times wider, as a batch short of block_rows gets it
    for products, hint, row_chunk, short in (
        ("cublas", None, 0, 1),
        ("triton", None, 0, 1),
        ("triton", 0.1, 0, 1),  # 4x wider: the row-skipping products' own widening
        ("triton", 0.3, 0, 1),  # 2x wider
        ("cublas", 0.0, 0, 1),
        ("cublas", 0.1, 0, 1),
        ("cublas", 0.5, 0, 1),
        ("cublas", None, 0, 4),
        ("cublas", 0.1, 0, 2),
        ("cublas", 0.5, 0, 4),
        ("cublas", 0.1, several, 1),
        ("triton", 0.1, several, 1),
    ):
        monkeypatch.setitem(LEAN_LAYOUT, "block_rows", short * n if short > 1 else 0)
        opts = CCEOptions(products=products, backward_row_chunk=row_chunk)
        if short > 1:
            assert plan_for(e, c, opts, counted_hint=hint).block_width == short * tuning["block_v"]
        got = kbackward(
            e,
            c,
            targets,
            bias,
            lse,
            g,
            softcap=None,
            ignore_index=IGNORE,
            opts=opts,
            need_e=True,
            need_c=True,
            need_bias=need_bias,
            counted_hint=hint,
        )
        for x, r in zip(got, ref):
            if r is not None:
                assert rel(x, r) < 1e-5, (products, hint, row_chunk, short)


@pytest.mark.parametrize("device", DEVICES)
def test_target_logits_of_a_wider_head_in_row_blocks(device, monkeypatch):
    """Under autocast (an fp32 head, bf16 products) the target logits come from the targets' rows of C gathered and
    converted a row block at a time (``_layout.TARGET_ROW_BLOCK``, here 7 rows): equal to converting the whole head
    first, targets outside ``[0, V)`` (a vocabulary shard's) and the last short block included."""
    device_ok(device)
    from cce_inductor.kernels import _forward, _row_chunks

    gen = torch.Generator().manual_seed(3)
    e = torch.randn(30, 16, generator=gen).bfloat16().to(device)
    c = torch.randn(50, 16, generator=gen).to(device)
    bias = torch.randn(50, generator=gen).to(device)
    targets = torch.randint(0, 50, (30,), generator=gen).to(device)
    targets[[2, 9]] = torch.tensor([-1, 50], device=device)  # another shard's targets: logit 0
    monkeypatch.setattr(_layout, "TARGET_ROW_BLOCK", 7)
    got = _row_chunks._target_logits(e, c, targets, bias, 5.0, torch.bfloat16)
    whole = _forward.target_logits(
        e, c.bfloat16(), targets.clamp(0, 49), bias, softcap=5.0, ignore_index=_forward.EVERY_ROW
    )
    want = torch.where((targets >= 0) & (targets < 50), whole, 0.0)
    assert got.shape == (30,) and got[2] == 0 and got[9] == 0
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_wider_head_past_the_products_range_poisons_ignored_rows(device):
    """Autocast's fp32 head with an entry finite in fp32 but past bf16's range: eager converts it to inf, so every
    row's logits hold inf and, with every row ignored, every row of eager's dE holds a NaN (0 * inf). The lean
    backward, which reads no ignored row, poisons them from the converted head's largest magnitude
    (``_launch.weight_poison``): its NaNs cover eager's."""
    device_ok(device)
    gen = torch.Generator().manual_seed(5)
    e = torch.randn(12, 16, generator=gen).bfloat16().to(device)
    c = torch.randn(40, 16, generator=gen).to(device)
    c[7, 0] = torch.finfo(torch.float32).max  # bf16: inf
    targets = torch.full((12,), IGNORE, device=device)
    lse = torch.full((12,), float("inf"), device=device)
    grads = kbackward(
        e,
        c,
        targets,
        None,
        lse,
        torch.zeros(12, device=device),
        softcap=None,
        need_bias=False,
        compute_dtype=torch.bfloat16,
        de_dtype=torch.bfloat16,
        dc_dtype=torch.float32,
    )
    e_ref, c_ref = (x.detach().double().requires_grad_(True) for x in (e, c.bfloat16()))
    torch.nn.functional.cross_entropy(e_ref @ c_ref.T, targets, ignore_index=IGNORE, reduction="sum").backward()
    assert e_ref.grad.isnan().any(dim=1).all()
    assert grads[0].isnan()[e_ref.grad.isnan()].all() and grads[1].isnan()[c_ref.grad.isnan()].all()


def test_row_skipping_widen_and_block_width():
    """The row-skipping products' G block after calls that counted as little as ``hint`` of their rows:
    ``ceil(0.5 / hint)`` times wider (at least half a narrow block's counted entries), 1 to 4 times; only where the
    rows are one row chunk, and at most V.  cuBLAS's products (over every row or a counted prefix) keep the narrow
    block."""
    hints = (1.0, 0.5, 0.4, 1 / 3, 0.25, 0.17, 0.125, 0.1, 0.0)
    assert [_planning.row_skipping_widen(h) for h in hints] == [1, 1, 2, 2, 2, 3, 4, 4, 4]
    gpu = _layout.LEAN_LAYOUT["gpu"]

    def width(rows, row_chunk, vocab, widen=1):
        return _layout.block_width(rows, row_chunk, vocab, widen, gpu)

    assert width(8192, 8192, 256000, 2) == 8192
    assert width(4096, 8192, 256000, 2) == 16384  # a short batch's widening too
    assert width(16384, 8192, 256000, 4) == 16384  # several row chunks: no short-batch widening
    assert width(16384, 8192, 256000) == 4096
    assert width(8192, 8192, 10000, 4) == 10000

    def widen(triton=False, hint=None, one=True):
        return _planning.g_block_widen(triton_products=triton, counted_hint=hint, one_row_chunk=one)

    # the row-skipping products: their own widening, over one row chunk after an earlier call
    assert widen(triton=True, hint=0.1) == 4 and widen(triton=True, hint=0.4) == 2
    assert widen(triton=True, hint=0.1, one=False) == 1  # several row chunks: the narrow block
    assert widen(triton=True) == 1  # no earlier call
    assert widen() == 1 and widen(hint=0.1) == 1  # cuBLAS over every row, or over a counted prefix


def test_memory_model_block_width_is_the_plans():
    """``paths.lean_block_width`` (the memory model) is the width the op's plan hands the kernels on a GPU
    (``_planning.backward_plan``, cuBLAS products over every row): the two agree on every batch size, row chunk and
    vocabulary."""
    gpu = _layout.LEAN_LAYOUT["gpu"]
    for rows in (1, 300, 2048, 4096, 8191, 8192, 8193, 16384, 40000):
        for row_chunk in (8192, 1024, 0):
            for vocab in (5000, 32000, 50257, 256000):
                facts = paths.HeadFacts(
                    rows=rows, hidden=64, vocab=vocab, element_size=2, kernels=True, reduction="mean", needs_grad=True
                )
                plan = _planning.backward_plan(rows, vocab, products="cublas", backward_row_chunk=row_chunk, layout=gpu)
                assert paths.lean_block_width(facts, row_chunk) == plan.block_width, (rows, row_chunk, vocab)


def test_products_read_g_in_blocks_the_recompute_stores_whole():
    """The recompute stores the counted rows' G in whole ``block_n``-row blocks and no ignored position past them
    (compacted G): the Triton products' row blocks (``BLOCK_M``) and K steps (``BLOCK_K``) must divide ``block_n``, so
    that they read no position past the last stored block, on the GPU tuning as under the interpreter."""
    from cce_inductor.kernels import _products

    for key, tune in _backward._TUNING.items():
        prod = _products._TUNING[key]
        assert tune["block_n"] % prod["BLOCK_M"] == 0 and tune["block_n"] % prod["BLOCK_K"] == 0, key


# ----------------------------------------------------------------------------------------------------
# GPU set: real LM-head shapes (skipped without CUDA)
# ----------------------------------------------------------------------------------------------------
GPU_SHAPES = [(8192, 32064, 3072), (8192, 128256, 4096), (8192, 256000, 2304)]


def _gpu_reference_grads(e, c, targets, grad_rows, softcap, chunk=1024):
    """fp64-accumulated reference on the GPU, chunked over rows (fp32 logits would be too coarse a reference for
    errors near bf16's rounding; fp64 matmuls on the GPU are slow but fine at these sizes)."""
    e64, c64 = e.double(), c.double()
    de = torch.zeros_like(e64)
    dc = torch.zeros_like(c64)
    lse_all = torch.empty(e.shape[0], dtype=torch.float64, device=e.device)
    for s in range(0, e.shape[0], chunk):
        raw = e64[s : s + chunk] @ c64.T
        logits = softcap * torch.tanh(raw / softcap) if softcap is not None else raw
        lse = torch.logsumexp(logits, -1)
        lse_all[s : s + chunk] = lse
        t = targets[s : s + chunk]
        valid = t != IGNORE
        grad = torch.softmax(logits, -1)
        grad[valid.nonzero()[:, 0], t[valid]] -= 1
        grad *= grad_rows[s : s + chunk, None].double()
        if softcap is not None:
            grad *= 1 - (logits / softcap) ** 2
        grad[~valid] = 0
        de[s : s + chunk] = grad @ c64
        dc += grad.T @ e64[s : s + chunk]
        del raw, logits, grad
    return lse_all, de, dc


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("opts", list(OPTION_SETS.values()), ids=list(OPTION_SETS))
def test_gpu_real_shapes(shape, opts):
    """Real LM-head shapes against the fp64 reference: the tolerance and, exact mode's contract (the lean path,
    whichever products it runs), no more error than eager PyTorch's in bf16."""
    n, v, d = shape
    e, c, targets, _ = make_kernel_inputs(n, v, d, torch.bfloat16, "cuda", ignore_frac=0.1, logit_std=1.0)
    grad_rows = mean_grad_rows(targets)
    lse, tgt, (de, dc, _) = run_kernels(e, c, targets, None, grad_rows, softcap=None, opts=opts)
    eager_de, eager_dc, _ = eager_grads(e, c, targets, None, None)
    lse_r, de_r, dc_r = _gpu_reference_grads(e, c, targets, grad_rows, None)
    valid = targets != IGNORE
    assert rel(lse[valid], lse_r[valid]) < LSE_TOL
    check_grad(de, de_r, eager_de)
    check_grad(dc, dc_r, eager_dc)


@pytest.mark.gpu
@requires_cuda
def test_gpu_no_host_sync():
    e, c, targets, b = make_kernel_inputs(1024, 32064, 512, torch.bfloat16, "cuda", ignore_frac=0.3, bias=True)
    g = mean_grad_rows(targets)
    every = [*OPTION_SETS.values(), CCEOptions(backward_row_chunk=384)]
    for opts in every:  # compile
        run_kernels(e, c, targets, b, g, softcap=30.0, opts=opts)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for opts in every:
            run_kernels(e, c, targets, b, g, softcap=30.0, opts=opts)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_reports_the_counted_rows_of_its_first_row_chunk(device, monkeypatch):
    """``observe_counted`` (how the op learns a head's share of counted rows without waiting: ``_counted_share``)
    gets the first row chunk's device-side count and its rows."""
    device_ok(device)
    e, c, targets, _ = make_kernel_inputs(48, 150, 32, torch.bfloat16, device, ignore_frac=0.5, bias=False)
    targets[:16] = 3  # the first row chunk (16 rows) counts all its rows, the rest are mixed
    seen = []
    kbackward(
        e,
        c,
        targets,
        None,
        torch.zeros(48, device=device),
        mean_grad_rows(targets),
        softcap=None,
        ignore_index=IGNORE,
        opts=CCEOptions(backward_row_chunk=16),
        need_e=True,
        need_c=True,
        need_bias=False,
        observe_counted=lambda count, rows: seen.append((int(count.reshape(-1)[0]), rows)),
    )
    assert seen == [(16, 16)]
    seen.clear()
    kbackward(
        e,
        c,
        targets,
        None,
        torch.zeros(48, device=device),
        mean_grad_rows(targets),
        softcap=None,
        ignore_index=IGNORE,
        opts=CCEOptions(),
        need_e=True,
        need_c=True,
        need_bias=False,
        observe_counted=lambda count, rows: seen.append((int(count.reshape(-1)[0]), rows)),
    )
    assert seen == [(int((targets != IGNORE).sum()), 48)]


@pytest.mark.parametrize("device", DEVICES)
def test_counted_prefix_products_match_for_any_hint(device, monkeypatch):
    """``counted_hint`` (an earlier call's share of counted rows): cuBLAS multiplies a prefix of the compacted rows,
    the row-skipping Triton products the rest. Whatever the hint (none counted, fewer than this call's counted rows,
    about as many, nearly all), with one or several row chunks and narrow vocabulary chunks, the gradients are the
    fp64 reference's to fp32 rounding (fp32 inputs) and within the default tolerance in bf16; a repeated call is
    bitwise equal."""
    device_ok(device)
    assert _backward_launch.counted_prefix(0.5, 100, 16) == 64 and _backward_launch.counted_prefix(0.0, 100, 16) == 0
    assert _backward_launch.counted_prefix(1.0, 100, 16) == 100 and _backward_launch.counted_prefix(0.31, 100, 16) == 32
    e, c, targets, b = make_kernel_inputs(70, 170, 24, torch.float32, device, ignore_frac=0.5, bias=True, seed=5)
    g = mean_grad_rows(targets)
    lse, *_ = K.forward(e, c, targets, b, softcap=20.0, ignore_index=IGNORE)
    e16, c16, b16 = e.bfloat16(), c.bfloat16(), b.bfloat16()
    lse16, *_ = K.forward(e16, c16, targets, b16, softcap=20.0, ignore_index=IGNORE)
    _, _, *ref32 = reference(e, c, targets, b, g, 20.0)
    _, _, *ref16 = reference(e16, c16, targets, b16, g, 20.0)
    monkeypatch.setitem(LEAN_LAYOUT, "block_cols", 40)  # several vocabulary chunks, a short last

    def grads(hint, row_chunk, sixteen=False):
        args = (e16, c16, targets, b16, lse16) if sixteen else (e, c, targets, b, lse)
        return kbackward(
            *args,
            g,
            softcap=20.0,
            ignore_index=IGNORE,
            opts=CCEOptions(backward_row_chunk=row_chunk),
            need_e=True,
            need_c=True,
            need_bias=True,
            counted_hint=hint,
        )

    # one gradient only: the other's buffers are never touched
    for need_e, need_c in ((False, True), (True, False)):
        de, dc, db = kbackward(
            e,
            c,
            targets,
            b,
            lse,
            g,
            softcap=20.0,
            ignore_index=IGNORE,
            opts=CCEOptions(),
            need_e=need_e,
            need_c=need_c,
            need_bias=True,
            counted_hint=0.2,
        )
        assert (de is None) != need_e and (dc is None) != need_c
        for x, ref in zip((de, dc, db), ref32):
            if x is not None:
                assert rel(x, ref) < 1e-5, (need_e, need_c)
    for hint in (0.0, 0.2, 0.5, 0.9):
        for row_chunk in (0, 33):
            got = grads(hint, row_chunk)
            for x, ref in zip(got, ref32):
                assert rel(x, ref) < 1e-5, (hint, row_chunk)
            for x, y in zip(got, grads(hint, row_chunk)):
                assert torch.equal(x, y)
            for x, ref in zip(grads(hint, row_chunk, sixteen=True), ref16):
                assert x.dtype == torch.bfloat16
                check_grad(x, ref)
