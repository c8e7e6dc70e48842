"""`onlineattn bench decode`: the command line and the bytes it counts (timings need the GPU)."""

import pytest
import torch

from onlineattn.bench import decode as B
from onlineattn.cli import build_parser


def test_defaults_are_the_issue_grid():
    args = build_parser().parse_args(["bench", "decode"])
    assert args.func is B.main and args.b is None and args.lengths is None
    assert (args.hq, args.hkv, args.d, args.page_size, args.num_splits) == (32, 8, 128, 256, 0)
    assert args.providers == ["onlineattn", "onlineattn-checked", "onlineattn-paged", "sdpa-default", "sdpa-flash"]
    assert (B.BATCHES, B.LENGTHS) == ((1, 16, 64), (4096, 32768, 131072))


def test_options_parse():
    args = build_parser().parse_args(["bench", "decode", "--b", "1", "64", "--L", "4096", "--providers", "onlineattn",
                                      "--cuda-graph", "--no-write", "--page-size", "16"])
    assert args.b == [1, 64] and args.lengths == [4096] and args.providers == ["onlineattn"]
    assert args.cuda_graph and args.no_write and args.page_size == 16


def test_timing_modes_are_exclusive_and_name_the_provider():
    assert build_parser().parse_args(["bench", "decode", "--cold"]).cold
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "decode", "--cold", "--cuda-graph"])
    assert B.TIMINGS == {"eager": "", "graph": "+graph", "cold": "+cold"}


def test_synchronising_providers_are_not_timed_cold_or_in_a_graph(monkeypatch, capsys):
    """onlineattn-checked reads lengths back to the host inside the call: n/a under --cold and --cuda-graph, before
    anything is built or timed."""
    monkeypatch.setattr(B, "_time", lambda fn, timing: pytest.fail("timed"))
    monkeypatch.setattr(B, "environment", lambda commit: {})
    monkeypatch.setattr(B.torch.cuda, "empty_cache", lambda: None)
    for timing in ("cold", "graph"):
        assert B.run([B.Case(1, 16)], ["onlineattn-checked"], out=None, timing=timing) == []
        assert "synchronises with the host" in capsys.readouterr().out


def test_bytes_count_k_and_v():
    assert B.Case(64, 32768).kv_bytes(2) == 2 * 64 * 32768 * 8 * 128 * 2  # 8.6 GB: 2 ms at 4.3 TB/s


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed where CUDA is absent")
def test_without_cuda_it_says_so(capsys):
    assert build_parser().parse_args(["bench", "decode"]).func(build_parser().parse_args(["bench", "decode"])) == 2
    assert "needs a CUDA device" in capsys.readouterr().out
