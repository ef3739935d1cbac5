"""``TRITON_INTERPRET=1 python -m bench.cross_release.keys KEYS.jsonl``: the build keys of every launch the sweep and
the cases make, written as JSON lines (the cases' with their integer arguments), on the CPU, nothing run."""

from __future__ import annotations

import os
import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("run it with TRITON_INTERPRET=1 (the CPU's launches are the tl twin's, keyed the same)", file=sys.stderr)
        return 2
    from . import cases, routing, sweep

    state = routing.install()
    out = argv[0]
    open(out, "w").close()
    state.capture, state.dry = out, True
    sweep.capture()
    state.ints = True
    cases.capture()
    state.capture, state.dry, state.ints = None, False, False
    keys = {line for line in open(out)}
    with open(out, "w") as f:
        f.writelines(sorted(keys))
    print(f"{len(keys)} keys in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
