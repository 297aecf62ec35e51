#!/bin/sh
# cmake --install into a temporary prefix, then use it with the source tree out of the way: the
# installed headroom's version, a plan, prepare and two training steps from another directory with
# HEADROOM_DATA_DIR unset and the source-tree fallback off (HEADROOM_DATA_NO_SOURCE=1), the data
# found beside the binary; then examples/ configured and built against the prefix with
# find_package(headroom), and run. Reuses the build's binary and libraries (no rebuild).
# Environment: BUILD_DIR (the configured build), SOURCE_DIR.
set -eu
work=$(mktemp -d /tmp/headroom-install-test.XXXXXX)
trap 'rm -rf "$work"' EXIT
prefix="$work/prefix"
fail() { echo "install_test: $*" >&2; exit 1; }

cmake --install "$BUILD_DIR" --prefix "$prefix" >"$work/install.log" || {
  cat "$work/install.log"; fail "cmake --install failed"; }
hr="$prefix/bin/headroom"
[ -x "$hr" ] || fail "no $hr after the install"
for f in share/headroom/gpt2/encoder.json share/headroom/chartlib/chart.umd.min.js \
         share/headroom/configs/llama-3.2-1b.json lib/cmake/headroom/headroomConfig.cmake \
         include/headroom/train/trainer.h; do
  [ -e "$prefix/$f" ] || fail "the install lacks $f (was \`make setup\` run?)"
done

mkdir "$work/elsewhere"
cd "$work/elsewhere"
# The installed binary alone: no data directory given, no source tree to fall back on.
run() { env -u HEADROOM_DATA_DIR -u HEADROOM_VOCAB_DIR HEADROOM_DATA_NO_SOURCE=1 "$@"; }
run "$hr" --version | head -1 | grep -q '^headroom ' || fail "--version"
run "$hr" version --json >version.json
python3 - "$prefix" <<'PY' || fail "version --json: the data was not found in the install"
import json, sys, os
d = json.load(open("version.json"))["data"]
share = os.path.realpath(sys.argv[1] + "/share/headroom")
for key in ("gpt2_vocab", "chart_lib", "configs"):
    assert d[key]["origin"] == "installed", (key, d[key])
    assert os.path.realpath(d[key]["path"]).startswith(share), (key, d[key])
PY
run "$hr" plan --model "$prefix/share/headroom/configs/smollm-135m.json" --device-memory 2GiB \
  --seq 64 --json >plan.json || fail "plan"
run "$hr" plan --model gpt2-tiny --device-memory 1GiB --seq 32 --global-batch 4 --json \
  >plan-tiny.json || fail "plan gpt2-tiny"
printf 'the quick brown fox jumps over the lazy dog. %.0s' $(seq 1 200) >text.txt
run "$hr" prepare text.txt --out text.tokens >/dev/null || fail "prepare (the installed vocabulary)"
run "$hr" train --model gpt2-tiny --data text.tokens --steps 2 --seq 32 --batch 2 --global-batch 2 \
  --device-memory 1GiB --sample-tokens 4 --out run --json --profile prof >train.json \
  || fail "train --steps 2"
[ -s prof/report.html ] || fail "train --profile: no report.html (the installed Chart.js)"
[ -s run/model.safetensors ] || fail "train: no model saved"

# A consumer: examples/ against the prefix (one file to compile).
cmake -S "$SOURCE_DIR/examples" -B consumer -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_BUILD_TYPE=Release >consumer.log 2>&1 || { cat consumer.log; fail "find_package(headroom)"; }
cmake --build consumer >>consumer.log 2>&1 || { cat consumer.log; fail "building against the install"; }
./consumer/plan_and_train --steps 2 >example.txt || { cat example.txt; fail "plan_and_train"; }
grep -q '^final loss' example.txt || fail "plan_and_train printed no final loss"
echo "install_test: ok ($prefix)"
