#!/usr/bin/env bash
# Render the HTML report and its items in headless Chromium and save a screenshot of each, to look at them.
#   scripts/report_screenshots.sh [results_dir] [out_dir]
# Needs chromium (Debian: apt-get install -y chromium) and a built report: snakemake --report results/report.html.
# Writes into <out_dir>:
#   report.png                  the report's front page (the summary) in a 1,400 x 1,400 window;
#   in_report/<item>.png        each item as the report shows it (1,400 x 1,000 window: its frame is ~1,050 px wide),
#                               opened by a copy of the report whose script selects the item on load;
#   page/<item>.png             each item's page alone at the frame's width (1,050 px), 1,600 px tall;
# where <item> is <folder>_<name> of results/report/items/<folder>/<name>.html (tables, figures, report pages).
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
mkdir -p "$out/in_report" "$out/page"
profile=$(mktemp -d)
tmp=$(mktemp -d)
trap 'rm -rf "$profile" "$tmp"' EXIT
shot() {  # shot <html file> <png> <width> <height>
  # the report is a JavaScript page: give its scripts virtual time to render before the screenshot
  "$browser" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking \
    --disable-component-update --disable-sync --user-data-dir="$profile" --hide-scrollbars \
    --window-size="$3,$4" --virtual-time-budget=8000 --screenshot="$2" "file://$(realpath "$1")" >/dev/null 2>&1
  echo "$2"
}
shot "$results/report.html" "$out/report.png" 1400 1400
for page in "$results"/report/items/*/*.html; do
  [[ -f $page ]] || continue
  folder=$(basename "$(dirname "$page")")
  name=$(basename "${page%.html}")
  key="$results/report/items/$folder/$name.html"
  # a copy of the report that opens this item once its app has rendered (the report keys items by their path);
  # appended after the document: the report's own scripts hold "</body>" in strings
  { cat "$results/report.html"
    echo "<script>setTimeout(function () { app.setView({content: 'html', contentPath: results['$key'].data_uri, resultPath: '$key'}); }, 500);</script>"
  } > "$tmp/report.html"
  shot "$tmp/report.html" "$out/in_report/${folder}_$name.png" 1400 1000
  shot "$page" "$out/page/${folder}_$name.png" 1050 1600
done
