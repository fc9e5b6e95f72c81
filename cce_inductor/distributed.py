"""Vocabulary-parallel Cut Cross-Entropy for tensor parallelism.

With a column-parallel (vocabulary-sharded) output head each rank of a tensor-parallel group holds the rows
``[vocab_start, vocab_start + V_local)`` of the classifier ``C`` (``ColwiseParallel`` on ``lm_head`` in
``torch.distributed.tensor.parallel``, Megatron's ``ColumnParallelLinear`` with ``gather_output=False``).
:func:`vocab_parallel_linear_cross_entropy` computes

    F.cross_entropy(softcap(e @ C_full.T + bias_full), targets, ignore_index=..., reduction=...)

from the shards without materialising any logits, neither the full ``N x V`` nor the local ``N x V_local``:

forward
    every rank runs the dispatched implementation (``cce_inductor._dispatch.forward``: the Triton kernels on CUDA,
    else the chunked path) on its shard and gets, per row, the log-sum-exp over its shard ``lse_r`` and the target
    logit if the target lies in its shard (else 0). **One collective**: an all-gather of the ``(2, N)`` pair
    (``2 * N * world`` floats, a few KB), after which every rank has ``lse = logsumexp_r(lse_r)`` and
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

Also here: :func:`dtensor_linear_cross_entropy`, the same on DTensors (``weight`` ``Shard(0)`` on a 1-D mesh, as
``ColwiseParallel`` leaves it), returning a ``Replicate`` DTensor like ``loss_parallel``; the graph pass
``cce_inductor/fx_passes/tensor_parallel.py`` rewrites compiled ``ColwiseParallel`` heads into it.

DDP and FSDP2 need nothing from this module: the main pass rewrites their compiled graphs as they are (see
``tests/test_distributed.py``), except when ``lm_head`` is an FSDP unit of its own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from . import _checks, _chunked, _dispatch, _loss, diagnostics
from .options import CCEOptions

__all__ = ["vocab_parallel_linear_cross_entropy", "dtensor_linear_cross_entropy", "vocab_shard_range"]

# Local target codes handed to the per-shard computation (independent of the user's ignore_index).
_LOCAL_IGNORED = -1  # the row's target is ignore_index: the row is not part of the loss
_LOCAL_ELSEWHERE = -2  # the row counts, but its target is in another rank's shard

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


# --------------------------------------------------------------------------------------------------------------
# The per-shard computation, as two custom ops: opaque to Dynamo / Inductor (the chunked loops are not unrolled
# into the graph, the Triton launches are not traced), no communication inside.
#
# ``shard_targets`` encodes each row for this shard: the local column index of its target (>= 0), or
# _LOCAL_ELSEWHERE (the row counts, its target is in another shard), or _LOCAL_IGNORED (ignore_index): both
# implementations (``_dispatch``) take a target outside [0, V_local) as "counts, with no one-hot term here".
# --------------------------------------------------------------------------------------------------------------


@torch.library.custom_op("cce_inductor::vocab_shard_forward", mutates_args=())
def vocab_shard_forward(
    e: Tensor, c: Tensor, shard_targets: Tensor, bias: Tensor | None, softcap: float | None
) -> tuple[Tensor, Tensor]:
    """Per row: ``(lse over this shard, target logit if the target is in this shard else 0)``."""
    diagnostics.count_execution("vocab_parallel")
    n_rows, v_local = e.shape[0], c.shape[0]
    in_shard = shard_targets >= 0
    if v_local == 0:  # an empty shard (V < world): contributes exp(-inf) = 0
        lse = torch.full((n_rows,), float("-inf"), dtype=_dispatch.lse_dtype(e.device, e.dtype), device=e.device)
        return lse, torch.zeros_like(lse)
    lse, target_logit, *_ = _dispatch.forward(e, c, shard_targets, bias, softcap=softcap, ignore_index=_LOCAL_IGNORED)
    return lse, torch.where(in_shard, target_logit, 0.0)


@vocab_shard_forward.register_fake
def _(e, c, shard_targets, bias, softcap):
    lse = e.new_empty((e.shape[0],), dtype=_dispatch.lse_dtype(e.device, e.dtype))
    return lse, torch.empty_like(lse)


@torch.library.custom_op("cce_inductor::vocab_shard_backward", mutates_args=())
def vocab_shard_backward(
    e: Tensor,
    c: Tensor,
    shard_targets: Tensor,
    bias: Tensor | None,
    lse: Tensor,
    grad_rows: Tensor,
    softcap: float | None,
    options: str,
    need_e: bool,
    need_c: bool,
    need_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """This shard's ``(dE contribution, dC_shard, dbias_shard)`` given the *global* ``lse``; empty if not needed."""
    need_bias = need_bias and bias is not None
    if c.shape[0] == 0:
        grad_e, grad_c = torch.zeros_like(e), torch.zeros_like(c)
        grad_bias = None if bias is None else torch.zeros_like(bias)
    else:
        grad_e, grad_c, grad_bias = _dispatch.backward(
            e,
            c,
            shard_targets,
            bias,
            lse,
            grad_rows,
            softcap=softcap,
            ignore_index=_LOCAL_IGNORED,
            options=CCEOptions.decode(options),
            need_e=need_e,
            need_c=need_c,
            need_bias=need_bias,
        )
    return (
        _loss.empty_unless(need_e, grad_e, e),
        _loss.empty_unless(need_c, grad_c, e),
        _loss.empty_unless(need_bias, grad_bias, e),
    )


@vocab_shard_backward.register_fake
def _(e, c, shard_targets, bias, lse, grad_rows, softcap, options, need_e, need_c, need_bias):
    return _loss.grad_outputs_fake(e, c, bias, need_e, need_c, need_bias)


class _VocabParallelLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, e, c, targets, bias, vocab_start, vocab_size, group, softcap, ignore_index, reduction, options):
        valid = targets != ignore_index
        _checks.check_target_range(targets, vocab_size, ignore_index)
        local = targets - vocab_start
        in_shard = valid & (local >= 0) & (local < c.shape[0])
        shard_targets = torch.where(valid, torch.where(in_shard, local, _LOCAL_ELSEWHERE), _LOCAL_IGNORED)
        lse_local, target_local = vocab_shard_forward(e, c, shard_targets, bias, softcap)

        # The one collective of the forward: every rank gets every rank's (lse, target logit).
        acc = _chunked.accumulation_dtype(e.dtype)
        world = dist.get_world_size(group)
        parts = torch.stack([lse_local.to(acc), target_local.to(acc)])  # (2, N)
        gathered = _wait(_all_gather_single(parts, 0, group)).view(world, 2, -1)
        lse = torch.logsumexp(gathered[:, 0], dim=0)
        target_logit = gathered[:, 1].sum(dim=0)
        loss = _loss.reduce_rows(torch.where(valid, lse - target_logit, 0.0), valid, reduction)

        ctx.save_for_backward(e, c, bias, shard_targets, lse)
        ctx.softcap, ctx.options, ctx.group, ctx.reduction = softcap, options, group, reduction
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        e, c, bias, shard_targets, lse = ctx.saved_tensors
        need_e, need_c, _, need_bias = ctx.needs_input_grad[:4]
        need_bias = need_bias and bias is not None
        valid = shard_targets != _LOCAL_IGNORED
        grad_rows = _loss.grad_rows(grad_loss, valid, ctx.reduction, _chunked.accumulation_dtype(e.dtype))
        grad_e, grad_c, grad_bias = vocab_shard_backward(
            e,
            c,
            shard_targets,
            bias,
            lse,
            grad_rows,
            ctx.softcap,
            ctx.options,
            need_e=need_e,
            need_c=need_c,
            need_bias=need_bias,
        )
        if need_e:
            # The one collective of the backward: dE is the sum of every shard's contribution.
            grad_e = _wait(funcol.all_reduce(grad_e, "sum", group=ctx.group))
        return (
            grad_e if need_e else None,
            grad_c if need_c else None,
            None,
            grad_bias if need_bias else None,
        ) + (None,) * 7


def vocab_parallel_linear_cross_entropy(
    e: Tensor,
    c_shard: Tensor,
    targets: Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group: dist.ProcessGroup | None = None,
    bias_shard: Tensor | None = None,
    softcap: float | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    options: CCEOptions | str | None = None,
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
        options: as in :func:`cce_inductor.linear_cross_entropy` (Triton kernels on CUDA, else the chunked path),
            or their ``CCEOptions.encode()`` string (what a graph holds: a graph's constants are plain values).

    Returns the loss (float32; float64 for float64 inputs), identical on every rank; ``e.grad`` is the full
    gradient (already summed over the group), ``c_shard.grad`` / ``bias_shard.grad`` this rank's slices.
    """
    _checks.check_public_args(e, c_shard, targets, softcap=softcap, reduction=reduction)
    if not (0 <= vocab_start and vocab_start + c_shard.shape[0] <= vocab_size):
        raise ValueError(f"shard [{vocab_start}, {vocab_start + c_shard.shape[0]}) is not inside [0, {vocab_size})")

    device_type = e.device.type
    e, c_shard, bias_shard = _checks.autocast_inputs(e, c_shard, bias_shard)

    if group is None:
        group = dist.group.WORLD
    e2d = e.reshape(-1, e.shape[-1])
    flat_targets = targets.reshape(-1).long()
    if not torch.compiler.is_compiling():  # its torch._check messages are closures: a graph break under Dynamo
        _checks.check_inputs(e2d, c_shard, flat_targets, bias_shard)
    with torch.autocast(device_type, enabled=False):
        loss = _VocabParallelLinearCrossEntropy.apply(
            e2d,
            c_shard,
            flat_targets,
            bias_shard,
            int(vocab_start),
            int(vocab_size),
            group,
            None if softcap is None else float(softcap),
            int(ignore_index),
            reduction,
            options if isinstance(options, str) else (options or CCEOptions()).encode(),
        )
    if reduction == "none":
        loss = loss.view(targets.shape)
    return loss


def dtensor_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    softcap: float | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    options: CCEOptions | str | None = None,
) -> Tensor:
    """The DTensor form: what ``loss_parallel()`` + ``F.cross_entropy(F.linear(hidden, weight, bias))`` computes
    for a vocabulary-sharded head (``ColwiseParallel``), without the logits.

    ``weight`` is a DTensor ``Shard(0)`` on a 1-D mesh (``bias`` likewise, if given); ``hidden`` a DTensor
    (redistributed to ``Replicate``) or a plain tensor equal on all ranks; ``targets`` a plain tensor or a
    DTensor (made ``Replicate``). Returns a ``Replicate`` DTensor, as ``loss_parallel`` does; the gradients
    reach ``hidden`` as ``Replicate`` and ``weight`` / ``bias`` as ``Shard(0)``. ``options`` as for
    :func:`vocab_parallel_linear_cross_entropy`. Traceable by Dynamo.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

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
        hidden,
        weight.to_local(),
        targets,
        vocab_start=vocab_start,
        vocab_size=weight.shape[0],
        group=mesh.get_group(),
        bias_shard=None if bias is None else bias.to_local(),
        softcap=softcap,
        ignore_index=ignore_index,
        reduction=reduction,
        options=options,
    )
    return DTensor.from_local(loss, mesh, [Replicate()], run_check=False)
