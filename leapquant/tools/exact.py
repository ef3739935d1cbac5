"""The gated delta rule computed exactly (in float64), the one every tool measures LeapQuant against.

In the ``[V, K]`` layout of SPEC §1 and §6 (FLA's ``naive_recurrent_kda`` / gated delta rule, transposed):

    KDA:  S <- S diag(exp g_t)        GDN:  S <- exp(g_t) S
          S <- S + beta_t (v_t - S k_t) k_t^T
          o_t = scale S_t q_t,  S_t the state after token t

Query and key heads may divide the value heads (grouped value heads): each query / key head serves
``HV / H`` consecutive value heads, as in ``leapquant.step``.
"""

from __future__ import annotations

import torch


def _grouped(x: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """Query or key ``x [..., H, K]`` repeated to the ``HV`` value heads of ``S [..., HV, V, K]``."""
    if x.dim() < 2 or S.dim() < 3 or x.shape[-2] == S.shape[-3]:
        return x
    return x.repeat_interleave(S.shape[-3] // x.shape[-2], dim=-2)


def recurrent_step(S: torch.Tensor, k, v, g, beta, gate: str) -> torch.Tensor:
    """One token of the gated delta rule on states ``S [..., V, K]`` in ``S.dtype``; returns the new state.

    ``k [..., K]``, ``v [..., V]``, ``beta [...]``; ``g [..., K]`` (KDA) or ``[...]`` (GDN), log-gates. Exact in
    float64; the simulation also steps its fp32 dense formats with it.
    """
    dt = S.dtype
    k, v, g, beta = _grouped(k, S).to(dt), v.to(dt), g.to(dt), beta.to(dt)
    if gate == "kda":
        S = S * torch.exp(g)[..., None, :]
    else:
        S = S * torch.exp(g)[..., None, None]
    err = v - torch.einsum("...vk,...k->...v", S, k)  # [..., V]
    return S + (beta[..., None] * err)[..., :, None] * k[..., None, :]


def output(S: torch.Tensor, q: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``o = scale S q`` for states ``S [..., V, K]`` and queries ``q [..., K]``, in ``S.dtype``."""
    return scale * torch.einsum("...vk,...k->...v", S, _grouped(q, S).to(S.dtype))


def exact_recurrence(q, k, v, g, beta, gate: str, *, state: torch.Tensor | None = None, scale: float = 1.0,
                     dtype=torch.float64):
    """The recurrence over ``T`` tokens: inputs ``[T, ...]`` as :func:`leapquant.tools.streams.decode_stream` gives
    them, from ``state [..., V, K]`` (V-first; default zero).

    Returns ``(o [T, ..., V], S [..., V, K])`` with ``o_t = scale S_t q_t`` (default ``scale`` 1: no
    ``1/sqrt(K)``), in ``dtype``.
    """
    T, V, K = k.shape[0], v.shape[-1], k.shape[-1]
    S = torch.zeros(*v.shape[1:-1], V, K, dtype=dtype) if state is None else state.to(dtype)
    out = []
    for t in range(T):
        S = recurrent_step(S, k[t], v[t], g[t], beta[t], gate)
        out.append(output(S, q[t], scale))
    return torch.stack(out), S


def relative_error(a: torch.Tensor, b: torch.Tensor, dims) -> torch.Tensor:
    """``||a - b|| / ||b||`` over ``dims``, in float64 (against an exact ``b`` of zero norm: ``||a|| / 1e-300``, so
    that any error there shows)."""
    b = b.double()
    num = torch.linalg.vector_norm(a.double() - b, dim=dims)
    return num / torch.clamp_min(torch.linalg.vector_norm(b, dim=dims), 1e-300)
