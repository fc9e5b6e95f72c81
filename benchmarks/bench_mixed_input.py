"""Probe (Hopper, Gluon): products that read autocast's fp32 head and convert each tile to bf16 on chip.

Every variant measured in engineering log v40 (its figures: results/2026-11-29_h200_mixed-input-products_v40.log):
the pipeline on the bf16 copy (the control), the head as the register operand, converted into a shared-memory ring,
read from global memory, persistent, and two warp-specialised forms (a feeder partition converting for the MMA warps).

    python benchmarks/bench_mixed_input.py [R D V]      # default 2048 4096 128256: one row chunk of Llama-3's head

logits[N, V] = E[N, D] (bf16) @ bf16(C[V, D])^T      C fp32, converted per tile
dE[N, D]     = G[N, V] (bf16) @ bf16(C[V, D])         fp32 out

The head is the wgmma A operand: C's fp32 tile comes through TMA into shared memory, each warpgroup loads its rows
into registers, converts them, and issues an async wgmma with B (E's / G's tile) from shared memory; the results are
written transposed.  REG_A=False instead stores the converted tile back to shared memory (a ring of two) for a
shared-memory A.
"""

import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper as H
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
_bar = getattr(gl, "thread_barrier", None) or getattr(gl, "barrier", None)
fence_async_shared_ = H.fence_async_shared


@gluon.jit
def logits_kernel(
    c_desc,
    e_desc,
    o_desc,
    K,
    num_n,
    STAGES: gl.constexpr,
    REG_A: gl.constexpr,
    num_warps: gl.constexpr,
    DIRECT: gl.constexpr = False,
):
    BV: gl.constexpr = c_desc.block_type.shape[0]
    BK: gl.constexpr = c_desc.block_type.shape[1]
    BN: gl.constexpr = e_desc.block_type.shape[0]
    pid = gl.program_id(0)
    pid_n = pid % num_n
    pid_v = pid // num_n
    off_v = pid_v * BV
    off_n = pid_n * BN

    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [STAGES, BV, BK], c_desc.layout)
    e_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, BK], e_desc.layout)
    ab_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BV, BK], gl.bfloat16)
    if not REG_A:
        ab_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BV, BK], ab_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for p in gl.static_range(STAGES):
        mbarrier.init(ready.index(p), count=1)
    nbytes: gl.constexpr = c_desc.block_type.nbytes + e_desc.block_type.nbytes
    num_k = gl.cdiv(K, BK)
    for p in gl.static_range(STAGES):
        mbarrier.expect(ready.index(p), nbytes, pred=p < num_k)
        _load(c_desc, [off_v, p * BK], ready.index(p), c_smem.index(p), pred=p < num_k)
        _load(e_desc, [off_n, p * BK], ready.index(p), e_smem.index(p), pred=p < num_k)

    acc = gl.zeros([BV, BN], gl.float32, mma_layout)
    for i in range(num_k):
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        if DIRECT:
            acc = H.warpgroup_mma(c_smem.index(s), e_smem.index(s).permute((1, 0)), acc, is_async=True)
            acc = H.warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        elif REG_A:
            a = c_smem.index(s).load(a_layout).to(gl.bfloat16)
            acc = H.warpgroup_mma(a, e_smem.index(s).permute((1, 0)), acc, is_async=True)
            acc = H.warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        else:
            blk: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [num_warps, 1], [1, 0])
            a = c_smem.index(s).load(blk).to(gl.bfloat16)
            ab = ab_smem.index(i % 2)
            ab.store(a)
            H.fence_async_shared()
            _bar()
            acc = H.warpgroup_mma(ab, e_smem.index(s).permute((1, 0)), acc, is_async=True)
            acc = H.warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        j = i - 1 + STAGES
        sp = (i + STAGES - 1) % STAGES
        refill = (i > 0) & (j < num_k)
        mbarrier.expect(ready.index(sp), nbytes, pred=refill)
        _load(c_desc, [off_v, j * BK], ready.index(sp), c_smem.index(sp), pred=refill)
        _load(e_desc, [off_n, j * BK], ready.index(sp), e_smem.index(sp), pred=refill)
    acc = H.warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    for p in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(p))
    out = gl.permute(acc.to(gl.bfloat16), (1, 0))
    o_smem = gl.allocate_shared_memory(gl.bfloat16, [BN, BV], o_desc.layout)
    o_smem.store(out)
    H.fence_async_shared()
    _store(o_desc, [off_n, off_v], o_smem)
    tma.store_wait(0)


@gluon.jit
def de_kernel(c_desc, g_desc, o_desc, K, num_n, STAGES: gl.constexpr, num_warps: gl.constexpr):
    # dE^T[BD, BR] = sum_k bf16(C[k, BD])^T @ G[BR, k]^T ; K = V
    BK: gl.constexpr = c_desc.block_type.shape[0]
    BD: gl.constexpr = c_desc.block_type.shape[1]
    BR: gl.constexpr = g_desc.block_type.shape[0]
    pid = gl.program_id(0)
    pid_n = pid % num_n
    pid_d = pid // num_n
    off_d = pid_d * BD
    off_r = pid_n * BR

    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BR, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    c_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BK, BD], c_desc.layout)
    g_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BR, BK], g_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for p in gl.static_range(STAGES):
        mbarrier.init(ready.index(p), count=1)
    nbytes: gl.constexpr = c_desc.block_type.nbytes + g_desc.block_type.nbytes
    num_k = gl.cdiv(K, BK)
    for p in gl.static_range(STAGES):
        mbarrier.expect(ready.index(p), nbytes, pred=p < num_k)
        _load(c_desc, [p * BK, off_d], ready.index(p), c_smem.index(p), pred=p < num_k)
        _load(g_desc, [off_r, p * BK], ready.index(p), g_smem.index(p), pred=p < num_k)

    acc = gl.zeros([BD, BR], gl.float32, mma_layout)
    for i in range(num_k):
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        a = c_smem.index(s).permute((1, 0)).load(a_layout).to(gl.bfloat16)
        acc = H.warpgroup_mma(a, g_smem.index(s).permute((1, 0)), acc, is_async=True)
        acc = H.warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        j = i - 1 + STAGES
        sp = (i + STAGES - 1) % STAGES
        refill = (i > 0) & (j < num_k)
        mbarrier.expect(ready.index(sp), nbytes, pred=refill)
        _load(c_desc, [j * BK, off_d], ready.index(sp), c_smem.index(sp), pred=refill)
        _load(g_desc, [off_r, j * BK], ready.index(sp), g_smem.index(sp), pred=refill)
    acc = H.warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    for p in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(p))
    out = gl.permute(acc, (1, 0))
    o_smem = gl.allocate_shared_memory(gl.float32, [BR, BD], o_desc.layout)
    o_smem.store(out)
    H.fence_async_shared()
    _store(o_desc, [off_r, off_d], o_smem)
    tma.store_wait(0)


@gluon.jit
def _tile_offsets(jt, num_k, num_n, pid, NPROG: gl.constexpr, BA: gl.constexpr, BB: gl.constexpr, BK: gl.constexpr):
    t = jt // num_k
    kk = jt - t * num_k
    tile = pid + t * NPROG
    pid_b = tile % num_n
    pid_a = tile // num_n
    return pid_a * BA, pid_b * BB, kk * BK


@gluon.jit
def logits_persistent_kernel(
    c_desc, e_desc, o_desc, K, num_n, num_tiles, STAGES: gl.constexpr, NPROG: gl.constexpr, num_warps: gl.constexpr
):
    """logits tile [BN, BV] = E[BN, K] @ bf16(C[BV, K])^T, persistent over tiles; loads run ahead across tiles and
    each tile's TMA store drains under the next tile's loop."""
    BV: gl.constexpr = c_desc.block_type.shape[0]
    BK: gl.constexpr = c_desc.block_type.shape[1]
    BN: gl.constexpr = e_desc.block_type.shape[0]
    pid = gl.program_id(0)
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    c_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BV, BK], c_desc.layout)
    e_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, BK], e_desc.layout)
    o_smem = gl.allocate_shared_memory(gl.bfloat16, [BN, BV], o_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for p in gl.static_range(STAGES):
        mbarrier.init(ready.index(p), count=1)
    nbytes: gl.constexpr = c_desc.block_type.nbytes + e_desc.block_type.nbytes
    num_k = gl.cdiv(K, BK)
    my_tiles = gl.cdiv(num_tiles - pid, NPROG)
    total = my_tiles * num_k
    for p in gl.static_range(STAGES):
        ov, on, ok = _tile_offsets(p, num_k, num_n, pid, NPROG, BV, BN, BK)
        mbarrier.expect(ready.index(p), nbytes, pred=p < total)
        _load(c_desc, [ov, ok], ready.index(p), c_smem.index(p), pred=p < total)
        _load(e_desc, [on, ok], ready.index(p), e_smem.index(p), pred=p < total)
    it = 0
    for t in range(my_tiles):
        tile = pid + t * NPROG
        off_n = (tile % num_n) * BN
        off_v = (tile // num_n) * BV
        acc = gl.zeros([BV, BN], gl.float32, mma_layout)
        for _ in range(num_k):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            a = c_smem.index(s).load(a_layout).to(gl.bfloat16)
            acc = H.warpgroup_mma(a, e_smem.index(s).permute((1, 0)), acc, is_async=True)
            acc = H.warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            jt = it - 1 + STAGES
            sp = (it + STAGES - 1) % STAGES
            refill = (it > 0) & (jt < total)
            ov, on, ok = _tile_offsets(jt, num_k, num_n, pid, NPROG, BV, BN, BK)
            mbarrier.expect(ready.index(sp), nbytes, pred=refill)
            _load(c_desc, [ov, ok], ready.index(sp), c_smem.index(sp), pred=refill)
            _load(e_desc, [on, ok], ready.index(sp), e_smem.index(sp), pred=refill)
            it += 1
        acc = H.warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        out = gl.permute(acc.to(gl.bfloat16), (1, 0))
        tma.store_wait(0)
        o_smem.store(out)
        H.fence_async_shared()
        _store(o_desc, [off_n, off_v], o_smem)
    tma.store_wait(0)
    for p in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(p))


@gluon.jit
def de_smemb_kernel(g_desc, c_desc, o_desc, K, num_n, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """dE tile [BR, BD] = G[BR, K] @ bf16(C[K, BD]): G the shared-memory A, C's tile converted into a bf16
    shared-memory B (a ring of two)."""
    BR: gl.constexpr = g_desc.block_type.shape[0]
    BK: gl.constexpr = g_desc.block_type.shape[1]
    BD: gl.constexpr = c_desc.block_type.shape[1]
    pid = gl.program_id(0)
    pid_n = pid % num_n
    pid_d = pid // num_n
    off_d = pid_d * BD
    off_r = pid_n * BR
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BD, 16]
    )
    c_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BK, BD], c_desc.layout)
    g_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BR, BK], g_desc.layout)
    cb_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, BD], gl.bfloat16)
    cb_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BK, BD], cb_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for p in gl.static_range(STAGES):
        mbarrier.init(ready.index(p), count=1)
    nbytes: gl.constexpr = c_desc.block_type.nbytes + g_desc.block_type.nbytes
    num_k = gl.cdiv(K, BK)
    for p in gl.static_range(STAGES):
        mbarrier.expect(ready.index(p), nbytes, pred=p < num_k)
        _load(c_desc, [p * BK, off_d], ready.index(p), c_smem.index(p), pred=p < num_k)
        _load(g_desc, [off_r, p * BK], ready.index(p), g_smem.index(p), pred=p < num_k)
    blk: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [num_warps, 1], [1, 0])
    acc = gl.zeros([BR, BD], gl.float32, mma_layout)
    for i in range(num_k):
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        b = c_smem.index(s).load(blk).to(gl.bfloat16)
        cb = cb_smem.index(i % 2)
        cb.store(b)
        H.fence_async_shared()
        _bar()
        acc = H.warpgroup_mma(g_smem.index(s), cb, acc, is_async=True)
        acc = H.warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        j = i - 1 + STAGES
        sp = (i + STAGES - 1) % STAGES
        refill = (i > 0) & (j < num_k)
        mbarrier.expect(ready.index(sp), nbytes, pred=refill)
        _load(c_desc, [j * BK, off_d], ready.index(sp), c_smem.index(sp), pred=refill)
        _load(g_desc, [off_r, j * BK], ready.index(sp), g_smem.index(sp), pred=refill)
    acc = H.warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    for p in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(p))
    o_smem = gl.allocate_shared_memory(gl.float32, [BR, BD], o_desc.layout)
    o_smem.store(acc)
    H.fence_async_shared()
    _store(o_desc, [off_r, off_d], o_smem)
    tma.store_wait(0)


def _desc(t, block):
    gl_dtype = {torch.float32: gl.float32, torch.bfloat16: gl.bfloat16}[t.dtype]
    layout = gl.NVMMASharedLayout.get_default_for(block, gl_dtype)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def logits(e, c, out, bv, bn, bk, stages, warps, reg_a=True, direct=False):
    n, v = out.shape
    num_n = triton.cdiv(n, bn)
    grid = (num_n * triton.cdiv(v, bv),)
    return logits_kernel[grid](
        _desc(c, [bv, bk]),
        _desc(e, [bn, bk]),
        _desc(out, [bn, bv]),
        c.shape[1],
        num_n,
        stages,
        reg_a,
        num_warps=warps,
        DIRECT=direct,
    )


@gluon.jit
def logits_gload_kernel(
    c_ptr,
    stride_cv,
    e_desc,
    o_desc,
    K,
    num_n,
    BV: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    """The head's fp32 tile read straight from global memory into registers two K steps ahead, converted, stored
    as the bf16 shared-memory A (a ring of two); E through TMA."""
    BN: gl.constexpr = e_desc.block_type.shape[0]
    pid = gl.program_id(0)
    pid_n = pid % num_n
    pid_v = pid // num_n
    off_v = pid_v * BV
    off_n = pid_n * BN
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 16]
    )
    blk: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [num_warps, 1], [1, 0])
    rows = off_v + gl.arange(0, BV, layout=gl.SliceLayout(1, blk))
    cols = gl.arange(0, BK, layout=gl.SliceLayout(0, blk))
    ptrs = c_ptr + rows[:, None] * stride_cv + cols[None, :]
    e_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, BK], e_desc.layout)
    ab_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BV, BK], gl.bfloat16)
    ab_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BV, BK], ab_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for p in gl.static_range(STAGES):
        mbarrier.init(ready.index(p), count=1)
    nbytes: gl.constexpr = e_desc.block_type.nbytes
    num_k = gl.cdiv(K, BK)
    for p in gl.static_range(STAGES):
        mbarrier.expect(ready.index(p), nbytes, pred=p < num_k)
        _load(e_desc, [off_n, p * BK], ready.index(p), e_smem.index(p), pred=p < num_k)
    a1 = gl.load(ptrs)
    a2 = gl.load(ptrs + gl.minimum(1, num_k - 1) * BK)
    acc = gl.zeros([BV, BN], gl.float32, mma_layout)
    for i in range(num_k):
        a0 = a1
        a1 = a2
        a2 = gl.load(ptrs + gl.minimum(i + 2, num_k - 1) * BK)
        ab = ab_smem.index(i % 2)
        ab.store(a0.to(gl.bfloat16))
        H.fence_async_shared()
        _bar()
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        acc = H.warpgroup_mma(ab, e_smem.index(s).permute((1, 0)), acc, is_async=True)
        acc = H.warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        j = i - 1 + STAGES
        sp = (i + STAGES - 1) % STAGES
        refill = (i > 0) & (j < num_k)
        mbarrier.expect(ready.index(sp), nbytes, pred=refill)
        _load(e_desc, [off_n, j * BK], ready.index(sp), e_smem.index(sp), pred=refill)
    acc = H.warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    for p in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(p))
    out = gl.permute(acc.to(gl.bfloat16), (1, 0))
    o_smem = gl.allocate_shared_memory(gl.bfloat16, [BN, BV], o_desc.layout)
    o_smem.store(out)
    H.fence_async_shared()
    _store(o_desc, [off_n, off_v], o_smem)
    tma.store_wait(0)


def logits_gload(e, c, out, bv, bn, bk, stages, warps):
    n, v = out.shape
    num_n = triton.cdiv(n, bn)
    grid = (num_n * triton.cdiv(v, bv),)
    return logits_gload_kernel[grid](
        c, c.stride(0), _desc(e, [bn, bk]), _desc(out, [bn, bv]), c.shape[1], num_n, bv, bk, stages, num_warps=warps
    )


@gluon.jit
def _ws_feeder(descs, bars, bufs, offs, num_k):
    """The fp32 head's tiles: TMA loads S1 - 1 steps ahead, each tile converted into the bf16 ring."""
    c_desc, e_desc = descs
    cf_ready, cf_empty, e_ready, e_empty, cb_ready, cb_empty = bars
    cf, e_s, cb = bufs
    off_v, off_n = offs
    S1: gl.constexpr = cf.type.shape[0]
    S3: gl.constexpr = cb.type.shape[0]
    BK: gl.constexpr = cf.type.shape[2]
    TPK: gl.constexpr = BK // 4
    blk: gl.constexpr = gl.BlockedLayout([1, 4], [32 // TPK, TPK], [4, 1], [1, 0])
    for p in gl.static_range(S1 - 1):
        mbarrier.expect(cf_ready.index(p), c_desc.block_type.nbytes, pred=p < num_k)
        _load(c_desc, [off_v, p * BK], cf_ready.index(p), cf.index(p), pred=p < num_k)
    for i in range(num_k):
        s1 = i % S1
        mbarrier.wait(cf_ready.index(s1), (i // S1) & 1)
        x = cf.index(s1).load(blk)
        j1 = i + S1 - 1
        sj = j1 % S1
        fence_async_shared_()
        mbarrier.expect(cf_ready.index(sj), c_desc.block_type.nbytes, pred=j1 < num_k)
        _load(c_desc, [off_v, j1 * BK], cf_ready.index(sj), cf.index(sj), pred=j1 < num_k)
        s3 = i % S3
        mbarrier.wait(cb_empty.index(s3), ((i // S3) & 1) ^ 1)
        cb.index(s3).store(x.to(gl.bfloat16))
        fence_async_shared_()
        mbarrier.arrive(cb_ready.index(s3), count=1)


@gluon.jit
def _ws_mma(o_desc, e_desc, bars, bufs, offs, num_k, num_warps: gl.constexpr):
    """The default partition: E's TMA ring (refilled as its steps are read) and async wgmma on the bf16 ring."""
    cf_ready, cf_empty, e_ready, e_empty, cb_ready, cb_empty = bars
    cf, e_s, cb = bufs
    off_v, off_n = offs
    S2: gl.constexpr = e_s.type.shape[0]
    S3: gl.constexpr = cb.type.shape[0]
    BV: gl.constexpr = cb.type.shape[1]
    BN: gl.constexpr = e_s.type.shape[1]
    BK: gl.constexpr = e_s.type.shape[2]
    for p in gl.static_range(S2):
        mbarrier.expect(e_ready.index(p), e_desc.block_type.nbytes, pred=p < num_k)
        _load(e_desc, [off_n, p * BK], e_ready.index(p), e_s.index(p), pred=p < num_k)
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 16]
    )
    acc = gl.zeros([BV, BN], gl.float32, mma_layout)
    for i in range(num_k):
        s2 = i % S2
        s3 = i % S3
        mbarrier.wait(e_ready.index(s2), (i // S2) & 1)
        mbarrier.wait(cb_ready.index(s3), (i // S3) & 1)
        acc = H.warpgroup_mma(cb.index(s3), e_s.index(s2).permute((1, 0)), acc, is_async=True)
        acc = H.warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        # step i - 1's operands are read: its bf16 slot back to the feeder, its E slot refilled
        mbarrier.arrive(cb_empty.index((i + S3 - 1) % S3), count=1, pred=i > 0)
        j = i - 1 + S2
        sp = (i + S2 - 1) % S2
        refill = (i > 0) & (j < num_k)
        mbarrier.expect(e_ready.index(sp), e_desc.block_type.nbytes, pred=refill)
        _load(e_desc, [off_n, j * BK], e_ready.index(sp), e_s.index(sp), pred=refill)
    acc = H.warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    out = gl.permute(acc.to(gl.bfloat16), (1, 0))
    o_smem = gl.allocate_shared_memory(gl.bfloat16, [BN, BV], o_desc.layout)
    o_smem.store(out)
    fence_async_shared_()
    _store(o_desc, [off_n, off_v], o_smem)
    tma.store_wait(0)


@gluon.jit
def logits_ws_kernel(
    c_desc,
    e_desc,
    o_desc,
    K,
    num_n,
    S1: gl.constexpr,
    S2: gl.constexpr,
    S3: gl.constexpr,
    CONV_REGS: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Warp-specialised: a 4-warp feeder partition (TMA loads of the fp32 head's tiles, each converted into a bf16
    ring in shared memory) and the MMA warps (the default partition: E's TMA ring, async wgmma on both rings).  A
    third partition (a 1-warp loader) leaves too few registers for the MMA warps' 128 x 256 accumulator."""
    BV: gl.constexpr = c_desc.block_type.shape[0]
    BK: gl.constexpr = c_desc.block_type.shape[1]
    BN: gl.constexpr = e_desc.block_type.shape[0]
    pid = gl.program_id(0)
    pid_n = pid % num_n
    pid_v = pid // num_n
    offs = (pid_v * BV, pid_n * BN)
    cf = gl.allocate_shared_memory(gl.float32, [S1, BV, BK], c_desc.layout)
    e_s = gl.allocate_shared_memory(gl.bfloat16, [S2, BN, BK], e_desc.layout)
    cb_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BV, BK], gl.bfloat16)
    cb = gl.allocate_shared_memory(gl.bfloat16, [S3, BV, BK], cb_layout)
    cf_ready = gl.allocate_shared_memory(gl.int64, [S1, 1], mbarrier.MBarrierLayout())
    cf_empty = gl.allocate_shared_memory(gl.int64, [S1, 1], mbarrier.MBarrierLayout())
    e_ready = gl.allocate_shared_memory(gl.int64, [S2, 1], mbarrier.MBarrierLayout())
    e_empty = gl.allocate_shared_memory(gl.int64, [S2, 1], mbarrier.MBarrierLayout())
    cb_ready = gl.allocate_shared_memory(gl.int64, [S3, 1], mbarrier.MBarrierLayout())
    cb_empty = gl.allocate_shared_memory(gl.int64, [S3, 1], mbarrier.MBarrierLayout())
    for p in gl.static_range(S1):
        mbarrier.init(cf_ready.index(p), count=1)
        mbarrier.init(cf_empty.index(p), count=1)
    for p in gl.static_range(S2):
        mbarrier.init(e_ready.index(p), count=1)
        mbarrier.init(e_empty.index(p), count=1)
    for p in gl.static_range(S3):
        mbarrier.init(cb_ready.index(p), count=1)
        mbarrier.init(cb_empty.index(p), count=1)
    num_k = gl.cdiv(K, BK)
    descs = (c_desc, e_desc)
    bars = (cf_ready, cf_empty, e_ready, e_empty, cb_ready, cb_empty)
    bufs = (cf, e_s, cb)
    gl.warp_specialize(
        [
            (_ws_mma, (o_desc, e_desc, bars, bufs, offs, num_k, num_warps)),
            (_ws_feeder, (descs, bars, bufs, offs, num_k)),
        ],
        [4],
        [CONV_REGS],
    )


def logits_ws(e, c, out, bv, bn, bk, s1, s2, s3, warps, conv_regs=152, maxnreg=168):
    n, v = out.shape
    num_n = triton.cdiv(n, bn)
    grid = (num_n * triton.cdiv(v, bv),)
    return logits_ws_kernel[grid](
        _desc(c, [bv, bk]),
        _desc(e, [bn, bk]),
        _desc(out, [bn, bv]),
        c.shape[1],
        num_n,
        s1,
        s2,
        s3,
        conv_regs,
        num_warps=warps,
        maxnreg=maxnreg,
    )


@gluon.jit
def _ws_feeder_g(c_ptr, stride_cv, bars, bufs, offs, num_k):
    """The fp32 head's tiles read from global memory into registers two steps ahead, converted into the bf16 ring
    (no fp32 pass through shared memory)."""
    cf_ready, cf_empty, e_ready, e_empty, cb_ready, cb_empty = bars
    cf, e_s, cb = bufs
    off_v, off_n = offs
    S3: gl.constexpr = cb.type.shape[0]
    BV: gl.constexpr = cb.type.shape[1]
    BK: gl.constexpr = cb.type.shape[2]
    TPK: gl.constexpr = BK // 4
    blk: gl.constexpr = gl.BlockedLayout([1, 4], [32 // TPK, TPK], [4, 1], [1, 0])
    rows = off_v + gl.arange(0, BV, layout=gl.SliceLayout(1, blk))
    cols = gl.arange(0, BK, layout=gl.SliceLayout(0, blk))
    ptrs = c_ptr + rows[:, None] * stride_cv + cols[None, :]
    x1 = gl.load(ptrs)
    x2 = gl.load(ptrs + gl.minimum(1, num_k - 1) * BK)
    for i in range(num_k):
        x0 = x1
        x1 = x2
        x2 = gl.load(ptrs + gl.minimum(i + 2, num_k - 1) * BK)
        s3 = i % S3
        mbarrier.wait(cb_empty.index(s3), ((i // S3) & 1) ^ 1)
        cb.index(s3).store(x0.to(gl.bfloat16))
        fence_async_shared_()
        mbarrier.arrive(cb_ready.index(s3), count=1)


@gluon.jit
def logits_wsg_kernel(
    c_ptr,
    stride_cv,
    e_desc,
    o_desc,
    K,
    num_n,
    BV: gl.constexpr,
    BK: gl.constexpr,
    S2: gl.constexpr,
    S3: gl.constexpr,
    FEED_REGS: gl.constexpr,
    num_warps: gl.constexpr,
):
    BN: gl.constexpr = e_desc.block_type.shape[0]
    pid = gl.program_id(0)
    pid_n = pid % num_n
    pid_v = pid // num_n
    offs = (pid_v * BV, pid_n * BN)
    e_s = gl.allocate_shared_memory(gl.bfloat16, [S2, BN, BK], e_desc.layout)
    cb_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BV, BK], gl.bfloat16)
    cb = gl.allocate_shared_memory(gl.bfloat16, [S3, BV, BK], cb_layout)
    e_ready = gl.allocate_shared_memory(gl.int64, [S2, 1], mbarrier.MBarrierLayout())
    e_empty = gl.allocate_shared_memory(gl.int64, [S2, 1], mbarrier.MBarrierLayout())
    cb_ready = gl.allocate_shared_memory(gl.int64, [S3, 1], mbarrier.MBarrierLayout())
    cb_empty = gl.allocate_shared_memory(gl.int64, [S3, 1], mbarrier.MBarrierLayout())
    for p in gl.static_range(S2):
        mbarrier.init(e_ready.index(p), count=1)
        mbarrier.init(e_empty.index(p), count=1)
    for p in gl.static_range(S3):
        mbarrier.init(cb_ready.index(p), count=1)
        mbarrier.init(cb_empty.index(p), count=1)
    num_k = gl.cdiv(K, BK)
    bars = (cb_ready, cb_empty, e_ready, e_empty, cb_ready, cb_empty)
    bufs = (cb, e_s, cb)
    gl.warp_specialize(
        [
            (_ws_mma, (o_desc, e_desc, bars, bufs, offs, num_k, num_warps)),
            (_ws_feeder_g, (c_ptr, stride_cv, bars, bufs, offs, num_k)),
        ],
        [4],
        [FEED_REGS],
    )


def logits_wsg(e, c, out, bv, bn, bk, s2, s3, warps, feed_regs=168, maxnreg=168):
    n, v = out.shape
    num_n = triton.cdiv(n, bn)
    grid = (num_n * triton.cdiv(v, bv),)
    return logits_wsg_kernel[grid](
        c,
        c.stride(0),
        _desc(e, [bn, bk]),
        _desc(out, [bn, bv]),
        c.shape[1],
        num_n,
        bv,
        bk,
        s2,
        s3,
        feed_regs,
        num_warps=warps,
        maxnreg=maxnreg,
    )


NUM_SMS = None


def logits_persistent(e, c, out, bv, bn, bk, stages, warps):
    n, v = out.shape
    num_n = triton.cdiv(n, bn)
    num_tiles = num_n * triton.cdiv(v, bv)
    nprog = min(NUM_SMS, num_tiles)
    return logits_persistent_kernel[(nprog,)](
        _desc(c, [bv, bk]),
        _desc(e, [bn, bk]),
        _desc(out, [bn, bv]),
        c.shape[1],
        num_n,
        num_tiles,
        stages,
        nprog,
        num_warps=warps,
    )


def de_smemb(g, c, out, br, bd, bk, stages, warps):
    n, d = out.shape
    num_n = triton.cdiv(n, br)
    grid = (num_n * triton.cdiv(d, bd),)
    return de_smemb_kernel[grid](
        _desc(g, [br, bk]), _desc(c, [bk, bd]), _desc(out, [br, bd]), c.shape[0], num_n, stages, num_warps=warps
    )


def de(g, c, out, bd, br, bk, stages, warps):
    n, d = out.shape
    num_n = triton.cdiv(n, br)
    grid = (num_n * triton.cdiv(d, bd),)
    return de_kernel[grid](
        _desc(c, [bk, bd]), _desc(g, [br, bk]), _desc(out, [br, bd]), c.shape[0], num_n, stages, num_warps=warps
    )


def bench(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(fn, warmup=5, rep=200)
    return ms


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main():
    torch.manual_seed(0)
    R, D, V = 2048, 4096, 128256
    if len(sys.argv) > 1:
        R, D, V = map(int, sys.argv[1:4])
    e = (torch.randn(R, D, device="cuda") * 0.5).bfloat16()
    c = torch.randn(V, D, device="cuda") * 0.02
    cb = c.bfloat16()
    flop = 2 * R * V * D
    rows = []
    t = bench(lambda: c.bfloat16())
    rows.append(("convert head fp32->bf16", t, None, None))
    ref = torch.mm(e, cb.t())
    t = bench(lambda: torch.mm(e, cb.t()))
    rows.append(("cuBLAS logits (bf16 copy)", t, flop / t / 1e9, 0.0))
    out = torch.empty(R, V, device="cuda", dtype=torch.bfloat16)
    global NUM_SMS
    NUM_SMS = torch.cuda.get_device_properties(0).multi_processor_count
    cfgs = [
        ("bf16 copy, smem A, no conversion", logits, (128, 256, 64, 3, 8, False, True), cb),
        ("bf16 copy, register A", logits, (128, 256, 64, 3, 8, True), cb),
        ("fp32 head, register A", logits, (128, 256, 32, 5, 8, True), c),
        ("fp32 head, smem A", logits, (128, 256, 64, 3, 8, False), c),
        ("fp32 head from global, 2 steps ahead, smem A", logits_gload, (128, 256, 64, 3, 8), c),
        ("persistent, fp32 head, register A", logits_persistent, (128, 256, 32, 4, 8), c),
        ("warp-specialised, fp32 head through TMA", logits_ws, (128, 256, 64, 2, 2, 2, 8), c),
        ("warp-specialised, fp32 head from global", logits_wsg, (128, 256, 32, 4, 4, 8), c),
    ]
    for kind, fn, cfg, head in cfgs:
        name = f"gluon logits {kind} {cfg}"
        try:
            out.fill_(float("nan"))
            k = fn(e, head, out, *cfg)
            torch.cuda.synchronize()
            err = rel(out, ref)
            t = bench(lambda: fn(e, head, out, *cfg))
            rows.append((name + f" regs {k.n_regs} spills {k.n_spills}", t, flop / t / 1e9, err))
        except Exception as exc:  # noqa: BLE001
            print(name, "FAILED:", type(exc).__name__, str(exc)[:3000], flush=True)
        print(rows[-1], flush=True)
    g = (torch.randn(R, V, device="cuda") * 1e-3).bfloat16()
    ref = torch.mm(g.float(), cb.float())
    t = bench(lambda: torch.mm(g, cb))
    rows.append(("cuBLAS dE (bf16 copy, bf16 out)", t, flop / t / 1e9, 0.0))
    try:
        t = bench(lambda: torch.mm(g, cb, out_dtype=torch.float32))
        rows.append(("cuBLAS dE (bf16 copy, fp32 out)", t, flop / t / 1e9, 0.0))
    except Exception as exc:  # noqa: BLE001
        print("out_dtype mm:", exc)
    dout = torch.empty(R, D, device="cuda", dtype=torch.float32)
    cfgs = [("regA", de, (128, 256, 64, 3, 8)), ("smemB", de_smemb, (128, 128, 64, 4, 8))]
    for kind, fn, cfg in cfgs:
        name = f"gluon dE {kind} {cfg}"
        try:
            dout.fill_(float("nan"))
            k = fn(g, c, dout, *cfg)
            torch.cuda.synchronize()
            err = rel(dout, ref)
            t = bench(lambda: fn(g, c, dout, *cfg))
            rows.append((name + f" regs {k.n_regs} spills {k.n_spills}", t, flop / t / 1e9, err))
        except Exception as exc:  # noqa: BLE001
            print(name, "FAILED:", type(exc).__name__, str(exc)[:3000], flush=True)
        print(rows[-1], flush=True)
    print(f"\nR {R} D {D} V {V}; {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    print("| product | ms | TFLOP/s | rel. diff to cuBLAS |")
    print("|---|---|---|---|")
    for name, t, tf, err in rows:
        print(f"| {name} | {t:.3f} | {'' if tf is None else f'{tf:.0f}'} | {'' if err is None else f'{err:.1e}'} |")


if __name__ == "__main__":
    main()
