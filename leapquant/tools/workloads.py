"""Pools filled with the value regimes the flush must handle, for tests, the demo, the GPU suite and benchmarks.

Every filler draws from a ``torch.Generator`` seeded by the caller (on the CPU, then moved), so a failing case is
reproduced by its seed on any device.
"""

from __future__ import annotations

import math

import torch

from leapquant import Pool

from .streams import decode_stream

REGIMES = ("gaussian", "lowrank", "large_columns", "realistic", "zero", "tiny", "huge", "decayed")
"""Value regimes of the rebuilt state: Gaussian; low rank plus noise; a few large columns; states produced by
``Pool.append`` over a token stream (KDA-like); all zero; tiny (max|S| near 2^-40) and huge (near 2^40) scales;
fully decayed gates (checkpoint multiplied by 0, the ring entries' decays 0)."""


# max|S| a regime produces, roughly, as (low, high): the tiny and huge ones sit at the SPEC's domain ends, the others
# between 2^0 and 2^8 (zero counts with them)
_MAGNITUDE = {"tiny": (2.0**-40, 2.0**-40), "huge": (2.0**40, 2.0**40)}
_ORDINARY = (1.0, 256.0)


def regimes_within(magnitude: tuple[float, float]) -> tuple[str, ...]:
    """The regimes whose state magnitude lies inside ``magnitude = (lo, hi)``, a backend's claimed domain."""
    lo, hi = magnitude
    return tuple(r for r in REGIMES if lo <= _MAGNITUDE.get(r, _ORDINARY)[0] and _MAGNITUDE.get(r, _ORDINARY)[1] <= hi)


def _randn(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float32)


def _rand(gen, *shape):
    return torch.rand(*shape, generator=gen, dtype=torch.float32)


def target_states(regime: str, n: int, heads: int, V: int, K: int, gen: torch.Generator) -> torch.Tensor:
    """States ``[n, heads, V, K]`` of a regime (before the ring buffer is added)."""
    shape = (n, heads, V, K)
    if regime in ("gaussian", "decayed"):
        return _randn(gen, *shape)
    if regime == "lowrank":
        sig = torch.tensor([12.0, 6.0, 4.0, 2.5, 1.5, 1.0])
        a = _randn(gen, n, heads, V, 6) / math.sqrt(V)
        b = _randn(gen, n, heads, K, 6) / math.sqrt(K)
        return 8.0 * torch.einsum("...vr,r,...kr->...vk", a, sig, b) + 0.02 * _randn(gen, *shape)
    if regime == "large_columns":
        S = _randn(gen, *shape)
        big = torch.randperm(K, generator=gen)[:3]
        S[..., big] *= 40.0
        return S
    if regime == "zero":
        return torch.zeros(shape)
    if regime == "tiny":
        return _randn(gen, *shape) * 2.0**-42
    if regime == "huge":
        return _randn(gen, *shape) * 2.0**37
    raise ValueError(f"unknown regime {regime!r}; known: {REGIMES}")


def _ring_scale(regime: str) -> float:
    return {"zero": 0.0, "tiny": 2.0**-42, "huge": 2.0**37}.get(regime, 1.0)


def fill(pool: Pool, slots, regime: str, gen: torch.Generator, due: torch.Tensor | None = None) -> None:
    """Give ``slots`` a checkpoint and a full ring of ``regime``; ``hcnt = L`` where ``due [len(slots), HV]`` is
    true (default: every head), else a count below L."""
    slots = torch.as_tensor(slots, dtype=torch.long).reshape(-1)
    n, HV, K, V, L = slots.numel(), pool.heads, pool.head_k, pool.head_v, pool.ring
    dev = pool.device
    if n == 0:
        return
    if regime == "realistic":
        _fill_by_stream(pool, slots, gen)
    else:
        # the reference on every device, whatever backend is under test: the bytes follow from the seed
        pool.load_states(slots, target_states(regime, n, HV, V, K, gen).to(dev), backend="reference")
        scale = _ring_scale(regime)
        k = torch.nn.functional.normalize(_randn(gen, n, HV, L, K), dim=-1)
        pool.kbuf[slots.to(dev)] = k.to(torch.bfloat16).to(dev)
        pool.ubuf[slots.to(dev)] = (scale * _randn(gen, n, HV, L, V)).to(torch.bfloat16).to(dev)
        pool.w[slots.to(dev)] = (0.05 + 0.95 * _rand(gen, n, HV, L)).to(dev)
        if pool.gate == "kda":
            if regime == "decayed":
                g = torch.zeros(n, HV, L, K)
                pc = torch.full((n, HV, K), -1.0e4)
            else:
                g = torch.exp(-0.2 * _rand(gen, n, HV, L, K))
                pc = -0.5 * _rand(gen, n, HV, K)
            pool.gbuf[slots.to(dev)] = g.to(torch.float16).to(dev)
            pool.pcum[slots.to(dev)] = pc.to(dev)
        else:
            pc = torch.zeros(n, HV, 1) if regime == "decayed" else 0.3 + 0.7 * _rand(gen, n, HV, 1)
            pool.pcum[slots.to(dev)] = pc.to(dev)
    if due is None:
        due = torch.ones(n, HV, dtype=torch.bool)
    below = torch.randint(0, L, (n, HV), generator=gen, dtype=torch.int32)
    pool.hcnt[slots.to(dev)] = torch.where(due.cpu(), torch.full_like(below, L), below).to(dev)


def _fill_by_stream(pool: Pool, slots: torch.Tensor, gen: torch.Generator, fills: int = 3) -> None:
    """States as an engine makes them: tokens appended and rings flushed (by the reference) ``fills`` times over,
    leaving a full ring."""
    from leapquant.reference import ReferenceBackend

    n, dev = slots.numel(), pool.device
    pool.load_states(slots, torch.zeros(n, pool.heads, pool.head_v, pool.head_k, device=dev), backend="reference")
    x = decode_stream("synthetic", n, pool.heads, pool.head_k, pool.head_v, fills * pool.ring, pool.gate, gen,
                      queries=False)
    k, v, g, beta = x["k"], x["v"], x["g"], x["beta"]
    idx = slots.to(torch.int32).to(dev)
    for t in range(fills * pool.ring):
        if t and t % pool.ring == 0:
            ReferenceBackend().flush(pool, idx)
        pool.append(slots, k[t], v[t], g[t], beta[t])
