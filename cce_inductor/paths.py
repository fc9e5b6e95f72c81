"""Which path a fused loss takes, and how much scratch the balanced one gets: one pure function of what is known
when the site is compiled (or, for a direct call, when it runs).

The two paths (``docs/design.md``; kernels in ``kernels/``):

* **lean** (``ops.linear_cross_entropy``): the forward keeps one log-sum-exp per row; the backward recomputes the
  logits block by block. Four matmuls of ``N x V x D``; memory above the gradients: one G block and dE's fp32 sums.
* **balanced** (``ops.linear_cross_entropy_with_grads``): the gradients are computed with the loss, row chunk by row
  chunk, through a scratch of logits, and the backward only scales them, in place. Three matmuls, as torch.compile
  does; memory: the scratch, and each gradient at 4 bytes an element until the backward (an fp32 sum, or a 16-bit
  gradient beside the 16-bit remainder of its sum).

The memory model, bytes above the inputs, gradients included (``b`` the products' element size; the gradients in
their inputs' dtypes, ``LB`` their bytes; under autocast ``X`` the inputs' copies in the products' dtype, held for
one call; ``benchmarks/`` compares it with measured peaks, ``tests/test_paths.py`` holds it to the kernels' layout):

    torch.compile  N V b + LB            (the logits, saved for its backward, and the gradients)
                   + N V 4 where the logits are also graph outputs (Hugging Face models return them; the rewrite
                   returns them lazily or drops them), + N V b more where they are softcapped too: at the peak of
                   such graphs the allocator holds three 16-bit logits-sized blocks, four with a softcap
                   (benchmarks/head_memory.py); for fp32 inputs b + 4 = 8 stays under three blocks' 12, so the
                   budget errs lean
    lean           LB + R W b + N D 4 (dE's fp32 sums; where dE is fp32 it is its own sums, but on counted-prefix
                   calls) (+ N D b + W D b + max(N D b, T D (4 + b)) under autocast: E and one vocabulary chunk of C
                   converted, and the larger of E's compacted rows (E converted) and a block of T = min(N, 1024) of
                   C's target rows converted, which live one after the other; X alone in the forward)
                   (+ W D 4 where N > R, or on
                   calls that take the counted-prefix products: their fp32 dC sums, cce_inductor/_counted_share.py);
                   R = min(N, backward_row_chunk), W = min(V, 4096 * max(1, 8192 // N) * k) where R = N, else 4096 k;
                   k = lean_widen's 4, 2 or 1, the widest that keeps this peak within the budget below (where the
                   row-skipping products run alone over one row chunk, their own widening may take the block past
                   k: up to 3 more G blocks, not in lean_peak)
    balanced       4 (N + P) D + S + 4 R D (a 16-bit dE's rows of one chunk) + X    (S the scratch, R its rows,
                   P = V rounded up to 64)

The default (``path="auto"``) takes the fastest path whose peak fits the budget ``max(0.5 x torch.compile's,
1.15 x LB)``: balanced where it fits (three matmuls), else lean (four matmuls, always within the budget's second
term up to its fixed scratch). So the default never trades memory for speed past half of torch.compile's estimated
peak. On a 16-bit head whose V is not a multiple of 8, where Inductor pads the products, torch.compile holds more
(``_PADDED_LOGIT_BYTES``), so where the first budget leaves the balanced path no scratch, such a head is sized
against half of that larger estimate (:func:`balanced_budget`). Where balanced does not fit (large V x D against
N x V, e.g. N 8192 on Gemma-2's head) the lean path's time is the price, and ``stats()`` says so. Where the graph
also returns the logits (Hugging Face models), torch.compile's peak holds more per logit, so the balanced path fits
from fewer rows. ``path="lean"`` / ``"balanced"`` force a path; a forced balanced path fatter than torch.compile
says so too.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

from . import _planning

Path = Literal["lean", "balanced"]

# The lean backward's G block as the kernels lay it out on a GPU (the memory model is about GPUs).
_LEAN_LAYOUT = _planning.LEAN_LAYOUT["gpu"]
# The balanced path's scratch: at least this many rows per chunk (smaller chunks make the dC products memory bound:
# each chunk reads and writes the fp32 dC sums, 8 V D bytes), at most this many bytes.
_MIN_CHUNK_ROWS = 1024
_MAX_SCRATCH_BYTES = 1 << 30
# The scratch is no larger than keeps the peak within this share of torch.compile's (or the gradients, the
# remainders of 16-bit sums and this slack) where that still leaves chunks of _TARGET_CHUNK_ROWS rows
# (balanced_scratch, memory_target).
_TARGET_SHARE = 0.35
_TARGET_SLACK = 256 << 20
_TARGET_CHUNK_ROWS = 2048
# The budget: the default takes the balanced path only where its peak is at most this share of torch.compile's, or
# (where the gradients alone are more than that) within this factor of the gradients' own bytes.
_COMPILE_SHARE = 0.5
_GRADIENT_FACTOR = 1.15
# stats() suggests a scratch_mb for a lean head only where the balanced path's estimated peak stays under this share
# of torch.compile's.
_CLEARLY_LEANER = 0.9
# Below this many rows a chunk loop is not worth it (and the scratch would be tiny): lean.
_MIN_BALANCED_ROWS = 256
# Below this many multiply-adds per logits product (N V D), a lean fwd + bwd on the kernels waits on the host's
# launch work (~25 Triton / cuBLAS launches and the layers around the op), not on the GPU: GPT-2's and GPT-2
# medium's heads at N 4096 lie below it, Qwen2.5-0.5B's (GPU-bound) above (measured; the figures are in docs/).
# stats() says so where the default keeps such a head on the lean path.
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


# torch.compile's bytes per logit beyond the input's width where the graph also returns the logits: of the three bf16
# logits-sized blocks the allocator holds at the step's peak (the model graph's logits, the gradient of the loss
# graph's upcast, one allocated outside Python code: 6.0 bytes per logit in all; module docstring), the two beyond
# the one the loss-only code holds too.
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
    gradients at the inputs' (its copies of the inputs are not counted: they did not add to its peak in
    ``benchmarks/head_memory.py``'s runs)."""
    per_logit = _PADDED_LOGIT_BYTES if padded else compile_bytes_per_logit(f)
    return f.rows * f.vocab * per_logit + gradient_bytes(f)


# torch.compile's bytes per logit in the loss-only graph of a 16-bit head whose V is not a multiple of 8 elements
# (Inductor pads its products): 4, as most such heads held them (docs/design.md, "Unaligned vocabularies"). The 4
# bytes are two 16-bit N x V buffers: the padded logits, overwritten by their gradient, and a second, padded copy
# of that gradient for the weight's gradient product; where Inductor's timing of that product (pad_mm, on the
# device) leaves it unpadded there is no second copy and 2 bytes a logit. The pass cannot see which: it counts 4.
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


def lean_block_width(f: HeadFacts, backward_row_chunk: int = 8192, widen: int = 1) -> int:
    """The lean backward's G block columns on a GPU (:func:`cce_inductor._planning.block_width`, the launches' own
    rule): 4096, wider where N < 8192 is one row chunk (the same bytes), times ``widen``, at most V."""
    return _planning.block_width(f.rows, backward_row_chunk, f.vocab, widen, _LEAN_LAYOUT)


def lean_peak(f: HeadFacts, backward_row_chunk: int = 8192, widen: int = 1, counted_prefix: bool = False) -> int:
    """The backward's: the gradients, one G block (``R x W``, R the row chunk, W :func:`lean_block_width`), dE in
    fp32 (the gradient itself where it is fp32) and, past one row chunk or with the ``counted_prefix`` products (their
    cuBLAS part's sums), one vocabulary chunk of dC in fp32 (``kernels/_backward.py``); under autocast E converted to
    the products' dtype with its compacted copy, one vocabulary chunk of C and a block of C's target rows (module
    docstring). Or the forward's, where more: under autocast the inputs' converted copies, for the call."""
    rows = min(f.rows, backward_row_chunk or f.rows)
    width = lean_block_width(f, backward_row_chunk, widen)
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
    target_rows = min(f.rows, _planning.TARGET_ROW_BLOCK) * f.hidden * (f.c_bytes + b) if wider_c else 0
    backward = (
        gradient_bytes(f) + rows * width * b + de_sums + dc_sums + e_converted + c_chunk + max(compacted, target_rows)
    )
    return max(backward, _converted_bytes(f))


@functools.lru_cache(maxsize=256)
def lean_widen(f: HeadFacts, backward_row_chunk: int = 8192, counted_prefix: bool = False) -> int:
    """How many times wider than its tuned width the lean backward's G block is made (``_planning.backward_plan``'s
    ``block_widen``, for its cuBLAS products over every row or, ``counted_prefix``, over the counted rows first): the
    largest of 4, 2, 1 whose :func:`lean_peak` stays within the :func:`budget`. A wider block gives each dE / dC
    product a longer K, reads and writes dE's fp32 rows fewer times and costs the host fewer launches (a few percent
    less fwd + bwd time: docs/performance.md); the budget keeps the head within half of torch.compile's peak, as the
    path choice does, that of the loss-only graph (the op, which decides at run time, does not know whether the site
    returns the logits). A row chunk other than the default (``CCEOptions.backward_row_chunk``) is a choice about
    memory: its block stays as tuned."""
    if backward_row_chunk != _LEAN_LAYOUT["block_rows"]:
        return 1
    limit = budget(dataclasses.replace(f, returned_logits=False, softcapped=False))
    for widen in (_LEAN_LAYOUT["max_widen"], _LEAN_LAYOUT["max_widen"] // 2):
        if (
            lean_block_width(f, backward_row_chunk, widen) > lean_block_width(f, backward_row_chunk)
            and lean_peak(f, backward_row_chunk, widen, counted_prefix) <= limit
        ):
            return widen
    return 1


def balanced_peak(f: HeadFacts, scratch_bytes: int) -> int:
    """The balanced path's peak (``kernels/_balanced.py``): each gradient as 4 bytes an element (an fp32 sum, or a
    16-bit pair), dC over the scratch's padded rows, the scratch, a 16-bit dE's fp32 rows of one chunk, the inputs'
    converted copies under autocast. The backward scales the gradients in place (Inductor, donated buffers), so it
    adds nothing."""
    rows = chunk_rows(scratch_bytes, f.vocab, f.element_size, f.rows) if scratch_bytes else 0
    de_rows = rows * f.hidden * 4 if f.e_bytes != 4 else 0
    return 4 * (f.rows + scratch_row_pitch(f.vocab)) * f.hidden + scratch_bytes + de_rows + _converted_bytes(f)


def budget(f: HeadFacts, padded: bool = False) -> int:
    return max(int(_COMPILE_SHARE * compile_peak(f, padded)), int(_GRADIENT_FACTOR * gradient_bytes(f)))


def balanced_budget(f: HeadFacts) -> tuple[int, bool]:
    """The budget the default sizes the balanced path against, and whether it counts 4 bytes a logit for torch.compile:
    :func:`budget`, or where that leaves no scratch and torch.compile pads the products (:func:`pads_product`), the
    budget of its padded peak. The second moves V 65535 at N 8192 and GPT-2's and GPT-2 medium's heads at N 4096
    from the lean path to two balanced chunks, faster at well under torch.compile's peak (docs/performance.md);
    heads that fit the first keep its smaller scratch."""
    limit = budget(f)
    if _scratch_within(f, limit) or not pads_product(f):
        return limit, False
    return budget(f, padded=True), True


def scratch_row_pitch(vocab: int) -> int:
    """Elements per scratch row, as the balanced kernels lay it out (``kernels/_balanced.py``, ``ROW_ALIGN``): V
    rounded up to a multiple of 64, so that the products over the scratch see aligned leading dimensions whatever V
    is (cuBLAS is several times slower on a 16-bit matrix whose rows are not a multiple of 8 elements)."""
    return -(-vocab // _planning.VOCAB_ALIGN) * _planning.VOCAB_ALIGN


def chunk_rows(scratch_bytes: int, vocab: int, element_size: int, rows: int) -> int:
    """Rows per balanced chunk: as many chunks as the padded rows that fit in ``scratch_bytes`` need, of equal size
    (no short last chunk: each chunk reads and writes the fp32 dC sums whatever its rows), a multiple of 128 once
    >= 128 (whole matmul tiles); at least 1, at most ``max(rows, 1)``."""
    fit = max(1, scratch_bytes // (scratch_row_pitch(vocab) * element_size))
    if fit >= 128:
        fit -= fit % 128
    rows = max(rows, 1)
    if fit >= rows:
        return rows
    even = -(-rows // -(-rows // fit))  # ceil(rows / number of chunks) <= fit
    if fit >= 128:
        even = min(fit, -(-even // 128) * 128)
    return even


def balanced_scratch(f: HeadFacts, limit: int | None = None) -> int:
    """The balanced path's scratch for these facts: as large as ``limit`` (default: the budget,
    :func:`balanced_budget`) leaves beside its fixed memory, at most 1 GiB and all rows, but no larger than keeps the
    peak within :func:`memory_target` where that still leaves chunks of ``_TARGET_CHUNK_ROWS`` rows (or all rows); 0
    where not even ``_MIN_CHUNK_ROWS`` rows (or all rows, if fewer) fit ``limit``."""
    limit = balanced_budget(f)[0] if limit is None else limit
    scratch = _scratch_within(f, limit)
    lean_scratch = _scratch_within(f, min(limit, memory_target(f)))
    rows = chunk_rows(lean_scratch, f.vocab, f.element_size, f.rows) if lean_scratch else 0
    return lean_scratch if rows >= min(f.rows, _TARGET_CHUNK_ROWS) else scratch


def memory_target(f: HeadFacts) -> int:
    """The peak the balanced path's scratch keeps to where it can (:func:`balanced_scratch`): ``_TARGET_SHARE`` of
    torch.compile's estimated peak, or the gradients' own bytes plus the remainders of the head's 16-bit sums
    (``V D`` elements) and ``_TARGET_SLACK`` where that is more. Each chunk rewrites dC's sums (8 bytes an element),
    so a smaller scratch costs time; chunks of ``_TARGET_CHUNK_ROWS`` rows keep that small beside the products."""
    remainders = f.vocab * f.hidden * f.c_bytes if f.c_bytes != 4 else 0
    return max(int(_TARGET_SHARE * compile_peak(f)), gradient_bytes(f) + remainders + _TARGET_SLACK)


def _scratch_within(f: HeadFacts, limit: int) -> int:
    """The largest scratch (at most 1 GiB, all rows) whose :func:`balanced_peak` fits ``limit``; 0 where not even
    ``_MIN_CHUNK_ROWS`` rows (or all rows, if fewer) fit."""
    row_bytes = scratch_row_pitch(f.vocab) * f.element_size
    # per scratch byte, a 16-bit dE's fp32 rows of the chunk grow too
    per_byte = 1 + (f.hidden * 4 / row_bytes if f.e_bytes != 4 else 0)
    room = int((limit - balanced_peak(f, 0)) / per_byte)
    want = min(_MAX_SCRATCH_BYTES, max(f.rows, 1) * row_bytes)
    if room < min(_MIN_CHUNK_ROWS, max(f.rows, 1)) * row_bytes:
        return 0
    return min(want, room)


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def _compile_estimate(f: HeadFacts, padded: bool = False) -> str:
    if padded:
        return (
            f"{_mib(compile_peak(f, padded=True))}, 4 bytes a logit as it holds them where it pads an unaligned "
            "vocabulary's products: the logits' gradient and a padded copy of it"
        )
    returned = (
        f", the logits it returns included: {compile_bytes_per_logit(f)} bytes per logit" if f.returned_logits else ""
    )
    return f"{_mib(compile_peak(f))}{returned}"


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
    f: HeadFacts, path: str = "auto", scratch_mb: int = 0, backward_row_chunk: int = 8192, products: str = "auto"
) -> PathChoice:
    """The path for a site (module docstring). ``path``: ``"auto"``, or a forced ``"lean"`` / ``"balanced"``;
    ``scratch_mb``: the balanced path's scratch (0: sized here); a ``scratch_mb`` with ``path="auto"`` asks for the
    balanced path, as it did before the automatic choice existed. ``products``: ``CCEOptions.products``, which the
    lean path's record explains where it is decided per call."""
    choice = _choose(f, path, scratch_mb, backward_row_chunk)
    if choice.path == "lean" and f.kernels and f.needs_grad:
        return dataclasses.replace(
            choice,
            reason=choice.reason
            + _lean_block_note(f, backward_row_chunk)
            + (_products_note(f, backward_row_chunk) if products == "auto" else ""),
        )
    return choice


def _lean_block_note(f: HeadFacts, backward_row_chunk: int) -> str:
    """Where the lean backward's G block is widened (:func:`lean_widen`), by how much and at what estimated peak, on
    calls over every row and, where it differs, on those that take the counted-prefix products."""
    widen, prefix_widen = lean_widen(f, backward_row_chunk), lean_widen(f, backward_row_chunk, True)
    if widen == 1:
        return ""
    prefix = (
        ""
        if prefix_widen == widen
        else (
            f"; {lean_block_width(f, backward_row_chunk, prefix_widen)} columns ({prefix_widen}x, est. peak "
            f"{_mib(lean_peak(f, backward_row_chunk, prefix_widen, True))}) on calls that take the counted-prefix "
            "products, whose dC sums are in fp32"
        )
    )
    return (
        f"; its backward's G block {lean_block_width(f, backward_row_chunk, widen)} columns wide ({widen}x, as "
        f"the budget leaves room: est. peak {_mib(lean_peak(f, backward_row_chunk, widen))}{prefix}; in default "
        "mode)"
    )


@functools.lru_cache(maxsize=256)  # (direct calls of the op choose on every call)
def _products_note(f: HeadFacts, backward_row_chunk: int) -> str:
    """How the lean backward picks its products per call (``cce_inductor/_counted_share.py``), and the est. peak of the
    calls that take the counted prefix (its fp32 dC sums, and an fp32 dE's compacted sums: :func:`lean_peak`)."""
    prefix_peak = lean_peak(f, backward_row_chunk, lean_widen(f, backward_row_chunk, True), True)
    return (
        "; its backward's products: cuBLAS over every row, or over the counted rows only on calls after "
        "ones with >= 10% of the targets ignored (cuBLAS, est. peak "
        f"{_mib(prefix_peak)}{' (over the budget)' if prefix_peak > balanced_budget(f)[0] else ''} on those calls; the "
        "row-skipping Triton products alone where >= 60% are ignored, or >= 40% and the share moves) "
        "(stats()['backward_products'])"
    )


def _choose(f: HeadFacts, path: str, scratch_mb: int, backward_row_chunk: int) -> PathChoice:
    if path == "lean":
        return PathChoice(
            "lean", "lean path (forced: path='lean')" + _lean_cost_note(f, backward_row_chunk) + _host_bound_note(f)
        )
    why_not = lean_only_reason(f)
    if why_not is not None:
        note = "" if path == "auto" and not scratch_mb else " (a balanced path was asked for)"
        return PathChoice("lean", f"lean path: {why_not}{note}")
    if path == "balanced" or scratch_mb:
        scratch = scratch_for(f, scratch_mb)
        why = "forced: path='balanced'" if path == "balanced" else f"asked for by scratch_mb={scratch_mb}"
        return PathChoice(
            "balanced",
            f"balanced path ({why}; {_mib(scratch)} scratch)" + _fat_note(f, scratch) + _host_bound_note(f, "balanced"),
            scratch,
        )
    if not f.kernels:
        return PathChoice(
            "lean",
            "lean path: the chunked PyTorch path (not CUDA kernels) does the same work either "
            "way, and the balanced one would hold the gradients in fp32",
        )
    if f.rows < _MIN_BALANCED_ROWS:
        return PathChoice("lean", f"lean path: {f.rows} rows are too few for the balanced path's chunks")
    limit, padded = balanced_budget(f)
    scratch = balanced_scratch(f, limit)
    if scratch:
        return PathChoice(
            "balanced",
            f"balanced path: three matmuls, est. peak {_mib(balanced_peak(f, scratch))} "
            f"within the budget {_mib(limit)} (half of torch.compile's est. "
            f"{_compile_estimate(f, padded)}; {_mib(scratch)} scratch)" + _host_bound_note(f, "balanced"),
            scratch,
        )
    need = balanced_peak(f, min(f.rows, _MIN_CHUNK_ROWS) * scratch_row_pitch(f.vocab) * f.element_size)
    lean = lean_peak(f, backward_row_chunk)
    over = (
        ""
        if lean <= limit
        else (
            f"; the lean path's est. peak {_mib(lean)} is over the budget too (its G block "
            "and dE summed in fp32 against a small V x D), the least of the two"
        )
    )
    return PathChoice(
        "lean",
        f"lean path: the balanced path's est. peak {_mib(need)} (its gradients at 4 bytes "
        f"an element, {_mib(4 * (f.vocab + f.rows) * f.hidden)}) exceeds the budget "
        f"{_mib(limit)} (half of "
        f"torch.compile's est. {_compile_estimate(f, padded)}); four matmuls where "
        "torch.compile does three (more time on the head: docs/performance.md)"
        f"{over}{_host_bound_note(f)}"
        f"{_balanced_instead_note(f)}",
    )


def scratch_for(f: HeadFacts, scratch_mb: int = 0) -> int:
    """The balanced path's scratch once it is taken: ``scratch_mb`` MiB where given, else what the budget leaves
    (:func:`balanced_scratch`), and where it leaves none (a forced path, or a batch larger than the one the site was
    compiled for) up to 1 GiB: the balanced path was chosen for speed. The op calls this at run time, with the real
    N and the site's ``returned_logits``, so it reads the budget the choice read."""
    if scratch_mb:
        return scratch_mb * 2**20
    # past the budget (forced), the scratch that makes the balanced path fast: fewer chunks, fewer fp32 dC passes
    return balanced_scratch(f) or min(_MAX_SCRATCH_BYTES, max(f.rows, 1) * scratch_row_pitch(f.vocab) * f.element_size)


def _fat_note(f: HeadFacts, scratch: int) -> str:
    peak, compile_bytes = balanced_peak(f, scratch), compile_peak(f)
    if f.kernels and peak > compile_bytes:
        return (
            f"; est. peak {_mib(peak)} is above torch.compile's {_mib(compile_bytes)} (its gradients at 4 bytes an "
            "element: path='auto' would take the lean path here)"
        )
    return ""


def _balanced_instead_note(f: HeadFacts) -> str:
    """Where the default keeps a head lean for memory, the way to trade memory for time instead: the balanced path
    with the largest scratch (at most 1 GiB) that keeps its estimated peak under 0.9x torch.compile's (clearly
    leaner, with room for the estimates' error), as a ``scratch_mb`` to set: three matmuls instead of four, about
    torch.compile's time (docs/performance.md)."""
    scratch = balanced_scratch(f, limit=int(_CLEARLY_LEANER * compile_peak(f))) // 2**20 * 2**20
    if scratch < 2**20:
        return ""
    peak = balanced_peak(f, scratch)
    return (
        f"; scratch_mb={scratch // 2**20} (CCE_INDUCTOR_SCRATCH_MB) would take the balanced path instead: three "
        f"matmuls (about torch.compile's time) at est. peak {_mib(peak)}, "
        f"{peak / compile_peak(f):.2f}x torch.compile's"
    )


def _host_bound_note(f: HeadFacts, path: Path = "lean") -> str:
    """Where a head is too small for its launches to hide behind its kernels (``_HOST_BOUND_MACS``), what that costs:
    the lean path's ~25 launches up to ~2x torch.compile's time on the head alone; the balanced path's fewer ones
    less, but a whole step that small waits on the host as well (docs/performance.md)."""
    macs = f.rows * f.vocab * f.hidden
    if not f.kernels or macs >= _HOST_BOUND_MACS:
        return ""
    if path == "balanced":
        return (
            f"; at this size ({macs:.1e} multiply-adds per logits product) the step may wait on the host's "
            "launch work: the balanced head alone can take longer to launch than to run, and whole steps this "
            "small wait on the host, their time against torch.compile's varying from one process to the next "
            "with the GPU's work equal (docs/performance.md)"
        )
    return (
        f"; at this size ({macs:.1e} multiply-adds per logits product) the step likely waits on the host's "
        "launch work, not the GPU: up to ~2x torch.compile's time (docs/performance.md)"
    )


def _lean_cost_note(f: HeadFacts, backward_row_chunk: int) -> str:
    if not f.kernels or lean_only_reason(f) is not None:
        return ""
    scratch = balanced_scratch(f)
    if scratch:
        return (
            f"; path='auto' would take the balanced path (three matmuls instead of four, est. peak "
            f"{_mib(balanced_peak(f, scratch))} against {_mib(lean_peak(f, backward_row_chunk))})"
        )
    return ""
