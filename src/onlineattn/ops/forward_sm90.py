"""Forward attention on Hopper (sm_90): a warp-specialized Gluon kernel, FlashAttention-3's structure.

A program takes tiles of ``BLOCK_M = 128`` query rows of one head (one tile, or with ``persistent`` a lap-strided
run of them), each split between two consumer warpgroups of 64 rows; at d = 64 long launches take 192-row tiles over
three (FA3's d = 64 tile has 192 rows too), whose Q arrives in three 64-row boxes.
A one-warp producer partition streams K and V blocks by TMA into a ring of ``num_stages`` shared-memory stages; each
stage has a "ready" mbarrier (the copy landed) and an "empty" one (every consumer is done reading it). Each consumer
keeps its own online-softmax state (m, l, acc) and, for block j, issues QKᵀ_j, then P_{j-1}·V_{j-1} (P stays in
registers as wgmma's A operand), waits for QKᵀ_j, runs block j's softmax, then waits for the P·V. The source waits for
the P·V after the softmax, but in tiles without ``lazy_rescale`` ptxas schedules that wait (a WARPGROUP.DEPBAR, which
has no register operands) at the top of the softmax's basic block, so there the softmax runs once the warpgroup's own
P·V is done, under the other warpgroups' matmuls (with it, the warpgroup-wide test of the rows' maxima keeps the
wait below the softmax). A form that keeps the wait in place everywhere read up to 9 % slower (at d = 64; elsewhere
about its own cost), and 4-13 % with FA3's ping-pong turns added (NOTES v30). Each consumer
writes its rows of O through a shared-memory staging buffer by TMA stores that run on under its next tile.
With ``lazy_rescale`` (``LAZY_RESCALE_FROM``: where it measured faster) a row keeps its running max until a score
passes it by 2^8, and a warpgroup rescales its O only in blocks where one of its rows took a new max (``_step``);
l and O share the stale max, so the result is exact (P reaches up to 2^8, well inside bf16/fp16's range).
With ``early_p`` a block's P is converted to wgmma's A operand right after its softmax (under the previous block's
P·V where that wait stays below the softmax), rather than just before its own P·V is issued, when the next block's
scores are already live.

Under causal, when the diagonal falls on a 128-key block boundary (``half_diagonal``; 128-key blocks: d = 64 and 128
outside the short causal tile, which like d = 256 runs 64-key blocks), warpgroup 0's rows see only
the first 64 keys of their tile's last (diagonal) block: it takes that block's QKᵀ and P·V over those 64 keys
(``_half_end``), a quarter of the block's matmul work and half of that warpgroup's softmax there. Where its rows see
none of the tile's last block (64-key blocks, or a diagonal off the block boundaries; in 192-row tiles warpgroup 1
too), it computes one block fewer (``_own_blocks``) and only releases that block's stage at the hand-over (``_skip``).

A program's tiles hand over: the next tile's first QKᵀ is issued right after this tile's last P·V and runs under
this tile's epilogue. Q has ``q_stages`` buffers (a second lets the producer load the next tile's Q early).

A non-causal persistent launch's tiles are equal, so where they are not a whole number of laps the last lap leaves
SMs idle. With ``SPLIT`` (``launch``: ``tail_pieces``) that lap's tiles run as pieces of their key blocks, more
items than tiles (``_tile_coords``); a piece's o and lse leave in float32 (``_store_piece``) and ``merge_pieces``, a
Triton kernel launched after this one, merges each tile's pieces in order into o and lse.

A sliding window (``WINDOW``) runs as a causal launch whose diagonal moves right by the window's right side: a tile's
key blocks start at the block holding its first row's left edge (``_key0``: blocks left of it are not loaded), and
``_softmax`` also masks blocks that start left of a warpgroup's last row's left edge. Every warpgroup of a tile
computes from that first block (a later warpgroup's rows may see none of it: masked, as a row that sees no key yet).

With ``SINK`` a tile's first block starts each row from its head's sink (m = sink, l = 1: a first key with no value).

Plain attention, or with a sliding window and/or sinks as its only variants: float16/bfloat16, equal head dims for K
and V (64, 128 or 256), a positive scale, strides a TMA descriptor accepts. ``forward.py`` routes a launch here when
``fwd_config`` picks a ``gluon`` tile (``ops/_configs.py`` says where it was measured faster); everything else runs
the Triton kernel.
Gluon has no interpreter, so CI compiles this kernel for sm_90 (tests/ops/test_forward_sm90.py) and the GPU suite
runs it. Which tile or piece an item is, the key blocks a tile and each warpgroup compute, and a persistent launch's
program count are in ``forward_sm90_schedule.py``.
"""

# No ``from __future__ import annotations``: the aggregate below reads its field annotations as types.
import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.core import _aggregate as aggregate

from ._common import LOG2E
from . import _launch as launch_cache
from ._configs import FWD_TAIL_MIN_KEYS
from ._launch import bounded_put, cdiv, keep_by_address, sm_count, start
from .forward_sm90_schedule import _key0, _own_blocks, _right, _tile_coords, half_diagonal, programs
from .pieces import merge_pieces, split_tail

ROWS_PER_WARPGROUP = 64
O_COLUMNS = 128  # an O store's box width (d = 256 stores two halves: a whole-row buffer would not fit)
SHARED_BYTES = 232448  # an sm_90 program's most (227 KiB)
HEAD_DIMS = (64, 128, 256)  # what this kernel is built and tested for (backward_sm90.HEAD_DIMS: the dK/dV kernel's)
CONSUMER_REGS_3 = gl.constexpr(160)  # the 2nd and 3rd consumers' registers a thread in a 192-row tile (512 threads:
#                                       three consumer warpgroups and the producer warp's, which takes a warpgroup's
#                                       share; the first consumer, the default partition, gets the other 168)


@aggregate
class Tile:
    """The compile-time shape a partition needs (this kernel's and backward_sm90.py's). ``warp_specialize`` flattens
    partition arguments into IR values, so constexprs travel inside an aggregate's type."""

    WG: gl.constexpr  # which consumer warpgroup (0, 1, or 2 in 192-row tiles); unused by the producer
    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr
    HEAD_DIM: gl.constexpr
    STAGES: gl.constexpr
    CAUSAL: gl.constexpr
    GROUP: gl.constexpr  # query heads per kv head where it is a constant (the dK/dV kernel); the forward's is not: 1
    FUSED_DQ: gl.constexpr  # the dK/dV kernel also reduces dQ (backward_sm90.py); the forward: False
    ORDERED: gl.constexpr  # with FUSED_DQ: the dQ adds in a fixed order (backward_sm90.py); the forward: False
    Q_STAGES: gl.constexpr  # the forward's Q buffers (two: the next tile's Q lands while this tile runs)
    TMA_OUT: gl.constexpr  # the dK/dV kernel stores dK and dV by TMA (backward_sm90.stores_by_tma)
    HALF_DIAG: gl.constexpr  # the forward: warpgroup 0 takes its tiles' diagonal block at half width (half_diagonal)
    EARLY_DV: gl.constexpr  # the dK/dV kernel: Sᵀ waited for alone, dV issued before dPᵀ is (BwdTile.early_dv)
    LAST_BLOCK_FIRST: gl.constexpr  # the dK/dV kernel: key blocks from the last (BwdTile.last_block_first)
    PERSISTENT: gl.constexpr  # the dK/dV kernel: programs loop over key blocks (BwdTile.persistent)
    LAZY_RESCALE: gl.constexpr  # the forward: a row keeps its running max until a score passes it by 2^8 (_softmax)
    EARLY_P: gl.constexpr  # the forward: a block's P becomes wgmma's A operand right after its softmax (_step)
    WINDOW: gl.constexpr  # the forward: a sliding window's left edge bounds the keys too (with CAUSAL: its right)
    SINK: gl.constexpr  # the forward: a sink logit per head joins each row's normaliser (_sink)
    SPLIT: gl.constexpr  # the forward: the last lap's tiles run as pieces of their key blocks (_tile_coords)

    @gluon.constexpr_function
    def __init__(self, WG, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, GROUP=1, FUSED_DQ=False, ORDERED=False,
                 Q_STAGES=1, TMA_OUT=False, HALF_DIAG=False, EARLY_DV=False, LAST_BLOCK_FIRST=False,
                 PERSISTENT=False, LAZY_RESCALE=False, EARLY_P=False, WINDOW=False, SINK=False, SPLIT=False):
        self.WG = gl.constexpr(WG)
        self.BLOCK_M = gl.constexpr(BLOCK_M)
        self.BLOCK_N = gl.constexpr(BLOCK_N)
        self.HEAD_DIM = gl.constexpr(HEAD_DIM)
        self.STAGES = gl.constexpr(STAGES)
        self.CAUSAL = gl.constexpr(CAUSAL)
        self.GROUP = gl.constexpr(GROUP)
        self.FUSED_DQ = gl.constexpr(FUSED_DQ)
        self.ORDERED = gl.constexpr(ORDERED)
        self.Q_STAGES = gl.constexpr(Q_STAGES)
        self.TMA_OUT = gl.constexpr(TMA_OUT)
        self.HALF_DIAG = gl.constexpr(HALF_DIAG)
        self.EARLY_DV = gl.constexpr(EARLY_DV)
        self.LAST_BLOCK_FIRST = gl.constexpr(LAST_BLOCK_FIRST)
        self.PERSISTENT = gl.constexpr(PERSISTENT)
        self.LAZY_RESCALE = gl.constexpr(LAZY_RESCALE)
        self.EARLY_P = gl.constexpr(EARLY_P)
        self.WINDOW = gl.constexpr(WINDOW)
        self.SINK = gl.constexpr(SINK)
        self.SPLIT = gl.constexpr(SPLIT)


@gluon.jit
def attention_fwd_sm90_kernel(q_desc, k_desc, v_desc, o_desc, LSE, stride_lb, stride_lh,
                              seqlen_q, seqlen_k, heads_q, group, qk_scale, num_tiles, window_left, window_right,
                              SINKS, O_PART, LSE_PART, split_full, split_pieces, BLOCK_M: gl.constexpr,
                              BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                              STAGES: gl.constexpr, CAUSAL: gl.constexpr, Q_STAGES: gl.constexpr,
                              HALF_DIAG: gl.constexpr, LAZY_RESCALE: gl.constexpr, EARLY_P: gl.constexpr,
                              WINDOW: gl.constexpr, SINK: gl.constexpr, SPLIT: gl.constexpr):
    """Programs take tiles ``pid, pid + programs, ...`` of ``num_tiles`` (one each when the grid covers them all).
    With ``HALF_DIAG`` warpgroup 0 takes each tile's diagonal block at half width (``_half_end``); with
    ``LAZY_RESCALE`` rows keep their running max until a score passes it by 2^8 (``_softmax``); with ``EARLY_P``
    a block's P is converted to wgmma's A operand right after its softmax (``_step``). With ``WINDOW`` (launched
    ``CAUSAL``) query i sees keys i + diag - window_left .. i + diag + window_right (diag = Sk - Sq): a tile's key
    blocks start at its first row's left edge (``_key0``). With ``SINK``, ``SINKS [Hq]`` holds a logit per head that
    joins every row's normaliser with no value (``_sink``; None without). With ``SPLIT`` (plain, not causal) items
    from ``split_full`` on are pieces, ``split_pieces`` a tile, of the last lap's tiles: ``num_tiles`` counts items,
    and a piece's float32 state goes to ``O_PART`` and ``LSE_PART`` for ``merge_pieces`` (None without)."""
    dtype: gl.constexpr = q_desc.dtype
    CONSUMERS: gl.constexpr = BLOCK_M // 64  # warpgroups, 64 rows each
    gl.static_assert((CONSUMERS == 2) | ((CONSUMERS == 3) & (not HALF_DIAG)), "128 or 192 rows; HALF_DIAG at 128")
    Q_BOXES: gl.constexpr = BLOCK_M // q_desc.block_type.shape[1]  # Q's boxes a tile (_q_box_rows)
    q_smem = gl.allocate_shared_memory(dtype, [Q_STAGES * Q_BOXES] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    o_smem = gl.allocate_shared_memory(dtype, [CONSUMERS] + o_desc.block_type.shape, o_desc.layout)  # O rows
    q_ready = gl.allocate_shared_memory(gl.int64, [Q_STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_STAGES, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(Q_STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=CONSUMERS)  # one arrival per consumer warpgroup
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
    fence_async_shared()

    smem = (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty)
    # Partition arguments must be IR values: an int argument equal to 1 arrives as a constexpr (Triton specialises
    # it), so every scalar is made a tensor.
    seqlen_q = gl.to_tensor(seqlen_q)
    seqlen_k = gl.to_tensor(seqlen_k)
    heads_q = gl.to_tensor(heads_q)
    num_tiles = gl.to_tensor(num_tiles)
    group = gl.to_tensor(group)
    stride_lb = gl.to_tensor(stride_lb)
    stride_lh = gl.to_tensor(stride_lh)
    shape = (seqlen_q, seqlen_k, heads_q, num_tiles, gl.to_tensor(window_left), gl.to_tensor(window_right),
             gl.to_tensor(split_full), gl.to_tensor(split_pieces))
    if SINK:
        sinks = SINKS
    else:  # a partition argument must be an IR value: lse's pointer stands in, never read
        sinks = LSE
    if SPLIT:
        parts = (O_PART, LSE_PART)
    else:  # as for the sinks
        parts = (LSE, LSE)
    consumer = smem + shape + (o_desc, o_smem, LSE, stride_lb, stride_lh, qk_scale, sinks) + parts
    tile = Tile(0, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, Q_STAGES=Q_STAGES, HALF_DIAG=HALF_DIAG,
                LAZY_RESCALE=LAZY_RESCALE, EARLY_P=EARLY_P, WINDOW=WINDOW, SINK=SINK, SPLIT=SPLIT)
    producer = (q_desc, k_desc, v_desc) + smem + shape + (group, tile)
    wg0, wg1 = consumer + (tile,), consumer + (_warpgroup(tile, 1),)
    if CONSUMERS == 2:  # (Gluon builds the partition list only from literals)
        gl.warp_specialize([(_consumer, wg0), (_consumer, wg1), (_producer, producer)], [4, 1], [240, 24])
    else:
        gl.warp_specialize([(_consumer, wg0), (_consumer, wg1), (_consumer, consumer + (_warpgroup(tile, 2),)),
                            (_producer, producer)], [4, 4, 1], [CONSUMER_REGS_3, CONSUMER_REGS_3, 24])


@gluon.constexpr_function
def _warpgroup(tile, wg):
    """Consumer warpgroup ``wg``'s copy of warpgroup 0's ``tile`` (``HALF_DIAG`` is warpgroup 0's alone)."""
    return Tile(wg, tile.BLOCK_M, tile.BLOCK_N, tile.HEAD_DIM, tile.STAGES, tile.CAUSAL, Q_STAGES=tile.Q_STAGES,
                LAZY_RESCALE=tile.LAZY_RESCALE, EARLY_P=tile.EARLY_P, WINDOW=tile.WINDOW, SINK=tile.SINK,
                SPLIT=tile.SPLIT)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
              seqlen_q, seqlen_k, heads_q, num_tiles, window_left, window_right, split_full, split_pieces, group,
              tile):
    """One warp: per tile, Q into the next of ``Q_STAGES`` buffers once every consumer has released its last tile,
    then K_j and V_j into the ring's next stages (``it`` counts blocks across tiles) once every consumer has
    released them."""
    BLOCK_N: gl.constexpr = tile.BLOCK_N
    STAGES: gl.constexpr = tile.STAGES
    Q_ROWS: gl.constexpr = q_desc.block_type.shape[1]
    Q_BOXES: gl.constexpr = tile.BLOCK_M // Q_ROWS
    band = (window_left, window_right, 0)
    it = 0
    n = 0  # tiles so far: Q buffer n % Q_STAGES
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_b, off_h, m0, n_blocks, first, _ = _tile_coords(t, seqlen_q, seqlen_k, heads_q, num_tiles, band,
                                                            (split_full, split_pieces), tile)
        slot = n % tile.Q_STAGES
        mbarrier.wait(q_empty.index(slot), ((n // tile.Q_STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
        mbarrier.expect(q_ready.index(slot), Q_BOXES * q_desc.block_type.nbytes)
        for i in gl.static_range(Q_BOXES):
            tma.async_copy_global_to_shared(q_desc, [off_b, m0 + i * Q_ROWS, off_h, 0], q_ready.index(slot),
                                            q_smem.index(slot * Q_BOXES + i))
        n += 1
        off_hkv = off_h // group
        key0 = _key0(m0, seqlen_q, seqlen_k, (window_left, window_right, first), tile)
        for j in range(n_blocks):
            stage = it % STAGES
            phase = (it // STAGES) & 1
            mbarrier.wait(k_empty.index(stage), phase ^ 1)
            mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [off_b, key0 + j * BLOCK_N, off_hkv, 0], k_ready.index(stage),
                                            k_smem.index(stage))
            mbarrier.wait(v_empty.index(stage), phase ^ 1)
            mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [off_b, key0 + j * BLOCK_N, off_hkv, 0], v_ready.index(stage),
                                            v_smem.index(stage))
            it += 1


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
              seqlen_q, seqlen_k, heads_q, num_tiles, window_left, window_right, split_full, split_pieces, o_desc,
              o_smem, LSE, stride_lb, stride_lh, qk_scale, SINKS, O_PART, LSE_PART, tile):
    """One warpgroup: per tile, its 64 rows' online softmax over the key blocks they see (``_rest``), then their output
    (by TMA, ``_store_o``) and log-sum-exp. Tiles hand over (``_handover``): the next tile's first QKᵀ is issued
    right after this tile's last P·V and runs under this tile's epilogue, so the tensor cores do not drain between
    tiles. ``it`` is the ring index of the tile's first key block, ``n`` the tile's place in the program's run.
    Under SPLIT an item may be a piece of a tile (``_tile_coords``): the same, over its key blocks, its state to
    ``_store_piece``; ``band``'s third value is the item's first key."""
    D: gl.constexpr = tile.HEAD_DIM
    BLOCK_N: gl.constexpr = tile.BLOCK_N
    s_layout: gl.constexpr = _acc_layout(BLOCK_N)
    o_layout: gl.constexpr = _acc_layout(D)
    rings = (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty)
    out = (o_desc, o_smem, LSE, stride_lb, stride_lh, seqlen_q, O_PART, LSE_PART)
    split = (split_full, split_pieces)
    programs = gl.num_programs(0)
    off_b, off_h, m0, n_blocks, key0, slot = _tile_coords(gl.program_id(0), seqlen_q, seqlen_k, heads_q, num_tiles,
                                                          (window_left, window_right, 0), split, tile)
    band = (window_left, window_right, key0)
    row0 = m0 + tile.WG * 64
    own = _own_blocks(row0, n_blocks, seqlen_q, seqlen_k, band, tile)
    it = 0
    n = 0
    p, m_i, l_i = _first_block(rings, it, n, row0, own, seqlen_q, seqlen_k, band, qk_scale, _sink(SINKS, off_h, tile),
                               tile, s_layout)
    for t in range(gl.program_id(0) + programs, num_tiles, programs):  # t: the next item
        band = (window_left, window_right, key0)
        acc = gl.zeros([64, D], gl.float32, layout=o_layout)
        p_last, m_i, l_i, acc = _rest(rings, p, m_i, l_i, acc, it, n, row0, own, seqlen_q, seqlen_k, band,
                                      qk_scale, tile, s_layout, o_layout)
        next_b, next_h, next_m0, next_blocks, next_key0, next_slot = _tile_coords(
            t, seqlen_q, seqlen_k, heads_q, num_tiles, (window_left, window_right, 0), split, tile)
        next_band = (window_left, window_right, next_key0)
        next_row0 = next_m0 + tile.WG * 64
        next_own = _own_blocks(next_row0, next_blocks, seqlen_q, seqlen_k, next_band, tile)
        p, m_i, l_i = _handover(rings, out, p_last, m_i, l_i, acc, it + own - 1, it + n_blocks, n + 1, off_b, off_h,
                                row0, slot, next_row0, next_own, seqlen_k, next_band, qk_scale,
                                _sink(SINKS, next_h, tile), tile, s_layout, o_layout)
        it += n_blocks
        n += 1
        off_b, off_h, row0, n_blocks, own, key0, slot = next_b, next_h, next_row0, next_blocks, next_own, next_key0, \
            next_slot
    band = (window_left, window_right, key0)
    acc = gl.zeros([64, D], gl.float32, layout=o_layout)
    p_last, m_i, l_i, acc = _rest(rings, p, m_i, l_i, acc, it, n, row0, own, seqlen_q, seqlen_k, band, qk_scale,
                                  tile, s_layout, o_layout)
    acc, p_op = _last_pv(rings, p_last, acc, it + own - 1, tile)
    acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
    mbarrier.arrive(v_empty.index((it + own - 1) % tile.STAGES), count=1)
    _epilogue(out, acc, m_i, l_i, off_b, off_h, row0, slot, tile, s_layout, o_layout)
    tma.store_wait(0)  # the last tile's O has left shared memory


@gluon.jit
def _skip(rings, first, end, tile):
    """Release ring blocks ``first`` .. ``end - 1``, which this warpgroup's rows do not see (``_own_blocks``), each
    once it has landed: the producer fills a stage only after every warpgroup released its previous block, so the
    wait keeps this release from counting toward that earlier one. The caller has not yet released the block
    before ``first`` (ring ``first - 1``'s V), so the blocks skipped must be fewer than the stages, or the wait for
    the last of them would wait on that release: one block at most, against two stages or more (``launch``)."""
    q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty = rings
    for idx in range(first, end):
        stage = idx % tile.STAGES
        phase = (idx // tile.STAGES) & 1
        mbarrier.wait(k_ready.index(stage), phase)
        mbarrier.arrive(k_empty.index(stage), count=1)
        mbarrier.wait(v_ready.index(stage), phase)
        mbarrier.arrive(v_empty.index(stage), count=1)


@gluon.jit
def _first_block(rings, it, n, row0, n_blocks, seqlen_q, seqlen_k, band, qk_scale, sink, tile,
                 s_layout: gl.constexpr):
    """A program's first tile: wait for its Q and first K block, run QKᵀ and the block's softmax from an empty state.
    Returns (p, m, l); P·V follows in ``_rest`` or the hand-over."""
    s = _first_qk(rings, n, it, tile, s_layout)
    return _first_softmax(rings, s, n, it, row0, n_blocks, seqlen_q, seqlen_k, band, qk_scale, sink, tile, s_layout)


@gluon.jit
def _rest(rings, p, m_i, l_i, acc, it, n, row0, n_blocks, seqlen_q, seqlen_k, band, qk_scale, tile,
          s_layout: gl.constexpr, o_layout: gl.constexpr):
    """A tile's blocks after its first, done up to the last one's softmax: ``_blocks``, or for warpgroup 0 with
    HALF_DIAG ``_half_end``. Returns (the last block's P, m, l, acc): P as ``_last_pv`` takes it."""
    if tile.HALF_DIAG and tile.WG == 0:
        p, m_i, l_i, acc = _half_end(rings, p, m_i, l_i, acc, it, n, row0, n_blocks, seqlen_q, seqlen_k, band,
                                     qk_scale, tile, s_layout, o_layout)
    else:
        p, m_i, l_i, acc = _blocks(rings, p, m_i, l_i, acc, it, n, row0, n_blocks, seqlen_q, seqlen_k, band,
                                   qk_scale, tile, s_layout, o_layout, True)
    return p, m_i, l_i, acc


@gluon.jit
def _blocks(rings, p, m_i, l_i, acc, it, n, row0, n_blocks, seqlen_q, seqlen_k, band, qk_scale, tile,
            s_layout: gl.constexpr, o_layout: gl.constexpr, LAST_QK: gl.constexpr):
    """Key blocks 1 .. n_blocks - 1 of a tile whose block 0 is done up to its softmax (``p``; the tile's blocks are
    the ring's ``it``, ``it + 1``, ..., its Q buffer the run's ``n``-th), one ``_step`` each. With ``LAST_QK`` (no
    block of the tile follows) Q is released as soon as the last of these QKᵀ is done. Returns (p, m, l, acc) with
    the last block's P·V still to do."""
    q = _q_rows(rings[0], n % tile.Q_STAGES, tile)
    edges = _edges(row0, seqlen_q, seqlen_k, band, tile)
    key0 = _key0(row0 - tile.WG * 64, seqlen_q, seqlen_k, band, tile)
    rows = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout))
    zero_s = gl.zeros([64, tile.BLOCK_N], gl.float32, layout=s_layout)
    for j in range(1, n_blocks):
        p, m_i, l_i, acc = _step(rings, q, p, m_i, l_i, acc, it + j, n, j, n_blocks, key0 + j * tile.BLOCK_N, rows,
                                 zero_s, edges, seqlen_k, qk_scale, tile, s_layout, o_layout, LAST_QK)
    return p, m_i, l_i, acc


@gluon.jit
def _step(rings, q, p, m_i, l_i, acc, idx, n, j, n_blocks, start_n, rows, zero_s, edges, seqlen_k, qk_scale, tile,
          s_layout: gl.constexpr, o_layout: gl.constexpr, RELEASE_Q: gl.constexpr):
    """One key block (ring ``idx``, keys from ``start_n``, as many as ``zero_s`` has columns, in ``s_layout``) after
    another whose softmax is done (``p``, ring ``idx - 1``): QKᵀ is issued, then the previous block's P·V (P stays
    in registers as wgmma's A operand); this block's softmax runs once QKᵀ is done, and without LAZY_RESCALE once the
    P·V is too (the module docstring: ptxas moves the wait). With ``RELEASE_Q`` the tile's Q is released where this
    is the last (``j``-th of ``n_blocks``) block. Returns (p, m, l, acc) with this block's P·V still to do."""
    q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty = rings
    D: gl.constexpr = tile.HEAD_DIM
    BLOCK_N: gl.constexpr = tile.BLOCK_N
    STAGES: gl.constexpr = tile.STAGES
    WIDTH: gl.constexpr = zero_s.shape[1]
    p_layout: gl.constexpr = _p_layout(tile.HEAD_DIM)
    stage = idx % STAGES
    prev = (idx - 1) % STAGES
    mbarrier.wait(k_ready.index(stage), (idx // STAGES) & 1)
    k = k_smem.index(stage).reshape([BLOCK_N, D])
    if WIDTH < BLOCK_N:
        k = k.slice(0, WIDTH)
    s = warpgroup_mma(q, k.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    mbarrier.wait(v_ready.index(prev), ((idx - 1) // STAGES) & 1)
    p_op = _operand(p, q_smem.dtype, p_layout)
    acc = warpgroup_mma(p_op, v_smem.index(prev).reshape([BLOCK_N, D]), acc, is_async=True)
    s = warpgroup_mma_wait(1, deps=(s,))  # QKᵀ, issued first, is done; the previous P·V may still run (in the PTX)
    mbarrier.arrive(k_empty.index(stage), count=1)
    if RELEASE_Q:
        mbarrier.arrive(q_empty.index(n % tile.Q_STAGES), count=1, pred=j == n_blocks - 1)
    m_old = m_i
    p, m_i, l_i, alpha = _softmax(s, m_i, l_i, start_n, rows, seqlen_k, edges, qk_scale, tile.CAUSAL, WIDTH,
                                  s_layout, tile.LAZY_RESCALE, tile.WINDOW)
    grown = 1
    if tile.LAZY_RESCALE:  # O is rescaled only where a row of the warpgroup took a new max
        grown = gl.max((m_i > m_old).to(gl.int32), axis=0)
    if tile.EARLY_P:  # here, not in the next _step once the next block's scores are live
        p = _operand(p, q_smem.dtype, p_layout)
    # p among the deps keeps this wait after the softmax in the PTX; ptxas may still schedule it above the softmax.
    acc, p_op, p = warpgroup_mma_wait(0, deps=(acc, p_op, p))
    mbarrier.arrive(v_empty.index(prev), count=1)
    if grown > 0:
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    return p, m_i, l_i, acc


@gluon.jit
def _half_end(rings, p, m_i, l_i, acc, it, n, row0, n_blocks, seqlen_q, seqlen_k, band, qk_scale, tile,
              s_layout: gl.constexpr, o_layout: gl.constexpr):
    """Warpgroup 0 with HALF_DIAG: its rows see only the first 64 keys of their tile's last block (the diagonal
    one), so that block's QKᵀ and P·V run over those 64 keys (``_half_block``); the blocks before it as in
    ``_blocks``. A one-block tile's first QKᵀ ran whole: its P keeps its first 64 columns (the others are masked,
    0). Returns (the last block's P as the A operand over those 64 keys, m, l, acc), its P·V still to do."""
    p_layout: gl.constexpr = _p_layout(tile.HEAD_DIM)
    dtype: gl.constexpr = rings[0].dtype
    if n_blocks == 1:
        left, right = p.to(dtype).reshape([64, 2, 64]).permute((0, 2, 1)).split()  # columns 0-63 and 64-127
        p_op = gl.convert_layout(left, p_layout)
    else:
        p, m_i, l_i, acc = _blocks(rings, p, m_i, l_i, acc, it, n, row0, n_blocks - 1, seqlen_q, seqlen_k, band,
                                   qk_scale, tile, s_layout, o_layout, False)
        start_n = _key0(row0 - tile.WG * 64, seqlen_q, seqlen_k, band, tile) + (n_blocks - 1) * tile.BLOCK_N
        p_op, m_i, l_i, acc = _half_block(rings, p, m_i, l_i, acc, it + n_blocks - 1, n, row0, start_n, seqlen_q,
                                          seqlen_k, band, qk_scale, tile, s_layout, o_layout)
    return p_op, m_i, l_i, acc


@gluon.jit
def _half_block(rings, p, m_i, l_i, acc, last, n, row0, start_n, seqlen_q, seqlen_k, band, qk_scale, tile,
                s_layout: gl.constexpr, o_layout: gl.constexpr):
    """``_step`` for a tile's last block (ring ``last``, keys from ``start_n``) at half width: QKᵀ over its first 64
    keys, Q released. Returns (P as the A operand over the 64 keys, m, l, acc), its P·V still to do."""
    h_layout: gl.constexpr = _acc_layout(64)
    p_layout: gl.constexpr = _p_layout(tile.HEAD_DIM)
    q = _q_rows(rings[0], n % tile.Q_STAGES, tile)
    rows = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, h_layout))
    zero_h = gl.zeros([64, 64], gl.float32, layout=h_layout)
    p, m_h, l_h, acc = _step(rings, q, p, gl.convert_layout(m_i, gl.SliceLayout(1, h_layout)),
                             gl.convert_layout(l_i, gl.SliceLayout(1, h_layout)), acc, last, n, 0, 1, start_n, rows,
                             zero_h, _edges(row0, seqlen_q, seqlen_k, band, tile), seqlen_k, qk_scale, tile,
                             h_layout, o_layout, True)
    m_i = gl.convert_layout(m_h, gl.SliceLayout(1, s_layout))
    l_i = gl.convert_layout(l_h, gl.SliceLayout(1, s_layout))
    return _operand(p, rings[0].dtype, p_layout), m_i, l_i, acc


@gluon.jit
def _handover(rings, out, p, m_i, l_i, acc, last, next_it, n, off_b, off_h, row0, slot, next_row0, next_blocks,
              seqlen_k, band, qk_scale, next_sink, tile, s_layout: gl.constexpr, o_layout: gl.constexpr):
    """From a tile whose last block this warpgroup sees (ring index ``last``) is done up to its softmax (``p``, as
    ``_last_pv`` takes it) to the next tile (the run's ``n``-th, its first block the ring's ``next_it``; blocks in
    between are skipped): issue the last P·V, then the next tile's first QKᵀ; once the P·V is done, write this
    tile's output while that QKᵀ runs (``slot``: its piece slot, ``_epilogue``); then the next tile's first softmax
    (``band``: the next tile's). Returns the next tile's (p, m, l).
    (Issuing the QKᵀ after the output instead read the same or up to 4 % slower, NOTES v14.)"""
    q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty = rings
    acc, p_op = _last_pv(rings, p, acc, last, tile)
    _skip(rings, last + 1, next_it, tile)
    s = _first_qk(rings, n, next_it, tile, s_layout)
    acc, p_op = warpgroup_mma_wait(1, deps=(acc, p_op))  # the P·V, issued first, is done; the QKᵀ may still run
    mbarrier.arrive(v_empty.index(last % tile.STAGES), count=1)
    _epilogue(out, acc, m_i, l_i, off_b, off_h, row0, slot, tile, s_layout, o_layout)
    seqlen_q = out[5]
    return _first_softmax(rings, s, n, next_it, next_row0, next_blocks, seqlen_q, seqlen_k, band, qk_scale,
                          next_sink, tile, s_layout)


@gluon.jit
def _first_qk(rings, n, it, tile, s_layout: gl.constexpr):
    """Issue a tile's first QKᵀ (the run's ``n``-th tile; its first key block the ring's ``it``) once Q and K have
    landed, without waiting for it."""
    q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty = rings
    slot = n % tile.Q_STAGES
    stage = it % tile.STAGES
    mbarrier.wait(q_ready.index(slot), (n // tile.Q_STAGES) & 1)
    mbarrier.wait(k_ready.index(stage), (it // tile.STAGES) & 1)
    k_t = k_smem.index(stage).reshape([tile.BLOCK_N, tile.HEAD_DIM]).permute((1, 0))
    return warpgroup_mma(_q_rows(q_smem, slot, tile), k_t, gl.zeros([64, tile.BLOCK_N], gl.float32, layout=s_layout),
                         use_acc=False, is_async=True)


@gluon.jit
def _first_softmax(rings, s, n, it, row0, n_blocks, seqlen_q, seqlen_k, band, qk_scale, sink, tile,
                   s_layout: gl.constexpr):
    """Wait for a tile's first QKᵀ (``_first_qk``), release its K block (and its Q when ``n_blocks``, the blocks this
    warpgroup sees of the tile, is 1), and run that block's softmax from an empty state -> (p, m, l)."""
    q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty = rings
    s = warpgroup_mma_wait(0, deps=(s,))
    mbarrier.arrive(k_empty.index(it % tile.STAGES), count=1)
    mbarrier.arrive(q_empty.index(n % tile.Q_STAGES), count=1, pred=n_blocks == 1)
    p, m_i, l_i = _fresh_softmax(s, row0, seqlen_q, seqlen_k, band, qk_scale, sink, tile, s_layout)
    if tile.EARLY_P:
        p = _operand(p, q_smem.dtype, _p_layout(tile.HEAD_DIM))
    return p, m_i, l_i


@gluon.jit
def _last_pv(rings, p, acc, last, tile):
    """Issue a tile's last P·V (ring index ``last``) without waiting for it: ``p`` the block's float32 P, or the A
    operand already (``EARLY_P``; ``_half_end``: over the block's first keys). Returns (acc, P as the A operand),
    both for the wait's deps (the registers stay live until the wgmma has read them)."""
    q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty = rings
    p_op = _operand(p, q_smem.dtype, _p_layout(tile.HEAD_DIM))
    stage = last % tile.STAGES
    mbarrier.wait(v_ready.index(stage), (last // tile.STAGES) & 1)
    v = v_smem.index(stage).reshape([tile.BLOCK_N, tile.HEAD_DIM])
    if p_op.shape[1] < tile.BLOCK_N:
        v = v.slice(0, p_op.shape[1])
    return warpgroup_mma(p_op, v, acc, is_async=True), p_op


@gluon.jit
def _operand(p, dtype: gl.constexpr, p_layout: gl.constexpr):
    """P as wgmma's A operand (``p_layout``) in ``dtype``: converted from float32, or as it is."""
    if p.dtype == gl.float32:
        p = gl.convert_layout(p.to(dtype), p_layout)
    return p


@gluon.constexpr_function
def _acc_layout(width):
    """A wgmma accumulator's layout for a warpgroup's 64 rows by ``width`` columns (QKᵀ's over a block's keys, O's
    over the head dim)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, width, 16])


@gluon.constexpr_function
def _p_layout(head_dim):
    """P's layout as wgmma's A operand for P·V into a warpgroup's O of ``head_dim`` columns."""
    return gl.DotOperandLayout(operand_index=0, parent=_acc_layout(head_dim), k_width=2)


@gluon.jit
def _epilogue(out, acc, m_i, l_i, off_b, off_h, row0, slot, tile, s_layout: gl.constexpr, o_layout: gl.constexpr):
    """o = acc / l and lse = (m + log2 l) · ln 2 for the warpgroup's 64 rows; a row that saw no key gets o = 0 and
    lse = -inf. A piece (SPLIT, ``slot`` >= 0) leaves them in float32 for ``merge_pieces`` (``_store_piece``)."""
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    o = acc / gl.where(l_o == 0.0, 1.0, l_o)[:, None]
    if tile.SPLIT:
        if slot >= 0:
            _store_piece(o, _lse(m_i, l_i), out[6], out[7], slot, tile, s_layout, o_layout)
        else:
            _store_rows(o, m_i, l_i, out, off_b, off_h, row0, tile, s_layout)
    else:
        _store_rows(o, m_i, l_i, out, off_b, off_h, row0, tile, s_layout)


@gluon.jit
def _lse(m_i, l_i):
    """Rows' natural log-sum-exp from their base-2 max and sum; -inf where they saw no key."""
    return gl.where(l_i == 0.0, float("-inf"), (m_i + gl.log2(l_i)) * 0.6931471805599453)


@gluon.jit
def _store_rows(o, m_i, l_i, out, off_b, off_h, row0, tile, s_layout: gl.constexpr):
    """The warpgroup's 64 rows of o (by TMA, ``_store_o``) and lse (those before the end)."""
    o_desc, o_smem, LSE, stride_lb, stride_lh, seqlen_q, O_PART, LSE_PART = out
    _store_o(o.to(o_desc.dtype), o_desc, o_smem.index(tile.WG), off_b, row0, off_h)
    rows = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout))
    lse = _lse(m_i, l_i)
    gl.store(LSE + off_b.to(gl.int64) * stride_lb + off_h * stride_lh + rows, lse, mask=rows < seqlen_q)


@gluon.jit
def _store_piece(o, lse, O_PART, LSE_PART, slot, tile, s_layout: gl.constexpr, o_layout: gl.constexpr):
    """A piece's state, float32 ``o`` and ``lse`` of the warpgroup's 64 rows (those past the end too: the merge
    drops them), into slot ``slot`` of ``O_PART [slots, BLOCK_M, D]`` and ``LSE_PART [slots, BLOCK_M]``."""
    base = slot.to(gl.int64) * tile.BLOCK_M + tile.WG * 64
    r_o = base + gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout))
    c_o = gl.arange(0, tile.HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    gl.store(O_PART + r_o[:, None] * tile.HEAD_DIM + c_o[None, :], o)
    gl.store(LSE_PART + base + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout)), lse)


@gluon.jit
def _q_rows(q_smem, slot, tile):
    """This warpgroup's 64 rows of Q buffer ``slot`` (a tile's ``BLOCK_M // Q_ROWS`` boxes of Q_ROWS rows)."""
    Q_ROWS: gl.constexpr = q_smem.shape[2]
    box = q_smem.index(slot * (tile.BLOCK_M // Q_ROWS) + tile.WG * 64 // Q_ROWS)
    return box.reshape([Q_ROWS, tile.HEAD_DIM]).slice(tile.WG * 64 % Q_ROWS, 64)


@gluon.jit
def _sink(SINKS, head, tile):
    """With SINK, head ``head``'s sink logit in the base-2 frame (``m`` and the scores' ``s · qk_scale``); else 0,
    unused. A sink of -inf joins as nothing (l = 1 at m = -inf: the first key's alpha is 0)."""
    sink = 0.0
    if tile.SINK:
        sink = gl.load(SINKS + head).to(gl.float32) * 1.4426950408889634
    return sink


@gluon.jit
def _edges(row0, seqlen_q, seqlen_k, band, tile):
    """What ``_softmax`` masks for the warpgroup's rows from ``row0``: (mask_from, diag, mask_below, left). Blocks
    reaching past key ``mask_from`` (past the end and, under causal, past the first row's diagonal: row i sees keys
    up to i + diag) and, under WINDOW, blocks starting before ``mask_below`` (the last row's left edge: row i sees
    keys from i + left)."""
    mask_from = seqlen_k
    diag = seqlen_k - seqlen_q + _right(band, tile)
    if tile.CAUSAL:
        mask_from = gl.minimum(seqlen_k, row0 + seqlen_k - seqlen_q + _right(band, tile) + 1)
    left = 0
    mask_below = 0
    if tile.WINDOW:
        left = seqlen_k - seqlen_q - band[0]
        mask_below = row0 + 63 + left
    return mask_from, diag, mask_below, left


@gluon.jit
def _fresh_softmax(s, row0, seqlen_q, seqlen_k, band, qk_scale, sink, tile, s_layout: gl.constexpr):
    """A tile's first block (from key ``_key0``): its softmax from an empty state, or with SINK from the head's sink
    (``sink``, base 2) as a first key with no value: m = sink, l = 1 -> (p, m, l)."""
    rows = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout))
    if tile.SINK:
        m_i = gl.full([64], 0.0, gl.float32, layout=gl.SliceLayout(1, s_layout)) + sink
        l_i = gl.full([64], 1.0, gl.float32, layout=gl.SliceLayout(1, s_layout))
    else:
        m_i = gl.full([64], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_i = gl.full([64], 0.0, gl.float32, layout=gl.SliceLayout(1, s_layout))
    p, m_i, l_i, alpha = _softmax(s, m_i, l_i, _key0(row0 - tile.WG * 64, seqlen_q, seqlen_k, band, tile), rows,
                                  seqlen_k, _edges(row0, seqlen_q, seqlen_k, band, tile), qk_scale, tile.CAUSAL,
                                  tile.BLOCK_N, s_layout, False, tile.WINDOW)
    return p, m_i, l_i


@gluon.jit
def _store_o(o, o_desc, buf, off_b, row0, off_h):
    """A warpgroup's 64 output rows ``o`` into O from ``row0`` by TMA stores from its staging buffer (one box of
    ``o_desc``: 64 rows and up to 128 columns; d = 256 goes as two column halves). The copy engine drops rows past
    the end. The stores run on while the warpgroup moves on: the buffer's next use waits for them to read it.
    (Storing straight from registers measured 10-25 % slower at N <= 2048, NOTES v13: each thread's 4-byte
    pieces of the wgmma layout.)"""
    COLS: gl.constexpr = o_desc.block_type.shape[3]
    staged = buf.reshape([64, COLS])
    tma.store_wait(0)  # the buffer's last store has read it
    if o.shape[1] == COLS:
        staged.store(o)
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [off_b, row0, off_h, 0], buf)
    else:  # two column halves (a register-local split of the wgmma layout)
        left, right = o.reshape([64, 2, COLS]).permute((0, 2, 1)).split()
        staged.store(left)
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [off_b, row0, off_h, 0], buf)
        tma.store_wait(0)
        staged.store(right)
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [off_b, row0, off_h, COLS], buf)


@gluon.jit
def _softmax(s, m_i, l_i, start_n, rows, seqlen_k, edges, qk_scale, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr,
             s_layout: gl.constexpr, LAZY: gl.constexpr = False, WINDOW: gl.constexpr = False):
    """One block's raw scores -> (p, m, l, alpha) in the base-2 frame (``qk_scale`` = scale · log2 e > 0). Only
    blocks ``edges`` marks (``_edges``) are masked: keys past the end, under causal past the diagonal, under WINDOW
    left of the window's left edge. With
    ``LAZY`` a row keeps its max until a score passes it by 2^8: P then reaches up to 2^8 and alpha stays 1, which
    lets ``_step`` skip O's rescale in most blocks; l and O share the max, so o = O / l and lse are exact."""
    mask_from, diag, mask_below, left = edges
    masked = start_n + BLOCK_N > mask_from
    if WINDOW:
        masked = masked | (start_n < mask_below)
    if masked:
        cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        if CAUSAL:  # one comparison per score: the key bound folded into each row's diagonal
            keep = cols[None, :] <= gl.minimum(rows + diag, seqlen_k - 1)[:, None]
        else:
            keep = cols[None, :] < seqlen_k
        if WINDOW:
            keep = keep & (cols[None, :] >= (rows + left)[:, None])
        s = gl.where(keep, s, float("-inf"))
    row_max = gl.max(s, axis=1) * qk_scale
    if LAZY:
        m_new = gl.where(row_max > m_i + 8.0, row_max, m_i)
    else:
        m_new = gl.maximum(m_i, row_max)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: exp2(-inf - 0) = 0, no NaN
    p = gl.exp2(s * qk_scale - m_use[:, None])
    alpha = gl.exp2(m_i - m_use)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_i, alpha


@functools.cache
def _shared_layout(block: tuple, dtype: torch.dtype, swizzled: bool = True):
    element = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]
    if not swizzled:
        return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=element.primitive_bitwidth,
                                    rank=len(block))
    return gl.NVMMASharedLayout.get_default_for(list(block), element)


def is_sm90(device: torch.device) -> bool:
    """Whether this CUDA device runs the kernel (Hopper's wgmma and TMA as sm_90a compiles them)."""
    return _is_sm90(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _is_sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


_DESCRIPTORS: dict = {}  # (address, shape, strides, dtype, box, swizzled) -> descriptor over an Address
# A training step keeps ~11 a layer (the forward's 4, the backward's 7), a few hundred bytes each: room for several
# hundred layers before the table starts over.
MAX_DESCRIPTORS = 8192


def descriptor(x, block: tuple, swizzled: bool = True) -> TensorDescriptor:
    """A Gluon TMA descriptor of ``x`` with box ``block`` (the kernels' shared-memory layout for it: NVMMA's default
    swizzle, or with ``swizzled=False`` none, the box row-major as it lies in shared memory). Kept by
    address and geometry: a launch reads nothing else of a descriptor, so a repeat over the same memory (a training
    step's recycled buffers, a benchmark loop) reuses it instead of building and checking a new one (2-3 µs each on
    the H200 machine's CPU, NOTES v24). ``ONLINEATTN_LAUNCH_CACHE=0`` builds every one afresh, as before."""
    if not launch_cache.enabled:
        return _build(x, block, swizzled)
    key = (x.data_ptr(), x.shape, x.stride(), x.dtype, block, swizzled)
    kept = _DESCRIPTORS.get(key)
    if kept is None:
        kept = _build(x, block, swizzled)  # checks the geometry
        bounded_put(_DESCRIPTORS, key, keep_by_address(kept, key[0]), MAX_DESCRIPTORS)
    return kept


def _build(x, block: tuple, swizzled: bool = True) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(x, list(block), _shared_layout(block, x.dtype, swizzled))


def descriptors(q, k, v, o, cfg) -> tuple:
    """Q's, K's, V's and O's descriptors for tile ``cfg``: a box of one head's rows (``_q_box_rows``), one key block
    of one head, and for O a warpgroup's 64 rows of one head by up to 128 columns (``O_COLUMNS``)."""
    d = q.shape[-1]
    rows_block, keys_block = (1, _q_box_rows(cfg.block_m), 1, d), (1, cfg.block_n, 1, d)
    o_block = (1, ROWS_PER_WARPGROUP, 1, min(d, O_COLUMNS))
    return descriptor(q, rows_block), descriptor(k, keys_block), descriptor(v, keys_block), descriptor(o, o_block)


def _q_box_rows(block_m: int) -> int:
    """Rows of Q's TMA box: the whole tile, or for 192-row tiles one warpgroup's 64 (Gluon's shared buffers take
    power-of-two shapes), three boxes a tile."""
    return block_m if block_m & (block_m - 1) == 0 else ROWS_PER_WARPGROUP


def shared_bytes(d: int, cfg) -> int:
    """Shared memory a launch takes (element size 2): ``q_stages`` Q buffers, ``num_stages`` K and V blocks, an O
    staging buffer per warpgroup (the mbarriers' few bytes aside)."""
    return (2 * d * (cfg.q_stages * cfg.block_m + 2 * cfg.num_stages * cfg.block_n)
            + 2 * cfg.block_m * min(d, O_COLUMNS))


def launch(q, k, v, o, lse, scale: float, causal: bool, cfg, keep: bool = False, band: tuple | None = None,
           sinks: torch.Tensor | None = None):
    """``q [B, Sq, Hq, D]``, ``k``/``v [B, Sk, Hkv, D]`` (checked by the caller: what ``forward.py`` routes here),
    into ``o [B, Sq, Hq, D]`` (TMA-aligned, as q) and ``lse [B, Hq, Sq]`` (last dims contiguous). A ``persistent``
    tile launches up to one program per SM (``programs``), each looping over tiles; otherwise one program per tile.
    ``band``: a sliding window's ``(left, right)`` with causal folded in (``Mods.band``; an unbounded side is
    ``UNBOUNDED``), launched as causal with the diagonal moved right by ``right`` and the key blocks left of a
    tile's first row's window not loaded. ``sinks``: a contiguous ``[Hq]`` sink logit per head (``Mods.sinks``).
    Returns ``(grid, Relaunch or None)``:
    with ``keep``, the launch kept for repeats with new arrays (``descriptors(q, k, v, o, cfg), lse``)."""
    if cfg.block_m not in (2 * ROWS_PER_WARPGROUP, 3 * ROWS_PER_WARPGROUP) or cfg.num_warps != 4:
        raise ValueError(f"config: the Hopper kernel runs 128- or 192-row tiles over two or three 4-warp warpgroups, "
                         f"not {cfg}")
    if cfg.block_m == 3 * ROWS_PER_WARPGROUP and (q.shape[-1] != 64 or cfg.block_n != 128):
        raise ValueError(f"config: 192-row tiles (three warpgroups of 160 registers a thread) run d = 64 over "
                         f"128-key blocks, not d = {q.shape[-1]} with {cfg}")
    if cfg.q_stages not in (1, 2):
        raise ValueError(f"config: q_stages is 1 or 2 (Q buffers), not {cfg.q_stages}")
    if cfg.block_n not in (64, 128) or cfg.num_stages < 2:
        raise ValueError(f"config: the Hopper kernel runs 64- or 128-key blocks over two K/V stages or more (a "
                         f"causal tile's first warpgroups may skip a block, _skip), not {cfg}")
    if o.dtype != q.dtype:
        raise ValueError(f"o: the Hopper kernel stores O by TMA in q's dtype {q.dtype}, not {o.dtype}")
    if sinks is not None and (sinks.shape != (q.shape[2],) or not sinks.is_contiguous() or sinks.device != q.device):
        raise ValueError(f"sinks: a contiguous [Hq] = [{q.shape[2]}] tensor on {q.device}, not {tuple(sinks.shape)} on "
                         f"{sinks.device}")
    b, sq, hq, d = q.shape
    if shared_bytes(d, cfg) > SHARED_BYTES:
        raise ValueError(f"config: {cfg} needs {shared_bytes(d, cfg)} bytes of shared memory at d = {d}; an SM has "
                         f"{SHARED_BYTES}")
    sk, hkv = k.shape[1], k.shape[2]
    num_tiles = cdiv(sq, cfg.block_m) * b * hq
    masked = causal or band is not None
    if band is not None:  # sides past Sq + Sk reach every key: clamped there, the kernel's int32 sums cannot overflow
        band = tuple(min(side, sq + sk) for side in band)
    grid = (programs(num_tiles, sq, sk, masked, cfg.block_m, cfg.block_n, _sm_count(q.device), band)
            if cfg.persistent else num_tiles,)
    left, right = band or (0, 0)
    plain = cfg.persistent and not masked and sinks is None and sk >= FWD_TAIL_MIN_KEYS.get(d, sk + 1)
    pieces, full, items = split_tail(num_tiles, grid[0], cdiv(sk, cfg.block_n), 1, plain)
    parts = (None, None)
    if pieces > 1:  # the last lap's tiles in pieces: their float32 states, merged after (not kept: two launches)
        slots = (num_tiles - full) * pieces
        parts = (torch.empty((slots, cfg.block_m, d), device=q.device, dtype=torch.float32),
                 torch.empty((slots, cfg.block_m), device=q.device, dtype=torch.float32))
        keep = False
    kept = start(
        keep, attention_fwd_sm90_kernel, grid, 5,
        *descriptors(q, k, v, o, cfg), lse, lse.stride(0), lse.stride(1),
        sq, sk, hq, hq // hkv, scale * LOG2E, items, left, right, sinks,
        *parts, full, pieces,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=d, STAGES=cfg.num_stages, CAUSAL=masked,
        Q_STAGES=cfg.q_stages, HALF_DIAG=half_diagonal(sq, sk, causal, cfg),
        LAZY_RESCALE=cfg.lazy_rescale, EARLY_P=cfg.early_p, WINDOW=band is not None, SINK=sinks is not None,
        SPLIT=pieces > 1, num_warps=4,
    )
    if pieces > 1:
        merge_pieces(*parts, o, lse, full, pieces)
    return grid, kept


def _sm_count(device) -> int:
    return sm_count(device, 132)  # 132 (an H100's or H200's) for compile-only runs on CPU tensors (tests)
