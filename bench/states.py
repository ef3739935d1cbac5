"""States in and out benchmark: ``Pool.load_states`` and ``Pool.states`` (SPEC §5) beside their floors.

    python -m bench.states                    # on a GPU: KDA, 256 sequences x 32 heads, K = V = 128, ring 16
    python -m bench.states --sweep            # also other builds of the Triton kernels (warps, register cap)
    python -m bench.states --cpu-smoke        # the same path on the CPU: tiny sizes, the reference backend

Writes ``<out>/states_<device>.json`` and ``.md``. Every case is ``check=False`` captured in a CUDA graph and replayed
(L2 evicted before each replay; neither call depends on what the last replay left: ``load_states`` overwrites the
checkpoints and rings it writes, ``states`` writes only its output); medians after warm-up, each beside its floor =
the bytes it must move over the copy bandwidth measured in the same run:

* ``load_states``: per (row, head) the fp32 state read, the checkpoint written, the ring resets written (``w``,
  ``pcum``, KDA's ``gbuf``) and ``hcnt``; per row its slot;
* ``states``: per (row, head) the checkpoint and the whole ring read (``kbuf``, ``ubuf``, ``w``, ``pcum``, ``gbuf``),
  the fp32 state written; per row its slot.

Each in the V-first layout ``[n, HV, V, K]`` and FLA's ``[n, HV, K, V]`` (``state_v_first=False``). After timing, the
results are checked: ``states`` against the reference to fp32 rounding, ``load_states`` by ``leapquant.parity``.

The same run times ``leapquant.flush(..., check=False)`` of an engine-layout pool and of a compact one (SPEC §2) with
the same contents, all due and 1/16 due (the rings restored before each replay): the compact layout must not make the
flush slower (within 5 %).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

import leapquant

from .timing import capture, copy_bandwidth, device_info, device_slug, module_version, nvidia_smi, time_replays

# the targets at 256 x 32 heads, x floor (docs/DESIGN.md, "Triton: states in and out")
TARGETS = {"load_states": 4.0, "states": 1.5}
# the compact layout's flush over the engine layout's, at most
LAYOUT_TARGET = 1.05
# other builds of the Triton kernels timed with --sweep: (warps, register cap; 0 = none); the default is the flush's
SWEEP = ((8, 0), (4, 0), (16, 0))


def _slice_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t[0, 0].numel() * t.element_size()


def transfer_bytes(pool) -> dict:
    """Bytes per (row, head) each call must move, counted from the pool's own views (SPEC §2), and per row."""
    state = pool.head_v * pool.head_k * 4
    checkpoint = sum(_slice_bytes(t) for t in (pool.codes, pool.s_k, pool.s_v, pool.uq))
    ring = sum(_slice_bytes(t) for t in (pool.kbuf, pool.ubuf, pool.w, pool.pcum, pool.gbuf))
    resets = sum(_slice_bytes(t) for t in (pool.w, pool.pcum, pool.gbuf))
    hcnt = pool.hcnt.element_size()
    return {"state": state, "checkpoint": checkpoint, "ring": ring, "resets": resets,
            "load_states": state + checkpoint + resets + hcnt, "states": checkpoint + ring + state, "per_row": 4}


def _check(pool, slots, backend: str, gen: torch.Generator) -> dict:
    """The timed backend's results on two rows: ``states`` against the reference, ``load_states`` by SPEC §4."""
    from leapquant import parity
    from leapquant import formulas as ref

    few = slots[:2]
    got = pool.states(few, backend=backend, check=False).cpu()
    want = pool.states(few, backend="reference").cpu()
    states_err = float(ref.relative_error(got, want).max())
    S = torch.randn(few.numel(), pool.heads, pool.head_v, pool.head_k, generator=gen).to(pool.device)
    p = parity.measure_load_states(pool, few, S, backend, check=False)
    return {"states_max_rel_err": states_err, "load_parity": p.summary(), "load_failures": p.failures(),
            "ok": states_err < 1e-6 and p.ok()}


def run(device: torch.device, batch: int, heads: int, head_k: int, head_v: int, gate: str, backend: str,
        budget_s: float, sweep: bool) -> dict:
    from leapquant.tools.workloads import fill

    gen = torch.Generator().manual_seed(0)
    B, HV = batch, heads
    # the engine layout, named: the flush comparison below copies this pool into a compact one (the default)
    pool = leapquant.Pool(B + 1, HV, head_k, head_v, gate=gate, device=device, layout="engine")
    slots = torch.arange(1, B + 1, dtype=torch.int32, device=device)
    fill(pool, slots.cpu(), "gaussian", gen)  # checkpoints and full rings: the state as a decode leaves it
    chosen = leapquant.select(pool, backend, op="states").name
    S = {True: pool.states(slots, backend=backend), False: None}
    S[False] = S[True].transpose(-1, -2).contiguous()
    out = {v: torch.empty_like(S[v]) for v in (True, False)}
    bw = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (1 << 24))
    bps = bw["GBps"] * 1e9
    tb = transfer_bytes(pool)
    reps = (10, 200) if device.type == "cuda" else (2, 3)
    cases = []
    hcnt0 = pool.hcnt.clone()

    def restore():  # the decode's fill counts back (load_states zeroes them; nothing reads them here)
        pool.hcnt.copy_(hcnt0)

    def timed(name, kind, fn, **extra):
        fn()  # compiles, outside the capture
        graph = capture(fn, device)
        t = time_replays(graph, restore, device, budget_s=budget_s, min_reps=reps[0], max_reps=reps[1])
        nbytes = B * HV * tb[kind] + B * tb["per_row"]
        floor_us = nbytes / bps * 1e6
        row = {"case": name, "kind": kind, "median_us": t.median * 1e6, "p20_us": t.p20 * 1e6,
               "p80_us": t.p80 * 1e6, "floor_us": floor_us, "x_floor": t.median * 1e6 / floor_us,
               "target_x_floor": TARGETS[kind], "GBps": nbytes / t.median / 1e9, "bytes": nbytes, **extra}
        row["meets_target"] = row["x_floor"] <= TARGETS[kind]
        cases.append(row)
        print(f"{name:<40} {row['median_us']:10.1f} us  floor {floor_us:8.1f} us  x{row['x_floor']:.2f}", flush=True)

    for v_first in (True, False):
        lay = "" if v_first else ", FLA layout"
        timed(f"load_states{lay}", "load_states",
              lambda v=v_first: pool.load_states(slots, S[v], backend=backend, check=False, state_v_first=v),
              state_v_first=v_first, build="default")
        timed(f"states{lay}", "states",
              lambda v=v_first: pool.states(slots, out=out[v], backend=backend, check=False, state_v_first=v),
              state_v_first=v_first, build="default")
    if sweep and chosen == "triton":
        from leapquant_triton.states import load_states_pool, states_pool

        for nw, cap in SWEEP:
            build = f"{nw} warps, " + (f"cap {cap}" if cap else "uncapped")
            timed(f"load_states [{build}]", "load_states",
                  lambda nw=nw, cap=cap: load_states_pool(pool, slots, S[True], True, num_warps=nw, maxnreg=cap),
                  state_v_first=True, build=build)
            timed(f"states [{build}]", "states",
                  lambda nw=nw, cap=cap: states_pool(pool, slots, out[True], True, num_warps=nw, maxnreg=cap),
                  state_v_first=True, build=build)
    restore()
    check = _check(pool, slots, backend, gen)
    layouts = _layouts(pool, slots, backend, bps, budget_s, reps)
    smi = nvidia_smi() if device.type == "cuda" else {}
    return {
        "what": "load_states / states timings beside their floors (bench/states.py)",
        "case": {"batch": B, "heads": HV, "head_k": head_k, "head_v": head_v, "ring": pool.ring, "rank": pool.rank,
                 "gate": gate, "backend": chosen},
        "device": device_info(device), "driver": smi.get("driver"), "cpu": platform.processor(),
        "versions": {m: module_version(m) for m in ("leapquant", "torch", "triton")},
        "bandwidth": bw, "bytes_per_head": tb, "cases": cases, "check": check, "layouts": layouts,
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def _layouts(pool, slots, backend: str, bps: float, budget_s: float, reps: tuple) -> list[dict]:
    """The flush of ``pool`` (engine layout) and of a compact copy of it, all due and 1/16 due, each beside its floor
    (the due programs' traffic, ``bench.flush.floor_bytes``)."""
    from leapquant import parity
    from leapquant.constants import BASE_WORDS
    from leapquant.tools.workloads import fill

    from .flush import _Rings, floor_bytes, program_bytes

    g = pool.geometry
    fill(pool, slots.cpu(), "gaussian", torch.Generator().manual_seed(1))  # load_states emptied the rings
    compact = leapquant.Pool(g.num_slots, g.heads, g.head_k, g.head_v, g.ring, g.rank, gate=g.gate,
                             device=pool.device, layout="compact")
    for name in ("codes", "s_k", "s_v", "uq", "kbuf", "ubuf", "w", "pcum", "gbuf"):
        if getattr(pool, name) is not None:
            getattr(compact, name).copy_(getattr(pool, name))
    B, HV, L = slots.numel(), g.heads, g.ring
    gen = torch.Generator().manual_seed(16)
    rows = []
    # one flush of the same contents, all due: the two layouts must hold the same bytes after it
    saved = [_Rings(p) for p in (pool, compact)]
    for p in (pool, compact):
        p.hcnt[slots.long()] = L
        leapquant.flush(p, slots, backend=backend, check=False)
    same = all(torch.equal(parity.as_bytes(getattr(pool, n)), parity.as_bytes(getattr(compact, n)))
               for n in ("codes", "s_k", "s_v", "uq", "w", "pcum"))
    for r in saved:
        r.restore()
    for frac, due_count in (("1", B * HV), ("1/16", max(1, B * HV // 16))):
        flat = torch.zeros(B * HV, dtype=torch.bool)
        flat[torch.randperm(B * HV, generator=gen)[:due_count]] = True
        hcnt = torch.where(flat.reshape(B, HV), L, 0).to(torch.int32).to(pool.device)
        for layout, p in (("engine", pool), ("compact", compact)):
            p.hcnt[slots.long()] = hcnt
            rings = _Rings(p)
            fn = lambda p=p: leapquant.flush(p, slots, backend=backend, check=False)  # noqa: E731
            fn()
            rings.restore()
            graph = capture(fn, p.device)
            t = time_replays(graph, rings.restore, p.device, budget_s=budget_s, min_reps=reps[0], max_reps=reps[1])
            rings.restore()
            floor_us = floor_bytes(program_bytes(p), due_count, B) / bps * 1e6
            rows.append({"layout": layout, "due": frac, "programs": due_count, "median_us": t.median * 1e6,
                         "floor_us": floor_us, "x_floor": t.median * 1e6 / floor_us,
                         "raw_bytes_per_slot": (p.raw.numel() - BASE_WORDS) * 4 // g.num_slots})
            print(f"flush {frac:>4} due, {layout:<8} {t.median * 1e6:10.1f} us  floor {floor_us:8.1f} us", flush=True)
        rows[-1]["over_engine"] = rows[-1]["median_us"] / rows[-2]["median_us"]
        rows[-1]["meets_target"] = rows[-1]["over_engine"] <= LAYOUT_TARGET
    for r in rows:
        r["same_bytes_as_engine"] = same
    return rows


def markdown(doc: dict) -> str:
    c, d, v = doc["case"], doc["device"], doc["versions"]
    tb = doc["bytes_per_head"]
    lines = [f"# States in and out on {d.get('name')}", "",
             f"{d.get('name')}, driver {doc['driver']}; torch {v['torch']}, Triton {v['triton']}; {doc['date_utc']}. "
             f"{c['gate'].upper()}, {c['batch']} sequences x {c['heads']} heads, K = {c['head_k']}, V = "
             f"{c['head_v']}, ring {c['ring']}, rank {c['rank']}; backend {c['backend']}; check=False, CUDA-graph "
             f"replays, medians (bench/states.py). Copy bandwidth {doc['bandwidth']['GBps']:.0f} GB/s (same run). "
             f"Floor per (row, head): load_states {tb['load_states']:,} B (state {tb['state']:,} read, checkpoint "
             f"{tb['checkpoint']:,} + ring resets {tb['resets']:,} + hcnt written), states {tb['states']:,} B "
             f"(checkpoint + ring {tb['ring']:,} read, state written).", "",
             "| case | time | floor | x floor | target | GB/s |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in doc["cases"]:
        mark = "met" if r["meets_target"] else "missed"
        lines.append(f"| {r['case']} | {r['median_us']:.1f} us | {r['floor_us']:.1f} us | {r['x_floor']:.2f} | "
                     f"<= {r['target_x_floor']:g} ({mark}) | {r['GBps']:.0f} |")
    if doc.get("layouts"):
        lines += ["", "Flush (`leapquant.flush`, check=False, CUDA-graph replays, rings restored between them) of the "
                  "engine layout's pool and of a compact pool with the same contents:", "",
                  "| due | layout | raw bytes per slot (past the header) | time | floor | x floor | compact / engine |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
        for r in doc["layouts"]:
            ratio = (f"{r['over_engine']:.3f} (<= {LAYOUT_TARGET:g}: {'met' if r['meets_target'] else 'missed'})"
                     if "over_engine" in r else "")
            lines.append(f"| {r['due']} | {r['layout']} | {r['raw_bytes_per_slot']:,} | {r['median_us']:.1f} us | "
                         f"{r['floor_us']:.1f} us | {r['x_floor']:.2f} | {ratio} |")
        lines.append(f"\nAfter one flush of the same contents both pools hold the same bytes: "
                     f"{'yes' if doc['layouts'][0]['same_bytes_as_engine'] else 'NO'}.")
    ck = doc["check"]
    lines += ["", f"Check after timing: states vs reference max relative error {ck['states_max_rel_err']:.2e}; "
              f"load_states parity ratio mean {ck['load_parity']['ratio_mean']:.5f}, worst "
              f"{ck['load_parity']['ratio_worst']:.5f}; " + ("ok" if ck["ok"] else "FAILED: " +
                                                               "; ".join(ck["load_failures"]))]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.states", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU with the reference backend")
    ap.add_argument("--batch", type=int, default=None, help="sequences (default 256; --cpu-smoke 3)")
    ap.add_argument("--heads", type=int, default=None, help="heads (default 32; --cpu-smoke 2)")
    ap.add_argument("--head-dim", type=int, default=None, help="K = V (default 128; --cpu-smoke 64)")
    ap.add_argument("--gate", choices=["kda", "gdn"], default="kda", help="the gate (default kda)")
    ap.add_argument("--backend", default="auto", help="backend of load_states / states (default auto)")
    ap.add_argument("--sweep", action="store_true", help="also time other builds of the Triton kernels")
    ap.add_argument("--budget", type=float, default=None, help="seconds of replays per case (default 2)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="output folder")
    args = ap.parse_args(argv)
    cpu = args.cpu_smoke
    if not cpu and not torch.cuda.is_available():
        print("error: no CUDA device here; `python -m bench.states --cpu-smoke` runs the path on the CPU",
              file=sys.stderr)
        return 2
    device = torch.device("cpu" if cpu else "cuda")
    dim = args.head_dim or (64 if cpu else 128)
    doc = run(device, args.batch or (3 if cpu else 256), args.heads or (2 if cpu else 32), dim, dim, args.gate,
              "reference" if cpu and args.backend == "auto" else args.backend, args.budget or (0.05 if cpu else 2.0),
              args.sweep)
    slug = "cpu" if cpu else device_slug(doc["device"]["name"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"states_{slug}.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / f"states_{slug}.md").write_text(markdown(doc))
    print(markdown(doc))
    return 0 if doc["check"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
