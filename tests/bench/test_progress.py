"""The bench's progress bar: tqdm's where installed, plain lines without it; table lines always reach stdout."""

import builtins
import sys

import pytest

from onlineattn.bench.progress import Progress


def test_lines_reach_stdout_with_tqdm(capsys):
    pytest.importorskip("tqdm", reason="the [bench] extra's tqdm draws the bar")
    with Progress(total=3, description="test") as bar:
        for label in ("a", "b", "c"):
            bar.step(label)
            bar.print(f"row {label}")
    assert capsys.readouterr().out.splitlines() == ["row a", "row b", "row c"]


def test_without_tqdm_it_prints_plain_lines(monkeypatch, capsys):
    real_import = builtins.__import__

    def no_tqdm(name, *args, **kwargs):
        if name == "tqdm":
            raise ImportError("No module named 'tqdm'")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "tqdm", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_tqdm)
    with Progress(total=2, description="test") as bar:
        bar.step("a")
        bar.print("row a")
    captured = capsys.readouterr()
    assert captured.out == "row a\n" and captured.err == ""
