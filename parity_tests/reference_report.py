"""SPEC §4's first criterion measured: the fp32 reference against the float64 model, per value regime and gate.

    python -m parity_tests.reference_report [--rows 4] [--heads 16] [--out parity_tests/reference_report.md]

Runs on the CPU (or ``--device cuda``). Per due program ``err_ref32 / err_ref64`` must stay <= 1.005 (+1e-6
absolute); the table gives mean and worst per regime, and how the fp32 reference's codes differ from the float64
model's.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import torch

from leapquant import parity
from leapquant.tools.workloads import REGIMES

from .strategies import build_case


def measure(rows: int, heads: int, device: str, seed: int = 0):
    out = []
    for gate in ("kda", "gdn"):
        for i, regime in enumerate(REGIMES):
            for rank, ring, (hk, hv) in ((4, 16, (128, 128)), (2, 8, (64, 64))):
                case = build_case(heads=heads, head_k=hk, head_v=hv, ring=ring, rank=rank, gate=gate,
                                  convention="vllm", regime=regime, rows=rows, due_frac=1.0, padding=0,
                                  seed=seed + 31 * i + rank, device=device)
                p = parity.measure(case.pool, case.idx, "reference")
                out.append({"gate": gate, "regime": regime, "shape": f"{hk}x{hv} L{ring} R{rank}",
                            "programs": p.count, "mean": float(p.ratio_ref.mean()),
                            "worst": float(p.ratio_ref.max()), "err_ref_mean": float(p.err_ref.mean()),
                            "ok": p.reference_ok()})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4, help="rows (sequences) per regime and gate (default 4)")
    ap.add_argument("--heads", type=int, default=16, help="heads per row (default 16)")
    ap.add_argument("--device", default="cpu", help="where the reference runs (default cpu)")
    ap.add_argument("--out", default="parity_tests/reference_report.md", help="the markdown report to write")
    args = ap.parse_args(argv)
    t0 = time.time()
    rows = measure(args.rows, args.heads, args.device)
    lines = ["# The fp32 reference against the float64 model (SPEC §4)", "",
             f"Command: `python -m parity_tests.reference_report --rows {args.rows} --heads {args.heads} "
             f"--device {args.device}`; torch {torch.__version__}, Python {platform.python_version()}, "
             f"{platform.machine()}, {time.strftime('%Y-%m-%d')}.", "",
             "Ratio = err_ref32 / err_ref64 per due program (bound: 1.005, plus 1e-6 absolute).", "",
             "| gate | regime | shape | programs | err_ref mean | ratio mean | ratio worst | within bound |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        lines.append(f"| {r['gate']} | {r['regime']} | {r['shape']} | {r['programs']} | {r['err_ref_mean']:.3e} | "
                     f"{r['mean']:.6f} | {r['worst']:.6f} | {'yes' if r['ok'] else 'NO'} |")
    ok = all(r["ok"] for r in rows)
    lines += ["", f"All within bound: {'yes' if ok else 'NO'} ({time.time() - t0:.0f} s)"]
    text = "\n".join(lines) + "\n"
    with open(args.out, "w") as f:
        f.write(text)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
