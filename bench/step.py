"""What the flush is amortised against: one KDA decode step on a full-precision (fp32) state, in plain Triton.

Per (row n, head h), with the state ``S [V, K]`` of slot ``idx[n]`` (V-first, as the pool's checkpoints):

    S <- S diag(exp g);   S <- S + beta (v - S k) k^T;   o = S q

Each row ``v`` of ``S`` is independent (its prediction ``S[v] . k`` and its update need only that row), so the grid
splits V into blocks of BV rows: program (n * HV + h, i_v) reads its ``[BV, K]`` slice of the state once and writes
it once. This is the byte floor's kernel, with no tiling tricks: a reference point, not an engine's step kernel.
A row whose ``idx`` is negative (SGLang padding) is skipped; its state and its ``o`` are left as they were.
"""

from __future__ import annotations

import time

import torch
import triton
import triton.language as tl

from leapquant.tools.exact import output, recurrent_step, relative_error
from leapquant.tools.streams import decode_stream


@triton.jit
def kda_step_kernel(state, idx, q, k, v, g, beta, o, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                    BV: tl.constexpr):
    i_nh = tl.program_id(0)
    i_v = tl.program_id(1)
    i_n = i_nh // HV
    i_h = i_nh % HV
    slot = tl.load(idx + i_n).to(tl.int64)
    live = slot >= 0
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    o_nh = i_nh.to(tl.int64)
    m_v = tl.where(live, o_v < V, False)  # not `(o_v < V) & live`: Triton 3.9's interpreter rejects that mask
    m_s = m_v[:, None] & (o_k[None, :] < K)
    # int64: slot * HV * V * K passes 2^31 beyond 4096 slots x 32 heads of 128 x 128
    p_s = state + (slot * HV + i_h) * (V * K) + o_v[:, None] * K + o_k[None, :]
    b_s = tl.load(p_s, mask=m_s, other=0.0)  # [BV, K] fp32
    b_q = tl.load(q + o_nh * K + o_k).to(tl.float32)
    b_k = tl.load(k + o_nh * K + o_k).to(tl.float32)
    b_g = tl.load(g + o_nh * K + o_k).to(tl.float32)
    b_v = tl.load(v + o_nh * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    b_beta = tl.load(beta + o_nh).to(tl.float32)
    b_s = b_s * tl.exp(b_g)[None, :]
    b_p = tl.sum(b_s * b_k[None, :], axis=1)  # [BV] prediction S k
    b_s = b_s + (b_beta * (b_v - b_p))[:, None] * b_k[None, :]
    b_o = tl.sum(b_s * b_q[None, :], axis=1)  # [BV]
    tl.store(p_s, b_s, mask=m_s)
    tl.store(o + o_nh * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)


def kda_step(state: torch.Tensor, idx: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             g: torch.Tensor, beta: torch.Tensor, o: torch.Tensor | None = None, *, BV: int = 32,
             num_warps: int = 4) -> torch.Tensor:
    """One KDA decode step in place on ``state``; returns ``o``.

    Args:
        state: fp32 ``[NS, HV, V, K]`` contiguous, updated in place for the slots of ``idx``.
        idx: int32 ``[N]``, the slot of each row (negative: padding, skipped).
        q, k: ``[N, HV, K]`` (any float dtype; read as fp32); g: log-decays ``[N, HV, K]``; v: ``[N, HV, V]``;
            beta: ``[N, HV]``.
        o: output ``[N, HV, V]`` (default: a new tensor of ``v``'s dtype).
        BV: rows of the state per program (a power of two; rows past V are masked).

    Raises:
        ValueError: a shape, dtype or layout the kernel does not take.
    """
    _, HV, V, K = state.shape
    N = idx.numel()
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError("state must be a contiguous fp32 [NS, HV, V, K] tensor")
    if idx.dtype != torch.int32:
        raise ValueError("idx must be int32")
    for name, t, last in (("q", q, K), ("k", k, K), ("g", g, K), ("v", v, V)):
        if t.shape != (N, HV, last) or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous [{N}, {HV}, {last}], got {list(t.shape)}")
    if beta.shape != (N, HV) or not beta.is_contiguous():
        raise ValueError(f"beta must be contiguous [{N}, {HV}]")
    if K & (K - 1) or BV & (BV - 1):
        raise ValueError("K and BV must be powers of two")
    if o is None:
        o = torch.empty_like(v)
    grid = (N * HV, triton.cdiv(V, BV))
    kda_step_kernel[grid](state, idx, q, k, v, g, beta, o, HV=HV, K=K, V=V, BV=BV, num_warps=num_warps,
                          enable_fp_fusion=True)  # as measured (Triton 3.10's default is off)
    return o


def kda_step_reference(state, idx, q, k, v, g, beta):
    """The step in float64 for the rows of ``idx`` (all real): ``(new states [N, HV, V, K], o [N, HV, V])``, by the
    exact recurrence of the tools (:mod:`leapquant.tools.exact`)."""
    S = recurrent_step(state[idx.long()].to(torch.float64), k, v, g, beta, "kda")
    return S, output(S, q)


def make_inputs(N: int, HV: int, K: int, V: int, gen: torch.Generator, device, act_dtype=torch.bfloat16):
    """Decode-step inputs as a model gives them: one token of the tools' synthetic stream
    (:func:`leapquant.tools.streams.decode_stream`: unit-norm q and k, values, KDA log-decays with memories of 10-1000
    tokens, beta in (0.05, 0.95)); q, k, v in ``act_dtype``, g and beta fp32."""
    x = decode_stream("synthetic", N, HV, K, V, 1, "kda", gen)
    out = {n: t[0].to(act_dtype) if n in ("q", "k", "v") else t[0] for n, t in x.items()}
    return {name: t.to(device).contiguous() for name, t in out.items()}


def check(device, N: int = 3, HV: int = 4, K: int = 128, V: int = 128, BV: int = 32, seed: int = 0) -> dict:
    """The kernel against :func:`kda_step_reference` on a small case with a padding row and a poisoned ``o``:
    relative Frobenius errors of the new states and of ``o``, untouched slots bit for bit. Fresh inputs per seed."""
    gen = torch.Generator().manual_seed(seed)
    NS = 2 * N + 1
    state = torch.randn(NS, HV, V, K, generator=gen).to(device)
    real = (torch.randperm(NS, generator=gen)[:N]).to(torch.int32)
    idx = torch.cat([real[:1], torch.tensor([-1], dtype=torch.int32), real[1:]]).to(device)
    inp = make_inputs(N + 1, HV, K, V, gen, device, act_dtype=torch.float32)
    before = state.clone()
    o = torch.full((N + 1, HV, V), float("nan"), device=device)
    kda_step(state, idx, **inp, o=o, BV=BV)
    rows = torch.tensor([0] + list(range(2, N + 1)), device=device)
    S_ref, o_ref = kda_step_reference(before, idx[rows], *(inp[n][rows] for n in ("q", "k", "v", "g", "beta")))
    S_got = state[idx[rows].long()].to(torch.float64)
    err_s, err_o = (float(relative_error(a, b, None)) for a, b in ((S_got, S_ref), (o[rows], o_ref)))
    others = torch.ones(NS, dtype=torch.bool, device=device)
    others[idx[rows].long()] = False
    untouched = torch.equal(state[others], before[others]) and bool(torch.isnan(o[1]).all())
    # fp32 arithmetic over K = 128 terms: near 1e-7; 1e-5 leaves room for exp() and FMA order, catches any slip
    ok = err_s < 1e-5 and err_o < 1e-5 and untouched
    return {"ok": ok, "err_state": err_s, "err_o": err_o, "untouched": untouched, "N": N, "HV": HV, "K": K, "V": V}


def step_floor_bytes(state: torch.Tensor, inputs: dict, o: torch.Tensor, N: int) -> int:
    """Per (row, head): the ``[V, K]`` state read and written once, plus q, k, g, v, beta read and o written; plus
    ``idx`` per row."""
    per_head = 2 * state[0, 0].numel() * state.element_size()
    per_head += sum(t[0, 0].numel() * t.element_size() for t in inputs.values())
    per_head += o[0, 0].numel() * o.element_size()
    HV = state.shape[1]
    return N * HV * per_head + N * 4


def run_worker(mode: str, device: torch.device, deadline: float, record) -> None:
    """Copy bandwidth, the step's float64 check, then the step's timing (CUDA graph replays) per BV."""
    from .flush import plan
    from .timing import capture, copy_bandwidth, device_info, module_version, time_replays

    record(kind="env", backend="step", **device_info(device), triton=module_version("triton"))
    cuda = device.type == "cuda"
    try:
        bw = copy_bandwidth(device, (1 << 30) if cuda else (16 << 20))
        record(kind="bandwidth", **bw)
        print(f"[copy] {bw['buffer_bytes'] / 2**30:.2f} GiB buffer copied: {bw['GBps']:.0f} GB/s (read + written, "
              f"median of {bw['replays']})", flush=True)
    except Exception as e:
        record(kind="bandwidth", error=f"{type(e).__name__}: {e}"[:600])
        print(f"[copy] ERROR {type(e).__name__}: {e}", flush=True)

    try:
        chk = check(device, **({} if cuda else {"N": 2, "HV": 2, "K": 64, "V": 64}))
        record(kind="step_check", **chk)
        print(f"[step] check vs float64: state err {chk['err_state']:.2e}, o err {chk['err_o']:.2e}, untouched "
              f"{chk['untouched']} -> {'ok' if chk['ok'] else 'FAILED'}", flush=True)
    except Exception as e:
        record(kind="step_check", ok=False, error=f"{type(e).__name__}: {e}"[:600])
        print(f"[step] check ERROR {type(e).__name__}: {e}", flush=True)

    plan_ = plan(mode)
    HV, N = plan_.amortise
    K, V = plan_.head_k, plan_.head_v
    configs = [(16, 4), (32, 4), (64, 4), (64, 8)] if cuda else [(32, 4)]
    gen = torch.Generator().manual_seed(1)
    try:
        NS = N + 1
        state = (0.1 * torch.randn(NS, HV, V, K, generator=gen)).to(device)
        idx = (torch.randperm(N, generator=gen) + 1).to(torch.int32).to(device)
        inp = make_inputs(N, HV, K, V, gen, device)
        o = torch.empty_like(inp["v"])
        floor = step_floor_bytes(state, inp, o, N)
    except Exception as e:
        record(kind="step", status="error", reason=f"{type(e).__name__}: {e}"[:600])
        print(f"[step] setup ERROR {type(e).__name__}: {e}", flush=True)
        return
    for BV, warps in configs:
        if time.time() > deadline - 2:
            record(kind="step", status="skipped", BV=BV, num_warps=warps, reason="time budget spent")
            continue
        try:
            def fn(BV=BV, warps=warps):
                kda_step(state, idx, **inp, o=o, BV=BV, num_warps=warps)

            fn()
            run = capture(fn, device)
            # the step updates the state in place, as decoding does: no restore between replays
            tm = time_replays(run, lambda: None, device, budget_s=1.0 if cuda else 0.1, min_reps=10 if cuda else 2,
                              max_reps=200 if cuda else 2, warmup=3 if cuda else 1)
            record(kind="step", status="ok", batch=N, heads=HV, head_k=K, head_v=V, BV=BV, num_warps=warps,
                   floor_bytes=floor, **tm.as_dict())
            print(f"[step] {N} x {HV} heads, BV={BV}, {warps} warps: {tm.median * 1e6:.1f} us (median of {tm.n})",
                  flush=True)
        except Exception as e:
            record(kind="step", status="error", BV=BV, num_warps=warps, reason=f"{type(e).__name__}: {e}"[:600])
            print(f"[step] BV={BV} ERROR {type(e).__name__}: {e}", flush=True)
