#!/bin/bash
# The same small Llama step in headroom and in PyTorch 1.13 (tools/reference/llama_bench.py), alternated.
NEW=${NEW:-build/release/headroom}
for p in fp32 bf16; do
  for r in 1 2 3; do
    h=$(OMP_NUM_THREADS=2 $NEW bench --model "$(dirname "$0")"/llama-small.json --batch 4 --seq 256 --precision $p --steps 4 --warmup 1 --threads 2 --peak-between-steps false --json 2>/dev/null | python3 -c "import json,sys; j=json.load(sys.stdin); print(j['tokens_per_s'], j['flops_per_token'], j.get('mfu_in_run'))")
    echo "llama $p round$r headroom $h"
    t=$(OMP_NUM_THREADS=2 /usr/bin/python3 tools/reference/llama_bench.py --layers 4 --hidden 256 --heads 4 --kv-heads 2 --intermediate 688 --vocab 8192 --batch 4 --seq 256 --dtype $p --steps 4 --threads 2 2>/dev/null | python3 -c "import json,sys; j=json.load(sys.stdin); print(j.get('tokens_per_s'))")
    echo "llama $p round$r torch $t"
  done
done
