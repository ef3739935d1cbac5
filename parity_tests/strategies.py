"""Hypothesis strategies: draw a pool's structure (shape, gate, convention, regime, due pattern, idx, seed) and build
its tensors from a ``torch.Generator`` seeded by the drawn seed."""

from __future__ import annotations

import copy
import io
import pickle
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

import leapquant
from leapquant.tools.workloads import REGIMES, fill, regimes_within


@dataclass
class Case:
    pool: leapquant.Pool
    idx: torch.Tensor
    regime: str
    seed: int

    def __repr__(self) -> str:
        return f"Case({self.pool!r}, idx={self.idx.tolist()}, regime={self.regime!r}, seed={self.seed})"


def build_case(
    *, heads, head_k, head_v, ring, rank, gate, convention, regime, rows, due_frac, padding, seed, device,
    num_slots=None, iters=1,
) -> Case:
    """A pool whose ``rows`` sequences sit in random slots; ``due_frac`` of their heads due; ``padding`` extra idx
    entries that name no real slot (the convention's pad value, or out-of-range values)."""
    gen = torch.Generator().manual_seed(seed)
    first = 1 if convention == "vllm" else 0
    NS = num_slots or first + rows + 2
    pool = leapquant.Pool(NS, heads, head_k, head_v, ring, rank, gate=gate, convention=convention, device=device,
                          iters=iters)
    slots = (torch.randperm(NS - first, generator=gen)[:rows] + first).to(torch.long)
    due = torch.rand(rows, heads, generator=gen) < due_frac
    fill(pool, slots, regime, gen, due=due)
    pad_value = 0 if convention == "vllm" else -1
    pads = [pad_value if i % 2 == 0 else NS + i for i in range(padding)]
    idx = torch.cat([slots.to(torch.int32), torch.tensor(pads, dtype=torch.int32)])
    idx = idx[torch.randperm(idx.numel(), generator=gen)]
    return Case(pool, idx.to(device), regime, seed)


def _allowed(options, allowed):
    return [o for o in options if allowed is None or o in allowed] or list(allowed)


def shapes(backend: str = "reference", small: bool = True):
    """Geometry kwargs within what ``backend`` supports. ``small`` keeps interpreter runs short: few heads, and the
    default head size most often."""
    req = leapquant.get_backend(backend).requirements
    heads = [1, 2, 3] if small else [1, 4, 8, 16, 32]
    dims = [(128, 128), (128, 128), (64, 64)] if small else [(128, 128), (64, 64), (128, 64), (64, 128)]
    return st.fixed_dictionaries({
        "heads": st.sampled_from(_allowed(heads, req.heads)),
        "hk_hv": st.sampled_from(_allowed(dims, req.head_dims)),
        "ring": st.sampled_from(_allowed([8, 16, 32], req.rings)),
        "rank": st.sampled_from(_allowed([1, 2, 3, 4], req.ranks)),
        "gate": st.sampled_from(_allowed(["kda", "gdn"], req.gates)),
        "convention": st.sampled_from(_allowed(["vllm", "sglang"], req.conventions)),
    })


def default_geometry(backend: str, heads: int = 2) -> dict:
    """The default geometry (128 x 128, ring 16, rank 4) with ``heads`` heads, or the backend's own head count."""
    req = leapquant.get_backend(backend).requirements
    return {"heads": heads if req.heads is None or heads in req.heads else req.heads[0]}


@st.composite
def cases(draw, device="cpu", small=True, regimes=None, geometry=None, backend="reference"):
    if regimes is None:
        regimes = regimes_within(leapquant.get_backend(backend).requirements.magnitude)
    g = dict(geometry) if geometry is not None else draw(shapes(backend, small))
    head_k, head_v = g.pop("hk_hv") if "hk_hv" in g else (g.pop("head_k"), g.pop("head_v"))
    return build_case(
        **g, head_k=head_k, head_v=head_v,
        regime=draw(st.sampled_from(regimes)),
        rows=draw(st.integers(1, 3)),
        due_frac=draw(st.sampled_from([1.0, 0.5, 0.0625])),
        padding=draw(st.integers(0, 2)),
        seed=draw(st.integers(0, 2**31 - 1)),
        device=device,
        # one pool size for every draw: TileLang specialises its kernel on it (~10 s per compile on the GPU machine)
        num_slots=8,
    )


def random_bits(t: torch.Tensor, gen: torch.Generator) -> None:
    """Fill a tensor with random bit patterns (NaNs and infinities included) through an integer view."""
    iv = t.view(torch.uint8)
    iv.copy_(torch.randint(0, 256, iv.shape, generator=gen, dtype=torch.uint8).to(iv.device))


def reloaded(obj, how: str):
    """``obj`` after a round trip: ``"pickle"``, ``"deepcopy"``, ``"torch.save"`` or ``"torch.save weights_only"``
    (``torch.load`` with that flag)."""
    if how == "pickle":
        return pickle.loads(pickle.dumps(obj))
    if how == "deepcopy":
        return copy.deepcopy(obj)
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=how.endswith("weights_only"))
