"""The user-facing caches (``onlineattn.cache``): decoding through them equals attention over the tokens they hold.

- ``KVCache``: prefill then token-by-token decode equals causal attention over the whole sequence.
- ``PagedKVCache``: a hypothesis state machine interleaves new sequences, appends, allocations, frees, decode steps
  and calls with corrupted block tables over many sequences; no operation changes another sequence's keys or values,
  pages are never shared, and exhaustion and bad page ids fail clearly without writing anything.
- ``StreamingCache``: decoding 10x past its capacity keeps memory bounded and equals attention over exactly the
  retained tokens (the sinks and the latest window).

The torch path runs the long and random sequences (float64: exact to 1e-12); the Triton kernels, through the
interpreter without CUDA, run shorter fixed scenarios.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import onlineattn
from onlineattn import reference as R
from onlineattn.cache import CacheFullError, KVCache, PagedKVCache, StreamingCache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL_DTYPE = torch.float32 if DEVICE == "cpu" else torch.bfloat16


def _name(dtype):
    return str(dtype).replace("torch.", "")


def _randn(gen, *shape, dtype=torch.float64):
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


def _check(o, lse, q, k, v, dtype, causal=True):
    """o and lse against the oracle over exactly ``k``/``v`` (section 3 rule, same-dtype math as the baseline)."""
    exact_o, exact_lse = R.naive_attention(q, k, v, causal=causal, return_lse=True)
    base_o, base_lse = R.torch_math_attention(q, k, v, causal=causal) if dtype not in (torch.float32, torch.float64) \
        else (None, None)
    R.assert_within_rule("o", o, exact_o, base_o, _name(dtype))
    R.assert_within_rule("lse", lse, exact_lse, base_lse, _name(dtype))


# ---- KVCache ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend,dtype", [("torch", torch.float64), ("triton", torch.float32), ("triton", torch.float16)],
                         ids=lambda x: _name(x) if isinstance(x, torch.dtype) else x)
def test_kvcache_prefill_then_decode_is_causal_attention(backend, dtype):
    gen = torch.Generator().manual_seed(0)
    b, n, prefill, hq, hkv, d = 2, 29, 21, 4, 2, 16
    q, k, v = _randn(gen, b, n, hq, d, dtype=dtype), _randn(gen, b, n, hkv, d, dtype=dtype), _randn(gen, b, n, hkv, d, dtype=dtype)
    cache = KVCache(b, 40, hkv, d, dtype=dtype, device=DEVICE)
    outs = [cache.attend(q[:, :prefill], k[:, :prefill], v[:, :prefill], return_lse=True, backend=backend)]
    for t in range(prefill, n):
        outs.append(cache.attend(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], return_lse=True, backend=backend,
                                 num_splits=2))
    assert cache.lengths == (n, n)
    _check(torch.cat([o for o, _ in outs], 1), torch.cat([lse for _, lse in outs], 2), q, k, v, dtype)


def test_kvcache_ragged_append_reset_and_overflow():
    gen = torch.Generator().manual_seed(1)
    cache = KVCache(3, 16, 1, 8, dtype=torch.float64, device=DEVICE)
    seqs = {0: _randn(gen, 5, 1, 8), 2: _randn(gen, 12, 1, 8)}
    for s, x in seqs.items():
        cache.append(x[None], 2 * x[None], seqs=[s])
    assert cache.lengths == (5, 0, 12)
    before = cache.k.clone(), cache.v.clone()
    with pytest.raises(CacheFullError, match="sequence 2 holds 12 of 16"):
        cache.attend(_randn(gen, 3, 1, 2, 8), _randn(gen, 3, 5, 1, 8), _randn(gen, 3, 5, 1, 8))
    assert torch.equal(cache.k, before[0]) and torch.equal(cache.v, before[1]) and cache.lengths == (5, 0, 12)
    q, k, v = _randn(gen, 3, 1, 2, 8), _randn(gen, 3, 1, 1, 8), _randn(gen, 3, 1, 1, 8)
    o = cache.attend(q, k, v)
    for s, length in enumerate((5, 0, 12)):
        old = seqs.get(s, torch.zeros(0, 1, 8, dtype=torch.float64, device=DEVICE))
        keys, values = torch.cat([old, k[s]])[None], torch.cat([2 * old, v[s]])[None]
        R.assert_within_rule("o", o[s : s + 1], R.naive_attention(q[s : s + 1], keys, values, causal=True))
    cache.reset([2])
    assert cache.lengths == (6, 1, 0)
    with pytest.raises(ValueError, match="distinct"):
        cache.reset([0, 0])
    with pytest.raises(ValueError, match="seqs: 3"):
        cache.append(k[:1], v[:1], seqs=[3])


# ---- PagedKVCache: hypothesis state machine --------------------------------------------------------------------

PAGES, PAGE, SEQS, MAX_LEN, HQ, HKV, D = 8, 16, 6, 80, 4, 2, 8  # a small pool: exhaustion is common


class PagedCacheMachine(RuleBasedStateMachine):
    """The model keeps each live sequence's tokens and how many tokens its pages can hold; the cache must agree."""

    def __init__(self):
        super().__init__()
        self.cache = PagedKVCache(PAGES, PAGE, HKV, D, max_seqs=SEQS, max_seqlen=MAX_LEN, dtype=torch.float64,
                                  device=DEVICE)
        self.keys, self.values, self.reserved = {}, {}, {}
        self.gen = torch.Generator().manual_seed(0)

    def _pages_needed(self, wanted: dict[int, int]):
        """(fits, pages taken) for giving each sequence ``wanted[s]`` more tokens, by the model's own count."""
        need = 0
        for s, n in wanted.items():
            total = self.keys[s].shape[0] + n
            if total > MAX_LEN:
                return False, 0
            need += max(0, -(-total // PAGE) - -(-self.reserved[s] // PAGE))
        used = sum(-(-r // PAGE) for r in self.reserved.values())
        return need <= PAGES - used, need

    def _tokens(self, *lead):
        return _randn(self.gen, *lead, HKV, D), _randn(self.gen, *lead, HKV, D)

    def _grow_model(self, s, n, k=None, v=None):
        if k is not None:
            self.keys[s], self.values[s] = torch.cat([self.keys[s], k]), torch.cat([self.values[s], v])
        self.reserved[s] = max(self.reserved[s], self.keys[s].shape[0] + (0 if k is not None else n))

    @rule()
    def new_sequence(self):
        if len(self.keys) == SEQS:
            with pytest.raises(CacheFullError, match="sequence slots"):
                self.cache.new_sequence()
            return
        s = self.cache.new_sequence()
        assert s not in self.keys
        self.keys[s] = self.values[s] = torch.zeros(0, HKV, D, dtype=torch.float64, device=DEVICE)
        self.reserved[s] = 0

    @precondition(lambda self: self.keys)
    @rule(data=st.data(), n=st.integers(0, 45))
    def append(self, data, n):
        s = data.draw(st.sampled_from(sorted(self.keys)))
        k, v = self._tokens(n)
        fits, _ = self._pages_needed({s: n})
        if not fits:
            with pytest.raises(CacheFullError, match="page pool exhausted|max_seqlen"):
                self.cache.append(s, k, v)
            return
        self.cache.append(s, k, v)
        self._grow_model(s, n, k, v)

    @precondition(lambda self: self.keys)
    @rule(data=st.data(), n=st.integers(0, 45))
    def allocate(self, data, n):
        s = data.draw(st.sampled_from(sorted(self.keys)))
        fits, _ = self._pages_needed({s: n})
        if not fits:
            with pytest.raises(CacheFullError):
                self.cache.allocate(s, n)
            return
        self.cache.allocate(s, n)
        self._grow_model(s, n)

    @precondition(lambda self: self.keys)
    @rule(data=st.data())
    def free(self, data):
        s = data.draw(st.sampled_from(sorted(self.keys)))
        self.cache.free(s)
        del self.keys[s], self.values[s], self.reserved[s]

    @precondition(lambda self: self.keys)
    @rule(data=st.data(), new=st.integers(0, 2), sq=st.integers(1, 2), splits=st.sampled_from([0, 1, 3]))
    def decode(self, data, new, sq, splits):
        seqs = data.draw(st.lists(st.sampled_from(sorted(self.keys)), min_size=1, unique=True))
        q = _randn(self.gen, len(seqs), sq, HQ, D)
        k, v = self._tokens(len(seqs), new)
        fits, _ = self._pages_needed(dict.fromkeys(seqs, new))
        if not fits:
            with pytest.raises(CacheFullError):
                self.cache.attend(q, seqs, k, v)
            return
        o, lse = self.cache.attend(q, seqs, k if new else None, v if new else None, return_lse=True, num_splits=splits)
        for i, s in enumerate(seqs):
            self._grow_model(s, new, k[i], v[i])
            exact_o, exact_lse = R.naive_attention(q[i : i + 1], self.keys[s][None], self.values[s][None], causal=True,
                                                   return_lse=True)
            R.assert_within_rule("o", o[i : i + 1], exact_o)
            R.assert_within_rule("lse", lse[i : i + 1], exact_lse)

    @precondition(lambda self: any(k.shape[0] for k in self.keys.values()))
    @rule(data=st.data(), bad=st.sampled_from([-1, PAGES, PAGES + 100]))
    def call_with_a_corrupted_block_table(self, data, bad):
        """A block table with an out-of-range page id where a sequence's tokens are is refused before any write."""
        s = data.draw(st.sampled_from(sorted(x for x in self.keys if self.keys[x].shape[0])))
        table = self.cache.block_table[s : s + 1].clone()
        table[0, data.draw(st.integers(0, (self.keys[s].shape[0] - 1) // PAGE))] = bad
        k, v = self._tokens(1, 1)
        with pytest.raises(ValueError, match=rf"block_table\[0, \d+\] = {bad} is not a page"):
            onlineattn.attention_with_kvcache(
                _randn(self.gen, 1, 1, HQ, D), self.cache.k_pages, self.cache.v_pages, k, v,
                cache_seqlens=torch.tensor([self.keys[s].shape[0] - 1], dtype=torch.int32, device=DEVICE),
                block_table=table,
            )

    @invariant()
    def every_sequence_keeps_its_tokens(self):
        assert self.cache.lengths == {s: k.shape[0] for s, k in self.keys.items()}
        for s in self.keys:
            assert torch.equal(self.cache.keys(s), self.keys[s]), f"sequence {s}'s keys changed"
            assert torch.equal(self.cache.values(s), self.values[s]), f"sequence {s}'s values changed"

    @invariant()
    def pages_are_owned_once(self):
        owned = [p for s in self.keys for p in self.cache.pages(s)]
        assert len(owned) == len(set(owned)), "a page belongs to two sequences"
        assert len(owned) + self.cache.num_free_pages == PAGES
        assert all(len(self.cache.pages(s)) == -(-self.reserved[s] // PAGE) for s in self.keys)


PagedCacheMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestPagedCacheProperties = PagedCacheMachine.TestCase


# ---- PagedKVCache: fixed scenarios --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []),
                         ids=_name)
def test_paged_cache_through_the_kernels(dtype):
    """Sequences grow at different rates; one finishes and a new one reuses its pages; decode runs through Triton."""
    gen = torch.Generator().manual_seed(2)
    cache = PagedKVCache(6, 16, HKV, 32, max_seqs=3, max_seqlen=64, dtype=dtype, device=DEVICE)
    tokens = {}

    def add(s, n):
        k, v = _randn(gen, n, HKV, 32, dtype=dtype), _randn(gen, n, HKV, 32, dtype=dtype)
        cache.append(s, k, v)
        old = tokens.get(s, (k[:0], v[:0]))
        tokens[s] = (torch.cat([old[0], k]), torch.cat([old[1], v]))

    def step(seqs):
        q = _randn(gen, len(seqs), 1, HQ, 32, dtype=dtype)
        k, v = _randn(gen, len(seqs), 1, HKV, 32, dtype=dtype), _randn(gen, len(seqs), 1, HKV, 32, dtype=dtype)
        o, lse = cache.attend(q, seqs, k, v, return_lse=True, num_splits=2, backend="triton")
        for i, s in enumerate(seqs):
            tokens[s] = (torch.cat([tokens[s][0], k[i]]), torch.cat([tokens[s][1], v[i]]))
            _check(o[i : i + 1], lse[i : i + 1], q[i : i + 1], tokens[s][0][None], tokens[s][1][None], dtype)

    a, b = cache.new_sequence(), cache.new_sequence()
    add(a, 31)
    add(b, 5)
    for _ in range(2):
        step([a, b])
    pages_of_a = set(cache.pages(a))
    cache.free(a)
    del tokens[a]
    c = cache.new_sequence()
    add(c, 40)  # three pages, two of them a's old ones
    assert pages_of_a & set(cache.pages(c))
    step([c, b])
    for s in (b, c):
        assert torch.equal(cache.keys(s), tokens[s][0]) and torch.equal(cache.values(s), tokens[s][1])


def test_paged_cache_exhaustion_is_clear_and_changes_nothing():
    gen = torch.Generator().manual_seed(3)
    cache = PagedKVCache(3, 16, 1, 8, max_seqs=2, max_seqlen=64, dtype=torch.float64, device=DEVICE)
    a, b = cache.new_sequence(), cache.new_sequence()
    cache.append(a, _randn(gen, 30, 1, 8), _randn(gen, 30, 1, 8))
    table, keys = cache.block_table.clone(), cache.keys(a)
    with pytest.raises(CacheFullError, match=r"page pool exhausted: 2 more pages of 16 tokens are needed and 1 of 3"):
        cache.attend(_randn(gen, 2, 1, 2, 8), [a, b], _randn(gen, 2, 3, 1, 8), _randn(gen, 2, 3, 1, 8))
    assert torch.equal(cache.block_table, table) and cache.num_free_pages == 1 and cache.lengths == {a: 30, b: 0}
    assert torch.equal(cache.keys(a), keys)
    with pytest.raises(CacheFullError, match="max_seqlen is 64"):
        cache.allocate(b, 65)
    with pytest.raises(CacheFullError, match="sequence slots"):
        cache.new_sequence()


def test_paged_cache_gives_pages_back_when_the_call_is_refused():
    gen = torch.Generator().manual_seed(4)
    cache = PagedKVCache(4, 16, 1, 8, max_seqs=2, max_seqlen=64, dtype=torch.float64, device=DEVICE)
    a = cache.new_sequence()
    with pytest.raises(ValueError, match="q"):  # q has 3 heads, which 1 kv head divides, but D is wrong
        cache.attend(_randn(gen, 1, 1, 3, 7), [a], _randn(gen, 1, 20, 1, 8), _randn(gen, 1, 20, 1, 8))
    assert cache.num_free_pages == 4 and cache.pages(a) == () and cache.lengths == {a: 0}
    assert torch.all(cache.block_table == -1)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [({"page_size": 24}, ValueError, "multiple of 16"), ({"num_pages": 0}, ValueError, "num_pages"),
     ({"max_seqs": 2.0}, TypeError, "max_seqs"), ({"dtype": torch.int32}, TypeError, "dtype"),
     ({"head_dim": 257}, ValueError, "head_dim must be at most 256"), ({"device": "gpu"}, ValueError, "device"),
     ({"device": 1.5}, TypeError, "device must be")],
)
def test_paged_cache_bad_construction(kwargs, exc, match):
    args = {"num_pages": 4, "page_size": 16, "heads_kv": 1, "head_dim": 8, "max_seqs": 2, "max_seqlen": 32, **kwargs}
    with pytest.raises(exc, match=match):
        PagedKVCache(**args)


# ---- StreamingCache ----------------------------------------------------------------------------------------------


def _retained(t: int, sink: int, window: int) -> list[int]:
    """The tokens StreamingLLM keeps once token t is in: the first ``sink`` and the latest ``window``."""
    return sorted(set(range(min(t + 1, sink))) | set(range(max(sink, t + 1 - window), t + 1)))


@pytest.mark.parametrize(
    "backend,dtype,sink,window,prefill",
    [("torch", torch.float64, 4, 12, 10), ("torch", torch.float64, 0, 8, 3), ("triton", torch.float32, 2, 6, 5),
     ("triton", torch.float16, 3, 13, 16)],
    ids=["torch-sinks", "torch-window-only", "triton-fp32", "triton-fp16-prefill-fills"],
)
def test_streaming_decodes_ten_times_past_capacity(backend, dtype, sink, window, prefill):
    """Issue #5's acceptance: after a prefill, decode until 10x the capacity; every output equals attention over
    exactly the retained tokens, and the cache's memory never moves or grows."""
    gen = torch.Generator().manual_seed(sink * 100 + window)
    b, hq, hkv, d = 2, 4, 2, 16
    capacity = sink + window
    n = 10 * capacity
    q, k, v = _randn(gen, b, n, hq, d, dtype=dtype), _randn(gen, b, n, hkv, d, dtype=dtype), _randn(gen, b, n, hkv, d, dtype=dtype)
    cache = StreamingCache(sink, window, b, hkv, d, dtype=dtype, device=DEVICE)
    memory = [(x.data_ptr(), x.numel()) for x in (cache.k, cache.v)]
    o, lse = cache.attend(q[:, :prefill], k[:, :prefill], v[:, :prefill], return_lse=True, backend=backend)
    _check(o, lse, q[:, :prefill], k[:, :prefill], v[:, :prefill], dtype)
    for t in range(prefill, n):
        o, lse = cache.attend(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], return_lse=True, backend=backend)
        kept = _retained(t, sink, window)
        assert len(kept) <= capacity
        assert sorted(cache.positions(0).tolist()) == kept
        _check(o, lse, q[:, t : t + 1], k[:, kept], v[:, kept], dtype)
    assert [(x.data_ptr(), x.numel()) for x in (cache.k, cache.v)] == memory
    assert cache.seen == (n, n)


def test_streaming_append_keeps_sinks_and_window_of_a_long_prompt():
    gen = torch.Generator().manual_seed(5)
    sink, window, b, hkv, d = 3, 8, 2, 1, 8
    cache = StreamingCache(sink, window, b, hkv, d, dtype=torch.float64, device=DEVICE)
    k, v = _randn(gen, b, 50, hkv, d), _randn(gen, b, 50, hkv, d)
    cache.append(k[:1, :7], v[:1, :7], seqs=[0])  # sequence 0 in two appends, sequence 1 in one
    cache.append(k[:1, 7:], v[:1, 7:], seqs=[0])
    cache.append(k[1:, :45], v[1:, :45], seqs=[1])
    assert cache.seen == (50, 45)
    for s, seen in enumerate((50, 45)):
        positions = cache.positions(s)
        assert sorted(positions.tolist()) == _retained(seen - 1, sink, window)
        assert torch.equal(cache.k[s], k[s, positions]) and torch.equal(cache.v[s], v[s, positions])
    q = _randn(gen, b, 1, 2, d)
    new_k, new_v = _randn(gen, b, 1, hkv, d), _randn(gen, b, 1, hkv, d)
    o = cache.attend(q, new_k, new_v)
    for s, seen in enumerate((50, 45)):
        keys = torch.cat([k[s, :seen], new_k[s]])[_retained(seen, sink, window)]
        values = torch.cat([v[s, :seen], new_v[s]])[_retained(seen, sink, window)]
        R.assert_within_rule("o", o[s : s + 1], R.naive_attention(q[s : s + 1], keys[None], values[None]))


def test_streaming_refuses_a_multi_token_step_that_evicts():
    gen = torch.Generator().manual_seed(6)
    cache = StreamingCache(2, 4, 1, 1, 8, dtype=torch.float64, device=DEVICE)
    cache.append(_randn(gen, 1, 5, 1, 8), _randn(gen, 1, 5, 1, 8))
    before = cache.k.clone()
    with pytest.raises(ValueError, match="one token at a time"):
        cache.attend(_randn(gen, 1, 2, 1, 8), _randn(gen, 1, 2, 1, 8), _randn(gen, 1, 2, 1, 8))
    assert torch.equal(cache.k, before) and cache.seen == (5,)
    with pytest.raises(ValueError, match="q"):  # a malformed q is refused before the ring write
        cache.attend(_randn(gen, 1, 1, 1, 4), _randn(gen, 1, 1, 1, 8), _randn(gen, 1, 1, 1, 8))
    assert torch.equal(cache.k, before) and cache.seen == (5,)


@pytest.mark.gpu
def test_streaming_memory_stays_flat_on_the_gpu():
    sink, window, b, hq, hkv, d = 4, 1020, 4, 32, 8, 128
    cache = StreamingCache(sink, window, b, hkv, d, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, 1, hkv, d, device="cuda", dtype=torch.bfloat16)
    peaks = []
    for step in range(10 * (sink + window)):
        if step % (sink + window) == 0:
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
        cache.attend(q, k, k)
    assert max(peaks[2:]) <= peaks[1] + 2**20, f"peak memory per capacity-length stretch grew: {peaks}"


def test_streaming_refuses_bad_keywords_before_the_ring_write():
    """Once a sequence has wrapped, a one-token step writes into the ring before it attends: a refused keyword
    (backend, scale, num_splits...) leaves the cache as it was, and the next step answers as if it never came."""
    gen = torch.Generator().manual_seed(7)
    cache = StreamingCache(1, 3, 1, 1, 8, dtype=torch.float64, device=DEVICE)
    cache.append(_randn(gen, 1, 6, 1, 8), _randn(gen, 1, 6, 1, 8))
    before = cache.k.clone(), cache.v.clone()
    q, k, v = _randn(gen, 1, 1, 1, 8), _randn(gen, 1, 1, 1, 8), _randn(gen, 1, 1, 1, 8)
    for bad in ({"backend": "bogus"}, {"softmax_scale": float("nan")}, {"num_splits": -1}, {"causal": 1}):
        with pytest.raises((ValueError, TypeError)):
            cache.attend(q, k, v, **bad)
        assert torch.equal(cache.k, before[0]) and torch.equal(cache.v, before[1]) and cache.seen == (6,)


def test_caches_name_bad_seqs_and_oversized_steps():
    """``seqs`` given as one int rather than a list raises TypeError naming it; a step with more new tokens than a
    sequence holds says so (not a length bound below zero)."""
    cache = KVCache(2, 8, 1, 8, dtype=torch.float32, device=DEVICE)
    k = torch.randn(1, 1, 1, 8, device=DEVICE)
    with pytest.raises(TypeError, match="seqs must be a list"):
        cache.append(k, k, seqs=0)
    assert KVCache(1, 8, 1, 8, dtype=torch.float32, device=None).k.device == torch.empty(0).device  # the default
    streaming = StreamingCache(1, 3, 1, 1, 8, dtype=torch.float32, device=DEVICE)
    k6 = torch.randn(1, 6, 1, 8, device=DEVICE)
    with pytest.raises(ValueError, match="k has 6 new tokens, more than the cache holds"):
        streaming.attend(torch.randn(1, 6, 1, 8, device=DEVICE), k6, k6)
    assert streaming.seen == (0,) and not streaming.k.any()


@pytest.mark.parametrize("make", ["kv", "paged", "streaming"])
def test_attend_names_q_for_a_wrong_batch_or_dtype(make):
    """A q with another batch than the sequences attended, or another dtype than the cache's, is the caller's q:
    the error names it (not the cache's own k_cache or block_table), and nothing is written."""
    if make == "kv":
        cache, seqs = KVCache(2, 32, 1, 8, dtype=torch.float32, device=DEVICE), ()
    elif make == "paged":
        cache = PagedKVCache(num_pages=4, page_size=16, heads_kv=1, head_dim=8, max_seqs=2, max_seqlen=32,
                             dtype=torch.float32, device=DEVICE)
        seqs = ([cache.new_sequence()],)
    else:
        cache, seqs = StreamingCache(1, 3, 2, 1, 8, dtype=torch.float32, device=DEVICE), ()
    rows = 1 if make == "paged" else 2
    k = torch.randn(rows, 1, 1, 8, device=DEVICE)
    wrong_batch = torch.randn(rows + 1, 1, 1, 8, device=DEVICE)
    wrong_dtype = torch.randn(rows, 1, 1, 8, device=DEVICE, dtype=torch.float64)
    for q, exc, match in ((wrong_batch, ValueError, "q must have one row"), (wrong_dtype, TypeError, "q must have the")):
        with pytest.raises(exc, match=match):
            cache.attend(q, *seqs, k, k)
    assert not cache.k.any()


def test_a_cuda_device_this_process_lacks_is_refused_naming_it():
    with pytest.raises(ValueError, match="device"):
        KVCache(1, 8, 1, 16, dtype=torch.float32, device=f"cuda:{torch.cuda.device_count() + 3}")
