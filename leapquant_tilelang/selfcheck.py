"""GPU self-check of the TileLang backend against the fp32 reference (SPEC §4). Run on a CUDA machine:

    python -m leapquant_tilelang.selfcheck [--slots 40] [--seed 0]

For each gate (KDA, GDN) and slot convention (vLLM, SGLang) it fills a pool with random checkpoints and rings (half
of the slots random codes / scales / factors, half compressed low-rank-plus-noise states), marks a random set of
(slot, head) programs due, and flushes it with the TileLang backend and, on a copy, with the reference backend. Then:

* per due program, ``err = ||Dq_new + q16 u16^T - S*|| / ||S*||`` with ``S*`` rebuilt in float64 from the old
  checkpoint; ``err_tilelang <= 1.02 err_ref + 1e-6`` per program and RMS of the ratios ``<= 1.003``; all finite;
* the fraction of codes that differ from the reference's and the largest difference (reported, not required);
* every byte outside the due programs' checkpoints and ring rows is unchanged; the due rings are reset (SPEC §2);
  ``hcnt``, ``kbuf``, ``ubuf`` are unchanged;
* a batch with no due program changes nothing; the flush replays from a captured CUDA graph with the same result.

Exits 1 when any check fails.
"""

import argparse
import math
import sys

import torch

from leapquant.constants import PNMIN, QMAX
from leapquant import parity, reference
from leapquant.pool import Pool
from leapquant.reference import ReferenceBackend

from .backend import TileLangBackend



def fill_random(pool: Pool, gen: torch.Generator) -> None:
    """Random checkpoints and rings, in the value ranges a serving engine produces."""
    NS, HV, K, V, L, R = pool.num_slots, pool.heads, pool.head_k, pool.head_v, pool.ring, pool.rank
    dev = pool.device

    def rand(*shape):
        return torch.rand(*shape, generator=gen).to(dev)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dev)

    # half of the slots: compressed low-rank-plus-noise states (the regime where fp16 factor bits matter)
    half = torch.arange(NS // 2, NS)
    lr = randn(len(half), HV, V, 3) @ (randn(len(half), HV, 3, K) * torch.tensor([4.0, 1.0, 0.2], device=dev)[:, None])
    pool.load_states(half, lr + 0.05 * randn(len(half), HV, V, K))
    # the other half: arbitrary checkpoints
    low = torch.arange(0, NS // 2)
    pool.codes[low] = torch.randint(-127, 128, (len(low), HV, V, K), generator=gen, dtype=torch.int8).to(dev)
    pool.s_k[low] = 0.2 + 1.8 * rand(len(low), HV, K)
    pool.s_v[low] = 0.5 + 3.5 * rand(len(low), HV, V)
    pool.u[low] = (2.0 * randn(len(low), HV, R, K)).to(torch.float16)
    pool.q[low] = (randn(len(low), HV, R, V) / math.sqrt(V)).to(torch.float16)
    # rings everywhere
    pool.kbuf.copy_((randn(NS, HV, L, K) / math.sqrt(K)).to(torch.bfloat16))
    pool.ubuf.copy_((0.5 * randn(NS, HV, L, V)).to(torch.bfloat16))
    pool.w.copy_(0.02 + 0.96 * rand(NS, HV, L))
    if pool.gate == "kda":
        pool.gbuf.copy_((0.9 + 0.1 * rand(NS, HV, L, K)).to(torch.float16))
        pool.pcum.copy_(-0.5 * rand(NS, HV, K))
    else:
        pool.pcum.copy_(0.3 + 0.7 * rand(NS, HV, 1))
        pool.pcum[NS // 2 - 1, 0, 0] = 1e-30  # a fully decayed head: the PNMIN floor
    pool.hcnt.copy_(torch.randint(0, L, (NS, HV), generator=gen, dtype=torch.int32).to(dev))


def clone_pool(pool: Pool) -> Pool:
    twin = Pool(pool.num_slots, pool.heads, pool.head_k, pool.head_v, pool.ring, pool.rank, pool.gate,
                pool.convention, pool.device, pool.q0, pool.iters)
    for name in ("raw", "kbuf", "ubuf", "w", "pcum", "gbuf", "hcnt"):
        src = getattr(pool, name)
        if src is not None:
            getattr(twin, name).copy_(src)
    return twin


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    # bitwise: raw holds int8 codes and fp16 factors, whose bits read as fp32 include NaNs (NaN != NaN)
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def snapshot(pool: Pool) -> dict[str, torch.Tensor]:
    return {name: getattr(pool, name).clone() for name in ("raw", "kbuf", "ubuf", "w", "pcum", "gbuf", "hcnt")
            if getattr(pool, name) is not None}


def rebuild64(ck: dict[str, torch.Tensor], gate: str) -> torch.Tensor:
    """SPEC §3 steps 1-4 in float64 over programs: ``[P, V, K]``, written out independently of
    ``leapquant.reference.rebuild`` on purpose: the check below holds the two against each other on the GPU's data."""
    d = {k: v.to(torch.float64) for k, v in ck.items() if v is not None}
    dq = d["codes"] * (d["s_v"] / QMAX)[..., :, None] * d["s_k"][..., None, :]
    lo = d["q"].transpose(-1, -2) @ d["u"]  # [P, V, K]
    if gate == "kda":
        g = d["gbuf"]
        decay = torch.ones_like(g)
        for j in range(g.shape[-2] - 2, -1, -1):
            decay[..., j, :] = decay[..., j + 1, :] * g[..., j + 1, :]
        kd = d["w"][..., None] * d["kbuf"] * decay
        ring = d["ubuf"].transpose(-1, -2) @ kd
        return (dq + lo) * torch.exp(d["pcum"])[..., None, :] + ring
    pn = torch.clamp(d["pcum"][..., 0], min=PNMIN)
    ring = (d["w"][..., None] * d["ubuf"]).transpose(-1, -2) @ d["kbuf"]
    return pn[..., None, None] * (dq + lo) + ring


class Report:
    def __init__(self) -> None:
        self.failures: list[str] = []

    def check(self, ok: bool, what: str) -> None:
        print(f"  [{'ok' if ok else 'FAIL'}] {what}")
        if not ok:
            self.failures.append(what)


def make_idx(pool: Pool, gen: torch.Generator) -> torch.Tensor:
    """A batch of 80 rows (more than the compaction keeps in registers at 40 slots: the serial tail runs too): every
    real slot once, padding, and values outside the pool, shuffled."""
    NS = pool.num_slots
    real = torch.arange(pool.first_slot, NS, dtype=torch.int32)
    pad = 0 if pool.convention == "vllm" else -1
    junk = torch.tensor([NS, NS + 7, -5, 2**30, -(2**30)], dtype=torch.int32)
    rows = torch.cat([real, junk, torch.full((80 - len(real) - len(junk),), pad, dtype=torch.int32)])
    return rows[torch.randperm(len(rows), generator=gen)].to(pool.device)


def check_case(gate: str, convention: str, iters: int, num_slots: int, seed: int, rep: Report) -> None:
    print(f"{gate} / {convention} / iters {iters}: {num_slots} slots x 32 heads")
    gen = torch.Generator().manual_seed(seed)
    backend = TileLangBackend()
    pool = Pool(num_slots, gate=gate, convention=convention, device="cuda", iters=iters)
    ok, why = backend.supports(pool)
    rep.check(ok, f"supports(): {why}")
    if not ok:
        return
    fill_random(pool, gen)
    idx = make_idx(pool, gen)
    # due pattern: every head of 3 slots, then ~1/4 of the remaining (slot, head) programs
    real = idx[(idx >= pool.first_slot) & (idx < num_slots)].long()
    pool.hcnt[real[:3]] = pool.ring
    lucky = torch.rand(num_slots, pool.heads, generator=gen).to(pool.device) < 0.25
    pool.hcnt[lucky] = pool.ring
    # the null slot (vLLM) and the slots outside the pool are never due, whatever their counters say
    if pool.first_slot == 1:
        pool.hcnt[0] = pool.ring

    # a batch without due programs first (compiles the kernel): nothing may change
    before = snapshot(pool)
    none_due = torch.tensor([0 if pool.first_slot == 1 else -1, num_slots + 3], dtype=torch.int32, device="cuda")
    backend.flush(pool, none_due)
    torch.cuda.synchronize()
    rep.check(all(same_bytes(getattr(pool, k), v) for k, v in before.items()), "no due program: pool unchanged")

    due = pool.due(idx)  # [N, HV]
    rows, heads = due.nonzero(as_tuple=True)
    slots = idx.long()[rows]
    print(f"  {len(slots)} due programs in {len(idx)} rows")
    ck = {k: (v[torch.arange(len(slots)), heads] if v is not None else None)
          for k, v in pool.checkpoint(slots.tolist()).items()}
    target = rebuild64(ck, gate)
    model = reference.rebuild(**ck, gate=gate, dtype=torch.float64)
    rep.check(bool(torch.allclose(target, model, rtol=1e-12, atol=1e-12)), "S* agrees with reference.rebuild (f64)")

    twin = clone_pool(pool)
    graph_pool = clone_pool(pool)
    backend.flush(pool, idx)
    ReferenceBackend().flush(twin, idx)
    torch.cuda.synchronize()

    def represented(p: Pool) -> torch.Tensor:  # Dq + q16 u16^T of the due programs' new checkpoints, float64
        return reference.reconstruct(p.codes[slots, heads], p.s_k[slots, heads], p.s_v[slots, heads],
                                     p.u[slots, heads], p.q[slots, heads])

    err_b = reference.relative_error(represented(pool), target)
    err_r = reference.relative_error(represented(twin), target)
    ratio = err_b / err_r
    finite_r = torch.isfinite(err_r)
    rep.check(bool(torch.isfinite(err_b[finite_r]).all()), "outputs finite wherever the reference's are")
    worst = int(torch.argmax(ratio))
    print(f"  err_ref mean {err_r.mean():.4e}; ratio tilelang / ref: mean {ratio.mean():.5f}, "
          f"max {ratio.max():.5f} (slot {int(slots[worst])}, head {int(heads[worst])}), "
          f"RMS {ratio.pow(2).mean().sqrt():.5f}")
    bad = err_b > parity.BACKEND_PER_PROGRAM * err_r + parity.ABS_SLACK
    rep.check(not bool(bad.any()),
              f"per program err <= {parity.BACKEND_PER_PROGRAM} err_ref + 1e-6 ({int(bad.sum())} violate)")
    rep.check(float(ratio.pow(2).mean().sqrt()) <= parity.BACKEND_RMS, f"RMS ratio <= {parity.BACKEND_RMS}")
    cd = (pool.codes[slots, heads].int() - twin.codes[slots, heads].int()).abs()
    differ = float((cd > 0).float().mean()) * 100
    print(f"  codes differing from the reference: {differ:.4f} %, largest difference {int(cd.max())}")

    # untouched bytes and resets
    may_write = pool.checkpoint_mask(slots, heads)
    raw_b, raw_0 = pool.raw.view(torch.uint8), before["raw"].view(torch.uint8)
    rep.check(torch.equal(raw_b[~may_write], raw_0[~may_write]), "raw: every byte outside due checkpoints unchanged")
    for name in ("kbuf", "ubuf", "hcnt"):
        rep.check(torch.equal(getattr(pool, name), before[name]), f"{name} unchanged")
    is_due = torch.zeros(num_slots, pool.heads, dtype=torch.bool, device="cuda")
    is_due[slots, heads] = True
    rep.check(torch.equal(pool.w[~is_due], before["w"][~is_due]) and bool((pool.w[is_due] == 0).all()),
              "w: due rows 0, others unchanged")
    if gate == "kda":
        rep.check(torch.equal(pool.pcum[~is_due], before["pcum"][~is_due]) and bool((pool.pcum[is_due] == 0).all()),
                  "pcum: due rows 0, others unchanged")
        rep.check(torch.equal(pool.gbuf[~is_due], before["gbuf"][~is_due]) and bool((pool.gbuf[is_due] == 1).all()),
                  "gbuf: due rows 1.0, others unchanged")
    else:
        rep.check(torch.equal(pool.pcum[~is_due], before["pcum"][~is_due]) and bool((pool.pcum[is_due] == 1).all()),
                  "pcum: due rows 1.0, others unchanged")

    # the same flush captured in a CUDA graph and replayed
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            backend.flush(graph_pool, idx)
        graph.replay()
        torch.cuda.synchronize()
        same = all(same_bytes(getattr(graph_pool, k), getattr(pool, k)) for k in before)
        rep.check(same, "CUDA graph replay gives the direct flush's bytes")
    except Exception as e:  # a capture error is a failed requirement, reported with its reason
        rep.check(False, f"CUDA graph capture: {type(e).__name__}: {e}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slots", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    ok, why = TileLangBackend().available()
    if not ok:
        print(f"tilelang backend unavailable: {why}")
        return 1
    print(f"device: {torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))})")
    rep = Report()
    # the seed's deployed iteration count on every gate and convention, then two rounds (not measured in the seed)
    cases = [("kda", "vllm", 1), ("kda", "sglang", 1), ("gdn", "vllm", 1), ("gdn", "sglang", 1), ("kda", "vllm", 2)]
    for i, (gate, convention, iters) in enumerate(cases):
        check_case(gate, convention, iters, args.slots, args.seed + i, rep)
    if rep.failures:
        print(f"FAILED ({len(rep.failures)}):")
        for f in rep.failures:
            print(f"  {f}")
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
