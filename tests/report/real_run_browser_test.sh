#!/usr/bin/env bash
# A real run's report in headless Chromium: `headroom train --profile` on gpt2-tiny, then the
# browser checks of browser_test.sh on its report.html (skips when chromium is absent).
#   HEADROOM=path/to/headroom tests/report/real_run_browser_test.sh
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
bin="${HEADROOM:-$repo/build/release/headroom}"
artifacts="${ARTIFACT_DIR:-$repo/build/test-artifacts/report-real}"
if ! command -v chromium >/dev/null 2>&1; then
  echo "real_run_browser_test: skipped: chromium not installed (Debian: apt-get install chromium)"
  exit 0
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$artifacts"
HEADROOM_CACHE_DIR="${HEADROOM_CACHE_DIR:-$work/cache}" "$bin" train --model gpt2-tiny --seq 64 \
  --batch 4 --steps 3 --sample-tokens 0 --out "$work/model" --profile "$work/profile" >"$work/train.log" 2>&1 ||
  { cat "$work/train.log"; exit 1; }
cp "$work/profile/memory.json" "$artifacts/"
ARTIFACT_DIR="$artifacts" "$repo/tests/report/browser_test.sh" "$work/profile/report.html"
