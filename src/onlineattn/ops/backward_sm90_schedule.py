"""Where the Hopper dK/dV kernel's programs work (``backward_sm90.py``): which key block a program takes, in which
order, and which of its row tiles (a split-tail piece's share, an ordered launch's rotation); and, on the host, how
many programs a persistent launch takes. Its partitions call these per key block."""

import functools

import numpy as np
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ._common import tile_of
from ._launch import cdiv
from .forward_sm90_schedule import balanced_programs, snake


@gluon.jit
def _spacing(n_tiles, seqlen_k, BLOCK_N: gl.constexpr):
    """ORDERED, non-causal: how many row tiles apart consecutive key blocks start (``n_tiles`` each), at least 1; 0
    where that does not fit (fewer row tiles than key blocks): they then all start at the first. (With the writer's
    earlier rule, a counter raised only after the next tile's turn, a spacing of 1 closed a cycle of waits, session
    21; now the spacing only keeps each add steps after the one it waits on, and 128-row tiles of square shapes have
    one row tile per key block per head of the group.)"""
    return n_tiles // gl.cdiv(seqlen_k, BLOCK_N)


@gluon.jit
def _key_block(tid, seqlen_q, seqlen_k, heads_kv, head_group, num_tiles, window_left, split, tile):
    """Tile ``tid`` -> (batch, kv head, key block, its first key, its first row tile's first row, row tiles per head
    of the group, the ORDERED rotation). (batch, kv head) columns go in groups of ``head_group`` (ORDERED: 1, so a
    head's programs launch together), key block 0 first (under causal masking the one with the most rows), or with
    LAST_BLOCK_FIRST (ORDERED causal) the last: a tile's adds then come from the last key blocks first (_turn).
    Persistent programs take their laps of tiles in the forward's snake order (``programs``). With SPLIT (``split``:
    (first piece item, pieces a tile)) ``tid`` and ``num_tiles`` count items, and a piece is its tile's (``_piece``
    says which row tiles it takes)."""
    num_n = gl.cdiv(seqlen_k, tile.BLOCK_N)
    if tile.PERSISTENT:
        tid = snake(tid, num_tiles)
    if tile.SPLIT:
        slot = gl.maximum(tid - split[0], 0)  # a piece's place among the pieces (0 for a whole block)
        tid = gl.minimum(tid, split[0]) + slot // split[1]
        num_tiles = split[0] + (num_tiles - split[0]) // split[1]
    last_first, pid_bh = tile_of(tid, num_n, num_tiles // num_n, head_group)
    pid_n = last_first
    if not tile.LAST_BLOCK_FIRST:
        pid_n = num_n - 1 - last_first
    n0 = pid_n * tile.BLOCK_N
    lo = 0
    if tile.CAUSAL:  # rows before the first key's diagonal see none of this block (query i sees key j <= i + Sk - Sq)
        lo = gl.maximum(n0 - (seqlen_k - seqlen_q), 0) // tile.BLOCK_M * tile.BLOCK_M
    rows_end = seqlen_q
    if tile.WINDOW:  # (causal) rows past the last key's window see none of this block: query i sees keys from
        rows_end = gl.minimum(seqlen_q, n0 + tile.BLOCK_N - (seqlen_k - seqlen_q) + window_left)  # i + diag - left
    row_tiles = gl.maximum(gl.cdiv(rows_end - lo, tile.BLOCK_M), 0)  # per head of the group
    shift = 0
    if tile.ORDERED and not tile.CAUSAL:  # programs start their row tiles apart (_turn)
        n_tiles = gl.maximum(row_tiles * tile.GROUP, 1)
        shift = (pid_n * _spacing(row_tiles * tile.GROUP, seqlen_k, tile.BLOCK_N)) % n_tiles
    return pid_bh // heads_kv, pid_bh % heads_kv, pid_n, n0, lo, row_tiles, shift


@gluon.jit
def _piece(tid, n_tiles, num_tiles, split):
    """SPLIT: item ``tid`` of ``num_tiles`` (``_key_block``) -> (its first row tile, the row tile past its last, its
    slot among the pieces, -1 for a whole key block): piece ``p`` of ``s`` takes row tiles ``p · n / s`` to ``(p + 1)
    · n / s`` of its block's ``n_tiles``."""
    slot = snake(tid, num_tiles) - split[0]
    piece = gl.maximum(slot, 0) % split[1]
    first = gl.where(slot >= 0, piece * n_tiles // split[1], 0)
    end = gl.where(slot >= 0, (piece + 1) * n_tiles // split[1], n_tiles)
    return first, end, gl.maximum(slot, -1)


@gluon.jit
def _row_tile(t, lo, row_tiles, shift, tile):
    """The ``t``-th row tile a program takes -> (its head within the GQA group, its first row): heads in turn, each
    over its row tiles from ``lo``; ORDERED non-causal programs start ``shift`` tiles in and wrap around. (Under
    WINDOW a key block may have no row tile, and its last dQ hand-over, not valid, still asks for one: divided by
    at least 1.)"""
    if tile.ORDERED and not tile.CAUSAL:
        t = (t + shift) % gl.maximum(row_tiles * tile.GROUP, 1)
    if tile.WINDOW:
        row_tiles = gl.maximum(row_tiles, 1)
    return t // row_tiles, lo + (t % row_tiles) * tile.BLOCK_M


@gluon.jit
def _blocks(block: gl.constexpr, args, num_tiles, tile):
    """A partition's key blocks: ``block(tid, it, n, args, tile)`` for key block ``pid``, or with PERSISTENT for
    ``pid, pid + programs, ...`` (its ``n``-th, its row tiles from the ``it``-th, which it returns advanced). Called
    once where a program owns one block: a loop around it there cost the ordered dQ 2-3 % (NOTES v22)."""
    if tile.PERSISTENT:
        it = 0
        n = 0
        for tid in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            it = block(tid, it, n, args, tile)
            n += 1
    else:
        block(gl.program_id(0), 0, 0, args, tile)


@functools.lru_cache(maxsize=256)
def programs(seqlen_q: int, seqlen_k: int, columns: int, group: int, causal: bool, block_m: int, block_n: int,
             head_group: int, sms: int, window_left: int | None = None) -> int:
    """A persistent launch's program count over key blocks of ``columns`` (batch, kv head) columns in launch order
    (``_key_block``: ``tile_of``, groups of ``head_group`` columns, block 0 first), a block costing its row tiles
    (of the ``group`` heads) plus 2: what a program's fixed work cost against a row tile at d = 128 (NOTES v22).
    ``balanced_programs`` picks the count. ``window_left``: a causal window's left side, as ``launch_dkdv`` takes it
    (a block's rows end at its last key's window, ``_key_block``)."""
    num_n = cdiv(seqlen_k, block_n)
    n0 = np.arange(num_n) * block_n
    lo = np.maximum(n0 - (seqlen_k - seqlen_q), 0) // block_m * block_m if causal else np.zeros(num_n, dtype=np.int64)
    end = seqlen_q if window_left is None else np.minimum(seqlen_q, n0 + block_n - (seqlen_k - seqlen_q) + window_left)
    cost = np.maximum(-(-(end - lo) // block_m), 0) * group + 2.0
    per_group = head_group * num_n

    def cost_of(t):  # tile t's key block: tile_of's t % per_group // (its group's columns; the last group may be short)
        return cost[t % per_group // np.minimum(columns - t // per_group * head_group, head_group)]

    return balanced_programs(num_n * columns, sms, cost_of)
