"""A progress bar for the bench's timing loops: tqdm's when it is installed (``pip install 'onlineattn[bench]'``),
nothing otherwise. The bar goes to stderr and only where stderr is a terminal (tqdm's ``disable=None``), so logs and
pipes get the plain table lines; those go through ``Progress.print`` so that they never tear the bar.

>>> with Progress(total=2, description="demo") as bar:
...     for name in ("a", "b"):
...         bar.step(name)
...     bar.print("done")
done
"""

from __future__ import annotations

import sys


class Progress:
    """Counts ``total`` steps; ``step(label)`` advances and shows what runs next, ``print(line)`` prints above it."""

    def __init__(self, total: int, description: str):
        try:
            from tqdm import tqdm
        except ImportError:  # the bar is optional: without tqdm the bench prints its lines only
            self._bar = None
        else:
            self._bar = tqdm(total=total, desc=description, unit="run", leave=False, disable=None, file=sys.stderr)

    def step(self, label: str = "") -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(label, refresh=False)
            self._bar.update()

    def print(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
