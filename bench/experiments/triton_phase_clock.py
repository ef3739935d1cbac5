"""Where one due program's time goes, phase by phase, read from inside the Triton kernel (session 12).

Writes a copy of leapquant_triton/kernel.py in which every program records the SM's cycle counter (``%clock64``)
and the global timer (``%globaltimer``, ns) at its entry and at eight points of the flush, and its SM (``%smid``),
into 24 extra int64 words of its scratch; loads the copy as a submodule of leapquant_triton (its relative imports
resolve to this tree) and runs its ``flush_pool`` eagerly, after an L2 eviction, on a KDA 257 x 32 pool
("realistic" states) with 1, 264 (one program per SM slot: one round), 512 (1/16 of 256 x 32) and 8,192 (all) due
programs, then GDN all due. The stamps read the clock when the thread that stores them (thread 0) passes the point; each
point is right after a barrier, or takes a value the phase computes as an input, so that it cannot be issued early.

    entry -> s0   the list schedule: wait for the due list (programmatic dependent launch), read the pair
    s0 -> s1      every input load, the rebuild (dequantisation, Lo, the ring products), max|S|
    s1 -> s2      Sn, P = Sn^T q, Y = Sn P, Y to scratch
    s2 -> s3      the first CholeskyQR
    s3 -> s4      the second CholeskyQR (fp16 Q to scratch)
    s4 -> s5      U, the residual, the column sums of |E|
    s5 -> s6      s_k, 1 / s_k
    s6 -> s7      X = E / s_k, s_v, the codes, the stores issued (their drain is not seen)

Printed per case: the medians (and 10th / 90th percentiles) of each phase over the due programs in cycles and us
(cycles over the SM clock measured from the two counters), the kernel's span from the first entry to the last s7,
and how many programs ran on one SM at once (at most two: 128 registers x 256 threads each).
The stamps add ~20 instructions and 18 stores per program; the times are for this copy, next to the kernel's own.

    PYTHONPATH=$PWD python bench/experiments/triton_phase_clock.py
"""

import importlib.util
import os
import statistics
import sys
import tempfile

import torch

import leapquant
from bench.timing import Evictor
from leapquant.workloads import fill

SRC = os.path.join(os.path.dirname(__file__), "..", "..", "leapquant_triton", "kernel.py")
EXTRA = 48  # fp32 words per program for the stamps: 24 int64 (clock 0..8, globaltimer 12..20, smid 23)

STAMP = '''

@triton.jit
def _stamp(p_tr, i: tl.constexpr, dep):
    """The SM's cycle counter and the global timer at this point (``dep`` a scalar the point waits for)."""
    c = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [dep], dtype=tl.int64, is_pure=False, pack=1)
    g = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dep], dtype=tl.int64, is_pure=False,
                                  pack=1)
    tl.store(p_tr + i, c)
    tl.store(p_tr + 12 + i, g)


@triton.jit
def _flush_one('''


def p_tr(first: str) -> str:
    """The stamps' int64 pointer of the program whose scratch words start at ``first``: after its own words."""
    return f"(scratch + {first} + 6 * V + 32 * ITERS + 4 + K).to(tl.pointer_type(tl.int64), bitcast=True)"


SMID = "tl.inline_asm_elementwise('mov.u32 $0, %smid;', '=r,r', [pid], dtype=tl.int32, is_pure=False, pack=1)"
LIST_ENTRY = "    if LIST:\n        pid = tl.program_id(0)\n"
KDA_RESETS = "    if IS_KDA:\n        tl.store(pcum + i_sh * K + o_k, tl.zeros([K], dtype=tl.float32))\n"
SCRATCH = "    scratch = torch.empty(plan.scratch_words, dtype=torch.float32, device=idx.device)\n"
CHOLQR_1 = "        _cholqr(p_y, p_gram + 32 * it, p_q16, V, R, False)\n"
CHOLQR_2 = "        _cholqr(p_y, p_gram + 32 * it + 16, p_q16, V, R, True)\n"
WORDS = "    return 6 * head_v + 32 * iters + 4 + head_k\n"
E_MAX = "    e_max = (a_max.to(tl.int32, bitcast=True) >> 23) & 0xFF\n"
COL_SUMS = "    tl.debug_barrier()\n    m_k = tl.load(p_e + o_k) * (1.0 / V)"
S_K = "    tl.debug_barrier()\n    b_s = b_s * tl.load(p_y + o_k)[None, :]\n"
REGION = "    o_reg = i_s * SS + i_h * (V * K)\n"

# (text of kernel.py, replacement): each must occur exactly once. The stamps' words follow the program's own
# scratch words (scratch_words grows by EXTRA; SCR, the kernel's stride, includes them).
EDITS = [
    ("\n\n@triton.jit\ndef _flush_one(", STAMP),
    (WORDS, WORDS.replace("head_k\n", f"head_k + {EXTRA}\n")),
    (LIST_ENTRY, (LIST_ENTRY + f"        p_tr = {p_tr('pid.to(tl.int64) * SCR')}\n        _stamp(p_tr, 8, pid)\n"
                  f"        tl.store(p_tr + 23, {SMID}.to(tl.int64))\n")),
    (REGION, REGION + f"    p_tr = {p_tr('o_scr')}\n    _stamp(p_tr, 0, i_h)\n"),
    (E_MAX, E_MAX + "    _stamp(p_tr, 1, e_max)\n"),
    ("        tl.debug_barrier()\n" + CHOLQR_1,
     "        tl.debug_barrier()\n        _stamp(p_tr, 2, e_max)\n" + CHOLQR_1 + "        _stamp(p_tr, 3, e_max)\n"),
    (CHOLQR_2, CHOLQR_2 + "        _stamp(p_tr, 4, e_max)\n"),
    (COL_SUMS, COL_SUMS.replace("barrier()\n", "barrier()\n    _stamp(p_tr, 5, e_max)\n")),
    (S_K, S_K.replace("barrier()\n", "barrier()\n    _stamp(p_tr, 6, e_max)\n")),
    (KDA_RESETS, "    _stamp(p_tr, 7, e_max)\n" + KDA_RESETS),
    # the last flush's scratch, for reading the stamps back
    (SCRATCH, SCRATCH + "    global LAST_SCRATCH\n    LAST_SCRATCH = scratch\n"),
]

PHASES = ["entry->s0 list wait", "s0->s1 loads, rebuild, max", "s1->s2 Sn, P, Y", "s2->s3 CholQR 1",
          "s3->s4 CholQR 2", "s4->s5 U, residual, col sums", "s5->s6 s_k", "s6->s7 codes, stores"]


def variant_module():
    with open(SRC) as f:
        text = f.read()
    for old, new in EDITS:
        assert text.count(old) == 1, f"not found once in kernel.py: {old[:70]!r}"
        text = text.replace(old, new)
    path = os.path.join(tempfile.mkdtemp(), "kernel_phase_clock.py")
    with open(path, "w") as f:
        f.write(text)
    # a submodule of leapquant_triton, so that its relative imports (backend, launcher) resolve to this tree's
    spec = importlib.util.spec_from_file_location("leapquant_triton._kernel_phase_clock", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def row(name: str, cycles: list, ghz: float) -> None:
    us = [c / ghz / 1e3 for c in cycles]
    print(f"  {name:<30} {statistics.median(cycles):10.0f} {statistics.median(us):7.2f} {pct(us, 0.1):7.2f} "
          f"{pct(us, 0.9):7.2f}", flush=True)


def main():
    dev = torch.device("cuda")
    mod = variant_module()
    evict = Evictor(dev)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {__import__('triton').__version__}; the list schedule (forced), 8 warps, 128 registers")
    for gate, cases in (("kda", (1, 264, 512, 8192)), ("gdn", (8192,))):
        pool = leapquant.Pool(257, 32, gate=gate, device=dev)
        gen = torch.Generator().manual_seed(12)
        fill(pool, torch.arange(1, 257), "realistic", gen)
        saved = {n: getattr(pool, n).clone() for n in ("raw", "w", "pcum", "gbuf") if getattr(pool, n) is not None}
        idx = torch.arange(1, 257, dtype=torch.int32, device=dev)
        words = mod.scratch_words(128, 128, 1)
        for due in cases:
            flat = torch.zeros(256 * 32, dtype=torch.bool)
            flat[torch.randperm(256 * 32, generator=gen)[:due]] = True
            pool.hcnt[1:257] = torch.where(flat.reshape(256, 32), 16, 3).to(torch.int32).to(dev)
            for _ in range(4):  # the first compiles; the last one's stamps are read
                for n, t in saved.items():
                    getattr(pool, n).copy_(t)
                evict()
                a, b = torch.cuda.Event(True), torch.cuda.Event(True)
                a.record()
                mod.flush_pool(pool, idx, schedule="list")
                b.record()
                b.synchronize()
            eager_us = a.elapsed_time(b) * 1e3
            tr = mod.LAST_SCRATCH.view(-1, words)[:, words - EXTRA:].contiguous().view(torch.int64)[:, :24].cpu()
            clk, gt, sm = tr[:due, :9], tr[:due, 12:21], tr[:due, 23]
            seq = torch.cat([clk[:, 8:9], clk[:, :8]], dim=1)  # entry, s0 .. s7
            d_cyc = (seq[:, 1:] - seq[:, :-1]).tolist()
            tot_cyc = (seq[:, -1] - seq[:, 0]).double()
            tot_ns = (gt[:, 7] - gt[:, 8]).double()
            ghz = float(tot_cyc.sum() / tot_ns.sum())
            span_us = (gt[:, 7].max() - gt[:, 8].min()).item() / 1e3
            # programs at once per SM, from the global timer: the most intervals [entry, s7] that overlap on one SM
            most, per_sm = 0, {}
            for e, x, m in zip(gt[:, 8].tolist(), gt[:, 7].tolist(), sm.tolist()):
                per_sm.setdefault(m, []).extend([(e, 1), (x, -1)])
            for ev in per_sm.values():
                cur = 0
                for _, d in sorted(ev):
                    cur += d
                    most = max(most, cur)
            print(f"\n{gate.upper()} 256 x 32, {due} due: eager flush (due list + flush) {eager_us:.1f} us; "
                  f"kernel span {span_us:.1f} us from the first program's entry to the last s7; "
                  f"SM clock {ghz:.3f} GHz; {len(sm.unique())} SMs, at most {most} programs at once on one")
            print(f"  {'phase':<30} {'median cyc':>10} {'us':>7} {'p10 us':>7} {'p90 us':>7}")
            for i, name in enumerate(PHASES):
                row(name, [r[i] for r in d_cyc], ghz)
            row("entry->s7 (one program)", tot_cyc.tolist(), ghz)


if __name__ == "__main__":
    sys.exit(main())
