#!/usr/bin/env bash
# Opens report.html in headless Chromium (Debian's `chromium`) and checks that the page ran
# without errors and drew every chart; keeps screenshots as test artifacts. Skips (exit 0) when
# chromium is not installed.
#
#   tests/report/browser_test.sh [REPORT_HTML]
#
# Without REPORT_HTML it writes a sample profile's report with the report_tests program
# ($REPORT_TESTS, or build/*/report_tests), and also a 10^6-event one (10^6 spans, 10^6 memory
# samples) that must open within $HR_REPORT_MAX_LOAD_S seconds (default 30); both are also opened
# zoomed into a range (report.html#zoom=A,B) that must be drawn at full resolution.
# Artifacts (screenshots, dumped DOM, browser log) go to $ARTIFACT_DIR (default
# build/test-artifacts/report).
set -euo pipefail

if ! command -v chromium >/dev/null 2>&1; then
  echo "browser_test: skipped: chromium not installed (Debian: apt-get install chromium)"
  exit 0
fi

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
artifacts="${ARTIFACT_DIR:-$repo/build/test-artifacts/report}"
charts=(timeline timeline-overview sweep-memory sweep-throughput fragmentation time-by-category)
# A page that takes longer than this to load and draw (browser start included) fails: a detector
# of pathological slowness (10^6 events should take a few seconds), not a benchmark.
max_load_s="${HR_REPORT_MAX_LOAD_S:-30}"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$artifacts"

# Writes a report with the test program into $1; $2 = "small" or "large".
make_report() {
  local out="$1" size="$2" bin="${REPORT_TESTS:-}"
  if [[ -z "$bin" ]]; then
    for b in "$repo"/build/release/report_tests "$repo"/build/*/report_tests; do
      if [[ -x "$b" ]]; then bin="$b"; break; fi
    done
  fi
  if [[ -z "$bin" || ! -x "$bin" ]]; then
    echo "browser_test: no report_tests program found; build it (cmake --build build/release) or set REPORT_TESTS" >&2
    exit 1
  fi
  mkdir -p "$out"
  HR_REPORT_OUT_DIR="$out" HR_REPORT_SPANS="$size" "$bin" \
    --gtest_filter='BrowserFixture.WritesSampleReport' --gtest_brief=1 >"$out/gtest.log" 2>&1 || {
    cat "$out/gtest.log" >&2
    echo "browser_test: writing the $size sample report failed" >&2
    exit 1
  }
  [[ -f "$out/report.html" ]] || { echo "browser_test: $bin wrote no report.html" >&2; exit 1; }
}

# chromium with a fresh profile, no network, no first-run work. Extra arguments follow.
browser() {
  local profile
  profile="$(mktemp -d "$work/chromium.XXXXXX")"
  # `timeout` so that a hung browser fails the test instead of stalling the suite.
  timeout 120 chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
    --disable-background-networking --disable-component-update --disable-sync \
    --disable-default-apps --disable-extensions --mute-audio --hide-scrollbars \
    --user-data-dir="$profile" --enable-logging=stderr --v=0 "$@"
}

passed=0
failed=0
# expect NAME MESSAGE COMMAND...: counts COMMAND's success; on failure prints NAME and MESSAGE.
expect() {
  local name="$1" message="$2"
  shift 2
  if "$@"; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
    echo "browser_test: FAIL: $name: $message" >&2
  fi
}
no_console_errors() { ! grep -Eq 'Uncaught|:ERROR:CONSOLE|CONSOLE.*"(Error|error)' "$1"; }

# Checks one report: errors, every chart drawn, screenshots. $1 = report.html, $2 = artifact name.
check_report() {
  local html="$1" name="$2" url
  url="file://$(realpath "$1")"
  local dom="$artifacts/$name.dom.html" log="$artifacts/$name.browser.log"
  local t0 t1
  t0=$(date +%s%N)
  browser --virtual-time-budget=15000 --dump-dom "$url" >"$dom" 2>"$log" || true
  t1=$(date +%s%N)
  local load_ms=$(((t1 - t0) / 1000000))
  echo "browser_test: $name: $(du -h "$html" | cut -f1) page loaded, drawn and dumped in" \
    "$load_ms ms (browser start included); page script done" \
    "$(grep -Eo 'data-ready-ms="[0-9]+"' "$dom" | head -1 | grep -Eo '[0-9]+') ms after navigation"
  expect "$name: loads within ${max_load_s} s" "took $load_ms ms" test "$load_ms" -lt $((max_load_s * 1000))

  expect "$name: page script ran to the end" "no data-complete=\"1\" on <html> (see $dom)" \
    grep -q 'data-complete="1"' "$dom"
  expect "$name: no page errors" "$(grep -o '<pre id="errors"[^<]*' "$dom" | head -c 600)" \
    grep -q 'data-errors="0"' "$dom"
  expect "$name: no console errors in the browser log" "$(grep -E 'Uncaught|CONSOLE' "$log" | head -5)" \
    no_console_errors "$log"
  for c in "${charts[@]}"; do
    expect "$name: chart $c rendered" "its container has no data-rendered=\"1\" (see $dom)" \
      grep -Eq "data-chart=\"$c\"[^>]*data-rendered=\"1\"" "$dom"
    expect "$name: chart $c has a canvas" "no <canvas> in its container (see $dom)" \
      grep -Eq "data-chart=\"$c\"[^>]*>[[:space:]]*<canvas" "$dom"
  done

  # Zoom (report.html#zoom=A,B): the detail chart draws every moment of the range, from the
  # page's full-resolution data. zoom.txt next to the page names the range and the moment count.
  local zoom="$(dirname "$html")/zoom.txt"
  if [[ -f "$zoom" ]]; then
    local a b moments zdom="$artifacts/$name.zoom.dom.html"
    read -r a b moments <"$zoom"
    browser --virtual-time-budget=15000 --dump-dom "$url#zoom=$a,$b" >"$zdom" 2>>"$log" || true
    expect "$name: zoomed page has no errors" "$(grep -o '<pre id="errors"[^<]*' "$zdom" | head -c 600)" \
      grep -q 'data-errors="0"' "$zdom"
    expect "$name: zoom draws full resolution" "no data-resolution=\"full\" on the timeline (see $zdom)" \
      grep -Eq 'data-chart="timeline"[^>]*data-resolution="full"' "$zdom"
    expect "$name: zoom draws all $moments moments" \
      "$(grep -Eo 'data-chart="timeline"[^>]*' "$zdom" | grep -o 'data-moments="[0-9]*"')" \
      grep -Eq "data-chart=\"timeline\"[^>]*data-moments=\"$moments\"" "$zdom"
    echo "browser_test: $name: zoom into $a..$b us took" \
      "$(grep -Eo 'data-zoom-ms="[0-9.]+"' "$zdom" | head -1 | grep -Eo '[0-9.]+') ms in the page"
    browser --virtual-time-budget=15000 --window-size=1280,900 \
      --screenshot="$artifacts/$name-zoom.png" "$url#zoom=$a,$b" >/dev/null 2>>"$log" || true
  fi

  browser --virtual-time-budget=15000 --window-size=1280,900 \
    --screenshot="$artifacts/$name.png" "$url" >/dev/null 2>>"$log" || true
  expect "$name: screenshot" "no $artifacts/$name.png" test -s "$artifacts/$name.png"
  browser --virtual-time-budget=15000 --window-size=1280,3000 \
    --screenshot="$artifacts/$name-full.png" "$url" >/dev/null 2>>"$log" || true
}

if (($# >= 1)); then
  check_report "$1" report
else
  make_report "$work/small" small
  cp "$work/small/report.html" "$artifacts/report.html"
  check_report "$work/small/report.html" report
  make_report "$work/large" large
  check_report "$work/large/report.html" report-1e6
fi

echo "browser_test: artifacts in $artifacts"
echo "browser_test: $passed passed, $failed failed"
((failed == 0))
