#!/usr/bin/env bash
# Run every check against the official code (tests/test_official_*.py) on checkouts of the pinned commits that
# fedcore/official_checkouts.py lists: each repository is cloned from GitHub (or taken from local clones with
# --mirror), its pinned commit extracted under --into, and the checks run with their variables set. Without
# the checkouts these tests skip, as in CI; here a skip means a checkout is missing and fails the script.
#
#   bash scripts/official_checks.sh                                  # clones into .official/ (needs the internet)
#   bash scripts/official_checks.sh --mirror /work/.mirror --into /tmp/official   # local clones instead
set -euo pipefail
cd "$(dirname "$0")/.."
into=.official mirror=()
while (($#)); do
  case $1 in
    --into) into=$2; shift 2 ;;
    --mirror) mirror=(--mirror "$2"); shift 2 ;;
    *) echo "official_checks.sh: unknown argument $1 (--into DIR, --mirror DIR)" >&2; exit 2 ;;
  esac
done
exports=$(python -m fedcore.official_checkouts --into "$into" "${mirror[@]}")
eval "$exports"
echo "$exports"
# -n 0: the checks put each checkout on sys.path in turn inside one process; -rs names any skip
python -m pytest -n 0 -q -rs tests/test_official_*.py 2>&1 | tee "$into/result.txt"
if grep -qE '(^| )[0-9]+ skipped' "$into/result.txt"; then
  echo "official_checks.sh: some checks skipped (see above): a checkout is missing or incomplete" >&2
  exit 1
fi
