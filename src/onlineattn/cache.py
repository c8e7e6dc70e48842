"""KV caches for decoding with ``attention_with_kvcache``: ``KVCache`` (a contiguous buffer per sequence),
``PagedKVCache`` (a pool of fixed-size pages shared by many sequences) and ``StreamingCache`` (StreamingLLM: the first
tokens as attention sinks plus a sliding window of the latest ones, in constant memory).

Only raw keys and values are cached, never probabilities: the online softmax extends attention one token at a time
from them, exactly.

Each cache owns its key and value tensors and keeps its bookkeeping twice: on the host (lengths, page lists), so that
every request is checked before anything is written and refused with a plain exception; and on the device (lengths,
block table), so that a decode step hands them to the kernels without a device-to-host copy. Because every index it
passes is known to be in range, a cache calls ``attention_with_kvcache`` with ``check_indices=False``.
"""

from __future__ import annotations

import torch

from . import _validate as V
from .api import _append_kv, attention_with_kvcache, kvcache_keywords


class CacheFullError(RuntimeError):
    """A cache cannot take the tokens asked for (a sequence is at its capacity, the page pool is exhausted or every
    sequence slot is taken). Nothing was written."""


def _count(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return value


def _to_device(values, device, dtype=torch.int64) -> torch.Tensor:
    """A small host list as a device tensor. ``non_blocking`` from pageable memory stages the copy on the host and
    returns without waiting for the device, where a blocking copy would synchronise the stream."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


class _Buffers:
    """Keys and values ``[*lead, heads_kv, head_dim(_v)]``, zero-filled, and the checks of tokens written into them."""

    def __init__(self, lead, heads_kv, head_dim, head_dim_v, dtype, device):
        self.heads_kv = _count("heads_kv", heads_kv)
        self.head_dim = _count("head_dim", head_dim)
        self.head_dim_v = head_dim if head_dim_v is None else _count("head_dim_v", head_dim_v)
        for name, dim in (("head_dim", self.head_dim), ("head_dim_v", self.head_dim_v)):
            if dim > V.MAX_HEAD_DIM:  # what attention_with_kvcache takes, refused now rather than at the first call
                raise ValueError(f"{name} must be at most {V.MAX_HEAD_DIM}, got {dim}")
        if dtype not in V.FLOAT_DTYPES:
            raise TypeError(f"dtype must be one of {', '.join(map(str, V.FLOAT_DTYPES))}, got {dtype}")
        if device is not None and not isinstance(device, (str, int, torch.device)):
            raise TypeError(f"device must be a torch.device, str, int or None, got {type(device).__name__}")
        try:
            device = None if device is None else torch.device(device)
        except RuntimeError as error:
            raise ValueError(f"device must name a torch device, got {device!r} ({error})") from None
        try:  # a device this build or machine lacks (torch raises AssertionError, RuntimeError, NotImplementedError)
            torch.empty(0, device=device)
        except (AssertionError, RuntimeError, NotImplementedError) as error:
            raise ValueError(f"device {device} is not available here: {error}") from None
        self.k = torch.zeros((*lead, heads_kv, head_dim), dtype=dtype, device=device)
        self.v = torch.zeros((*lead, heads_kv, self.head_dim_v), dtype=dtype, device=device)

    def _check_query(self, q, batch: int) -> None:
        """``q [batch, Sq, Hq, D]`` in the cache's dtype, checked before the kernels' checks, which would name the
        cache's own tensors (``k_cache``, ``block_table``) for what is the caller's ``q``."""
        V.check_tensor("q", q, ndim=4)
        if q.shape[0] != batch:
            raise ValueError(f"q must have one row per sequence attended ({batch}), got batch {q.shape[0]}")
        if q.dtype != self.k.dtype:
            raise TypeError(f"q must have the cache's dtype {self.k.dtype}, got {q.dtype}")

    def _check_tokens(self, k, v, batch: int) -> int:
        """``k [batch, S_new, Hkv, D]`` and ``v`` (both or neither) in the cache's dtype, on its device: ``S_new``."""
        new = V._check_new_tokens(k, v, batch, self.heads_kv, self.head_dim, self.head_dim_v, self.k.dtype)
        if k is not None and (k.device != self.k.device or v.device != self.k.device):
            raise ValueError(f"k and v must be on the cache's device {self.k.device}, got {k.device} and {v.device}")
        return new

    def _batch_seqs(self, seqs):
        """``seqs`` checked as distinct rows of a batched cache; None means every row."""
        return range(self.batch_size) if seqs is None else self._check_seqs(seqs, range(self.batch_size), "a sequence")

    def _check_seqs(self, seqs, live, what: str) -> list[int]:
        """Distinct sequence ids, each in ``live``."""
        if isinstance(seqs, (int, torch.Tensor)) or not hasattr(seqs, "__iter__"):
            raise TypeError(f"seqs must be a list of sequence ids, got {type(seqs).__name__}")
        seqs = list(seqs)
        for s in seqs:
            if isinstance(s, bool) or not isinstance(s, int) or s not in live:
                raise ValueError(f"seqs: {s!r} is not {what}")
        if len(set(seqs)) != len(seqs):
            raise ValueError(f"seqs must be distinct, got {seqs}")
        return seqs


class KVCache(_Buffers):
    """A contiguous cache, ``k, v [batch_size, max_seqlen, heads_kv, head_dim(_v)]``, with one length per sequence.

    >>> import torch
    >>> from onlineattn.cache import KVCache
    >>> cache = KVCache(batch_size=2, max_seqlen=64, heads_kv=2, head_dim=16, dtype=torch.float32)
    >>> cache.append(torch.randn(2, 10, 2, 16), torch.randn(2, 10, 2, 16))  # a prefill's keys and values
    >>> o = cache.attend(torch.randn(2, 1, 4, 16), torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16))
    >>> o.shape, cache.lengths
    (torch.Size([2, 1, 4, 16]), (11, 11))
    """

    def __init__(self, batch_size, max_seqlen, heads_kv, head_dim, *, head_dim_v=None, dtype=torch.float16,
                 device="cpu"):
        self.batch_size = _count("batch_size", batch_size)
        self.max_seqlen = _count("max_seqlen", max_seqlen)
        super().__init__((batch_size, max_seqlen), heads_kv, head_dim, head_dim_v, dtype, device)
        self._lengths = [0] * batch_size
        self._seqlens = torch.zeros(batch_size, dtype=torch.int32, device=self.k.device)

    @property
    def lengths(self) -> tuple[int, ...]:
        """Tokens held by each sequence."""
        return tuple(self._lengths)

    def _check_room(self, seqs, new: int) -> None:
        for s in seqs:
            if self._lengths[s] + new > self.max_seqlen:
                raise CacheFullError(f"sequence {s} holds {self._lengths[s]} of {self.max_seqlen} tokens and cannot take "
                                     f"{new} more; reset it or build a longer cache")

    def append(self, k, v, *, seqs=None) -> None:
        """Store new tokens without attending: ``k [n, S_new, Hkv, D]``, ``v [n, S_new, Hkv, Dv]`` for the sequences
        ``seqs`` (default: all, n = batch_size), after each one's current tokens."""
        seqs = self._batch_seqs(seqs)
        new = self._check_tokens(k, v, len(seqs))
        self._check_room(seqs, new)
        for i, s in enumerate(seqs):
            start = self._lengths[s]
            self.k[s, start : start + new].copy_(k[i])
            self.v[s, start : start + new].copy_(v[i])
            self._lengths[s] += new
            self._seqlens[s] += new

    def attend(self, q, k=None, v=None, *, causal=True, softmax_scale=None, num_splits=0, return_lse=False,
               backend="auto"):
        """Append ``k, v [batch_size, S_new, Hkv, D(v)]`` (if given) to every sequence, then attend with
        ``q [batch_size, Sq, Hq, D]`` over each sequence's tokens: ``attention_with_kvcache``'s result."""
        self._check_query(q, self.batch_size)
        new = self._check_tokens(k, v, self.batch_size)
        self._check_room(range(self.batch_size), new)
        out = attention_with_kvcache(q, self.k, self.v, k, v, cache_seqlens=self._seqlens, causal=causal,
                                     softmax_scale=softmax_scale, num_splits=num_splits, return_lse=return_lse,
                                     check_indices=False, backend=backend)
        self._lengths = [n + new for n in self._lengths]
        self._seqlens += new
        return out

    def reset(self, seqs=None) -> None:
        """Empty the sequences ``seqs`` (default: all); their old tokens are overwritten as new ones arrive."""
        seqs = self._batch_seqs(seqs)
        for s in seqs:
            self._lengths[s] = 0
            self._seqlens[s] = 0


class PagedKVCache(_Buffers):
    """A pool of ``num_pages`` pages of ``page_size`` tokens, ``k_pages, v_pages [num_pages, page_size, heads_kv,
    head_dim(_v)]``, shared by up to ``max_seqs`` sequences of up to ``max_seqlen`` tokens each.

    A sequence takes pages from the pool as it grows and gives them all back when it is freed. A page belongs to one
    sequence at a time, so no write can reach another sequence's tokens. ``block_table [max_seqs, pages per sequence]``
    (int32, on the device; -1 where no page is assigned) maps token t of sequence s to page
    ``block_table[s, t // page_size]``, slot ``t % page_size``.

    >>> import torch
    >>> from onlineattn.cache import PagedKVCache
    >>> cache = PagedKVCache(num_pages=8, page_size=16, heads_kv=2, head_dim=16, max_seqs=4, max_seqlen=64,
    ...                      dtype=torch.float32)
    >>> a, b = cache.new_sequence(), cache.new_sequence()
    >>> cache.append(a, torch.randn(20, 2, 16), torch.randn(20, 2, 16))  # 20 tokens: 2 pages
    >>> o = cache.attend(torch.randn(2, 1, 4, 16), [a, b], torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16))
    >>> cache.lengths, cache.num_free_pages
    ({0: 21, 1: 1}, 5)
    >>> cache.free(a); cache.num_free_pages
    7
    """

    def __init__(self, num_pages, page_size, heads_kv, head_dim, *, max_seqs, max_seqlen, head_dim_v=None,
                 dtype=torch.float16, device="cpu"):
        self.num_pages = _count("num_pages", num_pages)
        self.page_size = _count("page_size", page_size)
        if page_size % V.PAGE_MULTIPLE:
            raise ValueError(f"page_size must be a multiple of {V.PAGE_MULTIPLE}, got {page_size}")
        self.max_seqs = _count("max_seqs", max_seqs)
        self.max_seqlen = _count("max_seqlen", max_seqlen)
        super().__init__((num_pages, page_size), heads_kv, head_dim, head_dim_v, dtype, device)
        self.k_pages, self.v_pages = self.k, self.v
        self.pages_per_seq = -(-max_seqlen // page_size)
        self.block_table = torch.full((max_seqs, self.pages_per_seq), -1, dtype=torch.int32, device=self.k.device)
        self._seqlens = torch.zeros(max_seqs, dtype=torch.int32, device=self.k.device)
        self._free_pages = list(range(num_pages - 1, -1, -1))  # a stack: the lowest free id comes off first
        self._free_slots = list(range(max_seqs - 1, -1, -1))
        self._pages: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}

    # ---- bookkeeping -------------------------------------------------------------------------------------------

    @property
    def lengths(self) -> dict[int, int]:
        """Tokens held by each live sequence."""
        return dict(self._lengths)

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    def pages(self, seq) -> tuple[int, ...]:
        """The pages of sequence ``seq``, in token order."""
        return tuple(self._pages[self._check_seqs([seq], self._lengths, "a live sequence")[0]])

    def new_sequence(self) -> int:
        """Start an empty sequence and return its id (a row of ``block_table``)."""
        if not self._free_slots:
            raise CacheFullError(f"all {self.max_seqs} sequence slots are taken; free a finished sequence first")
        seq = self._free_slots.pop()
        self._pages[seq], self._lengths[seq] = [], 0
        return seq

    def free(self, seq) -> None:
        """Finish sequence ``seq``: its pages go back to the pool and its id may be reused."""
        seq = self._check_seqs([seq], self._lengths, "a live sequence")[0]
        self._free_pages.extend(reversed(self._pages.pop(seq)))
        del self._lengths[seq]
        self._free_slots.append(seq)
        self.block_table[seq].fill_(-1)
        self._seqlens[seq] = 0

    def allocate(self, seq, num_tokens) -> None:
        """Make sure sequence ``seq`` has pages for ``num_tokens`` tokens beyond those it holds."""
        seq = self._check_seqs([seq], self._lengths, "a live sequence")[0]
        self._grow(dict.fromkeys([seq], _count("num_tokens", num_tokens, minimum=0)))

    def _grow(self, wanted: dict[int, int]) -> dict[int, list[int]]:
        """Give each sequence pages for ``wanted[seq]`` more tokens, all or nothing; returns the pages taken."""
        need = {}
        for seq, new in wanted.items():
            total = self._lengths[seq] + new
            if total > self.max_seqlen:
                raise CacheFullError(f"sequence {seq} holds {self._lengths[seq]} tokens and cannot take {new} more: "
                                     f"max_seqlen is {self.max_seqlen}")
            need[seq] = max(0, -(-total // self.page_size) - len(self._pages[seq]))
        if sum(need.values()) > len(self._free_pages):
            raise CacheFullError(f"page pool exhausted: {sum(need.values())} more pages of {self.page_size} tokens are "
                                 f"needed and {len(self._free_pages)} of {self.num_pages} are free; free finished "
                                 "sequences or build a larger pool")
        taken = {}
        for seq, count in need.items():
            if count:
                taken[seq] = [self._free_pages.pop() for _ in range(count)]
                start = len(self._pages[seq])
                self._pages[seq] += taken[seq]
                self.block_table[seq, start : start + count].copy_(_to_device(taken[seq], self.k.device, torch.int32))
        return taken

    def _release(self, taken: dict[int, list[int]]) -> None:
        """Undo ``_grow``: the pages go back to the pool, as they were."""
        for seq, pages in taken.items():
            del self._pages[seq][len(self._pages[seq]) - len(pages) :]
            self.block_table[seq, len(self._pages[seq]) : len(self._pages[seq]) + len(pages)].fill_(-1)
            self._free_pages.extend(reversed(pages))

    # ---- tokens ------------------------------------------------------------------------------------------------

    def append(self, seq, k, v) -> None:
        """Store new tokens of sequence ``seq`` without attending: ``k [S_new, Hkv, D]``, ``v [S_new, Hkv, Dv]``."""
        seq = self._check_seqs([seq], self._lengths, "a live sequence")[0]
        V.check_tensor("k", k, ndim=3)
        V.check_tensor("v", v, ndim=3)
        new = self._check_tokens(k[None], v[None], 1)
        self._grow({seq: new})
        _append_kv(self.k_pages, self.v_pages, k[None], v[None], self._seqlens[seq : seq + 1],
                   self.block_table[seq : seq + 1])
        self._lengths[seq] += new
        self._seqlens[seq] += new

    def attend(self, q, seqs, k=None, v=None, *, causal=True, softmax_scale=None, num_splits=0, return_lse=False,
               backend="auto"):
        """Append ``k, v [n, S_new, Hkv, D(v)]`` (if given) to the sequences ``seqs`` (n distinct live ids), taking
        pages as needed, then attend with ``q [n, Sq, Hq, D]``: ``attention_with_kvcache``'s result, row i for
        ``seqs[i]``. If the pool cannot hold the new tokens, nothing is written."""
        seqs = self._check_seqs(seqs, self._lengths, "a live sequence")
        self._check_query(q, len(seqs))
        new = self._check_tokens(k, v, len(seqs))
        taken = self._grow(dict.fromkeys(seqs, new))
        index = _to_device(seqs, self.k.device)
        try:
            out = attention_with_kvcache(
                q, self.k_pages, self.v_pages, k, v, cache_seqlens=self._seqlens[index],
                block_table=self.block_table[index], causal=causal, softmax_scale=softmax_scale,
                num_splits=num_splits, return_lse=return_lse, check_indices=False, backend=backend,
            )
        except (TypeError, ValueError):  # refused before anything was written: give the pages back
            self._release(taken)
            raise
        for s in seqs:
            self._lengths[s] += new
        self._seqlens[index] += new
        return out

    def keys(self, seq) -> torch.Tensor:
        """A copy of sequence ``seq``'s keys in token order, ``[length, Hkv, D]``."""
        return self._gather(self.k_pages, seq)

    def values(self, seq) -> torch.Tensor:
        """A copy of sequence ``seq``'s values in token order, ``[length, Hkv, Dv]``."""
        return self._gather(self.v_pages, seq)

    def _gather(self, pool, seq) -> torch.Tensor:
        seq = self._check_seqs([seq], self._lengths, "a live sequence")[0]
        positions = torch.arange(self._lengths[seq])
        pages = torch.tensor(self._pages[seq], dtype=torch.long)[positions // self.page_size]
        return pool[pages.to(pool.device), (positions % self.page_size).to(pool.device)]


class StreamingCache(_Buffers):
    """StreamingLLM's cache: the first ``sink_tokens`` tokens of each sequence (attention sinks) and its latest
    ``window`` tokens, in ``k, v [batch_size, sink_tokens + window, heads_kv, head_dim(_v)]`` however long it grows.

    Slots: token t lives in slot t while the cache fills; after that, tokens past the sinks take the window's slots
    in turn (slot ``sink_tokens + (t − sink_tokens) % window``), overwriting the oldest. The kernels see
    ``min(seen, capacity)`` tokens, so the visible length, the memory and every index stay bounded while ``seen``
    (a Python int) counts on. ``positions(b)`` gives the original position of each retained token, slot by slot.

    Attention over a full cache needs no order: one query token sees all retained tokens, and softmax does not care
    where they sit. So once a sequence has wrapped, ``attend`` takes one token at a time; several tokens per call
    (a prefill, say) are accepted while nothing is evicted, and ``append`` stores any number of tokens (the latest
    ``window`` past the sinks survive). The kernels apply no rotary embedding: StreamingLLM re-rotates cached keys by
    their rank in the cache, which needs keys cached before rotation and a rotary-aware kernel (not provided here).

    >>> import torch
    >>> from onlineattn.cache import StreamingCache
    >>> cache = StreamingCache(sink_tokens=2, window=6, batch_size=1, heads_kv=1, head_dim=8, dtype=torch.float32)
    >>> for _ in range(20):
    ...     o = cache.attend(torch.randn(1, 1, 2, 8), torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8))
    >>> cache.seen, cache.positions(0).tolist()
    ((20,), [0, 1, 14, 15, 16, 17, 18, 19])
    """

    def __init__(self, sink_tokens, window, batch_size, heads_kv, head_dim, *, head_dim_v=None, dtype=torch.float16,
                 device="cpu"):
        self.sink_tokens = _count("sink_tokens", sink_tokens, minimum=0)
        self.window = _count("window", window)
        self.batch_size = _count("batch_size", batch_size)
        self.capacity = sink_tokens + window
        super().__init__((batch_size, self.capacity), heads_kv, head_dim, head_dim_v, dtype, device)
        self._seen = [0] * batch_size
        self._seen_dev = torch.zeros(batch_size, dtype=torch.int64, device=self.k.device)

    @property
    def seen(self) -> tuple[int, ...]:
        """Tokens each sequence has appended since its last reset, evicted ones included."""
        return tuple(self._seen)

    def _slot(self, t):
        """The slot of token t (an int or a tensor of ints)."""
        sink, window = self.sink_tokens, self.window
        if isinstance(t, torch.Tensor):
            return torch.where(t < sink, t, sink + (t - sink) % window)
        return t if t < sink else sink + (t - sink) % window

    def positions(self, seq) -> torch.Tensor:
        """Original positions of sequence ``seq``'s retained tokens, in slot order: ``int64 [min(seen, capacity)]``."""
        seen = self._seen[self._batch_seqs([seq])[0]]
        kept = list(range(min(seen, self.sink_tokens))) + list(range(max(self.sink_tokens, seen - self.window), seen))
        by_slot = sorted(kept, key=self._slot)
        return torch.tensor(by_slot, dtype=torch.int64)

    def append(self, k, v, *, seqs=None) -> None:
        """Store new tokens without attending: ``k [n, S_new, Hkv, D]``, ``v [n, S_new, Hkv, Dv]`` for the sequences
        ``seqs`` (default: all). Any number of tokens: only the sinks and the latest ``window`` are kept."""
        seqs = self._batch_seqs(seqs)
        new = self._check_tokens(k, v, len(seqs))
        for i, s in enumerate(seqs):
            first = self._seen[s]
            kept = [t for t in range(first, first + new) if t < self.sink_tokens or t >= first + new - self.window]
            rows = _to_device([t - first for t in kept], self.k.device)
            slots = _to_device([self._slot(t) for t in kept], self.k.device)
            self.k[s].index_copy_(0, slots, k[i].index_select(0, rows))
            self.v[s].index_copy_(0, slots, v[i].index_select(0, rows))
            self._seen[s] += new
            self._seen_dev[s] += new

    def attend(self, q, k=None, v=None, *, causal=True, softmax_scale=None, num_splits=0, return_lse=False,
               backend="auto"):
        """Append ``k, v [batch_size, S_new, Hkv, D(v)]`` (if given) to every sequence, evicting past the window, then
        attend with ``q [batch_size, Sq, Hq, D]`` over the retained tokens: ``attention_with_kvcache``'s result."""
        self._check_query(q, self.batch_size)
        V.check_kvcache(q, self.k, self.v, k, v, 0, None)  # shapes first: nothing is written for a bad call
        new = self._check_tokens(k, v, self.batch_size)
        kw = dict(causal=causal, softmax_scale=softmax_scale, num_splits=num_splits, return_lse=return_lse,
                  check_indices=False, backend=backend)
        if all(seen + new <= self.capacity for seen in self._seen):  # nothing evicted: tokens in order
            retained = self._seen_dev.to(torch.int32)
            out = attention_with_kvcache(q, self.k, self.v, k, v, cache_seqlens=retained, **kw)
        elif q.shape[1] == 1 and new <= 1:  # one query sees every retained token, in any order
            kvcache_keywords(q, softmax_scale, causal, return_lse, False, num_splits, backend)  # before the write
            if new:
                batch = torch.arange(self.batch_size, device=self.k.device)
                slots = self._slot(self._seen_dev)
                self.k.index_put_((batch, slots), k[:, 0])
                self.v.index_put_((batch, slots), v[:, 0])
            retained = (self._seen_dev + new).clamp(max=self.capacity).to(torch.int32)
            out = attention_with_kvcache(q, self.k, self.v, cache_seqlens=retained, **kw)
        else:
            raise ValueError(f"q has {q.shape[1]} tokens and k {new}, and this step evicts tokens (seen "
                             f"{max(self._seen)}, capacity {self.capacity}): once a sequence has wrapped, attend "
                             "takes one token at a time; store a long prompt with append()")
        self._seen = [seen + new for seen in self._seen]
        self._seen_dev += new
        return out

    def reset(self, seqs=None) -> None:
        """Empty the sequences ``seqs`` (default: all)."""
        seqs = self._batch_seqs(seqs)
        for s in seqs:
            self._seen[s] = 0
            self._seen_dev[s] = 0
