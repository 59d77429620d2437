#!/usr/bin/env bash
# Everything GPU-side in one command, on a machine with one CUDA GPU (fedcore/gpu_check.py): the GPU tests, the
# default pipeline on CUDA from an empty results directory, a sample of the smoke DAG and the throughput benchmarks at
# paper shapes, each with a timeout (about 10 minutes on one H100 in all); one summary: <out>/summary.{md,json}.
#
#   bash scripts/gpu_check.sh                        # writes gpu_check/summary.md (+ logs/, results_*/)
#   bash scripts/gpu_check.sh --out /tmp/gc          # elsewhere
#   SMOKE_OUTPUTS=all bash scripts/gpu_check.sh      # the whole smoke DAG (up to 20 more minutes)
#   bash scripts/gpu_check.sh --dry --out /tmp/gc    # any machine: checks each step's plumbing, runs nothing
#   bash scripts/gpu_check.sh --help                 # --only, --timeout STEP=SECONDS, --cores
#
# It installs nothing from the internet. Where snakemake or open_clip cannot be imported (a GPU machine with torch but
# not this project's other packages), it installs the wheels of .whl/ (../shared/tools/device_wheels.sh fills it) into
# /tmp/site, offline, and puts /tmp/site on PYTHONPATH. fedcore is imported from this checkout.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
py=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
have() { "$py" -c "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in ('snakemake', 'open_clip')))" 2>/dev/null; }
if ! have && [ -d /tmp/site ]; then   # installed by an earlier run on this machine
  export PYTHONPATH="/tmp/site:$PYTHONPATH" PATH="/tmp/site/bin:$PATH"
fi
if ! have; then
  if ! compgen -G ".whl/*.whl" >/dev/null; then
    echo "gpu_check: snakemake or open_clip is not importable and .whl/ holds no wheels: install the project" \
         "(pip install -e .) or fill .whl/ with ../shared/tools/device_wheels.sh on a machine with a package index" >&2
    exit 2
  fi
  echo "gpu_check: installing the wheels of .whl/ into /tmp/site (offline)"
  "$py" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 2
  case ":$PYTHONPATH:" in *:/tmp/site:*) ;; *) export PYTHONPATH="/tmp/site:$PYTHONPATH" PATH="/tmp/site/bin:$PATH" ;; esac
  have || { echo "gpu_check: snakemake or open_clip still not importable after installing .whl/" >&2; exit 2; }
fi
exec "$py" -m fedcore.gpu_check "$@"
