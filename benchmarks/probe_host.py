"""Per-call host and device time of the forward (API, no grad) and the backward (autograd.grad) at one shape, with
torch.profiler's kernel and op table: shows whether a short call is bound by its host path.

Usage (GPU machine): PYTHONPATH=src python3 benchmarks/probe_host.py B N H D CAUSAL LABEL
  e.g. 32 512 16 128 0 head; run it again with PYTHONPATH pointing at another checkout to compare commits.
"""
import sys, time, torch, onlineattn
from torch.profiler import profile, ProfilerActivity

from probe_gap import host_us  # the same host-time-per-call measurement (this script's directory is on sys.path)
b, n, h, d, causal = (int(x) for x in sys.argv[1:6])
q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
o = onlineattn.attention(q, k, v, causal=bool(causal))
do = torch.randn_like(o)
def fwd():
    with torch.no_grad():
        onlineattn.attention(q, k, v, causal=bool(causal))
bwd = lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
for name, fn in (("fwd", fwd), ("bwd", bwd)):
    for _ in range(20): fn()
    host = host_us(fn, calls=50)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(50): fn()
    torch.cuda.synchronize(); wall = (time.perf_counter() - t) / 50 * 1e6
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10): fn()
        torch.cuda.synchronize()
    print(f"### {sys.argv[6]} {name}: host {host:.0f} us/call, wall {wall:.0f} us/call")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8, max_name_column_width=60))
