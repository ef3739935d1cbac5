"""Command line: ``python -m leapquant {info,demo,simulate}``.

``info`` lists the backends, the devices and the bytes per sequence; ``demo`` and ``simulate`` are the tools of
:mod:`leapquant.tools` (``python -m leapquant.tools.demo``, ``python -m leapquant.tools.simulate``). Every command
takes ``--help``.
"""

from __future__ import annotations

import argparse
import sys

import leapquant
from leapquant.tools import demo, simulate
from leapquant.tools.machine import device_lines


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
    print()
    from .memory import table

    for line in table(args.gib, heads=args.heads, head_k=args.head_k, head_v=args.head_v, ring=args.ring,
                      rank=args.rank, gate=args.gate):
        print(line)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m leapquant", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("info", help="backends, devices and versions; why a backend is unavailable; bytes per sequence")
    i.add_argument("--gib", type=float, default=80.0, help="memory budget for the sequences-that-fit column (default 80)")
    i.add_argument("--heads", type=int, default=32, help="heads per sequence (per layer, per GPU; default 32)")
    i.add_argument("--head-k", type=int, default=128, help="key head dim K (default 128)")
    i.add_argument("--head-v", type=int, default=128, help="value head dim V (default 128)")
    i.add_argument("--ring", type=int, default=16, help="ring entries L (default 16)")
    i.add_argument("--rank", type=int, default=4, help="Compensator Tokens R (default 4)")
    i.add_argument("--gate", choices=["kda", "gdn"], default="kda", help="kda (gbuf, pcum[K]) or gdn (pcum[1])")
    demo.add_arguments(sub.add_parser("demo", description=demo.__doc__,
                                      formatter_class=argparse.RawDescriptionHelpFormatter,
                                      help="decode a batch token by token with leapquant.step, against the exact "
                                           "recurrence"))
    simulate.add_arguments(sub.add_parser("simulate", description=simulate.__doc__,
                                          formatter_class=argparse.RawDescriptionHelpFormatter,
                                          help="decode simulation: drift of LeapQuant state vs exact"))
    args = ap.parse_args(argv)
    try:
        return {"info": cmd_info, "demo": demo.run, "simulate": simulate.main}[args.cmd](args)
    except leapquant.BackendError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
