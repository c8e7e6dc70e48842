"""The Hopper dK/dV kernel's fused dQ (``backward_sm90.py``): where a warpgroup's part of a row tile's dQ lies
(its rows and columns, and its place in the float32 accumulator, in the order of the warpgroup's registers), how it
is added (a TMA reduce at once, or staged for the ordered writer warp, which adds every row tile's parts in a fixed
order kept by per-tile counters), and the kernel's dQ and counter arguments on the host."""

import functools

import torch
from triton._C.libtriton import ir as _ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin as _builtin
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from .backward_sm90_schedule import _key_block, _row_tile, _spacing
from .forward_sm90 import descriptor


@gluon.constexpr_function
def dq_split_rows(block_m):
    """Whether the two warpgroups split a fused-dQ row tile's dQ by rows: on 128-row tiles each adds its 64 rows
    over all d columns, so its dS K is one wgmma of N = d per 16 keys with its dS operand read once (2/3 of the
    shared-memory reads of [128 rows, d / 2] at d = 64: NOTES v29); else (wgmma takes 64 rows at a time) each adds
    half the columns."""
    return block_m >= 128


@gluon.constexpr_function
def dq_part_rows(block_m):
    """The rows of a row tile's dQ one warpgroup adds (``dq_split_rows``)."""
    return block_m // 2 if dq_split_rows(block_m) else block_m


@gluon.constexpr_function
def dq_part_cols(block_m, d):
    """The head-dim columns of that part."""
    return d if dq_split_rows(block_m) else d // 2


@gluon.constexpr_function
def dq_part_offset(block_m, d, wg):
    """Where warpgroup ``wg``'s part starts in the row tile's dQ: (row, column)."""
    return (wg * (block_m - dq_part_rows(block_m)), wg * (d - dq_part_cols(block_m, d)))


DQ_ORDER_COLS = gl.constexpr(128)  # float32 columns of the dQ accumulator's register-order view: 32 lanes x 4 values


@gluon.constexpr_function
def dq_order_rows(block_m, d):
    """Rows of ``DQ_ORDER_COLS`` one warpgroup's part of a row tile's dQ takes in register order (``_register_order``;
    a part is 64 rows by ``dq_part_cols``): the dQ descriptor's box, twice that for the ordered writer's copy."""
    return dq_part_rows(block_m) * dq_part_cols(block_m, d) // DQ_ORDER_COLS.value


@_builtin
def _tma_reduce_add(desc, coord, src, _semantic=None):
    """Add shared-memory block ``src`` (the descriptor's block shape and layout) into global memory at ``coord`` by
    an asynchronous TMA reduce (``cp.reduce.async.bulk.tensor``, one bulk group: ``tma.store_wait`` waits for it
    like a store). Triton 3.6's Gluon exposes no such call; its register-operand ``descriptor_reduce`` waits for
    the copy engine to read the staging memory at once, which measured slower (NOTES v13)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle, coord, src.handle)


@gluon.jit
def _ds_rows(ds, tile):
    """dQ's A operand from a row tile's dSᵀ buffer ``ds [128 keys, BLOCK_M rows]``: dS over this warpgroup's rows
    (``dq_part_rows``; all of them where the warpgroups split the columns)."""
    ROW0: gl.constexpr = dq_part_offset(tile.BLOCK_M, tile.HEAD_DIM, tile.WG)[0]
    return ds.slice(ROW0, dq_part_rows(tile.BLOCK_M), dim=1).permute((1, 0))


@gluon.jit
def _hand_dq(dq, DQ, dq_smem, dq_full, dq_empty, off_b, off_hkv, t, lo, row_tiles, shift, dq_rows, valid, tile):
    """This warpgroup's part of row tile ``t``'s dQ, where ``valid``: staged for the writer warp (ORDERED,
    ``_stage_dq``), else added at once (``_add_dq``)."""
    if tile.ORDERED:
        _stage_dq(dq, dq_smem, dq_full, dq_empty, t, valid, tile)
    else:
        _add_dq(dq, DQ, dq_smem.index(tile.WG), off_b, off_hkv * tile.GROUP, t, lo, row_tiles, shift, dq_rows, valid,
                tile)


@gluon.jit
def _add_dq(dq, dq_desc, buf, off_b, head0, t, lo, row_tiles, shift, rows_per_batch, valid, tile):
    """Add this warpgroup's part of row tile ``t``'s dQ (``dq [dq_part_rows, dq_part_cols]``, its GQA group's heads
    from ``head0``) into the accumulator (``_dq_coord``) by a TMA reduce from staging buffer ``buf``, where
    ``valid``. The reduce runs on under the next row tile; the buffer's next use waits for it to be read."""
    g, m = _row_tile(t, lo, row_tiles, shift, tile)
    if valid:
        tma.store_wait(0)  # the last reduce from this buffer (a row tile ago) has read it
        buf.reshape([dq_order_rows(tile.BLOCK_M, tile.HEAD_DIM), DQ_ORDER_COLS]).store(_register_order(dq))
        fence_async_shared()
        _tma_reduce_add(dq_desc, _dq_coord(off_b * rows_per_batch + m, head0 + g, tile.WG, tile), buf)


@gluon.jit
def _register_order(dq):
    """A warpgroup's dQ part ``[64, C]`` (wgmma's accumulator) as ``[64 · C / 128, 128]`` in the order its registers
    lie: row ``w · C / 8 + j`` holds warp ``w``'s column group ``j`` (columns ``8j … 8j + 7``), 4 values a lane (rows
    ``r`` and ``r + 8`` of one column pair). A reshape of the registers, no data moved; stored unswizzled, each warp
    writes 512 contiguous bytes an instruction (16-byte stores without bank conflicts, where the [64, C] tile's
    8-byte stores into the 128-byte swizzle conflicted 2-way: NOTES v29). ``attention_bwd_dq_scale_kernel``
    undoes it."""
    J: gl.constexpr = dq.shape[1] // 8
    return dq.reshape([4, 2, 8, J, 4, 2]).permute((0, 3, 2, 4, 1, 5)).reshape([4 * J, DQ_ORDER_COLS])


@gluon.jit
def _dq_coord(row0, head, wg, tile):
    """Where warpgroup ``wg``'s part of the row tile from accumulator row ``row0`` (``[B, rows_per_batch, Hq, D]``,
    each batch entry's rows padded to whole tiles) of ``head`` lies in the accumulator seen as ``[·, Hq,
    DQ_ORDER_COLS]``: a row tile's memory (all heads) holds ``2 · dq_order_rows`` rows of each head, the parts in
    turn, each in register order (``_register_order``); a part's rows lie ``Hq · DQ_ORDER_COLS`` values apart, as
    the tile's own rows would, so its adds spread over the L2 as before."""
    ROWS: gl.constexpr = dq_order_rows(tile.BLOCK_M, tile.HEAD_DIM)
    return [((row0 // tile.BLOCK_M) * 2 + wg) * ROWS, head, 0]


@gluon.jit
def _stage_dq(dq, dq_smem, dq_full, dq_empty, t, valid, tile):
    """ORDERED: this warpgroup's part of its ``t``-th row tile's dQ into its half of staging buffer ``t % 2`` for the
    writer warp, once the writer has released that buffer's last tile (two tiles ago), where ``valid``."""
    ROWS: gl.constexpr = dq_order_rows(tile.BLOCK_M, tile.HEAD_DIM)
    t = gl.maximum(t, 0)
    buf = t % 2
    mbarrier.wait(dq_empty.index(buf), ((t // 2) & 1) ^ 1, pred=valid)  # a fresh barrier passes parity 1
    if valid:
        dq_smem.index(buf).reshape([2 * ROWS, DQ_ORDER_COLS]).slice(tile.WG * ROWS, ROWS).store(_register_order(dq))
        fence_async_shared()
    mbarrier.arrive(dq_full.index(buf), count=1, pred=valid)


@gluon.jit
def _dq_writer(DQ, dq_smem, dq_full, dq_empty, SEM, rows_per_batch, seqlen_q, seqlen_k, heads_kv, head_group,
               num_tiles, window_left, tile):
    """ORDERED, one warp: the program's dQ tiles into the float32 accumulator in a fixed order. Each (batch, head, row
    tile) has a counter in ``SEM`` (int32, zeroed) of the adds landed; the writer waits until it reaches this program's
    turn (``_turn``), issues one TMA copy of both warpgroups' parts (a tile's first turn stores, so the accumulator
    needs no zeroing and the first add reads nothing; later turns add), and once it has landed raises the counter and
    releases the staging buffer (the consumers run up to two tiles ahead). So every run adds in the same order: dQ is
    bitwise reproducible. An add waits on its own program's earlier adds and on the adds at the same tile with an
    earlier turn, which ``_turn`` puts at earlier steps (or, at the same step, on blocks earlier in turn): that order
    has no cycle, so every chain of waits ends. (Raising a tile's counter only after the next tile's turn, as before
    NOTES v14, also made the chains cross tiles.) Key blocks may wait on blocks launched after them (non-causal, and
    causal ones launched block 0 first), so all of a (batch, kv head)'s blocks must be resident at once: ``launch_dkdv``
    takes no more of them than the device has SMs (``ordered_blocks``). Causal ones launched last block first
    (``LAST_BLOCK_FIRST``) wait only on blocks launched before them."""
    BLOCK_M: gl.constexpr = tile.BLOCK_M
    lane = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))
    off_b, off_hkv, pid_n, n0, lo, row_tiles, shift = _key_block(gl.program_id(0), seqlen_q, seqlen_k, heads_kv,
                                                                 head_group, num_tiles, window_left, None,
                                                                 tile)  # one block a program
    n_tiles = row_tiles * tile.GROUP
    q_tiles = rows_per_batch // BLOCK_M
    heads_q = heads_kv * tile.GROUP
    for t in range(n_tiles):
        buf = t % 2
        g, m = _row_tile(t, lo, row_tiles, shift, tile)
        head = off_hkv * tile.GROUP + g
        turn = _turn(g * row_tiles + (m - lo) // BLOCK_M, m // BLOCK_M, pid_n, n_tiles, seqlen_q, seqlen_k, tile)
        mbarrier.wait(dq_full.index(buf), (t // 2) & 1)
        counter = SEM + ((off_b * heads_q + head) * q_tiles + m // BLOCK_M) + lane * 0  # lane 0 releases it
        seen = gl.min(_load_acquire(counter), axis=0)
        while seen < turn:  # not yet: poll without acquiring, then acquire (it sees what the poll saw: runs once)
            polled = seen
            while polled < turn:
                polled = gl.min(_load_relaxed(counter), axis=0)
            seen = gl.min(_load_acquire(counter), axis=0)
        row0 = off_b * rows_per_batch + m
        if turn == 0:
            tma.async_copy_shared_to_global(DQ, _dq_coord(row0, head, 0, tile), dq_smem.index(buf))
        else:
            _tma_reduce_add(DQ, _dq_coord(row0, head, 0, tile), dq_smem.index(buf))
        _release(counter, lane)  # once the copy has landed: count it, free its buffer
        mbarrier.arrive(dq_empty.index(buf), count=1)


@gluon.jit
def _turn(tile_of, mt, pid_n, n_tiles, seqlen_q, seqlen_k, tile):
    """How many programs of this (batch, kv head) add into row tile ``mt`` before this one, key block ``pid_n`` of
    K = ``blocks``; ``tile_of`` is the tile's index among a program's ``n_tiles`` (head of the group, then row tile),
    before any rotation. Each add waits on adds at earlier steps of their programs (or, at the same step, on blocks
    it comes after), so the chains of waits end, and the orders put them steps apart, so the waits seldom stall:
    - Non-causal, key block j starts ``j · s`` tiles in (s = ``_spacing`` >= 1, K · s <= n_tiles), so it reaches tile
      t at step (t - j·s) mod n_tiles, and the adds go by step: a = min(t // s, K - 1), a - 1, ..., 0, K - 1, ...,
      a + 1, so j's turn is (a - j) mod K. Each waits on an add made at least s >= 1 steps earlier. With s = 0 every
      block starts at the first tile and the adds go by block, each waiting on the block before at the same step:
      the chain ends at block 0.
    - Causal: a row tile's adds go from the block on its diagonal back to block 0: each block reaches the tile no
      earlier in its own loop than the block after it (a step later or more, or at the same step where several
      blocks start at row 0 when Sk > Sq), and waits only on blocks after it. The chain ends at the last block that
      sees the tile. With ``LAST_BLOCK_FIRST`` those blocks launch first; otherwise block 0, the longest, launches
      first, and the lag between blocks keeps most adds from waiting when they start together."""
    blocks = gl.cdiv(seqlen_k, tile.BLOCK_N)
    if tile.CAUSAL:
        # key blocks j > pid_n whose first visible row tile (max(j·BLOCK_N - (Sk - Sq), 0) // BLOCK_M) is <= mt
        last = (tile.BLOCK_M * (mt + 1) + seqlen_k - seqlen_q + tile.BLOCK_N - 1) // tile.BLOCK_N - 1
        return gl.minimum(last, blocks - 1) - pid_n
    s = _spacing(n_tiles, seqlen_k, tile.BLOCK_N)
    a = gl.minimum(tile_of // gl.maximum(s, 1), blocks - 1)
    return gl.where(s > 0, (a - pid_n + blocks) % blocks, pid_n)


@gluon.jit
def _load_acquire(ptrs):
    """An acquiring load of int32 ``ptrs`` (then a proxy fence: the TMA copies issued after it see what it saw)."""
    return gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];\n\tfence.proxy.async.global;", "=r,l",
                                     [ptrs], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _load_relaxed(ptrs):
    """A strong load of int32 ``ptrs`` (from L2) without ordering: the writer's poll. ptxas lowers ``_load_acquire``
    to a strong load and an invalidation of the SM's whole L1 (``CCTL.IVALL``), which likely also cost the consumers
    their spilled registers cached there (inferred, NOTES v32); polling with it did that every read, so the writer
    polls relaxed and acquires once after."""
    return gl.inline_asm_elementwise("ld.relaxed.gpu.global.b32 $0, [$1];", "=r,l", [ptrs], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def _release(ptrs, lane):
    """Wait until no bulk group is in flight in each lane (the copies, issued by whichever lane was elected, have
    landed), meet at a warp barrier, then lane 0 adds 1 to counter ``ptrs`` with release order."""
    gl.inline_asm_elementwise("{ .reg .pred p; cp.async.bulk.wait_group 0; bar.warp.sync -1; "
                              "fence.proxy.async.global; setp.eq.s32 p, $2, 0;\n\t"
                              "@p red.release.gpu.global.add.s32 [$1], 1; mov.b32 $0, 0; }",
                              "=r,l,r", [ptrs, lane], dtype=gl.int32, is_pure=False, pack=1)


def dq_descriptor(dq_acc, tile, d: int, device):
    """The kernel's dQ argument: a descriptor over ``dq_acc [B, rows, Hq, D]`` (contiguous) seen as ``[·, Hq,
    DQ_ORDER_COLS]``, unswizzled, with boxes of one warpgroup's part of a row tile in register order
    (``dq_order_rows``, ``_dq_coord``; both parts for ``dq_ordered``'s writer warp); without ``dq_acc`` (not fused)
    a placeholder the kernel never reads."""
    if dq_acc is None:
        return _placeholder(d, device)[1]
    box = ((2 if tile.dq_ordered else 1) * dq_order_rows(tile.block_m, d), 1, DQ_ORDER_COLS.value)
    return descriptor(dq_acc.view(-1, dq_acc.shape[2], DQ_ORDER_COLS.value), box, swizzled=False)


@functools.cache
def _placeholder(d: int, device) -> tuple:
    """(memory, its descriptor, whose box of a few rows sizes the kernel's unused dQ staging): kept together, since a
    descriptor holds only its memory's address."""
    memory = torch.zeros((8, d), dtype=torch.float32, device=device)
    return memory, descriptor(memory, (8, d // 2))


def semaphores(dq_sem, device):
    """The kernel's SEM argument: ``dq_sem``, or without it (not ordered) a placeholder the kernel never reads."""
    return _no_semaphores(device) if dq_sem is None else dq_sem


@functools.cache
def _no_semaphores(device):
    return torch.zeros(1, dtype=torch.int32, device=device)
