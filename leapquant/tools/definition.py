"""The op described in the FlashInfer-Trace definition schema, one definition per gate.

    python -m leapquant.tools.definition --check     # are the committed files current? (exit 1 if not)
    python -m leapquant.tools.definition --write     # rewrite them from leapquant.reference

``build(gate)`` generates the definition from :mod:`leapquant.reference`: the ``reference`` field is the source of
the reference's own functions plus a ``run`` with the op's input order, so it runs standalone with torch alone. The
committed files are under ``leapquant/tools/definition/``; a test checks that they are current and that their ``run``
gives the reference's outputs bit for bit.
"""

from __future__ import annotations

import inspect
import json
import sys
import textwrap
from pathlib import Path

from leapquant import constants, formulas

from .cli import parser

DIR = Path(__file__).parent / "definition"
FUNCTIONS = (formulas.dequantise, formulas.low_rank, formulas.decays, formulas.ring_state,
             formulas.checkpoint_scale, formulas.rebuild, formulas.cholqr, formulas.pow2_normaliser,
             formulas.subspace, formulas.compress)

_RUN = {
    "kda": '''
def run(codes, s_k, s_v, u, q, kbuf, ubuf, gbuf, w, pcum, q0):
    """Every program due; returns the new checkpoint (codes, s_k, s_v, u, q) as fresh tensors."""
    S = rebuild(codes, s_k, s_v, u, q, kbuf, ubuf, w, pcum, gbuf, gate="kda")
    c, sk, sv, uu, qq = compress(S, q0, ITERS)
    return c, sk.float(), sv.float(), uu, qq
''',
    "gdn": '''
def run(codes, s_k, s_v, u, q, kbuf, ubuf, w, pcum, q0):
    """Every program due; returns the new checkpoint (codes, s_k, s_v, u, q) as fresh tensors."""
    S = rebuild(codes, s_k, s_v, u, q, kbuf, ubuf, w, pcum, None, gate="gdn")
    c, sk, sv, uu, qq = compress(S, q0, ITERS)
    return c, sk.float(), sv.float(), uu, qq
''',
}


def reference_source(gate: str) -> str:
    consts = "\n".join(f"{n} = {getattr(constants, n)!r}" for n in ("QMAX", "EPS", "FLOOR", "TINY", "PNMIN",
                                                                       "FP16_MAX"))
    body = "\n\n\n".join(textwrap.dedent(inspect.getsource(f)) for f in FUNCTIONS)
    return f"import torch\n\n{consts}\nITERS = 1\n\n\n{body}\n\n{_RUN[gate]}"


def build(gate: str, heads: int = 32, head_k: int = 128, head_v: int = 128, ring: int = 16, rank: int = 4) -> dict:
    kda = gate == "kda"
    axes = {
        "batch_size": {"type": "var", "description": "rows of the batch, every (row, head) due"},
        "num_v_heads": {"type": "const", "value": heads},
        "head_k": {"type": "const", "value": head_k},
        "head_v": {"type": "const", "value": head_v},
        "ring": {"type": "const", "value": ring, "description": "L, ring-buffer entries between flushes"},
        "rank": {"type": "const", "value": rank, "description": "R, Compensator Tokens per head"},
    }
    if not kda:
        axes["one"] = {"type": "const", "value": 1}
    B, H = "batch_size", "num_v_heads"
    inputs = {
        "codes": {"shape": [B, H, "head_v", "head_k"], "dtype": "int8", "description": "checkpoint codes"},
        "s_k": {"shape": [B, H, "head_k"], "dtype": "float32", "description": "column scales"},
        "s_v": {"shape": [B, H, "head_v"], "dtype": "float32", "description": "row scales"},
        "u": {"shape": [B, H, "rank", "head_k"], "dtype": "float16", "description": "Compensator Tokens, key side"},
        "q": {"shape": [B, H, "rank", "head_v"], "dtype": "float16", "description": "Compensator Tokens, value side"},
        "kbuf": {"shape": [B, H, "ring", "head_k"], "dtype": "bfloat16", "description": "ring keys"},
        "ubuf": {"shape": [B, H, "ring", "head_v"], "dtype": "bfloat16", "description": "ring update vectors"},
    }
    if kda:
        inputs["gbuf"] = {"shape": [B, H, "ring", "head_k"], "dtype": "float16",
                          "description": "per-entry per-key-channel decay factors exp(g)"}
    inputs["w"] = {"shape": [B, H, "ring"], "dtype": "float32", "description": "per-entry weights (beta)"}
    inputs["pcum"] = {"shape": [B, H, "head_k" if kda else "one"], "dtype": "float32",
                      "description": "cumulative log-gate" if kda else "cumulative gate product"}
    inputs["q0"] = {"shape": ["head_v", "rank"], "dtype": "float32",
                    "description": "start matrix of the subspace iteration (leapquant.start_matrix)"}
    outputs = {name: dict(inputs[name]) for name in ("codes", "s_k", "s_v", "u", "q")}
    return {
        "name": f"leapquant_{gate}_flush_h{heads}_k{head_k}_v{head_v}_l{ring}_r{rank}",
        "op_type": "leapquant_flush",
        "description": (
            f"LeapQuant flush for {'Kimi Delta Attention (per-key-channel gate)' if kda else 'Gated DeltaNet'} "
            "recurrent state: rebuild S from an int8 + rank-R checkpoint and a ring buffer of updates, find a new "
            "rank-R correction by one round of subspace iteration with CholeskyQR2, re-quantise the residual to "
            "int8 with column and row scales."
        ),
        "tags": ["status:verified", f"gate:{gate}", "stage:decode"],
        "axes": axes,
        "inputs": inputs,
        "outputs": outputs,
        "reference": reference_source(gate),
    }


def path(gate: str) -> Path:
    return DIR / f"{build(gate)['name']}.json"


def write() -> list[Path]:
    DIR.mkdir(exist_ok=True)
    out = []
    for gate in ("kda", "gdn"):
        p = path(gate)
        p.write_text(json.dumps(build(gate), indent=2) + "\n")
        out.append(p)
    return out


def stale() -> list[Path]:
    """The committed files that differ from what :func:`build` makes now (or are missing)."""
    return [path(g) for g in ("kda", "gdn") if not path(g).exists() or json.loads(path(g).read_text()) != build(g)]


def main(argv=None) -> int:
    ap = parser("python -m leapquant.tools.definition", __doc__)
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--write", action="store_true", help="rewrite the committed definition files")
    what.add_argument("--check", action="store_true", help="list the files that are not current; exit 1 if any")
    args = ap.parse_args(argv)
    if args.write:
        for p in write():
            print(p)
        return 0
    old = stale()
    for p in old:
        print(f"not current: {p} (python -m leapquant.tools.definition --write)")
    return 1 if old else 0


if __name__ == "__main__":
    sys.exit(main())
