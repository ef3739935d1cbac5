"""Decode benchmark: ``leapquant.step`` against FLA's fused recurrent step on an in-place state pool.

    python -m bench.decode                   # on a GPU: KDA, 256 sequences x 32 heads, K = V = 128, ring 16
    python -m bench.decode --cpu-smoke       # the same path on the CPU: tiny sizes, the reference backend, no FLA
    python -m bench.decode --baseline DIR    # also LeapQuant's cases under DIR's packages, in the same run

Writes ``<out>/decode_<device>.json`` and ``.md``. Every case is captured in a CUDA graph and replayed (before each
replay, outside the timed region: the fill counts and rings the step changes are restored, L2 is evicted); medians
after warm-up, each beside its floor = the bytes it must move over the copy bandwidth measured in the same run.

Cases (q, k, v bf16; g, beta fp32; o bf16):

* ``step fill f``: ``leapquant.step`` with every ring holding ``f - 1`` entries, so the token lands at entry ``f - 1``
  and the step reads ``f - 1`` entries (f = 1, 8, 15; no ring full);
* ``decode layer``: the steady state of a ring of L = 16: 1/16 of the heads' rings full (flushed inside the step),
  the others spread evenly over fills 1..15;
* ``fla fp32`` / ``fla bf16``: FLA's ``fused_recurrent_kda_fwd`` with the state updated in place in a slot pool of
  that dtype (``inplace_final_state``, ``ssm_state_indices``, ``state_v_first``), what engines run today.

``--baseline DIR``: DIR holds another version's ``leapquant``, ``leapquant_triton`` and ``leapquant_tilelang``
packages (as for ``python -m bench --baseline``); LeapQuant's cases are then timed again with those packages first on
the path, in a subprocess right after this tree's, as ``<case>@baseline`` rows beside their own floor.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import leapquant

from .flush import program_bytes
from .timing import capture, copy_bandwidth, device_info, device_slug, module_version, nvidia_smi, time_replays

FILLS = (1, 8, 15)


def step_bytes(pool: leapquant.Pool, entries_read: int, key_heads: int, in_size: int, out_size: int) -> int:
    """What one (row, value head) of a decode step must move: the checkpoint and the ``entries_read`` ring entries
    in use read, the new entry and the gate state written, the token's inputs read and the output written (q and k
    counted once per key head)."""
    K, V, L = pool.head_k, pool.head_v, pool.ring
    kda = pool.gate == "kda"
    per_entry = 2 * K + 2 * V + 4 + (2 * K if kda else 0)  # kbuf, ubuf, w, gbuf
    checkpoint = pool.geometry.checkpoint_bytes
    gate_state = 2 * (4 * K if kda else 4) + 2 * 4  # pcum and hcnt, read and written
    written = per_entry + (4 * entries_read if not kda else 0)  # GDN rewrites the decayed weights
    inputs = 2 * K * in_size * key_heads / pool.heads + V * in_size + (4 * K if kda else 4) + 4
    return int(checkpoint + entries_read * per_entry + gate_state + written + inputs + V * out_size)


def fla_bytes(HV: int, H: int, K: int, V: int, state_size: int, in_size: int, out_size: int, kda: bool) -> int:
    """What one (row, value head) of FLA's in-place step must move: the state read and written, the inputs and the
    output."""
    return int(2 * V * K * state_size + 2 * K * in_size * H / HV + V * in_size + (4 * K if kda else 4) + 4
               + V * out_size)


def _inputs(B, H, HV, K, V, gate, device, gen):
    q = torch.randn(B, H, K, generator=gen).to(device, torch.bfloat16)
    k = torch.nn.functional.normalize(torch.randn(B, H, K, generator=gen), dim=-1).to(device, torch.bfloat16)
    v = torch.randn(B, HV, V, generator=gen).to(device, torch.bfloat16)
    g = (-0.05 * torch.rand(*((B, HV, K) if gate == "kda" else (B, HV)), generator=gen)).to(device)
    beta = torch.rand(B, HV, generator=gen).to(device)
    return q, k, v, g, beta


def _fills(pool, slots, fill_of_head):
    """hcnt of ``slots`` set from ``fill_of_head [B, HV]`` (a fill of L: a full ring), entries past it emptied."""
    L = pool.ring
    pool.hcnt[slots] = fill_of_head.to(torch.int32).to(pool.device)
    past = torch.arange(L, device=pool.device) >= fill_of_head.to(pool.device)[..., None]
    pool.w[slots] = torch.where(past, torch.zeros_like(pool.w[slots]), pool.w[slots])
    if pool.gbuf is not None:
        pool.gbuf[slots] = torch.where(past[..., None], torch.ones_like(pool.gbuf[slots]), pool.gbuf[slots])


def _fill_and_name():
    """``fill`` and a function naming the step's backend, from this tree or a --baseline tree older than them."""
    try:
        from leapquant.tools.workloads import fill
    except ImportError:
        from leapquant.workloads import fill
    try:
        leapquant.select(leapquant.Pool(2, 1, 64, 64), "auto", op="step")
        return fill, lambda pool, backend: leapquant.select(pool, backend, op="step").name
    except TypeError:
        return fill, lambda pool, backend: leapquant.ops.select_step(pool, backend).name


def run(device: torch.device, batch: int, heads: int, key_heads: int, gate: str, backend: str, budget_s: float,
        with_fla: bool) -> dict:
    fill, step_backend = _fill_and_name()

    gen = torch.Generator().manual_seed(0)
    B, HV, H = batch, heads, key_heads
    pool = leapquant.Pool(B + 1, HV, gate=gate, device=device)
    K, V, L = pool.head_k, pool.head_v, pool.ring
    slots = torch.arange(1, B + 1)
    fill(pool, slots, "gaussian", gen)
    idx = slots.to(torch.int32).to(device)
    q, k, v, g, beta = _inputs(B, H, HV, K, V, gate, device, gen)
    out = torch.empty(B, HV, V, dtype=torch.bfloat16, device=device)
    bw = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (1 << 24))
    bps = bw["GBps"] * 1e9
    cases = []
    reps = (10, 200) if device.type == "cuda" else (2, 3)

    def timed(name, fn, restore, nbytes, **extra):
        fn()  # compiles, outside the capture
        restore()
        graph = capture(fn, device)
        t = time_replays(graph, restore, device, budget_s=budget_s, min_reps=reps[0], max_reps=reps[1])
        floor_us = nbytes / bps * 1e6
        row = {"case": name, "median_us": t.median * 1e6, "floor_us": floor_us, "x_floor": t.median * 1e6 / floor_us,
               "bytes": nbytes, **extra}
        cases.append(row)
        print(f"{name:<18} {row['median_us']:9.1f} us  floor {floor_us:7.1f} us  x{row['x_floor']:.2f}", flush=True)
        return row

    step = lambda: leapquant.step(pool, idx, q, k, v, g, beta, out=out, backend=backend, check=False)  # noqa: E731
    saved = {n: getattr(pool, n).clone() for n in ("hcnt", "w", "pcum", "gbuf") if getattr(pool, n) is not None}

    def restorer(fills):
        def restore():
            for n, t in saved.items():
                getattr(pool, n).copy_(t)
            _fills(pool, slots, fills)
        return restore

    for f in FILLS:
        fills = torch.full((B, HV), f - 1)
        nbytes = B * HV * step_bytes(pool, f - 1, H, 2, 2)
        timed(f"step fill {f}", step, restorer(fills), nbytes, fill=f)
    # steady state: 1/16 of the rings full, the rest spread evenly over 1 .. L - 1 entries
    order = torch.randperm(B * HV, generator=gen)
    fills = (order % L).reshape(B, HV)  # 0 .. L-1 entries; 0 stands for a full ring (L)
    fills = torch.where(fills == 0, torch.full_like(fills, L), fills)
    due = int((fills == L).sum())
    nbytes = int(sum(step_bytes(pool, int(f) % L, H, 2, 2) for f in fills.flatten()))
    nbytes += due * program_bytes(pool)["total"]  # the flushes inside
    timed("decode layer", step, restorer(fills), nbytes, due=due)
    if with_fla:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

        for dt in (torch.float32, torch.bfloat16):
            state = torch.randn(B + 1, HV, V, K, generator=gen).mul_(0.05).to(device, dt)
            o4 = torch.empty(B, 1, HV, V, dtype=torch.bfloat16, device=device)
            args = [t.unsqueeze(1) for t in (q, k, v, g, beta)]
            fn = lambda st=state, o4=o4: fused_recurrent_kda_fwd(  # noqa: E731
                *args, initial_state=st, inplace_final_state=True, state_v_first=True, ssm_state_indices=idx,
                out=o4)
            nbytes = B * HV * fla_bytes(HV, H, K, V, state.element_size(), 2, 2, gate == "kda")
            timed(f"fla {str(dt).replace('torch.', '').replace('float32', 'fp32').replace('bfloat16', 'bf16')}",
                  fn, lambda: None, nbytes)
    smi = nvidia_smi() if device.type == "cuda" else {}
    per_head_lq = pool.geometry.checkpoint_bytes + sum(
        getattr(pool, n)[1, 0].numel() * getattr(pool, n).element_size()
        for n in ("kbuf", "ubuf", "w", "pcum", "gbuf", "hcnt") if getattr(pool, n) is not None)
    return {
        "what": "decode step timings beside their floors (bench/decode.py)",
        "case": {"batch": B, "heads": HV, "key_heads": H, "head_k": K, "head_v": V, "ring": L, "gate": gate,
                 "backend": step_backend(pool, backend)},
        "device": device_info(device), "driver": smi.get("driver"), "cpu": platform.processor(),
        "versions": {m: module_version(m) for m in ("leapquant", "torch", "triton", "fla")},
        "bandwidth": bw, "cases": cases,
        "memory_per_sequence": {"fp32": HV * V * K * 4, "bf16": HV * V * K * 2, "leapquant": HV * per_head_lq},
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def markdown(doc: dict) -> str:
    c, d, v = doc["case"], doc["device"], doc["versions"]
    lines = [f"# Decode step on {d.get('name')}", "",
             f"{d.get('name')}, driver {doc['driver']}; torch {v['torch']}, Triton {v['triton']}, fla {v['fla']}; "
             f"{doc['date_utc']}. {c['gate'].upper()}, {c['batch']} sequences x {c['heads']} heads ({c['key_heads']} "
             f"key heads), K = {c['head_k']}, V = {c['head_v']}, ring {c['ring']}; backend {c['backend']}. Copy "
             f"bandwidth {doc['bandwidth']['GBps']:.0f} GB/s (same run). Medians of CUDA-graph replays "
             "(bench/decode.py).", "",
             "| case | time | floor | x floor |", "| --- | ---: | ---: | ---: |"]
    for r in doc["cases"]:
        lines.append(f"| {r['case']} | {r['median_us']:.1f} us | {r['floor_us']:.1f} us | {r['x_floor']:.2f} |")
    t = {r["case"]: r["median_us"] for r in doc["cases"]}
    against = [f"{name}: {100 * (t[name] / t[f'{name}@baseline'] - 1):+.1f} %" for name in t
               if f"{name}@baseline" in t]
    if against:
        lines += ["", f"Against the baseline ({doc['baseline']}), same run: " + "; ".join(against) + "."]
    ratios = [f"{layer} / {other} = {t[layer] / t[other]:.2f}" for layer in t if layer == "decode layer"
              for other in ("step fill 8", "fla fp32", "fla bf16") if other in t]
    if ratios:
        lines += ["", "Ratios (issue bounds: step fill 8 <= 1.3x its floor; decode layer <= 1.25x step, <= 0.3x fla "
                  "fp32, <= 0.5x fla bf16): " + "; ".join(ratios) + "."]
    m = doc["memory_per_sequence"]
    lines += ["", "Bytes per sequence: " + ", ".join(f"{k} {val:,}" for k, val in m.items())]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.decode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU with the reference, no FLA")
    ap.add_argument("--batch", type=int, default=None, help="sequences (default 256; --cpu-smoke 3)")
    ap.add_argument("--heads", type=int, default=None, help="value heads (default 32; --cpu-smoke 2)")
    ap.add_argument("--key-heads", type=int, default=None, help="query / key heads (default: --heads)")
    ap.add_argument("--gate", choices=["kda", "gdn"], default="kda", help="the gate (FLA's anchors are KDA's)")
    ap.add_argument("--backend", default="auto", help="leapquant backend of the step (default auto)")
    ap.add_argument("--budget", type=float, default=None, help="seconds of replays per case (default 2)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="output folder")
    ap.add_argument("--baseline", default=None, metavar="DIR",
                    help="also time LeapQuant's cases under the packages in DIR (see above)")
    ap.add_argument("--json-only", default=None, metavar="FILE", help=argparse.SUPPRESS)  # the baseline's run
    args = ap.parse_args(argv)
    cpu = args.cpu_smoke
    if not cpu and not torch.cuda.is_available():
        print("error: no CUDA device here; `python -m bench.decode --cpu-smoke` runs the path on the CPU",
              file=sys.stderr)
        return 2
    device = torch.device("cpu" if cpu else "cuda")
    batch = args.batch or (3 if cpu else 256)
    heads = args.heads or (2 if cpu else 32)
    doc = run(device, batch, heads, args.key_heads or heads, args.gate, "reference" if cpu else args.backend,
              args.budget or (0.05 if cpu else 2.0), with_fla=not cpu and args.gate == "kda" and not args.json_only)
    if args.json_only:
        Path(args.json_only).write_text(json.dumps(doc))
        return 0
    if args.baseline:
        doc["baseline"] = str(Path(args.baseline).resolve())
        rows = _baseline_cases(doc["baseline"], argv if argv is not None else sys.argv[1:])
        doc["cases"] += [dict(r, case=f"{r['case']}@baseline") for r in rows]
    slug = "cpu" if cpu else device_slug(doc["device"]["name"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"decode_{slug}.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / f"decode_{slug}.md").write_text(markdown(doc))
    print(markdown(doc))
    return 0


def _baseline_cases(baseline: str, argv: list[str]) -> list[dict]:
    """LeapQuant's cases timed by this file under ``baseline``'s packages: run from that folder (``python -m`` puts
    it first on the path), with this tree next so that ``bench`` itself still comes from here."""
    here = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([baseline, here] + (
        [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "baseline.json"
        rest, skip = [], False
        for a in argv:  # the same case, without this run's --baseline and --out
            if skip:
                skip = False
            elif a in ("--baseline", "--out"):
                skip = True
            elif not a.startswith(("--baseline=", "--out=")):
                rest.append(a)
        subprocess.run([sys.executable, "-m", "bench.decode", *rest, "--json-only", str(out)], cwd=baseline, env=env,
                       check=True)
        return json.loads(out.read_text())["cases"]


if __name__ == "__main__":
    sys.exit(main())
