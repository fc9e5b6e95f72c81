"""Vocabulary-parallel Cut Cross-Entropy for tensor parallelism.

With a column-parallel (vocabulary-sharded) output head each rank of a tensor-parallel group holds the rows
``[vocab_start, vocab_start + V_local)`` of the classifier ``C`` (``ColwiseParallel`` on ``lm_head`` in
``torch.distributed.tensor.parallel``, Megatron's ``ColumnParallelLinear`` with ``gather_output=False``).
:func:`vocab_parallel_linear_cross_entropy` computes

    F.cross_entropy(softcap(e @ C_full.T + bias_full), targets, ignore_index=..., reduction=...)

from the shards without materialising any logits, neither the full ``N x V`` nor the local ``N x V_local``:

forward
    every rank runs the chunked path (``cce_inductor._chunked.forward``; on CUDA the Triton kernels) on its
    shard and gets, per row, the log-sum-exp over its shard ``lse_r`` and the target logit if the target lies
    in its shard (else 0). **One collective**: an all-gather of the ``(2, N)`` pair (``2 * N * world``
    floats, a few KB), after which every rank has ``lse = logsumexp_r(lse_r)`` and
    ``target_logit = sum_r target_logit_r``; the loss is ``lse - target_logit`` at non-ignored rows, reduced
    as ``F.cross_entropy`` does (``mean`` over non-ignored rows, NaN if there are none).

backward
    ``softmax`` over the shard with the *global* ``lse`` gives each rank the exact gradient of its own logits,
    so ``dC_shard`` (and ``dbias_shard``) need **no communication**; ``dE`` is a sum of per-shard
    contributions: **one all-reduce SUM** (``N x D``).

All ranks of ``group`` must pass the same ``e`` and ``targets`` (the replicated input of a column-parallel
layer), and the loss and ``dE`` returned are the same on every rank. ``dE`` is already all-reduced: do not
all-reduce it again (in Megatron terms this function contains the ``copy_to_tensor_model_parallel_region``).

Structure: a ``torch.autograd.Function`` whose forward and backward each call one custom op for the per-shard
work (``cce_inductor::vocab_shard_forward`` / ``vocab_shard_backward``: opaque to Dynamo and Inductor, like the
fused op) and one functional collective (``torch.distributed._functional_collectives``: traceable, no host
sync). It compiles with ``fullgraph=True``. Every rank of ``group`` must call it (it is a collective).

Also here:

* :func:`dtensor_linear_cross_entropy`: the same on DTensors (``weight`` ``Shard(0)`` on a 1-D mesh, as
  ``ColwiseParallel`` leaves it), returning a ``Replicate`` DTensor like ``loss_parallel``;
* :func:`rewrite_tensor_parallel_sites` / :class:`TensorParallelGraphPass`: a prototype graph pass that rewrites a
  compiled ``ColwiseParallel(use_local_output=False)`` head + ``loss_parallel`` cross-entropy into
  :func:`dtensor_linear_cross_entropy` (to be folded into ``fx_passes/linear_cross_entropy.py``).

DDP and FSDP2 need nothing from this module: the main pass rewrites their compiled graphs as they are (see
``tests/test_distributed.py``), except when ``lm_head`` is an FSDP unit of its own.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor
from torch._inductor.custom_graph_pass import CustomGraphPass as _CustomGraphPass

from . import _chunked, ops
from .ops import Reduction

__all__ = [
    "vocab_parallel_linear_cross_entropy",
    "dtensor_linear_cross_entropy",
    "vocab_shard_range",
    "rewrite_tensor_parallel_sites",
    "TensorParallelGraphPass",
]

# Local target codes handed to the per-shard computation (independent of the user's ignore_index).
_LOCAL_IGNORED = -1  # the row's target is ignore_index: the row is not part of the loss
_LOCAL_ELSEWHERE = -2  # the row counts, but its target is in another rank's shard

_IMPLS = ("auto", "chunked", "kernels")

# ``all_gather_tensor`` is deprecated in 2.13 in favour of ``all_gather_single``, which 2.11 may lack.
_all_gather_single = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def vocab_shard_range(vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """``(vocab_start, V_local)`` of ``rank`` when ``vocab_size`` rows are split as ``torch.chunk`` /
    DTensor ``Shard(0)`` / ``ColwiseParallel`` split them: ``ceil(V / world)`` rows per rank, the last ranks
    get fewer (possibly none)."""
    per_rank = -(-vocab_size // world_size)
    start = min(rank * per_rank, vocab_size)
    return start, min(per_rank, vocab_size - start)


def _wait(t: Tensor) -> Tensor:
    """Functional collectives return ``AsyncCollectiveTensor`` in eager mode: wait, return a plain tensor."""
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _use_kernels(impl: str, e: Tensor) -> bool:
    if impl == "chunked":
        return False
    if impl == "kernels":
        if ops._kernels() is None:
            raise RuntimeError("impl='kernels' needs Triton and cce_inductor.kernels")
        return True
    return ops.uses_kernels(e.device, e.dtype) and e.shape[0] > 0


# --------------------------------------------------------------------------------------------------------------
# The per-shard computation, as two custom ops: opaque to Dynamo / Inductor (the chunked loops are not unrolled
# into the graph, the Triton launches are not traced), no communication inside.
#
# ``shard_targets`` encodes each row for this shard: the local column index of its target (>= 0), or
# _LOCAL_ELSEWHERE (the row counts, its target is in another shard), or _LOCAL_IGNORED (ignore_index).
# --------------------------------------------------------------------------------------------------------------


def _local_codes(shard_targets: Tensor) -> Tensor:
    """Targets with _LOCAL_IGNORED wherever no column of this shard is the target (no one-hot term here)."""
    return torch.where(shard_targets >= 0, shard_targets, _LOCAL_IGNORED)


@torch.library.custom_op("cce_inductor::vocab_shard_forward", mutates_args=())
def vocab_shard_forward(
    e: Tensor, c: Tensor, shard_targets: Tensor, bias: Optional[Tensor], softcap: float, vocab_sort: bool,
    use_kernels: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Per row: ``(lse over this shard, target logit if the target is in this shard else 0, aux)``."""
    cap = ops._softcap_or_none(softcap)
    n_rows, v_local = e.shape[0], c.shape[0]
    acc = _chunked.accumulation_dtype(e.dtype)
    in_shard = shard_targets >= 0
    if v_local == 0:  # an empty shard (V < world): contributes exp(-inf) = 0
        lse = torch.full((n_rows,), float("-inf"), dtype=torch.float32 if use_kernels else acc, device=e.device)
        target_logit = torch.zeros_like(lse)
        shape, dtype = _aux_spec(n_rows, v_local, vocab_sort, use_kernels)
        return lse, target_logit, torch.zeros(shape, dtype=dtype, device=e.device)
    if use_kernels:
        kernels = ops._kernels()
        # rows computed: every row that counts (also those whose target is elsewhere: it matches no column)
        row_compaction = kernels._config.compact_rows(shard_targets, _LOCAL_IGNORED)
        lse, target_logit, aux = kernels.forward(
            e, c, shard_targets, bias, softcap=cap, ignore_index=_LOCAL_IGNORED, vocab_sort=vocab_sort,
            row_compaction=row_compaction,
        )  # fmt: skip
    else:
        lse, target_logit = _chunked.forward(e, c, _local_codes(shard_targets), bias, softcap=cap,
                                             ignore_index=_LOCAL_IGNORED)  # fmt: skip
        aux = torch.zeros((0,), dtype=torch.float32, device=e.device)
    return lse, torch.where(in_shard, target_logit, 0.0), aux


def _aux_spec(n_rows, v_local, vocab_sort: bool, use_kernels: bool):
    if use_kernels:
        return ops._kernels().aux_spec(n_rows, v_local, vocab_sort)
    return (0,), torch.float32


@vocab_shard_forward.register_fake
def _(e, c, shard_targets, bias, softcap, vocab_sort, use_kernels):
    n_rows = e.shape[0]
    lse_dtype = torch.float32 if use_kernels else _chunked.accumulation_dtype(e.dtype)
    shape, dtype = _aux_spec(n_rows, c.shape[0], vocab_sort, use_kernels)
    lse = e.new_empty((n_rows,), dtype=lse_dtype)
    return lse, torch.empty_like(lse), e.new_empty(shape, dtype=dtype)


@torch.library.custom_op("cce_inductor::vocab_shard_backward", mutates_args=())
def vocab_shard_backward(
    e: Tensor, c: Tensor, shard_targets: Tensor, bias: Optional[Tensor], lse: Tensor, aux: Tensor,
    grad_rows: Tensor, softcap: float, filter_eps: float, vocab_sort: bool, exact: bool, use_kernels: bool,
    need_e: bool, need_c: bool, need_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """This shard's ``(dE contribution, dC_shard, dbias_shard)`` given the *global* ``lse``; empty if not needed."""
    need_bias = need_bias and bias is not None
    cap = ops._softcap_or_none(softcap)
    if c.shape[0] == 0:
        grad_e, grad_c = torch.zeros_like(e), torch.zeros_like(c)
        grad_bias = None if bias is None else torch.zeros_like(bias)
    elif use_kernels:
        kernels = ops._kernels()
        grad_e, grad_c, grad_bias = kernels.backward(
            e, c, _local_codes(shard_targets), bias, lse.float(), aux, grad_rows.float(),
            softcap=cap, ignore_index=_LOCAL_IGNORED, filter_eps=ops.kernel_filter_eps(filter_eps, exact, e.dtype),
            vocab_sort=vocab_sort, exact=exact,
            need_e=need_e, need_c=need_c, need_bias=need_bias,
            row_compaction=kernels._config.compact_rows(shard_targets, _LOCAL_IGNORED),
        )  # fmt: skip
    else:
        grad_e, grad_c, grad_bias = _chunked.backward(
            e, c, _local_codes(shard_targets), bias, lse, grad_rows,
            softcap=cap, need_e=need_e, need_c=need_c, need_bias=need_bias,
        )  # fmt: skip
    return (
        grad_e if need_e else e.new_empty(0),
        grad_c if need_c else e.new_empty(0),
        grad_bias if need_bias else e.new_empty(0),
    )


@vocab_shard_backward.register_fake
def _(e, c, shard_targets, bias, lse, aux, grad_rows, softcap, filter_eps, vocab_sort, exact, use_kernels,
      need_e, need_c, need_bias):  # fmt: skip
    need_bias = need_bias and bias is not None
    return (
        torch.empty_like(e, memory_format=torch.contiguous_format) if need_e else e.new_empty(0),
        torch.empty_like(c, memory_format=torch.contiguous_format) if need_c else e.new_empty(0),
        torch.empty_like(bias) if need_bias else e.new_empty(0),
    )


class _VocabParallelLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, e, c, targets, bias, vocab_start, vocab_size, group, softcap, ignore_index, reduction,
                use_kernels, filter_eps, vocab_sort, exact):  # fmt: skip
        valid = targets != ignore_index
        ops.check_target_range(targets, vocab_size, ignore_index)
        local = targets - vocab_start
        in_shard = valid & (local >= 0) & (local < c.shape[0])
        shard_targets = torch.where(valid, torch.where(in_shard, local, _LOCAL_ELSEWHERE), _LOCAL_IGNORED)
        lse_local, target_local, aux = vocab_shard_forward(e, c, shard_targets, bias, softcap, vocab_sort, use_kernels)

        # The one collective of the forward: every rank gets every rank's (lse, target logit).
        acc = _chunked.accumulation_dtype(e.dtype)
        world = dist.get_world_size(group)
        parts = torch.stack([lse_local.to(acc), target_local.to(acc)])  # (2, N)
        gathered = _wait(_all_gather_single(parts, 0, group)).view(world, 2, -1)
        lse = torch.logsumexp(gathered[:, 0], dim=0)
        target_logit = gathered[:, 1].sum(dim=0)

        row_loss = torch.where(valid, lse - target_logit, 0.0)
        if reduction == Reduction.NONE:
            loss = row_loss
        elif reduction == Reduction.SUM:
            loss = row_loss.sum()
        else:  # mean over non-ignored rows; 0/0 = NaN when all are ignored, as in PyTorch
            loss = row_loss.sum() / valid.sum()

        ctx.save_for_backward(e, c, bias, shard_targets, lse, aux)
        ctx.attrs = dict(softcap=softcap, filter_eps=filter_eps, vocab_sort=vocab_sort, exact=exact,
                         use_kernels=use_kernels)  # fmt: skip
        ctx.group, ctx.reduction = group, reduction
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        e, c, bias, shard_targets, lse, aux = ctx.saved_tensors
        need_e, need_c, _, need_bias = ctx.needs_input_grad[:4]
        need_bias = need_bias and bias is not None
        acc = _chunked.accumulation_dtype(e.dtype)
        valid = shard_targets != _LOCAL_IGNORED
        if ctx.reduction == Reduction.NONE:
            per_row = grad_loss.to(acc)
        elif ctx.reduction == Reduction.SUM:
            per_row = grad_loss.to(acc).expand(valid.shape[0])
        else:
            per_row = grad_loss.to(acc) / valid.sum()
        grad_rows = torch.where(valid, per_row, 0.0)
        grad_e, grad_c, grad_bias = vocab_shard_backward(
            e, c, shard_targets, bias, lse, aux, grad_rows, **ctx.attrs,
            need_e=need_e, need_c=need_c, need_bias=need_bias,
        )  # fmt: skip
        if need_e:
            # The one collective of the backward: dE is the sum of every shard's contribution.
            grad_e = _wait(funcol.all_reduce(grad_e, "sum", group=ctx.group))
        return (
            grad_e if need_e else None,
            grad_c if need_c else None,
            None,
            grad_bias if need_bias else None,
        ) + (None,) * 10


def vocab_parallel_linear_cross_entropy(
    e: Tensor,
    c_shard: Tensor,
    targets: Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group: Optional[dist.ProcessGroup] = None,
    bias_shard: Optional[Tensor] = None,
    softcap: Optional[float] = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    impl: str = "auto",
    filter_eps: Optional[float] = 0.0,
    vocab_sort: bool = False,
    exact: bool = False,
) -> Tensor:
    """``F.cross_entropy(softcap(e @ C.T + bias), targets)`` with ``C`` split by rows over the ranks of ``group``.

    Args:
        e: hidden states ``(..., D)``, the same on every rank of ``group``.
        c_shard: this rank's rows ``C[vocab_start : vocab_start + V_local]``, shape ``(V_local, D)``.
        targets: global class indices of shape ``e.shape[:-1]``, the same on every rank.
        vocab_start: index of this rank's first row in the full vocabulary.
        vocab_size: the full vocabulary size ``V`` (targets outside ``[0, V)`` other than ``ignore_index``
            raise, as in ``F.cross_entropy``).
        group: the tensor-parallel process group (default: the world).
        bias_shard: optional ``(V_local,)`` slice of the bias.
        softcap, ignore_index, reduction: as in :func:`cce_inductor.linear_cross_entropy`.
        impl: ``"auto"`` (Triton kernels on CUDA when available, else the chunked PyTorch path), ``"chunked"``
            or ``"kernels"`` (also on CPU tensors under ``TRITON_INTERPRET=1``, for tests).
        filter_eps, vocab_sort, exact: the kernels' backward options (see :class:`cce_inductor.CCEOptions`).

    Returns the loss (float32; float64 for float64 inputs), identical on every rank; ``e.grad`` is the full
    gradient (already summed over the group), ``c_shard.grad`` / ``bias_shard.grad`` this rank's slices.
    """
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    ops.check_public_args(e, c_shard, targets, softcap=softcap, reduction=reduction, filter_eps=filter_eps)
    if not (0 <= vocab_start and vocab_start + c_shard.shape[0] <= vocab_size):
        raise ValueError(f"shard [{vocab_start}, {vocab_start + c_shard.shape[0]}) is not inside [0, {vocab_size})")

    device_type = e.device.type
    e, c_shard, bias_shard = ops.autocast_inputs(e, c_shard, bias_shard)

    if group is None:
        group = dist.group.WORLD
    e2d = e.reshape(-1, e.shape[-1])
    flat_targets = targets.reshape(-1).long()
    if not torch.compiler.is_compiling():  # its torch._check messages are closures: a graph break under Dynamo
        ops.check_inputs(e2d, c_shard, flat_targets, bias_shard)
    with torch.autocast(device_type, enabled=False):
        loss = _VocabParallelLinearCrossEntropy.apply(
            e2d, c_shard, flat_targets, bias_shard, int(vocab_start), int(vocab_size), group,
            ops.NO_SOFTCAP if softcap is None else float(softcap), int(ignore_index), Reduction.BY_NAME[reduction],
            _use_kernels(impl, e2d), ops.AUTO_FILTER_EPS if filter_eps is None else float(filter_eps),
            bool(vocab_sort), bool(exact),
        )  # fmt: skip
    if reduction == "none":
        loss = loss.view(targets.shape)
    return loss


def dtensor_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Optional[Tensor] = None,
    softcap: Optional[float] = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    **options,
) -> Tensor:
    """The DTensor form: what ``loss_parallel()`` + ``F.cross_entropy(F.linear(hidden, weight, bias))`` computes
    for a vocabulary-sharded head (``ColwiseParallel``), without the logits.

    ``weight`` is a DTensor ``Shard(0)`` on a 1-D mesh (``bias`` likewise, if given); ``hidden`` a DTensor
    (redistributed to ``Replicate``) or a plain tensor equal on all ranks; ``targets`` a plain tensor or a
    DTensor (made ``Replicate``). Returns a ``Replicate`` DTensor, as ``loss_parallel`` does; the gradients
    reach ``hidden`` as ``Replicate`` and ``weight`` / ``bias`` as ``Shard(0)``. ``options`` go to
    :func:`vocab_parallel_linear_cross_entropy` (``impl``, ``filter_eps``, ...). Traceable by Dynamo.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: PLC0415

    if not isinstance(weight, DTensor):
        raise TypeError("weight must be a DTensor sharded by vocabulary rows (Shard(0)), e.g. from ColwiseParallel")
    mesh = weight.device_mesh
    if mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise ValueError(f"weight must be Shard(0) on a 1-D mesh, got {weight.placements} on a {mesh.ndim}-D mesh")
    if bias is not None and (not isinstance(bias, DTensor) or tuple(bias.placements) != (Shard(0),)):
        raise ValueError("bias must be a DTensor with placement Shard(0) like the weight")
    if isinstance(hidden, DTensor):
        hidden = hidden.redistribute(mesh, [Replicate()]).to_local()
    if isinstance(targets, DTensor):
        targets = targets.redistribute(mesh, [Replicate()]).to_local()
    # Shard(0) splits rows as torch.chunk does (the mesh rank is a Python int, also under Dynamo)
    vocab_start, _ = vocab_shard_range(weight.shape[0], mesh.get_local_rank(), mesh.size())
    loss = vocab_parallel_linear_cross_entropy(
        hidden, weight.to_local(), targets, vocab_start=vocab_start, vocab_size=weight.shape[0],
        group=mesh.get_group(), bias_shard=None if bias is None else bias.to_local(), softcap=softcap,
        ignore_index=ignore_index, reduction=reduction, **options,
    )  # fmt: skip
    return DTensor.from_local(loss, mesh, [Replicate()], run_check=False)


# --------------------------------------------------------------------------------------------------------------
# Prototype graph pass: rewrite a vocabulary-sharded (DTensor) head + loss_parallel cross-entropy
# --------------------------------------------------------------------------------------------------------------


def _is_redistribute(node) -> bool:
    if node.op == "call_method":
        return node.target == "redistribute"
    # torch <= 2.11: Dynamo captures DTensor.redistribute as a generated function named prim_redistribute
    return node.op == "call_function" and getattr(node.target, "__name__", "") == "prim_redistribute"


def _is_noop_redistribute(node) -> bool:
    """``x.redistribute(...)`` whose output has the placements of its input (ColwiseParallel's output hook)."""
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    from .fx_passes.linear_cross_entropy import _meta  # noqa: PLC0415

    if not _is_redistribute(node) or not node.args:
        return False
    src, out = _meta(node.args[0]), _meta(node)
    return (
        isinstance(src, DTensor) and isinstance(out, DTensor) and src.device_mesh == out.device_mesh
        and tuple(src.placements) == tuple(out.placements) and src.dtype == out.dtype and src.shape == out.shape
    )  # fmt: skip


def _tensor_parallel_reason(site) -> Optional[str]:
    """Why ``site`` (matched on DTensor metas) is not a vocabulary-parallel head, or None if it is."""
    from torch.distributed.tensor import DTensor, Shard  # noqa: PLC0415

    from .fx_passes.linear_cross_entropy import _meta  # noqa: PLC0415

    weight, logits = _meta(site.weight), _meta(site.head)
    if not isinstance(weight, DTensor) or not isinstance(logits, DTensor):
        return "mixed DTensor and plain tensors between head and loss"
    if weight.device_mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        return f"head weight placements {weight.placements} (need Shard(0) on a 1-D mesh)"
    (placement,) = logits.placements
    if not (placement.is_shard() and placement.dim in (-1, logits.dim() - 1)):
        return f"logits placements {logits.placements} (need the vocabulary dimension sharded)"
    for name, node in (("hidden states", site.hidden), ("targets", site.targets)):
        meta = _meta(node)
        if isinstance(meta, DTensor) and not all(p.is_replicate() for p in meta.placements):
            return f"{name} are {meta.placements}, not replicated"
    if site.weight_is_transposed:
        return "a (D, V) head weight under tensor parallelism"
    if site.bias is not None:
        bias = _meta(site.bias)
        if not isinstance(bias, DTensor) or tuple(bias.placements) != (Shard(0),):
            return "head bias is not Shard(0)"
    if site.escaping:
        return "the logits escape the compiled region"
    return None


def rewrite_tensor_parallel_sites(graph, options=None) -> int:
    """Rewrite ``DTensor`` sites ``linear(h, W: Shard(0)) -> [no-op redistribute] -> views -> [softcap] ->
    cross_entropy`` (``ColwiseParallel(use_local_output=False)`` + ``loss_parallel``) into
    :func:`dtensor_linear_cross_entropy`. Sites on plain tensors are left to the main pass. Returns the count.

    A prototype to be folded into ``fx_passes/linear_cross_entropy.py``; run it before the main pass (as a
    ``pre_grad_custom_pass`` that ``cce_inductor``'s backend chains, see :class:`TensorParallelGraphPass`).
    """
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    from . import diagnostics  # noqa: PLC0415
    from .fx_passes import linear_cross_entropy as pattern  # noqa: PLC0415
    from .options import CCEOptions  # noqa: PLC0415

    options = options or CCEOptions()
    def _ce_input(node):
        return node.args[0] if node.args else node.kwargs.get("input")

    sites = [
        node for node in graph.nodes
        if pattern._is(node, pattern.CROSS_ENTROPY) and isinstance(pattern._meta(_ce_input(node)), DTensor)
    ]  # fmt: skip
    if not sites:
        return 0
    graph_id = diagnostics.new_graph()
    for node in list(graph.nodes):
        if _is_noop_redistribute(node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    names = {code: name for name, code in Reduction.BY_NAME.items()}
    rewritten = 0
    for ce in sites:
        try:
            site = pattern.match_site(ce)
            reason = _tensor_parallel_reason(site)
            if reason is not None:
                raise pattern.NoMatch(f"tensor parallel: {reason}")
        except pattern.NoMatch as why:
            diagnostics.record(diagnostics.SiteDecision(graph_id, ce.name, False, str(why)))
            continue
        except Exception as exc:  # noqa: BLE001 - never break compilation
            diagnostics.record(diagnostics.SiteDecision(graph_id, ce.name, False, f"not understood ({exc})"))
            continue
        fused = pattern.rewrite_site(graph, site, options)  # the row views, casts and chain removal
        rows, weight, targets, bias, softcap, ignore_index, reduction, filter_eps, vocab_sort, exact = fused.args
        (loss_getitem,) = fused.users
        with graph.inserting_before(fused):
            loss = graph.call_function(
                dtensor_linear_cross_entropy,
                (rows, weight, targets),
                dict(bias=bias, softcap=None if softcap == ops.NO_SOFTCAP else softcap, ignore_index=ignore_index,
                     reduction=names[reduction], filter_eps=None if filter_eps == ops.AUTO_FILTER_EPS else filter_eps,
                     vocab_sort=vocab_sort, exact=exact),
            )  # fmt: skip
        loss_getitem.replace_all_uses_with(loss)
        graph.erase_node(loss_getitem)
        graph.erase_node(fused)
        rewritten += 1
        diagnostics.record(diagnostics.SiteDecision(
            graph_id, ce.name, True, f"tensor parallel (vocabulary-sharded head): {pattern._describe(site)}"
        ))  # fmt: skip
    if rewritten:
        graph.lint()
    return rewritten


class TensorParallelGraphPass(_CustomGraphPass):
    """``torch._inductor.config.pre_grad_custom_pass`` running :func:`rewrite_tensor_parallel_sites`; the
    ``cce_inductor`` backend / ``enable()`` chain it before the main pass::

        torch._inductor.config.pre_grad_custom_pass = TensorParallelGraphPass()
        model = torch.compile(model, backend=cce_inductor.backend)
    """

    def __init__(self, options=None) -> None:
        from .options import CCEOptions  # noqa: PLC0415

        self.options = options or CCEOptions()

    def __call__(self, graph) -> None:
        rewrite_tensor_parallel_sites(graph, self.options)

    def uuid(self):
        from .graph_pass import _source_hash  # noqa: PLC0415

        return f"cce_inductor-tp-{_source_hash()}-{self.options.cache_key()}"
