"""The token streams the tools decode: one generator, seeded by the caller (on the CPU), so that a run replays.

``synthetic``: unit random keys and queries, per-channel (KDA) or per-head (GDN) memory lengths of 10..1000 tokens
(``g = log(1 - 1/tau)``, tau log-uniform, jittered by 0.5..1.5 per token), beta in (0.05, 0.95). ``structured``:
keys and queries near three dominant directions, two outlier key channels, four outlier value channels, a quarter of
the key channels (GDN: every other head) with memory lengths of 10^3..10^5 tokens, i.e. decays within 1e-3 of 1; as
trained models show.
"""

from __future__ import annotations

import math

import torch

STREAMS = ("synthetic", "structured")


def _normalise(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(x, dim=-1)


def _log_uniform(gen, lo: float, hi: float, *shape) -> torch.Tensor:
    return torch.exp(math.log(lo) + (math.log(hi) - math.log(lo)) * torch.rand(*shape, generator=gen))


def decode_stream(kind: str, n: int, heads: int, K: int, V: int, T: int, gate: str, gen: torch.Generator, *,
                  key_heads: int | None = None, queries: bool = True) -> dict:
    """Decode inputs ``dict(q, k, v, g, beta)``, each ``[T, n, heads, ...]`` fp32 on the CPU: ``q, k [.., K]`` unit
    vectors (``key_heads`` heads of them, dividing ``heads``; default ``heads``), ``v [.., V]``, ``g`` log-gates
    (``[.., K]`` for KDA, ``[T, n, heads]`` for GDN), ``beta [T, n, heads]`` in (0, 1).

    ``queries=False`` leaves ``q`` out (the synthetic stream then does not draw it: a pool filler that needs no
    queries leaves the generator where the other inputs leave it).
    """
    H = key_heads or heads
    if kind == "synthetic":
        tau = _log_uniform(gen, 10.0, 1000.0, n, heads, K)
        k = _normalise(torch.randn(T, n, H, K, generator=gen))
        v = torch.randn(T, n, heads, V, generator=gen)
        beta = 0.05 + 0.9 * torch.rand(T, n, heads, generator=gen)
        g_base = torch.log1p(-1.0 / tau)
        if gate != "kda":
            g_base = g_base[..., 0]
        g = g_base.expand(T, *g_base.shape) * (0.5 + torch.rand(T, *g_base.shape, generator=gen))
        q = _normalise(torch.randn(T, n, H, K, generator=gen)) if queries else None
        return _inputs(q, k, v, g, beta)
    if kind != "structured":
        raise ValueError(f"unknown stream {kind!r}; known: {STREAMS}")
    if H != heads:
        raise ValueError("the structured stream has one key head per value head")
    # memory lengths tau: a quarter of the key channels (GDN: every other head) remember 10^3..10^5 tokens
    if gate == "kda":
        long = torch.rand(n, heads, K, generator=gen) < 0.25
        tau = torch.where(long, _log_uniform(gen, 1e3, 1e5, n, heads, K), _log_uniform(gen, 10.0, 1e3, n, heads, K))
    else:
        long = (torch.arange(heads) % 2 == 0).expand(n, heads)
        tau = torch.where(long, _log_uniform(gen, 1e3, 1e5, n, heads), _log_uniform(gen, 10.0, 1e3, n, heads))
    g_base = torch.log1p(-1.0 / tau)
    dirs = _normalise(torch.randn(n, heads, 3, K, generator=gen))
    weight = torch.tensor([3.0, 1.5, 1.0])
    # two "massive activation" key channels with a fixed offset per head, shared by keys and queries
    out_k = torch.randperm(K, generator=gen)[:2]
    offset = torch.zeros(n, heads, K)
    offset[..., out_k] = torch.sign(torch.randn(n, heads, 2, generator=gen))

    def near_dirs():
        coef = torch.randn(T, n, heads, 3, generator=gen) * weight
        noise = 0.3 * torch.randn(T, n, heads, K, generator=gen) / math.sqrt(K)
        return _normalise(torch.einsum("tnhd,nhdk->tnhk", coef, dirs) + offset + noise)

    k, q = near_dirs(), near_dirs()
    v = torch.randn(T, n, heads, V, generator=gen)
    v[..., torch.randperm(V, generator=gen)[:4]] *= 10.0
    beta = 0.05 + 0.9 * torch.rand(T, n, heads, generator=gen)
    jitter = 0.5 + torch.rand(T, *g_base.shape, generator=gen)
    return _inputs(q if queries else None, k, v, g_base * jitter, beta)


def _inputs(q, k, v, g, beta) -> dict:
    return ({} if q is None else {"q": q}) | dict(k=k, v=v, g=g, beta=beta)
