"""How a sequence is split over the ranks of a ring, and which blocks of attention each ring step computes.

Two layouts, for a sequence of S tokens over ``world`` ranks:

- ``"contiguous"``: rank r holds tokens ``[r·S/world, (r+1)·S/world)``;
- ``"zigzag"``: the sequence is cut into ``2·world`` equal chunks and rank r holds chunks r and ``2·world − 1 − r``,
  in that order. Under causal masking every rank then has the same amount of visible work, whereas with contiguous
  shards the last rank sees every key and the first only its own.

Positions are global token indices; a rank's local shard lists its tokens in increasing global order in both layouts,
which is what lets the diagonal block of a ring use the ordinary causal kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import _validate as V

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout) -> str:
    return V.check_choice("layout", layout, LAYOUTS)


def chunks_per_rank(layout: str) -> int:
    """How many equal chunks of the sequence one rank holds: 1 (contiguous) or 2 (zigzag)."""
    return 1 if layout == "contiguous" else 2


def chunk_ids(layout: str, rank: int, world: int) -> tuple[int, ...]:
    """Indices of the chunks rank ``rank`` holds, in local order, out of ``world · chunks_per_rank(layout)``."""
    return (rank,) if layout == "contiguous" else (rank, 2 * world - 1 - rank)


def _check_int(name: str, value, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low or (high is not None and value >= high):
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def shard_sequence(x: torch.Tensor, rank: int, world: int, layout: str = "contiguous", *, seq_dim: int = 1):
    """The part of a full-sequence tensor that rank ``rank`` of ``world`` holds.

    Args:
        x: the full sequence, ``[B, S, H, D]`` (q, k, v, o) by default; pass ``seq_dim=2`` for an lse ``[B, H, S]``.
        rank, world: this rank and the ring's size, ``0 <= rank < world``.
        layout: ``"contiguous"`` or ``"zigzag"`` (see the module docstring).

    Returns:
        ``[B, S / world, H, D]`` (a view for contiguous, a new tensor for zigzag, whose two chunks are concatenated).

    Raises ``ValueError`` unless S divides by ``world`` (contiguous) or ``2 · world`` (zigzag).

    Example (8 tokens, 2 ranks):
        >>> x = torch.arange(8).reshape(1, 8, 1, 1)
        >>> shard_sequence(x, 0, 2, "zigzag").flatten().tolist(), shard_sequence(x, 1, 2, "zigzag").flatten().tolist()
        ([0, 1, 6, 7], [2, 3, 4, 5])
    """
    V.check_tensor("x", x, dtypes=None)
    if x.dim() == 0:
        raise ValueError("x must have a sequence dim, got a 0-d tensor")
    layout = check_layout(layout)
    world = _check_int("world", world, 1)
    rank = _check_int("rank", rank, 0, world)
    seq_dim = _check_int("seq_dim", seq_dim, 0, x.dim())
    pieces = world * chunks_per_rank(layout)
    s = x.shape[seq_dim]
    if s % pieces:
        raise ValueError(
            f"x's sequence length (dim {seq_dim}) must divide by {pieces} ({'world' if layout == 'contiguous' else '2 · world'}"
            f" for layout {layout!r}, world {world}), got {s}"
        )
    c = s // pieces
    parts = [x.narrow(seq_dim, i * c, c) for i in chunk_ids(layout, rank, world)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=seq_dim)


def unshard_sequence(shards, layout: str = "contiguous", *, seq_dim: int = 1) -> torch.Tensor:
    """Inverse of ``shard_sequence``: ``shards[r]`` is rank r's ``[B, S / world, H, D]``; returns ``[B, S, H, D]``.

    Example:
        >>> import torch
        >>> x = torch.arange(8.0).reshape(1, 8, 1, 1)
        >>> shards = [shard_sequence(x, r, 2, "zigzag") for r in range(2)]
        >>> torch.equal(unshard_sequence(shards, "zigzag"), x)
        True
    """
    if not isinstance(shards, (list, tuple)) or not shards:
        raise TypeError(f"shards must be a non-empty list of tensors, one per rank, got {type(shards).__name__}")
    for r, x in enumerate(shards):
        V.check_tensor(f"shards[{r}]", x, dtypes=None)
        if x.shape != shards[0].shape:
            raise ValueError(f"shards must share one shape: shards[0] is {tuple(shards[0].shape)}, "
                             f"shards[{r}] is {tuple(x.shape)}")
        if x.dtype != shards[0].dtype:
            raise TypeError(f"shards must share one dtype: shards[0] is {shards[0].dtype}, shards[{r}] is {x.dtype}")
        if x.device != shards[0].device:
            raise ValueError(f"shards must be on one device: shards[0] is on {shards[0].device}, shards[{r}] on "
                             f"{x.device}")
    if shards[0].dim() == 0:
        raise ValueError("shards must have a sequence dim, got 0-d tensors")
    layout = check_layout(layout)
    seq_dim = _check_int("seq_dim", seq_dim, 0, shards[0].dim())
    world = len(shards)
    per_rank = chunks_per_rank(layout)
    n = shards[0].shape[seq_dim]
    if n % per_rank:
        raise ValueError(f"zigzag shards hold two equal chunks, so their length must be even, got {n}")
    c = n // per_rank
    chunks = [None] * (world * per_rank)
    for r, x in enumerate(shards):
        for local, global_id in enumerate(chunk_ids(layout, r, world)):
            chunks[global_id] = x.narrow(seq_dim, local * c, c)
    return torch.cat(chunks, dim=seq_dim)


def positions(layout: str, rank: int, world: int, n: int) -> torch.Tensor:
    """Global token index of each of the ``n`` local tokens of ``rank``: int64 ``[n]``, increasing."""
    c = n // chunks_per_rank(layout)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunk_ids(layout, rank, world)])


@dataclass(frozen=True)
class Block:
    """One attention call of a ring step: local query rows ``rows`` against the visiting shard's keys ``cols``.

    ``causal`` means the block lies on the diagonal (queries and keys are the same global tokens, in the same order),
    where the kernels' bottom-right causal mask is exactly "key position <= query position".
    """

    rows: slice
    cols: slice
    causal: bool


def step_blocks(layout: str, causal: bool, rank: int, src: int, n: int) -> list[Block]:
    """Blocks that rank ``rank`` computes when it holds the K/V shard of rank ``src``; both shards have n tokens.

    Without causal masking every pair of tokens is visible: one block. With it (contiguous shards, chunk i per rank):
    keys of an earlier rank are all visible, of a later rank all hidden, and the own shard is the diagonal.
    Zigzag (c = n / 2, queries hold chunks r and 2w−1−r, keys s and 2w−1−s):

    - s = r: the diagonal; the local causal mask over both chunks is exact, because both lists are in global order;
    - s < r: every query sees key chunk s (it precedes both query chunks) and none sees 2w−1−s: ``[all] × [:c]``;
    - s > r: query chunk r sees nothing, chunk 2w−1−r sees both key chunks: ``[c:] × [all]``.

    Every off-diagonal zigzag step is one ``2c × c`` (or ``c × 2c``) block, and the diagonal is half of ``2c × 2c``:
    the same work on every rank at every step, which is the point of the layout.
    """
    everything = slice(0, n)
    if not causal:
        return [Block(everything, everything, False)]
    if src == rank:
        return [Block(everything, everything, True)]
    if layout == "contiguous":
        return [Block(everything, everything, False)] if src < rank else []
    c = n // 2
    if src < rank:
        return [Block(everything, slice(0, c), False)]
    return [Block(slice(c, n), everything, False)]
