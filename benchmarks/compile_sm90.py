"""Compile the Triton kernels for sm_90 on a machine without a GPU, and compare the plain kernels with a base commit.

Triton ships ptxas, so its whole pipeline (TTIR -> TTGIR -> PTX -> cubin) runs on a CPU once the active driver reports
an sm_90 target; the launchers are called as usual, with every launch turned into a compile-only warm-up.

    python benchmarks/compile_sm90.py --base 6ed21b2      # plain kernels: PTX and SASS of HEAD's tree vs the base's
    python benchmarks/compile_sm90.py --variants           # every score variant compiles, with its shared memory

The plain kernels are the Triton ones of ``PLAIN_CASES`` and the Gluon (Hopper) ones: every tile the forward's and the
backward's tables route to over the bench grid (``GLUON_LENGTHS``; deterministic or not), launched plain, with a
causal window and sinks, and as a non-causal persistent launch whose last lap splits into pieces.

The comparison ignores debug info, labels and parameter declarations (new unused parameters are expected), so
"identical" means the same PTX instructions in the same order; SASS is compared as nvdisasm prints it.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLAIN_CASES = [(d, causal, dtype) for d in (64, 128, 256) for causal in (False, True) for dtype in ("bfloat16",)]
PLAIN_CASES += [(128, True, "float32"), (128, True, "float16")]
GLUON_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)


def _compile_only(src: str):
    """Import onlineattn from ``src`` with launches turned into sm_90 compiles; return (module, list of compiled)."""
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["ONLINEATTN_LAUNCH_CACHE"] = "0"  # every launch through run(), where the compiles are collected
    sys.path.insert(0, src)
    import triton
    import triton.runtime.jit as jit
    from probe_launch import Sm90NoLaunch

    triton.runtime.driver.set_active(Sm90NoLaunch())
    compiled = []
    run = jit.JITFunction.run

    def warmup_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, kernel))
        return kernel

    jit.JITFunction.run = warmup_only
    return compiled


def _inputs(d, dtype, b=2, sq=1024, sk=1024, hq=8, hkv=2):
    import torch

    g = torch.Generator().manual_seed(0)
    make = lambda *shape: torch.randn(*shape, generator=g).to(getattr(torch, dtype))
    return make(b, sq, hq, d), make(b, sk, hkv, d), make(b, sk, hkv, d), make(b, sq, hq, d)


def _dump(compiled, out: Path, tag: str) -> None:
    for i, (name, kernel) in enumerate(compiled):
        (out / f"{tag}-{i}-{name}.ptx").write_text(kernel.asm["ptx"])
        (out / f"{tag}-{i}-{name}.cubin").write_bytes(kernel.asm["cubin"])
        print(f"{tag:28} {name:34} shared {kernel.metadata.shared:7d} B", flush=True)
    compiled.clear()


def compile_plain(src: str, out: Path) -> None:
    compiled = _compile_only(src)
    import torch
    from onlineattn.ops import _configs as C
    from onlineattn.ops import backward as B
    from onlineattn.ops import forward as F

    for d, causal, dtype in PLAIN_CASES:
        q, k, v, do = _inputs(d, dtype)
        dt = getattr(torch, dtype)
        o, _ = F.forward(q, k, v, d**-0.5, causal, config=C.fwd_config(d, d, dt, causal, "cuda", seqlen_q=q.shape[1]))
        B.backward(do, q, k, v, o, torch.randn(2, 8, 1024), d**-0.5, causal, config=C.bwd_config(d, d, dt, "cuda", causal=causal))
        _dump(compiled, out, f"{dtype}-d{d}-causal{int(causal)}")
    compile_gluon(compiled, out)


def compile_gluon(compiled, out: Path) -> None:
    """The Hopper kernels (forward_sm90, backward_sm90) at every tile their tables route to: plain, with a causal
    window (and sinks, for the forward), and split (a non-causal persistent launch with a partial last lap: five SMs
    for the backward, 133 tiles for the forward)."""
    import torch
    from onlineattn.ops import _configs as C
    from onlineattn.ops import backward_sm90, forward_sm90

    bf16 = torch.bfloat16
    grid = [(d, causal, n) for d in (64, 128, 256) for causal in (False, True) for n in GLUON_LENGTHS]
    fwd = {(d, causal, C.fwd_config(d, d, bf16, causal, "cuda", seqlen_q=n, seqlen_k=n, ws_ok=True))
           for d, causal, n in grid}
    for i, (d, causal, cfg) in enumerate(sorted(fwd, key=str)):
        q, k = torch.randn(2, 300, 8, d, dtype=bf16), torch.randn(2, 300, 2, d, dtype=bf16)
        o, lse = torch.empty_like(q), torch.empty(2, 8, 300)
        forward_sm90.launch(q, k, k, o, lse, 0.1, causal, cfg)
        if causal:
            forward_sm90.launch(q, k, k, o, lse, 0.1, True, cfg, band=(37, 0), sinks=torch.zeros(8))
        elif cfg.persistent:
            q = torch.randn(1, cfg.block_m * 133, 1, d, dtype=bf16)  # 133 tiles over 132 programs
            k = torch.randn(1, C.FWD_TAIL_MIN_KEYS[d], 1, d, dtype=bf16)
            forward_sm90.launch(q, k, k, torch.empty_like(q), torch.empty(1, 1, q.shape[1]), 0.1, False, cfg)
        _dump(compiled, out, f"gluon-fwd-{i}-d{d}-causal{int(causal)}")
    bwd = {(d, causal, C.bwd_config(d, d, bf16, "cuda", causal=causal, ws_ok=True, seqlen_q=n, seqlen_k=n,
                                    deterministic=det, ordered_blocks=132).dkdv)
           for d, causal, n in grid for det in (False, True)}
    tail, sms = dict(C.BWD_TAIL_MIN_KEYS), backward_sm90._sm_count
    for i, (d, causal, tile) in enumerate(sorted(bwd, key=str)):
        if not tile.gluon:
            continue
        cases = [(None, 300)]  # (a causal window's left side, keys)
        if causal:
            cases.append((37, 300))
        elif tile.persistent:
            cases.append((None, 4096))  # split: its 128 key blocks over five SMs, the tail rule at any length
        for left, n in cases:
            split = n > 300
            backward_sm90.BWD_TAIL_MIN_KEYS.update({d: 0} if split else {})
            backward_sm90._sm_count = (lambda device: 5) if split else sms
            rows = -(-n // tile.block_m) * tile.block_m
            q, k, lse = torch.randn(2, n, 8, d, dtype=bf16), torch.randn(2, n, 2, d, dtype=bf16), torch.randn(2, 8, n)
            backward_sm90.launch_dkdv(q, k, k, q, lse, lse, torch.empty_like(k), torch.empty_like(k), 0.1, causal,
                                      tile, dq_acc=torch.zeros(2, rows, 8, d) if tile.fused_dq else None,
                                      dq_sem=torch.zeros(2, 8, rows // tile.block_m, dtype=torch.int32)
                                      if tile.dq_ordered else None, window_left=left)
            backward_sm90.BWD_TAIL_MIN_KEYS.clear(), backward_sm90.BWD_TAIL_MIN_KEYS.update(tail)
            backward_sm90._sm_count = sms
        _dump(compiled, out, f"gluon-bwd-{i}-d{d}-causal{int(causal)}")


def compile_variants(src: str, out: Path) -> None:
    compiled = _compile_only(src)
    import torch
    from onlineattn._mods import Mods
    from onlineattn.dropout import draw_rng_state
    from onlineattn.ops import _configs as C
    from onlineattn.ops import backward as B
    from onlineattn.ops import bias_grad
    from onlineattn.ops import forward as F

    bias_grad.bias_grad_config = lambda d, dtype, device: C.bias_grad_config(d, dtype, "cuda")
    for dtype in ("bfloat16", "float16", "float32"):
        dt = getattr(torch, dtype)
        for d in (64, 128, 256):
            q, k, v, do = _inputs(d, dtype, sq=1000, sk=1300)
            cfg_f = C.fwd_config(d, d, dt, True, "cuda", variants=True)
            cfg_b = C.bwd_config(d, d, dt, "cuda", causal=True)
            everything = Mods(300, 0, 15.0, torch.rand(2, 8), torch.randn(1, 8, 1, 1300).to(dt),
                              torch.randn(8).to(dt), 0.1, draw_rng_state(torch.Generator()))
            cu = torch.tensor([0, 500, 500, 1000], dtype=torch.int32)
            varlen = Mods(64, 0, 0.0, None, None, torch.randn(8).to(dt), 0.0, None, cu, cu, 500, 500)
            for tag, mods, packed in (("all", everything, False), ("varlen-window-sinks", varlen, True)):
                args = (q[0], k[0, :1000], v[0, :1000], do[0]) if packed else (q, k, v, do)
                lse = torch.randn(8, 1000) if packed else torch.randn(2, 8, 1000)
                o, _ = F.forward(*args[:3], d**-0.5, True, mods=mods, config=cfg_f)
                B.gradients(args[3], *args[:3], o, lse, d**-0.5, True, mods=mods, config=cfg_b,
                            bias_grad=mods.attn_bias is not None)
                _dump(compiled, out, f"{tag}-{dtype}-d{d}")


def _ptx_body(text: str) -> list[str]:
    text = re.split(r"\.section\s+\.debug", text)[0]
    lines = []
    for line in text.splitlines():
        s = line.strip()
        if not s or s.startswith((".loc", ".file", "//", ".param")) or "ld.param" in s or re.match(r"\$L__tmp\d+:", s):
            continue
        lines.append(re.sub(r"\$L__tmp\d+", "$L__tmp", s))
    return lines


def _sass(cubin: Path) -> list[str]:
    import triton

    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    text = subprocess.run([str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    return [re.sub(r"/\*[0-9a-f]+\*/", "", s).strip() for s in text.splitlines() if re.match(r"\s*/\*[0-9a-f]+\*/", s)]


def compare(base: Path, head: Path) -> int:
    different = 0
    for ptx in sorted(base.glob("*.ptx")):
        other = head / ptx.name
        if not other.exists():  # the trees' tables route to other tiles: nothing to compare it with
            different += 1
            print(f"{ptx.stem:58} not built by HEAD's tree")
            continue
        same_ptx = _ptx_body(ptx.read_text()) == _ptx_body(other.read_text())
        same_sass = _sass(ptx.with_suffix(".cubin")) == _sass(other.with_suffix(".cubin"))
        different += not (same_ptx and same_sass)
        print(f"{ptx.stem:58} PTX {'identical' if same_ptx else 'DIFFERS'}, SASS {'identical' if same_sass else 'differs'}")
    return different


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", help="commit whose plain kernels HEAD's working tree is compared with")
    p.add_argument("--variants", action="store_true", help="compile every score variant instead")
    p.add_argument("--worker", nargs=3, metavar=("KIND", "SRC", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        kind, src, out = args.worker
        (compile_plain if kind == "plain" else compile_variants)(src, Path(out))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        env = {**os.environ, "TRITON_CACHE_DIR": str(tmp / "cache"), "PYTHONDONTWRITEBYTECODE": "1"}
        worker = lambda kind, src, out: subprocess.run(
            [sys.executable, __file__, "--worker", kind, str(src), str(out)], env=env, check=True)
        if args.variants:
            (tmp / "variants").mkdir()
            worker("variants", ROOT / "src", tmp / "variants")
            return 0
        if not args.base:
            p.error("give --base COMMIT or --variants")
        subprocess.run(f"git -C {ROOT} archive {args.base} src | tar -x -C {tmp}", shell=True, check=True)
        for name, src in (("base", tmp / "src"), ("head", ROOT / "src")):
            (tmp / name).mkdir()
            worker("plain", src, tmp / name)
        return 1 if compare(tmp / "base", tmp / "head") else 0


if __name__ == "__main__":
    sys.exit(main())
