#!/bin/bash
# GPT-2 step before (ab47f84) and after (main) the generic transformer, alternated.
# OLD: a headroom binary built from the commit before (e.g. a worktree at ab47f84).
OLD=${OLD:?set OLD to the older headroom binary}; NEW=${NEW:-build/release/headroom}
for cfg in "gpt2-tiny 8 256 fp32" "gpt2-tiny 8 256 bf16" "gpt2 4 256 fp32" "gpt2 4 256 bf16"; do
  set -- $cfg
  for r in 1 2 3; do
    for who in old new; do
      B=$OLD; [ $who = new ] && B=$NEW
      t=$(OMP_NUM_THREADS=2 $B bench --model $1 --batch $2 --seq $3 --precision $4 --steps 4 --warmup 1 --threads 2 --peak-between-steps false --json 2>/dev/null | python3 -c "import json,sys; print(json.load(sys.stdin)['tokens_per_s'])")
      echo "$1 $4 round$r $who $t"
    done
  done
done
