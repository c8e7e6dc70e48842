"""A MODEL ON PAPER, not a measurement: per-step compute vs. communication of causal zigzag ring attention.

For a ring of ``world`` GPUs over a sequence of S tokens (shard n = S / world per GPU, zigzag chunks c = n / 2), every
step of the forward computes one ``2c × c`` (or ``c × 2c``) block, or half of the ``n × n`` diagonal, i.e.
``2·H·n²·d`` FLOPs, while the next K/V shard (``2·n·Hkv·d`` elements in bf16) crosses one link. The backward computes
2.5× the FLOPs and moves K/V (bf16) plus the travelling dK/dV (float32): 3× the bytes. Compute grows as n², transfer
as n, so above a crossover shard length the overlap can hide the transfer completely:

    forward:  n* = 2·Hkv·F_fwd / (H·BW)        backward: n* = 12·Hkv·F_bwd / (5·H·BW)   (latency ignored)

Inputs, each stated:
- forward TFLOP/s: the latest ``onlineattn`` ``fwd`` rows of ``results/h200.jsonl`` at d = 128, bf16, read at the
  grid length nearest the block's side (non-causal rows for off-diagonal blocks); beyond N = 16384 the N = 16384 rate;
- backward TFLOP/s: likewise from the latest ``bwd`` rows (the Triton backward, measured since commit 6b7a5ed);
  ``--bwd-tflops`` overrides it with one flat rate;
- link: 450 GB/s one way per GPU (H200 NVLink 4: 900 GB/s bidirectional), plus a per-transfer latency (default
  20 µs, an assumption); NCCL's achieved point-to-point rate is lower, so pass ``--link-gbs`` to see its effect;
- the merge of partial states is left out: ~8 memory-bound passes over ``[n, H, d]`` in float32, ~2 ms per step at
  n = 131072 on 4.27 TB/s, not hidden, and small beside the block.

    python benchmarks/ring_model.py [--seqlen 1048576] [--world 8] [--bwd-tflops R] [--link-gbs 450]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "h200.jsonl"


def measured_rates(op: str, path: Path = RESULTS, d: int = 128) -> dict[tuple[int, bool], float]:
    """``{(N, causal): TFLOP/s}`` of onlineattn's bf16 ``op`` (fwd or bwd) at head dim d, the latest row of each."""
    rates = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row["op"] == op and row["provider"] == "onlineattn" and row["d"] == d and row["dtype"] == "bfloat16":
            rates[row["Sq"], row["causal"]] = row["tflops"]
    return rates


def rate_at(rates: dict, length: int, causal: bool) -> float:
    """The measured rate at the grid length nearest ``length`` (the largest grid point beyond the grid)."""
    grid = sorted(n for n, c in rates if c == causal)
    nearest = min(grid, key=lambda n: abs(n - min(length, grid[-1])))
    return rates[nearest, causal]


def step_model(n: int, heads: int, kv_heads: int, d: int, rates: dict, bwd_rates: dict, link_gbs: float,
               latency_us: float) -> dict:
    """Milliseconds of one off-diagonal ring step at shard length n: compute and transfer, forward and backward."""
    fwd_flops = 2.0 * heads * n * n * d  # a 2c × c block, c = n / 2: 4·H·(2c)·c·d
    fwd_ms = fwd_flops / (rate_at(rates, n // 2, causal=False) * 1e9)
    bwd_tflops = rate_at(bwd_rates, n // 2, causal=False)
    kv_bytes = 2 * n * kv_heads * d * 2  # K and V in bf16
    link = lambda nbytes: nbytes / (link_gbs * 1e6) + latency_us / 1e3  # noqa: E731  (ms)
    return {
        "fwd_compute": fwd_ms, "fwd_comm": link(kv_bytes),
        "bwd_compute": 2.5 * fwd_flops / (bwd_tflops * 1e9), "bwd_comm": link(kv_bytes + 2 * kv_bytes),  # + dK/dV fp32
    }


def main() -> None:
    p = argparse.ArgumentParser(description="model of a causal zigzag ring's per-step compute vs. communication")
    p.add_argument("--seqlen", type=int, default=1 << 20)
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--bwd-tflops", type=float, default=None, help="one flat backward rate instead of the bwd rows")
    p.add_argument("--link-gbs", type=float, default=450.0, help="GB/s one way per GPU")
    p.add_argument("--latency-us", type=float, default=20.0, help="per transfer")
    a = p.parse_args()
    rates = measured_rates("fwd", d=a.head_dim)
    bwd_rates = measured_rates("bwd", d=a.head_dim)
    if a.bwd_tflops is not None:
        bwd_rates = {key: a.bwd_tflops for key in bwd_rates}
    fwd_star = 2 * a.kv_heads * rate_at(rates, 1 << 30, False) * 1e12 / (a.heads * a.link_gbs * 1e9)
    bwd_star = 12 * a.kv_heads * rate_at(bwd_rates, 1 << 30, False) * 1e12 / (5 * a.heads * a.link_gbs * 1e9)
    source = f"{a.bwd_tflops:g} TFLOP/s (given)" if a.bwd_tflops is not None else "rates from the bwd rows"
    print(f"MODEL (not measured): causal zigzag ring, H={a.heads}, Hkv={a.kv_heads}, d={a.head_dim}, bf16; "
          f"link {a.link_gbs:g} GB/s + {a.latency_us:g} us; fwd rates from the fwd rows, bwd {source}")
    print(f"crossover shard length (latency ignored): forward n* ~ {fwd_star:,.0f}, backward n* ~ {bwd_star:,.0f}")
    print(f"{'n / GPU':>9} {'S at world':>12} {'fwd comp ms':>12} {'fwd comm ms':>12} {'comm/comp':>9} "
          f"{'bwd comp ms':>12} {'bwd comm ms':>12} {'comm/comp':>9}  overlap hides comm?")
    target = a.seqlen // a.world
    for n in sorted({1024, 2048, 4096, 8192, 16384, 65536, target}):
        m = step_model(n, a.heads, a.kv_heads, a.head_dim, rates, bwd_rates, a.link_gbs, a.latency_us)
        rf, rb = m["fwd_comm"] / m["fwd_compute"], m["bwd_comm"] / m["bwd_compute"]
        verdict = "yes" if max(rf, rb) < 1 else ("backward only" if rb < 1 else "no: communication-bound")
        mark = " <- S = %d over %d GPUs" % (a.seqlen, a.world) if n == target else ""
        print(f"{n:9,} {n * a.world:12,} {m['fwd_compute']:12.3f} {m['fwd_comm']:12.3f} {rf:9.3f} "
              f"{m['bwd_compute']:12.3f} {m['bwd_comm']:12.3f} {rb:9.3f}  {verdict}{mark}")
    m = step_model(target, a.heads, a.kv_heads, a.head_dim, rates, bwd_rates, a.link_gbs, a.latency_us)
    fwd_total, bwd_total = a.world * m["fwd_compute"], a.world * m["bwd_compute"]
    # world − 1 K/V transfers per pass; the backward also sends dK/dV world times (the last one home).
    fwd_comm = (a.world - 1) * m["fwd_comm"]
    bwd_comm = fwd_comm + a.world * (m["bwd_comm"] - m["fwd_comm"])
    print(f"at S = {a.seqlen:,}: forward ~ {fwd_total / 1e3:.2f} s, backward ~ {bwd_total / 1e3:.2f} s per pass "
          f"({a.world} steps); without overlap the transfers would add ~{fwd_comm:.0f} ms and ~{bwd_comm:.0f} ms")


if __name__ == "__main__":
    main()
