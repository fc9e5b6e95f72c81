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

Collectives are ``torch.distributed._functional_collectives`` (traceable by Dynamo, no host sync); the
computation is a ``torch.autograd.Function``. Every rank must call it (it is a collective).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from . import _chunked, ops
from .ops import Reduction

__all__ = ["vocab_parallel_linear_cross_entropy", "vocab_shard_range"]

# Local target codes handed to the per-shard computation (independent of the user's ignore_index).
_LOCAL_IGNORED = -1  # the row's target is ignore_index: the row is not part of the loss
_LOCAL_ELSEWHERE = -2  # the row counts, but its target is in another rank's shard (kernel path only)

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


def _check_target_range(targets: Tensor, valid: Tensor, vocab_size: int) -> None:
    out_of_range = valid & ((targets < 0) | (targets >= vocab_size))
    if targets.device.type == "cuda":
        torch._assert_async(~out_of_range.any(), "cce_inductor: target out of bounds (not ignore_index and not in [0, V))")
    elif out_of_range.any():
        raise IndexError(f"Target {int(targets[out_of_range][0])} is out of bounds.")


class _VocabParallelLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, e, c, targets, bias, vocab_start, vocab_size, group, softcap, ignore_index, reduction, impl,
                filter_eps, vocab_sort, exact):  # fmt: skip
        v_local = c.shape[0]
        valid = targets != ignore_index
        _check_target_range(targets, valid, vocab_size)
        local = targets - vocab_start
        in_shard = valid & (local >= 0) & (local < v_local)
        acc = _chunked.accumulation_dtype(e.dtype)
        use_kernels = _use_kernels(impl, e)

        if use_kernels:
            kernels = ops._kernels()
            # Forward: rows to compute are the globally valid ones; a target in another shard matches no column.
            fwd_targets = torch.where(
                valid, torch.where(in_shard, local, _LOCAL_ELSEWHERE), _LOCAL_IGNORED
            )  # fmt: skip
            row_compaction = kernels._config.compact_rows(fwd_targets, _LOCAL_IGNORED)
            lse_local, target_local, aux = kernels.forward(
                e, c, fwd_targets, bias, softcap=softcap, ignore_index=_LOCAL_IGNORED, vocab_sort=vocab_sort,
                row_compaction=row_compaction,
            )  # fmt: skip
        elif v_local == 0:  # an empty shard (V < world): contributes exp(-inf) = 0
            row_compaction = None
            lse_local = torch.full(valid.shape, float("-inf"), dtype=acc, device=e.device)
            target_local = torch.zeros(valid.shape, dtype=acc, device=e.device)
            aux = e.new_empty(0, dtype=torch.float32)
        else:
            row_compaction = None
            fwd_targets = torch.where(in_shard, local, _LOCAL_IGNORED)
            lse_local, target_local = _chunked.forward(
                e, c, fwd_targets, bias, softcap=softcap, ignore_index=_LOCAL_IGNORED
            )  # fmt: skip
            aux = e.new_empty(0, dtype=torch.float32)
        target_local = torch.where(in_shard, target_local, 0.0)

        # The one collective of the forward: every rank gets every rank's (lse, target logit).
        world = dist.get_world_size(group)
        parts = torch.stack([lse_local, target_local]).to(acc)  # (2, N)
        gathered = _wait(_all_gather_single(parts, 0, group))  # (world * 2, N)
        gathered = gathered.view(world, 2, -1)
        lse = torch.logsumexp(gathered[:, 0], dim=0)
        target_logit = gathered[:, 1].sum(dim=0)

        row_loss = torch.where(valid, lse - target_logit, 0.0)
        if reduction == Reduction.NONE:
            loss = row_loss
        elif reduction == Reduction.SUM:
            loss = row_loss.sum()
        else:  # mean over non-ignored rows; 0/0 = NaN when all are ignored, as in PyTorch
            loss = row_loss.sum() / valid.sum()

        # Backward targets: the local index, or a code that is neither a column nor a (kernel) valid row.
        bwd_targets = torch.where(in_shard, local, _LOCAL_IGNORED)
        ctx.save_for_backward(e, c, bias, bwd_targets, valid, lse, aux)
        ctx.row_compaction = row_compaction
        ctx.use_kernels = use_kernels
        ctx.group = group
        ctx.softcap = softcap
        ctx.reduction = reduction
        ctx.filter_eps, ctx.vocab_sort, ctx.exact = filter_eps, vocab_sort, exact
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        e, c, bias, bwd_targets, valid, lse, aux = ctx.saved_tensors
        need_e, need_c, _, need_bias = ctx.needs_input_grad[:4]
        need_bias = need_bias and bias is not None
        acc = _chunked.accumulation_dtype(e.dtype)
        if ctx.reduction == Reduction.NONE:
            per_row = grad_loss.to(acc)
        elif ctx.reduction == Reduction.SUM:
            per_row = grad_loss.to(acc).expand(valid.shape[0])
        else:
            per_row = grad_loss.to(acc) / valid.sum()
        grad_rows = torch.where(valid, per_row, 0.0)

        if ctx.use_kernels:
            kernels = ops._kernels()
            if ctx.exact:
                eps = 0.0
            elif ctx.filter_eps is None:
                eps = kernels.default_filter_eps(e.dtype)
            else:
                eps = ctx.filter_eps
            grad_e, grad_c, grad_bias = kernels.backward(
                e, c, bwd_targets, bias, lse.float(), aux, grad_rows.float(),
                softcap=ctx.softcap, ignore_index=_LOCAL_IGNORED, filter_eps=eps, vocab_sort=ctx.vocab_sort,
                exact=ctx.exact, need_e=need_e, need_c=need_c, need_bias=need_bias,
                row_compaction=ctx.row_compaction,
            )  # fmt: skip
        else:
            grad_e, grad_c, grad_bias = _chunked.backward(
                e, c, bwd_targets, bias, lse, grad_rows,
                softcap=ctx.softcap, need_e=need_e, need_c=need_c, need_bias=need_bias,
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
    filter_eps: Optional[float] = None,
    vocab_sort: bool = True,
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
    if reduction not in Reduction.BY_NAME:
        raise ValueError(f"reduction must be one of {sorted(Reduction.BY_NAME)}, got {reduction!r}")
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    if e.dim() < 1 or c_shard.dim() != 2:
        raise ValueError(f"expected e of shape (..., D) and c_shard of shape (V_local, D), got {tuple(e.shape)} and {tuple(c_shard.shape)}")
    if tuple(targets.shape) != tuple(e.shape[:-1]):
        raise ValueError(f"targets must have shape {tuple(e.shape[:-1])} (e's leading dims), got {tuple(targets.shape)}")
    if not (0 <= vocab_start and vocab_start + c_shard.shape[0] <= vocab_size):
        raise ValueError(f"shard [{vocab_start}, {vocab_start + c_shard.shape[0]}) is not inside [0, {vocab_size})")

    device_type = e.device.type
    if torch.is_autocast_enabled(device_type) and e.dtype.is_floating_point:
        autocast_dtype = torch.get_autocast_dtype(device_type)
        e, c_shard = e.to(autocast_dtype), c_shard.to(autocast_dtype)
        bias_shard = None if bias_shard is None else bias_shard.to(autocast_dtype)

    if group is None:
        group = dist.group.WORLD
    e2d = e.reshape(-1, e.shape[-1])
    flat_targets = targets.reshape(-1).long()
    ops.check_inputs(e2d, c_shard, flat_targets, bias_shard)
    with torch.autocast(device_type, enabled=False):
        loss = _VocabParallelLinearCrossEntropy.apply(
            e2d, c_shard, flat_targets, bias_shard, int(vocab_start), int(vocab_size), group,
            None if softcap is None else float(softcap), int(ignore_index), Reduction.BY_NAME[reduction], impl,
            filter_eps, bool(vocab_sort), bool(exact),
        )  # fmt: skip
    if reduction == "none":
        loss = loss.view(targets.shape)
    return loss
