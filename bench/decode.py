"""Decode benchmark: ``leapquant.step`` against FLA's fused recurrent step on an in-place state pool, for KDA and GDN,
both pool layouts, and over batch sizes.

    python -m bench.decode                   # on a GPU: KDA and GDN, 256 sequences x 32 heads, K = V = 128, ring 16,
                                             # then the batch sweep 1-512 (about 2-3 minutes on an H200)
    python -m bench.decode --cpu-smoke       # the same path on the CPU: tiny sizes, the reference backend, no FLA
    python -m bench.decode --baseline DIR    # also LeapQuant's cases under DIR's packages, in the same run

Writes ``<out>/decode_<device>.json``, ``.md`` and ``.png`` (the sweep's plot; without matplotlib the numbers are still
written and the JSON says why there is no plot). Every case is captured in a CUDA graph and replayed (before each
replay, outside the timed region: the fill counts and rings the step changes are restored, L2 is evicted); medians
after warm-up, each beside its floor = the bytes it must move over the copy bandwidth measured in the same run. The
JSON and the markdown are also written after each gate and each sweep, so a run stopped from outside keeps what it
measured.

Setup, per gate and batch B: a pool of 2 B + 1 slots (slot 0 the null slot) with the batch's rows at B distinct slots
in random order, as in an engine, whose pool outnumbers its batch and whose rows do not come in slot order; FLA's
state pools have the same slots and the same ``idx``. q, k, v bf16; g, beta fp32; o bf16.

Cases, one table per gate:

* ``step fill f``: ``leapquant.step`` on an engine-layout pool (``Pool(..., layout="engine")``) with every ring holding
  ``f - 1`` entries, so the token lands at entry ``f - 1`` and the step reads ``f - 1`` entries (f = 1, 8, 15; no ring
  full);
* ``decode layer``: the steady state of a ring of L = 16: 1/16 of the heads' rings full (flushed inside the step),
  the others spread evenly over fills 1..15;
* ``flush in layer``: ``leapquant.flush`` alone at the decode layer's fills (the flush inside its step), floor the
  due rings' flush bytes; ``flush, none due``: the same call with no ring full (every ring holding 7 entries), the
  flush's fixed part (its due list and the programs that find nothing), floor the fill counts read; engine layout;
* ``verify T=4 (fill 8)``, ``verify T=8 (fill 8)``: a speculative decoding verify, T draft tokens per row in one
  ``leapquant.step`` call (SPEC §6.1), every ring holding 7 entries (no flush inside); engine layout only;
* ``step fill 8 (compact)``, ``decode layer (compact)``: the same on a compact-layout pool (``layout="compact"``)
  holding the same bytes (copied view by view from the engine pool). The floor counts the checkpoint's own bytes,
  ``pool.geometry.checkpoint_bytes`` (codes, scales, factors: 19,456 B at 128 x 128, rank 4), in both layouts: the
  compact layout only rounds each checkpoint up to 128 B, padding no kernel reads (none at 128 x 128);
* ``packed fill 8``, ``packed fill 8, gates apart``: ``leapquant.step_packed`` (vLLM's packed decode call) at fill
  8, from the packed ``mixed_qkv`` with q and k l2-normalised in the kernel and the raw gate inputs (``a``, ``b``
  bf16), the gates computed in the step kernel, then (``fused=False``) apart in a launch of their own into a
  workspace; the floor reads ``a`` and ``b`` in bf16 in the places of the step's fp32 ``g`` and ``beta``;
* ``packed verify T=4 (fill 8)``, ``packed verify T=4 (fill 8), gates apart``: the same for the verify's four tokens
  a row (``mixed_qkv [B, T, D]``);
* ``fla fp32`` / ``fla bf16``: FLA's ``fused_recurrent_kda_fwd`` with the state updated in place in a slot pool of
  that dtype (``inplace_final_state``, ``ssm_state_indices``, ``state_v_first``), what engines run today. FLA 0.6's
  ``fused_recurrent_gated_delta_rule`` has no in-place slot-pool mode, so GDN's anchor is the same KDA call fed GDN's
  scalar log-gate broadcast over K as a materialised ``[B, 1, HV, K]`` copy, made once before timing: the kernel
  addresses ``g`` as a contiguous tensor and ignores its strides, so an ``expand()`` view (stride 0 over K) would be
  read past its storage (NaN outputs when tried). Its floor counts the K gate floats the kernel reads, as KDA's
  (512 B per head, 0.8 % of a bf16 state's traffic).

Bounds (issue 38), per gate and layout, each marked met or missed in the markdown: step fill 8 <= 1.5x its floor;
decode layer <= 1.15x step fill 8, <= 0.3x fla fp32, <= 0.5x fla bf16.

Batch sweep: the decode layer (engine layout, 1/16 of the rings full) against ``fla fp32`` and ``fla bf16`` at
batches 1, 2, ..., 512 (``--sweep``), 32 heads, each point on its own pool of 2 B + 1 slots; KDA first, then GDN.
Cases there have ``--sweep-budget`` seconds of replays (0.3 s: a replay with its restore and L2 eviction takes well
under 1.5 ms on an H200, so there the cap of 200 replays binds first, as for the main cases' 2 s). No sweep point
starts after ``--time-limit`` seconds (240 s): the rest are listed as skipped with the reason, so the run stays near
4 minutes whatever the machine.

``--baseline DIR``: DIR holds another version's ``leapquant``, ``leapquant_triton`` and ``leapquant_tilelang``
packages (as for ``python -m bench --baseline``); LeapQuant's cases (not the sweep) are then timed again with those
packages first on the path, in a subprocess right after this tree's, as ``<case>@baseline`` rows beside their own
floor. A baseline whose ``Pool`` takes no ``layout`` runs the engine-layout cases and lists the compact ones as
skipped.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

import leapquant

from .flush import program_bytes
from .timing import capture, copy_bandwidth, device_info, device_slug, module_version, nvidia_smi, time_replays

GATES = ("kda", "gdn")
FILLS = (1, 8, 15)
COMPACT_FILLS = (8,)
FLA_CASES = ("fla fp32", "fla bf16")
SWEEP = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
CPU_SWEEP = (1, 2, 4)
# issue 38's bounds: (case, what it is divided by, at most); per layout, the LeapQuant names take the layout's suffix
# and issue 36's: a verify of VERIFY_T tokens per row at most 1.6x a one-token step
VERIFY_T = 4
VERIFY = f"verify T={VERIFY_T} (fill 8)"
# and a longer draft (no bound): the Gluon kernel takes it in two launches of four tokens (docs/DESIGN.md)
VERIFY_LONG_T = 8
VERIFY_LONG = f"verify T={VERIFY_LONG_T} (fill 8)"
# step_packed at fill 8 (one launch, the gates in the step kernel; then the gates apart, in a launch of their own),
# one token a row and VERIFY_T
PACKED_CASES = ("packed fill 8", "packed fill 8, gates apart")
PACKED_VERIFY = (f"packed verify T={VERIFY_T} (fill 8)", f"packed verify T={VERIFY_T} (fill 8), gates apart")
# the sweep's small batches as an engine steps them: L steps per sequence, each sequence's rings flushed once
CYCLE = "decode cycle"
# where the decode layer's time goes: its flush alone (the layer's fills, 1/16 of the rings full), and a flush call
# that finds nothing due (its fixed part: the due list and the programs that return at once); engine layout
LAYER_FLUSH = "flush in layer"
FLUSH_NONE = "flush, none due"
BOUNDS = (("step fill 8", "floor", 1.5), ("decode layer", "step fill 8", 1.15), ("decode layer", "fla fp32", 0.3),
          ("decode layer", "fla bf16", 0.5), (VERIFY, "step fill 8", 1.6))
BOUNDS_TEXT = ("step fill 8 <= 1.5x its floor; decode layer <= 1.15x step fill 8, <= 0.3x fla fp32, "
               f"<= 0.5x fla bf16; {VERIFY} <= 1.6x step fill 8")
SUFFIX = {"engine": "", "compact": " (compact)"}


class Unsupported(Exception):
    """A case this tree's packages cannot run (a --baseline tree from before the compact layout): listed as
    skipped, never as an error."""


def step_bytes(pool: leapquant.Pool, entries_read: int, key_heads: int, in_size: int, out_size: int) -> int:
    """What one (row, value head) of a decode step must move: the checkpoint and the ``entries_read`` ring entries
    in use read, the new entry and the gate state written, the token's inputs read and the output written (q and k
    counted once per key head)."""
    K, V, L = pool.head_k, pool.head_v, pool.ring
    kda = pool.gate == "kda"
    per_entry = 2 * K + 2 * V + 4 + (2 * K if kda else 0)  # kbuf, ubuf, w, gbuf
    checkpoint = pool.geometry.checkpoint_bytes
    gate_state = 2 * (4 * K if kda else 4) + 2 * 4  # pcum and hcnt, read and written
    written = per_entry + (4 * entries_read if not kda else 0)  # GDN rewrites the decayed weights
    inputs = 2 * K * in_size * key_heads / pool.heads + V * in_size + (4 * K if kda else 4) + 4
    return int(checkpoint + entries_read * per_entry + gate_state + written + inputs + V * out_size)


def packed_bytes(pool: leapquant.Pool, entries_read: int, key_heads: int) -> int:
    """:func:`step_bytes` of a ``step_packed`` call with bf16 tokens: the raw gate inputs ``a`` and ``b`` (bf16) read
    in the places of ``g`` and ``beta`` (fp32); ``A_log`` and ``dt_bias``, one per head, are not counted."""
    gate = pool.head_k if pool.gate == "kda" else 1
    return step_bytes(pool, entries_read, key_heads, 2, 2) - 2 * (gate + 1)


def packed_verify_bytes(pool: leapquant.Pool, entries_read: int, tokens: int, key_heads: int) -> int:
    """:func:`verify_bytes` of a ``step_packed`` call of ``tokens`` tokens a row with bf16 tokens: each token's raw
    gate inputs ``a`` and ``b`` (bf16) read in the places of its ``g`` and ``beta`` (fp32)."""
    gate = pool.head_k if pool.gate == "kda" else 1
    return verify_bytes(pool, entries_read, tokens, key_heads) - tokens * 2 * (gate + 1)


def verify_bytes(pool: leapquant.Pool, entries_read: int, tokens: int, key_heads: int) -> int:
    """What a step of ``tokens`` tokens per (row, value head) must move: one token's step, and for each further token
    its inputs and output and the entry it writes (the checkpoint and the older entries are read once)."""
    K, V = pool.head_k, pool.head_v
    kda = pool.gate == "kda"
    per_entry = 2 * K + 2 * V + 4 + (2 * K if kda else 0)
    inputs = 2 * K * 2 * key_heads / pool.heads + V * 2 + (4 * K if kda else 4) + 4
    return int(step_bytes(pool, entries_read, key_heads, 2, 2) + (tokens - 1) * (per_entry + inputs + V * 2))


def layer_bytes(pool: leapquant.Pool, fills: torch.Tensor, key_heads: int) -> int:
    """What a decode layer moves at ``fills [B, HV]`` ring entries per head (L: a full ring, flushed inside, after
    which the step reads no entry): each head's step and each full ring's flush."""
    L = pool.ring
    counts = torch.bincount(fills.flatten().long(), minlength=L + 1)
    steps = sum(int(counts[f]) * step_bytes(pool, f % L, key_heads, 2, 2) for f in range(L + 1))
    return steps + int(counts[L]) * program_bytes(pool)["total"]


def fla_bytes(HV: int, H: int, K: int, V: int, state_size: int, in_size: int, out_size: int, gate_floats: int) -> int:
    """What one (row, value head) of FLA's in-place step must move: the state read and written, the inputs (the gate
    as ``gate_floats`` fp32 values) and the output."""
    return int(2 * V * K * state_size + 2 * K * in_size * H / HV + V * in_size + 4 * gate_floats + 4
               + V * out_size)


def _inputs(B, H, HV, K, V, gate, device, gen):
    q = torch.randn(B, H, K, generator=gen).to(device, torch.bfloat16)
    k = torch.nn.functional.normalize(torch.randn(B, H, K, generator=gen), dim=-1).to(device, torch.bfloat16)
    v = torch.randn(B, HV, V, generator=gen).to(device, torch.bfloat16)
    g = (-0.05 * torch.rand(*((B, HV, K) if gate == "kda" else (B, HV)), generator=gen)).to(device)
    beta = torch.rand(B, HV, generator=gen).to(device)
    return q, k, v, g, beta


def _fills(pool, slots, fill_of_head):
    """hcnt of ``slots`` set from ``fill_of_head [B, HV]`` (a fill of L: a full ring), entries past it emptied."""
    L = pool.ring
    pool.hcnt[slots] = fill_of_head.to(torch.int32).to(pool.device)
    past = torch.arange(L, device=pool.device) >= fill_of_head.to(pool.device)[..., None]
    pool.w[slots] = torch.where(past, torch.zeros_like(pool.w[slots]), pool.w[slots])
    if pool.gbuf is not None:
        pool.gbuf[slots] = torch.where(past[..., None], torch.ones_like(pool.gbuf[slots]), pool.gbuf[slots])


def _fill_and_name():
    """``fill`` and a function naming the step's backend, from this tree or a --baseline tree older than them."""
    try:
        from leapquant.tools.workloads import fill
    except ImportError:
        from leapquant.workloads import fill
    try:
        leapquant.select(leapquant.Pool(2, 1, 64, 64), "auto", op="step")
        return fill, lambda pool, backend: leapquant.select(pool, backend, op="step").name
    except TypeError:
        return fill, lambda pool, backend: leapquant.ops.select_step(pool, backend).name


def make_pool(num_slots: int, heads: int, head_dim: int, gate: str, layout: str, device) -> leapquant.Pool:
    """``leapquant.Pool(..., layout=layout)``, the layout always named (the default may change); a tree whose ``Pool``
    takes no ``layout`` (before the compact layout) makes the engine layout and raises :class:`Unsupported` for the
    compact one."""
    if "layout" in inspect.signature(leapquant.Pool).parameters:
        return leapquant.Pool(num_slots, heads, head_dim, head_dim, gate=gate, device=device, layout=layout)
    if layout != "engine":
        raise Unsupported(f"this tree's Pool takes no layout, so no {layout} layout")
    return leapquant.Pool(num_slots, heads, head_dim, head_dim, gate=gate, device=device)


@dataclass
class Setup:
    """One batch: the engine-layout pool, the rows' slots (CPU) and ``idx``, the token's inputs, the output buffer and
    the decode layer's fills ``[B, HV]`` (entries per head, L for a full ring)."""

    pool: leapquant.Pool
    slots: torch.Tensor
    idx: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    out: torch.Tensor
    layer_fills: torch.Tensor
    key_heads: int


def setup(device, batch: int, heads: int, key_heads: int, head_dim: int, gate: str, seed: int = 0) -> Setup:
    """``batch`` rows at distinct random slots of an engine-layout pool of ``2 batch + 1`` slots, filled with
    checkpoints and rings of the Gaussian regime."""
    fill, _ = _fill_and_name()
    gen = torch.Generator().manual_seed(seed)
    B, HV, H = batch, heads, key_heads
    pool = make_pool(2 * B + 1, HV, head_dim, gate, "engine", device)
    K, V, L = pool.head_k, pool.head_v, pool.ring
    slots = torch.randperm(2 * B, generator=gen)[:B] + 1
    fill(pool, slots, "gaussian", gen)
    q, k, v, g, beta = _inputs(B, H, HV, K, V, gate, device, gen)
    out = torch.empty(B, HV, V, dtype=torch.bfloat16, device=device)
    # steady state: 1/16 of the rings full, the rest spread evenly over 1 .. L - 1 entries
    order = torch.randperm(B * HV, generator=gen)
    fills = (order % L).reshape(B, HV)  # 0 .. L-1 entries; 0 stands for a full ring (L)
    fills = torch.where(fills == 0, torch.full_like(fills, L), fills)
    return Setup(pool, slots, slots.to(torch.int32).to(device), q, k, v, g, beta, out, fills, H)


def compact_twin(s: Setup) -> leapquant.Pool:
    """A compact-layout pool of the same geometry holding the same bytes in the batch's slots, view by view."""
    p = s.pool
    c = make_pool(p.num_slots, p.heads, p.head_k, p.gate, "compact", p.device)
    at = s.slots.to(p.device)
    for name in ("codes", "s_kv", "uq", "kbuf", "ubuf", "w", "pcum", "gbuf", "hcnt"):
        src = getattr(p, name)
        if src is not None:
            getattr(c, name)[at] = src[at]
    return c


class Timer:
    """Times one case: run once eagerly (compiles), captured, replayed for ``budget_s`` (``reps`` bounds); the row
    holds the median beside the floor of ``nbytes`` at the run's copy bandwidth."""

    def __init__(self, device: torch.device, bandwidth: dict, budget_s: float, label: str = ""):
        self.device, self.budget_s, self.label = device, budget_s, label
        self.bps = bandwidth["GBps"] * 1e9
        cuda = device.type == "cuda"
        self.reps, self.warmup = ((10, 200), 3) if cuda else ((1, 3), 1)

    def __call__(self, name: str, fn, restore, nbytes: int, **extra) -> dict:
        restore()
        fn()  # compiles, outside the capture, on the case's own state
        restore()
        graph = capture(fn, self.device)
        t = time_replays(graph, restore, self.device, budget_s=self.budget_s, min_reps=self.reps[0],
                         max_reps=self.reps[1], warmup=self.warmup)
        floor_us = nbytes / self.bps * 1e6
        row = {"case": name, "status": "ok", "median_us": t.median * 1e6, "p20_us": t.p20 * 1e6,
               "p80_us": t.p80 * 1e6, "replays": t.n, "floor_us": floor_us, "x_floor": t.median * 1e6 / floor_us,
               "bytes": nbytes, **extra}
        print(f"{self.label}{name:<24} {row['median_us']:9.1f} us  floor {floor_us:7.1f} us  x{row['x_floor']:.2f}",
              flush=True)
        return row


def _failed(name: str, e: BaseException, **extra) -> dict:
    if isinstance(e, Unsupported):
        return {"case": name, "status": "skipped", "reason": str(e), **extra}
    traceback.print_exc()
    return {"case": name, "status": "error", "reason": f"{type(e).__name__}: {e}"[:500], **extra}


def _attempt(name: str, run, **extra) -> dict:
    """``run()``'s row, or a row saying why there is none: one case's failure costs that case only."""
    try:
        return run()
    except Exception as e:
        return _failed(name, e, **extra)


def leapquant_rows(timer: Timer, s: Setup, backend: str, fills=FILLS, compact: bool = True,
                   verify: bool = True) -> list[dict]:
    """``step fill f`` for each of ``fills`` and ``decode layer`` on the engine layout, then (``verify``) the layer's
    flush alone, the verify and the packed calls, then (``compact``) ``step fill 8 (compact)`` and ``decode layer
    (compact)``."""
    _, step_backend = _fill_and_name()
    rows, pools = [], {}
    # every pool made before anything is timed: the compact twin copies the bytes the engine pool was filled with
    for layout in ("engine", "compact") if compact else ("engine",):
        try:
            pools[layout] = s.pool if layout == "engine" else compact_twin(s)
        except Exception as e:
            pools[layout] = e
    for layout, pool in pools.items():
        sfx = SUFFIX[layout]
        case_fills = fills if layout == "engine" else COMPACT_FILLS
        names = [f"step fill {f}{sfx}" for f in case_fills] + [f"decode layer{sfx}"]
        try:
            if isinstance(pool, Exception):
                raise pool
            chosen = step_backend(pool, backend)
        except Exception as e:
            rows += [_failed(n, e, layout=layout) for n in names]
            continue
        B, HV, H = s.idx.numel(), pool.heads, s.key_heads
        step = lambda p=pool: leapquant.step(p, s.idx, s.q, s.k, s.v, s.g, s.beta, out=s.out,  # noqa: E731
                                             backend=backend, check=False)
        saved = {n: getattr(pool, n).clone() for n in ("hcnt", "w", "pcum", "gbuf") if getattr(pool, n) is not None}

        def restorer(fill_of_head, pool=pool, saved=saved):
            # on the pool's device once: a host tensor would be copied over before every replay
            fill_of_head, at = fill_of_head.to(pool.device), s.idx.long()

            def restore():
                for n, t in saved.items():
                    getattr(pool, n).copy_(t)
                _fills(pool, at, fill_of_head)
            return restore

        for f, name in zip(case_fills, names):
            rows.append(_attempt(name, lambda f=f, name=name, pool=pool, step=step: timer(
                name, step, restorer(torch.full((B, HV), f - 1)), B * HV * step_bytes(pool, f - 1, H, 2, 2),
                fill=f, layout=layout, backend=chosen), layout=layout))
        due = int((s.layer_fills == pool.ring).sum())
        rows.append(_attempt(names[-1], lambda name=names[-1], pool=pool, step=step: timer(
            name, step, restorer(s.layer_fills), layer_bytes(pool, s.layer_fills, H), due=due, layout=layout,
            backend=chosen), layout=layout))
        if layout == "engine" and verify:
            flush = lambda p=pool: leapquant.flush(p, s.idx, backend=backend, check=False)  # noqa: E731
            rows.append(_attempt(LAYER_FLUSH, lambda pool=pool, flush=flush: timer(
                LAYER_FLUSH, flush, restorer(s.layer_fills), due * program_bytes(pool)["total"], due=due,
                layout=layout, backend=leapquant.select(pool, backend).name), layout=layout))
            # nothing due: the floor is the fill counts read
            rows.append(_attempt(FLUSH_NONE, lambda pool=pool, flush=flush: timer(
                FLUSH_NONE, flush, restorer(torch.full((B, HV), 7)), B * HV * 4, due=0, layout=layout,
                backend=leapquant.select(pool, backend).name), layout=layout))
            for name, T in ((VERIFY, VERIFY_T), (VERIFY_LONG, VERIFY_LONG_T)):
                rows.append(_attempt(name, lambda name=name, T=T, pool=pool, restorer=restorer: _verify(
                    timer, s, pool, backend, restorer, T, name), layout=layout))
            for names, T in ((PACKED_CASES, 1), (PACKED_VERIFY, VERIFY_T)):
                for name, fused in zip(names, (True, False)):
                    rows.append(_attempt(name, lambda name=name, fused=fused, pool=pool, restorer=restorer, T=T:
                                         _packed(timer, name, fused, s, pool, backend, restorer, T),
                                         layout=layout))
    return rows


def _packed(timer, name: str, fused: bool, s, pool, backend: str, restorer, T: int = 1) -> dict:
    """:data:`PACKED_CASES` (T = 1) and :data:`PACKED_VERIFY`: ``leapquant.step_packed`` at fill 8 from vLLM's packed
    projection (``mixed_qkv``, q and k l2-normalised in the kernel) and the raw gate inputs (``a``, ``b`` bf16;
    ``A_log``, ``dt_bias`` fp32), T tokens a row (the step's token, repeated, as the verify's), the gates computed in
    the step kernel (``fused``) or apart, into a workspace, before it."""
    if not hasattr(leapquant, "step_packed") or (not fused and not _takes_fused()):
        raise Unsupported("this tree's step_packed computes its gates apart only")
    B, HV, H, K = s.idx.numel(), pool.heads, s.key_heads, pool.head_k
    gen = torch.Generator().manual_seed(2)
    mixed = torch.cat([x.flatten(1) for x in (s.q, s.k, s.v)], 1)
    kda = pool.gate == "kda"
    a = torch.randn(*((B, HV, K) if kda else (B, HV)), generator=gen).to(mixed.device, torch.bfloat16)
    b = torch.randn(B, HV, generator=gen).to(mixed.device, torch.bfloat16)
    out = s.out
    if T > 1:
        mixed, a, b = (x[:, None].expand(x.shape[0], T, *x.shape[1:]).contiguous() for x in (mixed, a, b))
        out = torch.empty(B, T, HV, pool.head_v, dtype=s.out.dtype, device=s.out.device)
    A_log = torch.full((HV,), math.log(0.05), device=mixed.device)
    dt_bias = torch.zeros(HV * K if kda else HV, device=mixed.device)
    ws = leapquant.packed_workspace(pool, B * T)
    kw = dict(fused=fused) if _takes_fused() else {}
    step = lambda: leapquant.step_packed(pool, s.idx, mixed, a, b, A_log=A_log, dt_bias=dt_bias,  # noqa: E731
                                         use_qk_l2norm=True, out=out, workspace=ws, backend=backend, check=False,
                                         **kw)
    nbytes = packed_bytes(pool, 7, H) if T == 1 else packed_verify_bytes(pool, 7, T, H)
    return timer(name, step, restorer(torch.full((B, HV), 7)), B * HV * nbytes, fill=8, fused=fused, tokens=T,
                 layout="engine", backend=leapquant.select(pool, backend, op="step").name)


def _takes_fused() -> bool:
    """Whether this tree's ``step_packed`` has the ``fused`` switch."""
    return "fused" in inspect.signature(leapquant.step_packed).parameters


def cycle_fills(B: int, HV: int, L: int) -> torch.Tensor:
    """Fills ``[B, HV]`` for :data:`CYCLE`: every head of a sequence at one fill (an engine steps a sequence's heads
    together), the sequences' phases spread evenly over 1 .. L (L: a full ring, flushed on the first step)."""
    phase = (torch.arange(B) * L) // B  # 0 .. L - 1
    return (L - phase)[:, None].expand(B, HV).clone()


def cycle_row(timer: Timer, s: Setup, backend: str) -> dict:
    """:data:`CYCLE`: L consecutive ``leapquant.step`` calls in one graph from :func:`cycle_fills`, so every sequence's
    rings fill and are flushed once; the row holds the time per step and the floor of the L steps' bytes over L."""
    pool = s.pool
    B, HV, L = s.idx.numel(), pool.heads, pool.ring
    fills = cycle_fills(B, HV, L)

    def run():
        for _ in range(L):
            leapquant.step(pool, s.idx, s.q, s.k, s.v, s.g, s.beta, out=s.out, backend=backend, check=False)
    saved = {n: getattr(pool, n).clone() for n in ("hcnt", "w", "pcum", "gbuf") if getattr(pool, n) is not None}
    at, dev_fills = s.idx.long(), fills.to(pool.device)

    def restore():
        for n, t in saved.items():
            getattr(pool, n).copy_(t)
        _fills(pool, at, dev_fills)
    # step i sees every ring one entry fuller (a ring past L was flushed on the step before and holds one)
    nbytes = sum(layer_bytes(pool, (fills - 1 + i) % L + 1, s.key_heads) for i in range(L))
    row = timer(CYCLE, run, restore, nbytes, due=B * HV // L if B >= L else None, steps=L)
    for key in ("median_us", "p20_us", "p80_us", "floor_us"):
        row[key] /= L
    return row


def _verify(timer, s, pool, backend: str, restorer, T: int, name: str) -> dict:
    """``VERIFY`` / ``VERIFY_LONG``: ``T`` draft tokens per row in one call (speculative decoding, SPEC §6.1), every
    ring holding 7 entries (no flush inside: T <= 9 at L = 16); the tokens are the step's, repeated (their values do
    not change the work)."""
    B, HV = s.idx.numel(), pool.heads
    if not hasattr(leapquant, "accept"):
        raise Unsupported("this tree's step takes one token per row")
    if 7 + T > pool.ring:
        raise Unsupported(f"{T} tokens after 7 entries do not fit a ring of {pool.ring}")
    many = [x[:, None].expand(x.shape[0], T, *x.shape[1:]).contiguous() for x in (s.q, s.k, s.v, s.g, s.beta)]
    out = torch.empty(B, T, HV, pool.head_v, dtype=s.out.dtype, device=s.out.device)
    step = lambda: leapquant.step(pool, s.idx, *many, out=out, backend=backend, check=False)  # noqa: E731
    return timer(name, step, restorer(torch.full((B, HV), 7)), B * HV * verify_bytes(pool, 7, T, s.key_heads),
                 fill=8, tokens=T, layout="engine",
                 backend=leapquant.select(pool, backend, op="step_tokens").name)


def fla_step(s: Setup, state: torch.Tensor, out: torch.Tensor):
    """FLA's in-place slot-pool step on ``s``'s rows as a callable: ``state [NS, HV, V, K]`` (fp32 or bf16) updated in
    place at ``s.idx``, ``out [B, 1, HV, V]`` written. GDN's scalar gate is broadcast over K as a materialised copy,
    made here, outside anything timed (the module's docstring says why not a view)."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    B, HV, K = s.idx.numel(), s.pool.heads, s.pool.head_k
    g = s.g if s.pool.gate == "kda" else s.g[..., None].expand(B, HV, K).contiguous()
    args = [t.unsqueeze(1) for t in (s.q, s.k, s.v, g, s.beta)]  # FLA's [B, T = 1, ...]
    return lambda: fused_recurrent_kda_fwd(*args, initial_state=state, inplace_final_state=True, state_v_first=True,
                                           ssm_state_indices=s.idx, out=out)


def fla_rows(timer: Timer, s: Setup) -> list[dict]:
    """``fla fp32`` and ``fla bf16``: :func:`fla_step` on a state pool of that dtype with ``s.pool``'s slots."""
    pool, device = s.pool, s.idx.device
    B, HV, H, K, V = s.idx.numel(), pool.heads, s.key_heads, pool.head_k, pool.head_v
    out = torch.empty(B, 1, HV, V, dtype=torch.bfloat16, device=device)
    gen = torch.Generator(device=device).manual_seed(1)
    rows = []
    for name, dt in zip(FLA_CASES, (torch.float32, torch.bfloat16)):
        def one(name=name, dt=dt):
            state = torch.randn(pool.num_slots, HV, V, K, generator=gen, device=device).mul_(0.05).to(dt)
            nbytes = B * HV * fla_bytes(HV, H, K, V, state.element_size(), 2, 2, K)
            return timer(name, fla_step(s, state, out), lambda: None, nbytes, state_dtype=str(dt)[6:])
        rows.append(_attempt(name, one))
    return rows


def _memory(gate: str, heads: int, head_dim: int, ring: int, rank: int) -> dict | None:
    """Bytes per sequence of each format (:func:`leapquant.memory.formats`), or None in a tree without it."""
    try:
        from leapquant.memory import formats
    except ImportError:
        return None
    keys = ("fp32", "bf16", "leapquant_engine", "leapquant_compact")
    return {k: f.per_sequence for k, f in zip(keys, formats(heads, head_dim, head_dim, ring, rank, gate))}


def _planned(with_fla: bool) -> list[str]:
    return ([f"step fill {f}" for f in FILLS] + ["decode layer", LAYER_FLUSH, FLUSH_NONE, VERIFY, VERIFY_LONG,
                                                 *PACKED_CASES, *PACKED_VERIFY]
            + [f"step fill {f} (compact)" for f in COMPACT_FILLS]
            + ["decode layer (compact)"] + (list(FLA_CASES) if with_fla else []))


def gate_section(timer: Timer, device, gate: str, batch: int, heads: int, key_heads: int, head_dim: int,
                 backend: str, with_fla: bool) -> dict:
    """One gate's table: every LeapQuant case and FLA's anchors, the bounds, the bytes per sequence."""
    t0 = time.time()
    geo = {"batch": batch, "heads": heads, "key_heads": key_heads, "head_k": head_dim, "head_v": head_dim,
           "ring": None, "rank": None, "pool_slots": 2 * batch + 1}
    try:
        s = setup(device, batch, heads, key_heads, head_dim, gate)
    except Exception as e:
        rows = [_failed(n, e) for n in _planned(with_fla)]
    else:
        geo.update(ring=s.pool.ring, rank=s.pool.rank)
        rows = leapquant_rows(timer, s, backend) + (fla_rows(timer, s) if with_fla else [])
        del s
    backends = {r["layout"]: r["backend"] for r in rows if r.get("backend")}
    memory = _memory(gate, heads, head_dim, geo["ring"], geo["rank"]) if geo["ring"] else None
    return {"gate": gate, **geo, "backend": backends, "cases": rows, "bounds": bounds(rows),
            "memory_per_sequence": memory, "seconds": round(time.time() - t0, 1)}


def sweep_rows(timer: Timer, device, gate: str, batches, heads: int, key_heads: int, head_dim: int, backend: str,
               with_fla: bool, deadline: float) -> list[dict]:
    """``decode layer`` (engine layout) and FLA's anchors at each batch; a point not started by ``deadline`` (epoch
    seconds) is listed as skipped."""
    rows = []
    names = ["decode layer"] + (list(FLA_CASES) if with_fla else [])
    for B in batches:
        if time.time() > deadline:
            rows += [{"batch": B, "case": n, "status": "skipped", "reason": "not started: the run passed its time "
                      "limit (--time-limit)"} for n in names]
            continue
        try:
            s = setup(device, B, heads, key_heads, head_dim, gate, seed=B)
        except Exception as e:
            rows += [dict(_failed(n, e), batch=B) for n in names]
            continue
        timer.label = f"{gate} B={B:<4} "
        point = leapquant_rows(timer, s, backend, fills=(), compact=False, verify=False)
        if B < s.pool.ring:  # from L sequences on, the layer has as many full rings per step as an engine
            point.append(_attempt(CYCLE, lambda: cycle_row(timer, s, backend)))
        point += fla_rows(timer, s) if with_fla else []
        rows += [{"batch": B, **r} for r in point]
        del s, point
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the next point's pools are larger: give back this one's
    timer.label = ""
    return rows


def bounds(rows: list[dict]) -> list[dict]:
    """Issue 38's bounds (:data:`BOUNDS`) for each layout from one gate's rows: the ratio, the bound and whether it
    is met (None, with the reason, where a case is missing)."""
    t = {r["case"]: r for r in rows if r.get("status") == "ok"}
    out = []
    for layout, sfx in SUFFIX.items():
        for case, against, bound in BOUNDS:
            if case == VERIFY and layout != "engine":  # timed on the engine layout only
                continue
            num = case + sfx
            den = against if against == "floor" or against.startswith("fla") else against + sfx
            row = {"layout": layout, "case": num, "against": den, "bound": bound, "ratio": None, "met": None}
            if num not in t or (den != "floor" and den not in t):
                row["reason"] = " and ".join(n for n in (num, den) if n != "floor" and n not in t) + " not timed"
            else:
                row["ratio"] = t[num]["x_floor"] if den == "floor" else t[num]["median_us"] / t[den]["median_us"]
                row["met"] = row["ratio"] <= bound
            out.append(row)
    return out


def run(device: torch.device, *, gates=GATES, batch: int = 256, heads: int = 32, key_heads: int | None = None,
        head_dim: int = 128, backend: str = "auto", budget_s: float = 2.0, sweep=SWEEP, sweep_budget_s: float = 0.3,
        with_fla: bool = True, time_limit_s: float = 240.0, on_progress=None) -> dict:
    """Every gate's table, then the sweep (``sweep`` batches, empty for none); ``on_progress(doc)`` after each."""
    t0 = time.time()
    key_heads = key_heads or heads
    bw = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (1 << 24))
    smi = nvidia_smi() if device.type == "cuda" else {}
    doc = {
        "what": "decode step timings beside their floors, KDA and GDN, both layouts, and a batch sweep "
                "(bench/decode.py)",
        "config": {"batch": batch, "heads": heads, "key_heads": key_heads, "head_k": head_dim, "head_v": head_dim,
                   "tokens": "bf16", "pool_slots": "2 x batch + 1",
                   "slot_order": "random distinct slots", "backend": backend, "budget_s": budget_s,
                   "time_limit_s": time_limit_s},
        "device": device_info(device), "driver": smi.get("driver"), "cpu": platform.processor(),
        "versions": {m: module_version(m) for m in ("leapquant", "torch", "triton", "fla")},
        "bandwidth": bw, "bounds_text": BOUNDS_TEXT, "gates": {}, "sweep": None,
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }

    def progress():
        doc["wall_s"] = round(time.time() - t0, 1)
        doc["versions"] = {m: module_version(m) for m in ("leapquant", "torch", "triton", "fla")}  # fla once imported
        if on_progress is not None:
            on_progress(doc)

    print(f"bench.decode on {doc['device']['name']} ({bw['GBps']:.0f} GB/s): gates {', '.join(gates)}, {batch} x "
          f"{heads} heads, K = V = {head_dim}; sweep {list(sweep) or 'none'}, no point started after "
          f"{time_limit_s:.0f} s", flush=True)
    timer = Timer(device, bw, budget_s)
    doc["config"].update(max_replays=timer.reps[1], clock="CUDA-graph replays, CUDA events" if device.type == "cuda"
                         else "eager calls, the host clock")
    for gate in gates:
        timer.label = f"{gate} "
        doc["gates"][gate] = gate_section(timer, device, gate, batch, heads, key_heads, head_dim, backend, with_fla)
        progress()
    if sweep:
        doc["sweep"] = {"batches": list(sweep), "heads": heads, "key_heads": key_heads, "layout": "engine",
                        "budget_s": sweep_budget_s, "gates": {}, "seconds": {}}
        fast = Timer(device, bw, sweep_budget_s)
        for gate in gates:
            s0 = time.time()
            doc["sweep"]["gates"][gate] = sweep_rows(fast, device, gate, sweep, heads, key_heads, head_dim, backend,
                                                     with_fla, t0 + time_limit_s)
            doc["sweep"]["seconds"][gate] = round(time.time() - s0, 1)
            progress()
    progress()
    return doc


def _fmt_us(r: dict | None, key: str = "median_us") -> str:
    if r is None:
        return "—"
    if r.get("status") != "ok":
        return r.get("status", "?")
    return f"{r[key]:.1f} us"


def bound_lines(section: dict) -> list[str]:
    """The bounds stated as the issue states them, then each layout's ratios marked met / missed."""
    lines = [f"Bounds (issue 38): {BOUNDS_TEXT}."]
    for layout in SUFFIX:
        parts = []
        for b in (b for b in section["bounds"] if b["layout"] == layout):
            den = "its floor" if b["against"] == "floor" else b["against"]
            if b["ratio"] is None:
                parts.append(f"{b['case']} / {den}: not measured, {b['reason']} (bound {b['bound']:g}x)")
            else:
                parts.append(f"{b['case']} / {den} = {b['ratio']:.2f}x (bound {b['bound']:g}x: "
                             f"{'met' if b['met'] else 'missed'})")
        lines.append(f"- {layout} layout: " + "; ".join(parts) + ".")
    return lines


def layer_split(t: dict) -> str | None:
    """Where the decode layer's time goes, from the medians ``t`` by case (engine layout): the step, the layer's
    flush alone and what is left; None where a case is missing."""
    need = ("decode layer", "step fill 8", LAYER_FLUSH, FLUSH_NONE)
    if not all(n in t for n in need):
        return None
    layer, step, flush, none = (t[n] for n in need)
    return (f"Where the decode layer's time goes: step fill 8 {step:.1f} us + {LAYER_FLUSH} {flush:.1f} us = "
            f"{step + flush:.1f} us against the layer's {layer:.1f} us ({layer - step - flush:+.1f} us); a flush "
            f"call with nothing due takes {none:.1f} us ({FLUSH_NONE}: its fixed part).")


def _gate_markdown(doc: dict, gate: str, section: dict) -> list[str]:
    be = ", ".join(f"{name} ({layout})" for layout, name in section["backend"].items()) or "none timed"
    lines = [f"## {gate.upper()}", "",
             f"{section['batch']} sequences x {section['heads']} heads ({section['key_heads']} key heads), "
             f"K = {section['head_k']}, V = {section['head_v']}, ring {section['ring']}, rank {section['rank']}; "
             f"a pool of {section['pool_slots']} slots; step backend {be}.", "",
             "| case | time | floor | x floor |", "| --- | ---: | ---: | ---: |"]
    for r in section["cases"]:
        if r.get("status") == "ok":
            lines.append(f"| {r['case']} | {r['median_us']:.1f} us | {r['floor_us']:.1f} us | {r['x_floor']:.2f} |")
        else:
            lines.append(f"| {r['case']} | {r['status']}: {r.get('reason', '')[:160]} | | |")
    t = {r["case"]: r["median_us"] for r in section["cases"] if r.get("status") == "ok"}
    against = [f"{name}: {100 * (t[name] / t[f'{name}@baseline'] - 1):+.1f} %" for name in t
               if f"{name}@baseline" in t]
    if against:
        lines += ["", f"Against the baseline ({doc['baseline']}), same run: " + "; ".join(against) + "."]
    lines += [""] + bound_lines(section)
    split = layer_split(t)
    if split:
        lines += ["", split]
    m = section.get("memory_per_sequence")
    if m:
        lines += ["", "Bytes per sequence: " + ", ".join(f"{k.replace('_', ' ')} {val:,}" for k, val in m.items())
                  + "."]
    return lines + [""]


def _sweep_markdown(doc: dict) -> list[str]:
    sw = doc["sweep"]
    lines = ["## Batch sweep", "",
             f"The decode layer ({sw['layout']} layout, 1/16 of the rings full) against FLA's in-place steps, "
             f"{sw['heads']} heads, each batch on a pool of 2 x batch + 1 slots at random slots; "
             f"{sw['budget_s']:g} s of replays per case (at most {doc['config']['max_replays']}). Below 16 "
             f"sequences, `{CYCLE}` is the mean step as an engine runs it: 16 steps in one graph from fills spread "
             "over the sequences (each sequence's heads at one fill), so each sequence's rings are flushed once "
             "in 16 steps instead of 1/16 of every sequence's heads on every step."]
    if doc.get("plot"):
        lines += ["", f"![decode layer and FLA's steps against the batch]({doc['plot']})"]
    elif doc.get("plot_error"):
        lines += ["", f"No plot: {doc['plot_error']}"]
    for gate, rows in sw["gates"].items():
        by = {(r["batch"], r["case"]): r for r in rows}
        lines += ["", f"### {gate.upper()}", "",
                  "| batch | due | decode layer | floor | x floor | decode cycle | fla fp32 | fla bf16 | "
                  "layer / fla fp32 | layer / fla bf16 |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        notes = []
        for B in sw["batches"]:
            lay, cyc, f32, b16 = (by.get((B, n)) for n in ("decode layer", CYCLE, "fla fp32", "fla bf16"))
            ok = lambda r: r is not None and r.get("status") == "ok"  # noqa: E731
            ratio = lambda r: f"{lay['median_us'] / r['median_us']:.2f}" if ok(lay) and ok(r) else "—"  # noqa: E731
            lines.append(f"| {B} | {lay.get('due', '') if ok(lay) else ''} | {_fmt_us(lay)} | "
                         f"{_fmt_us(lay, 'floor_us') if ok(lay) else '—'} | "
                         f"{format(lay['x_floor'], '.2f') if ok(lay) else '—'} | {_fmt_us(cyc)} | {_fmt_us(f32)} | "
                         f"{_fmt_us(b16)} | "
                         f"{ratio(f32)} | {ratio(b16)} |")
            notes += [f"batch {B}, {r['case']}: {r['status']}: {r.get('reason', '')[:200]}"
                      for r in (lay, cyc, f32, b16) if r is not None and r.get("status") != "ok"]
        if notes:
            reasons = sorted(set(n.split(": ", 1)[1] for n in notes))
            lines += ["", "Not timed: " + "; ".join(reasons[:4]) + f" ({len(notes)} cases)."]
    return lines + [""]


def markdown(doc: dict) -> str:
    d, v, c = doc["device"], doc["versions"], doc["config"]
    lines = [f"# Decode step on {d.get('name')}", "",
             f"{d.get('name')}, driver {doc['driver']}; torch {v['torch']}, Triton {v['triton']}, fla {v['fla']}; "
             f"{doc['date_utc']}; the run took {doc.get('wall_s', 0):.0f} s. Copy bandwidth "
             f"{doc['bandwidth']['GBps']:.0f} GB/s (same run). bf16 tokens; medians of {c['clock']}, "
             f"{c['budget_s']:g} s per case (at most {c['max_replays']} replays); floor = the bytes a case must move "
             "over that bandwidth (bench/decode.py).", ""]
    for gate, section in doc["gates"].items():
        lines += _gate_markdown(doc, gate, section)
    if doc.get("sweep"):
        lines += _sweep_markdown(doc)
    return "\n".join(lines).rstrip("\n") + "\n"


def _write(doc: dict, out: Path, slug: str, plot: bool) -> None:
    """JSON and markdown (and, when ``plot``, the sweep's PNG: a plotting failure is recorded, the numbers kept)."""
    stem = out / f"decode_{slug}"
    if plot and doc.get("sweep"):
        doc["plot"] = None
        try:
            from .plot import decode_sweep

            decode_sweep(doc, stem.with_suffix(".png"))
            doc["plot"] = stem.with_suffix(".png").name
            doc.pop("plot_error", None)
        except Exception as e:  # matplotlib missing or a plotting error must not lose the numbers
            doc["plot_error"] = f"{type(e).__name__}: {e}"[:300]
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(doc))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.decode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny sizes on the CPU with the reference, no FLA, a sweep of batches 1, 2, 4")
    ap.add_argument("--batch", type=int, default=None, help="sequences (default 256; --cpu-smoke 3)")
    ap.add_argument("--heads", type=int, default=None, help="value heads (default 32; --cpu-smoke 2)")
    ap.add_argument("--key-heads", type=int, default=None, help="query / key heads (default: --heads)")
    ap.add_argument("--head-dim", type=int, choices=[64, 128], default=None, help="K = V (default 128; --cpu-smoke 64)")
    ap.add_argument("--gate", choices=["kda", "gdn", "both"], default="both", help="the gates (default both)")
    ap.add_argument("--backend", default="auto", help="leapquant backend of the step (default auto)")
    ap.add_argument("--budget", type=float, default=None, help="seconds of replays per case (default 2)")
    ap.add_argument("--sweep", default=None, metavar="B,B,...",
                    help=f"batches of the sweep (default {','.join(map(str, SWEEP))}; --cpu-smoke "
                         f"{','.join(map(str, CPU_SWEEP))})")
    ap.add_argument("--no-sweep", action="store_true", help="no batch sweep")
    ap.add_argument("--sweep-budget", type=float, default=None, help="seconds of replays per sweep case (default 0.3)")
    ap.add_argument("--time-limit", type=float, default=240.0,
                    help="seconds after which no sweep point starts (default 240)")
    ap.add_argument("--fla", action="store_true",
                    help="FLA's anchors with --cpu-smoke too (its Triton kernels run on the CPU only under "
                         "TRITON_INTERPRET=1)")
    ap.add_argument("--no-fla", action="store_true", help="no FLA anchors")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="output folder")
    ap.add_argument("--baseline", default=None, metavar="DIR",
                    help="also time LeapQuant's cases under the packages in DIR (see above)")
    ap.add_argument("--json-only", default=None, metavar="FILE", help=argparse.SUPPRESS)  # the baseline's run
    args = ap.parse_args(argv)
    cpu = args.cpu_smoke
    if not cpu and not torch.cuda.is_available():
        print("error: no CUDA device here; `python -m bench.decode --cpu-smoke` runs the path on the CPU",
              file=sys.stderr)
        return 2
    device = torch.device("cpu" if cpu else "cuda")
    heads = args.heads or (2 if cpu else 32)
    if args.no_sweep or args.json_only:
        sweep = ()
    elif args.sweep is not None:
        sweep = tuple(int(b) for b in args.sweep.split(",") if b.strip())
    else:
        sweep = CPU_SWEEP if cpu else SWEEP
    slug = "cpu" if cpu else device_slug(torch.cuda.get_device_name(device))
    out = Path(args.out)
    if not args.json_only:
        out.mkdir(parents=True, exist_ok=True)
    doc = run(device, gates=GATES if args.gate == "both" else (args.gate,), batch=args.batch or (3 if cpu else 256),
              heads=heads, key_heads=args.key_heads or heads, head_dim=args.head_dim or (64 if cpu else 128),
              backend="reference" if cpu else args.backend, budget_s=args.budget or (0.05 if cpu else 2.0),
              sweep=sweep, sweep_budget_s=args.sweep_budget or (0.02 if cpu else 0.3),
              with_fla=(not cpu or args.fla) and not args.no_fla and not args.json_only,
              time_limit_s=args.time_limit,
              on_progress=None if args.json_only else lambda d: _write(d, out, slug, plot=False))
    if args.json_only:
        Path(args.json_only).write_text(json.dumps(doc))
        return 0
    if args.baseline:
        doc["baseline"] = str(Path(args.baseline).resolve())
        theirs = _baseline_cases(doc["baseline"], argv if argv is not None else sys.argv[1:])
        for gate, section in doc["gates"].items():
            section["cases"] += [dict(r, case=f"{r['case']}@baseline") for r in theirs.get(gate, [])]
    _write(doc, out, slug, plot=True)
    print(markdown(doc))
    print(f"wrote {out / f'decode_{slug}'}.json, .md" + (f", {doc['plot']}" if doc.get("plot") else "")
          + f" in {doc['wall_s']:.0f} s")
    return 0


def _baseline_cases(baseline: str, argv: list[str]) -> dict[str, list[dict]]:
    """LeapQuant's cases of each gate timed by this file under ``baseline``'s packages: run from that folder
    (``python -m`` puts it first on the path), with this tree next so that ``bench`` itself still comes from here."""
    here = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([baseline, here] + (
        [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "baseline.json"
        rest, skip = [], False
        for a in argv:  # the same cases, without this run's --baseline and --out
            if skip:
                skip = False
            elif a in ("--baseline", "--out"):
                skip = True
            elif not a.startswith(("--baseline=", "--out=")):
                rest.append(a)
        subprocess.run([sys.executable, "-m", "bench.decode", *rest, "--json-only", str(out)], cwd=baseline, env=env,
                       check=True)
        return {gate: s["cases"] for gate, s in json.loads(out.read_text())["gates"].items()}


if __name__ == "__main__":
    sys.exit(main())
