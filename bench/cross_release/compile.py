"""``python -m bench.cross_release.compile KEYS.jsonl LIB``: under the installed Triton, the Gluon step for sm_90 for
every key (:mod:`.keys`) into ``LIB/<release>/<key hash>.cubin`` and ``.json`` (what the routing needs: name,
parameters, shared memory, warps; and the build's registers and spills). A key with integer arguments takes Triton's
runtime specialisation of them (1: a constant; a multiple of 16: divisible); without, every integer argument is a
plain i32, which holds for any value. Pointers are 16-byte aligned where the key says so."""

from __future__ import annotations

import json
import os
import re
import sys


def build(key: dict):
    """The compiled kernel of ``key`` (``triton.compile`` for sm_90, as the backend's launch builds it)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from leapquant.geometry import Geometry
    from leapquant_triton import step as st
    from leapquant_triton.targets import mma_sync_only

    g = Geometry(num_slots=8, heads=4, head_k=key["K"], head_v=key["V"], ring=key["L"], rank=key["R"],
                 gate="kda" if key["IS_KDA"] else "gdn")
    kernel, consts, options = st.step_build(g, key["FIRST"], key["USE_QK_L2NORM"], 90, "gluon")
    consts.update({n: key[n] for n in ("HIST", "HT", "T", "TOFF", "PACKED", "BETA_ROUND")})
    sig, attrs, ints = {}, {}, key.get("ints", {})
    for i, a in enumerate(kernel.arg_names):
        p = key["ptrs"].get(a, "absent")
        if a in consts:
            sig[a] = "constexpr"
        elif p is None:  # passed as None: a constexpr None
            sig[a], consts[a] = "constexpr", None
        elif p != "absent":
            sig[a] = "*" + p[0]
            if p[1]:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif a in ("scale", "lower_bound"):
            sig[a] = "fp32"
        elif ints.get(a) == 1:
            sig[a], consts[a] = "constexpr", 1
        else:
            sig[a] = "i32"
            if a in ints and ints[a] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = GluonASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    with mma_sync_only():
        return kernel, sig, triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    import triton

    from leapquant_triton.portability import _ptxas_usage
    from leapquant_triton.step import gluon_kernel

    from .routing import key_hash

    if gluon_kernel() is None:
        print(f"Triton {triton.__version__} is not a release of the Gluon step (GLUON_RELEASES)", file=sys.stderr)
        return 1
    keys = {key_hash(k): k for k in (json.loads(line) for line in open(argv[0]))}
    release = ".".join(triton.__version__.split(".")[:2])
    out = os.path.join(argv[1], release)
    os.makedirs(out, exist_ok=True)
    for h, key in sorted(keys.items()):
        if os.path.exists(f"{out}/{h}.cubin"):
            continue
        kernel, sig, ck = build(key)
        ptx = ck.asm["ptx"]
        entry = re.search(r"\.entry\s+\w+\s*\((.*?)\)", ptx, re.S).group(1)
        regs, spills, _ = _ptxas_usage(ptx, 90)
        meta = ck.metadata._asdict()
        with open(f"{out}/{h}.cubin", "wb") as f:
            f.write(ck.asm["cubin"])
        json.dump(dict(release=triton.__version__, key=key, name=meta["name"], shared=meta["shared"],
                       num_warps=meta["num_warps"], arg_names=list(kernel.arg_names), sig=sig,
                       nparams=len(re.findall(r"\.param\s", entry)), regs=regs, spills=spills),
                  open(f"{out}/{h}.json", "w"))
        print(f"{release} {h} T {key['T']} regs {regs} spills {spills}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
