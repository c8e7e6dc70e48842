"""`onlineattn bench prefill`: the command line and the FLOPs it counts (timings need the GPU)."""

from onlineattn.bench import prefill as P
from onlineattn.cli import build_parser


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
