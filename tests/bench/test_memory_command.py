"""`onlineattn bench memory`: rows in ENGINEERING.md §5's format plus ``mode`` and ``peak_bytes``. Without CUDA it
measures the resident-set peak on the CPU, in a fresh process (as tests/test_memory.py does) so that pages earlier
tests left behind cannot hide what a call touches."""

import json
import subprocess
import sys

import pytest
import torch

from onlineattn.bench import memory as M
from onlineattn.bench.rows import CPU_OUT
from onlineattn.cli import build_parser


def test_options_parse():
    args = build_parser().parse_args(["bench", "memory", "--n", "1024", "4096", "--mode", "fwd", "--causal",
                                      "--providers", "onlineattn", "naive", "--no-write"])
    assert args.func is M.main and args.n == [1024, 4096] and args.mode == "fwd" and args.causal
    assert args.providers == ["onlineattn", "naive"] and args.no_write


@pytest.mark.skipif(not M.cpu_peak_supported(), reason="CPU peak memory needs Linux's /proc/self/clear_refs")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, bench memory measures the GPU; this checks CPU rows")
def test_cpu_rows_show_the_textbook_holding_its_scores(tmp_path):
    out = tmp_path / "rows.jsonl"
    n, heads = 1024, 2
    proc = subprocess.run(
        [sys.executable, "-m", "onlineattn", "bench", "memory", "--n", str(n), "--heads", str(heads), "--d", "32",
         "--mode", "fwd", "--providers", "onlineattn", "naive", "--out", str(out), "--commit", "test"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    rows = {r["provider"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"onlineattn", "naive"}
    for row in rows.values():
        assert {"date", "commit", "gpu", "torch", "triton", "op", "provider", "dtype", "B", "Hq", "Hkv", "Sq", "Sk",
                "d", "causal", "ms"} <= set(row)
        assert (row["op"], row["mode"], row["gpu"], row["commit"], row["Sq"]) == ("memory", "fwd", "cpu", "test", n)
    scores = heads * n * n * 4  # one float32 [H, N, N] score matrix
    assert rows["naive"]["peak_bytes"] >= scores > 4 * rows["onlineattn"]["peak_bytes"], rows


def test_cpu_rows_go_to_the_cpu_file_by_default():
    assert str(CPU_OUT) == "benchmarks/results/cpu.jsonl"
