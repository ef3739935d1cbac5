#!/usr/bin/env bash
# The flush benchmark on the GPU machine: run from the repository root; results (JSON, markdown, PNG, log) go to
# $OUT. About 4 minutes on an H200 (python -m bench keeps to a 210 s budget for its workers, plus start-up).
set -o pipefail
export PYTHONUNBUFFERED=1
# the source tree first; keep whatever else is on the path (TileLang unpacked to /tmp/site)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
OUT="${OUT:-$PWD/bench/results}"
mkdir -p "$OUT"

if ! python -c "import leapquant" 2>/dev/null; then
    pip install -e . --no-deps --no-build-isolation -q || echo "pip install -e . failed; relying on PYTHONPATH"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv || true
python -m leapquant info || true

python -m bench --out bench/results "$@" 2>&1 | tee "$OUT/bench_log.txt"
rc=$?
cp bench/results/flush_*.json bench/results/flush_*.md bench/results/flush_*.png "$OUT"/ 2>/dev/null || true
ls -l "$OUT"
exit $rc
