"""The decode kernel's tiles and its split, wave and merge rules (``decode.py``), as data. Each entry carries the
measured reason it was chosen; the prefill tiles are in ``_configs.py``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._configs import _padded
from ._launch import cdiv, next_power_of_2


DECODE_MIN_BLOCKS_PER_SPLIT = 4  # a tile's default fewest blocks per chunk (the split rule below says why)


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int  # keys per block
    block_m: int  # most packed (query, head) rows per program; more rows launch more programs
    num_warps: int
    num_stages: int
    balance: bool = True  # the split rule also cuts long caches of full grids into chunks (decode_num_splits)
    per_sm: int = 1  # programs per SM the split rule fills (decode_num_splits)
    min_blocks: int = DECODE_MIN_BLOCKS_PER_SPLIT  # fewest key blocks in a split's chunk
    tma_max_keys: int = 0  # K and V by TMA (contiguous caches) where a split's chunk has at most this many keys
    waves: bool = False  # the split rule then cuts long chunks further, into whole waves of programs (decode_splits)


_DECODE_INTERPRETER = DecodeConfig(block_n=32, block_m=64, num_warps=4, num_stages=1)

# H200, bf16, d = 128 (benchmarks/sweep_decode.py, graph-timed, 2026-11-29; benchmarks/NOTES.md "Decode v1"):
# - 64 keys, 4 warps, 2 stages led at B = 16 (4.39 TB/s at L = 32k, 4.47 at 128k) where 3 stages gave 4.24 / 4.37.
#   Other head dims are not measured: they keep 64 keys and take the same 2 stages (d = 256 already had 32 keys, 2
#   stages, to leave shared memory).
# - K and V by TMA (tensor descriptors, the copy engine zero-filling past the cache's capacity) rather than pointer
#   loads, where a split's chunk has at most DECODE_TMA_MAX_KEYS keys (NOTES v41, ab_decode.py, graph-timed, Hq 32 /
#   Hkv 8, two rounds, µs, pointers -> TMA): one program per SM, long tile, B = 1, L = 8k 11.6 -> 9.4, 32k 36.8 ->
#   35.7, 128k 124.9 -> 123.4-123.8 (chunks of 8k); B = 2, 16k 37.4 -> 35.7; B = 8, 8k 66.5 -> 64.5; B = 16, 4k 64.5
#   -> 63.4, 16k 240.5 -> 239.3; this tile, B = 32, 4k 135.5 -> 131.0, B = 64, 4k 243.7 -> 243.1; the fill tile, Hkv
#   4, B = 1, 16k 14.1 -> 13.3. Longer chunks tied or lost: B = 16, 32k 475.3 -> 475.1, 128k 1899 -> 1905; B = 64,
#   32k 1889 -> 1891, 128k 7538 -> 7561. The short-cache tile tied (B = 1, 4k 8.1 -> 7.8-8.3; Hq 8 / Hkv 1, B = 2, 8k
#   8.7 both), so it keeps pointer loads and no descriptor to build. Measured at d = 128; the d = 128 tables serve
#   head dims 65-128, whose narrower rows the copy engine pads with zeros in the box (tested, not timed); other
#   tables keep pointers. Devices without TMA (before sm_90) keep pointers too (decode._tma).
#   The longer chunks lost in flash-attn's layout, where a head's keys are 256 bytes every Hkv * 256: over
#   head-major caches (each head's keys adjacent, SDPA's layout, as views) TMA led at each length measured (NOTES
#   v41, `ab_decode.py --head-major`, one process, B = 16, pointers -> TMA: 128k 1881.0-1881.2 -> 1872.5-1872.8, 32k
#   477.4 -> 475.3, 4k 64.6-64.7 -> 63.7), so decode._tma takes it there at any chunk. Other batch sizes (B = 64 at
#   32k and 128k, where flash-attn's layout lost 0.3 % by TMA) are unmeasured; v42's re-timing in another call read
#   1880.8-1881.0 at 128k with no pointer build beside it (not an A/B).
DECODE_TMA_MAX_KEYS = 16384
_DECODE_HALF = {16: DecodeConfig(64, 64, 4, 2), 32: DecodeConfig(64, 64, 4, 2), 64: DecodeConfig(64, 64, 4, 2),
                128: DecodeConfig(64, 64, 4, 2, tma_max_keys=DECODE_TMA_MAX_KEYS), 256: DecodeConfig(32, 64, 4, 2)}
# - A grid of at most one program per SM (B * Hkv * automatic splits <= SMs: B = 1 at any length, B = 16 at L = 4k,
#   one split of 128 pairs) has each program alone on its SM, so it must keep more loads in flight itself: 3 stages.
#   sweep_decode.py at 3d9bcdd (graph-timed): B = 16, L = 4k 107.8 us with 2 stages -> 66.9 us with 3 (best seen:
#   64.4, 128 keys and 3 stages); B = 1, L = 4k 16 splits 12.3 -> 11.6 us (the former 128-key short-cache tile with 8
#   splits: 12.4); B = 1, L = 128k 2.40 -> 3.38 TB/s at 369cefa. Over full grids 2 stages stay (above).
_DECODE_HALF_FILL = {16: DecodeConfig(64, 64, 4, 3), 32: DecodeConfig(64, 64, 4, 3), 64: DecodeConfig(64, 64, 4, 3),
                     128: DecodeConfig(64, 64, 4, 3, tma_max_keys=DECODE_TMA_MAX_KEYS)}
# - Long chunks: 128-key blocks, 3 stages, and no balance splits (d = 128 only; others unmeasured).
#   - v9 (sweep_decode.py at 943df2b, graph-timed / cold): with one program per SM and chunks of at least
#     DECODE_MIN_BLOCKS_PER_SPLIT 128-key blocks, 128 keys per block keep twice the bytes in flight: B = 1, L = 128k
#     135.6 -> 128.0 us graph (3.96 -> 4.19 TB/s), 148.3 -> 139.6 us cold; L = 32k 41.0 -> 40.1 / 50.7 -> 50.6;
#     B = 16, L = 4k 66.7 -> 64.5 / 77.9 -> 76.7. Shorter chunks (B = 1, L = 4k: 16 splits of 256 keys) keep 64
#     keys: with 128 the split rule's minimum chunk would halve the splits (8: 12.4 us in v6 against 11.0 for 16).
#   - v19 (.devrun/dtab.py at db569af, graph-timed, two passes, SDPA's default in the same process): cuDNN's decode
#     kernel runs one 4-warp program per (sequence, kv head), unsplit, with 86 KiB of shared memory (ncu). The same
#     shape here, this tile at the fill split count (one program per SM or more) and no balance splits, against the
#     table's 64-key 2-stage tile with balance splits: B = 16, L = 32k 489.7-490.3 -> 475.1-475.2 us (SDPA 472.9-
#     473.3), L = 128k 1912-1913 -> 1893 (1885-1891); B = 32, L = 32k 964 -> 952 (961); B = 64, L = 32k 1918 ->
#     1882-1887 (1915-1924), L = 128k 7630-7632 -> 7497-7506 (7677-7686); B = 8, L = 32k 2 splits 251 -> 243 (245-246);
#     B = 4, L = 128k 4 splits 491 -> 477-479 (479-482). At B = 64, L = 4k it read 245.5-246.4 against the 64-key
#     tile's 244.4-245.2, so grids past one program per SM take it from DECODE_LONG_MIN_KEYS keys per chunk. Where
#     the long tile's own (unbalanced) split count fills the SMs at most once, 512 keys a chunk suffice, as in the
#     fill grids (B = 16 at 8k, B = 4 at 32k, B = 2 at 64k: between measured points, unmeasured themselves).
#   - v43 (session 51, ab_decode.py, graph-timed, two rounds in one call, Hq 32 / Hkv 8, L = 128k, µs; programs a
#     split x splits = programs, then waves of one program per SM on 132 SMs): 128 x 1 = 0.97 waves 1884-1886, x 2 =
#     1.94 1859, x 4 = 3.88 1851, x 8 = 7.76 1853; 192 x 1 = 1.45 3223-3225, x 2 = 2.91 2769-2770, x 3 = 4.36 3048-3049;
#     256 x 1 = 1.94 3724-3730, x 2 = 3.88 3682-3683, x 4 = 7.76 3718-3719; 512 x 1 = 3.88 7367-7376, x 2 = 7.76
#     7413-7415, x 4 7474-7475; 64 x 2 = 0.97 948-949, x 4 = 1.94 936, x 8 = 3.88 933; 96 x 1 = 0.73 1379-1380, x 2
#     = 1.45 1739-1740, x 4 = 2.91 1393, x 5 = 3.64 1460-1462; at L = 32k 128 x 1 473.8-473.9, x 2 470.8-471.2; at 64k
#     128 x 1 944.4-944.5, x 2 937.6-937.8, x 4 932.3-932.8. A grid whose last wave leaves many SMs idle streams
#     that wave short of the DRAM's rate (192 x 1 lost 16 %), and a single wave lost to three or four (a program
#     that ends early leaves its SM idle to the end). So the long tile takes the most splits from the fill rule's
#     count up whose grid runs at most DECODE_MAX_WAVES waves, its last at least DECODE_LAST_WAVE full, over chunks
#     of at least DECODE_WAVE_MIN_KEYS keys (decode_wave_splits). Its cost: 96 x 4 (the rule) against 96 x 1, +1 %.
#     Not below 32k-key chunks: on another machine (one process, two rounds) B = 16, L = 32k read 465.4 unsplit
#     against 472.4-472.5 in 2 splits of 16k keys (which also take TMA), though 128k gained there too (1855-1857
#     -> 1851); on the first, 2 splits had gained (473.8 -> 471.0).
_DECODE_LONG = {128: DecodeConfig(128, 64, 4, 3, balance=False, tma_max_keys=DECODE_TMA_MAX_KEYS, waves=True)}
DECODE_LONG_MIN_KEYS = 16384  # per chunk, where the long tile's grid has more programs than SMs (4k < it <= 32k)
DECODE_MAX_WAVES = 4
DECODE_WAVE_MIN_KEYS = 32768
DECODE_LAST_WAVE = 0.85
# - Short caches: two programs per SM over chunks of 64-key blocks, 2 stages, no balance splits, where one program per
#   SM (the fill split count) would leave chunks of at most DECODE_SHORT_MAX_KEYS keys and at least
#   DECODE_SHORT_MIN_SPLITS splits (d = 128 only). Its merge loads every partial at once, so it takes no more splits
#   than that holds (decode_splits) unless those chunks would be long and a merge tree may run (whole nodes then).
#   (Its chunks used to be held to 512 keys, for wide GQA groups whose merge held few splits and ran no tree; with
#   trees up to DECODE_SHORT_MAX_ROWS rows that never binds, NOTES v38.) NOTES v36 (.devrun/dec44*.py,
#   graph-timed, two rounds, SDPA's default in the same process; Hq / Hkv, B, L: old choice -> this, µs): 32 / 8, B =
#   1, L = 1k 9.5-9.7 -> 6.7 (16 splits of one block, SDPA 6.2-6.6), 2k 9.8-9.9 -> 7.8-7.9 (32 of one; 7.2), 4k
#   9.9-10.1 -> 9.3-9.5 (32 of two; 8.9-9.3); 32 / 32, B = 1, L = 1k 8.8-8.9 -> 8.4 (8); 8 / 2, B = 1, L = 4k
#   9.5-9.6 -> 7.6-7.9 and 16k 19.9-20.2 -> 14.4-14.6 (32 splits, the second of 512 keys: .devrun/dab44.py).
#   Chunks of 512 keys at the fill count split twice as fine gave mixed results (B = 1, L = 8k 13.1 -> 12.2; B = 2,
#   L = 4k 12.6 -> 13.8), so the fill tiles keep them. Grids of more than DECODE_SHORT_MAX_ROWS query rows (B · Sq ·
#   Hq) lost with the same programs and chunks (dab44.py, b59a84b against bb92c8f, alternating processes: 32 / 8,
#   B = 2, L = 2k 9.5 -> 10.8; B = 4, L = 1k 9.3 -> 10.5; 64 / 8, B = 1, L = 4k 11.0 -> 11.8; cause not found), so
#   they keep the fill tiles too. GQA groups of 16 and 32 (32 / 2 and 32 / 1, B = 1, 8k): NOTES v38.
_DECODE_SHORT = {128: DecodeConfig(64, 64, 4, 2, balance=False, per_sm=2, min_blocks=1)}
DECODE_SHORT_MAX_KEYS = 256
DECODE_SHORT_MIN_SPLITS = 4
DECODE_SHORT_MAX_ROWS = 32
# The short tile's tree from capped chunks of half DECODE_SHORT_MAX_KEYS where its capped grid would fill at most
# 1 / DECODE_TREE_SPARSE of the SMs (NOTES v38, graph-timed, Hq / Hkv, B = 1, L: the cap -> a tree, SDPA's default,
# us): 8 / 1, 4k 8.2 -> 7.1 (16 programs of 256 keys -> 64 of 64; 7.1); 32 / 2, 2k 8.4 -> 7.3 (16 -> 32 programs;
# 6.9); 16 / 2, 4k 8.5 -> 7.5 (32 -> 128; 7.2). It lost with chunks of 128 keys (8 / 1, 2k 6.1 -> 6.7-7.0) and at 64
# capped programs (28 / 4, 4k 8.6-8.8 -> 9.0-9.5; 8 / 2, 4k 6.2 -> 7.0; 32 / 4, 2k 6.6 -> 7.4).
DECODE_TREE_SPARSE = 4
# - Paged caches (session 18, sweep_decode.py --paged 256 at fbc1758, graph-timed, d = 128 bf16, Hq 32, Hkv 8): the
#   page id feeds each block's K/V addresses, so the pipeliner keeps fewer K/V loads in flight than for a contiguous
#   cache, and the contiguous tiles left paged B = 1 at 2.3-2.6 TB/s. Five stages restore the depth. The gathered
#   loads keep a shallower shared-memory buffer than a contiguous tile's stages: 137 KiB for the paged 128-key tile at
#   5 stages (sm_90 compile), about a contiguous tile's at 3; the contiguous one at 5 stages needs 264 KiB.
#   One program per SM: 128 keys, 5 stages: B = 1, L = 4k / 32k / 128k 14.9 / 58.2 / 204.9 us -> 14.1 / 46.3 / 148.0,
#   B = 16, L = 4k 103.7 -> 74.2 (4, 6 and 8 stages within 1%; 3 and 4 stages time the same). Fuller grids: 64 keys,
#   5 stages: B = 16, L = 32k 543.2 -> 526.0, L = 128k 2096.8 -> 2030.8, B = 64, L = 32k 1988.6 -> 1943.0.
#   d = 128 only (others unmeasured keep the contiguous tables).
_DECODE_PAGED_FILL = {128: DecodeConfig(128, 64, 4, 5)}
_DECODE_PAGED = {128: DecodeConfig(64, 64, 4, 5)}
# float32 (ieee dots, exactness before speed) halves the keys per block; unmeasured.
_DECODE_FP32 = {16: DecodeConfig(32, 64, 4, 2), 32: DecodeConfig(32, 64, 4, 2), 64: DecodeConfig(32, 64, 4, 2),
                128: DecodeConfig(32, 64, 4, 2), 256: DecodeConfig(16, 32, 4, 1)}


# Wide GQA groups: one query token, more than DECODE_WIDE_ROWS (and at most twice as many) query heads a kv head and
# at most DECODE_WIDE_MAX_PAIRS (sequence, kv head) pairs, with automatic splits: row blocks of DECODE_WIDE_ROWS rows.
# Both blocks of a pair read the same keys (the second read mostly from L2, the two programs launched side by side);
# each merges its own 16 rows, in tree nodes of 8 partials where 32 rows took 4, so in fewer levels, and computes
# half the rows a key. NOTES v39 (graph-timed, d = 128, bf16; Hq / Hkv, B, L: 32 rows in one block -> 16-row blocks
# with the tables' choice, SDPA's default; us): 32 / 1, 2, 32k 21.5-21.6 -> 18.7-18.8 (16.8-17.3); 32 / 1, 1, 8k
# 12.7-12.9 -> 8.5-8.6 (8.9-9.0); 64 / 2, 1, 16k 15.1-15.3 -> 13.9-14.0 (12.6); 32 / 1, 4, 16k 19.7-19.8 -> 18.4
# (15.9-16.1); 32 / 1, 1, 128k 31.2-31.3 -> 30.5-30.7 (29.4). Measured over 1-4 pairs, for contiguous
# half-precision caches of head dims 65-128; more query tokens, more pairs and other caches keep 64-row blocks.
DECODE_WIDE_ROWS = 16
DECODE_WIDE_MAX_PAIRS = 4


def decode_block_m(sq: int, group: int, pairs: int, num_sms: int, head_dim: int, dtype: torch.dtype,
                   device_type: str, paged: bool, num_splits: int) -> int:
    """Packed rows a decode program holds for ``sq`` query tokens of a GQA ``group`` over ``pairs`` (sequence, kv
    head) pairs and ``num_splits`` (0: automatic): DECODE_WIDE_ROWS for the wide groups above, else the tables' 64."""
    wide = sq == 1 and DECODE_WIDE_ROWS < group <= 2 * DECODE_WIDE_ROWS and pairs <= DECODE_WIDE_MAX_PAIRS
    if (wide and not num_splits and device_type == "cuda" and not paged and dtype != torch.float32
            and _padded(head_dim) == 128 and 2 * pairs <= num_sms):
        return DECODE_WIDE_ROWS
    return 64


def decode_config(head_dim: int, head_dim_v: int, dtype: torch.dtype, device_type: str, *, batch_heads: int = 0,
                  max_seqlen_k: int = 0, num_sms: int = 0, num_splits: int = 0, paged: bool = False,
                  rows: int = 0) -> DecodeConfig:
    """The tile for a decode launch of ``batch_heads`` programs per split ((sequence, kv head) pairs times row
    blocks), keys up to ``max_seqlen_k`` (0: unknown, counted as one split), ``num_splits`` (0: automatic), a paged
    cache or not, and ``rows`` query rows in all (B · Sq · Hq; 0: unknown)."""
    if device_type != "cuda":
        return _DECODE_INTERPRETER
    padded = _padded(max(head_dim, head_dim_v))
    if dtype == torch.float32:
        return _DECODE_FP32[padded]
    splits = num_splits or decode_num_splits(batch_heads, max_seqlen_k, num_sms, _DECODE_HALF[padded].block_n)
    fill = 0 < batch_heads * splits <= num_sms  # at most one program per SM
    if paged and padded in _DECODE_PAGED:
        return (_DECODE_PAGED_FILL if fill else _DECODE_PAGED)[padded]
    short = _DECODE_SHORT.get(padded)
    if (short is not None and fill and not paged and not num_splits and max_seqlen_k > 0
            and 0 < rows <= DECODE_SHORT_MAX_ROWS and splits >= DECODE_SHORT_MIN_SPLITS
            and -(-max_seqlen_k // splits) <= DECODE_SHORT_MAX_KEYS):
        return short
    long = _DECODE_LONG.get(padded)
    if long is not None and not paged:
        if fill:  # chunks of at least DECODE_MIN_BLOCKS_PER_SPLIT 128-key blocks
            least, chunks = DECODE_MIN_BLOCKS_PER_SPLIT * long.block_n, splits
        else:  # the long tile's own split count (fill only, no balance), which may still fill the SMs once
            chunks = num_splits or decode_num_splits(batch_heads, max_seqlen_k, num_sms, long.block_n, balance=False)
            own_fill = 0 < batch_heads * chunks <= num_sms
            least = DECODE_MIN_BLOCKS_PER_SPLIT * long.block_n if own_fill else DECODE_LONG_MIN_KEYS
        if -(-max_seqlen_k // chunks) >= least:
            return long
    if not fill:
        return _DECODE_HALF[padded]
    return _DECODE_HALF_FILL.get(padded, _DECODE_HALF[padded])


# Split-KV rule for num_splits = 0, from the same sweep (B = 1, 16, 64 x L = 4k, 32k, 128k; Hq 32, Hkv 8, d 128;
# grid = B · Hkv · row blocks programs per split). Two needs, and the larger wins:
# - Fill: a grid with fewer programs than SMs leaves SMs idle, so split each (sequence, kv head) into
#   floor(SMs / programs) chunks: one program per SM, no second partial wave. B = 1: 16 splits (128 programs on
#   132 SMs); at L = 32k they took 55.9 us where the old rule's 33 splits (264 programs) took 68.5 us. One
#   program per SM can stream at full rate: B = 16, L = 128k ran 128 single-split programs at 4.42 TB/s.
# - Balance: a long cache in a full grid still leaves a tail (a few long programs per SM finishing at different
#   times), so cut it into chunks of about DECODE_BALANCE_BLOCKS blocks, at most DECODE_BALANCE_MAX_SPLITS.
#   B = 64 (512 programs): 8 splits gave 4.46 TB/s at L = 32k (512 blocks -> 64 per chunk) and 16 gave 4.54 at
#   128k (2048 blocks, capped at 16), against <= 4.41 for one split. Measured with the 64-key 2-stage tile; the
#   long-chunk tile (_DECODE_LONG, balance=False) streams as well unsplit (v19) and skips this need.
# Every chunk keeps at least DECODE_MIN_BLOCKS_PER_SPLIT blocks (B = 1, L = 4k: 8 splits of 4 128-key blocks took
# 18.0 us in v1; 16 splits of 4 64-key blocks 11.6 us at 3d9bcdd; a tile's ``min_blocks``, one for the short-cache
# tile, whose two programs per SM merge at once or as a tree), and there are never more than DECODE_MAX_SPLITS.
DECODE_BALANCE_BLOCKS = 64
DECODE_BALANCE_MAX_SPLITS = 16
DECODE_MAX_SPLITS = 128
INTERPRETER_SMS = 8  # a stand-in SM count for CPU tensors under the interpreter


def decode_num_splits(programs: int, max_seqlen_k: int, num_sms: int, block_n: int, balance: bool = True,
                      per_sm: int = 1, min_blocks: int = DECODE_MIN_BLOCKS_PER_SPLIT) -> int:
    """Key chunks per (sequence, kv head) for a grid of ``programs`` per split, keys up to ``max_seqlen_k``; without
    ``balance`` (the tile's ``DecodeConfig.balance``) only the fill need counts: ``per_sm`` programs per SM, chunks
    of at least ``min_blocks`` blocks (the tile's fields)."""
    blocks = -(-max_seqlen_k // block_n)
    fill = per_sm * num_sms // max(programs, 1)
    balance = min(DECODE_BALANCE_MAX_SPLITS, blocks // DECODE_BALANCE_BLOCKS) if balance else 1
    most = min(DECODE_MAX_SPLITS, blocks // min_blocks)
    return max(1, min(most, max(fill, balance)))


def decode_wave_splits(programs: int, max_seqlen_k: int, num_sms: int, splits: int) -> int:
    """The most split counts from ``splits`` up whose grid of ``programs`` a split, one program per SM, runs at most
    DECODE_MAX_WAVES waves and ends on a wave at least DECODE_LAST_WAVE full (or whole), over chunks of at least
    DECODE_WAVE_MIN_KEYS keys, and no more than DECODE_MAX_SPLITS; ``splits`` where none does (the long tile's rule,
    above)."""
    best, s = splits, splits
    while (s <= DECODE_MAX_SPLITS and programs * s <= DECODE_MAX_WAVES * num_sms
           and cdiv(max_seqlen_k, s) >= DECODE_WAVE_MIN_KEYS):
        last = programs * s % num_sms
        if last == 0 or last >= DECODE_LAST_WAVE * num_sms:
            best = s
        s += 1
    return best


def decode_splits(tile: DecodeConfig, programs: int, max_seqlen_k: int, num_sms: int, rows: int,
                  head_dim_v: int) -> int:
    """``tile``'s automatic split count: ``decode_num_splits`` by its fields, and for a tile of more than one program
    per SM, which merges at once, no more than that merge holds for ``rows`` packed rows a program (where it holds
    more than one), unless the merge may run as a tree (``merge_tree_node``) and its chunks would then pass
    DECODE_SHORT_MAX_KEYS (half that where its grid would leave most SMs idle, DECODE_TREE_SPARSE): then whole nodes
    of the tree (NOTES v37: where the capped chunks stay short an extra level lost, Hq 32 / Hkv 4, B = 1, L = 2k: 16
    splits 9.2 us, 32 in a tree 12.3; v38: 6.6 against 7.4 with the rows-first merge)."""
    splits = decode_num_splits(programs, max_seqlen_k, num_sms, tile.block_n, tile.balance, tile.per_sm,
                               tile.min_blocks)
    if tile.waves:
        splits = decode_wave_splits(programs, max_seqlen_k, num_sms, splits)
    held, node = merge_at_once_splits(rows, head_dim_v), merge_tree_node(rows, head_dim_v)
    if tile.per_sm > 1 and 1 < held < splits:
        sparse = programs * held * DECODE_TREE_SPARSE <= num_sms  # the capped grid would leave most SMs idle
        longest = DECODE_SHORT_MAX_KEYS // 2 if sparse else DECODE_SHORT_MAX_KEYS  # capped chunks past it: a tree
        if not (node and cdiv(max_seqlen_k, held) > longest):
            return held
        splits -= splits % held  # a tree of whole nodes
    if node and held < splits and programs * splits <= tile.per_sm * num_sms:
        return _tree_levels(splits, node, max_seqlen_k, tile.block_n)
    return splits


# A merge tree of ``node`` partials a node merges ``splits`` of them in ⌈log_node(splits)⌉ levels, one load and one
# atomic each on the launch's critical path (~2.3 us a level at d = 128: NOTES v39, Hq / Hkv 4 to 32 over one kv
# head). Where the largest split count of one level fewer (a power of the node) adds at most DECODE_TREE_LEVEL_KEYS
# keys to each chunk (chunks counted in whole key blocks, as the kernel cuts them), it takes that count (NOTES v39,
# graph-timed, one query token, 16-row blocks (DECODE_WIDE_ROWS): Hq 32 / Hkv 1, B = 1, L = 8k 128 splits (chunks of
# 64 keys, three levels) 10.5 us -> 64 (128 keys, two) 8.5; L = 128k 66 splits 32.4 -> 64 30.3; the A/B: Hq 32 /
# Hkv 2, B = 1, 8k 10.8 -> 8.9, 64k 26.8-27.3 -> 25.0-25.1). Cutting more keys than that lost where the chunks stay
# short (NOTES v38: Hq 8 / Hkv 1, B = 1, L = 4k 64 splits of 64 keys in two levels 7.1 against 16 of 256 at once
# 8.2).
DECODE_TREE_LEVEL_KEYS = 64


def _tree_levels(splits: int, node: int, max_seqlen_k: int, block_n: int) -> int:
    """``splits``, or the largest count of one merge-tree level fewer where that adds at most DECODE_TREE_LEVEL_KEYS
    keys to each chunk of whole ``block_n``-key blocks."""
    fewer = 1
    while fewer * node < splits:
        fewer *= node
    more = decode_chunk(max_seqlen_k, fewer, block_n) - decode_chunk(max_seqlen_k, splits, block_n)
    if fewer > 1 and more <= DECODE_TREE_LEVEL_KEYS:
        return fewer
    return splits


def decode_chunk(keys: int, splits: int, block_n: int) -> int:
    """The keys of one split's chunk as the decode kernel cuts ``keys`` keys into ``splits``: whole ``block_n``-key
    blocks."""
    return cdiv(cdiv(keys, splits), block_n) * block_n


# The merging split's one load of every partial (decode.py): split count and packed rows padded to powers of two,
# times the padded value dim, at most this many float32: 128 registers a thread at 4 warps. NOTES v36 raised it from
# 8192 (v19): B = 1, Hq 64 / Hkv 8, L = 4k, 16 splits of 8 rows 12.1 -> 11.4-11.6 us (causal calls there lost 11.0 ->
# 11.5), and the short tile's 32 splits of 4 rows. Measured at d = 128 only; other widths follow the same count.
MERGE_AT_ONCE_MAX_ELEMENTS = 16384


def merge_at_once_splits(rows: int, head_dim_v: int) -> int:
    """The most splits whose partials (``rows`` packed rows of ``head_dim_v``) the at-once merge holds: a power of
    two, or 0 where not even one fits."""
    fit = MERGE_AT_ONCE_MAX_ELEMENTS // (next_power_of_2(rows) * _padded(head_dim_v))
    return 1 << (fit.bit_length() - 1) if fit else 0


# Past one load, the merge runs as a tree of at-once loads (decode.py's _merge_tree) where a program holds at most
# this many packed rows (padded). NOTES v37 (.devrun/dec45b.py, graph-timed, d = 128, one query token; Hq / Hkv, B =
# 1, L: the library's choice -> the best tree, SDPA's default): 28 / 4, 8k 15.4 -> 10.9-11.1 (10.3); 8 / 1, 8k 14.9
# -> 12.5 (8.2); 8 / 2, 16k 14.4 -> 12.6-13.2 (9.9). A node of 16 or 32 rows then took ~10 us: the at-once load put
# the splits on the warps and summed them across warps through shared memory. With the rows leading the load (NOTES
# v38, benchmarks/ab_decode.py, causal calls) a tree of them pays: 32 / 1, 8k 20.6 (the loop, also with a limit of
# 16 rows, measured while the short tile's chunks were still held to 512 keys) -> 13.0 (128 splits in nodes of 4;
# SDPA 8.9); 32 / 2, 8k 15.6 -> 10.7 (nodes of 8; SDPA 8.9); the shapes of at most 8 rows the same with a limit of
# 8, 16 or 32. Measured for the short tile at d = 128 only: trees of 16-32 rows for the long and paged tiles, other
# head dims and Sq > 1 are tested, not timed.
MERGE_TREE_MAX_ROWS = 32


def merge_tree_node(rows: int, head_dim_v: int) -> int:
    """Partials a node of the merge tree holds for ``rows`` packed rows of ``head_dim_v`` (``merge_at_once_splits``),
    or 0 where no tree runs: more than MERGE_TREE_MAX_ROWS rows, or fewer than two partials a node."""
    held = merge_at_once_splits(rows, head_dim_v)
    return held if next_power_of_2(rows) <= MERGE_TREE_MAX_ROWS and held > 1 else 0
