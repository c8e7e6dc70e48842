"""Where the Hopper forward kernel's programs work (``forward_sm90.py``): which tile (or split-tail piece) an item
is, which key blocks a tile and each of its warpgroups compute, and, on the host, how many programs a persistent
launch takes (``balanced_programs``, which the backward's launches use too) and where warpgroup 0 takes the diagonal
block at half width."""

import functools

import numpy as np
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ._launch import cdiv


@gluon.jit
def snake(t, num_tiles):
    """A persistent program's ``t``-th tile (``t = pid, pid + programs, ...``: laps of ``programs`` tiles) in the
    snake order: every odd full lap reversed (``balanced_programs``). One lap (a tile per program): ``t`` itself."""
    programs = gl.num_programs(0)
    lap = t // programs
    mirror = (lap % 2 == 1) & ((lap + 1) * programs <= num_tiles)
    return gl.where(mirror, lap * programs + (programs - 1 - t % programs), t)


@gluon.jit
def _tile_coords(t, seqlen_q, seqlen_k, heads_q, num_tiles, band, split, tile):
    """Item ``t`` -> (batch, q head, first row, key blocks, a piece's first key, piece slot). Without SPLIT an item
    is a tile, its first key 0 here (``_key0`` finds a window's) and its slot -1. With SPLIT (``split``: (first
    piece item, pieces a tile)) the items from the first piece on are pieces of the last lap's tiles, a tile's
    pieces in turn: piece ``p`` of ``s`` takes key blocks ``p · n / s`` to ``(p + 1) · n / s`` of the tile's ``n``,
    its slot its place among the pieces (``_store_piece``). A head's row tiles are adjacent (they share
    K and V in L2: interleaving the heads instead cost 2-5 % causal at N >= 4096, session 19); under causal they come
    bottom first (the most key blocks; under a window all but the first window's rows have as many), so within a head
    the tiles handed out last are the short ones. A program takes ``t = pid, pid + programs, ...`` (laps of ``programs``
    tiles); every odd full lap is taken in reverse (a snake), so under causal a program that took a longer tile of one
    lap takes a shorter one of the next, and ``programs`` picks the count whose laps balance best (a length-major order
    balanced them too but lost more to L2, NOTES v12). A tile whose rows all sit above the causal diagonal (Sq > Sk)
    still takes key block 0, fully masked: its rows get o = 0 and lse = -inf like any row that sees no key (o is 0 · V
    there: NaN where that block of V holds inf or NaN, as for any masked key of a computed block; with HALF_DIAG
    warpgroup 0 multiplies only the block's first 64 keys' V)."""
    t = snake(t, num_tiles)
    slot = t * 0 - 1
    if tile.SPLIT:
        if t >= split[0]:
            slot = t - split[0]
            t = split[0] + slot // split[1]
    num_m = gl.cdiv(seqlen_q, tile.BLOCK_M)
    pid_m = t % num_m
    if tile.CAUSAL:
        pid_m = num_m - 1 - pid_m
    pid_bh = t // num_m
    m0 = pid_m * tile.BLOCK_M
    hi = seqlen_k
    if tile.CAUSAL:  # bottom-right diagonal: row i sees keys j <= i + Sk - Sq (+ a window's right side)
        hi = gl.minimum(seqlen_k, m0 + tile.BLOCK_M + seqlen_k - seqlen_q + _right(band, tile))
    n_blocks = gl.maximum(gl.cdiv(hi, tile.BLOCK_N), 1) - _key0(m0, seqlen_q, seqlen_k, band, tile) // tile.BLOCK_N
    key0 = m0 * 0
    if tile.SPLIT:
        if slot >= 0:
            piece = slot % split[1]
            first = piece * n_blocks // split[1]
            key0 = first * tile.BLOCK_N
            n_blocks = (piece + 1) * n_blocks // split[1] - first
    return pid_bh // heads_q, pid_bh % heads_q, m0, n_blocks, key0, slot


@gluon.jit
def _right(band, tile):
    """How far right of the bottom-right diagonal a row sees under CAUSAL: 0, or under WINDOW the window's right side
    (``band``: its (left, right))."""
    right = 0
    if tile.WINDOW:
        right = band[1]
    return right


@gluon.jit
def _key0(m0, seqlen_q, seqlen_k, band, tile):
    """The first key of the blocks of the tile from row ``m0``: 0, or under WINDOW the start of the block holding
    the left edge of that row (key m0 + Sk - Sq - left), left of which no row of the tile sees a key. Each
    warpgroup computes from there (a later warpgroup's rows may see none of that block: it is masked). With SPLIT,
    ``band[2]``: the item's first key (``_tile_coords``; the band the partitions make per item)."""
    key0 = 0
    if tile.WINDOW:
        key0 = gl.maximum(m0 + seqlen_k - seqlen_q - band[0], 0) // tile.BLOCK_N * tile.BLOCK_N
    elif tile.SPLIT:
        key0 = band[2]
    return key0


@gluon.jit
def _own_blocks(row0, n_blocks, seqlen_q, seqlen_k, band, tile):
    """How many of its tile's ``n_blocks`` key blocks this warpgroup's 64 rows (from ``row0``) see. Under causal
    masking a warpgroup's rows can end before the tile's last block starts (64-key blocks, a diagonal off the
    block boundaries, or the first two warpgroups of a 192-row tile): it then does not compute that block, fully
    masked. At a hand-over it releases the block's stage (``_skip``); after a program's last tile it leaves it
    unreleased, which is safe because the producer has issued every load by then and the last warpgroup, which
    sees every block, waits for each to land. With 64- or 128-key blocks that is at most one block a tile, and with
    128-key blocks in 192-row tiles (``launch`` takes no others)."""
    own = n_blocks
    if tile.CAUSAL:
        hi = gl.minimum(seqlen_k, row0 + 64 + seqlen_k - seqlen_q + _right(band, tile))
        first = _key0(row0 - tile.WG * 64, seqlen_q, seqlen_k, band, tile) // tile.BLOCK_N
        own = gl.minimum(gl.maximum(gl.cdiv(hi, tile.BLOCK_N), 1) - first, n_blocks)
    return own


def half_diagonal(seqlen_q: int, seqlen_k: int, causal: bool, cfg) -> bool:
    """Whether warpgroup 0 takes each tile's diagonal block at half width: causal, with key blocks as long as the
    tile's rows and the diagonal on a block boundary, so its 64 rows see at most the block's first 64 keys."""
    return causal and cfg.block_n == cfg.block_m and (seqlen_k - seqlen_q) % cfg.block_n == 0


@functools.lru_cache(maxsize=256)
def programs(num_tiles: int, seqlen_q: int, seqlen_k: int, causal: bool, block_m: int, block_n: int,
             sms: int, band: tuple | None = None) -> int:
    """A persistent launch's program count (``balanced_programs``), a tile counting as its key blocks plus one (the
    per-tile cost measured at N = 512, NOTES v14). Under causal the tiles differ in length and an uneven last lap
    left the busiest program 11 % over the mean (d = 128, N = 512, 132 programs; 128 balance exactly). ``band``
    (``causal`` True): a window's (left, right), as ``launch`` takes it."""
    num_m = cdiv(seqlen_q, block_m)
    m0 = np.arange(num_m)[::-1] * block_m if causal else np.zeros(num_m, dtype=np.int64)  # tile t's rows: t % num_m
    left, right = band or (0, 0)
    hi = np.minimum(seqlen_k, m0 + block_m + seqlen_k - seqlen_q + right) if causal else np.full(num_m, seqlen_k)
    first = np.maximum(m0 + seqlen_k - seqlen_q - left, 0) // block_n if band else 0  # _key0's block
    cost = np.maximum(-(-hi // block_n), 1) - first + 1.0
    return balanced_programs(num_tiles, sms, lambda t: cost[t % num_m])


def balanced_programs(num_tiles: int, sms: int, cost) -> int:
    """The program count of a persistent launch of ``num_tiles`` tiles, tile ``t`` (in launch order, an array)
    costing ``cost(t)``: programs take laps of tiles, odd full laps reversed (``snake``); of ``3/4 sms ... sms``
    programs this picks the count whose busiest program has the least work, ties to the most programs. Where the
    tiles fit, one program each; past 64 laps the count is ``sms`` (the tail is a small share), and ``cost`` is not
    called."""
    if num_tiles <= sms or num_tiles > 64 * sms:
        return min(num_tiles, sms)
    t = np.arange(num_tiles)
    cost = cost(t)
    best, best_load = sms, None
    for count in range(sms, max(1, (3 * sms) // 4) - 1, -1):
        lap, pos = t // count, t % count
        mirror = (lap % 2 == 1) & ((lap + 1) * count <= num_tiles)
        taken = np.where(mirror, lap * count + count - 1 - pos, t)
        load = np.bincount(pos, weights=cost[taken], minlength=count).max()
        if best_load is None or load < best_load:
            best, best_load = count, load
    return best
