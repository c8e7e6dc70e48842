"""One rank of the gloo ring that ``test_ring.py`` starts as a subprocess; it checks nothing itself.

Usage: ``python ring_worker.py CASES OUT INIT_URL RANK WORLD``. CASES is a ``torch.save`` file of
``{name: case}``, each case a dict of full-sequence tensors (q, k, v, do, dlse) and the spec's fields. For every case
this rank shards the inputs, runs ``ring_attention`` forward and backward, and keeps its local o, lse and gradients,
or the exception that the call raised. Everything goes to ``OUT/rank{RANK}.pt`` for the test to compare.

A subprocess, not ``torch.multiprocessing``: pytest imports test modules under names a spawned child cannot import.
"""

from __future__ import annotations

import datetime
import sys
import traceback

import torch
import torch.distributed as dist

from onlineattn.distributed import ring, ring_attention, shard_sequence


def run_case(case: dict, rank: int, world: int) -> dict:
    layout = case["layout"]
    kwargs = {"causal": case["causal"], "layout": layout, "softmax_scale": case["scale"],
              "return_lse": case["return_lse"], "_overlap": case["overlap"]}
    if case["per_rank"]:  # a deliberately bad call: the ranks disagree on a keyword
        kwargs.update(case["per_rank"][rank])
    q, k, v, do = (shard_sequence(case[name], rank, world, layout) for name in ("q", "k", "v", "do"))
    dlse = shard_sequence(case["dlse"], rank, world, layout, seq_dim=2)
    if case["trim"]:  # a deliberately bad call: the ranks' shards differ in length
        q, k, v = (x[:, : x.shape[1] - case["trim"][rank]] for x in (q, k, v))
    if case["noncontiguous"]:  # [B, S, H, D] views of [B, H, S, D] storage
        q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    use_triton = ring._use_triton
    if case["triton"]:  # the per-block Triton path, through the interpreter on CPU tensors
        ring._use_triton = lambda q: True
    try:
        out = ring_attention(*leaves, **kwargs)
        o, lse = out if case["return_lse"] else (out, None)
        loss = (o.double() * do.double()).sum()
        if lse is not None:
            loss = loss + (lse.double() * dlse.double()).sum()
        loss.backward()
    except Exception as err:  # noqa: BLE001 - the test decides whether this error was the expected one
        return {"error": type(err).__name__, "message": str(err), "traceback": traceback.format_exc()}
    finally:
        ring._use_triton = use_triton
    result = {"o": o.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
    if lse is not None:
        result["lse"] = lse.detach()
    return result


def main(cases_path: str, out_dir: str, init_url: str, rank: int, world: int) -> None:
    torch.set_num_threads(1)  # several ranks share two cores
    # A short timeout turns a hang (a rank waiting for a peer that raised) into an error the test can see.
    dist.init_process_group("gloo", init_method=init_url, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    cases = torch.load(cases_path)
    results = {name: run_case(case, rank, world) for name, case in cases.items()}
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
