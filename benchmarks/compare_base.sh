#!/bin/bash
# No-regression check in one run (issue #6): the grid of `onlineattn bench prefill --mode all` for a baseline
# checkout (onlineattn only) and for this tree (with SDPA's backends), head dim by head dim, so both sides share the
# GPU's state. Rows go to $OUT/base.jsonl and $OUT/rows.jsonl.
#   git worktree add .base <base-commit>   # locally; ignore it in .git/info/exclude and carry it to the device
#   bash benchmarks/compare_base.sh <base-commit> <this-commit> "64 128 256" [extra bench args, e.g. --n 512 1024]
BASE=$1; C=$2; DS=$3; shift 3
for d in $DS; do
  PYTHONPATH=.base/src python3 -m onlineattn bench prefill --mode all --d "$d" "$@" --providers onlineattn \
    --out "$OUT/base.jsonl" --commit "$BASE" 2>&1 | grep -v Warn | tail -13
  PYTHONPATH=src python3 -m onlineattn bench prefill --mode all --d "$d" "$@" \
    --providers onlineattn sdpa-flash sdpa-cudnn sdpa-efficient --out "$OUT/rows.jsonl" --commit "$C" 2>&1 \
    | grep -v Warn | tail -13
done
