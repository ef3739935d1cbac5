"""SPEC §3 (the flush) and §6 (the decode step) as plain torch functions, one per step: the definition of correct.

Pure functions of tensors (no pool, no backend): the reference backend (:mod:`leapquant.reference`), ``Pool.append``,
the parity judge and the tools all compute with these. Written for clarity, vectorised over any leading batch dimensions, the same code on CPU and CUDA. Every function
takes the arithmetic dtype (``torch.float32`` is the reference; ``torch.float64`` is the float64 model the reference
itself is checked against). Shapes use the SPEC's letters: ``V`` value channels (rows), ``K`` key channels (columns),
``L`` ring entries, ``R`` rank; ``...`` is any batch, e.g. ``[N, HV]``.
"""

from __future__ import annotations

import torch

from .constants import EPS, FLOOR, FP16_MAX, PNMIN, QMAX, TINY


def dequantise(codes, s_k, s_v, dtype=torch.float32):
    """``Dq[v, k] = C[v, k] * (s_v[v] / QMAX) * s_k[k]`` -> ``[..., V, K]``."""
    return codes.to(dtype) * (s_v.to(dtype) / QMAX)[..., :, None] * s_k.to(dtype)[..., None, :]


def low_rank(u, q, dtype=torch.float32):
    """``sum_r q_r (outer) u_r`` from fp16 factors ``u [..., R, K]``, ``q [..., R, V]`` -> ``[..., V, K]``."""
    return torch.einsum("...rv,...rk->...vk", q.to(dtype), u.to(dtype))


def decays(gbuf, dtype=torch.float32):
    """KDA: ``d_j[k] = prod_{i=j+1}^{L-1} gbuf[i, k]`` (``d_{L-1} = 1``) from ``gbuf [..., L, K]``."""
    g = gbuf.to(dtype)
    suffix = torch.flip(torch.cumprod(torch.flip(g, [-2]), dim=-2), [-2])  # prod_{i >= j}
    return torch.cat([suffix[..., 1:, :], torch.ones_like(g[..., :1, :])], dim=-2)


def ring_state(kbuf, ubuf, w, gbuf, gate, dtype=torch.float32):
    """The ring buffer's contribution ``[..., V, K]`` (SPEC §3 step 3)."""
    k = kbuf.to(dtype)
    if gate == "kda":
        k = k * decays(gbuf, dtype)
    return torch.einsum("...lv,...lk->...vk", ubuf.to(dtype), w.to(dtype)[..., :, None] * k)


def checkpoint_scale(pcum, gate, dtype=torch.float32):
    """What multiplies the checkpoint: ``exp(pcum) [..., 1, K]`` (KDA) or ``max(pcum[0], PNMIN) [..., 1, 1]``."""
    p = pcum.to(dtype)
    if gate == "kda":
        return torch.exp(p)[..., None, :]
    return torch.clamp_min(p[..., :1], PNMIN)[..., None, :]


def rebuild(codes, s_k, s_v, u, q, kbuf, ubuf, w, pcum, gbuf=None, *, gate="kda", dtype=torch.float32):
    """The rebuilt state ``S [..., V, K]`` (SPEC §3 steps 1-4).

    Args:
        codes: int8 ``[..., V, K]``; s_k: ``[..., K]``; s_v: ``[..., V]``; u: fp16 ``[..., R, K]``;
        q: fp16 ``[..., R, V]``; kbuf: bf16 ``[..., L, K]``; ubuf: bf16 ``[..., L, V]``; w: ``[..., L]``;
        pcum: ``[..., K]`` (KDA) or ``[..., 1]`` (GDN); gbuf: fp16 ``[..., L, K]`` (KDA) or None (GDN).
    """
    old = dequantise(codes, s_k, s_v, dtype) + low_rank(u, q, dtype)
    return old * checkpoint_scale(pcum, gate, dtype) + ring_state(kbuf, ubuf, w, gbuf, gate, dtype)


def predict(codes, s_k, s_v, u, q, kbuf, ubuf, w, pcum, gbuf=None, *, gate="kda", k, dtype=torch.float32):
    """``S k`` for keys ``k [..., K]`` without forming ``S``: what the step kernel predicts (SPEC §6)."""
    k = k.to(dtype)
    ks = k * checkpoint_scale(pcum, gate, dtype)[..., 0, :]  # the checkpoint's decay folded into the key
    dq = (s_v.to(dtype) / QMAX) * torch.einsum("...vk,...k->...v", codes.to(dtype), s_k.to(dtype) * ks)
    lo = torch.einsum("...rv,...r->...v", q.to(dtype), torch.einsum("...rk,...k->...r", u.to(dtype), ks))
    kk = kbuf.to(dtype)
    if gate == "kda":
        kk = kk * decays(gbuf, dtype)
    ring = torch.einsum("...lv,...l->...v", ubuf.to(dtype), w.to(dtype) * torch.einsum("...lk,...k->...l", kk, k))
    return dq + lo + ring


def cholqr(Y, floor: float = FLOOR):
    """One CholeskyQR step with the relative pivot floor: ``Y L^{-T}`` where ``Y^T Y = L L^T`` (SPEC §3 step 5).

    ``L_ii = sqrt(max(G_ii - sum_{j<i} L_ij^2, floor * G_ii, TINY))``. ``Y [..., V, R]``, R <= 4, so the
    factorisation is written out column by column.
    """
    R = Y.shape[-1]
    G = Y.transpose(-1, -2) @ Y  # [..., R, R]
    Lf = torch.zeros_like(G)
    for i in range(R):
        d = G[..., i, i] - (Lf[..., i, :i] ** 2).sum(-1)
        piv = torch.sqrt(torch.maximum(torch.maximum(d, floor * G[..., i, i]), torch.full_like(d, TINY)))
        Lf[..., i, i] = piv
        for k in range(i + 1, R):
            Lf[..., k, i] = (G[..., k, i] - (Lf[..., k, :i] * Lf[..., i, :i]).sum(-1)) / piv
    cols = []
    for i in range(R):
        c = Y[..., :, i]
        for j in range(i):
            c = c - Lf[..., i, j, None] * cols[j]
        cols.append(c / Lf[..., i, i, None])
    return torch.stack(cols, dim=-1)


def pow2_normaliser(S):
    """A power of two ``c [..., 1, 1]`` with ``max|c S|`` in [0.5, 1) (1 for a zero state): scaling by it is exact,
    and keeps the subspace products finite for ``max|S|`` anywhere in the SPEC's domain. The exponent is held to
    ``[-125, 126]``, as the kernels hold theirs, so that ``c`` stays a finite fp32 number: below ``2^-126`` (a fully
    decayed head, a denormal state) ``c = 2^125`` leaves ``max|c S|`` under 0.5 instead of overflowing to infinity
    and NaN factors."""
    m = S.abs().amax(dim=(-2, -1), keepdim=True)
    _, e = torch.frexp(m)
    return torch.where(m > 0, torch.ldexp(torch.ones_like(m), -e.clamp(-125, 126)), torch.ones_like(m))


def subspace(S, q0, iters: int = 1):
    """``ITERS`` rounds of the block power method from ``q0 [V, R]``, each closed by CholeskyQR2 -> ``Q [..., V, R]``."""
    Sn = S * pow2_normaliser(S)
    Q = q0.to(S.dtype).expand(*S.shape[:-2], *q0.shape)
    for _ in range(iters):
        P = Sn.transpose(-1, -2) @ Q  # [..., K, R]
        Y = Sn @ P  # [..., V, R]
        Q = cholqr(cholqr(Y))
    return Q


def compress(S, q0, iters: int = 1):
    """A new checkpoint for states ``S [..., V, K]`` (SPEC §3 steps 5-9), computed in ``S.dtype``.

    Returns ``(codes int8 [..., V, K], s_k [..., K], s_v [..., V], u fp16 [..., R, K], q fp16 [..., R, V])``; the
    scales are in ``S.dtype`` (the caller stores them as fp32).
    """
    dt = S.dtype
    q16 = subspace(S, q0, iters).to(torch.float16)  # [..., V, R]
    U = S.transpose(-1, -2) @ q16.to(dt)  # [..., K, R]
    u16 = U.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
    E = S - q16.to(dt) @ u16.to(dt).transpose(-1, -2)  # [..., V, K]
    s_k = torch.clamp_min(torch.sqrt(E.abs().mean(dim=-2)), EPS)  # [..., K]
    X = E / s_k[..., None, :]
    s_v = torch.clamp_min(X.abs().amax(dim=-1), EPS)  # [..., V]
    codes = torch.round(X * QMAX / s_v[..., :, None]).clamp(-QMAX, QMAX).to(torch.int8)
    return codes, s_k, s_v, u16.transpose(-1, -2).contiguous(), q16.transpose(-1, -2).contiguous()


def reconstruct(codes, s_k, s_v, u, q, dtype=torch.float64):
    """The state a checkpoint represents, ``Dq + q16 u16^T`` (SPEC §4's ``rec``)."""
    return dequantise(codes, s_k, s_v, dtype) + low_rank(u, q, dtype)


def relative_error(rec, S):
    """Per program ``||rec - S||_F / ||S||_F`` over the last two dims (0 where both are zero)."""
    num = torch.linalg.vector_norm((rec - S).to(torch.float64), dim=(-2, -1))
    den = torch.linalg.vector_norm(S.to(torch.float64), dim=(-2, -1))
    return torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), num)


def l2norm(x):
    """``x / sqrt(sum x^2 + 1e-6)`` over the last dimension, as FLA's ``use_qk_l2norm_in_kernel``."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def step_rows(c: dict, q, k, v, g, beta, *, gate: str, scale: float, use_qk_l2norm: bool = False):
    """One token into the rings of gathered rows (SPEC §6), after their full rings were flushed.

    Args:
        c: the rows' checkpoints and rings as :meth:`Pool.gather` gives them (``[N, HV, ...]``) plus ``hcnt``
            ``[N, HV]``; q, k: ``[N, HV, K]`` (key heads already repeated per value head); v: ``[N, HV, V]``;
            g: ``[N, HV, K]`` (KDA) or ``[N, HV]`` (GDN) log decays; beta: ``[N, HV]``.

    Returns:
        ``(ring, o)``: the new ``kbuf``, ``ubuf``, ``w``, ``pcum``, ``gbuf`` (KDA) and ``hcnt`` of the rows, and
        ``o = scale S_t q`` ``[N, HV, V]`` fp32, ``S_t`` the state after the token. Only the entries in use (before
        the new one) are read: entries at or past ``hcnt`` contribute nothing, whatever they hold.
    """
    f32 = torch.float32
    L = c["w"].shape[-1]
    q, k, v, beta = q.to(f32), k.to(f32), v.to(f32), beta.to(f32)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    j = c["hcnt"].long()
    j = torch.where(j >= L, torch.zeros_like(j), j)  # a full ring was flushed: it restarts at entry 0
    o_l = torch.arange(L, device=j.device)
    older = o_l < j[..., None]  # [N, HV, L]: the entries in use
    entry = o_l == j[..., None]  # the new one
    w, pcum, gbuf = c["w"], c["pcum"], c["gbuf"]
    if gate == "kda":
        pcum = pcum + g.to(f32)
        gbuf = torch.where(entry[..., None], torch.exp(g.to(f32))[..., None, :].to(torch.float16), gbuf)
        # decays up to now: entries past the new one count as 1
        g_use = torch.where((o_l > j[..., None])[..., None], torch.ones_like(gbuf), gbuf)
    else:
        a = torch.exp(g.to(f32))  # [N, HV]
        pcum = pcum * a[..., None]
        w = torch.where(older, w * a[..., None], w)
        g_use = None
    zero_l = torch.zeros_like(w)

    def ring_in(mask, kb, ub, ww):  # only the entries of ``mask``: others may hold anything, NaN included
        return dict(kbuf=torch.where(mask[..., None], kb, torch.zeros_like(kb)),
                    ubuf=torch.where(mask[..., None], ub, torch.zeros_like(ub)),
                    w=torch.where(mask, ww, zero_l))

    ck = dict(codes=c["codes"], s_k=c["s_k"], s_v=c["s_v"], u=c["u"], q=c["q"], pcum=pcum, gbuf=g_use)
    p = predict(**ck, **ring_in(older, c["kbuf"], c["ubuf"], w), gate=gate, k=k)  # S' k
    ubuf = torch.where(entry[..., None], (v - p).to(torch.bfloat16)[..., None, :], c["ubuf"])
    kbuf = torch.where(entry[..., None], k.to(torch.bfloat16)[..., None, :], c["kbuf"])
    w = torch.where(entry, beta[..., None], w)
    o = scale * predict(**ck, **ring_in(older | entry, kbuf, ubuf, w), gate=gate, k=q)  # S_t q
    ring = dict(kbuf=kbuf, ubuf=ubuf, w=w, pcum=pcum, hcnt=(j + 1).to(torch.int32))
    if gate == "kda":
        ring["gbuf"] = gbuf
    return ring, o


def ring_empty(w, pcum, gate: str):
    """``[...]`` bool: the ring holds nothing since its last flush, i.e. it is in the state a flush's ring reset leaves
    (SPEC §2): every weight ``w [..., L]`` zero and the checkpoint's scale the identity (KDA ``pcum [..., K]`` all 0,
    GDN ``pcum[..., 0] == 1``). The rebuilt state of such a ring is its checkpoint exactly, so a flush skips it
    (idempotence; ``gbuf`` and the entries' keys and values are void under zero weights). NaN is never empty. For a
    partially filled ring pass the weights of :func:`ring_in_use`: only the entries in use count."""
    empty = (w == 0).all(-1)
    if gate == "kda":
        return empty & (pcum == 0).all(-1)
    return empty & (pcum[..., 0] == 1)


def ring_in_use(kbuf, ubuf, w, gbuf, used) -> dict:
    """The ring with only its first ``used [...]`` entries (SPEC §3 step 3: a forced flush of a partially filled
    ring, SPEC §2): entries ``i >= used`` get zero keys, values and weights and unit decay factors, whatever they hold
    (NaN included), so they add nothing and decay nothing; ``used = L`` leaves the ring as it is. Returns ``kbuf``,
    ``ubuf``, ``w`` and ``gbuf`` (None for GDN) shaped as given."""
    L = w.shape[-1]
    live = torch.arange(L, device=w.device) < used.to(w.device)[..., None]  # [..., L]
    out = dict(kbuf=torch.where(live[..., None], kbuf, torch.zeros_like(kbuf)),
               ubuf=torch.where(live[..., None], ubuf, torch.zeros_like(ubuf)),
               w=torch.where(live, w, torch.zeros_like(w)), gbuf=None)
    if gbuf is not None:
        out["gbuf"] = torch.where(live[..., None], gbuf, torch.ones_like(gbuf))
    return out


def empty_ring(w, pcum, gbuf, gate: str) -> dict:
    """What a flush leaves in a ring (SPEC §2): ``w`` 0, the checkpoint's scale the identity (KDA ``pcum`` 0 and
    ``gbuf`` 1, GDN ``pcum`` 1), tensors shaped as the given ones (``gbuf`` None for GDN)."""
    new = dict(w=torch.zeros_like(w))
    if gate == "kda":
        new["pcum"] = torch.zeros_like(pcum)
        new["gbuf"] = torch.ones_like(gbuf)
    else:
        new["pcum"] = torch.ones_like(pcum)
    return new
