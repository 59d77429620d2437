#!/usr/bin/env bash
# Render the HTML report and its pages in headless Chromium and save a screenshot of each, to look at them.
#   scripts/report_screenshots.sh [results_dir] [out_dir]
# Needs chromium (Debian: apt-get install -y chromium) and a built report: snakemake --report results/report.html.
# Writes <out_dir>/report.png (the report's landing page), and one PNG per table, figure and per-paper page that
# the report embeds (results/tables/*.html, results/report/*.html; figures are PNGs already).
set -euo pipefail
results=${1:-results}
out=${2:-$results/screenshots}
browser=$(command -v chromium || command -v chromium-browser || true)
if [[ -z $browser ]]; then
  echo "no chromium on PATH (Debian: apt-get install -y chromium)" >&2
  exit 1
fi
if [[ ! -f $results/report.html ]]; then
  echo "$results/report.html is missing: build it with snakemake --report $results/report.html" >&2
  exit 1
fi
mkdir -p "$out"
shot() {  # shot <html file> <png> <height>
  # the report is a JavaScript page: give its scripts virtual time to render before the screenshot
  "$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1400,"$3" \
    --virtual-time-budget=5000 --screenshot="$2" "file://$(realpath "$1")" >/dev/null 2>&1
  echo "$2"
}
shot "$results/report.html" "$out/report.png" 1000
for page in "$results"/tables/*.html "$results"/report/*.html; do
  [[ -f $page ]] || continue
  shot "$page" "$out/$(basename "$(dirname "$page")")_$(basename "${page%.html}").png" 1400
done
