"""Dropout's random stream: Philox-4x32-10, counter based, so a mask is recomputed anywhere and never stored.

Element ``(b, h, i, j)`` of a call (batch entry or varlen sequence ``b``, query head ``h``, query ``i`` and key ``j``
counted within the sequence) is kept when ``u > dropout_p``, where ``u`` is the first word of
``philox(key=seed, counter=(j, i, b·Hq + h, offset))`` mapped to [0, 1) exactly as ``tl.uint_to_uniform_float`` does.
The Triton kernels (``ops/_common.dropout_keep``) and the torch path (``keep_mask`` below) compute the same words, so
both backends draw the same mask for the same seed. Kept probabilities are scaled by ``1 / (1 − dropout_p)``.

``seed`` and ``offset`` come from a torch generator (``draw_rng_state``): ``torch.manual_seed`` or a ``generator``
makes a call reproducible, and every call draws fresh ones. They travel as an int64 tensor ``[3]`` =
``(seed_lo, seed_hi, offset)`` (each below 2^31) on the inputs' device, so no host synchronisation is needed and the
kernels read them from memory.

The torch implementation works on int64 tensors with 16-bit limbs for the 32 × 32-bit products, so nothing overflows.
"""

from __future__ import annotations

import torch

__all__ = ["draw_rng_state", "keep_mask", "dropout_mask"]

_MASK32 = 0xFFFFFFFF
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_ROUNDS = 10
_UNIFORM_SCALE = 4.6566127342e-10  # tl.uint_to_uniform_float's: the largest with MAX_INT * scale < 1 in float32


def draw_rng_state(generator=None, device="cpu") -> torch.Tensor:
    """``(seed_lo, seed_hi, offset)`` as int64 ``[3]`` on ``device``, drawn from ``generator`` (a ``torch.Generator``
    on that device's type) or from the device's default generator, which ``torch.manual_seed`` seeds."""
    device = torch.device(device)
    if generator is not None and generator.device.type != device.type:
        raise ValueError(f"generator is on {generator.device}, the inputs on {device}: draw from a generator of the "
                         "inputs' device type")
    return torch.randint(0, 2**31, (3,), generator=generator, device=device, dtype=torch.int64)


def _mul32(a: torch.Tensor, b: int):
    """``(hi, lo)`` 32-bit words of the 64-bit product of uint32 values ``a`` (int64 tensor) and the constant ``b``."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    b_hi, b_lo = b >> 16, b & 0xFFFF
    ll, lh, hl = a_lo * b_lo, a_lo * b_hi, a_hi * b_lo
    mid = (ll >> 16) + (lh & 0xFFFF) + (hl & 0xFFFF)
    lo = ((mid & 0xFFFF) << 16) | (ll & 0xFFFF)
    hi = a_hi * b_hi + (lh >> 16) + (hl >> 16) + (mid >> 16)
    return hi, lo


def philox_word(rng: torch.Tensor, c0, c1, c2) -> torch.Tensor:
    """First output word (int64 holding a uint32) of Philox-4x32-10 with key ``(seed_lo, seed_hi)`` and counter
    ``(c0, c1, c2, offset)``; the counters are int64 tensors that broadcast together (values below 2^32)."""
    k0, k1, c3 = rng[0], rng[1], rng[2]
    c0, c1, c2, c3 = torch.broadcast_tensors(c0, c1, c2, c3 + 0 * c0)
    for _ in range(_ROUNDS):
        hi_b, lo_b = _mul32(c2, _ROUND_B)
        hi_a, lo_a = _mul32(c0, _ROUND_A)
        c0, c2, c1, c3 = hi_b ^ c1 ^ k0, hi_a ^ c3 ^ k1, lo_b, lo_a
        k0, k1 = (k0 + _KEY_A) & _MASK32, (k1 + _KEY_B) & _MASK32
    return c0


def _uniform(word: torch.Tensor) -> torch.Tensor:
    """``tl.uint_to_uniform_float`` of a uint32 word: as int32, folded to non-negative, times the scale, in float32."""
    x = torch.where(word >= 2**31, word - 2**32, word)
    x = torch.where(x < 0, -x - 1, x)
    return x.to(torch.float32) * torch.tensor(_UNIFORM_SCALE, dtype=torch.float32, device=x.device)


def keep_mask(rng, b, h, heads_q: int, i, j, dropout_p: float) -> torch.Tensor:
    """True where element ``(b, h, i, j)`` is kept; ``b``, ``h``, ``i``, ``j`` are int64 tensors that broadcast."""
    u = _uniform(philox_word(rng.to(torch.int64), j, i, b * heads_q + h))
    return u > torch.tensor(dropout_p, dtype=torch.float32, device=u.device)


def dropout_mask(rng, batch: int, heads_q: int, seqlen_q: int, seqlen_k: int, dropout_p: float) -> torch.Tensor:
    """The whole keep mask ``[batch, heads_q, seqlen_q, seqlen_k]`` (bool) of one call: for tests and the oracle.

    For ``attention_varlen`` sequence ``b`` uses ``dropout_mask(rng, n_seqs, Hq, max_q, max_k, p)[b, :, :len_q,
    :len_k]``: indices count from each sequence's start.
    """
    dev = rng.device
    ar = lambda n: torch.arange(n, device=dev, dtype=torch.int64)
    return keep_mask(rng, ar(batch)[:, None, None, None], ar(heads_q)[None, :, None, None], heads_q,
                     ar(seqlen_q)[None, None, :, None], ar(seqlen_k)[None, None, None, :], dropout_p)
