"""The ``onlineattn`` command: ``onlineattn demo | info | bench``.

Each subcommand's parser stores its handler as ``func``, a callable ``(args: argparse.Namespace) -> int`` whose
result is the exit code. Bad arguments end in argparse's usage error (exit code 2).

>>> parser = build_parser()
>>> args = parser.parse_args(["demo", "--max-n", "1024"])
>>> args.command, args.max_n, str(args.out)
('demo', 1024, 'demo.png')
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

MIN_DEMO_N = 16  # below this the sweep measures nothing but Python overhead


def _int_at_least(minimum: int):
    """An argparse ``type`` accepting integers >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    return parse


def _png_path(text: str) -> Path:
    """An argparse ``type`` for the demo's output: a .png path in an existing directory."""
    path = Path(text)
    if path.suffix.lower() != ".png":
        raise argparse.ArgumentTypeError(f"expected a path ending in .png, got {text!r}")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"directory {str(path.parent)!r} does not exist")
    return path


# ---------------------------------------------------------------------------------------------------------
# demo


def _run_demo(args: argparse.Namespace) -> int:
    from . import demo  # lazy: `onlineattn info` should not pay for the demo's imports

    return demo.run(out=args.out, max_n=args.max_n)


def _add_demo_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "demo",
        help="show that online softmax is exact and needs O(N) memory",
        description="Print the float64 exactness gap of the online recurrence, then measure peak memory and time "
        "of naive attention vs onlineattn.attention for a doubling range of N, and plot them.",
    )
    p.add_argument(
        "--out", type=_png_path, default=Path("demo.png"), help="where to write the plot (default: demo.png)"
    )
    p.add_argument(
        "--max-n",
        type=_int_at_least(MIN_DEMO_N),
        default=None,
        metavar="N",
        help="largest sequence length of the sweep (default: 8192 on CPU, 32768 on CUDA)",
    )
    p.set_defaults(func=_run_demo)


# ---------------------------------------------------------------------------------------------------------
# info


def _version(module_name: str) -> str:
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return "not installed"
    except Exception as exc:  # noqa: BLE001 - a broken install should be reported, not crash `info`
        return f"import failed ({type(exc).__name__}: {exc})"
    return str(getattr(module, "__version__", "unknown"))


def info_lines() -> list[str]:
    """``name: version`` lines for onlineattn and what it runs on, then the CUDA devices (if any)."""
    import torch

    from . import __version__

    lines = [
        f"onlineattn: {__version__}",
        f"python: {sys.version.split()[0]}",
        f"torch: {torch.__version__}",
        f"triton: {_version('triton')}",
        f"numpy: {_version('numpy')}",
        f"matplotlib: {_version('matplotlib')}",
    ]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            lines.append(f"cuda:{i}: {torch.cuda.get_device_name(i)} (CUDA {torch.version.cuda})")
    else:
        lines.append(f"cuda: none (cpu, {torch.get_num_threads()} threads)")
    return lines


def _run_info(args: argparse.Namespace) -> int:
    print("\n".join(info_lines()))
    return 0


def _add_info_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "info",
        help="print versions and the CUDA device",
        description="Print the versions of onlineattn, python, torch, triton, numpy and matplotlib, "
        "and the CUDA devices if any.",
    )
    p.set_defaults(func=_run_info)


# ---------------------------------------------------------------------------------------------------------
# bench


def _add_bench_parser(subparsers) -> None:
    """Register ``bench`` and its subcommands; each module under ``bench/`` adds its own parser."""
    from .bench import decode, long, memory, prefill, report

    p = subparsers.add_parser("bench", help="benchmark against SDPA's backends in the same run (needs CUDA)")
    bench_commands = p.add_subparsers(dest="bench_command", required=True,
                                      metavar="{prefill,decode,long,memory,report}")
    prefill.add_parser(bench_commands)
    decode.add_parser(bench_commands)
    long.add_parser(bench_commands)
    memory.add_parser(bench_commands)
    report.add_parser(bench_commands)


# ---------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="onlineattn", description="Exact attention by the online-softmax recurrence.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="{demo,info,bench}")
    _add_demo_parser(subparsers)
    _add_info_parser(subparsers)
    _add_bench_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``onlineattn`` console script and of ``python -m onlineattn``; returns the exit code."""
    args = build_parser().parse_args(argv)
    return args.func(args)
