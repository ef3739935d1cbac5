"""The sweep: each release's build of the Gluon step against the fp32 reference, SPEC §6's criteria token by token
(as parity_tests/test_triton_step.py and test_multi_token.py hold the native build to them): ``out`` within 1e-5
(one ulp of a 16-bit ``out``), the new ``ubuf`` entry within one bf16 ulp, the new ``kbuf`` / ``gbuf`` entries, the
gates and the history as the reference writes them. Pools of 6 slots x 4 heads of 128 x 128, ring 16, rank 2, filled
by the gaussian workload, counts that leave room for the call's tokens (nothing flushed)."""

from __future__ import annotations

import torch

import leapquant
import leapquant_triton.step as ST
from leapquant import formulas, parity
from leapquant.reference import ReferenceBackend
from parity_tests.test_multi_token import _pool, _tokens, _twin
from parity_tests.test_triton_step import _ulp, _ulps

REF = ReferenceBackend()
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CONFIGS = []
for gate in ("kda", "gdn"):
    for i, (tq, tg, to) in enumerate((("bf16", "fp32", "bf16"), ("fp32", "fp32", "fp32"), ("fp16", "fp16", "fp16"),
                                      ("bf16", "bf16", "fp32"))):
        for l2 in (False, True):
            CONFIGS.append(dict(gate=gate, T=1, tq=tq, tg=tg, to=to, l2=l2, conv="vllm", H=2 if l2 else 4))
        if i == 0:
            CONFIGS.append(dict(gate=gate, T=1, tq=tq, tg=tg, to=to, l2=False, conv="sglang", H=4))
    for T in (2, 3, 4, 6, 8):
        for tq, tg, to in (("fp32", "fp32", "fp32"), ("bf16", "fp32", "bf16")):
            if T > 4 and tq == "bf16":
                continue
            CONFIGS.append(dict(gate=gate, T=T, tq=tq, tg=tg, to=to, l2=False, conv="vllm", H=2 if T % 2 else 4))


def make(c: dict, seed: int):
    """The configuration's pool (with the history of T tokens where T > 1), ``idx`` (row 1 pads) and tokens."""
    T = c["T"]
    L = 16
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, L - T + 1, (5, 4), generator=gen)  # room for T more: nothing flushed
    made, gen = _pool(c["gate"], T, L=L, HV=4, seed=seed, counts=counts, max_tokens=T, dim=128)
    if c["conv"] == "sglang":  # the same bytes in a pool whose slots start at 0
        g = made.geometry
        other = leapquant.Pool(g.num_slots, g.heads, 128, 128, L, g.rank, gate=g.gate, q0=made.q0.clone(),
                               convention="sglang")
        parity.restore(other, parity.snapshot(made))
        made = other
    pool = _twin(made, DEV) if made.history is not None else _plain_twin(made)
    idx = torch.tensor([3, 0, 1, 5], dtype=torch.int32, device=DEV)
    raw = _tokens(pool, idx.numel(), T, c["H"], gen)
    tok = {n: x.to(DEV, DT[c["tg"] if n in ("g", "beta") else c["tq"]]) for n, x in raw.items()}
    if T == 1:
        tok = {n: x[:, 0] for n, x in tok.items()}
    return pool, idx, tok


def _plain_twin(pool):
    """A pool holding ``pool``'s bytes on the sweep's device, without a history (parity.twin keeps the device)."""
    g = pool.geometry
    other = leapquant.Pool(g.num_slots, g.heads, g.head_k, g.head_v, g.ring, g.rank, gate=g.gate, q0=pool.q0.clone(),
                           convention=pool.convention, device=DEV)
    parity.restore(other, parity.snapshot(pool))
    return other


def run_kernel(pool, idx, tok, c: dict) -> torch.Tensor:
    """The Triton step of the configuration (its launches split at four tokens, as the Gluon kernel takes them), ``out``
    poisoned first."""
    T = c["T"]
    shape = (idx.numel(), T, pool.heads, 128) if T > 1 else (idx.numel(), pool.heads, 128)
    out = torch.full(shape, float("nan"), dtype=DT[c["to"]], device=DEV)
    ST.step_pool(pool, idx, **tok, scale=0.3, use_qk_l2norm=c["l2"], out=out, per_launch=4 if T > 1 else None)
    return out


def check(pool, before, idx, tok, out, c: dict) -> list[str]:
    """SPEC §6 per token against the reference stepped from the state the kernel left before it; [] if all hold."""
    T, bad = c["T"], []
    real = (idx >= pool.first_slot) & (idx < pool.num_slots)
    rows = idx[real].long()
    if not bool((out[~real] == 0).all()):
        bad.append("padding row not 0")
    heads = torch.arange(pool.heads, device=DEV)
    hist, L = pool.history, pool.ring
    start = (hist.start[rows] if T > 1 else before.hcnt[rows])
    j0 = torch.where(start >= L, torch.zeros_like(start), start)
    for t in range(T):
        if T > 1:
            ref = _twin(pool)
            ref.hcnt[rows] = torch.where(torch.full_like(start, t) == 0, start, j0 + t).int()
            ref.pcum[rows] = hist.pcum[rows, :, t]
            ref.w[rows] = hist.w[rows, :, t]
            x = {n: tok[n][:, t] for n in tok}
            got = out[:, t]
        else:
            ref = parity.twin(before)
            x = tok
            got = out
        want = torch.empty(idx.numel(), pool.heads, 128, device=DEV)  # fp32 whatever the tokens' dtype
        REF.step(ref, idx, x["q"], x["k"], x["v"], x["g"], x["beta"], scale=0.3, use_qk_l2norm=c["l2"], out=want)
        j = (j0 + t).long()
        # o is linear in the new entry: the reference's taken with the kernel's bf16 entry where they differ by an ulp
        # (as parity_tests/test_triton_step.py's check)
        qx = x["q"].float()
        if c["l2"]:
            qx = formulas.l2norm(qx)
        qx = qx.repeat_interleave(pool.heads // qx.shape[1], 1)[real].double()  # [rows, HV, K]
        bx = x["beta"].float()[real].double()[..., None]
        kb_a, ub_a = pool.kbuf[rows[:, None], heads, j].double(), pool.ubuf[rows[:, None], heads, j].double()
        kb_r, ub_r = ref.kbuf[rows[:, None], heads, j].double(), ref.ubuf[rows[:, None], heads, j].double()
        corr = 0.3 * bx * (ub_a * (kb_a * qx).sum(-1, keepdim=True) - ub_r * (kb_r * qx).sum(-1, keepdim=True))
        w, gt = want[real].double() + corr, got[real].double()
        if got.dtype == torch.float32:
            rel = (gt - w).norm(dim=-1) / w.norm(dim=-1).clamp_min(1e-30)
            if float(rel[w.norm(dim=-1) > 0].max()) > 1e-5:
                bad.append(f"t{t} out rel {float(rel.max()):.2e}")
        else:
            bound = _ulp(w, got.dtype) + 1e-5 * w.abs().amax(-1, keepdim=True)
            r = ((gt - w).abs() / bound).max()
            if float(r) > 1:
                bad.append(f"t{t} out {float(r):.2f} of an ulp")
        for name in ("kbuf", "gbuf"):
            if getattr(pool, name) is not None:
                a_, b_ = getattr(pool, name)[rows[:, None], heads, j], getattr(ref, name)[rows[:, None], heads, j]
                if name == "kbuf" and c["l2"]:
                    if int(_ulps(a_, b_).max()) > 1:
                        bad.append(f"t{t} kbuf {int(_ulps(a_, b_).max())} ulp")
                elif not torch.equal(a_, b_) and not (DEV == "cpu" and int(_ulps(a_, b_).max()) <= 1):
                    bad.append(f"t{t} {name} differs")  # (the interpreter's exp is numpy's: an ulp off torch's)
        a_u, b_u = pool.ubuf[rows[:, None], heads, j], ref.ubuf[rows[:, None], heads, j]
        d = _ulps(a_u, b_u)
        floor = 2.0 ** -18 * (x["v"].float().abs().max() + b_u.float().abs().max())
        if not bool(((d <= 1) | ((a_u.float() - b_u.float()).abs() <= floor)).all()):
            bad.append(f"t{t} ubuf {int(d.max())} ulp")
        if T > 1:
            if not torch.allclose(hist.pcum[rows, :, t + 1], ref.pcum[rows], rtol=4e-7, atol=0):
                bad.append(f"t{t} hist pcum")
            if not torch.allclose(hist.w[rows, :, t + 1], ref.w[rows], rtol=4e-7, atol=0):
                bad.append(f"t{t} hist w")
        else:
            for name in ("pcum", "w", "hcnt"):
                a_, b_ = getattr(pool, name)[rows], getattr(ref, name)[rows]
                if not torch.equal(a_, b_) and not (DEV == "cpu" and name != "hcnt"
                                                    and torch.allclose(a_, b_, rtol=5e-7, atol=0)):
                    bad.append(f"{name} differs")
    return bad




def capture() -> None:
    """Every configuration's launches (the routing's capture records their keys)."""
    native = ST.flush_pool
    ST.flush_pool = _no_flush
    try:
        for n, c in enumerate(CONFIGS):
            pool, idx, tok = make(c, 100 + n)
            run_kernel(pool, idx, tok, c)
    finally:
        ST.flush_pool = native


def _no_flush(*args, **kwargs) -> None:
    """Every ring has room for the call's tokens: nothing is due, and no flush kernel is built for the sweep."""


def run(state, releases) -> list[dict]:
    """Each configuration under each release: "pass", what failed, or "no cubin" where a launch found none."""
    native = ST.flush_pool
    ST.flush_pool = _no_flush
    rows = []
    try:
        for n, c in enumerate(CONFIGS):
            pool0, idx, tok = make(c, 100 + n)
            line = {"config": c, "results": {}}
            for rel in releases:
                state.release = rel
                state.counts.update(routed=0, native=0)
                pool = _twin(pool0) if pool0.history is not None else parity.twin(pool0)
                try:
                    out = run_kernel(pool, idx, tok, c)
                    if DEV == "cuda":
                        torch.cuda.synchronize()
                    if state.counts["native"]:
                        line["results"][rel] = "no cubin for a launch"
                        continue
                    bad = check(pool, pool0, idx, tok, out, c)
                    line["results"][rel] = "pass" if not bad else "; ".join(bad[:4])
                except Exception as e:  # one configuration's failure is its row's
                    line["results"][rel] = f"error {type(e).__name__}: {e}"[:200]
            state.release = None
            rows.append(line)
            print(line, flush=True)
    finally:
        ST.flush_pool = native
    return rows
