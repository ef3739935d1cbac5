"""The flush's two schedules against each other: ``list`` (the due pairs listed first, one program each) and ``grid``
(one program per (row, head)), over rings, batches and due fractions, beside the pick of
:func:`leapquant_triton.flush.schedule_for` (which knows ``N`` x heads only, not the ring).

    python -m bench.schedule               # on a GPU: KDA, 32 heads of 128 x 128, rank 4; rings 8, 16, 32 at one
                                           # iteration and ring 32 at two (eight builds to compile, 32 timings)
    python -m bench.schedule --cpu-smoke   # the same path on the CPU through Triton's interpreter: tiny sizes

Writes ``<out>/schedule_<device>.json`` and ``.md``. Per geometry (ring, iterations) one compact pool of 2 x 256 + 1
slots filled with the Gaussian regime; per case (batch rows N at random distinct slots, a due fraction f) exactly
round(f N HV) of the rows' heads full (at random), the others holding fewer than L entries (:mod:`bench.flush`'s
cases, with f = 1/L read per ring). ``f = 1/L`` is a decode
layer's steady state (:mod:`bench.decode`'s ``decode layer`` at L = 16), ``f = 1`` every ring full at once. Each
schedule's ``leapquant_triton.flush.flush_pool`` is captured in a CUDA graph and replayed (the rings and fill counts
restored before each replay, L2 evicted: :func:`bench.timing.time_replays`); medians beside the floor of
:func:`bench.flush.floor_bytes` at the copy bandwidth of the same run. Each case also flushes the same pool state once
with each schedule and compares every byte of the checkpoints (SPEC §5.2: a pair's bytes do not depend on how the
programs are scheduled).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from fractions import Fraction
from pathlib import Path

import torch

import leapquant

from .decode import Timer
from .flush import Case, _set_due, floor_bytes, program_bytes
from .timing import copy_bandwidth, device_info, device_slug, module_version, nvidia_smi

# (ring, subspace iterations): every ring the pool takes, and the build the AOT check flags (ring 32, two iterations)
GEOMETRIES = ((8, 1), (16, 1), (32, 1), (32, 2))
# (batch rows, due fraction): "1/L" the ring's steady state; around schedule_for's threshold of 2,048 programs
CASES = ((32, "1/L"), (64, "1/L"), (256, "1/L"), (256, "1"))
SCHEDULES = ("list", "grid")


def _fraction(text: str, ring: int) -> Fraction:
    return Fraction(1, ring) if text == "1/L" else Fraction(text)


def make_pool(ring: int, iters: int, heads: int, head_dim: int, max_batch: int, device, seed: int = 0):
    """A compact pool of ``2 max_batch + 1`` slots, every real slot filled (Gaussian regime, full rings)."""
    from leapquant.tools.workloads import fill

    pool = leapquant.Pool(2 * max_batch + 1, heads, head_dim, head_dim, ring=ring, gate="kda", iters=iters,
                          device=device)
    fill(pool, torch.arange(1, pool.num_slots), "gaussian", torch.Generator().manual_seed(seed + ring + iters))
    return pool


def geometry_rows(timer: Timer, pool, cases, seed: int = 0) -> list[dict]:
    """Both schedules' rows for every case on ``pool``."""
    from leapquant_triton.flush import flush_pool, schedule_for

    names = [n for n in ("w", "pcum", "gbuf") if getattr(pool, n) is not None]
    saved = {n: getattr(pool, n).clone() for n in names}
    raw0 = pool.raw.clone()
    pb = program_bytes(pool)
    rows = []
    for batch, ftext in cases:
        # the flush benchmark's case: batch distinct random slots, exactly due_count() heads full, the rest below L
        case = Case(pool.heads, batch, str(_fraction(ftext, pool.ring)))
        idx = _set_due(pool, case, seed + pool.ring + pool.iters)
        due, hcnt0 = case.due_count(), pool.hcnt.clone()

        def restore():
            for n, t in saved.items():
                getattr(pool, n).copy_(t)
            pool.hcnt.copy_(hcnt0)

        base = {"ring": pool.ring, "iters": pool.iters, "batch": batch, "fraction": ftext, "due": due,
                "programs": batch * pool.heads, "picked": schedule_for(batch, pool.heads)}
        written = {}
        for sched in SCHEDULES:
            def flush(sched=sched):
                flush_pool(pool, idx, schedule=sched)
            label = f"L{pool.ring} it{pool.iters} N{batch} f{ftext} {sched}"
            try:
                row = timer(label, flush, restore, floor_bytes(pb, due, batch), **base, schedule=sched)
            except Exception as e:  # one case's failure costs that case only
                row = {"case": label, **base, "schedule": sched, "status": "error",
                       "reason": f"{type(e).__name__}: {e}"[:300]}
            rows.append(row)
            try:  # one flush of the same state, its bytes kept as integers (code bytes read as fp32 may be NaN)
                pool.raw.copy_(raw0)
                restore()
                flush()
                written[sched] = pool.raw.view(torch.int32).clone()
            except Exception:
                written[sched] = None
            finally:
                pool.raw.copy_(raw0)
        ok = all(x is not None for x in written.values())
        same = bool(torch.equal(written["list"], written["grid"])) if ok else None
        # the comparison means something only if the flush wrote the checkpoints
        changed = not torch.equal(written["list"], raw0.view(torch.int32)) if ok else None
        for r in rows[-len(SCHEDULES):]:
            r["same_bytes"], r["flushed"] = same, changed
    return rows


def run(device: torch.device, *, heads: int = 32, head_dim: int = 128, geometries=GEOMETRIES, cases=CASES,
        budget_s: float = 1.0, on_progress=None) -> dict:
    t0 = time.time()
    bw = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (1 << 20))
    smi = nvidia_smi() if device.type == "cuda" else {}
    timer = Timer(device, bw, budget_s)
    doc = {
        "what": "the flush's list and grid schedules over rings, batches and due fractions (bench/schedule.py)",
        "config": {"gate": "kda", "heads": heads, "head_k": head_dim, "head_v": head_dim, "rank": 4,
                   "layout": "compact", "pool_slots": 2 * max(b for b, _ in cases) + 1, "budget_s": budget_s,
                   "max_replays": timer.reps[1],
                   "clock": "CUDA-graph replays, CUDA events" if device.type == "cuda" else "eager calls, the host "
                   "clock"},
        "device": device_info(device), "driver": smi.get("driver"), "cpu": platform.processor(),
        "versions": {m: module_version(m) for m in ("leapquant", "torch", "triton")}, "bandwidth": bw,
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": [],
    }
    print(f"bench.schedule on {doc['device']['name']} ({bw['GBps']:.0f} GB/s): {heads} heads of {head_dim} x "
          f"{head_dim}, (ring, iterations) {list(geometries)}", flush=True)
    for ring, iters in geometries:
        pool = make_pool(ring, iters, heads, head_dim, max(b for b, _ in cases), device)
        doc["rows"] += geometry_rows(timer, pool, cases)
        del pool
        doc["wall_s"] = round(time.time() - t0, 1)
        if on_progress is not None:
            on_progress(doc)
    doc["wall_s"] = round(time.time() - t0, 1)
    return doc


def markdown(doc: dict) -> str:
    d, v, c = doc["device"], doc["versions"], doc["config"]
    lines = [f"# Flush schedules on {d.get('name')}", "",
             f"{d.get('name')}, driver {doc['driver']}; torch {v['torch']}, Triton {v['triton']}; {doc['date_utc']}; "
             f"the run took {doc.get('wall_s', 0):.0f} s. Copy bandwidth {doc['bandwidth']['GBps']:.0f} GB/s (same "
             f"run). KDA, {c['heads']} heads of {c['head_k']} x {c['head_v']}, rank {c['rank']}, a compact pool of "
             f"{c['pool_slots']} slots; medians of {c['clock']}, {c['budget_s']:g} s per case (at most "
             f"{c['max_replays']} replays); floor = the due programs' bytes and the due scan over that bandwidth "
             "(bench/schedule.py). `picked`: what `schedule_for` launches for that N x heads.", "",
             "| ring | iters | N | due | floor | list | grid | list / grid | picked | faster | same bytes |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |"]
    by = {}
    for r in doc["rows"]:
        by.setdefault((r["ring"], r["iters"], r["batch"], r["fraction"]), {})[r["schedule"]] = r
    for (ring, iters, batch, _), pair in by.items():
        lst, grd = pair.get("list", {}), pair.get("grid", {})
        ok = lst.get("status") == "ok" and grd.get("status") == "ok"
        t = lambda r: f"{r['median_us']:.1f} us" if r.get("status") == "ok" else r.get("status", "—")  # noqa: E731
        first = lst or grd
        ratio = f"{lst['median_us'] / grd['median_us']:.2f}" if ok else "—"
        faster = ("list" if lst["median_us"] < grd["median_us"] else "grid") if ok else "—"
        floor = f"{first['floor_us']:.1f} us" if "floor_us" in first else "—"
        lines.append(f"| {ring} | {iters} | {batch} | {first['due']} | {floor} | {t(lst)} | {t(grd)} | {ratio} | "
                     f"{first['picked']} | {faster} | {_same_text(first)} |")
    errors = [f"{r['case']}: {r['reason']}" for r in doc["rows"] if r.get("status") not in (None, "ok")]
    if errors:
        lines += ["", "Not timed: " + "; ".join(errors[:4])]
    return "\n".join(lines) + "\n"


def _same_text(row: dict) -> str:
    if row.get("same_bytes") is None:
        return "not compared"
    return ("yes" if row["same_bytes"] else "no") + ("" if row.get("flushed") else " (nothing flushed)")


def _write(doc: dict, out: Path, slug: str) -> None:
    stem = out / f"schedule_{slug}"
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(doc))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.schedule", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny sizes on the CPU through Triton's interpreter (set TRITON_INTERPRET=1 first)")
    ap.add_argument("--budget", type=float, default=None, help="seconds of replays per case (default 1)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="output folder")
    args = ap.parse_args(argv)
    cpu = args.cpu_smoke
    if not cpu and not torch.cuda.is_available():
        print("error: no CUDA device here; `TRITON_INTERPRET=1 python -m bench.schedule --cpu-smoke` runs the path "
              "on the CPU", file=sys.stderr)
        return 2
    if cpu and os.environ.get("TRITON_INTERPRET") != "1":
        print("error: --cpu-smoke runs the Triton flush through its interpreter: `TRITON_INTERPRET=1 python -m "
              "bench.schedule --cpu-smoke`", file=sys.stderr)
        return 2
    device = torch.device("cpu" if cpu else "cuda")
    slug = "cpu" if cpu else device_slug(torch.cuda.get_device_name(device))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if cpu:
        doc = run(device, heads=2, head_dim=64, geometries=((8, 1), (32, 2)), cases=((2, "1/L"), (2, "1")),
                  budget_s=args.budget or 0.01, on_progress=lambda d: _write(d, out, slug))
    else:
        doc = run(device, budget_s=args.budget or 1.0, on_progress=lambda d: _write(d, out, slug))
    _write(doc, out, slug)
    print(markdown(doc))
    print(f"wrote {out / f'schedule_{slug}'}.json, .md in {doc['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
