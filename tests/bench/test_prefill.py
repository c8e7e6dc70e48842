"""`onlineattn bench prefill`: the command line, the peers it knows and how it leaves out those it cannot set up (the
timings need the GPU)."""

import pytest
import torch

from onlineattn import attention
from onlineattn.bench import prefill as P
from onlineattn.cli import build_parser


def test_defaults_measure_every_peer_on_the_grid():
    args = build_parser().parse_args(["bench", "prefill"])
    assert args.func is P.main and args.d is None and args.n is None and args.mode == "fwd"
    assert args.providers == ["onlineattn", "onlineattn-nondet", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient",
                              "sdpa-math", "flex", "flash-attn", "flash-attn-cute"]
    assert (P.HEAD_DIMS, P.SEQLENS) == ((64, 128, 256), (512, 1024, 2048, 4096, 8192, 16384))
    assert len(P.grid()) == 36 and all(c.b * c.n == 16384 and c.h * c.d == 2048 for c in P.grid())


def test_quick_is_d128_at_two_lengths():
    args = build_parser().parse_args(["bench", "prefill", "--quick", "--mode", "all", "--providers", "onlineattn",
                                      "flex", "--no-write"])
    assert args.quick and args.providers == ["onlineattn", "flex"] and args.no_write
    assert (P.QUICK_HEAD_DIMS, P.QUICK_SEQLENS) == ((128,), (1024, 8192))


def test_flops_halve_for_causal():
    full, causal = P.Case(2, 16, 8192, 128, False), P.Case(2, 16, 8192, 128, True)
    assert full.flops("fwd") == 4 * 2 * 16 * 8192 * 8192 * 128 == 2 * causal.flops("fwd")
    assert full.flops("bwd") == 2.5 * full.flops("fwd") and full.flops("fwdbwd") == 3.5 * full.flops("fwd")


def test_unavailable_peers_are_named_and_left_out(monkeypatch, capsys):
    def missing():
        raise ImportError("No module named 'flash_attn'")

    monkeypatch.setitem(P.PROVIDER_SETUPS, "flash-attn", missing)
    found = P.available(["onlineattn", "flash-attn", "sdpa-math"])
    assert list(found) == ["onlineattn", "sdpa-math"] and all(callable(fn) for fn in found.values())
    assert "flash-attn: not available (ImportError: No module named 'flash_attn')" in capsys.readouterr().out


def test_sdpa_math_peer_computes_attention():
    """The peers take onlineattn's [B, S, H, D] layout; math SDPA (runs anywhere) equals our result."""
    q, k, v = (torch.randn(1, 33, 2, 16, dtype=torch.float64) for _ in range(3))
    got = P.available(["sdpa-math"])["sdpa-math"](q, k, v, True)
    assert got.shape == q.shape and torch.allclose(got, attention(q, k, v, causal=True), atol=1e-12)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed where CUDA is absent")
def test_without_cuda_it_says_so(capsys):
    args = build_parser().parse_args(["bench", "prefill", "--quick"])
    assert args.func(args) == 2 and "needs a CUDA device" in capsys.readouterr().out


def test_window_option_parses():
    args = build_parser().parse_args(["bench", "prefill", "--window", "1024", "--n", "16384", "--d", "128",
                                      "--causal", "1", "--mode", "all", "--no-write"])
    assert args.func is P.main and args.window == 1024 and args.n == [16384] and args.d == [128]
    assert build_parser().parse_args(["bench", "prefill"]).window is None
    assert P.window_provider(1024) == "onlineattn-window1024"


def test_window_flops_count_the_band():
    case = P.Case(b=1, h=16, n=16384, d=128, causal=True)
    full = case.flops("fwd")
    band = case.flops("fwd", window=1024)
    assert band == 4.0 * 16 * 128 * (1024 * 1025 / 2 + (16384 - 1024) * 1024)
    assert 0.12 < band / full < 0.125  # the visible pairs: a bit under 1/8 of the causal triangle
    assert case.flops("fwd", window=16384) == full + 4.0 * 16 * 128 * 16384 / 2  # the diagonal counted whole


def test_sinks_option_adds_a_provider_whose_rows_say_so(monkeypatch, capsys):
    """``--sinks``: the provider ``onlineattn-sinks`` joins at every case with the case's FLOPs, its rows carry
    ``"sinks": true``, the table gives its time against the call without sinks, and its per-head logits are made
    once (no call times their creation) and passed to ``attention``."""
    assert build_parser().parse_args(["bench", "prefill", "--sinks"]).sinks
    assert not build_parser().parse_args(["bench", "prefill"]).sinks
    monkeypatch.setattr(P, "_timed", lambda fn, mode, q, k, v, causal, cold: 2.0 if fn is P._ours_sinks else 1.0)
    monkeypatch.setattr(P, "_inputs", lambda case, dtype: tuple(torch.zeros(1, case.n, 1, 1) for _ in range(3)))
    cases = P.grid((64,), (512,), (False, True))
    rows = P.run(cases, ["onlineattn"], ("fwd",), out=None, sinks=True)
    assert [(r["provider"], r["causal"], r.get("sinks")) for r in rows] == [
        ("onlineattn", False, None), (P.SINKS_PROVIDER, False, True), ("onlineattn", True, None),
        (P.SINKS_PROVIDER, True, True)]
    assert rows[1]["tflops"] == pytest.approx(rows[0]["tflops"] / 2)  # the same FLOPs, twice the time
    assert capsys.readouterr().out.count("sinks: 2.000 ms = 2.000 x without 1.000 ms") == 2
    logits = P._sink_logits(4, "cpu")
    assert logits is P._sink_logits(4, "cpu") and logits.tolist() == pytest.approx([-1.0, -1 / 3, 1 / 3, 1.0])
    import onlineattn.api

    seen = {}
    monkeypatch.setattr(onlineattn.api, "attention", lambda q, k, v, **kw: seen.update(kw) or q)
    q = torch.zeros(1, 8, 4, 16)
    P._ours_sinks(q, q, q, True)
    assert seen["sinks"] is logits and seen["causal"] is True and seen["backend"] == "triton"


def test_first_case_is_timed_once_and_dropped_before_the_grid(monkeypatch):
    """A fresh process's first timed point reads low (NOTES v25): every provider and mode times the first case once,
    unrecorded, before the grid; the rows are the grid's."""
    calls = []

    def timed(fn, mode, q, k, v, causal, cold):
        calls.append((fn.__name__, mode, q.shape[1]))
        return 1.0

    monkeypatch.setattr(P, "_timed", timed)
    monkeypatch.setattr(P, "_inputs", lambda case, dtype: tuple(torch.zeros(1, case.n, 1, 1) for _ in range(3)))
    cases = P.grid((64,), (512, 1024), (False,))
    rows = P.run(cases, ["onlineattn", "onlineattn-nondet", "sdpa-math"], ("fwd", "bwd"), out=None)
    points = lambda n: [("_ours", "fwd", n), ("run", "fwd", n), ("_ours", "bwd", n), ("_ours_any_order", "bwd", n),
                        ("run", "bwd", n)]  # sdpa-math's function is run; onlineattn-nondet's forward is ours
    assert calls == points(512) + points(512) + points(1024)
    assert len(rows) == 10 and {r["Sq"] for r in rows} == {512, 1024}


def test_settling_leaves_a_failing_peer_to_the_grid_and_stops_on_ours(monkeypatch):
    def timed(fn, mode, q, k, v, causal, cold):
        if fn.__name__ == "run":  # sdpa-math's function: a peer that fails
            raise RuntimeError("peer failed")
        return 1.0

    monkeypatch.setattr(P, "_timed", timed)
    monkeypatch.setattr(P, "_inputs", lambda case, dtype: tuple(torch.zeros(1, case.n, 1, 1) for _ in range(3)))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    rows = P.run(P.grid((64,), (512,), (False,)), ["onlineattn", "sdpa-math"], ("fwd",), out=None)
    assert [r["provider"] for r in rows] == ["onlineattn"]  # the peer's cell is n/a, the run goes on
    monkeypatch.setattr(P, "_timed", lambda *a: (_ for _ in ()).throw(RuntimeError("ours failed")))
    with pytest.raises(RuntimeError, match="ours failed"):
        P._settle(P.grid((64,), (512,), (False,))[0], {"onlineattn": P._ours}, ("fwd",), torch.float32)


def test_cold_times_every_provider_cold_and_names_its_rows(monkeypatch):
    """``--cold``: every provider's call (the settling pass's too) is timed by its device work alone, and the rows
    say so in the provider's name; without it, none is."""
    assert build_parser().parse_args(["bench", "prefill", "--cold"]).cold
    assert not build_parser().parse_args(["bench", "prefill"]).cold
    seen = []
    monkeypatch.setattr(P, "_timed", lambda fn, mode, q, k, v, causal, cold: seen.append(cold) or 1.0)
    monkeypatch.setattr(P, "_inputs", lambda case, dtype: tuple(torch.zeros(1, case.n, 1, 1) for _ in range(3)))
    cases = P.grid((64,), (512,), (False,))
    for cold in (True, False):
        seen.clear()
        rows = P.run(cases, ["onlineattn", "sdpa-math"], ("fwd", "bwd"), out=None, cold=cold)
        assert seen == [cold] * 8
        assert [r["provider"] for r in rows] == [p + ("+cold" if cold else "") for p in ["onlineattn", "sdpa-math"] * 2]


@pytest.mark.parametrize("mode", ["fwd", "bwd", "fwdbwd"])
@pytest.mark.parametrize("cold", [True, False])
def test_cold_timing_holds_the_gpu_longer_than_a_training_step_host_path(mode, cold, monkeypatch):
    """Under ``--cold`` every mode's call goes to ``time_cold`` with ``COLD_HOLD_CYCLES``, a hold that outlasts a
    backward step's host path (up to ~760 µs measured on the H200 machine, NOTES v25); without it, to do_bench."""
    import triton.testing

    timings = []
    monkeypatch.setattr(P, "time_cold", lambda call, hold_cycles: timings.append(("cold", hold_cycles)) or 1.0)
    monkeypatch.setattr(triton.testing, "do_bench", lambda call, **kw: timings.append(("do_bench", call())) or 2.0)
    monkeypatch.setattr(P, "warm_up_gpu", lambda: 0)
    q = torch.ones(1, 4, 1, 8)
    got = P._timed(lambda q, k, v, causal: q * k + v, mode, q, q, q, False, cold=cold)
    assert (got, [t[0] for t in timings]) == ((1.0, ["cold"]) if cold else (2.0, ["do_bench"]))
    if cold:
        assert timings[0][1] == P.COLD_HOLD_CYCLES and P.COLD_HOLD_CYCLES / 1.98e9 > 1e-3  # over 1 ms
