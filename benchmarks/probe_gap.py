"""Why does `bench prefill` read ~10% under `sweep_fwd.py` for the same kernel and shape? Time the variants side by side."""

import torch
import triton.testing

from onlineattn.api import attention
from onlineattn.bench.prefill import Case, _timed
from onlineattn.ops.forward import forward

case = Case(4, 16, 4096, 128, True)
shape = (case.b, case.n, case.h, case.d)
gen = torch.Generator(device="cuda").manual_seed(case.n * 1000 + case.d)
qg, kg, vg = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
qd, kd, vd = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
tf = lambda ms: f"{case.flops('fwd') / ms / 1e9:.1f}"
for label, (q, k, v) in (("generator", (qg, kg, vg)), ("default", (qd, kd, vd))):
    for wu, rep in ((25, 100), (10, 40)):
        direct = triton.testing.do_bench(lambda: forward(q, k, v, case.d**-0.5, True), warmup=wu, rep=rep, return_mode="median")
        api = triton.testing.do_bench(lambda: attention(q, k, v, causal=True), warmup=wu, rep=rep, return_mode="median")
        print(f"{label:9} wu={wu} rep={rep}: direct {tf(direct)}  api {tf(api)}", flush=True)
print("bench _timed:", tf(_timed(lambda q, k, v, c: attention(q, k, v, causal=c), "fwd", qg, kg, vg, True)))
print("bench _timed default data:", tf(_timed(lambda q, k, v, c: attention(q, k, v, causal=c), "fwd", qd, kd, vd, True)))
