"""Tile, warp and stage choices as data. Each entry carries the measured reason it was chosen. The decode kernel's
are in ``_decode_configs.py``."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ._launch import cdiv


@dataclass(frozen=True)
class FwdConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False  # K/V through tensor descriptors (the bulk copy engine) where strides allow
    warp_specialize: bool = False  # tl.range(warp_specialize=True) on the unmasked key loop (see the note below)
    heads_per_group: int = 1  # programs run longest-first across groups of this many (batch, kv head) columns
    pipeline: bool = False  # the unmasked key loop overlaps block j's softmax with block j-1's P·V (forward.py)
    gluon: bool = False  # the warp-specialized Hopper kernel (forward_sm90.py): block_m = 128 rows over two
    #                      warpgroups of num_warps = 4 (192 over three at d = 64), num_stages K/V stages filled by
    #                      a producer warp
    persistent: bool = False  # gluon only: one program per SM looping over the tiles
    q_stages: int = 1  # gluon only: Q buffers (2: the next tile's Q loads while this tile's blocks run)
    lazy_rescale: bool = False  # gluon only: rows keep their running max until a score passes it by 2^8, and O is
    #                             rescaled only in blocks where a row of the warpgroup took a new one
    early_p: bool = False  # gluon only: a block's P becomes wgmma's 16-bit A operand right after its softmax instead
    #                        of before its own P·V is issued (under the previous P·V where ptxas keeps that wait
    #                        below the softmax: forward_sm90's docstring)


# Interpreter runs (CPU tensors, TRITON_INTERPRET=1): bigger tiles mean fewer Python-level programs; stages and warps
# have no meaning there.
_INTERPRETER = FwdConfig(block_m=64, block_n=32, num_warps=4, num_stages=1)

# H200, bf16/fp16, keyed by padded head dim. benchmarks/sweep_fwd.py, 2026-11-29, bf16, peers' grid shapes:
# - d = 128, N = 4096: 64x64 w4 s3 with K/V through tensor descriptors (TMA) gave 519 non-causal / 470 causal
#   TFLOP/s; the best pointer-load tile gave 483 / 432 (128x128 w8 s3 / 64x64 w4 s3).
# - d = 64, N = 4096: the same TMA tile gave 440 / 399; the best pointer tiles 445 (64x64 w4) / 393 (128x64 w8).
# - d = 256 (second sweep, with TMA, medians of 3 round-robin passes): 64x64 w4 s3 TMA gives 400 / 531 causal and
#   482 / 515 non-causal at N = 2048 / 16384, against 342 / 470 and 442 / 486 for 128x32 w8 s3 with pointer loads;
#   at N = 512 the order flips (194 against 212 causal). Q plus three stages of K and V fill 224 KiB of the 227 KiB
#   of shared memory, so the variant flags (bias, ALiBi, dropout... need 241 KiB with all on) and loads without
#   descriptors take the 128x32 tile (see fwd_config). Every 128x64 or 64x128 tile runs out of shared memory.
# - tl.range(warp_specialize=True) fails to compile this kernel on sm_90 with triton 3.6 (NVGPUWarpSpecialization
#   pass asserts), so no entry uses it.
# - Causal, d = 128: programs run longest-first across groups of 4 (batch, kv head) columns (tile_order). Medians of
#   5 round-robin passes at N = 2048 / 4096 / 8192 / 16384: 408 / 450 / 469 / 475 TFLOP/s against 400 / 433 /
#   441 / 473 in the plain per-head order (groups of 2 and 8 fall between). At d = 64 and 256 (single passes) and
#   non-causal (every d) the grouping measured flat or slower (L2 holds fewer heads' K/V), so they keep the plain order.
_FWD_HALF = {
    16: FwdConfig(64, 64, 4, 3, tma=True),
    32: FwdConfig(64, 64, 4, 3, tma=True),
    64: FwdConfig(64, 64, 4, 3, tma=True),
    128: FwdConfig(64, 64, 4, 3, tma=True),
    256: FwdConfig(64, 64, 4, 3, tma=True),
}
_FWD_HALF_CAUSAL = {**_FWD_HALF, 128: FwdConfig(64, 64, 4, 3, tma=True, heads_per_group=4)}
# - Software-pipelined key loops (pipeline=True: block j's softmax beside block j-1's P·V; forward.py), medians of
#   3 round-robin passes in two runs, against the same tile without: N = 16384 gained at d = 128 (causal 490 / 507
#   vs 474 / 496, non-causal 499 / 504 vs 490 / 486) and d = 256 (causal 521 / 523 vs 503 / 504, non-causal 509 /
#   538 vs 512 / 512); N = 4096 was within noise either way (-2% .. +4%); N = 1024 lost 2-6% (the loop's first
#   iteration adds 0·V in place of a peeled block: one extra P·V per tile). d = 64 was flat at every N. So plain
#   launches at d = 128 and 256 pipeline from PIPELINE_MIN_KEYS keys on. Variant launches keep the plain loops
#   (the pipelined ones are tested with every variant through the interpreter, not timed on the GPU).
PIPELINE_MIN_KEYS = 16384
_FWD_LONG = {causal: {d: replace(cfg, pipeline=True) for d, cfg in table.items() if d in (128, 256)}
             for causal, table in ((False, _FWD_HALF), (True, _FWD_HALF_CAUSAL))}
# - The warp-specialized Gluon kernel (forward_sm90.py, session 18), TFLOP/s, bf16, 16 heads, B·N = 32k tokens:
#   - First run (.devrun/gfwd.py, two stages, against the Triton table's tile and sdpa-cudnn in one run), d = 128
#     non-causal N = 512 … 16384: 397 / 482 / 542 / 573 / 604 / 616 against 365 / 423 / 453 / 474 / 480 / 510
#     (cuDNN 502 / 530 / 580 / 599 / 608 / 611); causal 231 / 342 / 440 / 496 / 555 / 601 against 258 / 341 /
#     402 / 444 / 468 / 498 (cuDNN 342 / 398 / 471 / 527 / 552 / 577).
#   - Bench rows of 17eb37c (the bench's grid: B = 32 at N = 512): non-causal N = 512 read 317 against 367 for the
#     Triton tile at 8ebf3cf (the Gluon launch has no launch cache: its host path is the suspect, unmeasured).
#   - Tiles (.devrun/gsweep.py, N = 1024 / 4096 / 16384): three stages beat two at every d = 128 point (non-causal
#     492 / 577 / 618 against 477 / 574 / 617, causal 345 / 510 / 607 against 342 / 508 / 599); 64-key blocks lost
#     everywhere (444-541 non-causal). d = 64 with 128-key blocks and three stages: 348 / 435 / 460 non-causal and
#     232 / 374 / 449 causal against the Triton tile's 381 / 399 / 410 and 292 / 372 / 400.
#   So each head dim takes it from a sequence length per mask (WS_MIN_KEYS: non-causal, causal; both the query rows
#   and the keys, since only Sq = Sk was measured) where it led clearly; below, the 128-row tiles leave SMs idle (few
#   row tiles per head) and the Triton tiles keep the launch (they also pack a GQA group's rows, which short queries
#   need).
# - Persistent (session 19, .devrun/gsweep3.py, same grid, beside a GPU suite on the other GPU): one program per SM
#   looping over tiles (snake order: odd laps reversed) against one program per tile and the Triton tile, TFLOP/s.
#   Non-causal it won at every point: d = 128 N = 512 / 1024 / 2048 / 16384: 436 / 528 / 564 / 618 against 364 /
#   468 / 535 / 611 per tile and 364 / 427 / 458 / 511 Triton; d = 64: 332 / 393 / 426 / 459 against 223 / 335 /
#   392 / 457 and 315 / 366 / 389 / 414. So non-causal launches take it from N = 512 at both head dims.
#   Causal d = 128 N = 1024 / 2048 / 4096 / 8192 / 16384: persistent 308 / 397 / 451 / 513 / 557, per tile 297 / 379
#   / 471 / 508 / 587, Triton 347 / 405 / 452 / 476 / 502. Those per-tile numbers sat below the 2-D grid kernel's
#   rows of f0fdff6 (438 / 507 / 551 / 601 at 2048 / 4096 / 8192 / 16384): the 1-D grid had interleaved the heads'
#   row tiles (bottom tiles of every head first), so the K/V of many heads competed for L2. Head-major order (each
#   head's tiles adjacent, bottom first) restored them (.devrun/c4.sh): per tile 435 / 496 / 534 / 601 at 2048 /
#   4096 / 8192 / 16384 (Triton 432 / 451 / 476 / 524, cuDNN 487 / 527 / 546 / 574); persistent fell to 428 / 463 /
#   487 / 429 (cause not established). d = 64 causal N = 4096 / 16384: per tile 378 / 445, persistent 400 / 437,
#   Triton 380 / 402. So causal launches take one program per tile, from 2048 at d = 128 (the bench rows of f0fdff6
#   read 438 there for the same order on a 2-D grid, against 400 for the Triton tile in the rows of 7956468) and
#   16384 at d = 64 (session 20 below: persistent causal at shorter lengths, and d = 64 from 2048).
_WS_TILE = FwdConfig(128, 128, 4, 3, tma=True, gluon=True)
# - d = 256 (session 20, .devrun/gsweep256.py, 8 heads, B·N = 16k, beside the Triton tile and cuDNN in one run):
#   Q (64 KiB) and two stages of 64-key K/V blocks fill 192 KiB; 32-key blocks with three or four stages lost to it
#   everywhere (337-513 non-causal). 64-key blocks, N = 512 / 1024 / 2048 / 4096 / 16384: non-causal persistent
#   439 / 540 / 607 / 639 / 664 (per tile 402 / 514 / 594 / 635 / 659; Triton 327 / 422 / 466 / 492 / 544; cuDNN
#   511 / 601 / 648 / 675 / 683); causal per tile 250 / 371 / 461 / 538 / 667 (persistent 266 / 388 / 467 / 517 /
#   434; Triton 211 / 310 / 384 / 442 / 527; cuDNN 333 / 443 / 530 / 570 / 610). So both masks take it from 512,
#   persistent non-causal and one program per tile causal, as at d = 128. ptxas: 80-136 B of spills.
_WS_TILE_D256 = FwdConfig(128, 64, 4, 2, tma=True, gluon=True)
# - O by TMA (session 21, NOTES v13): the O staging buffers (a warpgroup's 64 rows by up to 128 columns) leave no
#   room for a third K/V stage at d = 128 (224 + 32 KiB). Two stages had read within the spread of three
#   (.devrun/gsweep8.py s2q1 against s3q1: 441-446 / 495-516 / 549-559 / 579-596 / 616-624 against 428-438 /
#   454-511 / 551-573 / 563-584 / 610-611 non-causal at N = 512 / 1024 / 2048 / 4096 / 16384), and with the TMA
#   store two stages read 493-503 / 547-562 / 596-599 / 629-630 at 512 / 1024 / 2048 / 16384 (.devrun/esweep.py).
_WS_TILE_D128 = replace(_WS_TILE, num_stages=2)
# - Causal, persistent against one program per tile on the bench grid (session 20, .devrun/gsweep4.py, two passes
#   each, TFLOP/s at N = 512 / 1024 / 2048 / 4096 / 8192):
#   - d = 64: persistent 179 / 285-288 / 352-353 / 396-399 / 419-426, per tile 142 / 221-225 / 306-307 / 368-374 /
#     409-411, Triton 210 / 288-289 / 337-339 / 363-373 / 388-391 (cuDNN 255 / 333 / 382 / 418 / 430); at 16384
#     (session 19) per tile 445, persistent 437.
#   - d = 128: persistent 229 / 340-343 / 423-425 / 468-471 / 479-491, per tile 207 / 320 / 418-423 / 489-497 /
#     539-545, Triton 245-248 / 338-341 / 396-406 / 444-445 / 466-467.
#   - d = 256: persistent 265-266 / 389-391 / 464-469 / 508-513 / 466-479, per tile 250-251 / 364-366 / 459-460 /
#     521-527 / 577-584, Triton 210 / 312 / 384-389 / 435-438 / 477-489.
#   A static persistent schedule loses where causal tiles are long and unequal; below that it hides each tile's
#   prologue and epilogue. So causal launches run persistent below WS_CAUSAL_PERSISTENT_BELOW rows and keys, one
#   program per tile from there, and d = 64 takes the Gluon kernel from 2048 (it led Triton there by 4-9 %; from
#   1024 since session 21, below).
# - Two Q buffers at d = 64 non-causal (session 25, .devrun/fsweepq2.py, two passes; v14 had read 378-379 against
#   369-370 at N = 512): N = 512 / 1024 / 2048 / 4096 375.5-377.5 / 418.8-421.3 / 421.8-427.5 / 450.6-451.2 against
#   365.7-366.7 / 411.2-413.8 / 428.7-449.3 / 440.5-446.9; causal lost (316.6-318.5 / 382.8-390.5 / 405.8-409.1
#   against 318.6-322 / 393.2-394 / 415.9-423.1 at 1024 / 2048 / 4096), so causal keeps one. (At 2048 one buffer's
#   two passes spread over 429-449 and two buffers read 422-428; the gain is at 512, 1024 and 4096.)
# - P as the A operand early (session 35, NOTES v27, .devrun/fab35.py, main against early_p at d = 128 and 256 and
#   at d = 64, alternating processes, two each, CUDA-graph TFLOP/s, B·N = 16k): d = 256 non-causal 4096 662-665
#   against 633-638, causal 602-605 against 600-607; d = 128 non-causal 1024 / 4096 / 16384 534-538 / 594-597 /
#   607-610 against 526-528 / 591-594 / 606-610, causal 428-431 / 557-560 / 610-613 against 423 / 556-559 /
#   609-612; d = 64 non-causal 2048 / 8192 427-430 / 445-449 against 430-431 / 447-451, causal 4096 408-411
#   against 413-416. ptxas spills fell at d = 128 (34 STL / 46 LDL -> 8 / 11) and rose at d = 64 (0 -> 4 / 4).
#   So d = 128 and 256 take it.
_WS_TILE_D128 = replace(_WS_TILE_D128, early_p=True)
_WS_TILE_D256 = replace(_WS_TILE_D256, early_p=True)
_FWD_WS = {False: {64: replace(_WS_TILE, persistent=True, q_stages=2), 128: replace(_WS_TILE_D128, persistent=True),
                   256: replace(_WS_TILE_D256, persistent=True)},
           True: {64: _WS_TILE, 128: _WS_TILE_D128, 256: _WS_TILE_D256}}
# - With O by TMA (session 21, .devrun/tsweep.py, two passes; persistent / per tile / Triton / cuDNN, causal, at
#   N = 512 / 1024 / 2048 / 4096 / 8192 / 16384):
#   - d = 128: 267 / 417-427 / 494-498 / 536 / 554-555 / 461-476, per tile 232 / 350-354 / 449-450 / 521-522 /
#     563-565 / 615-633, Triton 248 / 338-342 / 347-393 / 395-445 / 448-471 / 487-501 (cuDNN 325-329 / 412-418 /
#     477-484 / 517-540 / 538-547 / 556-559). So the Gluon kernel from 512, persistent below 8192.
#   - d = 64: 186-188 / 305 / 374-382 / 409-414 / 435-438 / 438-449, per tile 153 / 234 / 318 / 377-382 / 414-422 /
#     397-448, Triton 211 / 288-291 / 334-358 / 329-371 / 369-392 / 387-400. So from 1024; at 16384 the two
#     schedules' passes overlap, and the table keeps one program per tile there.
#   - d = 256: 308-309 / 458 / 509-510 / 541-543 / 484-492 / 445-449, per tile 293-295 / 406 / 492 / 553-558 /
#     584-591 / 651-652: persistent below 4096, as before.
#   Non-causal, persistent led or tied per tile at every length and head dim (d = 128: 500-510 / 556-559 / 592-593 /
#   603-605 / 612-614 / 612-613, cuDNN 490-508 / 553-562 / 585-594 / 599-605 / 606-609 / 611-618).
# - Tiles hand over and the program count balances the laps (session 22, NOTES v14, .devrun/fsweep.py, medians of
#   two passes, persistent against one program per tile, causal, N = 4096 / 8192 / 16384): d = 128 - / 579-592 /
#   601-607 against - / 552-561 / 601-602; d = 256 585-596 / 624-627 / 636-650 against 543-550 / 577-585 /
#   648; d = 64 at 16384 441-445 against 436-447. So d = 128 and 256 run causal persistent below 16384 too.
WS_MIN_KEYS = {64: (512, 1024), 128: (512, 512), 256: (512, 512)}
# - Calls the Gluon kernel could run with both lengths in WS_SHORT_KEYS (rows and keys from 512, below 1024) take
#   these tiles. Only there: a short chunk over a long cache was not measured; other launches (variants, no
#   descriptors, shorter) keep the table's tiles.
#   - Session 25 (.devrun/fsweeptri.py, two passes, d = 64 causal N = 512): the Triton 64x32 w4 s3 TMA tile read
#     219.5-220.1 against the table's 64x64 210.1-210.2 (64x64 s4 204-205, 128x64 w8 194, 64x128 164, 128x128 w8
#     135), and took d = 64 causal there.
#   - Session 29 (NOTES v21, .devrun/fsweep29b.py, CUDA-graph medians, two passes alternated with the tree before):
#     warpgroup 0 skips a tile's last block where its rows see none of it (forward_sm90_schedule._own_blocks), which
#     64-key blocks give every causal diagonal tile. Causal N = 512, the Gluon kernel at 64-key blocks, three stages,
#     persistent: d = 128 309-314 against the 128-key table tile's 298-300 (cuDNN 302-305); d = 64 231-234 against
#     the Triton tile's 210-212 (cuDNN 245-250). At N = 1024 the 128-key tiles led (d = 128 419-420 against
#     394-399; d = 64 322-323 against 292-297), so these stop below 1024.
#   - Session 33 (NOTES v25, .devrun/fsweep33.py, one process, two passes alternated, TFLOP/s under the bench's
#     cold-L2 do_bench | CUDA graph, causal N = 512): a second Q buffer (the next tile's Q lands under this one) at
#     d = 64 243-244 | 238-239 against the three-stage tile's 228-230 | 231-232 (four stages and two buffers
#     239-242 | 238-239; four or six stages alone 226-229 | 230-231; lazy rescaling 220-222; one program per tile
#     166-167; cuDNN 259-260 | 245); at d = 128 four stages and two buffers 331-333 | 309-310, two buffers 323-327
#     | 308-310, against 316-323 | 304-305 (cuDNN 323-325 | 301-303).
WS_SHORT_KEYS = (512, 1024)
_WS_CAUSAL_SHORT = FwdConfig(128, 64, 4, 3, tma=True, gluon=True, persistent=True, q_stages=2)
_FWD_WS_SHORT = {(64, True): _WS_CAUSAL_SHORT, (128, True): replace(_WS_CAUSAL_SHORT, num_stages=4)}
WS_CAUSAL_PERSISTENT_BELOW = {64: 16384, 128: 16384, 256: 16384}  # d = 64: _FWD_WS_WIDE takes over from 8192
# - Lazy rescale (session 31, NOTES v23, .devrun/fsweep31.py, the table's tile with lazy_rescale off / on, CUDA-graph
#   means, two passes each, TFLOP/s at N = 512 / 1024 / 2048 / 4096 / 8192 / 16384):
#   - d = 256 non-causal 490 / 561 / 603 / 627 / - / 642 -> 490 / 567 / 615 / 638 / - / 656; causal 351 / 460 / 539 /
#     589 / 616 / 631 -> 342 / 454 / 539 / 595 / 628 / 680;
#   - d = 128 causal 314 / 423 / 502 / 549 / 574 / 599 -> 305 / 422 / 504 / 560 / 592 / 613; non-causal lost 0.6-1.4 %
#     at every length (463 / 529 / 572 / 596 / - / 612 -> 459 / 523 / 565 / 589 / - / 609), d = 64 1.6-6 %.
#   The skipped rescale (64 · D float32 multiplies a warpgroup per block) pays for the warpgroup-wide test of the
#   rows' maxima (a cross-warp reduction) where D is large or the rows see many blocks. Keyed by (d, causal): keys.
#   (These readings also include where ptxas places the wait for the previous P·V: the lazy tiles keep it below the
#   softmax, the others have it hoisted above; NOTES v30.)
LAZY_RESCALE_FROM = {(128, True): 4096, (256, False): 1024, (256, True): 4096}
# - Three consumer warpgroups on 192-row tiles at d = 64 (session 36, NOTES v28, .devrun/tsweep36.py, one process,
#   two passes, TFLOP/s under the bench's cold-L2 do_bench | CUDA graph, B·N = 16k). v17's three warpgroups spilled
#   at 128-key blocks with P kept in float32 until its P·V; with early_p their key loop fits 160 registers without
#   spills (ptxas, CPU compile: none at all where Triton specialises the lengths as multiples of 16; otherwise 35
#   stores and 43 loads non-causal, all outside the key loop).
#   - Non-causal, persistent, three stages, two Q buffers, N = 512 / 1024 / 2048 / 4096 / 8192 / 16384: 355-358 |
#     339-340, 382-395 | 382-384, 448-450 | 440-441, 460-473 | 460-464, 489-493 | 487, 487-498 | 494 against the
#     table's 376-377 | 359-360, 406-428 | 400-401, 433-441 | 424-425, 449-455 | 438-441, 445-457 | 444, 451-455 |
#     444-445 (cuDNN 380-381 | 359-360, 414-416 | 401-403, 433-435 | 426-427, 443 | 441-443, 443 | 441-444,
#     442-444 | 446-447). Two or four stages, or one Q buffer, read the same or lower; lazy rescaling 10 % lower.
#     At 512 and 1024 a head's last 192-row tile holds 64 rows past Sq (1/9 of the rows computed).
#   - Causal, one program per tile, one Q buffer: 8192 444-455 | 444-447, 16384 470-477 | 471-472 against the
#     table's 435-463 | 431-432, 446-447 | 442-443 (cuDNN 422-425 | 421-422, 433-437 | 433); persistent 443-449
#     | 437-439 at 8192. At 4096 (persistent 424-428 | 413-423 against 420-443 | 408-412) the cold readings overlap,
#     and below it the table's tile led (2048: 367-369 | 358-359 against 392-393 | 376).
#   So d = 64 takes them from WS_WIDE_FROM rows and keys (per mask), before the rules above.
WS_WIDE_FROM = {(64, False): 2048, (64, True): 8192}
# - Sliding windows (session 41, NOTES v33, .devrun/win41.py: cold do_bench, two passes, causal window W at N = 16384,
#   B = 1, H = 2048 / d, band TFLOP/s against the Triton kernel's, which ran every window before): d = 128 W = 1024
#   persistent 466-470 (per tile 429-436, lazy 463-466) against 371-384; W = 128 137-138 against 123; W = 4096
#   persistent lazy 560-571 (per tile lazy 560-575, not lazy 537-553) against 443-461; N = 4096 W = 1024 387-388
#   against 339-340; d = 256 W = 1024 509-513 against 326. Second call (s41c.sh): d = 256 W = 128 persistent 174-176
#   against 104, W = 4096 per tile lazy 596-606 (persistent lazy 557-559) against 412-416; d = 64 W = 1024 the
#   128-row tile persistent 347-349 (per tile 295) against 294-325, W = 128 101-102 against 103-105; its 192-row
#   tile lost at W = 1024 (277-302). So windows take the Hopper kernel where the plain causal call would: at d = 128
#   and 256 at any span, at d = 64 from a 1024-key span on its 128-row tile; persistent below a 4096-key span; lazy
#   from LAZY_RESCALE_FROM (the causal calls' rule at the span's length). Only windows that leave a row fewer keys
#   than Sk: one with an unbounded side (left-only non-causal, whose bottom tiles are the short ones, or causal with
#   no left edge) was not measured and keeps the Triton kernel (the review of session 41).
WS_WINDOW_MIN_SPAN = {64: 1024, 128: 1, 256: 1}
# The backward's windows (right side 0) on the Hopper dK/dV kernel against the Triton backward, deterministic, device
# time alone (NOTES v35, bwin43b.py: B = 1, H = 2048 / d, causal, ms, N = 4096 | 16384): d = 64 W = 128 0.155 |
# 0.548-0.552 against 0.149 | 0.525, W = 256 0.174-0.175 | 0.628 against 0.179-0.181 | 0.646-0.648, W = 1024
# 0.275-0.276 | 1.056-1.061 against 0.361 | 1.375-1.377; d = 128 W = 128 0.107 | 0.366-0.367 against 0.133 | 0.473;
# d = 256 W = 128 0.131 | 0.449 against 0.152-0.154 | 0.533. So the Hopper kernel from a 256-key span at d = 64, at
# any span above. Only windows leaving a row fewer keys than Sk (others are causal calls: the plain table).
BWD_WS_WINDOW_MIN_SPAN = {64: 256, 128: 1, 256: 1}
WS_WINDOW_PERSISTENT_BELOW = 4096
_FWD_WS_WIDE = {False: FwdConfig(192, 128, 4, 3, tma=True, gluon=True, persistent=True, q_stages=2, early_p=True),
                True: FwdConfig(192, 128, 4, 3, tma=True, gluon=True, early_p=True)}
# - The split tail (session 52, NOTES v44). A non-causal persistent launch's tiles are equal, so where they are not
#   a whole number of laps the last lap leaves SMs idle: at the grid's shapes 2048 or 4096 tiles over 132 programs,
#   a 3 % tail. .devrun/tail52.py (cold | eager TFLOP/s, two rounds) against shapes of whole laps (more rows or
#   heads, the same keys): d = 128 N = 16384 690-691 | 608-615 -> 709 | 628-631 (16896 rows), N = 2048 646-647 |
#   573-574 -> 665-666 | 582-585 (132 heads, not 128), d = 256 N = 4096 749-750 | 647-653 -> 761 | 674-676 (4224
#   rows); cuDNN gained 0-2 % the same way (2-6 % at d = 256). So the last lap's tiles are cut into pieces of key blocks
#   (``tail_pieces``), whose float32 states a second launch merges (pieces.merge_pieces). The piece
#   count: counted in key blocks, a tile costing its blocks plus one (forward_sm90_schedule.programs' model), the
#   pieces' lap against a whole tile's, pieces of at least TAIL_MIN_PIECE_BLOCKS, where that saves TAIL_MIN_GAIN of the
#   launch. The model leaves out the pieces' stores and the merge (float32 states: 64 KiB a piece at d = 128, 128 at
#   d = 256), which the A/B (.devrun/tailab.py, one process, rule against one piece, two rounds, cold | eager) put
#   at 10-70 us: d = 128 N = 16384 687-689 | 620-621 -> 699 | 625-627, 8192 682-684 | 604-613 -> 692-695 | 621-623,
#   4096 675 | 601-603 -> 673-674 | 600-604, 2048 647 | 576-584 -> 636-637 | 565-571; d = 256 16384 770-771 |
#   687-691 -> 778-780 | 703-715, 8192 759-761 | 679-683 -> 758-761 | 689-691, 4096 736-737 | 661-665 -> 714 | 655;
#   d = 64 (192-row tiles) 4096 508 | 467 -> 517-518 | 465-466, 2048 478-480 | 430-446 -> 478-480 | 441-442. So
#   only from FWD_TAIL_MIN_KEYS keys (per head dim), where it gained or tied.
FWD_TAIL_MIN_KEYS = {64: 4096, 128: 8192, 256: 8192}
TAIL_MIN_PIECE_BLOCKS = 4
TAIL_MAX_PIECES = 8  # its float32 states: at most (programs - 1) · 8 tiles
TAIL_MIN_GAIN = 0.01


def tail_pieces(tiles: int, programs: int, blocks: int, overhead: int = 1) -> int:
    """Into how many pieces a non-causal persistent launch of ``tiles`` equal tiles of ``blocks`` blocks (the
    forward's key blocks, the backward's row tiles) over ``programs`` programs cuts each tile of its last, partial lap
    (``tiles % programs`` of them), a tile costing its blocks plus ``overhead`` (``programs``' models: 1 forward, 2
    backward): the count whose pieces' lap costs least, or 1 (no split) where there is no partial lap after a whole
    one or it gains too little. (The key minimum, FWD_TAIL_MIN_KEYS or BWD_TAIL_MIN_KEYS, is the caller's to check:
    ``forward_sm90.launch``, ``backward_sm90.launch_dkdv``.)"""
    laps, rest = divmod(tiles, programs)
    if laps == 0 or rest == 0:
        return 1
    best, best_cost = 1, blocks + overhead
    for pieces in range(2, min(TAIL_MAX_PIECES, blocks // TAIL_MIN_PIECE_BLOCKS) + 1):
        cost = cdiv(rest * pieces, programs) * (cdiv(blocks, pieces) + overhead)
        if cost < best_cost:
            best, best_cost = pieces, cost
    whole = (laps + 1) * (blocks + overhead)
    return best if laps * (blocks + overhead) + best_cost <= (1 - TAIL_MIN_GAIN) * whole else 1


_FWD_D256_SMALL = FwdConfig(128, 32, 8, 3)  # d = 256 with variants, without descriptors, or with Sq <= 512 where the
#                                              Gluon kernel does not take the call (above)

# fp32 tiles take twice the shared memory and run as ieee fp32 (exactness before speed): smaller tiles.
_FWD_FP32 = {
    16: FwdConfig(64, 32, 4, 2),
    32: FwdConfig(64, 32, 4, 2),
    64: FwdConfig(64, 32, 4, 2),
    128: FwdConfig(64, 32, 4, 2),
    256: FwdConfig(32, 32, 4, 1),
}


def _padded(d: int) -> int:
    p = 16
    while p < d:
        p *= 2
    return p


def fwd_config(head_dim: int, head_dim_v: int, dtype: torch.dtype, causal: bool, device_type: str, *,
               seqlen_q: int | None = None, seqlen_k: int | None = None, variants: bool = False,
               tma_ok: bool = True, ws_ok: bool = False, hopper: bool = False, window: int = 0) -> FwdConfig:
    """The tile for a launch. ``seqlen_q``/``seqlen_k``: query rows / keys per sequence (None: unknown); ``variants``:
    any score variant flag is on; ``tma_ok``: K and V can go through tensor descriptors (aligned strides, not packed
    varlen); ``ws_ok``: the warp-specialized Hopper kernel can run this launch (``forward.ws_ok``); ``hopper``: the
    variants are a sliding window and/or sinks only (``Mods.window_sinks_only``), which that kernel runs as well;
    ``window``: the keys a row's window spans (at most Sk), else 0. The Hopper kernel runs windows as causal launches,
    from ``WS_WINDOW_MIN_SPAN`` keys to fewer than Sk (``_window_tile``), and sinks as the plain call's tile would."""
    if device_type != "cuda":
        return _INTERPRETER
    padded = _padded(max(head_dim, head_dim_v))
    if dtype == torch.float32:
        return _FWD_FP32[padded]
    ws = None
    windowed = WS_WINDOW_MIN_SPAN.get(head_dim, window + 1) <= window < (seqlen_k or 0)
    if ws_ok and head_dim == head_dim_v and (not variants or (hopper and (windowed or not window))):
        ws = _ws_config(head_dim, causal or windowed, seqlen_q, seqlen_k)
        if ws is not None and windowed:
            ws = _window_tile(ws, head_dim, window)
    return ws or _triton_config(padded, causal, seqlen_q, seqlen_k, variants, tma_ok)


def _window_tile(ws: FwdConfig, head_dim: int, span: int) -> FwdConfig:
    """A window's tile: every tile spans about the window's ``span`` keys, so the 128-row tile (d = 64's 192-row one
    lost), persistent below ``WS_WINDOW_PERSISTENT_BELOW``, lazy as a causal call of that length rescales."""
    if ws.block_m != 128:
        ws = _FWD_WS[True][head_dim]
    lazy_from = LAZY_RESCALE_FROM.get((head_dim, True), span + 1)
    return replace(ws, persistent=span < WS_WINDOW_PERSISTENT_BELOW, lazy_rescale=span >= lazy_from)


def _ws_config(head_dim: int, causal: bool, seqlen_q: int | None, seqlen_k: int | None) -> FwdConfig | None:
    """The Hopper kernel's tile for these lengths, or None where the Triton kernel runs (``fwd_config``)."""
    ws = _FWD_WS[causal].get(head_dim)
    if ws is None:
        return None
    shortest, longest = min(seqlen_q or 0, seqlen_k or 0), max(seqlen_q or 0, seqlen_k or 0)
    if WS_SHORT_KEYS[0] <= shortest and longest < WS_SHORT_KEYS[1] and (head_dim, causal) in _FWD_WS_SHORT:
        return _FWD_WS_SHORT[head_dim, causal]
    if shortest >= WS_WIDE_FROM.get((head_dim, causal), shortest + 1):
        return _FWD_WS_WIDE[causal]
    if shortest >= WS_MIN_KEYS[head_dim][causal]:
        if causal and shortest < WS_CAUSAL_PERSISTENT_BELOW[head_dim]:
            ws = replace(ws, persistent=True)
        lazy_from = LAZY_RESCALE_FROM.get((head_dim, causal))
        if lazy_from is not None and seqlen_k >= lazy_from:
            ws = replace(ws, lazy_rescale=True)
        return ws
    return None


def _triton_config(padded: int, causal: bool, seqlen_q: int | None, seqlen_k: int | None, variants: bool,
                   tma_ok: bool) -> FwdConfig:
    """The Triton kernel's tile (``fwd_config``)."""
    if padded == 256 and (variants or not tma_ok or (seqlen_q is not None and seqlen_q <= 512)):
        return _FWD_D256_SMALL
    if padded in _FWD_LONG[causal] and not variants and seqlen_k is not None and seqlen_k >= PIPELINE_MIN_KEYS:
        return _FWD_LONG[causal][padded]
    return (_FWD_HALF_CAUSAL if causal else _FWD_HALF)[padded]


@dataclass(frozen=True)
class BwdTile:
    block_m: int  # packed query rows per tile
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int
    tma: bool = False  # the streamed operands (Q, dO for dK/dV; K, V for dQ) through tensor descriptors
    split_scores: bool = False  # dK/dV only: score tiles split across warpgroups (backward.py, SPLIT_SCORES)
    gluon: bool = False  # dK/dV only: the warp-specialized Hopper kernel (backward_sm90.py): block_n = 128 keys over
    #                      two 4-warp warpgroups at d = 64/128 (at d = 256: 64 keys shared by both, each with half
    #                      of dK's and dV's columns), block_m = 64-row tiles of one head (or 128 at d = 64),
    #                      num_stages Q/dO stages
    fused_dq: bool = False  # gluon only: that kernel also adds dQ (TMA reduce-adds into float32, in no fixed order:
    #                         not deterministic, unless dq_ordered), and no dQ kernel runs
    dq_ordered: bool = False  # fused_dq only: the adds go in a fixed order (per-tile counters, a writer warp), so dQ
    #                           is deterministic; needs every key block of a (batch, kv head) resident at once
    last_block_first: bool = False  # dq_ordered only: causal programs launch from the last key block (block 0 last)
    early_dv: bool = False  # gluon at d = 64/128 only: per row tile Sᵀ is waited for alone and dV's product issued
    #                         before dPᵀ is waited for (the same products in the same order: the same bits)
    persistent: bool = False  # gluon only, not dq_ordered: up to one program per SM, each over key blocks (the
    #                           next block's loads run under the last one's dK/dV epilogue)


@dataclass(frozen=True)
class BwdConfig:
    dkdv: BwdTile  # a program owns block_n keys and loops over tiles of block_m rows
    dq: BwdTile  # a program owns block_m rows and loops over tiles of block_n keys


_BWD_INTERPRETER = BwdConfig(BwdTile(32, 32, 4, 1), BwdTile(32, 32, 4, 1))

# H200, bf16, keyed by padded head dim. benchmarks/sweep_bwd.py, 2026-11-29, peers' grid at N = 2048 and 8192, each
# kernel swept with the other held (TFLOP/s of the whole backward, counted as 2.5x the forward's FLOPs):
# - d <= 64: dK/dV 32x128 w4 s3 TMA (330-359 non-causal, 269-320 causal) over 64x64 w4 s3 TMA (327-351);
#   dQ 64x64 w4 s3 TMA (310-322 / 276-316). Together: 343-352 non-causal, 282-323 causal.
# - d = 128: dK/dV 64x64 w4 s2 with pointer loads (233-252 non-causal); the TMA variant of the same tile led causal
#   (209-241 against 194-228) but made ptxas crash (exit -11) when compiled non-causal, at d = 64 too, as did every
#   TMA tile with 2 stages; so no non-causal entry uses TMA with 2 stages. dQ 128x64 w8 s3 TMA led every shape.
#   Together: 368-378 non-causal, 344-384 causal. v8: 8-warp split_scores tiles (64x64, 128x64 dK/dV; 64x64,
#   64x128 dQ) lost to these at N = 1024 and 8192 (dK/dV 201-339 against 237-418).
# - d = 256, first sweep: dK/dV 32x32 w4 s2 TMA (108-123), dQ 64x32 w4 s2 TMA (131-145); together 146-167, below
#   sdpa-flash (229-259). The 32-key dK/dV tile ran on mma.sync (sm_90 SASS: HMMA, 424 B of spills): wgmma needs
#   64 keys, and 64 keys' dK and dV accumulators need 8 warps, with which Triton computed every score tile twice.
#   Second sweep (v8, N = 1024 / 2048 / 8192): dK/dV 64x64 w8 s2 with pointer loads and split_scores (each warpgroup
#   half of the score tile, backward.py) led every shape: whole backward 275 / 309 / 317 non-causal and 202 / 243 /
#   299 causal, against 164 / 164 for the old table at N = 8192 (without split_scores the same tile gave 200-267).
#   Its TMA form makes ptxas crash (exit -11) non-causal and was no faster causal (291 vs 296). dQ 64x32 w4 s3 TMA
#   beat 64x64 w4 s2 and every 8-warp split tile (64x64, 64x128, 64x32: 255-287 against 318 at N = 8192).
_BWD_CUDA = {
    16: BwdConfig(BwdTile(32, 128, 4, 3, True), BwdTile(64, 64, 4, 3, True)),
    32: BwdConfig(BwdTile(32, 128, 4, 3, True), BwdTile(64, 64, 4, 3, True)),
    64: BwdConfig(BwdTile(32, 128, 4, 3, True), BwdTile(64, 64, 4, 3, True)),
    128: BwdConfig(BwdTile(64, 64, 4, 2), BwdTile(128, 64, 8, 3, True)),
    256: BwdConfig(BwdTile(64, 64, 8, 2, split_scores=True), BwdTile(64, 32, 4, 3, True)),
}
# - Causal d = 128 (v9, sweep_bwd.py --causal 1 at N = 2048 / 8192 / 16384, dQ held at the table's): the TMA form of
#   the dK/dV tile gave 343 / 399 / 422 against 314 / 374 / 395 with pointer loads; the sliding window 1024 at
#   N = 16384 (sweep_bwd.py --window) 283 against 246. Causal kernels compile with it: the ptxas crash above is
#   non-causal only (plain; non-causal windows were not swept), and on the CPU machine every causal combination of
#   dtype (bf16, fp16), GQA group (1, 2, 4, 8) and variant (plain, window, softcap, ALiBi, bias, sinks, dropout,
#   window + softcap + sinks) compiled for sm_90 with it (NOTES v9). So causal launches take it.
_BWD_CUDA_CAUSAL = {**_BWD_CUDA, 128: replace(_BWD_CUDA[128], dkdv=replace(_BWD_CUDA[128].dkdv, tma=True))}

# fp32 (ieee dots): half the elements per byte of shared memory, so smaller tiles; exactness, not speed, is the aim.
_BWD_FP32_SMALL = BwdConfig(BwdTile(32, 32, 4, 1), BwdTile(32, 32, 4, 1))
_BWD_FP32_D256 = BwdConfig(BwdTile(16, 16, 4, 1), BwdTile(16, 16, 4, 1))


# - The warp-specialized Gluon dK/dV kernel (backward_sm90.py, session 19) beside the table's dQ kernel, for plain
#   half-precision d = 64 / 128 launches on sm_90 (``ws_ok``; d = 256 since session 20, below); two Q/dO stages of 64 rows. Whole backward, TFLOP/s,
#   bf16, B·N = 16k tokens (.devrun/bsweep.py, bsweep2.py), against the Triton dK/dV tile:
#   - non-causal d = 128 N = 512 / 1024 / 2048 / 4096 / 16384: 285 / 357-366 / 410 / 431 / 461 against 270 / 333-335
#     / 368 / 388 / 398; d = 64: 273 / 329-334 / 363 / 390 / 405 against 269 / 313-317 / 334 / 357 / 362;
#   - causal d = 128 N = 512 / 1024 / 2048 / 4096 / 16384: 179 / 261-262 / 328 / 376 / 448 against 194 / 267-273 /
#     331 / 371 / 423; d = 64: 167 / 240-241 / 296 / 337 / 382 against 172 / 234-235 / 279 / 318 / 349.
#   So it runs from BWD_WS_MIN_KEYS (non-causal, causal; rows and keys, as the forward's) where it led.
#   The profile at d = 128 N = 16384 non-causal: dK/dV 6.41 ms (4 of the 7 matmuls: about 690 TFLOP/s executed),
#   dQ 4.99 ms (3 of 7: about 660): each near the matmul ceiling; what is left is the recomputed QKᵀ and dO·Vᵀ.
# - d = 256 (session 20, .devrun/bsweep256.py, 8 heads, B·N = 16k): two [64, 256] float32 accumulators do not fit a
#   warpgroup, so both warpgroups take the same 64 keys and half of dK's and dV's columns each; per row tile each
#   computes Sᵀ and dPᵀ for half the rows and they swap Pᵀ and dSᵀ halves through shared memory (_consumer_split).
#   Two Q/dO stages (214 KiB of shared memory, no spills non-causal). Whole backward beside the table's dQ kernel,
#   N = 512 / 1024 / 2048 / 4096 / 8192 / 16384: non-causal 247 / 308 / 337 / 367 / 368 / 381 against the Triton
#   dK/dV tile's 224 / 274 / 305 / 317 / 317 / 315 (cuDNN 239 / 299 / 356 / 366 / 356 / 357); causal 168 / 236 /
#   292 / 317 / 353 / 366 against 154 / 204 / 242 / 269 / 294 / 300 (cuDNN 179 / 247 / 304 / 344 / 384 / 382); dK
#   and dV bitwise equal to the Triton tile's. One stage lost (213-318). The dK/dV kernel took 3.78 ms against 5.50
#   at N = 8192 non-causal (about 580 TFLOP/s executed). So it runs from 512 at d = 256, both masks.
# - d = 64 on 128-row tiles (session 23, NOTES v15; .devrun/bsweep10.py, two passes, dK/dV stored from registers
#   against TMA stores on 64-row tiles), whole backward, N = 1024 / 2048 / 4096 / 8192 / 16384:
#   - fused dQ, non-causal 337 / 394-397 / 434-436 / 457 / 449-468 against 334-337 / 384 / 413-414 / 429-433 /
#     440-442; causal 240-242 / 328-329 / 395-398 / 441-443 / 473-474 against 237-238 / 303-304 / 354 / 388-391 /
#     416-419;
#   - beside the Triton dQ, non-causal 331-340 / 371 / 392-395 / 406-407 / 411-418 against 340-347 / 368-373 /
#     390-398 / 400-401 / 399-402; causal 256-259 / 320-322 / 361-365 / 395-400 / 418-423 against 254 / 306-310 /
#     346-349 / 370-376 / 387-389.
#   dK and dV came out bitwise equal to the 64-row tiles' (dQ within float32 summation order). A tile's fixed costs
#   (barriers, statistics, the dS hand-over) weigh half as much against twice the matmul work; the registers fit
#   at d = 64 only (ptxas: 232-252 bytes of spills with the fused dQ, none without). The ordered dQ
#   (.devrun/bsweep11.py, beside GPU tests on the other GPU), 128 rows against 64, last block first: non-causal
#   N = 1024 / 2048 / 4096 / 8192 / 16384 312-313 / 370 / 410-412 / 434-437 / 435-438 against 301-302 / 354-355 /
#   378-385 / 379-399 / 394-406; causal 215 / 296-297 / 358-359 / 404 / 425-428 against 223 / 297-298 / 352 /
#   385-386 / 359-403 (block 0 first on 128 rows: 214 / 276-291 / 326-355 / 362-372 / 351-364). Without a fused
#   dQ, 128 rows lost at short N (non-causal 512 / 1024: 264-268 / 312-326 in that run against 279-280 / 333-347 on
#   64 rows in others), so only the fused dQ's tiles take them (BWD_FUSED_DQ_ROWS).
_BWD_WS_DKDV = {64: BwdTile(64, 128, 4, 2, tma=True, gluon=True), 128: BwdTile(64, 128, 4, 2, tma=True, gluon=True),
                256: BwdTile(64, 64, 4, 2, tma=True, gluon=True)}
BWD_FUSED_DQ_ROWS = {64: 128, 128: 64}  # the row tiles of the Gluon dK/dV tiles that fuse dQ (ordered or not)
#   Session 23 (.devrun/bsweep9.py, two passes, with the TMA stores of NOTES v14), causal N = 512: d = 64 180-182
#   against the Triton tile's 172, d = 128 197-198 against 193-194; at causal 1024 d = 128 274-278 against 267-270. So
#   from 512 at every head dim, both masks.
BWD_WS_MIN_KEYS = {64: (512, 512), 128: (512, 512), 256: (512, 512)}
# - The Triton dQ tile beside the Gluon dK/dV kernel at d = 256 (session 25, .devrun/bsweep256dq.py, two passes, whole
#   backward, N = 512 / 1024 / 2048 / 4096 / 8192 / 16384): 128x32 w8 s3 TMA read causal 172.5 / 239.5-239.7 /
#   296-301 / 327-328 / 365-367 / 379-386 and non-causal 263-265 / 329 / 346-361 / 383-385 / 388-395 / 398-402
#   against the table's 64x32 w4 s3 TMA at 169 / 234 / 289-291 / 318-324 / 352-353 / 365-366 and 243-246 / 309-310 /
#   336-341 / 362-373 / 365-368 / 377-384 (+2-8 %); dq bitwise equal (the key loop adds the same 16-key products in
#   the same order). 64x64 w4 s2 and 128x32 w8 s2 fell between or below. Only this route takes it: the variant
#   launches keep the table's tile, whose shared memory they were sized for.
_BWD_WS_DQ = {256: BwdTile(128, 32, 8, 3, tma=True)}
# - dQ fused into the Gluon dK/dV kernel (session 20, branch ws-fused-dq v3; the NOTES' v12): per row tile each
#   warpgroup computes dQ's half of the columns from both warpgroups' dSᵀ (shared memory) one row tile behind, and
#   adds it into a float32 accumulator by TMA reduce-add; no dQ kernel, so no recomputed QKᵀ and dO·Vᵀ (5 matmuls,
#   not 7). Whole backward, bf16, B·N = 16k, fused against Gluon dK/dV + Triton dQ (.devrun/bsweep3.py):
#   - d = 128 non-causal N = 1024 / 4096 / 16384: 352 / 464 / 503 against 362 / 432 / 455; causal 244 / 405 / 488
#     against 262 / 382 / 443;
#   - d = 64 non-causal 290 / 372 / 407 against 325 / 384 / 398; causal 201 / 317 / 383 against 240 / 334 / 379.
#   - With the accumulator in dq's own layout (ea5ca0f: the final scaling no longer copies through a transpose,
#     124 -> 67-74 us at N = 16384), d = 128 N = 1024 / 2048 / 4096 / 16384: non-causal 374 / 437 / 461 / 497
#     against 360 / 401 / 424 / 455, causal 270 / 353 / 414 / 497 against 262 / 328 / 371 / 442; d = 64 N = 1024 /
#     4096 / 16384: non-causal 308 / 383 / 407 against 330 / 384 / 394, causal 218 / 328 / 389 against 238 / 335 /
#     375.
#   The reduce order varies run to run, so only launches that allow it (``deterministic=False`` and torch's
#   deterministic mode off) take it, where it led: d = 128 from 1024 rows and keys non-causal and 2048 causal (at
#   causal 1024 it tied the Triton dK/dV tile that runs there otherwise: bench 265-268 against 267-271), d = 64 from
#   16384 (both masks); then also below BWD_WS_MIN_KEYS, where the Triton dK/dV tile ran otherwise (the session 23
#   lengths below replace these). v2 (atomics in place of the TMA reduces) lost everywhere (d = 128 N = 16384: 444
#   against 462).
#   Session 23 (.devrun/bsweep7.py, two passes), d = 64 causal N = 1024 / 2048 / 4096 / 8192 / 16384: fused 237-239 /
#   304-305 / 355-357 / 389-391 / 416-417 against Gluon dK/dV + Triton dQ 252-254 / 305-311 / 343-350 / 368-376 /
#   384-389; so d = 64 causal from 4096. Non-causal (.devrun/bsweep8.py) N = 1024 / 2048 / 4096 / 8192 / 16384:
#   fused 332-335 / 381-382 / 401-406 / 426-427 / 432-435 against 336-344 / 368 / 377-382 / 388-390 / 391-396;
#   so d = 64 non-causal from 2048. And d = 128 (.devrun/bsweep9.py) at N = 512 / 1024: causal 206-207 / 296-303
#   against the table's Triton dK/dV tile 193-194 / 267-270; non-causal 310-313 / 390-391 against Gluon dK/dV's 303-308
#   / 364-372: from 512 at d = 128. d = 64 on 128-row tiles (BWD_FUSED_DQ_ROWS; .devrun/bsweep10.py): causal 2048
#   328-329 against Gluon dK/dV + Triton dQ's 306-310 (64 rows): from 2048 at both masks.
#   Session 24 (NOTES v16; the ordered tile's first add stores, so its accumulator needs no zeroing, and a Triton
#   kernel scales dQ): at d = 128 the ordered tile now leads the unordered one (.devrun/bsweep12.py, two passes,
#   N = 512 / 1024 / 2048 / 8192): non-causal 336.6 / 409-414 / 462-464 / 507-509 against 319.2 / 399-400 /
#   442-452 / 500-501, causal 223.4 / 324-325 / 403-406 / 505-506 against 213 / 314-316 / 395-398 / 499-501; at
#   16384 (rows of 796ccf3) non-causal 525 against 517, causal 502 against 540. The table still gives calls that
#   allow any order the unordered tile (5a74f7e routed them to the ordered one below 16384; reverted, because its
#   programs wait on each other and deterministic=False is the documented way around those waits, docs/limitations.md).
#   Session 37 (NOTES v29; d = 64's 128-row tiles split dQ by rows, backward_sm90_dq.dq_part_rows; .devrun/bab37.py, one
#   process a route, whole backward, cold do_bench TFLOP/s, three readings): non-causal 1024 fused 346-352 against
#   the table's Gluon dK/dV + Triton dQ 330-331 (512: 274-275 against 284-289). So d = 64 non-causal from 1024.
BWD_FUSED_DQ_MIN_KEYS = {64: (1024, 2048), 128: (512, 512)}
# - The ordered fused dQ (session 21, NOTES v13): the same kernel with a writer warp that adds each dQ tile after the
#   adds that precede it in a fixed order (per-tile counters), so dQ is bitwise reproducible and deterministic calls
#   can take it. Non-causal key blocks start their row tiles spread apart (a tile's adds come steps apart); causal
#   programs then launched last key block first (session 23: per head dim, below). Whole backward against Gluon
#   dK/dV + Triton dQ (.devrun/bsweep5.py, two passes, cuDNN in the same run), d = 128:
#   - non-causal N = 1024 / 2048 / 4096 / 16384: 361-363 / 422-424 / 465-467 / 455-463 against 351-364 / 401-403 /
#     427-428 / 439-456 (with launch order instead of spread starts: 271-273 / 306 / 343 / 454-462);
#   - causal N = 1024 / 2048 / 4096 / 8192 / 16384 (launch order, reversed): 222-224 / 291 / 353-354 / 423 / 483-489
#     against 260-263 / 327-334 / 374-381 / 411-414 / 442 (without the reversal: 211 / 255 / 277 / - / 191).
#   - d = 64: non-causal lost (spread starts 293 / 389-391 / 302 at N = 1024 / 4096 / 16384 against 321-330 /
#     383-389 / 398-403); causal led at 16384 only (398-401 against 376).
#   The unordered fused tile stays ahead (d = 128 non-causal 16384: 520-523): the ordered adds wait on each other.
# - Session 22 (NOTES v14; the writer raises a tile's counter once its adds land; dK/dV by TMA stores), d = 128,
#   causal N = 2048 / 4096 / 8192 / 16384: ordered 367-372 / 425-428 / 461 / 480-486 against Gluon dK/dV + Triton
#   dQ 338-344 / 383-389 / 417-420 / 423-445 (fused, unordered: 395-399 / 452-454 / 497-504 / 530-532). So causal
#   from 2048 too.
#   So deterministic calls take it from these lengths (None: never).
# - Session 23 (NOTES v15): causal launch order. Each (batch, kv head)'s programs launched last key block first
#   (adds wait only on programs launched earlier) against block 0 first (as the unordered tile; adds may wait on
#   programs launched later, all resident), .devrun/bsweep7.py, one GPU, two passes, causal N = 1024 / 2048 / 4096
#   / 8192 / 16384:
#   - d = 128, block 0 first: 281 / 376-379 / 437-445 / 483-487 / 497-499 against last first 283 / 362-371 /
#     419-420 / 465-469 / 486-488 (the default route, Gluon dK/dV + Triton dQ: 279-282 / 339-350 / 383-392 /
#     417-424 / 437-448);
#   - d = 64, last first: 221-222 / 295 / 353 / 393 / 409-412 against block 0 first 218-219 / 289 / 347 / 382-385
#     / 387 (the default route: 252-254 / 305-311 / 343-350 / 368-376 / 384-389).
#   So d = 64 keeps the last-first launch and takes the ordered tile from causal 4096 (was 16384). And d = 64
#   non-causal (.devrun/bsweep8.py, the writer as of session 22), ordered N = 1024 / 2048 / 4096 / 8192 / 16384:
#   303-305 / 359 / 394 / 415-416 / 424-427 against the default route's 336-344 / 368 / 377-382 / 388-390 / 391-396:
#   from 4096 (it had lost in session 21, before the eager writer). d = 128 at N = 1024 (.devrun/bsweep9.py):
#   ordered 390-392 non-causal and 282-283 causal against Gluon dK/dV + Triton dQ 364-372 / 274-278 (at 512: 302-304
#   / 188 against 303-308 / 197-198): from 1024. d = 64 on 128-row tiles (above _BWD_WS_DKDV): non-causal from 2048
#   (370 against Gluon dK/dV + Triton dQ's 358 in the same run), causal from 4096 (358-359 against 352-356).
# - Session 24 (first adds stored, dQ scaled by a Triton kernel; .devrun/bsweep12.py, the numbers above): at N = 512
#   the ordered tile leads Gluon dK/dV + Triton dQ (304-305 / 193-194): d = 128 from 512. d = 64 keeps its lengths (ordered 325 against 332-335 at non-causal 1024, 309
#   against 300-308 at causal 2048).
#   Session 37 (as for BWD_FUSED_DQ_MIN_KEYS above), d = 64, ordered against the table's route: non-causal 1024
#   344-356 against 285-330, causal 2048 316-322 against 288-307 (causal 1024: 234-235 against 261; non-causal 512
#   259-260 against 285-289). So non-causal from 1024, causal from 2048.
BWD_ORDERED_DQ_MIN_KEYS = {64: (1024, 2048), 128: (512, 512)}
BWD_ORDERED_LAST_BLOCK_FIRST = {64: True, 128: False}
# - early_dv on the fused tiles (session 26, NOTES v18; .devrun/bsweep26.py, three passes alternated with main, whole
#   backward through the table, TFLOP/s at N = 1024 / 4096 / 16384), d = 128 non-causal: ordered 425-429 / 515-521 /
#   537-540 against 416-422 / 502 / 524-526, unordered 416-419 / 511-512 / 531-543 against 406-407 / 486-491 /
#   517-519; causal (also N = 2048 / 8192 / 16384 in a later call, two passes) tied at 2048 and lost at 1024, 4096
#   and 8192 (ordered 312-321 / 453-463 / 491-501 against 318-327 / 473-485 / 510-522; unordered 307-308 / 450 /
#   489 against 317 / 459-464 / 500-501) and gained at 16384 (ordered 505-513 against 496-500). d = 64 non-causal: the plain
#   64-row tile lost at 1024 (326-330 against 341-347), the 128-row fused ones tied at 4096 (ordered 432-439 against
#   431-433, unordered 442-447 against 437-441). Per head dim, (non-causal, causal); the plain tiles keep the order.
BWD_EARLY_DV = {64: (False, False), 128: (True, False)}
# - Persistent dK/dV grids (session 30, NOTES v22; .devrun/bsweep30.py, whole backward through the table, graph-timed,
#   two passes alternated with the tree before, TFLOP/s at N = 512 / 1024 / 2048 / 8192, B·N = 16k, H = 2048 / d).
#   Up to one program per SM, each over key blocks in the forward's snake order (backward_sm90_schedule.programs), the
#   next block's Q/dO under the last one's epilogue. d = 128's unordered fused tile, non-causal 315-316 / 394-399 /
#   454-461 / 511-519 -> 325-328 / 410 / 469 / 527-530, causal 202-203 / 289-291 / 373-375 / 467-471 -> 207-208 /
#   301-302 / 388-389 / 491-493; d = 64's plain tile non-causal 270-274 / 322-327 -> 278-280 / 326-328, causal 182-185
#   / 249-252 -> 189-191 / 253-257. d = 256 within 1 % either way (-1 % causal 8192); d = 64's fused 128-row tiles
#   lost non-causal (2048 / 8192: 385-390 / 437-451 -> 353-354 / 388-392) and tied or won causal: neither takes it.
#   (Before the snake order and its program count, plain laps lost 5-25 % causal at d = 128 and 256 from 1024: the
#   laps' first programs took every lap's longest block.) Ordered tiles cannot (their programs wait on one another).
#   Per head dim: (the plain Gluon tile, the unordered fused-dQ tile).
BWD_PERSISTENT = {64: (True, False), 128: (False, True)}
# - The backward's split tail (session 53). A non-causal persistent dK/dV launch has the forward's tail: at d = 128 the
#   grid's 2048 key blocks over 132 programs leave 68 for the last lap. Its tiles are cut the same way, into pieces of
#   row tiles (``tail_pieces`` at the backward's per-block cost, 2), each leaving float32 partial dK and dV that a
#   second launch sums in piece order (pieces.sum_pieces); dQ's adds are the unsplit launch's. Measured
#   (.devrun/bwdtail.py, one process, deterministic=False, the rule against no split, two rounds, cold | eager
#   TFLOP/s; cuDNN beside at 574-579 | 540-545 for N = 16384): N = 16384 601-606 | 567-574 -> 605-607 | 572-582,
#   8192 613-614 | 557 -> 619-622 | 552-565, 4096 587-588 | 538-541 -> 592-595 | 539-542, 2048 539-540 | 490-497 ->
#   541-542 | 498-499 (1024: no split, 16 row tiles a block). So +0.2-1.3 % cold, -0.9 to +1.6 % eager: cold, at
#   most 1.3 of the tail's 3 % (where the rest goes, beside the pieces' float32 stores of 128 KiB each and the second
#   launch, was not measured). Taken from 2048 keys at d = 128 (its deterministic=False route); d = 64's persistent
#   tile runs only below 1024 keys (BWD_FUSED_DQ_MIN_KEYS, BWD_ORDERED_DQ_MIN_KEYS), not measured split.
BWD_TAIL_MIN_KEYS = {128: 2048}


def fused_dq_tile(head_dim: int, ordered: bool = False, *, causal: bool) -> BwdTile:
    """The Gluon dK/dV tile that fuses dQ at ``head_dim`` (64 or 128): on BWD_FUSED_DQ_ROWS row tiles, its adds in
    no fixed order, or with ``ordered`` in a fixed one, launched as BWD_ORDERED_LAST_BLOCK_FIRST says; its matmuls
    in the order BWD_EARLY_DV gives for the mask."""
    tile = replace(_BWD_WS_DKDV[head_dim], block_m=BWD_FUSED_DQ_ROWS[head_dim], fused_dq=True,
                   early_dv=BWD_EARLY_DV[head_dim][causal])
    return replace(tile, dq_ordered=True, last_block_first=BWD_ORDERED_LAST_BLOCK_FIRST[head_dim]) if ordered else tile


def bwd_config(head_dim: int, head_dim_v: int, dtype: torch.dtype, device_type: str, *,
               causal: bool = False, ws_ok: bool = False, seqlen_q: int | None = None,
               seqlen_k: int | None = None, deterministic: bool = True, ordered_blocks: int = 0) -> BwdConfig:
    """The tiles of a backward launch; ``ws_ok``: the Hopper dK/dV kernel can run it (``backward.ws_ok``);
    ``seqlen_q``/``seqlen_k``: query rows / keys per sequence (None: unknown, and the Hopper kernel is not taken);
    ``deterministic``: only bitwise-reproducible tiles (a fused dQ only with ``dq_ordered``); ``ordered_blocks``:
    the most key blocks a ``dq_ordered`` launch may have on this device (``backward_sm90.ordered_blocks``)."""
    if device_type != "cuda":
        return _BWD_INTERPRETER
    padded = _padded(max(head_dim, head_dim_v))
    if dtype == torch.float32:
        return _BWD_FP32_D256 if padded > 128 else _BWD_FP32_SMALL
    cfg = (_BWD_CUDA_CAUSAL if causal else _BWD_CUDA)[padded]
    ws = _BWD_WS_DKDV.get(head_dim) if ws_ok and head_dim == head_dim_v else None
    if ws is None:
        return cfg
    shortest = min(seqlen_q or 0, seqlen_k or 0)
    fused_from = BWD_FUSED_DQ_MIN_KEYS.get(head_dim)
    persistent = BWD_PERSISTENT.get(head_dim, (False, False))
    if not deterministic and fused_from is not None and shortest >= fused_from[causal]:
        return replace(cfg, dkdv=replace(fused_dq_tile(head_dim, causal=causal), persistent=persistent[1]))
    ordered_from = BWD_ORDERED_DQ_MIN_KEYS.get(head_dim, (None, None))[causal]
    if (deterministic and ordered_from is not None and shortest >= ordered_from
            and -(-seqlen_k // ws.block_n) <= ordered_blocks):
        return replace(cfg, dkdv=fused_dq_tile(head_dim, ordered=True, causal=causal))
    if shortest < BWD_WS_MIN_KEYS[head_dim][causal]:
        return cfg
    return replace(cfg, dkdv=replace(ws, persistent=persistent[0]), dq=_BWD_WS_DQ.get(head_dim, cfg.dq))


# - The backward's causal launch order (session 28, NOTES v20). The dK/dV and dQ grids ran head after head, each
#   head's heaviest program first, so the last heads' heaviest programs started late. A list-scheduling model (132
#   SMs, one program each, a program's cost its row tiles or key blocks + 1) put that tail at 5-7 % (dK/dV) and
#   10-14 % (dQ) of the d = 256 causal backward at N = 512-8192, and under 3 % with equal groups of up to 8-32
#   heads (tile_order). Measured (.devrun/bsweep28*.py, whole backward, TFLOP/s, best of three alternated in one
#   process; the other call's separate processes agreed), groups of 1 / 8 / 32: d = 256 N = 1024 / 2048 / 4096 /
#   8192 222.7 / 226.9 / 224.9, 282.4 / 292.2 / 282.1, 323.9 / 335.3 / 327.1, 358.0 / 363.8 / 366.9; d = 64
#   512-2048 within 1.5 %; d = 128 deterministic=False 1024 / 2048 280.7 / 284.7 / 284.4, 360.7 / 374.6 / 356.9.
#   So 0-3.5 %, far under the model: the d = 256 causal gap to cuDNN is not the tail. Every head at once (one
#   group) lost 5-15 % at N = 512-2048 (the programs running together then share no head's K/V or Q/dO in L2),
#   and a lone group of 8 heads (d = 256, N = 16384) 0.4-1.8 %: at most 8 columns go head after head.
BWD_CAUSAL_HEAD_GROUP = 8


def bwd_head_group(heads: int, causal: bool) -> int:
    """The (batch, kv head) columns a backward launch over ``heads`` of them interleaves (``tile_order``): under
    causal masking, equal groups of at most BWD_CAUSAL_HEAD_GROUP where there are more columns than that; else 1
    (head after head: equal programs, or few columns, each long enough to hide the others' tails)."""
    if not causal or heads <= BWD_CAUSAL_HEAD_GROUP:
        return 1
    groups = -(-heads // BWD_CAUSAL_HEAD_GROUP)
    return -(-heads // groups)


@dataclass(frozen=True)
class BiasGradConfig:
    block_m: int  # query rows per tile (of one head: this kernel does not pack GQA rows)
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int


_BIAS_GRAD_INTERPRETER = BiasGradConfig(32, 32, 4, 1)
# Provisional and unmeasured: the kernel holds Q, dO, K and V tiles and one float32 accumulator; 64 x 64 at
# d <= 128 keeps those within shared memory with room to spare, d = 256 halves both. fp32 takes the small tile.
_BIAS_GRAD_CUDA = BiasGradConfig(64, 64, 4, 2)
_BIAS_GRAD_SMALL = BiasGradConfig(32, 32, 4, 1)


def bias_grad_config(head_dim: int, dtype: torch.dtype, device_type: str) -> BiasGradConfig:
    if device_type != "cuda":
        return _BIAS_GRAD_INTERPRETER
    return _BIAS_GRAD_SMALL if dtype == torch.float32 or _padded(head_dim) > 128 else _BIAS_GRAD_CUDA


@dataclass(frozen=True)
class MergeConfig:
    block_rows: int  # (query, head) rows per program
    num_warps: int


# Interpreter: one program per batch entry and 64 rows is the fewest Python-level programs for the test shapes.
_MERGE_INTERPRETER = MergeConfig(block_rows=64, num_warps=4)
# Provisional and unmeasured: 16 rows x Dv <= 256 float32 accumulators fit 4 warps' registers; decoding (Sq = 1,
# H = 32) then runs 2 programs per batch entry, and the merge reads only S·B·H·Dv·4 bytes, far less than K and V.
_MERGE_CUDA = MergeConfig(block_rows=16, num_warps=4)


def merge_config(device_type: str) -> MergeConfig:
    return _MERGE_CUDA if device_type == "cuda" else _MERGE_INTERPRETER
