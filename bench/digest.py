"""Whether two versions of the GPU backends write the same bytes.

    python -m bench.digest                     # one SHA-256 per (case, backend, operation) of the bytes it wrote
    python -m bench.digest --baseline DIR      # the same cases under DIR's packages too, compared case by case

Each case is a seeded pool (both gates, the default and smaller shapes, ring 8 to 32, ITERS 1 and 2, both slot
conventions, the grid and the list schedules of the Triton backend) with a seeded due pattern. On a fresh copy of it
each operation the backend implements runs once in place with ``check=False``: a flush, a decode step of seeded bf16
tokens (its output digested too), and ``states`` then ``load_states`` of the case's slots (the rebuilt states too). ``--baseline DIR`` takes another version's ``leapquant``, ``leapquant_triton`` and
``leapquant_tilelang`` packages, as ``python -m bench --baseline`` does, runs the same cases under them in a
subprocess, and exits 1 if any case's bytes differ: a refactoring that claims "behaviour unchanged" shows it here.
``--backends triton`` (or ``tilelang``) digests one backend only: after a change to one kernel, the other's compiles
are skipped in both trees; ``--backends reference`` runs on a CPU too. When no backend asked for can flush the pools
here (the default GPU backends on a CPU) it digests nothing, says so and exits 2.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import subprocess
import sys
from pathlib import Path

import torch

# (gate, heads, K, V, ring, rank, iters, convention, rows, due fraction); 96 rows x 32 heads takes Triton's list
# schedule, the others its grid schedule
CASES = (
    ("kda", 32, 128, 128, 16, 4, 1, "vllm", 8, 1.0),
    ("gdn", 32, 128, 128, 16, 4, 1, "vllm", 8, 1.0),
    ("kda", 32, 128, 128, 16, 4, 1, "vllm", 96, 0.25),
    ("gdn", 32, 128, 128, 16, 4, 1, "sglang", 96, 0.25),
    ("kda", 32, 128, 128, 16, 2, 2, "sglang", 8, 0.5),
    ("kda", 4, 64, 64, 8, 2, 1, "vllm", 8, 1.0),
    ("gdn", 4, 64, 128, 32, 3, 2, "vllm", 8, 1.0),
    ("kda", 4, 128, 64, 32, 1, 1, "sglang", 8, 0.5),
)


def _case_pool(case: tuple, device: torch.device):
    import leapquant
    try:
        from leapquant.tools.workloads import fill
    except ImportError:  # a --baseline tree from before leapquant.tools
        from leapquant.workloads import fill

    gate, heads, K, V, ring, rank, iters, convention, rows, frac = case
    gen = torch.Generator().manual_seed(1234)
    first = 1 if convention == "vllm" else 0
    # the engine layout, named where the tree knows layouts (the only one of a tree before them, the default until
    # the compact one became it): raw is hashed whole, so both sides of a comparison need the same layout
    layout = {"layout": "engine"} if "layout" in inspect.signature(leapquant.Pool).parameters else {}
    pool = leapquant.Pool(first + rows + 2, heads, K, V, ring, rank, gate=gate, convention=convention,
                          device=device, iters=iters, **layout)
    slots = torch.randperm(rows + 2, generator=gen)[:rows] + first
    fill(pool, slots, "gaussian", gen, due=torch.rand(rows, heads, generator=gen) < frac)
    return pool, slots.to(torch.int32).to(device)


BACKENDS = ("triton", "tilelang", "reference")
GPU_BACKENDS = BACKENDS[:2]


OPS = ("flush", "step", "states")


def _implements(b, op: str) -> bool:
    # a --baseline tree from before Backend.implements said it with has_step / has_states
    if hasattr(b, "implements"):
        return b.implements(op)
    return op == "flush" or getattr(b, f"has_{op}")


def _hash(*tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        if t is not None:
            h.update(t.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def _run(op: str, pool, idx, backend: str, case_seed: int):
    """``op`` on the case's pool with ``check=False``; the tensors it wrote besides the pool (the step's output, the
    rebuilt states)."""
    import leapquant

    if op == "flush":
        leapquant.flush(pool, idx, backend=backend, check=False)
        return ()
    if op == "step":
        gen = torch.Generator().manual_seed(case_seed)
        B, HV, K, V = idx.numel(), pool.heads, pool.head_k, pool.head_v
        q = torch.randn(B, HV, K, generator=gen).to(pool.device, torch.bfloat16)
        k = torch.nn.functional.normalize(torch.randn(B, HV, K, generator=gen), dim=-1).to(pool.device, torch.bfloat16)
        v = torch.randn(B, HV, V, generator=gen).to(pool.device, torch.bfloat16)
        g = -0.05 * torch.rand(*((B, HV, K) if pool.gate == "kda" else (B, HV)), generator=gen)
        beta = torch.rand(B, HV, generator=gen)
        o = leapquant.step(pool, idx, q, k, v, g.to(pool.device), beta.to(pool.device), backend=backend, check=False)
        return (o,)
    # states: the rebuilt states of the case's slots, then those states compressed back into them
    S = pool.states(idx, backend=backend, check=False)
    pool.load_states(idx, S, backend=backend, check=False)
    return (S,)


def digests(device: torch.device, backends: tuple = GPU_BACKENDS) -> list[dict]:
    """One record per (case, backend of ``backends``, operation of :data:`OPS`), each on a fresh seeded pool: the
    SHA-256 of every pool tensor after the operation and of what else it wrote, or why it was skipped."""
    import leapquant

    out = []
    for n, case in enumerate(CASES):
        for backend in backends:
            for op in OPS:
                pool, idx = _case_pool(case, device)
                b = leapquant.get_backend(backend)
                ok, why = b.available()
                if ok:
                    ok, why = b.supports(pool)
                if ok and not _implements(b, op):
                    ok, why = False, f"no {op}"
                rec = {"case": list(case), "backend": backend, "op": op}
                if not ok:
                    out.append(dict(rec, skipped=why))
                    continue
                due = int(pool.due(idx).sum())
                extra = _run(op, pool, idx, backend, 99 + n)
                tensors = [getattr(pool, name) for name in ("raw", "kbuf", "ubuf", "w", "pcum", "gbuf", "hcnt")]
                out.append(dict(rec, sha256=_hash(*tensors, *extra), due=due))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.digest", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the pools live (default: cuda if there is a GPU)")
    ap.add_argument("--baseline", default=None, metavar="DIR",
                    help="another version's packages (see python -m bench --help); compare its bytes with these")
    ap.add_argument("--backends", default=",".join(GPU_BACKENDS),
                    help="comma-separated backends to digest (default: %(default)s)")
    ap.add_argument("--json", action="store_true", help="print the records as JSON lines only")
    args = ap.parse_args(argv)
    backends = tuple(b.strip() for b in args.backends.split(",") if b.strip())
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown or not backends:
        ap.error(f"--backends: {', '.join(unknown) or 'none given'}; choose from {', '.join(BACKENDS)}")
    import leapquant

    mine = digests(torch.device(args.device), backends)
    if args.json:
        for r in mine:
            print(json.dumps(r))
        return 0
    if not any("sha256" in r for r in mine):
        # every case skipped: nothing was digested, so nothing could differ; saying "same" would pass a change unseen
        why = sorted({f"{r['backend']}: {r['skipped']}" for r in mine})
        print(f"bench.digest digested nothing on {args.device}: it needs a GPU backend ({', '.join(backends)} cannot "
              f"flush its pools here; `--backends reference` runs on a CPU).\n  " + "\n  ".join(why), file=sys.stderr)
        return 2
    print(f"leapquant from {Path(leapquant.__file__).resolve().parent}")
    if not args.baseline:
        for r in mine:
            print(r["backend"], r["op"], r["case"], r.get("sha256") or f"skipped: {r['skipped']}")
        return 0
    # this file's cases under DIR's packages: `-c` puts DIR (the working directory) first on the path, ahead of
    # PYTHONPATH and site-packages, and run_path adds no folder of its own, so bench/'s modules cannot shadow anything
    cwd = str(Path(args.baseline).resolve())
    code = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    res = subprocess.run([sys.executable, "-c", code, str(Path(__file__).resolve()), "--json", "--device",
                          args.device, "--backends", ",".join(backends)], cwd=cwd, capture_output=True, text=True)
    if res.returncode != 0:
        print(res.stderr[-3000:], file=sys.stderr)
        return 2
    # (TileLang logs its compiles on stdout: the records are the lines that are JSON objects)
    records = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    theirs = {(json.dumps(r["case"]), r["backend"], r["op"]): r for r in records}
    same = differ = 0
    for r in mine:
        t = theirs.get((json.dumps(r["case"]), r["backend"], r["op"]), {})
        what = f"{r['backend']:<9} {r['op']:<6} {r['case']}"
        if "sha256" not in r or "sha256" not in t:
            print(f"{what}  not compared: {r.get('skipped') or t.get('skipped') or 'missing'}")
            continue
        eq = r["sha256"] == t["sha256"]
        same, differ = same + eq, differ + (not eq)
        print(f"{what}  {'same bytes' if eq else 'DIFFERENT BYTES'}")
    print(f"{same} cases with the same bytes, {differ} different (baseline: {cwd})")
    if not same and not differ:
        print("nothing compared: no case ran under both trees", file=sys.stderr)
        return 2
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
