#!/usr/bin/env bash
# Re-lock constraints.txt: resolve the project's dependencies afresh (pyproject.toml's ranges, torch and
# torchvision held at the pins constraints.txt has now, or at $TORCH / $TORCHVISION), then write the version
# of every package that install took. Run it with the Python the lock is for (CI's: 3.11), then run the tests
# under the new lock (`pip install -e ".[test]" -c constraints.txt && python -m pytest`) before committing it.
#
#   bash scripts/update_constraints.sh                       # newest releases within pyproject's ranges
#   TORCH=2.14.1 TORCHVISION=0.29.1 bash scripts/update_constraints.sh
#
# Left out: pip, setuptools and wheel (installer tooling), and torch's CUDA runtime wheels (nvidia-*, cuda-*,
# triton), which the torch pin fixes itself and which a CPU or another CUDA build of torch does not take.
set -euo pipefail
cd "$(dirname "$0")/.."
pin() { awk -F'==' -v p="$1" '$1 == p {print $2}' constraints.txt; }
torch=${TORCH:-$(pin torch)}
torchvision=${TORCHVISION:-$(pin torchvision)}
work=$(mktemp -d)
trap 'rm -rf "$work" constraints.txt.tmp' EXIT
printf 'torch==%s\ntorchvision==%s\n' "$torch" "$torchvision" > "$work/torch.txt"
python -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q -e ".[test]" -c "$work/torch.txt"
{
  echo "# The exact versions CI and README's commands install (pip install -e \".[test]\" -c constraints.txt);"
  echo "# pyproject.toml keeps the supported ranges. Locked by scripts/update_constraints.sh on $(date -u +%F),"
  echo "# $("$work/venv/bin/python" -c 'import platform; print("Python", platform.python_version(), platform.system(), platform.machine())'),"
  echo "# without installer tooling and torch's CUDA runtime wheels (the torch pin fixes those)."
  "$work/venv/bin/python" -m pip freeze --exclude-editable | grep -viE '^(nvidia-|cuda-|triton==)' | LC_ALL=C sort -f
} > constraints.txt.tmp
mv constraints.txt.tmp constraints.txt  # the old lock stays whole until the new one is
echo "constraints.txt: $(grep -vc '^#' constraints.txt) pins (torch $torch, torchvision $torchvision)"
