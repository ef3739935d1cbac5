"""The engine's cursor and copy operations beside their floors: ``leapquant.accept`` (SPEC §6.1) and
``Pool.copy_slots`` (SPEC §5.3).

    python -m bench.engine                 # on a GPU: KDA and GDN, 256 sequences x 32 heads, K = V = 128, ring 16
    python -m bench.engine --cpu-smoke     # the same path on the CPU at tiny sizes

Writes ``<out>/engine_<device>.json`` and ``.md``. Every case is ``check=False``, captured in a CUDA graph and
replayed (L2 evicted before each replay); both calls are idempotent (``accept`` restores recorded values, a copy
between distinct slots writes the same bytes again), so a replay needs no restore. Medians after warm-up, each beside
its floor = the bytes the call must move over the copy bandwidth measured in the same run:

* ``accept`` of a T = 4 verify, per (row, head): the history's start and count and its ``pcum`` and ``w`` after n
  tokens read; ``hcnt``, ``pcum``, ``w`` and the count written; KDA also the gates of the T - n entries taken back
  (fp16 [K] each); per row its slot and n. Every n in 0 .. T drawn at random.
* ``copy_slots``, per pair and head: the slot's checkpoint (its bytes in ``raw``) and ring (``kbuf``, ``ubuf``,
  ``w``, ``pcum``, ``gbuf``) and ``hcnt`` read and written; per pair ``src`` and ``dst``. The step's backend (the
  Triton kernels on a GPU) and, as ``copy_slots ..., torch``, the torch form the other backends take.

After timing each result is checked: the counts ``accept`` leaves (SPEC §6.1's rule) and the copied slots' bytes.
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

from .states import _slice_bytes
from .timing import capture, copy_bandwidth, device_info, device_slug, module_version, nvidia_smi, time_replays

T = 4  # draft tokens per row of the verify that accept takes back
FILL = 7  # entries in every ring before the verify (a half-full ring)


def head_bytes(pool) -> dict:
    """Bytes per (row, head) of the two calls, counted from the pool's views; ``accept_gate`` per entry taken back
    (KDA's fp16 gates, 0 for GDN)."""
    pcum = _slice_bytes(pool.pcum)
    w = _slice_bytes(pool.w)
    checkpoint = sum(_slice_bytes(t) for t in (pool.codes, pool.s_k, pool.s_v, pool.uq))
    ring = sum(_slice_bytes(t) for t in (pool.kbuf, pool.ubuf, pool.w, pool.pcum, pool.gbuf))
    hcnt = pool.hcnt.element_size()
    return {"accept": 2 * hcnt + 2 * (pcum + w) + 2 * hcnt,  # start, count read; pcum, w read and written; hcnt, count
            "accept_gate": pool.head_k * pool.gbuf.element_size() if pool.gbuf is not None else 0,
            "copy": 2 * (checkpoint + ring + hcnt), "per_row": 8}


def accept_bytes(pool, n: torch.Tensor) -> int:
    """The floor of ``accept`` of rows taking back ``T - n`` of T tokens each."""
    hb = head_bytes(pool)
    taken_back = int((T - n.long()).sum())
    return n.numel() * (pool.heads * hb["accept"] + hb["per_row"]) + taken_back * pool.heads * hb["accept_gate"]


def _verified_pool(device, gate: str, B: int, HV: int, dim: int, gen: torch.Generator):
    """A pool that keeps a history, B rows at distinct random slots, every ring at ``FILL`` entries, after one verify
    of T tokens (what ``accept`` takes back)."""
    from leapquant.tools.workloads import fill

    pool = leapquant.Pool(2 * B + 1, HV, dim, dim, gate=gate, device=device, max_tokens=T)
    slots = torch.randperm(2 * B, generator=gen)[:B] + 1
    fill(pool, slots, "gaussian", gen)
    pool.hcnt[slots] = FILL
    idx = slots.to(torch.int32).to(device)
    q = torch.randn(B, T, HV, dim, generator=gen).to(device)
    k = torch.nn.functional.normalize(torch.randn(B, T, HV, dim, generator=gen), dim=-1).to(device)
    v = torch.randn(B, T, HV, dim, generator=gen).to(device)
    g = (-0.05 * torch.rand(*((B, T, HV, dim) if gate == "kda" else (B, T, HV)), generator=gen)).to(device)
    beta = torch.rand(B, T, HV, generator=gen).to(device)
    leapquant.step(pool, idx, q, k, v, g, beta)
    return pool, slots, idx


def run(device: torch.device, batch: int, heads: int, dim: int, pairs: int, budget_s: float) -> dict:
    bw = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (1 << 24))
    bps = bw["GBps"] * 1e9
    reps = (10, 200) if device.type == "cuda" else (2, 3)
    cases, checks = [], []

    def timed(name, gate, fn, nbytes, **extra):
        fn()  # outside the capture
        graph = capture(fn, device)
        t = time_replays(graph, lambda: None, device, budget_s=budget_s, min_reps=reps[0], max_reps=reps[1])
        floor_us = nbytes / bps * 1e6
        row = {"case": name, "gate": gate, "median_us": t.median * 1e6, "p20_us": t.p20 * 1e6, "p80_us": t.p80 * 1e6,
               "floor_us": floor_us, "x_floor": t.median * 1e6 / floor_us, "bytes": nbytes, **extra}
        cases.append(row)
        print(f"{gate} {name:<28} {row['median_us']:9.1f} us  floor {floor_us:7.1f} us  x{row['x_floor']:.2f}",
              flush=True)

    for gate in ("kda", "gdn"):
        gen = torch.Generator().manual_seed(0)
        pool, slots, idx = _verified_pool(device, gate, batch, heads, dim, gen)
        n = torch.randint(0, T + 1, (batch,), generator=gen, dtype=torch.int32).to(device)
        hist = pool.history
        start = hist.start[slots].long()
        timed(f"accept T={T}", gate, lambda: leapquant.accept(pool, idx, n, check=False), accept_bytes(pool, n),
              rows=batch, tokens=T)
        j0 = torch.where(start >= pool.ring, torch.zeros_like(start), start)
        kept = n.long()[:, None].to(start.device)
        want = torch.where(kept == 0, start, j0 + kept).to(torch.int32)
        checks.append({"case": f"{gate} accept", "ok": bool(torch.equal(pool.hcnt[slots], want))})
        # prefix caching: the first `pairs` rows' slots copied into free slots of the pool
        free = torch.tensor(sorted(set(range(1, pool.num_slots)) - set(slots.tolist())))[:pairs]
        src = slots[:pairs].to(device)
        dst = free.to(device)
        copy_floor = pairs * (pool.heads * head_bytes(pool)["copy"] + head_bytes(pool)["per_row"])
        timed(f"copy_slots {pairs} pairs", gate, lambda: pool.copy_slots(src, dst, check=False), copy_floor,
              pairs=pairs, backend=leapquant.select(pool, op="step").name)
        # the torch form (the backends without a copy kernel) beside it
        timed(f"copy_slots {pairs} pairs, torch", gate,
              lambda: pool.copy_slots(src, dst, check=False, backend="reference"), copy_floor, pairs=pairs,
              backend="reference")
        a, b = pool.checkpoint(src.cpu()), pool.checkpoint(dst.cpu())
        same = all((a[name] is None and b[name] is None) or torch.equal(a[name], b[name]) for name in a)
        same = same and torch.equal(pool.hcnt[src], pool.hcnt[dst])
        checks.append({"case": f"{gate} copy_slots", "ok": bool(same)})
    smi = nvidia_smi() if device.type == "cuda" else {}
    return {
        "what": "accept and copy_slots beside their floors (bench/engine.py)",
        "case": {"batch": batch, "heads": heads, "head_k": dim, "head_v": dim, "tokens": T, "fill": FILL,
                 "pairs": pairs},
        "device": device_info(device), "driver": smi.get("driver"), "cpu": platform.processor(),
        "versions": {m: module_version(m) for m in ("leapquant", "torch", "triton")},
        "bandwidth": bw, "cases": cases, "checks": checks, "ok": all(c["ok"] for c in checks),
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def markdown(doc: dict) -> str:
    c, d, v = doc["case"], doc["device"], doc["versions"]
    lines = [f"# accept and copy_slots on {d.get('name')}", "",
             f"{d.get('name')}, driver {doc['driver']}; torch {v['torch']}, Triton {v['triton']}; {doc['date_utc']}. "
             f"{c['batch']} sequences x {c['heads']} heads, K = V = {c['head_k']}; accept of a T = {c['tokens']} "
             f"verify from rings of {c['fill']} entries, n drawn in 0 .. {c['tokens']}; copy_slots of {c['pairs']} "
             f"slots; check=False, CUDA-graph replays, medians (bench/engine.py). Copy bandwidth "
             f"{doc['bandwidth']['GBps']:.0f} GB/s (same run).", "",
             "| gate | case | time | floor | x floor |", "| --- | --- | ---: | ---: | ---: |"]
    for r in doc["cases"]:
        lines.append(f"| {r['gate']} | {r['case']} | {r['median_us']:.1f} us | {r['floor_us']:.2f} us | "
                     f"{r['x_floor']:.1f} |")
    lines += ["", "Checks after timing: " + "; ".join(f"{c['case']} {'ok' if c['ok'] else 'FAILED'}"
                                                      for c in doc["checks"])]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU (the reference backend)")
    ap.add_argument("--batch", type=int, default=None, help="sequences (default 256; --cpu-smoke 3)")
    ap.add_argument("--heads", type=int, default=None, help="heads (default 32; --cpu-smoke 2)")
    ap.add_argument("--head-dim", type=int, default=None, help="K = V (default 128; --cpu-smoke 64)")
    ap.add_argument("--pairs", type=int, default=None, help="slots copy_slots copies (default 64; --cpu-smoke 2)")
    ap.add_argument("--budget", type=float, default=None, help="seconds of replays per case (default 2)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="output folder")
    args = ap.parse_args(argv)
    cpu = args.cpu_smoke
    if not cpu and not torch.cuda.is_available():
        print("error: no CUDA device here; `python -m bench.engine --cpu-smoke` runs the path on the CPU",
              file=sys.stderr)
        return 2
    device = torch.device("cpu" if cpu else "cuda")
    batch = args.batch or (3 if cpu else 256)
    pairs = min(args.pairs or (2 if cpu else 64), batch)
    doc = run(device, batch, args.heads or (2 if cpu else 32), args.head_dim or (64 if cpu else 128), pairs,
              args.budget or (0.05 if cpu else 2.0))
    slug = "cpu" if cpu else device_slug(doc["device"]["name"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"engine_{slug}.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / f"engine_{slug}.md").write_text(markdown(doc))
    print(markdown(doc))
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
