"""Host time per eager ``flush`` call: what an engine that does not replay a CUDA graph pays on its CPU.

    python -m bench.host_overhead                    # every backend available on the GPU
    python -m bench.host_overhead --device cpu       # the reference backend on the CPU (smoke)

Each path is called back to back ``--calls`` times per round, ``--rounds`` rounds after a warm-up; per round the host
time to return from the calls and the wall time until the GPU has finished them are divided by the calls. With no
program due (every ring below ``L``) the GPU's share is short, so the wall time is the host time unless a path
launches more work than its host time covers. Paths:

* ``flush``: ``leapquant.flush(pool, idx, backend=b, check=False)``, the hot path;
* ``flush+check``: the same with ``check=True`` (reads ``idx`` on the host: a synchronisation per call);
* ``op``: ``torch.ops.leapquant.flush(...)``, the custom op that ``torch.compile`` graphs hold;
* ``backend``: ``leapquant.get_backend(b).flush(pool, idx)``, the backend's own launches without the interface;
* ``bound`` (Triton only): the same with every launch bound by Triton (``JITFunction.run``) instead of the direct
  launches of ``leapquant_triton/launcher.py``: what that launcher saves.

Writes ``<out>/host_overhead_<device>.json`` and ``.md`` with the device, CPU and library versions.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import leapquant
from leapquant.ops import op_args

from .timing import device_info, device_slug, module_version, nvidia_smi

PATHS = ("flush", "flush+check", "op", "backend", "bound")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _idle_pool(device: torch.device, rows: int) -> tuple:
    """A KDA pool of 32 heads and ``idx`` of ``rows`` rows, nothing due: the GPU's part is the launches and the due
    test."""
    pool = leapquant.Pool(2 * rows + 1, 32, gate="kda", device=device)
    pool.hcnt.fill_(pool.ring - 1)
    return pool, torch.arange(1, rows + 1, dtype=torch.int32, device=device)


def _calls(pool, idx, backend: str) -> dict:
    args = op_args(pool, idx, backend)
    b = leapquant.get_backend(backend)
    calls = {
        "flush": lambda: leapquant.flush(pool, idx, backend=backend, check=False),
        "flush+check": lambda: leapquant.flush(pool, idx, backend=backend, check=True),
        "op": lambda: torch.ops.leapquant.flush(*args),
        "backend": lambda: b.flush(pool, idx),
    }
    if backend == "triton":
        calls["bound"] = _bound(calls["backend"])
    return calls


def _bound(fn):
    """``fn`` with the Triton backend's launches bound by Triton on every call (the launcher's direct path off)."""
    from leapquant_triton import flush

    launchers = (flush._launch_flush, flush._launch_due_list)

    def call():
        saved = [la.direct for la in launchers]
        for la in launchers:
            la.direct = False
        try:
            fn()
        finally:
            for la, d in zip(launchers, saved):
                la.direct = d

    return call


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn, device: torch.device, calls: int, rounds: int, warmup: int) -> dict:
    for _ in range(warmup):
        fn()
    _sync(device)
    host, wall = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        _sync(device)
        t2 = time.perf_counter()
        host.append((t1 - t0) / calls * 1e6)
        wall.append((t2 - t0) / calls * 1e6)
    return {"host_us": statistics.median(host), "host_min_us": min(host), "wall_us": statistics.median(wall),
            "calls": calls, "rounds": rounds}


def run(device: torch.device, backends: list[str], rows: int, calls: int, rounds: int, warmup: int) -> dict:
    pool, idx = _idle_pool(device, rows)
    results = {}
    for name in backends:
        ok, why = leapquant.get_backend(name).supports(pool) if name in _known() else (False, "unknown backend")
        if not ok:
            results[name] = {"status": "unavailable", "reason": why}
            continue
        results[name] = {"status": "ok", **{p: measure(fn, device, calls, rounds, warmup)
                                            for p, fn in _calls(pool, idx, name).items()}}
        r = results[name]
        print(f"{name:>10}: " + "  ".join(f"{p} {r[p]['host_us']:.1f} us" for p in PATHS if p in r), flush=True)
    smi = nvidia_smi() if device.type == "cuda" else {}
    return {
        "what": "host time per eager flush call, nothing due (leapquant.flush and the paths below it)",
        "case": {"rows": rows, "heads": 32, "gate": "kda", "head_k": 128, "head_v": 128, "ring": 16, "due": 0},
        "device": device_info(device), "driver": smi.get("driver"), "cpu": _cpu_model(),
        "versions": {m: module_version(m) for m in ("leapquant", "triton", "tilelang")},
        "results": results,
    }


def _known() -> set[str]:
    return {i.name for i in leapquant.backends()}


def markdown(doc: dict) -> str:
    d = doc["device"]
    v = doc["versions"]
    lines = [
        "# Host time per eager flush call",
        "",
        f"{d['name']} ({d.get('capability')}), driver {doc['driver']}, CPU {doc['cpu']}; torch {d['torch']}, "
        f"CUDA {d['cuda']}, Triton {v['triton']}, TileLang {v['tilelang']}. KDA, {doc['case']['rows']} rows x 32 "
        "heads, nothing due. Median over rounds of back-to-back calls (bench/host_overhead.py: host = until the "
        "calls return, wall = until the device has finished them).",
        "",
        "| backend | " + " | ".join(f"{p} host / wall" for p in PATHS) + " |",
        "| --- |" + " ---: |" * len(PATHS),
    ]
    for name, r in doc["results"].items():
        if r["status"] != "ok":
            lines.append(f"| {name} | " + " | ".join([r["reason"]] + [""] * (len(PATHS) - 1)) + " |")
            continue
        lines.append(f"| {name} | " + " | ".join(f"{r[p]['host_us']:.1f} / {r[p]['wall_us']:.1f} us" if p in r
                                                  else "n/a" for p in PATHS) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.host_overhead", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the pool lives (default: cuda if there is a GPU)")
    ap.add_argument("--backends", default=None, help="comma-separated; default: every backend available here")
    ap.add_argument("--rows", type=int, default=8, help="rows of idx (sequences of 32 heads), none due (default 8)")
    ap.add_argument("--calls", type=int, default=200, help="back-to-back calls per round (default 200)")
    ap.add_argument("--rounds", type=int, default=7, help="rounds; the median is reported (default 7)")
    ap.add_argument("--warmup", type=int, default=30, help="untimed calls first (default 30)")
    ap.add_argument("--out", default="bench/results", help="folder for host_overhead_<device>.json and .md")
    ap.add_argument("--profile", default=None, metavar="BACKEND",
                    help="also print where the host time of BACKEND's own launch goes (cProfile, top 25 by own time)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    names = args.backends.split(",") if args.backends else [i.name for i in leapquant.backends() if i.available]
    if device.type == "cpu" and not args.backends:
        names = ["reference"]
    doc = run(device, names, args.rows, args.calls, args.rounds, args.warmup)
    slug = "cpu" if device.type == "cpu" else device_slug(doc["device"]["name"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"host_overhead_{slug}.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / f"host_overhead_{slug}.md").write_text(markdown(doc))
    print(markdown(doc))
    if args.profile:
        profile(device, args.profile, args.rows, args.calls)
    return 0


def profile(device: torch.device, backend: str, rows: int, calls: int) -> None:
    import cProfile
    import pstats

    pool, idx = _idle_pool(device, rows)
    fn = _calls(pool, idx, backend)["backend"]
    measure(fn, device, calls, 1, 30)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    _sync(device)
    print(f"\n{backend}: the backend's own launch, {calls} calls, by own time")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    raise SystemExit(main())
