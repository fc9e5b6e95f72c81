"""Which path a fused loss takes, and how much scratch the balanced one gets: one pure function of what is known
when the site is compiled (or, for a direct call, when it runs).

The two paths (``docs/design.md``; kernels in ``kernels/``):

* **lean** (``ops.linear_cross_entropy_op``): the forward keeps one log-sum-exp per row; the backward recomputes the
  logits block by block. Four matmuls of ``N x V x D``; memory above the gradients: one G block and dE's fp32 sums.
* **balanced** (``balanced_op``): the gradients are computed with the loss, row chunk by row chunk, through a
  scratch of logits, and the backward only scales them, in place. Three matmuls, as torch.compile does; memory: the
  scratch and the gradients, a 16-bit dC summed in its own dtype over at most two chunks (one rounding a chunk: the
  error budget) or beside its remainder, a 16-bit dE rounded once (beside its remainder for ``exact`` or a scale the
  op cannot be given).

The memory model, bytes above the inputs, gradients included: :func:`compile_peak`, :func:`lean_peak`,
:func:`balanced_peak` (formulas in ``docs/design.md``, "How the default picks a path"; ``tests/test_paths.py`` holds
them to the kernels' layout). The default (``path="auto"``, :func:`choose`) is speed first with an explicit error
budget: the balanced path wherever it computes the loss on the kernels, planned by :func:`balanced_plan` against the
memory target (:func:`overhead_target`); the lean path for the forms only it computes, ``exact=True``, the chunked
PyTorch path and tiny batches. ``path="lean"`` / ``"balanced"`` force a path.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

from .kernels import _layout

Path = Literal["lean", "balanced"]

# The lean backward's G block as the kernels lay it out on a GPU (the memory model is about GPUs).
_LEAN_LAYOUT = _layout.LEAN_LAYOUT["gpu"]
# The balanced path's scratch: at least _MIN_CHUNK_ROWS rows per chunk where dC's sums (an fp32 gradient, a 16-bit
# pair) are read and written by every chunk's product (smaller chunks make those products memory bound), and a pair
# taken for memory at least _MIN_PAIR_CHUNK_ROWS (its epilogue's share of a chunk's time falls as 1 / rows, whatever
# V is: shorter, the plain sum's speed goes first); at most _MAX_SCRATCH_BYTES, or _SUMS_CHUNK_ROWS rows where those
# are more bytes (a wide vocabulary); a scratch past both buys little time and would raise a whole step's peak.
_MIN_CHUNK_ROWS = 2048
_MIN_PAIR_CHUNK_ROWS = 4096
_SUMS_CHUNK_ROWS = 8192
_MAX_SCRATCH_BYTES = 1 << 30
# The default's memory target (issue 62): the balanced path's peak above the gradients' own bytes within this share
# of torch.compile's; under autocast the inputs' converted copies plus this smaller share (overhead_target).
_OVERHEAD_SHARE = 0.3
_CONVERTED_OVERHEAD_SHARE = 0.15
# Below this many rows a chunk loop is not worth it (and the scratch would be tiny): lean.
_MIN_BALANCED_ROWS = 256
# Below this many multiply-adds per logits product (N V D), a fwd + bwd on the kernels waits on the host's launch
# work, not on the GPU (GPT-2's heads at N 4096 below it, Qwen2.5-0.5B's above; docs/): stats() says so.
_HOST_BOUND_MACS = 3e11


@dataclasses.dataclass(frozen=True)
class HeadFacts:
    """What the choice reads: the head's shape, the loss and where it runs."""

    rows: int  # N (a size hint where the batch is symbolic)
    hidden: int  # D
    vocab: int  # V
    element_size: int  # bytes per element of the inputs (2 for bf16 / fp16)
    kernels: bool  # the CUDA Triton kernels run it (else the chunked PyTorch path)
    reduction: str  # "mean" | "sum" | "none"
    needs_grad: bool  # the loss needs gradients of the head's inputs
    lse_reused: bool = False  # the log-sum-exp is used beyond the loss (a z-loss)
    per_row_outputs: bool = False  # token log-probs, entropy, chunked heads fused with reduction "none"
    returned_logits: bool = False  # the logits are graph outputs too (torch.compile holds more; the rewrite does not)
    softcapped: bool = False  # the loss reads softcapped logits (with returned logits torch.compile holds one more)
    loss_scale: str = ""  # the loss's scale after the cross-entropy that the op cannot be given (fx_passes/upstream.py)
    # bytes per element of the hidden states / the head as stored, where not element_size (autocast: fp32 inputs,
    # 16-bit products); each gradient is returned in its input's dtype. 0: element_size.
    e_element_size: int = 0
    c_element_size: int = 0

    @property
    def e_bytes(self) -> int:
        return self.e_element_size or self.element_size

    @property
    def c_bytes(self) -> int:
        return self.c_element_size or self.element_size


def storage_facts(e_dtype, c_dtype, compute_dtype) -> dict:
    """:class:`HeadFacts`' storage fields for inputs of these dtypes computed in ``compute_dtype`` (none where all
    three are one dtype)."""
    if e_dtype == c_dtype == compute_dtype:
        return {}
    return dict(e_element_size=e_dtype.itemsize, c_element_size=c_dtype.itemsize)


def _converted_bytes(f: HeadFacts) -> int:
    """The inputs converted to the products' dtype for one call (autocast), ``(N or V) x D x b`` each."""
    b = f.element_size
    return (f.rows * f.hidden * b if f.e_bytes != b else 0) + (f.vocab * f.hidden * b if f.c_bytes != b else 0)


@dataclasses.dataclass(frozen=True)
class PathChoice:
    path: Path
    reason: str  # one sentence for stats(): why this path
    scratch_bytes: int = 0  # the balanced path's scratch (0 for lean)
    plain_sum: bool = False  # the balanced path sums a 16-bit dC in its own dtype (BalancedPlan)
    de_pair: bool = False  # ... and, where dC is the pair, a 16-bit dE as the pair too (BalancedPlan)


# torch.compile's bytes per logit beyond the input's width where the graph also returns the logits: of the three bf16
# logits-sized blocks the allocator holds at the step's peak (the model graph's logits, the gradient of the loss
# graph's upcast, one allocated outside Python code: 6.0 bytes per logit in all; docs/design.md's memory model), the
# two beyond the one the loss-only code holds too.
_RETURNED_LOGITS_EXTRA_BYTES = 4


def compile_bytes_per_logit(f: HeadFacts) -> int:
    """torch.compile's bytes per logit in :func:`compile_peak`: the logits at the input's width, and where the graph
    returns them ``_RETURNED_LOGITS_EXTRA_BYTES`` more, and one more block of the input's width if softcapped."""
    b = f.element_size
    if not f.returned_logits:
        return b
    return b + _RETURNED_LOGITS_EXTRA_BYTES + (b if f.softcapped else 0)


def compile_peak(f: HeadFacts, padded: bool = False) -> int:
    """torch.compile's peak for ``cross_entropy(linear(e, c).float(), t)`` (forward + backward), bytes, and more
    where the graph returns the logits (``f.returned_logits``; :func:`compile_bytes_per_logit`); ``padded``: at 4
    bytes a logit, as it held them where it padded an unaligned vocabulary's products (:func:`pads_product`). Under
    autocast (inputs stored wider than the products' dtype) the same: the logits at the products' width and the
    gradients at the inputs' (its copies of the inputs are not counted: they do not add to its peak, as
    docs/design.md's memory model says)."""
    per_logit = _PADDED_LOGIT_BYTES if padded else compile_bytes_per_logit(f)
    return f.rows * f.vocab * per_logit + gradient_bytes(f)


# torch.compile's bytes per logit in the loss-only graph of a 16-bit head whose V is not a multiple of 8 (Inductor
# pads its products): the padded logits, overwritten by their gradient, and a padded copy of that gradient for the
# weight's product, which pad_mm may leave unpadded (2 bytes); the pass cannot see which, and counts the 4 most such
# heads held (docs/design.md, "Unaligned vocabularies").
_PADDED_LOGIT_BYTES = 4


def pads_product(f: HeadFacts) -> bool:
    """Whether torch.compile's head likely pads its products and holds 4 bytes a logit (``_PADDED_LOGIT_BYTES``): a
    16-bit head on the kernels whose V is not a multiple of 8 elements, in a loss-only graph (a graph that returns
    the logits holds its own bytes per logit, :func:`compile_bytes_per_logit`, unaligned or not). Established in
    bf16; fp16 pads at the same alignment and is taken to hold the same."""
    return f.kernels and f.element_size == 2 and f.vocab % 8 != 0 and not f.returned_logits


def gradient_bytes(f: HeadFacts) -> int:
    """The lower bound: the gradients themselves, ``(N + V) D`` elements, each in its input's dtype."""
    return (f.rows * f.e_bytes + f.vocab * f.c_bytes) * f.hidden


def lean_block_width(f: HeadFacts, backward_row_chunk: int = 8192) -> int:
    """The lean backward's G block columns on a GPU (``kernels/_layout.py``'s ``block_width``, the launches' own
    rule) for cuBLAS's products: 4096, wider where N < 8192 is one row chunk (the same bytes), at most V."""
    return _layout.block_width(f.rows, backward_row_chunk, f.vocab, 1, _LEAN_LAYOUT)


def lean_peak(f: HeadFacts, backward_row_chunk: int = 8192, *, counted_prefix: bool = False) -> int:
    """The backward's: the gradients, one G block (``R x W``, R the row chunk, W :func:`lean_block_width`), dE in
    fp32 (the gradient itself where it is fp32) and, past one row chunk or with the ``counted_prefix`` products (their
    cuBLAS part's sums), one vocabulary chunk of dC in fp32 (``kernels/_backward.py``); under autocast E converted to
    the products' dtype with its compacted copy, one vocabulary chunk of C and a block of C's target rows (module
    docstring). Or the forward's, where more: under autocast the inputs' converted copies, for the call."""
    rows = min(f.rows, backward_row_chunk or f.rows)
    width = lean_block_width(f, backward_row_chunk)
    b = f.element_size
    dc_sums = width * f.hidden * 4 if f.rows > rows or counted_prefix else 0
    # dE's fp32 sums: the gradient itself where it is fp32, but not on the counted-prefix calls, which sum it in
    # compacted order and put it back at the end (kernels/_backward.py)
    de_sums = f.rows * f.hidden * 4 if f.e_bytes != 4 or counted_prefix else 0
    # under autocast: E converted, and (its dE being its fp32 sums, whose rows are never free) the compacted copy of
    # its rows the products read in a buffer of its own; of a wider-stored head one vocabulary chunk converted, and
    # one block of its target rows gathered and converted for the target logits, freed before the compacted copy is
    # made (kernels/_backward.py, kernels/_row_chunks.py)
    e_converted = compacted = f.rows * f.hidden * b if f.e_bytes != b else 0
    wider_c = f.c_bytes != b
    c_chunk = width * f.hidden * b if wider_c else 0
    target_rows = min(f.rows, _layout.TARGET_ROW_BLOCK) * f.hidden * (f.c_bytes + b) if wider_c else 0
    backward = (
        gradient_bytes(f) + rows * width * b + de_sums + dc_sums + e_converted + c_chunk + max(compacted, target_rows)
    )
    return max(backward, _converted_bytes(f))


def balanced_peak(f: HeadFacts, scratch_bytes: int, plain_sum: bool = False, de_pair: bool = True) -> int:
    """The balanced path's peak (``kernels/_balanced.py``): the gradients in their inputs' dtypes, dC over the
    scratch's padded rows; a 16-bit dC's remainder (the pair's ``lo``) unless a ``plain_sum``, a 16-bit dE's where
    dC is the pair and ``de_pair``; a 16-bit dE's fp32 rows of one chunk (always counted: compacted rows and V's
    tail hold them too); the scratch; the inputs' converted copies under autocast. The backward scales the gradients
    in place (Inductor, donated buffers)."""
    rows = chunk_rows(scratch_bytes, f.vocab, f.element_size, f.rows) if scratch_bytes else 0
    pitch = scratch_row_pitch(f.vocab)
    gradients = (f.rows * f.e_bytes + pitch * f.c_bytes) * f.hidden
    de_remainder = f.rows * f.hidden * f.e_bytes if de_pair and not plain_sum else 0
    de_extra = de_remainder + rows * f.hidden * 4 if f.e_bytes != 4 else 0
    dc_remainder = pitch * f.hidden * f.c_bytes if f.c_bytes != 4 and not plain_sum else 0
    return gradients + de_extra + dc_remainder + rows * pitch * f.element_size + _converted_bytes(f)  # (whole rows)


def compile_overhead(f: HeadFacts) -> int:
    """torch.compile's estimated peak above the gradients' own bytes (:func:`compile_peak`, at 4 bytes a logit where
    it pads the products of an unaligned vocabulary, :func:`pads_product`)."""
    return compile_peak(f, padded=pads_product(f)) - gradient_bytes(f)


def overhead_target(f: HeadFacts) -> int:
    """The memory the balanced path may hold above the gradients' own bytes (issue 62's target):
    ``_OVERHEAD_SHARE`` of torch.compile's overhead; under autocast the inputs' converted copies (one call's) plus
    ``_CONVERTED_OVERHEAD_SHARE`` of it."""
    converted = _converted_bytes(f)
    share = _CONVERTED_OVERHEAD_SHARE if converted else _OVERHEAD_SHARE
    return int(share * compile_overhead(f)) + converted


def scratch_row_pitch(vocab: int) -> int:
    """Elements per scratch row, as the balanced kernels lay it out (``kernels/_balanced_launch.py``, ``ROW_ALIGN``): V
    rounded up to a multiple of 64, so that the products over the scratch see aligned leading dimensions whatever V
    is (cuBLAS is several times slower on a 16-bit matrix whose rows are not a multiple of 8 elements)."""
    return -(-vocab // _layout.VOCAB_ALIGN) * _layout.VOCAB_ALIGN


def chunk_rows(scratch_bytes: int, vocab: int, element_size: int, rows: int) -> int:
    """Rows per balanced chunk: as many chunks as the padded rows that fit in ``scratch_bytes`` need, of equal size
    (no short last chunk: each chunk reads and writes dC's sums whatever its rows), a multiple of 128 once
    >= 128 (whole matmul tiles) where the rows take more than one; at least 1, at most ``max(rows, 1)``."""
    fit = max(1, scratch_bytes // (scratch_row_pitch(vocab) * element_size))
    rows = max(rows, 1)
    if fit >= rows:
        return rows
    if fit >= 128:
        fit -= fit % 128
    even = -(-rows // -(-rows // fit))  # ceil(rows / number of chunks) <= fit
    if fit >= 128:
        even = min(fit, -(-even // 128) * 128)
    return even


@dataclasses.dataclass(frozen=True)
class BalancedPlan:
    """How the balanced path runs a head: its scratch, the rows per chunk that scratch gives, and how a 16-bit dC is
    summed over the chunks: ``plain_sum`` in its own dtype (one rounding a chunk, no remainder bytes, at most
    ``_layout.PLAIN_SUM_MAX_CHUNKS`` chunks), else as a 16-bit pair (a remainder of ``V x D`` 16-bit elements,
    exact at any number of chunks). An fp32 dC is its own sum either way. ``de_pair``: where dC is the pair, a 16-bit
    dE is one too (else rounded once: each of its rows is one chunk's sum, as torch.compile's product rounds it)."""

    scratch_bytes: int  # what the kernels allocate: ``chunk_rows`` padded rows
    chunk_rows: int
    chunks: int
    plain_sum: bool
    peak: int  # est. bytes (:func:`balanced_peak`)
    within_target: bool  # the peak within the gradients plus :func:`overhead_target`
    de_pair: bool = False


def _plan(f: HeadFacts, scratch_bytes: int, plain_sum: bool, de_pair: bool) -> BalancedPlan:
    rows = chunk_rows(scratch_bytes, f.vocab, f.element_size, f.rows)
    allocated = rows * scratch_row_pitch(f.vocab) * f.element_size  # (the kernels' scratch: whole rows of it)
    de_pair = de_pair and not plain_sum and f.e_bytes == 2
    peak = balanced_peak(f, scratch_bytes, plain_sum, de_pair)
    within = peak <= gradient_bytes(f) + overhead_target(f)
    return BalancedPlan(allocated, rows, -(-max(f.rows, 1) // rows), plain_sum, peak, within, de_pair)


def _scratch_of_chunks(f: HeadFacts, chunks: int) -> int:
    """The scratch whose chunks (:func:`chunk_rows`) are at most ``chunks``: ``ceil(N / chunks)`` rows, rounded up to
    a multiple of 128 once >= 128."""
    rows = -(-max(f.rows, 1) // chunks)
    if rows >= 128:
        rows = -(-rows // 128) * 128
    return rows * scratch_row_pitch(f.vocab) * f.element_size


def _scratch_cap(f: HeadFacts) -> int:
    """The most scratch the plan takes: ``_MAX_SCRATCH_BYTES``, or ``_SUMS_CHUNK_ROWS`` rows where those are more."""
    return max(_MAX_SCRATCH_BYTES, _SUMS_CHUNK_ROWS * scratch_row_pitch(f.vocab) * f.element_size)


def _largest_scratch_within(f: HeadFacts, limit: int, plain_sum: bool, de_pair: bool) -> int:
    """The largest scratch (at most :func:`_scratch_cap`, all rows) whose peak fits ``limit``; 0 where not even
    ``_MIN_CHUNK_ROWS`` rows (or all rows, if fewer) fit."""
    row_bytes = scratch_row_pitch(f.vocab) * f.element_size
    # per scratch byte, a 16-bit dE's fp32 rows of the chunk grow too
    per_byte = 1 + (f.hidden * 4 / row_bytes if f.e_bytes != 4 else 0)
    room = int((limit - balanced_peak(f, 0, plain_sum, de_pair)) / per_byte)
    want = min(_scratch_cap(f), max(f.rows, 1) * row_bytes)
    if room < min(_MIN_CHUNK_ROWS, max(f.rows, 1)) * row_bytes:
        return 0
    return min(want, room)


@functools.lru_cache(maxsize=256)  # (the op plans every call, before its first launch)
def balanced_plan(
    f: HeadFacts, scratch_mb: int = 0, plain_sum: bool | None = None, de_pair: bool = False
) -> BalancedPlan:
    """The balanced path's plan for these facts (the pass asks at the batch it traced, the op at each call's).
    ``plain_sum``: the site's choice (the op's argument), or None to choose here. ``de_pair``: where dC is the pair,
    a 16-bit dE is one too (``exact``; a scale the op cannot be given, ``f.loss_scale``, asks for it here; else its
    rows are each one chunk's sum, rounded once, as torch.compile's). The rule, fastest first, within the memory
    target (the gradients plus :func:`overhead_target`) and a scratch of at most :func:`_scratch_cap`:

    * a 16-bit dC summed in its own dtype over 1, else 2 chunks (``PLAIN_SUM_MAX_CHUNKS``: the error budget);
    * else as a 16-bit pair (exact at any number of chunks, for the pair product's epilogue), the largest scratch
      within the target, where that gives chunks of at least ``_MIN_PAIR_CHUNK_ROWS`` rows;
    * else speed first: the plain sum over 2 chunks (the pair's epilogue reads and writes ``V x D`` pairs every
      chunk, a share of its time that grows as the chunks shrink); ``within_target`` False (stats() says so);
    * the pair where the graph scales the loss in a way the op cannot be given (``f.loss_scale``): the backward
      would round a plain sum once more by that upstream gradient, past the error budget.

    An fp32 dC (fp32 heads, autocast's fp32 weights) is its own fp32 sum at any number of chunks: the largest scratch
    within the target, chunks of at least ``_MIN_CHUNK_ROWS`` rows. ``scratch_mb`` (> 0) sets the scratch; a plain sum
    then still takes at most 2 chunks."""
    most = _layout.PLAIN_SUM_MAX_CHUNKS
    plain_sum = False if plain_sum is None and f.loss_scale else plain_sum
    de_pair = de_pair or bool(f.loss_scale)
    sixteen = f.c_bytes == 2
    if scratch_mb:
        scratch = scratch_mb * 2**20
        fits_plain = -(-max(f.rows, 1) // chunk_rows(scratch, f.vocab, f.element_size, f.rows)) <= most
        plain = sixteen and (fits_plain if plain_sum is None else plain_sum)
        return _plan(f, scratch if fits_plain or not plain else _scratch_of_chunks(f, most), plain, de_pair)
    limit = gradient_bytes(f) + overhead_target(f)
    floor = min(_MIN_CHUNK_ROWS, max(f.rows, 1)) * scratch_row_pitch(f.vocab) * f.element_size
    sums = _plan(f, max(_largest_scratch_within(f, limit, False, de_pair), floor), False, de_pair)  # fp32, or the pair
    if not sixteen or plain_sum is False:
        return sums
    for chunks in range(1, most + 1):
        plan = _plan(f, _scratch_of_chunks(f, chunks), True, False)
        if plan.within_target and plan.scratch_bytes <= _scratch_cap(f):
            return plan
    if plain_sum is None and sums.within_target and sums.chunk_rows >= min(_MIN_PAIR_CHUNK_ROWS, max(f.rows, 1)):
        return sums
    return _plan(f, _scratch_of_chunks(f, most), True, False)


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def lean_only_reason(f: HeadFacts) -> str | None:
    """Why the balanced path cannot compute this loss at all (None where it can)."""
    if f.per_row_outputs or f.reduction not in ("mean", "sum"):
        return f"reduction={f.reduction!r} or per-row outputs (the balanced path computes 'mean' and 'sum' losses)"
    if not f.needs_grad:
        return "no gradient is needed (no input of the head requires grad, or grad mode is off)"
    if f.lse_reused:
        return "the log-sum-exp is used beyond the loss (a z-loss)"
    return None


def choose(
    f: HeadFacts,
    path: str = "auto",
    scratch_mb: int = 0,
    backward_row_chunk: int = 8192,
    products: str = "auto",
    exact: bool = False,
) -> PathChoice:
    """The path for a site (module docstring). ``path``: ``"auto"``, or a forced ``"lean"`` / ``"balanced"``;
    ``scratch_mb``: the balanced path's scratch (0: sized here); a ``scratch_mb`` with ``path="auto"`` asks for the
    balanced path, as it did before the automatic choice existed. ``products``: ``CCEOptions.products``, which the
    lean path's record explains where it is decided per call. ``exact``: gradients at no more than torch.compile's
    error (the lean path; a forced balanced path sums a 16-bit dC as a pair)."""
    choice = _choose(f, path, scratch_mb, exact)
    if choice.path == "lean" and f.kernels and f.needs_grad and products == "auto":
        return dataclasses.replace(choice, reason=choice.reason + _products_note(f, backward_row_chunk))
    return choice


def choose_for(f: HeadFacts, options) -> PathChoice:
    """:func:`choose` with the fields of a ``CCEOptions`` (the pass and the direct call)."""
    return choose(f, options.path, options.scratch_mb, options.backward_row_chunk, options.products, options.exact)


@functools.lru_cache(maxsize=256)  # (direct calls of the op choose on every call)
def _products_note(f: HeadFacts, backward_row_chunk: int) -> str:
    """How the lean backward picks its products per call (``cce_inductor/_counted_share.py``), and the est. peak of the
    calls that take the counted prefix (its fp32 dC sums, and an fp32 dE's compacted sums: :func:`lean_peak`)."""
    prefix_peak = lean_peak(f, backward_row_chunk, counted_prefix=True)
    return (
        "; its backward's products: cuBLAS over every row, or over the counted rows only on calls after "
        "ones with >= 10% of the targets ignored (cuBLAS, est. peak "
        f"{_mib(prefix_peak)} on those calls, {prefix_peak / compile_peak(f):.2f}x torch.compile's; the "
        "row-skipping Triton products alone where >= 60% are ignored, or >= 40% and the share moves) "
        "(stats()['backward_products'])"
    )


def _choose(f: HeadFacts, path: str, scratch_mb: int, exact: bool) -> PathChoice:
    if path == "lean":
        return PathChoice("lean", "lean path (forced: path='lean')" + _lean_cost_note(f, exact) + _host_bound_note(f))
    why_not = lean_only_reason(f)
    if why_not is not None:
        note = "" if path == "auto" and not scratch_mb else " (a balanced path was asked for)"
        return PathChoice("lean", f"lean path: {why_not}{note}")
    if path == "balanced" or scratch_mb:
        plan = balanced_plan(f, scratch_mb, plain_sum=False if exact else None, de_pair=exact)
        why = "forced: path='balanced'" if path == "balanced" else f"asked for by scratch_mb={scratch_mb}"
        return _balanced_choice(f, plan, f"balanced path ({why})")
    if exact:
        return PathChoice(
            "lean",
            "lean path: exact=True (fp32 sums, four matmuls: gradients below torch.compile's error, where the "
            "default's balanced path sums a 16-bit dC in its own dtype, within 1.35x of it)" + _host_bound_note(f),
        )
    if not f.kernels:
        return PathChoice(
            "lean",
            "lean path: the chunked PyTorch path (not CUDA kernels) does the same work either "
            "way, and the balanced one would hold the gradients in fp32",
        )
    if f.rows < _MIN_BALANCED_ROWS:
        return PathChoice("lean", f"lean path: {f.rows} rows are too few for the balanced path's chunks")
    return _balanced_choice(f, balanced_plan(f), "balanced path")


def _balanced_choice(f: HeadFacts, plan: BalancedPlan, head: str) -> PathChoice:
    """A balanced path's record: how dC is summed over how many chunks, its est. peak against torch.compile's."""
    if f.c_bytes == 4:
        sums = "the gradients summed in fp32"
    elif plan.plain_sum:
        sums = (
            f"dC summed in its own 16-bit dtype, one rounding a chunk (at most {_layout.PLAIN_SUM_MAX_CHUNKS} "
            "chunks: within 1.35x torch.compile's dC error)"
        )
    else:
        sums = "dC summed as a 16-bit pair (a V x D remainder, exact at any number of chunks)"
        if f.e_bytes == 2:
            sums += ", dE as a pair too" if plan.de_pair else ", dE rounded once (each row one chunk's sum)"
        if f.loss_scale:  # (balanced_plan)
            sums += f": the loss is scaled after the cross-entropy ({f.loss_scale}), past a plain sum's error budget"
    overhead = plan.peak - gradient_bytes(f)
    ratio = overhead / max(compile_overhead(f), 1)
    target = _CONVERTED_OVERHEAD_SHARE if _converted_bytes(f) else _OVERHEAD_SHARE
    over = " (over the memory target: the pair in chunks of at least 2048 rows)"
    if plan.plain_sum:
        over = (
            " (over the memory target, speed first: more chunks would put dC's 16-bit sum past the error budget, and "
            "the pair, with its V x D remainder, is past the target too or within it only in chunks of under "
            f"{_MIN_PAIR_CHUNK_ROWS} rows)"
        )
    over = "" if plan.within_target else over
    compile_bytes = compile_peak(f)
    fat = f"; est. peak above torch.compile's {_mib(compile_bytes)}" if f.kernels and plan.peak > compile_bytes else ""
    return PathChoice(
        "balanced",
        f"{head}: three matmuls, {plan.chunks} row chunk{'s' if plan.chunks > 1 else ''} of {plan.chunk_rows} rows "
        f"({_mib(plan.scratch_bytes)} scratch), {sums}; est. peak {_mib(plan.peak)}, {_mib(overhead)} above the "
        f"gradients: {ratio:.2f}x torch.compile's est. {_mib(compile_overhead(f))}{_compile_note(f)} (target {target}x"
        f"{' beside the converted inputs' if _converted_bytes(f) else ''}){over}"
        + fat
        + _host_bound_note(f, "balanced"),
        plan.scratch_bytes,
        plan.plain_sum,
        plan.de_pair,
    )


def _compile_note(f: HeadFacts) -> str:
    """What torch.compile's estimate holds per logit, where it is not the input's width."""
    if pads_product(f):
        return f" at {_PADDED_LOGIT_BYTES} bytes a logit, as it holds them where it pads an unaligned vocabulary"
    if f.returned_logits:
        return f", the logits it returns included: {compile_bytes_per_logit(f)} bytes per logit"
    return ""


def _host_bound_note(f: HeadFacts, path: Path = "lean") -> str:
    """Where a head is too small for its launches to hide behind its kernels (``_HOST_BOUND_MACS``), what that costs:
    the lean path's ~25 launches up to ~2x torch.compile's time on the head alone; the balanced path's fewer ones
    less, but a whole step that small waits on the host as well; below twice the threshold, so do the balanced
    calls that skip ignored rows (the GPU work of the counted rows, the launches of all: docs/performance.md)."""
    macs = f.rows * f.vocab * f.hidden
    skips_rows = path == "balanced" and f.e_bytes == f.c_bytes == 2  # (16-bit inputs in their own dtype only)
    if not f.kernels or macs >= (2 if skips_rows else 1) * _HOST_BOUND_MACS:
        return ""
    size = f"at this size ({macs:.1e} multiply-adds per logits product)"
    if path != "balanced":
        return f"; {size} the step likely waits on the host's launch work, not the GPU: up to ~2x torch.compile's time"
    if macs >= _HOST_BOUND_MACS:
        return (
            "; where many targets are ignored (prompt masks), the calls that skip those rows do less GPU work but the "
            f"same launch work, and {size} they may wait on the host"
        )
    return (
        f"; {size} the step may wait on the host's launch work: the balanced head alone can take longer to launch "
        "than to run, and whole steps this small wait on the host, their time against torch.compile's varying "
        "between processes with the GPU's work equal"
    )


def _lean_cost_note(f: HeadFacts, exact: bool) -> str:
    if not f.kernels or lean_only_reason(f) is not None or f.rows < _MIN_BALANCED_ROWS or exact:
        return ""
    plan = balanced_plan(f)
    return (
        f"; path='auto' would take the balanced path (three matmuls instead of four, est. peak {_mib(plan.peak)} "
        f"against {_mib(lean_peak(f))})"
    )
