"""dK and dV on Hopper (sm_90): a warp-specialized Gluon kernel, the dK/dV half of FlashAttention-3's backward.

One program owns ``BLOCK_N = 128`` keys of one (batch, kv head), split between two consumer warpgroups of 64 keys
each (at d = 256: 64 keys that both warpgroups share, each with half of dK's and dV's columns, ``_consumer_split``);
their K and V rows come in once by TMA. A one-warp producer partition streams the row tiles (64 query rows, or
128 at d = 64: ``ROW_TILES``) of every head in the GQA group (Q and dO, by TMA) through a ring of ``num_stages``
stages with "ready" and "empty" mbarriers, so both warpgroups read each tile once from shared memory. Per tile a
warpgroup computes, in registers,

    Sᵀ = K Qᵀ and dPᵀ = V dOᵀ          (both issued, then one wait)
    Pᵀ = 2^(Sᵀ · scale · log2 e − lse₂)  (lse₂ = lse · log2 e, +inf for rows that saw no key, so P = 0)
    dSᵀ = Pᵀ ∘ (dPᵀ − delta)
    dV += Pᵀ dO and dK += dSᵀ Q         (Pᵀ and dSᵀ as wgmma's register A operand)

(at d = 256 each warpgroup computes Sᵀ and dPᵀ for half of the tile's rows and writes its Pᵀ and dSᵀ halves to
shared memory, from where both warpgroups' dV and dK products read them; at d = 64 and 128 with ``early_dv``, the
table's choice per head dim and mask, Sᵀ is waited for alone, Pᵀ computed while dPᵀ's wgmma runs, and dV's product
issued before dPᵀ is waited for, so dSᵀ is computed while it runs: the same products in the same order),

and the group's sum of dK and dV stays in registers (no atomics, deterministic), as in ``backward.py``'s Triton
kernel, after whose dQ kernel (which computes delta) this one runs (with ``fused_dq``, below, after the preprocess
kernel). dK and dV leave by TMA stores staged in each warpgroup's own K and V rows, free once both warpgroups are
past the block's last matmul, where ``stores_by_tma`` holds (64-row tiles at d = 64/128, outputs of q's dtype,
aligned); otherwise (d = 256, 128-row tiles, float32 outputs) from registers. Plain attention, or with sinks
(through lse alone) and causal windows (``WINDOW``: a key block's row tiles end where its last key leaves their
windows, ``_key_block``; rows crossing its first key's window edge are masked): float16/bfloat16, equal head dims
(64, 128 or 256), TMA-able strides; ``backward.py`` routes a launch here when ``bwd_config`` picks a ``gluon``
dK/dV tile.

A ``persistent`` tile launches at most one program per SM (``programs``: of 3/4 of the SMs to all of them, the count
whose busiest program has the least work), each taking key blocks in turn in the forward's snake order
(``_key_block``). The producer loads the next block's first row tiles while the consumers finish the last block's
dK and dV, then its K and V once they have released theirs (``kv_empty``); the Q/dO ring and the dSᵀ buffers run on
across blocks. A persistent fused-dQ tile stages its dK/dV stores in the dSᵀ and dQ buffers instead of K and V
(``_early_dkdv``), so K and V are released before the stores and the next block's load runs under them. Each
partition's per-block work is one function (``_producer_block``, ``_consumer_block``, ``_consumer_split_block``) that
``_blocks`` calls per key block.

With ``fused_dq`` no dQ kernel runs: both warpgroups write their dSᵀ to shared memory, and one row tile later each
issues dQ = dS K for its part of dQ (half the rows of a 128-row tile, else half the columns: ``dq_part_rows``,
``dq_part_cols``) over all 128 keys behind that tile's dV and dK, and adds the result into a float32 accumulator by a
TMA reduce-add (``cp.reduce.async.bulk.tensor``). The accumulator holds each part in the order of the warpgroup's
registers (``_register_order``: staged by conflict-free 16-byte stores and added by one TMA reduce of rows of 128
values; FA3's flat dQ staging), which the scaling pass after the kernel undoes. The programs' adds land in no fixed
order, so the table takes that only for calls that allow it (``deterministic=False``). With ``dq_ordered`` the
warpgroups stage their dQ tiles for a writer warp that adds them in a fixed order (``_dq_writer``, ``_turn``; a row
tile's first add is a TMA store, so that accumulator needs no zeroing), and deterministic calls take it where it
measured faster than the dQ kernel. Either way a pass after the kernel scales the sum into dq (``backward.py``).

Which key blocks and row tiles a program takes, and a persistent launch's program count, are in
``backward_sm90_schedule.py``; the fused dQ's layout, its adds and the ordered writer in ``backward_sm90_dq.py``.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from ._common import LOG2E, tma_aligned
from ._configs import BWD_TAIL_MIN_KEYS
from ._launch import cdiv, start
from .backward_sm90_dq import (DQ_ORDER_COLS, _dq_writer, _ds_rows, _hand_dq, dq_descriptor, dq_order_rows,
                               dq_part_cols, dq_part_offset, dq_part_rows, semaphores)
from .backward_sm90_schedule import _blocks, _key_block, _piece, _row_tile, programs
from .forward_sm90 import Tile, _sm_count, descriptor
from .pieces import split_tail, sum_pieces

HEAD_DIMS = (64, 128, 256)  # what this kernel is built and tested for (d = 256 splits the head dim: _consumer_split)

KEYS_PER_WARPGROUP = 64
ROW_TILES = {64: (64, 128)}  # the row tiles a head dim takes, where not only 64 (128 rows: registers for d <= 64 only)


@gluon.jit
def attention_bwd_dkdv_sm90_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, LSE, DELTA, DK, DV, DQ, SEM,
                                   stride_lb, stride_lh, stride_dkb, stride_dks, stride_dkh,
                                   stride_dvb, stride_dvs, stride_dvh, dq_rows,
                                   seqlen_q, seqlen_k, heads_kv, qk_scale,
                                   sm_scale, head_group, num_tiles, window_left, DK_PART, DV_PART, split_full,
                                   split_pieces, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                                   HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                                   GROUP: gl.constexpr, FUSED_DQ: gl.constexpr, ORDERED: gl.constexpr,
                                   TMA_OUT: gl.constexpr, LAST_BLOCK_FIRST: gl.constexpr, EARLY_DV: gl.constexpr,
                                   PERSISTENT: gl.constexpr, WINDOW: gl.constexpr, SPLIT: gl.constexpr):
    # A program takes key block ``pid`` of ``num_tiles``, or with PERSISTENT (never ORDERED) ``pid, pid + programs,
    # ...``, in _key_block's order. Only the producer's and the ORDERED partitions' Tiles carry LAST_BLOCK_FIRST.
    # With SPLIT, items from ``split_full`` on are pieces of the last lap's key blocks (``_piece``), ``num_tiles``
    # counts items, and a piece's float32 dK and dV go to DK_PART and DV_PART (``pieces.sum_pieces``).
    gl.static_assert(ORDERED or not LAST_BLOCK_FIRST, "LAST_BLOCK_FIRST orders an ORDERED launch")
    gl.static_assert(not (ORDERED and PERSISTENT), "ORDERED programs wait on one another: one key block each")
    gl.static_assert(not SPLIT or (PERSISTENT and not CAUSAL and HEAD_DIM <= 128),
                     "SPLIT: the last lap of a persistent non-causal launch at d = 64 or 128")
    dtype: gl.constexpr = q_desc.dtype
    k_smem = gl.allocate_shared_memory(dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, v_desc.block_type.shape, v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    # Per row tile, lse (base 2) and delta: the producer writes them beside the tile's Q and dO, so the consumers hold
    # them in registers only while they use them (as [64 keys x BLOCK_M rows] columns, 16 registers each per 64 rows).
    plain: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], plain)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], plain)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())  # both warpgroups past every tile
    staged = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())  # both dK/dV stores read (_early)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # With FUSED_DQ: both warpgroups' dSᵀ of a row tile ([128 keys, BLOCK_M rows], two buffers), for dQ = dS K over
    # all 128 keys (each warpgroup its part of dQ: dq_part_rows, dq_part_cols); "ds_ready" counts the two halves
    # written, "ds_free" the two reads.
    # At d = 256, ds_ready / ds_free index 0 serve _consumer_split's Pᵀ/dSᵀ halves (ds_smem goes unused there).
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [2 if FUSED_DQ else 1, BLOCK_N, BLOCK_M], ds_layout)
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    # With FUSED_DQ: each warpgroup's part of a row tile's dQ (float32 in register order), staged for its TMA copy:
    # a buffer per warpgroup (the dQ descriptor's box: one part) for its own reduce-add; ORDERED, two buffers of both
    # parts (the box: a whole row tile), one copy of both by the writer warp (a reduce-add, or the first turn's
    # store), which holds one tile's while the next is staged; "dq_full" counts both warpgroups' parts staged,
    # "dq_empty" the writer's release. Without FUSED_DQ, a few rows that go unused (the placeholder's box).
    gl.static_assert(not FUSED_DQ or (DQ.block_type.shape[0] == (2 if ORDERED else 1) * dq_order_rows(BLOCK_M, HEAD_DIM)
                                      and DQ.block_type.shape[1] == 1 and DQ.block_type.shape[2] == DQ_ORDER_COLS
                                      and dq_part_rows(BLOCK_M) == 64),
                     "the dQ box: a part of a row tile in register order, both with ORDERED (dq_descriptor)")
    # Allocated under a 128-byte swizzle, which aligns it to 1024 bytes as a persistent tile's dK/dV staging needs
    # (_early_dkdv reinterprets it so), and used in the descriptor's layout (unswizzled where fused).
    dq_aligned: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32,
                                                    rank=len(DQ.block_type.shape))
    dq_smem = gl.allocate_shared_memory(gl.float32, [2] + DQ.block_type.shape, dq_aligned)._reinterpret(
        gl.float32, [2] + DQ.block_type.shape, DQ.layout)
    dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())  # K/V's last reads of a key block
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(kv_empty, count=2)  # one arrival per consumer warpgroup
    mbarrier.init(done, count=2)
    mbarrier.init(staged, count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=2)  # the copies' expect-tx arrival, then the row statistics' one
        mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=2)
        mbarrier.init(ds_free.index(i), count=2)
        mbarrier.init(dq_full.index(i), count=2)
        mbarrier.init(dq_empty.index(i), count=1)
    fence_async_shared()

    # Partition arguments must be IR values: an int argument equal to 1 arrives as a constexpr (lse's batch stride is
    # 1 when Hq · Sq = 1), so every int a partition takes is made a tensor.
    stride_lb = gl.to_tensor(stride_lb)
    stride_lh = gl.to_tensor(stride_lh)
    stride_dkb = gl.to_tensor(stride_dkb)
    stride_dks = gl.to_tensor(stride_dks)
    stride_dkh = gl.to_tensor(stride_dkh)
    stride_dvb = gl.to_tensor(stride_dvb)
    stride_dvs = gl.to_tensor(stride_dvs)
    stride_dvh = gl.to_tensor(stride_dvh)
    smem = (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_bar, kv_empty, ready, empty)
    shape = (gl.to_tensor(seqlen_q), gl.to_tensor(seqlen_k), gl.to_tensor(heads_kv), gl.to_tensor(head_group),
             gl.to_tensor(num_tiles), gl.to_tensor(window_left))
    dq_rows = gl.to_tensor(dq_rows)
    outs = (DK, DV, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh, qk_scale, sm_scale)
    tail = (gl.to_tensor(split_full), gl.to_tensor(split_pieces))
    if SPLIT:
        parts = (DK_PART, DV_PART)
    else:  # a partition argument must be an IR value: dK's pointer stands in, never read
        parts = (DK, DK)
    consumer = smem + (ds_smem, ds_ready, ds_free, dq_smem, dq_full, dq_empty, done, staged) + shape + (
        dk_desc, dv_desc, DQ, dq_rows) + outs + parts + tail
    loads = (q_desc, k_desc, v_desc, do_desc) + smem + shape + (LSE, DELTA, stride_lb, stride_lh) + tail + (Tile(
        0, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, GROUP, FUSED_DQ, ORDERED, LAST_BLOCK_FIRST=LAST_BLOCK_FIRST,
        PERSISTENT=PERSISTENT, WINDOW=WINDOW, SPLIT=SPLIT),)
    if HEAD_DIM > 128:  # both warpgroups on the same keys, each with half of dK's and dV's columns (_consumer_split)
        gl.static_assert(not FUSED_DQ, "fused_dq: d = 64 and 128 only")
        half_rows: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M // 2], dtype)
        p_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M // 2], half_rows)
        dst_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M // 2], half_rows)
        split = smem + (p_smem, dst_smem, ds_ready.index(0), ds_free.index(0)) + shape + outs
        gl.warp_specialize([
            (_consumer_split, split + (Tile(0, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, GROUP,
                                            PERSISTENT=PERSISTENT, WINDOW=WINDOW),)),
            (_consumer_split, split + (Tile(1, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, GROUP,
                                            PERSISTENT=PERSISTENT, WINDOW=WINDOW),)),
            (_producer, loads),
        ], [4, 1], [240, 24])
    elif ORDERED:  # a fourth partition, one warp, adds the staged dQ tiles in their fixed order
        gl.static_assert(FUSED_DQ, "ORDERED orders the fused dQ's adds")
        writer = (DQ, dq_smem, dq_full, dq_empty, SEM, dq_rows) + shape + (
            Tile(0, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, GROUP, FUSED_DQ, ORDERED,
                 LAST_BLOCK_FIRST=LAST_BLOCK_FIRST, WINDOW=WINDOW),)
        gl.warp_specialize([
            (_consumer, consumer + (Tile(0, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, GROUP, FUSED_DQ, ORDERED,
                                         TMA_OUT=TMA_OUT, EARLY_DV=EARLY_DV, LAST_BLOCK_FIRST=LAST_BLOCK_FIRST,
                                         WINDOW=WINDOW),)),
            (_consumer, consumer + (Tile(1, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, GROUP, FUSED_DQ, ORDERED,
                                         TMA_OUT=TMA_OUT, EARLY_DV=EARLY_DV, LAST_BLOCK_FIRST=LAST_BLOCK_FIRST,
                                         WINDOW=WINDOW),)),
            (_producer, loads),
            (_dq_writer, writer),
        ], [4, 1, 1], [240, 24, 24])
    else:
        gl.warp_specialize([
            (_consumer, consumer + (Tile(0, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, GROUP, FUSED_DQ,
                                         TMA_OUT=TMA_OUT, EARLY_DV=EARLY_DV, PERSISTENT=PERSISTENT, WINDOW=WINDOW,
                                         SPLIT=SPLIT),)),
            (_consumer, consumer + (Tile(1, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, GROUP, FUSED_DQ,
                                         TMA_OUT=TMA_OUT, EARLY_DV=EARLY_DV, PERSISTENT=PERSISTENT, WINDOW=WINDOW,
                                         SPLIT=SPLIT),)),
            (_producer, loads),
        ], [4, 1], [240, 24])


@gluon.jit
def _producer(q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_bar, kv_empty,
              ready, empty, seqlen_q, seqlen_k, heads_kv, head_group, num_tiles, window_left, LSE, DELTA, stride_lb,
              stride_lh, split_full, split_pieces, tile):
    """One warp: per key block after the program's first, its first row tiles (as many as the ring has stages), then
    its K and V once both consumers are done with the last block's (``kv_empty``: under their epilogue the next
    block's row tiles already stream in), then its other row tiles. Row tile ``t`` of the block (its head of the
    group and rows: ``_row_tile``; ``it`` counts them across blocks) brings Q and dO by TMA and the rows' lse (base 2,
    +inf where a row saw no key, so P = 0 there and past the last row) and delta into stage ``it % STAGES``, once
    both consumers released it. A piece (SPLIT) loads its own row tiles (``_piece``)."""
    _blocks(_producer_block, (q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
             kv_bar, kv_empty, ready, empty, seqlen_q, seqlen_k, heads_kv, head_group, num_tiles, window_left, LSE,
             DELTA, stride_lb, stride_lh, (split_full, split_pieces)), num_tiles, tile)


@gluon.jit
def _producer_block(tid, it, n, args, tile):
    """_producer's key block ``tid``, the program's ``n``-th, its row tiles from the program's ``it``-th;
    returns the next block's ``it``."""
    (q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_bar, kv_empty, ready,
     empty, seqlen_q, seqlen_k, heads_kv, head_group, num_tiles, window_left, LSE, DELTA, stride_lb, stride_lh,
     split) = args
    off_b, off_hkv, pid_n, n0, lo, row_tiles, shift = _key_block(tid, seqlen_q, seqlen_k, heads_kv, head_group,
                                                                 num_tiles, window_left, split, tile)
    n_tiles = row_tiles * tile.GROUP
    t_first = 0  # the row tiles t_first ... t_end - 1 (a piece's: _piece)
    t_end = n_tiles
    if tile.SPLIT:
        t_first, t_end, _ = _piece(tid, n_tiles, num_tiles, split)
    first = gl.minimum(t_end - t_first, tile.STAGES)  # before K and V, except in a program's first block
    if n == 0:
        first = 0
    for t in range(t_first, t_first + first):
        _load_rows(q_desc, do_desc, q_smem, do_smem, lse_smem, delta_smem, ready, empty, it + t - t_first, t, off_b,
                   off_hkv, lo, row_tiles, shift, seqlen_q, LSE, DELTA, stride_lb, stride_lh, tile)
    mbarrier.wait(kv_empty, (n & 1) ^ 1)  # a fresh barrier passes the wait for parity 1
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [off_b, n0, off_hkv, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [off_b, n0, off_hkv, 0], kv_bar, v_smem)
    for t in range(t_first + first, t_end):
        _load_rows(q_desc, do_desc, q_smem, do_smem, lse_smem, delta_smem, ready, empty, it + t - t_first, t, off_b,
                   off_hkv, lo, row_tiles, shift, seqlen_q, LSE, DELTA, stride_lb, stride_lh, tile)
    it += t_end - t_first
    return it


@gluon.jit
def _load_rows(q_desc, do_desc, q_smem, do_smem, lse_smem, delta_smem, ready, empty, it, t, off_b, off_hkv, lo,
               row_tiles, shift, seqlen_q, LSE, DELTA, stride_lb, stride_lh, tile):
    """Row tile ``t`` of a key block, the ``it``-th of the program, into stage ``it % STAGES`` (see _producer)."""
    STAGES: gl.constexpr = tile.STAGES
    BLOCK_M: gl.constexpr = tile.BLOCK_M
    row_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
    stage = it % STAGES
    g, m = _row_tile(t, lo, row_tiles, shift, tile)
    head = off_hkv * tile.GROUP + g
    mbarrier.wait(empty.index(stage), ((it // STAGES) & 1) ^ 1)  # a fresh barrier passes the wait for parity 1
    mbarrier.expect(ready.index(stage), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [off_b, m, head, 0], ready.index(stage), q_smem.index(stage))
    tma.async_copy_global_to_shared(do_desc, [off_b, m, head, 0], ready.index(stage), do_smem.index(stage))
    rows = m + gl.arange(0, BLOCK_M, layout=row_layout)
    stats = off_b.to(gl.int64) * stride_lb + head * stride_lh + rows
    lse = gl.load(LSE + stats, mask=rows < seqlen_q, other=float("inf"))
    lse_smem.index(stage).store(gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634))
    delta_smem.index(stage).store(gl.load(DELTA + stats, mask=rows < seqlen_q, other=0.0))
    mbarrier.arrive(ready.index(stage))  # releases the stores above to the consumers' wait


@gluon.jit
def _consumer(k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_bar, kv_empty, ready, empty, ds_smem, ds_ready,
              ds_free, dq_smem, dq_full, dq_empty, done, staged, seqlen_q, seqlen_k, heads_kv, head_group, num_tiles,
              window_left, dk_desc, dv_desc, DQ, dq_rows, DK, DV, stride_dkb, stride_dks, stride_dkh, stride_dvb,
              stride_dvs, stride_dvh, qk_scale, sm_scale, DK_PART, DV_PART, split_full, split_pieces, tile):
    """One warpgroup, per key block: its 64 keys' dK and dV over every row tile of the group, then stored (dK times
    the scale): by TMA with TMA_OUT (``_store_dkdv_tma``, staged in this warpgroup's K and V rows once both
    warpgroups are done reading them; persistent with FUSED_DQ, ``_early_dkdv``), else from registers
    (``_store_dkdv``, after releasing K and V). With FUSED_DQ, per row tile also its part of dQ (``_dq_coord``) over
    the block's 128 keys, added to the float32 accumulator (unscaled) by TMA reduces, one row tile behind (ORDERED:
    staged for the writer warp, _dq_writer). A piece (SPLIT) runs its own row tiles (``_piece``) and leaves its
    partial dK (scaled) and dV in float32 from registers (``_store_dkdv`` into its slot of DK_PART and DV_PART)."""
    _blocks(_consumer_block, (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_bar, kv_empty, ready, empty,
             ds_smem, ds_ready, ds_free, dq_smem, dq_full, dq_empty, done, staged, seqlen_q, seqlen_k, heads_kv,
             head_group, num_tiles, window_left, dk_desc, dv_desc, DQ, dq_rows, DK, DV, stride_dkb, stride_dks,
             stride_dkh, stride_dvb, stride_dvs, stride_dvh, qk_scale, sm_scale, DK_PART, DV_PART,
             (split_full, split_pieces)), num_tiles, tile)


@gluon.jit
def _consumer_block(tid, it, n, args, tile):
    """_consumer's key block ``tid``, the program's ``n``-th, its row tiles from the program's ``it``-th;
    returns the next block's ``it``."""
    (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_bar, kv_empty, ready, empty, ds_smem, ds_ready, ds_free,
     dq_smem, dq_full, dq_empty, done, staged, seqlen_q, seqlen_k, heads_kv, head_group, num_tiles, window_left,
     dk_desc, dv_desc, DQ, dq_rows, DK, DV, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
     qk_scale, sm_scale, DK_PART, DV_PART, split) = args
    D: gl.constexpr = tile.HEAD_DIM
    BLOCK_M: gl.constexpr = tile.BLOCK_M
    STAGES: gl.constexpr = tile.STAGES
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    DQ_ROWS: gl.constexpr = dq_part_rows(BLOCK_M)
    DQ_COLS: gl.constexpr = dq_part_cols(BLOCK_M, D)
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DQ_COLS, 16])
    dtype: gl.constexpr = q_smem.dtype
    diag = seqlen_k - seqlen_q
    zero_st = gl.zeros([64, BLOCK_M], gl.float32, layout=st_layout)
    zero_dq = gl.zeros([DQ_ROWS, DQ_COLS], gl.float32, layout=dq_layout)
    k = k_smem.reshape([tile.BLOCK_N, D]).slice(tile.WG * 64, 64)
    v = v_smem.reshape([tile.BLOCK_N, D]).slice(tile.WG * 64, 64)
    # dQ's B operand: K's columns of this warpgroup's part (all of them where the warpgroups split the rows)
    k_dq = k_smem.reshape([tile.BLOCK_N, D]).slice(dq_part_offset(BLOCK_M, D, tile.WG)[1], DQ_COLS, dim=1)
    off_b, off_hkv, pid_n, n0, lo, row_tiles, shift = _key_block(tid, seqlen_q, seqlen_k, heads_kv, head_group,
                                                                 num_tiles, window_left, split, tile)
    key0 = n0 + tile.WG * 64
    keys = key0 + gl.arange(0, 64, layout=gl.SliceLayout(1, st_layout))
    full_from = key0 + 63 - diag  # row tiles starting here see every key of this warpgroup
    win_from = key0 - diag + window_left + 1  # WINDOW: rows from here on do not see this warpgroup's first key
    partial = key0 + 64 > seqlen_k  # keys past the end: zero-filled K and V, but P must be 0 there for dS
    dk = gl.zeros([64, D], gl.float32, layout=kv_layout)
    dv = gl.zeros([64, D], gl.float32, layout=kv_layout)
    mbarrier.wait(kv_bar, n & 1)
    n_tiles = row_tiles * tile.GROUP
    t_first = 0  # the row tiles t_first ... t_end - 1 (a piece's: _piece)
    t_end = n_tiles
    if tile.SPLIT:
        t_first, t_end, slot = _piece(tid, n_tiles, num_tiles, split)
    for t in range(t_first, t_end):
        g = it + t - t_first
        stage = g % STAGES
        m = _row_tile(t, lo, row_tiles, shift, tile)[1]
        mbarrier.wait(ready.index(stage), (g // STAGES) & 1)
        q = q_smem.index(stage).reshape([BLOCK_M, D])
        do = do_smem.index(stage).reshape([BLOCK_M, D])
        st = warpgroup_mma(k, q.permute((1, 0)), zero_st, use_acc=False, is_async=True)
        dpt = warpgroup_mma(v, do.permute((1, 0)), zero_st, use_acc=False, is_async=True)
        if tile.EARLY_DV:  # Pᵀ while dPᵀ's wgmma runs (wait(1) is Sᵀ: no group is left over from the last tile)
            st = warpgroup_mma_wait(1, deps=(st,))
        else:
            st, dpt = warpgroup_mma_wait(0, deps=(st, dpt))
        lse = lse_smem.index(stage).load(gl.SliceLayout(0, st_layout))
        pt = gl.exp2(st * qk_scale - lse[None, :])
        if tile.CAUSAL:
            if m < full_from:
                rows = m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
                pt = gl.where(keys[:, None] <= rows[None, :] + diag, pt, 0.0)
        if tile.WINDOW:
            if m + BLOCK_M > win_from:
                rows = m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
                pt = gl.where(keys[:, None] >= rows[None, :] + (diag - window_left), pt, 0.0)
        if tile.FUSED_DQ:
            if partial:
                pt = gl.where(keys[:, None] < seqlen_k, pt, 0.0)
        if tile.EARLY_DV:  # dV's product issued before dPᵀ is waited for: dSᵀ while it runs
            pt_op = gl.convert_layout(pt.to(dtype), a_layout)
            dv = warpgroup_mma(pt_op, do, dv, is_async=True)
            dpt = warpgroup_mma_wait(1, deps=(dpt,))
        dst = pt * (dpt - delta_smem.index(stage).load(gl.SliceLayout(0, st_layout))[None, :])
        if not tile.EARLY_DV:
            pt_op = gl.convert_layout(pt.to(dtype), a_layout)
        dst_op = gl.convert_layout(dst.to(dtype), a_layout)
        if tile.FUSED_DQ:
            buf = g % 2  # this tile's dSᵀ, once both warpgroups have read the buffer's last tile (two tiles ago)
            mbarrier.wait(ds_free.index(buf), ((g // 2) & 1) ^ 1)
            ds_smem.index(buf).slice(tile.WG * 64, 64).store(dst.to(dtype))
            fence_async_shared()
            mbarrier.arrive(ds_ready.index(buf), count=1)
        if not tile.EARLY_DV:
            dv = warpgroup_mma(pt_op, do, dv, is_async=True)
        dk = warpgroup_mma(dst_op, q, dk, is_async=True)
        if tile.FUSED_DQ:
            # The previous tile's dQ behind this tile's dV and dK: the other warpgroup wrote its half of that dSᵀ
            # a tile ago, so the two rarely wait for each other. At t = 0 nothing waits, arrives or is added.
            pbuf = (g + 1) % 2  # (g - 1) % 2 from t = 1
            mbarrier.wait(ds_ready.index(pbuf), ((g + 1) // 2 + 1) & 1, pred=t > t_first)  # parity of (g - 1) // 2
            dq = warpgroup_mma(_ds_rows(ds_smem.index(pbuf), tile), k_dq, zero_dq, use_acc=False, is_async=True)
            dv, dk, dq, pt_op, dst_op = warpgroup_mma_wait(0, deps=(dv, dk, dq, pt_op, dst_op))
            mbarrier.arrive(empty.index(stage), count=1)
            mbarrier.arrive(ds_free.index(pbuf), count=1, pred=t > t_first)
            _hand_dq(dq, DQ, dq_smem, dq_full, dq_empty, off_b, off_hkv, t - 1, lo, row_tiles, shift, dq_rows,
                     t > t_first, tile)
        else:
            dv, dk, pt_op, dst_op = warpgroup_mma_wait(0, deps=(dv, dk, pt_op, dst_op))
            mbarrier.arrive(empty.index(stage), count=1)
    if tile.FUSED_DQ:  # the last tile's dQ (nothing when there was no tile)
        last = gl.maximum(it + (t_end - t_first) - 1, 0)
        mbarrier.wait(ds_ready.index(last % 2), (last // 2) & 1, pred=t_end > t_first)
        dq = warpgroup_mma(_ds_rows(ds_smem.index(last % 2), tile), k_dq, zero_dq, use_acc=False, is_async=True)
        dq = warpgroup_mma_wait(0, deps=(dq,))
        mbarrier.arrive(ds_free.index(last % 2), count=1, pred=t_end > t_first)
        _hand_dq(dq, DQ, dq_smem, dq_full, dq_empty, off_b, off_hkv, gl.maximum(t_end - 1, t_first), lo, row_tiles,
                 shift, dq_rows, t_end > t_first, tile)
        if not tile.ORDERED:
            tma.store_wait(0)  # the last reduce has read its staging buffer
    it += t_end - t_first

    if tile.SPLIT:
        if slot >= 0:  # a piece's partial sums, K and V released first (a program's items after a piece are pieces)
            mbarrier.arrive(kv_empty, count=1)
            out_keys = tile.WG * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, kv_layout))
            _store_dkdv(dk, dv, DK_PART, DV_PART, slot, 0, out_keys,
                        gl.arange(0, D, layout=gl.SliceLayout(0, kv_layout)), tile.BLOCK_N, tile.BLOCK_N * D, D, 0,
                        tile.BLOCK_N * D, D, 0, sm_scale)
        else:
            _store_block(dk, dv, args, n, off_b, off_hkv, key0, tile)
    else:
        _store_block(dk, dv, args, n, off_b, off_hkv, key0, tile)
    return it


@gluon.jit
def _store_block(dk, dv, args, n, off_b, off_hkv, key0, tile):
    """_consumer's dK (times the scale) and dV of the program's ``n``-th key block (this warpgroup's 64 keys from
    ``key0``), K and V released: by TMA with TMA_OUT, staged in the warpgroup's K and V rows once both warpgroups are
    past the block's last matmul (persistent with FUSED_DQ in the dSᵀ/dQ buffers, with K and V released first:
    ``_early_dkdv``), else from registers after releasing K and V."""
    (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_bar, kv_empty, ready, empty, ds_smem, ds_ready, ds_free,
     dq_smem, dq_full, dq_empty, done, staged, seqlen_q, seqlen_k, heads_kv, head_group, num_tiles, window_left,
     dk_desc, dv_desc, DQ, dq_rows, DK, DV, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
     qk_scale, sm_scale, DK_PART, DV_PART, split) = args
    D: gl.constexpr = tile.HEAD_DIM
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, D, 16])
    if tile.TMA_OUT:  # K and V are free once both warpgroups are past the block's last matmul
        mbarrier.arrive(done, count=1)
        mbarrier.wait(done, n & 1)
        if tile.PERSISTENT and tile.FUSED_DQ:  # released before the stores: the next block's K and V load under them
            mbarrier.arrive(kv_empty, count=1)
            _early_dkdv(dk * sm_scale, dv, dk_desc, dv_desc, ds_smem, dq_smem, staged, n, off_b, off_hkv, key0, tile)
        else:
            rows = k_smem.reshape([tile.BLOCK_N, D]), v_smem.reshape([tile.BLOCK_N, D])
            _store_dkdv_tma(dk * sm_scale, dv, dk_desc, dv_desc, rows[0].slice(tile.WG * 64, 64),
                            rows[1].slice(tile.WG * 64, 64), k_smem.slice(tile.WG * 64, 64, dim=1),
                            v_smem.slice(tile.WG * 64, 64, dim=1), off_b, off_hkv, key0)
            mbarrier.arrive(kv_empty, count=1)
    else:
        mbarrier.arrive(kv_empty, count=1)
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, kv_layout))
        out_keys = key0 + gl.arange(0, 64, layout=gl.SliceLayout(1, kv_layout))
        _store_dkdv(dk, dv, DK, DV, off_b, off_hkv, out_keys, cols, seqlen_k, stride_dkb, stride_dks, stride_dkh,
                    stride_dvb, stride_dvs, stride_dvh, sm_scale)


@gluon.jit
def _consumer_split(k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_bar, kv_empty, ready, empty, p_smem,
                    dst_smem, pd_ready, pd_free, seqlen_q, seqlen_k, heads_kv, head_group, num_tiles, window_left, DK,
                    DV, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh, qk_scale, sm_scale,
                    tile):
    """One warpgroup at d = 256, per key block: the block's 64 keys, columns ``WG · D/2 ...`` of their dK and dV.
    Per row tile it computes Sᵀ and dPᵀ for rows ``WG · 32 ...`` of the tile (the whole head dim), writes that half
    of Pᵀ and dSᵀ to shared memory, and once both warpgroups have, adds its columns of dV = Pᵀ dO and dK = dSᵀ Q over
    all 64 rows (two [64 keys, 32 rows] halves each). "pd_ready" counts the halves written, "pd_free" the
    warpgroups done reading them. dK and dV leave from registers, after K and V are released."""
    _blocks(_consumer_split_block, (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_bar, kv_empty, ready,
             empty, p_smem, dst_smem, pd_ready, pd_free, seqlen_q, seqlen_k, heads_kv, head_group, num_tiles,
             window_left, DK, DV, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh, qk_scale,
             sm_scale), num_tiles, tile)


@gluon.jit
def _consumer_split_block(tid, it, n, args, tile):
    """_consumer_split's key block ``tid``, the program's ``n``-th, its row tiles from the program's ``it``-th;
    returns the next block's ``it``."""
    (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_bar, kv_empty, ready, empty, p_smem, dst_smem, pd_ready,
     pd_free, seqlen_q, seqlen_k, heads_kv, head_group, num_tiles, window_left, DK, DV, stride_dkb, stride_dks,
     stride_dkh, stride_dvb, stride_dvs, stride_dvh, qk_scale, sm_scale) = args
    D: gl.constexpr = tile.HEAD_DIM
    HALF_D: gl.constexpr = D // 2
    BLOCK_M: gl.constexpr = tile.BLOCK_M
    HALF_M: gl.constexpr = BLOCK_M // 2
    STAGES: gl.constexpr = tile.STAGES
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HALF_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HALF_D, 16])
    stats: gl.constexpr = gl.SliceLayout(0, st_layout)
    dtype: gl.constexpr = q_smem.dtype
    diag = seqlen_k - seqlen_q
    zero_st = gl.zeros([tile.BLOCK_N, HALF_M], gl.float32, layout=st_layout)
    k = k_smem.reshape([tile.BLOCK_N, D])
    v = v_smem.reshape([tile.BLOCK_N, D])
    off_b, off_hkv, pid_n, n0, lo, row_tiles, shift = _key_block(tid, seqlen_q, seqlen_k, heads_kv, head_group,
                                                                 num_tiles, window_left, None, tile)
    keys = n0 + gl.arange(0, tile.BLOCK_N, layout=gl.SliceLayout(1, st_layout))
    full_from = n0 + tile.BLOCK_N - 1 - diag  # row tiles starting here see every key of the block
    win_from = n0 - diag + window_left + 1  # WINDOW: rows from here on do not see the block's first key
    dk = gl.zeros([tile.BLOCK_N, HALF_D], gl.float32, layout=kv_layout)
    dv = gl.zeros([tile.BLOCK_N, HALF_D], gl.float32, layout=kv_layout)
    mbarrier.wait(kv_bar, n & 1)
    n_tiles = row_tiles * tile.GROUP
    for t in range(n_tiles):
        g = it + t
        stage = g % STAGES
        m = _row_tile(t, lo, row_tiles, shift, tile)[1]
        mbarrier.wait(ready.index(stage), (g // STAGES) & 1)
        q = q_smem.index(stage).reshape([BLOCK_M, D])
        do = do_smem.index(stage).reshape([BLOCK_M, D])
        st = warpgroup_mma(k, q.slice(tile.WG * HALF_M, HALF_M).permute((1, 0)), zero_st, use_acc=False,
                           is_async=True)
        dpt = warpgroup_mma(v, do.slice(tile.WG * HALF_M, HALF_M).permute((1, 0)), zero_st, use_acc=False,
                            is_async=True)
        st, dpt = warpgroup_mma_wait(0, deps=(st, dpt))
        lse = lse_smem.index(stage).slice(tile.WG * HALF_M, HALF_M).load(stats)
        pt = gl.exp2(st * qk_scale - lse[None, :])
        if tile.CAUSAL:
            if m < full_from:
                rows = m + tile.WG * HALF_M + gl.arange(0, HALF_M, layout=stats)
                pt = gl.where(keys[:, None] <= rows[None, :] + diag, pt, 0.0)
        if tile.WINDOW:
            if m + tile.WG * HALF_M + HALF_M > win_from:
                rows = m + tile.WG * HALF_M + gl.arange(0, HALF_M, layout=stats)
                pt = gl.where(keys[:, None] >= rows[None, :] + (diag - window_left), pt, 0.0)
        dst = pt * (dpt - delta_smem.index(stage).slice(tile.WG * HALF_M, HALF_M).load(stats)[None, :])
        mbarrier.wait(pd_free, (g & 1) ^ 1)  # both warpgroups read the last tile's halves (a fresh barrier passes)
        p_smem.index(tile.WG).store(pt.to(dtype))
        dst_smem.index(tile.WG).store(dst.to(dtype))
        fence_async_shared()
        mbarrier.arrive(pd_ready, count=1)
        mbarrier.wait(pd_ready, g & 1)
        for h in gl.static_range(2):
            do_h = do.slice(h * HALF_M, HALF_M).slice(tile.WG * HALF_D, HALF_D, dim=1)
            q_h = q.slice(h * HALF_M, HALF_M).slice(tile.WG * HALF_D, HALF_D, dim=1)
            dv = warpgroup_mma(p_smem.index(h), do_h, dv, is_async=True)
            dk = warpgroup_mma(dst_smem.index(h), q_h, dk, is_async=True)
        dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
        mbarrier.arrive(empty.index(stage), count=1)
        mbarrier.arrive(pd_free, count=1)
    it += n_tiles
    mbarrier.arrive(kv_empty, count=1)
    cols = tile.WG * HALF_D + gl.arange(0, HALF_D, layout=gl.SliceLayout(0, kv_layout))
    out_keys = n0 + gl.arange(0, tile.BLOCK_N, layout=gl.SliceLayout(1, kv_layout))
    _store_dkdv(dk, dv, DK, DV, off_b, off_hkv, out_keys, cols, seqlen_k, stride_dkb, stride_dks, stride_dkh,
                stride_dvb, stride_dvs, stride_dvh, sm_scale)
    return it


@gluon.jit
def _store_dkdv(dk, dv, DK, DV, off_b, off_hkv, out_keys, cols, seqlen_k, stride_dkb, stride_dks, stride_dkh,
                stride_dvb, stride_dvs, stride_dvh, sm_scale):
    """A warpgroup's dK (times the scale) and dV: rows ``out_keys`` (those past the end dropped), columns ``cols``."""
    keep = (out_keys < seqlen_k)[:, None]
    p_dk = DK + off_b.to(gl.int64) * stride_dkb + off_hkv * stride_dkh + out_keys.to(gl.int64)[:, None] * stride_dks
    p_dv = DV + off_b.to(gl.int64) * stride_dvb + off_hkv * stride_dvh + out_keys.to(gl.int64)[:, None] * stride_dvs
    gl.store(p_dk + cols[None, :], (dk * sm_scale).to(DK.dtype.element_ty), mask=keep)
    gl.store(p_dv + cols[None, :], dv.to(DV.dtype.element_ty), mask=keep)


@gluon.jit
def _store_dkdv_tma(dk, dv, dk_desc, dv_desc, k_rows, v_rows, k_box, v_box, off_b, off_hkv, key0):
    """A warpgroup's 64 rows of dK (already scaled) and dV by TMA stores, staged in its own 64 rows of K and V
    (``k_rows``/``v_rows`` as ``[64, D]``, ``k_box``/``v_box`` as ``[1, 64, 1, D]``: dK's and dV's box, type and
    swizzle); the copy engine drops keys past the end. Returns once the copies have read them. (``gl.store`` from
    the wgmma layout cost the forward 10-25 % at short lengths, NOTES v13.)"""
    k_rows.store(dk.to(dk_desc.dtype))
    v_rows.store(dv.to(dv_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [off_b, key0, off_hkv, 0], k_box)
    tma.async_copy_shared_to_global(dv_desc, [off_b, key0, off_hkv, 0], v_box)
    tma.store_wait(0)


@gluon.jit
def _early_dkdv(dk, dv, dk_desc, dv_desc, ds_smem, dq_smem, staged, n, off_b, off_hkv, key0, tile):
    """A persistent fused-dQ program's dK (scaled) and dV of its ``n``-th block by TMA stores staged in the dSᵀ
    buffers (warpgroup 0) or the dQ staging buffers (warpgroup 1): both are free once both warpgroups are past the
    block's last dQ product and its reduce has read its buffer (``done``), so K and V are released before the
    stores and the next block's load runs under them. Returns once both warpgroups' stores have read their buffers
    (``staged``): the next block's first dSᵀ and dQ tiles reuse them."""
    D: gl.constexpr = tile.HEAD_DIM
    dtype: gl.constexpr = dk_desc.dtype
    gl.static_assert(tile.BLOCK_N * tile.BLOCK_M >= 64 * D and tile.BLOCK_M >= 64
                     and dq_part_rows(tile.BLOCK_M) * dq_part_cols(tile.BLOCK_M, D) * 2 >= 64 * D,
                     "a warpgroup's dK and dV (2-byte elements: stores_by_tma) fit its staging buffers")
    if tile.WG == 0:
        bufs = ds_smem._reinterpret(dtype, [2, 1, 64, 1, D], dk_desc.layout)
    else:
        bufs = dq_smem._reinterpret(dtype, [2, 1, 64, 1, D], dk_desc.layout)
    _store_dkdv_tma(dk, dv, dk_desc, dv_desc, bufs.index(0).reshape([64, D]), bufs.index(1).reshape([64, D]),
                    bufs.index(0), bufs.index(1), off_b, off_hkv, key0)
    mbarrier.arrive(staged, count=1)
    mbarrier.wait(staged, n & 1)


def descriptors(q, k, v, do, dk, dv, tile) -> tuple:
    """Q's, K's, V's, dO's, dK's and dV's descriptors for ``tile``: a row tile of one head, a key block of one kv
    head, and for dK and dV a warpgroup's 64 keys (its K and V rows' box, which stage them, or in a persistent
    fused-dQ tile the dSᵀ/dQ buffers, ``_early_dkdv``). Where the kernel stores
    dK and dV from registers (``stores_by_tma`` is false) Q's and dO's stand in for them, unread."""
    d = q.shape[-1]
    rows_block, keys_block, out_block = (1, tile.block_m, 1, d), (1, tile.block_n, 1, d), (1, KEYS_PER_WARPGROUP, 1, d)
    q_desc, do_desc = descriptor(q, rows_block), descriptor(do, rows_block)
    outs = ((descriptor(dk, out_block), descriptor(dv, out_block)) if stores_by_tma(q, dk, dv, tile)
            else (q_desc, do_desc))
    return (q_desc, descriptor(k, keys_block), descriptor(v, keys_block), do_desc, *outs)


def stores_by_tma(q, dk, dv, tile) -> bool:
    """Whether the kernel stores dK and dV by TMA, staged in each warpgroup's own 64 rows of K and V (a [64, D] box,
    dK's and dV's shape, type and swizzle; a persistent fused-dQ tile stages them in its dSᵀ/dQ buffers): at
    d = 64 and 128 with 64-row tiles, into outputs of q's dtype with a 16-byte aligned base and strides. Otherwise
    it stores them from registers (``gl.store``), as at d = 256 (whose warpgroups share their keys), for ring
    attention, which sums its steps into float32 dk and dv, and on 128-row tiles (d = 64's fused dQ), where TMA
    stores measured 3-5 % slower non-causal (NOTES v22)."""
    return (q.shape[-1] <= 128 and tile.block_m == KEYS_PER_WARPGROUP and dk.dtype == q.dtype and dv.dtype == q.dtype
            and tma_aligned(dk, dv))


def launch_dkdv(q, k, v, do, lse, delta, dk, dv, scale: float, causal: bool, tile, keep: bool = False, dq_acc=None,
                dq_sem=None, head_group: int = 1, window_left: int | None = None):
    """dK and dV of ``q [B, Sq, Hq, D]``, ``k``/``v [B, Sk, Hkv, D]``, ``do [B, Sq, Hq, D]`` with the forward's lse and
    delta (``[B, Hq, Sq]``, last dim contiguous; from the dQ kernel, or from the preprocess kernel before a fused dQ)
    into ``dk``/``dv`` (any float dtype, last dim contiguous; by TMA stores where ``stores_by_tma``, else from
    registers). A ``fused_dq`` tile also adds dS K (dQ without the scale) into ``dq_acc`` (the memory of float32 ``[B,
    Sq rounded up to the row tile, Hq, D]``, contiguous, each row tile's in the kernel's order, ``_dq_coord``; all of it
    zeroed before this launch, padding rows too: backward.py's delta pass does it); a ``dq_ordered`` one adds in a fixed
    order, counting the adds in ``dq_sem`` (int32 ``[B, Hq, row tiles]``, zeroed likewise), and stores its first add to
    each row tile, so ``dq_acc`` needs zeroing only in the rows no key block sees (causal, Sq > Sk). ``head_group``: the
    (batch, kv head) columns launched interleaved (``_configs.bwd_head_group``; 1 for ``dq_ordered``, whose waits need a
    head's programs launched together). Returns ``(grid, Relaunch or None)``: with ``keep``, the launch kept for repeats
    with new arrays (``descriptors(q, k, v, do, dk, dv, tile), lse, delta, dk, dv, dq_descriptor(dq_acc, ...),
    semaphores(dq_sem, ...)``, placeholders where not fused or not ordered). ``window_left``: a causal window's left
    side (query i sees keys i + Sk - Sq - window_left ... i + Sk - Sq): a key block's programs skip the row tiles past
    its window and mask those crossing its edge; None without a window."""
    if window_left is not None and not (causal and window_left >= 0):
        raise ValueError(f"window_left: the Hopper dK/dV kernel runs causal windows with a left side >= 0, not "
                         f"{window_left} with causal={causal}")
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"q: the Hopper dK/dV kernel is built for head dims {HEAD_DIMS}, not {q.shape[-1]}")
    for name, x in (("dk", dk), ("dv", dv)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name}: the kernel writes rows of a contiguous last dim, not stride {x.stride(-1)}")
    split = q.shape[-1] > 128  # d = 256: both warpgroups on 64 keys, each with half of dK's and dV's columns
    keys = KEYS_PER_WARPGROUP if split else 2 * KEYS_PER_WARPGROUP
    rows = ROW_TILES.get(q.shape[-1], (64,))
    if tile.block_m not in rows or tile.block_n != keys or tile.num_warps != 4:
        raise ValueError(f"config: the Hopper dK/dV kernel runs {keys} keys over two 4-warp warpgroups and "
                         f"{' or '.join(map(str, rows))}-row tiles at d = {q.shape[-1]}, not {tile}")
    if split and tile.fused_dq:
        raise ValueError("config: fused_dq runs at d = 64 and 128 only")
    if tile.fused_dq != (dq_acc is not None):
        raise ValueError("dq_acc: a fused_dq tile needs the float32 dQ accumulator, and only it takes one")
    if tile.dq_ordered and not tile.fused_dq:
        raise ValueError("config: dq_ordered orders a fused_dq tile's adds")
    if tile.last_block_first and not tile.dq_ordered:
        raise ValueError("config: last_block_first orders a dq_ordered tile's launch")
    if split and tile.early_dv:
        raise ValueError("config: early_dv orders the d = 64 and 128 warpgroups' matmuls; d = 256 has no such order")
    if tile.dq_ordered != (dq_sem is not None):
        raise ValueError("dq_sem: a dq_ordered tile needs the int32 counters, and only it takes them")
    if delta.stride() != lse.stride():
        raise ValueError(f"delta: the kernel reads it with lse's strides {lse.stride()}, not {delta.stride()}")
    if tile.persistent and tile.dq_ordered:
        raise ValueError("config: dq_ordered tiles wait on other key blocks' programs, so each takes one block: "
                         "not persistent")
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    blocks = cdiv(sk, tile.block_n)  # key blocks per (batch, kv head)
    num_tiles = blocks * b * hkv
    group = 1 if tile.dq_ordered else head_group
    if window_left is not None:  # sides past Sq + Sk reach every key: clamped there, int32 sums cannot overflow
        window_left = min(window_left, sq + sk)
    grid = (programs(sq, sk, b * hkv, hq // hkv, causal, tile.block_m, tile.block_n, group, _sm_count(q.device),
                     window_left) if tile.persistent else num_tiles,)
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc = descriptors(q, k, v, do, dk, dv, tile)
    rows_per_batch = cdiv(sq, tile.block_m) * tile.block_m
    if dq_acc is not None and (dq_acc.shape != (b, rows_per_batch, hq, d) or not dq_acc.is_contiguous()
                               or dq_acc.dtype != torch.float32):
        raise ValueError(f"dq_acc: a contiguous float32 [B, Sq rounded up to {tile.block_m}, Hq, D] = "
                         f"{(b, rows_per_batch, hq, d)}, not {dq_acc.dtype} {tuple(dq_acc.shape)}")
    if dq_sem is not None:
        if dq_sem.shape != (b, hq, rows_per_batch // tile.block_m) or dq_sem.dtype != torch.int32 \
                or not dq_sem.is_contiguous():
            raise ValueError(f"dq_sem: contiguous int32 [B, Hq, row tiles] = {(b, hq, rows_per_batch // tile.block_m)}, "
                             f"not {dq_sem.dtype} {tuple(dq_sem.shape)}")
        if blocks > ordered_blocks(q.device):  # a (batch, kv head)'s programs wait on each other: all resident
            raise ValueError(f"config: dq_ordered needs all {blocks} key blocks of a (batch, kv head) resident at "
                             f"once, and this device runs {ordered_blocks(q.device)}")
    dq_arg = dq_descriptor(dq_acc, tile, d, q.device)
    plain = tile.persistent and not causal and sk >= BWD_TAIL_MIN_KEYS.get(d, sk + 1)
    pieces, full, items = split_tail(num_tiles, grid[0], cdiv(sq, tile.block_m) * (hq // hkv), 2, plain)
    parts = (None, None)  # constexprs: a kept launch's arrays lead its arguments (_launch.prepare)
    if pieces > 1:  # the last lap's key blocks in pieces: their float32 dK and dV, summed after (not kept)
        parts = tuple(torch.empty((num_tiles - full) * pieces, tile.block_n, d, device=q.device, dtype=torch.float32)
                      for _ in range(2))
        keep = False
    kept = start(
        keep, attention_bwd_dkdv_sm90_kernel, grid, 12,
        q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse, delta, dk, dv, dq_arg, semaphores(dq_sem, q.device),
        lse.stride(0), lse.stride(1),
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2), rows_per_batch,
        sq, sk, hkv, scale * LOG2E, scale, group, items, window_left or 0,
        *parts, full, pieces,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, HEAD_DIM=d, STAGES=tile.num_stages, CAUSAL=causal,
        GROUP=hq // hkv, FUSED_DQ=tile.fused_dq, ORDERED=tile.dq_ordered, TMA_OUT=stores_by_tma(q, dk, dv, tile),
        LAST_BLOCK_FIRST=tile.last_block_first and causal, EARLY_DV=tile.early_dv, PERSISTENT=tile.persistent,
        WINDOW=window_left is not None, SPLIT=pieces > 1, num_warps=4,
    )
    if pieces > 1:
        sum_pieces(*parts, dk, dv, full, pieces, b * hkv, group)
    return grid, kept


def ordered_blocks(device) -> int:
    """The most key blocks per (batch, kv head) a ``dq_ordered`` launch takes on ``device``: one resident program
    per SM (the kernel's shared memory allows no second), and non-causal programs, and causal ones launched block 0
    first, may wait on programs launched after them, so all must be resident at once. (A device shared under MPS
    with an SM limit, or kernels holding SMs for the whole launch, leave fewer SMs than this count: such a launch
    can then stall until they let go, or hang.)"""
    return _sm_count(device)  # (132 for the compile-only runs on CPU tensors)
