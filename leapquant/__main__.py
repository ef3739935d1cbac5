"""Command line: ``python -m leapquant {info,demo,simulate}``."""

from __future__ import annotations

import argparse
import copy
import importlib.metadata as md
import platform
import sys
import time

import torch

import leapquant

from . import parity
from .workloads import fill


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


def device_lines() -> list[str]:
    lines = [f"python {platform.python_version()}, torch {torch.__version__}, triton {_version('triton')}, "
             f"tilelang {_version('tilelang')}, leapquant {leapquant.__version__}"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"cuda:{i} {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
                         f"{p.total_memory / 2**30:.0f} GiB (CUDA {torch.version.cuda})")
    else:
        lines.append("no CUDA device: kernels run on the CPU only through an interpreter (TRITON_INTERPRET=1)")
    return lines


def cmd_info(args) -> int:
    for line in device_lines():
        print(line)
    print()
    print(f"{'backend':<12} {'priority':>8}  status")
    for b in leapquant.backends():
        status = "available" if b.available else "unavailable"
        print(f"{b.name:<12} {b.priority:>8}  {status}: {b.reason}")
        if b.description:
            print(f"{'':<22}{b.description}")
        if b.available:
            for dev, why in leapquant.get_backend(b.name).not_for_auto.items():
                print(f"{'':<22}auto skips it on {dev}: {why}")
    return 0


def _time(fn, device: torch.device, repeat: int) -> float:
    """Median seconds of ``fn`` (events on CUDA, a host clock on the CPU), after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def cmd_demo(args) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    for line in device_lines():
        print(line)
    pool = leapquant.Pool(args.slots + 1, args.heads, gate=args.gate, device=device)
    slots = torch.arange(1, args.slots + 1)
    print(f"\nbuilding {args.slots} sequences x {args.heads} heads of {args.gate.upper()} state by decoding "
          f"{3 * pool.ring} tokens each (pool.append; rings flushed by the reference)...", flush=True)
    fill(pool, slots, "realistic", torch.Generator().manual_seed(args.seed))
    idx = slots.to(torch.int32).to(device)
    best = leapquant.select(pool, args.backend)
    names = [best.name] + (["reference"] if best.name != "reference" else [])
    print(f"backend: {best.name} ({'chosen by auto' if args.backend == 'auto' else 'asked for'}); "
          f"{int(pool.due(idx).sum())} programs due\n")
    print(f"{'backend':<10} {'programs':>8} {'rel. error':>11} {'vs ref mean':>12} {'vs ref worst':>13} "
          f"{'codes differing':>16} {'time':>10}")
    for name in names:
        work = copy.deepcopy(pool)
        p = parity.measure(work, idx, name)
        s = p.summary()

        def again():
            work.hcnt.copy_(pool.hcnt)
            leapquant.flush(work, idx, backend=name, check=False)

        t = _time(again, device, args.repeat)
        print(f"{name:<10} {s['programs']:>8} {s['err_ref_mean'] * s['ratio_mean']:>11.5f} {s['ratio_mean']:>12.5f} "
              f"{s['ratio_worst']:>13.5f} {100 * s['code_diff_frac']:>14.3f} % {t * 1e3:>7.2f} ms")
        if not p.backend_ok():
            print(f"  FAILS SPEC §4: {p.failures()}")
            return 1
    print("\nrel. error: ||checkpoint - exact state|| / ||exact state|| after the flush (exact = float64 rebuild);"
          "\nvs ref: that error over the fp32 reference's (SPEC §4 bound: 1.02 per program).")
    if device.type == "cpu" and best.name == "reference":
        print("No GPU here: the reference ran. `TRITON_INTERPRET=1 python -m leapquant demo --backend triton` runs "
              "the Triton kernel in its interpreter on the CPU (correct, but about 15x slower than the reference).")
    return 0


def cmd_simulate(args) -> int:
    from .simulate import main as simulate_main

    return simulate_main(args)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m leapquant", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="backends, devices and versions; why a backend is unavailable")
    d = sub.add_parser("demo", help="flush a pool of realistic KDA states with the best backend here")
    d.add_argument("--slots", type=int, default=8, help="sequences in the pool, all flushed at once (default 8)")
    d.add_argument("--heads", type=int, default=32, help="value heads per sequence (default 32)")
    d.add_argument("--gate", choices=["kda", "gdn"], default="kda",
                   help="kda: per-channel decay (Kimi Delta Attention); gdn: scalar decay (Gated DeltaNet)")
    d.add_argument("--backend", default="auto",
                   help="auto (the fastest that supports the pool here), reference, triton or tilelang; on a CPU, "
                        "triton needs TRITON_INTERPRET=1 in the environment")
    d.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if there is a GPU, else cpu)")
    d.add_argument("--repeat", type=int, default=5, help="timed flushes per backend; the median is printed")
    d.add_argument("--seed", type=int, default=0, help="seed of the generated token streams")
    try:
        from .simulate import add_arguments
    except ImportError:
        add_arguments = None
    if add_arguments is not None:
        add_arguments(sub.add_parser("simulate", help="decode simulation: drift of LeapQuant state vs exact"))
    args = ap.parse_args(argv)
    try:
        return {"info": cmd_info, "demo": cmd_demo, "simulate": cmd_simulate}[args.cmd](args)
    except leapquant.BackendError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
