#!/usr/bin/env bash
# Issue #5's figure: packed vs bucketed batching of gpt2-tiny on the default corpus (Debian's
# fortunes, each fortune a document), run one after the other with the same seed, global batch
# and steps. Prints, side by side: padding, median tokens/s (real tokens, padding excluded), the
# real tokens trained on, and the validation loss (validation is on packed windows in both modes,
# so the losses compare). Quote ratios: the machine may be loaded.
#   scripts/batching_compare.sh [HEADROOM binary]   (env: STEPS, SEQ, GLOBAL, BUCKET, OUT)
set -euo pipefail
HEADROOM=${1:-${HEADROOM:-build/release/headroom}}
STEPS=${STEPS:-40}
SEQ=${SEQ:-128}
GLOBAL=${GLOBAL:-8}
BUCKET=${BUCKET:-32}
OUT=${OUT:-out/batching-compare}
rm -rf "$OUT"
mkdir -p "$OUT"
common=(--model gpt2-tiny --seq "$SEQ" --global-batch "$GLOBAL" --steps "$STEPS" --seed 1337
        --sample-tokens 0 --json)
"$HEADROOM" train "${common[@]}" --batching packed --out "$OUT/packed" \
  --log-json "$OUT/packed.jsonl" > "$OUT/packed.json" 2> "$OUT/packed.log"
"$HEADROOM" train "${common[@]}" --batching bucketed --bucket "$BUCKET" --out "$OUT/bucketed" \
  --log-json "$OUT/bucketed.jsonl" > "$OUT/bucketed.json" 2> "$OUT/bucketed.log"
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
rows = {}
for mode in ("packed", "bucketed"):
    r = json.load(open(f"{out}/{mode}.json"))
    steps = [json.loads(l) for l in open(f"{out}/{mode}.jsonl")]
    rows[mode] = dict(
        padding=r["padding"], tps=r["tokens_per_s"], val=r.get("final_val_loss", float("nan")),
        tokens=sum(s["tokens"] for s in steps), loss=r["final_loss"],
        mbs=sum(s["micro_batches"] for s in steps), peak=r["device_bytes_peak"],
        plan=r["planned_peak_bytes"])
print(f"{'':26}{'packed':>14}{'bucketed':>14}{'ratio b/p':>11}")
def line(name, key, fmt):
    p, b = rows["packed"][key], rows["bucketed"][key]
    ratio = f"{b / p:11.2f}" if p else ""
    print(f"{name:26}{format(p, fmt):>14}{format(b, fmt):>14}{ratio}")
line("padding", "padding", ".3f")
line("median tokens/s (real)", "tps", ".0f")
line("real tokens trained on", "tokens", "d")
line("micro-batches", "mbs", "d")
line("final train loss", "loss", ".4f")
line("validation loss", "val", ".4f")
line("peak bytes (measured)", "peak", "d")
line("peak bytes (planned)", "plan", "d")
PY
