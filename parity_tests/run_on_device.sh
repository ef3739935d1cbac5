#!/usr/bin/env bash
# The GPU parity pass in one device call, from the repository root; everything lands in $OUT.
#
# Carry `.device` with: the TileLang archive (../shared/tools/pack-tilelang-for-device.sh) and the fla-core wheel
# (python3 -m pip download --no-deps -d .device/whl fla-core; the simulation test checks against FLA). Stages, each
# with its own time limit so that one hang cannot eat the call (the device allows 10 minutes a command):
#   1. the TileLang self-check (about 60 s with its compiles)
#   2. the parity suite for the backends named in $BACKENDS (default triton,tilelang,reference): the per-regime
#      table, then pytest within --pytest-budget in $PYTEST_WORKERS processes; writes $OUT/gpu_report.md. The pytest
#      part leaves out what does not involve a GPU backend and runs in CI anyway (compile checks, simulation,
#      benchmark smoke tests, the fp32 reference on the CPU: its two batch tests took ~69 s each of a 330 s budget
#      that had ~55 s left in session 10): $PYTEST_K
set -o pipefail
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT" /tmp/site
tar -C /tmp/site -xJf .device/tilelang-site.tar.xz || echo "no TileLang archive: the tilelang backend will be unavailable"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/whl/*.whl 2>/dev/null || true
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv || true

timeout 150 python3 -m leapquant_tilelang.selfcheck > "$OUT/tilelang_selfcheck.log" 2>&1
echo "selfcheck exit $?"; grep -E "ratio|FAIL|all checks" "$OUT/tilelang_selfcheck.log"

BACKENDS="${BACKENDS:-triton,tilelang,reference}"
PYTEST_K="${PYTEST_K:-not tilelang_compile and not triton_portability and not test_simulate and not test_bench and not reference-cpu}"
# PYTEST_BUDGET=0: the per-regime table only (a short re-check when little device time is left)
PYTEST_BUDGET="${PYTEST_BUDGET:-330}"
# pytest processes on the device's 16 cores (pytest-xdist is in its Python): the compiles then run side by side
PYTEST_WORKERS="${PYTEST_WORKERS:-6}"
PYTEST_ARGS=(--pytest-budget "$PYTEST_BUDGET" --workers "$PYTEST_WORKERS" -k "$PYTEST_K")
[ "$PYTEST_BUDGET" = 0 ] && PYTEST_ARGS=(--skip-pytest)
LEAPQUANT_TEST_BACKENDS="$BACKENDS" timeout 420 python3 -m parity_tests.gpu_suite --profile dev --out "$OUT" \
    "${PYTEST_ARGS[@]}" > "$OUT/suite.log" 2>&1
rc=$?
echo "gpu_suite exit $rc"
tail -45 "$OUT/gpu_report.md" 2>/dev/null || tail -30 "$OUT/suite.log"
exit $rc
