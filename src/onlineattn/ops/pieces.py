"""The second launch of a split tail: a persistent Hopper launch whose equal tiles leave a partial last lap runs that
lap's tiles as pieces (``_configs.tail_pieces``), each leaving a float32 partial result, and one of these Triton
kernels combines each tile's pieces in piece order (so a launch gives the same bits every time):

- ``merge_pieces``: the forward's pieces of key blocks, float32 (o, lse) states, merged by their log-sum-exp
  (``merge_splits``, decode's split merge) into o and lse (``forward_sm90.launch``);
- ``sum_pieces``: the dK/dV kernel's pieces of row tiles, float32 partial dK (scaled) and dV, summed into dk and dv
  (``backward_sm90.launch_dkdv``).
"""

import triton
import triton.language as tl

from ._common import merge_splits, tile_of
from ._configs import tail_pieces
from ._launch import cdiv, launch as launch_kernel

MERGE_ELEMENTS = 4096  # a program's rows times the head dim: 32 rows at d = 128


def split_tail(num_tiles: int, programs: int, blocks: int, overhead: int, allowed: bool) -> tuple:
    """How a persistent launch of ``num_tiles`` equal tiles of ``blocks`` blocks over ``programs`` programs splits its
    last lap (``tail_pieces``, where ``allowed``): (pieces a tile, the first piece item, the items the kernel takes:
    whole tiles, then each split tile's pieces in turn); (1, 1, num_tiles) without a split (1s: constexprs, no
    kernel argument)."""
    pieces = tail_pieces(num_tiles, programs, blocks, overhead) if allowed else 1
    if pieces == 1:
        return 1, 1, num_tiles
    full = num_tiles - num_tiles % programs
    return pieces, full, num_tiles + (num_tiles - full) * (pieces - 1)


@triton.jit
def merge_pieces_kernel(O_PART, LSE_PART, O, LSE, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, first_tile,
                        pieces, seqlen_q, heads_q, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr):
    """Tile ``first_tile + program_id(0)`` of a split forward launch: ``ROWS`` of its rows (``program_id(1)``), their
    ``pieces`` partial states (slots ``program_id(0) · pieces ...`` of ``O_PART [slots, BLOCK_M, D]`` and ``LSE_PART
    [slots, BLOCK_M]``) merged in piece order (``merge_splits``) into ``o [B, Sq, Hq, D]`` and ``lse [B, Hq, Sq]``;
    rows past the end dropped. Tiles are numbered as ``forward_sm90_schedule._tile_coords`` numbers them without causal
    masking."""
    tl.static_assert(BLOCK_M % ROWS == 0, "a tile's rows split evenly between its merge programs")
    split = tl.program_id(0)
    t = first_tile + split
    num_m = tl.cdiv(seqlen_q, BLOCK_M)
    off_b = (t // num_m // heads_q).to(tl.int64)
    off_h = (t // num_m % heads_q).to(tl.int64)  # o's head stride may be Sq · D (a head-major view): 64-bit sums
    local = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    rows = ((t % num_m) * BLOCK_M + local).to(tl.int64)
    m_r = rows < seqlen_q
    o_d = tl.arange(0, HEAD_DIM)
    first = split.to(tl.int64) * pieces * BLOCK_M + local
    o, lse = merge_splits(O_PART + first[:, None] * HEAD_DIM + o_d[None, :], LSE_PART + first, BLOCK_M * HEAD_DIM,
                          BLOCK_M, pieces, m_r, o_d < HEAD_DIM, ROWS, HEAD_DIM, 1)
    p_o = O + off_b * stride_ob + rows[:, None] * stride_os + off_h * stride_oh + o_d[None, :]
    tl.store(p_o, o.to(O.dtype.element_ty), mask=m_r[:, None])
    tl.store(LSE + off_b * stride_lb + off_h * stride_lh + rows, lse, mask=m_r)


def merge_pieces(o_part, lse_part, o, lse, first_tile: int, pieces: int) -> None:
    """After a split forward launch: each split tile's pieces (``o_part [slots, BLOCK_M, D]``, ``lse_part [slots,
    BLOCK_M]``, a tile's ``pieces`` slots in turn, tiles from ``first_tile``) merged into ``o`` and ``lse``."""
    slots, block_m, d = o_part.shape
    rows = MERGE_ELEMENTS // d
    launch_kernel(merge_pieces_kernel, (slots // pieces, cdiv(block_m, rows)), o_part, lse_part, o, lse, o.stride(0),
                  o.stride(1), o.stride(2), lse.stride(0), lse.stride(1), first_tile, pieces, o.shape[1], o.shape[2],
                  BLOCK_M=block_m, HEAD_DIM=d, ROWS=rows, num_warps=4)


@triton.jit
def sum_pieces_kernel(DK_PART, DV_PART, DK, DV, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
                      first_tile, pieces, seqlen_k, heads_kv, columns, head_group, BLOCK_N: tl.constexpr,
                      HEAD_DIM: tl.constexpr, ROWS: tl.constexpr):
    """Key block ``first_tile + program_id(0)`` of a split dK/dV launch: ``ROWS`` of its keys (``program_id(1)``),
    their ``pieces`` partial sums (slots ``program_id(0) · pieces ...`` of ``DK_PART``/``DV_PART [slots, BLOCK_N,
    D]``, dK already scaled) added in piece order into ``dk``/``dv [B, Sk, Hkv, D]``; keys past the end dropped.
    Blocks are numbered as ``backward_sm90_schedule._key_block`` numbers them without LAST_BLOCK_FIRST (``tile_of`` over
    ``columns`` (batch, kv head) columns in groups of ``head_group``, a column's key block 0 first)."""
    tl.static_assert(BLOCK_N % ROWS == 0, "a block's keys split evenly between its programs")
    split = tl.program_id(0)
    num_n = tl.cdiv(seqlen_k, BLOCK_N)
    last_first, pid_bh = tile_of(first_tile + split, num_n, columns, head_group)
    off_b = (pid_bh // heads_kv).to(tl.int64)
    off_hkv = (pid_bh % heads_kv).to(tl.int64)
    local = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    keys = ((num_n - 1 - last_first) * BLOCK_N + local).to(tl.int64)
    cols = tl.arange(0, HEAD_DIM)
    part = (split.to(tl.int64) * pieces * BLOCK_N + local)[:, None] * HEAD_DIM + cols[None, :]
    dk = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    for _ in range(pieces):
        dk += tl.load(DK_PART + part)
        dv += tl.load(DV_PART + part)
        part += BLOCK_N * HEAD_DIM
    keep = (keys < seqlen_k)[:, None]
    p_dk = DK + off_b * stride_dkb + keys[:, None] * stride_dks + off_hkv * stride_dkh + cols[None, :]
    p_dv = DV + off_b * stride_dvb + keys[:, None] * stride_dvs + off_hkv * stride_dvh + cols[None, :]
    tl.store(p_dk, dk.to(DK.dtype.element_ty), mask=keep)
    tl.store(p_dv, dv.to(DV.dtype.element_ty), mask=keep)


def sum_pieces(dk_part, dv_part, dk, dv, first_tile: int, pieces: int, columns: int, head_group: int) -> None:
    """After a split dK/dV launch: each split key block's pieces (``dk_part``/``dv_part [slots, BLOCK_N, D]``, a
    block's ``pieces`` slots in turn, blocks from ``first_tile``) summed into ``dk`` and ``dv`` (``[B, Sk, Hkv,
    D]``); ``columns``: batch · kv heads, ``head_group`` as the launch took them."""
    slots, block_n, d = dk_part.shape
    rows = min(MERGE_ELEMENTS // d, block_n)
    launch_kernel(sum_pieces_kernel, (slots // pieces, cdiv(block_n, rows)), dk_part, dv_part, dk, dv,
                  *dk.stride()[:3], *dv.stride()[:3], first_tile, pieces, dk.shape[1], dk.shape[2], columns,
                  head_group, BLOCK_N=block_n, HEAD_DIM=d, ROWS=rows, num_warps=4)
