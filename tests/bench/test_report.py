"""`onlineattn bench report`: which rows it takes, the Markdown it writes, and PNGs that exist (looking at them is a
person's job; docs/report/ holds the committed ones)."""

import json

import pytest

from onlineattn.bench import report as Rp
from onlineattn.cli import build_parser

pytest.importorskip("matplotlib", reason="the report's plots need the [plots] extra")

ENV = {"date": "2026-12-01", "gpu": "NVIDIA H200", "torch": "2.11.0+cu130", "triton": "3.6.0", "dtype": "bfloat16"}


def _row(commit, op, provider, n, value, **extra):
    unit = "tbps" if op == "decode" else "tflops"
    return {**ENV, "commit": commit, "op": op, "provider": provider, "B": 16384 // n, "Hq": 16, "Hkv": 16, "Sq": n,
            "Sk": n, "d": 128, "causal": False, "ms": 1.0, unit: value, **extra}


@pytest.fixture
def results(tmp_path):
    rows = [_row("aaa", "fwd", "onlineattn", n, 100 + n / 1000) for n in (1024, 4096)]
    rows += [_row("bbb", "fwd", p, n, v + n / 1000) for p, v in (("onlineattn", 300), ("sdpa-flash", 200))
             for n in (1024, 4096)]
    rows.append(_row("bbb", "fwd", "onlineattn", 4096, 333.3))  # measured again: the later row counts
    rows += [_row("bbb", "decode", p, n, v, B=1, Sq=1) for p, v in (("onlineattn", 3.5), ("sdpa-flash", 3.0))
             for n in (4096, 32768)]
    path = tmp_path / "h200.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    memory = [{**_row("ccc", "memory", p, n, 0, mode=m), "gpu": "cpu", "peak_bytes": b * n}
              for p, b in (("onlineattn", 10), ("naive", 1000)) for n in (512, 1024) for m in ("fwd", "fwdbwd")]
    cpu = tmp_path / "cpu.jsonl"
    cpu.write_text("".join(json.dumps(r) + "\n" for r in memory))
    return path, cpu


def test_latest_takes_the_last_commit_and_its_last_row(results):
    rows = Rp.load(results[0])
    commit, now = Rp.latest(rows, "fwd")
    assert commit == "bbb" and len(now) == 4
    assert {(r["provider"], r["Sq"]): r["tflops"] for r in now}[("onlineattn", 4096)] == 333.3
    assert Rp.commits(rows, "fwd") == ["aaa", "bbb"] and Rp.latest(rows, "bwd") == (None, [])


def test_latest_prefers_the_last_full_grid_over_a_later_quick_run(results):
    rows = Rp.load(results[0]) + [_row("ccc", "fwd", "onlineattn", 1024, 999.0)]  # one point, measured last
    commit, now = Rp.latest(rows, "fwd")
    assert commit == "bbb" and len(now) == 4
    assert Rp.latest(rows, "fwd", "ccc")[0] == "ccc"


def test_report_writes_plots_and_tables(results, tmp_path):
    out = tmp_path / "report"
    written = Rp.run(*results[:1], out_dir=out, memory_results=results[1])
    names = sorted(p.name for p in written)
    assert names == ["decode.png", "memory.png", "prefill_fwd.png", "report.md"]  # no bwd rows, no bwd plot
    for path in written:
        if path.suffix == ".png":
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    text = (out / "report.md").read_text()
    assert "| 128 | no | 4096 | 4 | 16 | 333.3 | 204.1 |" in text  # onlineattn first, the re-measured value
    assert "commit `bbb`" in text and "commit `ccc`" in text and "| fwd | 1024 |" in text


def test_the_command_line(results, tmp_path, capsys):
    args = build_parser().parse_args(["bench", "report", "--results", str(results[0]), "--memory-results",
                                      str(results[1]), "--out-dir", str(tmp_path / "r")])
    assert args.func(args) == 0 and "report.md" in capsys.readouterr().out
    args = build_parser().parse_args(["bench", "report", "--results", str(tmp_path / "absent.jsonl")])
    assert args.func(args) == 2


def test_a_provider_timed_another_way_takes_its_colour_dashed_or_dotted():
    assert Rp.line_style("onlineattn") == (Rp.COLORS["onlineattn"], "o-")
    assert Rp.line_style("sdpa-default+graph") == (Rp.COLORS["sdpa-default"], "o--")
    assert Rp.line_style("onlineattn-nondet+cold") == (Rp.COLORS["onlineattn-nondet"], "o:")
    assert Rp.line_style("someone-new") == (None, "o-")


def test_ratios_against_cudnn_pair_each_timing_and_skip_variant_rows(tmp_path, capsys):
    """Each onlineattn provider over sdpa-cudnn at each point, a +cold provider over sdpa-cudnn+cold; window rows
    (band FLOPs), sink rows (a variant cuDNN does not run) and points without a peer row are left out; ``--ratios``
    prints the table and writes nothing, and refuses (exit 2, naming the option) a commit or op with no such rows,
    and ``--commit`` without ``--ratios``."""
    values = {"onlineattn": 330, "onlineattn-nondet": 345, "sdpa-cudnn": 300, "onlineattn+cold": 320,
              "sdpa-cudnn+cold": 400, "onlineattn-window1024": 900, "onlineattn-sinks": 310}
    rows = [_row("ccc", "bwd", p, n, v) for p, v in values.items() for n in (1024, 2048)]
    rows.append(_row("ccc", "bwd", "onlineattn", 4096, 500))  # no peer row at 4096
    commit, ours, lines = Rp.ratios(rows, "bwd")
    assert commit == "ccc" and ours == ["onlineattn", "onlineattn-nondet", "onlineattn+cold"]
    assert lines == [[128, "no", n, "1.10", "1.15", "0.80"] for n in (1024, 2048)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    args = build_parser().parse_args(["bench", "report", "--results", str(path), "--out-dir", str(out),
                                      "--ratios", "bwd"])
    assert args.func(args) == 0 and not out.exists()
    assert "| 128 | no | 2048 | 1.10 | 1.15 | 0.80 |" in capsys.readouterr().out
    for bad, named in ((["--ratios", "bwd", "--commit", "zzz"], "--commit zzz"), (["--ratios", "fwd"], "--ratios fwd"),
                       (["--commit", "ccc"], "--commit")):
        args = build_parser().parse_args(["bench", "report", "--results", str(path), "--out-dir", str(out), *bad])
        assert args.func(args) == 2 and not out.exists()  # no such rows, or --commit without --ratios: refused
        assert named in capsys.readouterr().out
    assert "| 128 | no | 1024 | 1.10 | 1.15 | 0.80 |" in Rp.markdown(rows, [], {"bwd": tmp_path / "b.png",
                                                                              "decode": tmp_path / "d.png"})
