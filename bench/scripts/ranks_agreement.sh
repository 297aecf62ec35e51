#!/usr/bin/env bash
# The cost of the ranks' agreement at every micro-batch boundary (issue #26): two headroom
# binaries, A (before: no agreement) and B (after), alternated A, B, A, B, ... on 2 ranks with
# many micro-batches per step, per ZeRO stage; prints each run's median step time (steps 2..N
# from --log-json) and the median of B/A over the pairs. ZEROS picks the stages (default "0 2").
#   [ZEROS="2 3"] bench/scripts/ranks_agreement.sh BEFORE/headroom AFTER/headroom [ROUNDS] [STEPS]
set -euo pipefail
A=$1
B=$2
ROUNDS=${3:-3}
STEPS=${4:-8}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
median_step_ms() {  # log.json -> the median step_ms of steps 2..
  python3 -c '
import json, statistics, sys
ms = [json.loads(l)["step_ms"] for l in open(sys.argv[1]) if l.strip()][1:]
print(f"{statistics.median(ms):.1f}")' "$1"
}
for zero in ${ZEROS:-0 2}; do
  ratios=()
  for r in $(seq "$ROUNDS"); do
    for side in A B; do
      bin=$A
      [ "$side" = B ] && bin=$B
      mpirun -np 2 --oversubscribe "$bin" train --threads 1 --model gpt2-tiny --seq 64 --batch 1 \
        --global-batch 16 --steps "$STEPS" --precision fp32 --recompute none --zero "$zero" \
        --device-memory 2GiB --sample-tokens 0 --json --log-json "$work/$side.json" >/dev/null 2>&1
    done
    a=$(median_step_ms "$work/A.json")
    b=$(median_step_ms "$work/B.json")
    ratios+=("$(python3 -c "print($b / $a)")")
    echo "zero $zero round $r: before $a ms/step, after $b ms/step"
  done
  python3 -c "
import statistics, sys
r = [float(x) for x in sys.argv[1:]]
print(f'zero $zero: median after/before {statistics.median(r):.3f} over {len(r)} pairs')" "${ratios[@]}"
done
