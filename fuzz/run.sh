#!/usr/bin/env bash
# Runs each libFuzzer target (or those named) for FUZZ_SECONDS seconds on its seed corpus and the
# committed regression inputs; fails on the first crash, sanitizer report, timeout or OOM.
# New corpus entries go to a scratch directory, never into the committed corpus; crashing inputs
# go to $FUZZ_BUILD/fuzz-artifacts/<target>/. See docs/notes/fuzzing.md.
# Usage: fuzz/run.sh [config safetensors token_file checkpoint hf_tokenizer spm_model]
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${FUZZ_SECONDS:-30}
build=${FUZZ_BUILD:-build/fuzz}
targets=("$@")
((${#targets[@]})) || targets=(config safetensors token_file checkpoint hf_tokenizer spm_model)

scratch=$(mktemp -d "${TMPDIR:-/tmp}/headroom-fuzz-run.XXXXXX")
# The targets' own scratch files (fuzz_checkpoint's directory), on a tmpfs where there is one.
files=$(mktemp -d /dev/shm/headroom-fuzz-files.XXXXXX 2>/dev/null || mktemp -d "$scratch/files.XXXXXX")
trap 'rm -rf "$scratch" "$files"' EXIT

for t in "${targets[@]}"; do
  case $t in
    config) max_len=4096 dicts=(json config) ;;
    safetensors) max_len=8192 dicts=(json safetensors) ;;
    token_file) max_len=4096 dicts=(token_file) ;;
    checkpoint) max_len=16384 dicts=(json config safetensors checkpoint) ;;
    hf_tokenizer) max_len=8192 dicts=(json hf_tokenizer) ;;
    spm_model) max_len=8192 dicts=(spm_model) ;;
    *) echo "fuzz: unknown target '$t' (config, safetensors, token_file, checkpoint, hf_tokenizer, spm_model)" >&2; exit 2 ;;
  esac
  bin=$build/fuzz/fuzz_$t
  [[ -x $bin ]] || { echo "fuzz: $bin is missing; build it with 'make fuzz'" >&2; exit 2; }
  artifacts=$build/fuzz-artifacts/$t
  mkdir -p "$artifacts" "$scratch/$t"
  dict=$scratch/$t.dict
  for d in "${dicts[@]}"; do cat "fuzz/dict/$d.dict"; done >"$dict"
  corpora=(fuzz/corpus/$t)
  [[ -d tests/fuzz_regressions/$t ]] && corpora+=(tests/fuzz_regressions/$t)
  log=$artifacts/last-run.log
  echo "fuzz: $t for ${seconds}s (log: $log)"
  # The first corpus directory receives new inputs: the scratch one. -timeout catches hangs,
  # -rss_limit_mb/-malloc_limit_mb runaway allocations.
  if ! TMPDIR=$files UBSAN_OPTIONS=print_stacktrace=1 "$bin" -max_total_time="$seconds" -max_len="$max_len" \
      -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=1024 -dict="$dict" -print_final_stats=1 \
      -artifact_prefix="$artifacts/" "$scratch/$t" "${corpora[@]}" >"$log" 2>&1; then
    tail -n 60 "$log" >&2
    echo "fuzz: $t FAILED; the input is in $artifacts/ (reproduce: $bin $artifacts/<file>)" >&2
    exit 1
  fi
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log")
  echo "fuzz: $t ok: $execs executions, $rate exec/s, corpus $(ls "$scratch/$t" | wc -l) new"
done
