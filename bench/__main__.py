"""``python -m bench``: flush timings against the bandwidth floor, and the decode step they are amortised against.

    python -m bench                      # the full run on a GPU (about 4 minutes on an H200)
    python -m bench --quick              # a few cases, a smoke test on a GPU
    python -m bench --cpu-smoke          # the whole path on the CPU: reference backend, tiny sizes, host clock
    python -m bench --backends triton,tilelang --out /tmp/res
    python -m bench --baseline DIR       # also time the packages in DIR (another commit's), in the same run

``--baseline DIR``: DIR holds another version's ``leapquant``, ``leapquant_triton`` and ``leapquant_tilelang``
packages (``git archive REV leapquant leapquant_triton leapquant_tilelang | tar -x -C DIR``); every backend is then
timed a second time with those packages first on the path, as ``<backend>@baseline``, right after its own worker,
beside the same floor: a change's effect on speed measured in one run.

Writes ``<out>/flush_<device>.json``, ``.md`` and ``.png`` (``<device>`` from the GPU's name, e.g. ``h200``).

Work runs in subprocesses, one after another: the copy bandwidth and the step kernel, then one per backend. Each has
a share of ``--budget`` seconds (unused time passes to the next); a worker that crashes, loses its CUDA context or
overruns its share by ``GRACE_S`` is stopped, and its unfinished cases are recorded with the reason, never dropped.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

DEFAULT_BACKENDS = ("triton", "tilelang", "reference")
# seconds of the budget per worker, in run order (scaled to --budget); TileLang compiles slowest on first use
SHARES = {"step": 30, "triton": 75, "tilelang": 85, "reference": 40}
BUDGET = {"full": 210.0, "quick": 120.0, "cpu": 120.0}
GRACE_S = 20.0


def _order(backends: list[str]) -> list[str]:
    rank = {"triton": 0, "tilelang": 1, "reference": 9}
    return sorted(backends, key=lambda b: (rank.get(b, 5), b))


def _run_worker(name: str, argv: list[str], env: dict, deadline: float, cwd: str | None = None) -> dict:
    """Run one worker to completion or to ``deadline + GRACE_S``; stream its output, keep its stderr's tail."""
    tail: collections.deque[str] = collections.deque(maxlen=25)
    proc = subprocess.Popen([sys.executable, "-m", "bench", *argv], env=env, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, cwd=cwd)

    def pump():
        for line in proc.stderr:
            sys.stderr.write(line)
            tail.append(line.rstrip())

    th = threading.Thread(target=pump, daemon=True)
    th.start()
    killed = False
    try:
        proc.wait(timeout=max(1.0, deadline + GRACE_S - time.time()))
    except subprocess.TimeoutExpired:
        killed = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the worker's own process group (started above), nothing else
        except ProcessLookupError:
            pass
        proc.wait()
    th.join(timeout=5)
    return {"worker": name, "rc": proc.returncode, "killed_after_budget": killed, "stderr_tail": list(tail)}


def _known_backends() -> set[str]:
    """Backend names registered through entry points, and the built-ins (without importing any backend)."""
    from importlib import metadata

    from leapquant.backends import ENTRY_POINT_GROUP

    return {ep.name for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)} | set(DEFAULT_BACKENDS)


def _read(path: Path) -> list[dict]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line cut by a kill
    return rows


def _close_out(rows: list[dict], backend: str, plan_, status: dict) -> list[dict]:
    """Cases of a worker that died or was stopped get a record saying so (the case it was running named)."""
    have = {json.dumps(r["case"], sort_keys=True) for r in rows if r.get("kind") == "case"}
    starts = [json.dumps(r["case"], sort_keys=True) for r in rows if r.get("kind") == "start"]
    running = starts[-1] if starts and starts[-1] not in have else None
    if status["killed_after_budget"]:
        why = f"worker stopped after overrunning its time share by {GRACE_S:.0f} s"
    else:
        why = f"worker exited with rc={status['rc']}"
    tail = " | ".join(status["stderr_tail"][-4:])
    for c in plan_.cases:
        key = json.dumps(asdict(c), sort_keys=True)
        if key not in have:
            what = f"{why} while running this case" if key == running else f"not reached: {why}"
            rows.append({"kind": "case", "backend": backend, "case": asdict(c), "status": "error",
                         "reason": (what + (f"; stderr: {tail}" if tail else ""))[:800]})
    return rows


def _write(args, plan_, backends, records, meta, device, t0, final: bool):
    """Build the results from the records so far and write JSON + markdown (and, when ``final``, the plot)."""
    from . import report
    from .timing import device_slug

    meta["wall_s"] = round(time.time() - t0, 1)
    meta["complete"] = final
    doc = report.build(plan_, backends, records, json.loads(json.dumps(meta)))
    report.finish_step_floor(doc)
    kind = args.tag or ("cpu" if device == "cpu" else device_slug(doc["env"].get("name") or "gpu"))
    out = Path(args.out)
    stem = out / f"flush_{kind}"
    png = stem.with_suffix(".png")
    doc["plot"] = None
    if final:
        try:
            from .plot import plot

            plot(doc, png)
            doc["plot"] = png.name
        except Exception as e:  # matplotlib missing or a plotting error must not lose the numbers
            doc["plot_error"] = f"{type(e).__name__}: {e}"[:300]
    report.write_json(doc, stem.with_suffix(".json"))
    stem.with_suffix(".md").write_text(report.markdown(doc, doc["plot"]))
    return doc, stem


def orchestrate(args) -> int:
    import torch

    from . import flush as flush_mod
    from . import report
    from .timing import nvidia_smi, version

    mode = "cpu" if args.cpu_smoke else ("quick" if args.quick else "full")
    if mode != "cpu" and not torch.cuda.is_available():
        print("error: no CUDA device here; `python -m bench --cpu-smoke` runs the script path on the CPU",
              file=sys.stderr)
        return 2
    backends = [b.strip() for b in (args.backends or ("reference" if mode == "cpu" else ",".join(DEFAULT_BACKENDS)))
                .split(",") if b.strip()]
    backends = _order(list(dict.fromkeys(backends)))
    plan_ = flush_mod.plan(mode)
    device = "cpu" if mode == "cpu" else "cuda"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = args.budget if args.budget else BUDGET[mode]
    workers = ["step"] + backends
    if args.baseline:
        workers = ["step"] + [w for b in backends for w in (b, f"{b}@baseline")]
        backends = [w for w in workers if w != "step"]
    total_share = sum(SHARES.get(w.partition("@")[0], 40) for w in workers)
    t0 = time.time()
    print(f"bench: {mode} run on {device}, backends {backends}, {len(plan_.cases)} cases, budget {budget:.0f} s",
          flush=True)

    smi = nvidia_smi() if device == "cuda" else {"error": "cpu smoke run"}
    meta = {"mode": mode, "env": {"driver": smi.get("driver"), "nvidia_smi": smi, "torch": torch.__version__,
                                  "cuda": torch.version.cuda, "triton": version("triton"),
                                  "tilelang": version("tilelang"), "name": smi.get("name")},
            "workers": []}
    records: dict[str, list[dict]] = {}
    tmp = Path(tempfile.mkdtemp(prefix="leapquant_bench_"))
    planned_end = t0
    known = _known_backends()
    for w in workers:
        base, _, variant = w.partition("@")
        share = budget * SHARES.get(base, 40) / total_share
        planned_end += share
        # time left over by earlier workers passes on; a worker that overran still gets a quarter of its share
        deadline = max(planned_end, time.time() + 0.25 * share)
        path = tmp / f"{w}.jsonl"
        if w != "step" and base not in known:
            records[w] = [{"kind": "case", "backend": w, "case": asdict(c), "status": "unavailable",
                           "reason": f"unknown backend {w!r}; known: {sorted(known)}"} for c in plan_.cases]
            print(f"--- {w}: unknown backend, known: {sorted(known)}", flush=True)
            continue
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if device == "cuda":
            env.pop("TRITON_INTERPRET", None)  # the backends refuse CUDA tensors under the interpreter
        elif w == "step":
            env["TRITON_INTERPRET"] = "1"  # the step kernel runs on the CPU only through Triton's interpreter
        cwd = None
        if variant:
            # run from DIR (`python -m` puts the working directory first on the path): the baseline's packages
            # shadow this tree's, and `bench` itself still comes from this tree
            cwd = str(Path(args.baseline).resolve())
            here = str(Path(__file__).resolve().parent.parent)
            env["PYTHONPATH"] = os.pathsep.join([cwd, here] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        argv = ["--worker", "step" if w == "step" else "flush", "--backend", base, "--mode", mode, "--device", device,
                "--deadline", repr(deadline), "--results-file", str(path)]
        print(f"--- {w} (until +{deadline - t0:.0f} s)", flush=True)
        started = time.time()
        status = _run_worker(w, argv, env, deadline, cwd)
        status["seconds"] = round(time.time() - started, 1)
        meta["workers"].append(status)
        rows = _read(path)
        if w != "step":
            if status["rc"] != 0 or status["killed_after_budget"]:
                rows = _close_out(rows, w, plan_, status)
        elif status["rc"] != 0 or status["killed_after_budget"]:
            print(f"--- step worker failed (rc={status['rc']}): {' | '.join(status['stderr_tail'][-3:])}", flush=True)
        records[w] = rows
        # written after every worker: if this process is killed from outside, what was measured is on disk
        doc, stem = _write(args, plan_, backends, records, meta, device, t0, final=False)
    doc, stem = _write(args, plan_, backends, records, meta, device, t0, final=True)
    png = stem.with_suffix(".png")
    shutil.rmtree(tmp, ignore_errors=True)

    print()
    for line in report.summary_lines(doc):
        print(line)
    print()
    for line in report.table_lines(doc):
        print(line)
    rs = report.reasons(doc)
    if rs:
        print("\nnot measured, or timed without a graph:")
        for r in rs:
            print(f"  {r}")
    if doc.get("plot_error"):
        print(f"\nplot not written: {doc['plot_error']}")
    print(f"\nwrote {stem}.json, {stem}.md" + (f", {png}" if doc["plot"] else "") + f" in {doc['wall_s']:.0f} s")
    return 0


def worker(args) -> int:
    import torch

    from .timing import Recorder

    record = Recorder(args.results_file)
    device = torch.device(args.device)
    try:
        if args.worker == "step":
            from . import step

            step.run_worker(args.mode, device, args.deadline, record)
        else:
            from . import flush

            flush.run_worker(args.backend, args.mode, device, args.deadline, record)
    except Exception as e:  # recorded; the parent closes out what is missing
        import traceback

        record(kind="fatal", error=f"{type(e).__name__}: {e}"[:600], traceback=traceback.format_exc()[-2000:])
        traceback.print_exc()
        return 1
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few cases (smoke test on a GPU)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="the whole path on the CPU: reference backend, tiny sizes, host clock, no graphs")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="output folder")
    ap.add_argument("--backends", default=None,
                    help=f"comma-separated (default {','.join(DEFAULT_BACKENDS)}; --cpu-smoke: reference)")
    ap.add_argument("--budget", type=float, default=None,
                    help=f"seconds for all workers together (default {BUDGET['full']:.0f}, --quick "
                         f"{BUDGET['quick']:.0f})")
    ap.add_argument("--tag", default=None, help="file name tag instead of the device's name")
    ap.add_argument("--baseline", default=None, metavar="DIR",
                    help="also time each backend from the packages in DIR, as <backend>@baseline (see above)")
    # internal: one worker process
    ap.add_argument("--worker", choices=["step", "flush"], help=argparse.SUPPRESS)
    ap.add_argument("--backend", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--device", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--results-file", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
