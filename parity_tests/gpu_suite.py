"""The whole GPU check in one call: the parity test suite on the GPU, then per-regime error ratios of every backend.

    python -m parity_tests.gpu_suite --out DIR

Writes ``DIR/gpu_report.md`` (pass/fail per property and backend, ratios per regime, the GPU, driver, torch,
Triton and TileLang versions) and ``DIR/gpu_report.json``; exits non-zero if any test or ratio fails. The committed
``parity_tests/gpu_report.md`` is the report of the run a closing note cites.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import re
from collections import defaultdict
from pathlib import Path

import torch
from math import nan

import leapquant
from leapquant import parity
from leapquant.tools.machine import device_lines
from leapquant.tools.workloads import REGIMES, regimes_within

from .conftest import backends_here
from .strategies import build_case


def driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0]
    except Exception as e:  # the report says it could not be read
        return f"unknown ({type(e).__name__})"


# one test's verbose line: ``parity_tests/m.py::test[param] STATUS`` (one process), or
# ``[gw0] [ 12%] STATUS parity_tests/m.py::test[param]`` (pytest-xdist workers)
_STATUS = "PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS"
# (a module skipped as a whole, e.g. one that needs two GPUs, prints its path with no test name)
_SERIAL = re.compile(rf"^parity_tests/(\w+)\.py(?:::(\w+)(\[.*\])?)? ({_STATUS})\b")
_XDIST = re.compile(rf"^\[gw\d+\] \[\s*\d+%\] ({_STATUS}) parity_tests/(\w+)\.py(?:::(\w+)(\[.*\])?)?\s*$")
# pytest's verbose status -> the report's column; an unexpected pass of a non-strict xfail is a pass (a strict one
# is reported FAILED by pytest itself)
_COLUMN = {"PASSED": "passed", "SKIPPED": "skipped", "XFAIL": "xfailed", "XPASS": "passed"}
COLUMNS = ("passed", "failed", "skipped", "xfailed")


def parse_results(text: str) -> tuple[dict, list[str]]:
    """Counts per property (``module::test backend``) and the failed test ids, from pytest's verbose output in either
    form (:data:`_SERIAL`, :data:`_XDIST`)."""
    results: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(COLUMNS, 0))
    failures = []
    for line in text.splitlines():
        m = _SERIAL.match(line)
        if m:
            module, test, param, status = m.groups()
        elif m := _XDIST.match(line):
            status, module, test, param = m.groups()
        else:
            continue
        backend = (param or "").strip("[]").split("-")[0]
        key = f"{module}::{test} {backend}".strip() if test else module
        status = _COLUMN.get(status, "failed")
        results[key][status] += 1
        if status == "failed":
            failures.append(f"{module}::{test}{param or ''}" if test else module)
    return dict(results), failures


def pytest_processes(requested: int) -> int:
    """How many processes pytest runs in: ``requested`` where pytest-xdist is installed, else one."""
    return requested if requested > 1 and importlib.util.find_spec("xdist") is not None else 1


def run_pytest(out: Path, profile: str, keyword: str, budget: float, workers: int = 1) -> tuple[int, dict, list[str]]:
    """pytest in verbose mode, streamed to ``out/pytest.log`` and parsed line by line, so that a run stopped by its
    ``budget`` (seconds) still reports every test it finished; in ``workers`` processes (:func:`pytest_processes`),
    which run the tests side by side on the machine's cores. Returns (exit code, counts per property, failures)."""
    log = out / "pytest.log"
    env = dict(os.environ, HYPOTHESIS_PROFILE=profile)
    # every test, the slow ones too (the default run leaves them out: pyproject.toml)
    cmd = [sys.executable, "-m", "pytest", "-v", "-rfE", "--durations=20", "-p", "no:cacheprovider",
           "-m", "slow or not slow", "parity_tests"]
    if pytest_processes(workers) > 1:
        cmd += ["-n", str(workers)]
    if keyword:
        cmd += ["-k", keyword]
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        # its own process group, so that a stop by the budget takes the xdist workers with it
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = -1
    results, failures = parse_results(log.read_text(errors="replace"))
    return rc, results, failures


def regime_table(rows: int, heads: int) -> tuple[list[dict], bool]:
    table, ok = [], True
    measured: dict[tuple[str, str], list] = defaultdict(list)
    backends = backends_here("cuda")
    for gate in ("kda", "gdn"):
        for i, regime in enumerate(REGIMES):
            case = build_case(heads=heads, head_k=128, head_v=128, ring=16, rank=4, gate=gate, convention="vllm",
                              regime=regime, rows=rows, due_frac=1.0, padding=2, seed=500 + i, device="cuda")
            for b in backends:
                pool = copy.deepcopy(case.pool)
                be = leapquant.get_backend(b)
                if not be.supports(pool)[0] or regime not in regimes_within(be.requirements.magnitude):
                    continue
                # the padding rows include out-of-range slots on purpose: check=False, as an engine calls it
                try:
                    p = parity.measure(pool, case.idx, b, check=False)
                except Exception as e:  # recorded as a failing row; a poisoned CUDA context fails the rest alike
                    table.append({"backend": b, "gate": gate, "regime": regime, "programs": 0, "ratio_mean": nan,
                                  "ratio_worst": nan, "ratio_rms": nan, "pass_": False,
                                  "error": f"{type(e).__name__}: {str(e)[:200]}"})
                    ok = False
                    continue
                measured[b, gate].append(p)
                s = p.summary()
                # (the batch RMS is judged over all regimes below; a regime alone is judged per program and bytes)
                s.update(backend=b, gate=gate, regime=regime,
                         pass_=p.backend_ok() and p.reference_ok() and not p.untouched)
                ok &= s["pass_"]
                table.append(s)
        # the batch RMS criterion over all regimes of this gate
        for b in backends:
            if not measured[b, gate]:
                continue
            p = parity.Parity.concat(measured[b, gate])
            s = p.summary()
            s.update(backend=b, gate=gate, regime="ALL (batch RMS)", pass_=p.rms_ratio() <= parity.BACKEND_RMS)
            s.pop("ref_vs_f64_worst")
            table.append(s)
            ok &= s["pass_"]
    return table, ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_report"),
                    help="folder for gpu_report.md / .json and the pytest log (default $OUT or gpu_report)")
    ap.add_argument("--profile", default="gpu", help="hypothesis profile of the pytest part (conftest.py)")
    ap.add_argument("--rows", type=int, default=8, help="rows of 32 heads per regime in the ratio table")
    ap.add_argument("--skip-pytest", action="store_true", help="only the per-regime ratio table")
    ap.add_argument("-k", dest="keyword", default="", help="pytest -k expression (e.g. to leave out a backend's files)")
    ap.add_argument("--pytest-budget", type=float, default=240.0, help="seconds pytest may run; what finished counts")
    ap.add_argument("--workers", type=int, default=1, help="pytest processes (pytest-xdist, where installed)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        print("gpu_suite needs a CUDA device", file=sys.stderr)
        return 2
    t0 = time.time()
    env = device_lines() + [f"driver {driver()}", f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"]
    print("\n".join(env), flush=True)
    # the per-regime table first: it is short and says the most; pytest after it, within its budget
    table, ratios_ok = regime_table(args.rows, 32)
    print(f"regime table done ({time.time() - t0:.0f} s)", flush=True)
    rc, props, failures = (0, {}, []) if args.skip_pytest else run_pytest(out, args.profile, args.keyword,
                                                                          args.pytest_budget, args.workers)
    print(f"pytest exit {rc} ({time.time() - t0:.0f} s)", flush=True)
    lines = ["# GPU parity report", "", "Command: `python -m parity_tests.gpu_suite` (the one-call wrapper is `bash parity_tests/run_on_device.sh`)", ""]
    only = os.environ.get("LEAPQUANT_TEST_BACKENDS", "")
    lines += [f"- {e}" for e in env]
    lines += [f"- backends under test: {only or 'all available'}; pytest -k: {args.keyword or '(none)'}; pytest "
              f"processes: {pytest_processes(args.workers)}"]
    lines += ["", "## Properties (pytest on the GPU machine)", "", "| property / backend | " + " | ".join(COLUMNS) + " |",
              "| --- |" + " ---: |" * len(COLUMNS)]
    for k in sorted(props):
        lines.append(f"| {k} | " + " | ".join(str(props[k].get(c, 0)) for c in COLUMNS) + " |")
    lines.append("| **total** | " + " | ".join(str(sum(v.get(c, 0) for v in props.values())) for c in COLUMNS) + " |")
    if args.skip_pytest:
        lines += ["", "pytest not run (--skip-pytest): this report holds the per-regime table only"]
    else:
        lines += ["", f"pytest exit code: {rc}" + (" (stopped by its time budget: the table lists what finished)"
                                                   if rc == -1 else "")]
    lines += [f"- FAILED {f}" for f in failures]
    lines += ["", "## Error ratios per value regime (err_backend / err_ref; "
              f"{args.rows} rows x 32 heads, all due; ref32/f64 = reference over the float64 model). Per program "
              "err_backend <= 1.02 err_ref + 1e-6; the batch RMS (<= 1.003) counts programs with err_ref >= 1e-5 "
              "(leapquant.parity.RMS_MIN_ERR: below it the state is compressed exactly up to fp32 rounding)", "",
              "| backend | gate | regime | programs | mean | worst | RMS (programs counted) | ref32/f64 worst | codes differing | max code diff | pass |",
              "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in table:
        lines.append(
            f"| {r['backend']} | {r['gate']} | {r['regime']} | {r['programs']} | {r['ratio_mean']:.5f} | "
            f"{r['ratio_worst']:.5f} | {r['ratio_rms']:.5f} ({r.get('rms_programs', '-')}) | "
            f"{r.get('ref_vs_f64_worst', float('nan')):.5f} | "
            f"{100 * r.get('code_diff_frac', 0):.4f} % | {r.get('code_diff_max', '')} | "
            f"{'PASS' if r['pass_'] else 'FAIL ' + r.get('error', '')} |")
    ok = rc == 0 and ratios_ok
    lines += ["", f"Overall: {'PASS' if ok else 'FAIL'} ({time.time() - t0:.0f} s)"]
    (out / "gpu_report.md").write_text("\n".join(lines) + "\n")
    (out / "gpu_report.json").write_text(json.dumps({"env": env, "pytest_rc": rc, "properties": props,
                                                     "failures": failures,
                                                     "regimes": table}, indent=1, default=str))
    print("\n".join(lines[-len(table) - 4:]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
