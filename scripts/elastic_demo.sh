#!/usr/bin/env bash
# Issue #5's figure: gpt2-tiny on the default corpus, trained twice with the same seed and global
# batch: once undisturbed, once with its budget file halved after step $HALVE_AT and restored
# after step $RESTORE_AT while it runs. Prints the re-plan log lines and both loss curves.
#   scripts/elastic_demo.sh [HEADROOM binary]   (env: STEPS, FULL, HALF, HALVE_AT, RESTORE_AT, OUT)
set -euo pipefail
HEADROOM=${1:-${HEADROOM:-build/release/headroom}}
STEPS=${STEPS:-30}
FULL=${FULL:-512MiB}
HALF=${HALF:-256MiB}
HALVE_AT=${HALVE_AT:-10}
RESTORE_AT=${RESTORE_AT:-20}
OUT=${OUT:-out/elastic-demo}
rm -rf "$OUT"
mkdir -p "$OUT"
common=(--model gpt2-tiny --global-batch 8 --steps "$STEPS" --seed 1337 --eval-every 10
        --sample-tokens 0)

echo "== undisturbed: --device-memory $FULL" >&2
"$HEADROOM" train "${common[@]}" --device-memory "$FULL" --out "$OUT/steady" \
  --log-json "$OUT/steady.jsonl" 2> "$OUT/steady.log"

echo "== disturbed: --device-memory-file, $FULL -> $HALF after step $HALVE_AT -> $FULL after step $RESTORE_AT" >&2
echo "$FULL" > "$OUT/budget"
: > "$OUT/elastic.jsonl"
(
  # Edits the budget file as a user (or a second job) would, watching the step log.
  stage=0
  while [ $stage -lt 2 ]; do
    n=$(wc -l < "$OUT/elastic.jsonl")
    if [ $stage -eq 0 ] && [ "$n" -ge "$HALVE_AT" ]; then echo "$HALF" > "$OUT/budget"; stage=1; fi
    if [ $stage -eq 1 ] && [ "$n" -ge "$RESTORE_AT" ]; then echo "$FULL" > "$OUT/budget"; stage=2; fi
    sleep 0.02
  done
) &
editor=$!
"$HEADROOM" train "${common[@]}" --device-memory-file "$OUT/budget" --out "$OUT/elastic" \
  --log-json "$OUT/elastic.jsonl" 2> "$OUT/elastic.log" || { kill "$editor" 2>/dev/null; exit 1; }
wait "$editor" 2>/dev/null || true

echo "== re-plan log lines" >&2
grep -E "budget .* -> |out of memory" "$OUT/elastic.log" | sed 's/^[^s]*step/step/' || true
python3 - "$OUT/steady.jsonl" "$OUT/elastic.jsonl" <<'EOF'
import json, sys
steady = [json.loads(l) for l in open(sys.argv[1])]
elastic = [json.loads(l) for l in open(sys.argv[2])]
print("| step | undisturbed loss | plan | disturbed loss | plan | budget | rel. diff |")
print("|---:|---:|---|---:|---|---:|---:|")
worst = 0.0
for a, b in zip(steady, elastic):
    d = abs(a["loss"] - b["loss"]) / a["loss"]
    worst = max(worst, d)
    s = a["step"]
    if s == 1 or s % 2 == 0 or b.get("replans"):
        plan = lambda r: f'{r["micro_batch"]} x {r["accumulation"]}'
        print(f'| {s} | {a["loss"]:.5f} | {plan(a)} | {b["loss"]:.5f} | {plan(b)} | '
              f'{b["device_budget"] / 2**20:.0f} MiB | {d:.1e} |')
vals = [(a["step"], a["val_loss"], b["val_loss"]) for a, b in zip(steady, elastic) if "val_loss" in a]
for s, x, y in vals:
    print(f"validation loss at step {s}: undisturbed {x:.5f}, disturbed {y:.5f}")
print(f"largest relative loss difference over {len(steady)} steps: {worst:.1e}")
EOF
