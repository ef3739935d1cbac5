"""The flush as one warp-specialised TileLang kernel (SPEC §3 math, §7 design).

One persistent CTA per SM. Every CTA first scans all ``N * HV`` due flags and keeps the due programs whose global
rank is ``bid mod SMS`` (the compaction); then a 32-thread producer warp streams each kept program's checkpoint and
ring into a shared-memory stage with TMA, and ``NCG = 3`` consumer groups of 128 threads each take one program at a
time. A consumer group runs one program as these phases, in this order (SPEC §3 steps):

* ``wait_program``: the next program of the group and its stage;
* ``rebuild`` (steps 1-4): ``B`` = the rebuilt state minus the old rank-R part, fp16 into ``state_shared``;
* ``ITERS`` rounds of ``product_p`` / ``product_q`` / ``cholesky_qr2`` (step 5, with CholeskyQR2), and a last
  ``product_p`` whose ``P`` is the new ``U`` (step 6);
* ``store_factors`` (step 6): the new fp16 factors to the pool;
* ``residual`` (step 7): ``E`` over ``B`` in ``state_shared`` and the column partials of ``|E|``;
* ``release_stage``: the stage goes back to the producer;
* ``column_scales`` (step 8), ``quantise_rows`` (step 9: row scales and codes), ``reset_ring`` (step 10).

A program whose ring holds nothing since its last flush (SPEC §2: every ``w`` zero, KDA ``pcum`` all 0, GDN
``pcum = 1``) only hands its stage back (``ring_has_entries``), and the compaction lists a (slot, head) only for the
first row of ``idx`` naming the slot (``first_rows``): a flush is idempotent and flushes each (slot, head) at most
once, whatever ``idx`` repeats.

Numerics (the seed's deployed configuration, SPEC §3 last paragraph):

* ``B`` is kept fp16 in shared memory for the subspace products (fp16 mma, fp32 accumulate); the old rank-R part is
  carried algebraically through small ``R x R`` corrections.
* The ring: bf16 values times decayed keys split into bf16 hi + lo (KDA), or w-scaled values split into bf16 hi + lo
  (GDN): 16 bits of each product, the seed's choice.
* KDA takes the ``KEXACT`` residual: ``E`` is accumulated in fp32 from the stage (second dequantisation, ring mma,
  both rank-R products), then stored fp16 with a power-of-two scale per (warp, half). GDN takes the plain residual
  from the fp16 ``B`` (SPEC §3, last paragraph).
* Departure from the seed: KDA's residual adds a third bf16 piece of the decayed keys (lo2), so that its ring term is
  the fp32 product; with hi + lo alone a fully decayed (exactly rank-1) head fails SPEC §4 (docs/DESIGN.md, "TileLang:
  what the port changed"). The rebuild for the subspace iteration keeps hi + lo: it feeds fp16 products.

Register legend of a consumer thread (mma.sync m16n8k16 fragment terms).

:class:`Thread`, its coordinates: ``g`` consumer group (= its stage: one stage per group), ``t`` thread in the group
(a row v or a column c, by phase), ``wp`` warp in the group (owns rows / columns ``32 wp .. 32 wp + 31`` of the
products), ``lane``, ``q4 = lane % 4`` (the mma thread-in-quad: accumulator columns ``2 q4, 2 q4 + 1``),
``r0 = lane // 4`` (accumulator rows ``r0, r0 + 8``), ``bar`` the group's named barrier.

:class:`Regs`, the register arrays that live across phases:

* ``cfrag`` (64 fp32): one 64-column half of this warp's ``32 x 128`` tile of ``B`` or ``E``, index
  ``((ntl * 4) + (mt * 2 + hr)) * 2 + c1`` (:func:`cf`) with ``ntl`` the local 8-column n-tile, ``mt`` the 16-row
  m-tile, ``hr`` the row half (``r0`` or ``r0 + 8``), ``c1`` the column in the pair; the column sums reuse it.
* ``row_scale`` (4): ``s_v / QMAX`` (GDN: ``x pn``) of this lane's 4 accumulator rows; ``col_scale`` (16): ``s_k``
  (KDA rebuild: ``x pc``) of this lane's 16 columns of a half.
* The ring product: ``afrag`` (bf16 A fragments of the values; GDN: hi + lo), ``bfrag`` (bf16 B fragments of the
  decayed keys, KDA: hi + lo; two alternating steps), ``lo2`` (KDA: the third piece of this thread's key column).
* The subspace products: ``ah`` (A fragments of ``B``: 2 k-parities x 2 m-tiles), ``bh2`` (B fragments of ``Q`` or
  ``P``, 2 k-parities; also the column sums' ``|E|``), ``ao`` (A fragments of the old factors, m-rows 8..15 zero),
  ``c32`` (accumulators: 2 m-tiles x 4, two chains), ``mc`` (the ``R x R`` correction ``M = Q_old^T Q`` or
  ``M2 = U_old^T P`` as an m16n8 accumulator), ``mm`` (that matrix shuffled to every lane).
* The residual's rank-R products (m16n8k8): ``afrag2`` (A = ``Q_old^T``), ``afrag3`` (A = the new ``Q``), ``bfr``
  (B = ``U_old`` or ``-U_new``, two alternating steps).
* The column sums: ``aone`` (an A fragment of ones), ``colp`` (partials of ``|E|``: 16 n-tiles x 2 columns);
  ``esc`` (KEXACT: the inverse ``E`` scale per half of this warp's rows).

Shared memory at NCG = 3: 223,232 B (KDA) and 207,872 B (GDN) plus the due list beyond its 512 B floor (sm_90 allows
227 KB, sm_100 228 KB).
"""

from dataclasses import dataclass

import tilelang
import tilelang.language as T
from tilelang.layout import make_swizzled_layout
from tvm.ir import PrimExpr
from tvm.script.ir_builder import IRBuilder

from leapquant.constants import EPS, FLOOR, PNMIN, QMAX, ROUND_MAGIC, TINY
from leapquant.geometry import LAYOUTS, Geometry

F32, F16, BF16, I32 = "float32", "float16", "bfloat16", "int32"

PRODUCER_THREADS = 32
GROUP_THREADS = 128
# the due list holds a CTA's share of every program that can be due at once; past this it no longer fits next to
# the stages (8 KB: 8443 slots of 32 heads on 132 SMs)
DUE_LIST_MAX = 2048

# Bit devices of the int8 <-> fp32 conversions (exact in fp32; not SPEC constants)
FULL_MASK = 0xFFFFFFFF  # every lane of the warp
CODE_SIGN_FLIP = -2139062144  # 0x80808080 as int32: flips each packed code's sign bit (biased codes 1..255)
F32_TWO23 = 0x4B000000  # fp32 bits of 2^23: a byte in the low mantissa bits reads 2^23 + byte
BYTE_TO_F32 = 0x7650  # __byte_perm selector: byte 0..3 (added) of the codes under the upper bytes of 2^23
TWO23_PLUS_BIAS = 8388736.0  # 2^23 + 128: takes off the magic number and the code bias

PACK_LOW_BYTES = 0x0040  # __byte_perm selector: low bytes of x and y into bytes 0 and 1
PACK_LOW_HALVES = 0x5410  # __byte_perm selector: low halfwords of x and y


def due_list_capacity(num_slots: int, heads: int, first_slot: int, sms: int) -> int:
    """Entries of a CTA's due list: its share of all programs of the real slots, at least 128 (the seed's floor)."""
    real = num_slots - first_slot
    return max(128, (real * heads + sms - 1) // sms + 1)


# ---- the macros' arguments, grouped (TileLang passes Python objects through macro calls unchanged) ----

@dataclass(frozen=True)
class PoolViews:
    """The kernel's global tensors: the pool's views (SPEC §2), ``q0`` and ``idx``."""

    codes: T.Buffer
    s_k: T.Buffer
    s_v: T.Buffer
    s_kv: T.Buffer
    kbuf: T.Buffer
    ubuf: T.Buffer
    w: T.Buffer
    pcum: T.Buffer
    gbuf: T.Buffer
    hcnt: T.Buffer
    uq: T.Buffer
    q0: T.Buffer
    idx: T.Buffer


@dataclass(frozen=True)
class Shared:
    """The CTA's shared memory. A stage (``[s, ...]``, filled by TMA; the consumer group g owns stage g): ``codes``,
    ``scales`` (s_k | s_v), ``keys``, ``updates`` (values), ``weights``, ``factors`` (U^T | Q^T), ``keys_lo`` and
    ``pcum`` (KDA). Per group (``[g, ...]``): ``state``, ``newf`` with its views ``qrows`` / ``newf_flat`` /
    ``colsum``, ``decay`` (KDA). Per CTA: the due list and the stage barriers."""

    codes: T.Buffer
    scales: T.Buffer
    keys: T.Buffer
    updates: T.Buffer
    weights: T.Buffer
    factors: T.Buffer
    keys_lo: T.Buffer  # KDA only (None in GDN), as pcum and decay
    pcum: T.Buffer
    state: T.Buffer
    newf: T.Buffer
    qrows: T.Buffer
    newf_flat: T.Buffer
    colsum: T.Buffer
    decay: T.Buffer
    due_list: T.Buffer
    due_count: T.Buffer
    warp_due: T.Buffer
    first_row: T.Buffer  # [NS] int32 over ``state`` (the compaction only): the first row of idx naming each slot
    loaded: T.Buffer
    consumed: T.Buffer


@dataclass(frozen=True)
class Thread:
    """A consumer thread's coordinates (module docstring, register legend)."""

    g: PrimExpr
    t: PrimExpr
    wp: PrimExpr
    lane: PrimExpr
    q4: PrimExpr
    r0: PrimExpr
    bar: PrimExpr


@dataclass(frozen=True)
class Regs:
    """A consumer thread's register arrays that live across phases (module docstring, register legend)."""

    row_scale: T.Buffer
    col_scale: T.Buffer
    afrag: T.Buffer
    bfrag: T.Buffer
    cfrag: T.Buffer
    afrag2: T.Buffer
    afrag3: T.Buffer
    bfr: T.Buffer
    ah: T.Buffer
    bh2: T.Buffer
    ao: T.Buffer
    aone: T.Buffer
    c32: T.Buffer
    mc: T.Buffer
    mm: T.Buffer
    colp: T.Buffer
    esc: T.Buffer
    lo2: T.Buffer


# ---- addressing and instruction helpers: plain functions that return expressions at trace time ----

def ldsm_half(lane, bit: int):
    """Bit ``bit`` of the 8x8 matrix (``lane // 8``) that ``lane`` addresses in an ldmatrix / stmatrix x2 or x4."""
    return (lane // 8) % 2 if bit == 0 else lane // 16


def ldsm_row(lane, bit: int = 0):
    """Row 0..15 of a 16-row tile that ``lane`` addresses when matrix bit ``bit`` selects the rows 8..15."""
    return 8 * ldsm_half(lane, bit) + lane % 8


def ldsm_col(lane, bit: int = 0):
    """Column offset, 0 or 8, that ``lane`` addresses when matrix bit ``bit`` selects the columns 8..15."""
    return 8 * ldsm_half(lane, bit)


def acc_row(wp, rr, r0):
    """Row v of this lane's accumulator row ``rr`` (m-tile ``rr // 2``, half ``rr % 2``) in warp ``wp``'s band."""
    return wp * 32 + (rr // 2) * 16 + (rr % 2) * 8 + r0


def acc_col(h, ntl, q4, c1):
    """Column c of this lane's accumulator column ``c1`` of the local n-tile ``ntl`` in half ``h``."""
    return (h * 8 + ntl) * 8 + q4 * 2 + c1


def cf(ntl, rr):
    """``cfrag`` index of the column pair of n-tile ``ntl``, accumulator row ``rr = mt * 2 + hr`` (add ``c1``)."""
    return (ntl * 4 + rr) * 2


def factor(sm: Shared, s, row, col):
    """Entry (row, col) of the factor stage ``s``: U^T | Q^T in four 64-column blocks."""
    return sm.factors[s, col // 64, row, col % 64]


def ldmatrix(trans: bool, count: int, src, dst):
    """``ldmatrix.x{count}[.trans]`` from this lane's row address ``src`` into the registers from ``dst`` on."""
    return T.ptx_ldmatrix(T.bool(trans), count, T.access_ptr(src, "r", extent=2 * count),
                          T.access_ptr(dst, "w", extent=2 * count))


def stmatrix(count: int, dst, ph):
    """``stmatrix.x{count}`` of the fp16 pairs ``ph[0:2], ph[2:4], ..`` to this lane's row address ``dst``."""
    pairs = [T.reinterpret(ph[2 * i:2 * i + 2], I32) for i in range(count)]
    return T.call_extern("handle", f"tl::ptx_stmatrix_m8n8_x{count}", T.access_ptr(dst, "w", extent=8), *pairs)


def mma(shape: str, ab: str, a, a_off, b, b_off, c, c_off):
    """``mma.sync`` ``shape`` (row.col, ``ab`` operands, fp32 accumulate) on register arrays at the given offsets."""
    return T.ptx_mma(F32, shape, "row", "col", ab, ab, "fp32", a.data, a_off, b.data, b_off, c.data, c_off,
                     T.bool(False))


def warp_ballot(pred):
    return T.call_extern("uint32", "__ballot_sync", T.uint32(FULL_MASK), pred)


def popc(mask):
    return T.call_extern(I32, "__popc", mask)


def byte_perm(x, y, selector):
    return T.call_extern(I32, "__byte_perm", x, y, selector)


def inv_pivot(d, gii):
    """1 / L_ii of CholeskyQR from the pivot ``d = G_ii - sum_j L_ij^2`` with the floors of SPEC §3 step 5."""
    return T.rsqrt(T.max(T.max(d, FLOOR * gii), TINY))


@tilelang.jit(pass_configs={"tl.disable_thread_storage_sync": True})
def flush_kernel(
    # task config
    num_slots: int, heads: int = 32, head_k: int = 128, head_v: int = 128, ring: int = 16, rank: int = 4,
    gate: str = "kda", first_slot: int = 1, iters: int = 1, layout: str = "engine",
    # kernel config
    sms: int = 132,
    groups: int = 3,
):
    """Build the flush kernel for a pool of ``num_slots`` slots (SPEC §2 layout) on a GPU with ``sms`` SMs.

    Task config: the pool geometry (only ``heads = 32``, ``head_k = head_v = 128``, ``ring = 16``, ``rank`` 1..4 are
    implemented), ``gate`` ``"kda"`` or ``"gdn"``, ``first_slot`` the smallest real slot (1: vLLM, slot 0 is the null
    slot; 0: SGLang, -1 pads), ``iters`` rounds of the subspace iteration, ``layout`` the pool's (SPEC §2:
    ``"engine"`` or ``"compact"``; only the checkpoint views' slot and head strides depend on it). Kernel config:
    ``sms`` persistent CTAs, ``groups`` consumer groups per CTA (3 is what fits 227 KB).

    The returned kernel takes ``(codes32, s_k, s_v, s_kv, kbuf, ubuf, w, pcum, gbuf, hcnt, uq, q0, idx)``: the
    pool's views (``gbuf`` reinterpreted as bf16 for TMA; a ``[1, 1, 1, 1]`` placeholder for GDN), ``q0 [V, R]`` fp32
    and ``idx int32 [N]`` (``N`` symbolic: one compile serves every batch size). Writes only the due programs.
    """
    NS, HV, K, V, L, R = num_slots, heads, head_k, head_v, ring, rank
    KDA = gate == "kda"
    # KEXACT residual (SPEC §3): the seed's deployed choice for KDA; GDN takes the plain residual
    KEX = KDA
    ITERS = iters
    NCG = groups
    if gate not in ("kda", "gdn"):
        raise ValueError(f"gate must be 'kda' or 'gdn', got {gate!r}")
    if (HV, K, V, L) != (32, 128, 128, 16) or not 1 <= R <= 4:
        raise ValueError(f"implemented for heads=32, head_k=head_v=128, ring=16, rank 1..4; got {(HV, K, V, L, R)}")
    if first_slot not in (0, 1):
        raise ValueError(f"first_slot must be 0 or 1, got {first_slot}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    # the checkpoint region strides of the layout, in fp32 words (engine: V K per head and a spare head per slot;
    # compact: the checkpoint rounded up to 128 B, no spare head): the only place the layout enters the kernel
    geo = Geometry(NS, HV, K, V, L, R, gate, layout)
    SS, HS = geo.slot_stride, geo.head_stride
    KW = K // 4  # int8 codes packed four to an int32 word
    NCONS = GROUP_THREADS * NCG
    NT = PRODUCER_THREADS + NCONS
    NWARPS = NT // 32
    MAXIT = due_list_capacity(NS, HV, first_slot, sms)
    if MAXIT > DUE_LIST_MAX:
        raise ValueError(f"{NS} slots need a due list of {MAXIT} entries per CTA on {sms} SMs (at most {DUE_LIST_MAX})")
    # n-steps per warp the compaction keeps in registers (N <= 40 * NWARPS = 520 rows at NCG = 3, vLLM's
    # max_num_seqs 512); larger batches take a serial tail with the flags recomputed in the rank pass
    KMAX = min((NS + NWARPS - 1) // NWARPS, 40)
    # state_shared row stride: conflict-free fragment stores, ldmatrix rows and 16 B row reads; the pad columns hold the
    # fp16 Q tile
    KP = K + 8
    if NS > NCG * V * KP // 2:  # first_row lies over state_shared (unreachable: the due list's bound comes first)
        raise ValueError(f"{NS} slots exceed the compaction's first-row table ({NCG * V * KP // 2} entries)")
    KV8 = K + V + 8  # newf_shared row stride (halfwords): 528 B -> conflict-free ldmatrix rows
    P16OFF = 4 * KV8  # fp16 P tile (K x 8) at halfword offset 4 rows into newf_shared (after the fp32 Q plane)
    # KDA: the lo2 tile of the decayed keys sits in state_shared rows LO2_ROW.., columns 64.. during the residual, where
    # only the last warp's E half 1 lands (after a barrier)
    LO2_ROW = V - 2 * L
    N = T.dynamic("N")

    def due_flag(step, row, slot, fill, steps):
        """1 where batch row ``row`` (the warp's n-step ``step``) names a real slot whose head is due, else 0."""
        real = (slot >= first_slot) & (slot < NS)
        return T.if_then_else((step < steps) & (row < N) & real & (fill == L), 1, 0)

    def ring_at(tile, s, j, c):
        """Entry (j, c) of a ring tile of stage ``s`` (keys, their lo piece): two 64-column halves."""
        return tile[s, c // (K // 2), j, c % (K // 2)]

    def value_rows(sm: Shared, s, m0, lane):
        """ldmatrix.x4.trans row address of the values tile ``[k = j][m = v]``, ``v = m0 ..``: (j 0-7, v 0-7),
        (j 0-7, v 8-15), (j 8-15, v 0-7), (j 8-15, v 8-15)."""
        return sm.updates[s, m0 // (V // 2), ldsm_row(lane, 1), m0 % (V // 2) + ldsm_col(lane)]

    def key_cols(tile, s, n0, lane):
        """ldmatrix.x4.trans row address of a key tile ``[k = j][n = c]``, ``c = n0 ..``: (j 0-7, c 0-7),
        (j 8-15, c 0-7), (j 0-7, c 8-15), (j 8-15, c 8-15)."""
        return tile[s, n0 // (K // 2), ldsm_row(lane), n0 % (K // 2) + ldsm_col(lane, 1)]

    def p16_index(row):
        """Halfword index in ``newf_flat`` of row ``row`` of the fp16 P tile (8 columns, R.. zero)."""
        return P16OFF + row * 8

    def group_sync(th: Thread):
        """The consumer group's named barrier."""
        return T.sync_threads(th.bar, GROUP_THREADS)

    # ---- compaction: every CTA ranks all due programs the same way and keeps those of rank == bid (mod SMS) ----
    @T.macro
    def first_rows(pool: PoolViews, sm: Shared, tx):
        """``first_row[s]`` = the first row of ``idx`` naming slot ``s``, for every real slot ``idx`` names (a shared
        minimum: memory and time linear in ``N``); the compaction keeps a row's due flags only where it is that row, so
        that a slot named twice is flushed once."""
        for i in T.unroll(T.ceildiv(N, NT), unroll_factor=1):  # not unrolled: ptxas then spills 180 B more
            s = pool.idx[T.min(tx + NT * i, N - 1)]
            if (tx + NT * i < N) & (s >= first_slot) & (s < NS):
                sm.first_row[s] = N
        T.sync_threads(14, NT)
        for i in T.unroll(T.ceildiv(N, NT), unroll_factor=1):
            s = pool.idx[T.min(tx + NT * i, N - 1)]
            if (tx + NT * i < N) & (s >= first_slot) & (s < NS):
                T.call_extern(I32, "atomicMin", T.address_of(sm.first_row[s]), tx + NT * i)  # ATOMS
        T.sync_threads(14, NT)

    def first_only(sm: Shared, row, slot):
        """``slot`` where ``row`` is the first row naming it, else -1 (not a real slot: the row's due flags are 0)."""
        return T.if_then_else(sm.first_row[T.min(T.max(slot, 0), NS - 1)] == row, slot, -1)

    @T.macro
    def load_tail(ck, wid, wlane, pool: PoolViews, sm: Shared, sl8: T.Buffer, hc8: T.Buffer):
        """Slots and fill counts of the warp's n-steps KMAX + 8 ck .. KMAX + 8 ck + 7 (batches past KMAX * NWARPS
        rows), clamped and first rows only like the register steps."""
        for j in T.unroll(8):
            sl8[j] = first_only(sm, wid + NWARPS * (KMAX + ck * 8 + j),
                                pool.idx[T.max(T.min(wid + NWARPS * (KMAX + ck * 8 + j), N - 1), 0)])
        for j in T.unroll(8):
            hc8[j] = pool.hcnt[T.min(T.max(sl8[j], 0), NS - 1), wlane]

    @T.macro
    def tail_ballot(ck, j, wid, kn: T.Buffer, sl8: T.Buffer, hc8: T.Buffer, tb: T.Buffer):
        """``tb[0]``: the warp's due flags of its n-step ``KMAX + 8 ck + j``, from what :func:`load_tail` loaded (the
        counting pass and the ranking pass take the same flags)."""
        k = KMAX + ck * 8 + j
        f = due_flag(k, wid + NWARPS * k, sl8[j], hc8[j], kn[0])
        tb[0] = warp_ballot(f)

    @T.macro
    def compact_due(pool: PoolViews, sm: Shared, bid, tx):
        """Fill ``due_list`` with this CTA's due programs ``q = slot * HV + hv`` and ``due_count``.

        Warp wid takes the batch rows n = wid, wid + NWARPS, ..., lane hv the head: one broadcast idx load and one
        coalesced 128 B hcnt load per n. The due programs are ranked with ballot/popc in the fixed order (warp, n-step,
        hv), so that every CTA gets +-1 of the mean (the flush is latency-bound; docs/DESIGN.md, "TileLang: the seed's
        warp-specialised design")."""
        wlane = tx % 32
        wid = tx // 32
        kn = T.alloc_local((1,), I32)
        kn[0] = T.ceildiv(N, NWARPS)  # n-steps per warp
        cnt = T.alloc_local((1,), I32)
        cnt[0] = 0
        slk = T.alloc_local((KMAX,), I32)
        hck = T.alloc_local((KMAX,), I32)
        mk = T.alloc_local((KMAX,), "uint32")
        first_rows(pool, sm, tx)  # first: nothing is live across its barriers
        # all loads in flight at once (explicit clamps: no guard branches; the flag rejects what the clamp hid); a row
        # that is not the first naming its slot names no slot
        for k in T.unroll(KMAX):
            slk[k] = first_only(sm, wid + NWARPS * k, pool.idx[T.max(T.min(wid + NWARPS * k, N - 1), 0)])
        for k in T.unroll(KMAX):
            hck[k] = pool.hcnt[T.min(T.max(slk[k], 0), NS - 1), wlane]
        for k in T.unroll(KMAX):
            f = due_flag(k, wid + NWARPS * k, slk[k], hck[k], kn[0])
            mk[k] = warp_ballot(f)
            cnt[0] += popc(mk[k])
        sl8 = T.alloc_local((8,), I32)
        hc8 = T.alloc_local((8,), I32)
        tb = T.alloc_local((1,), "uint32")
        # the tail (N > KMAX * NWARPS only): serial chunks of 8 n-steps, flags recomputed in the rank pass
        for ck in T.serial(T.ceildiv(kn[0] - KMAX, 8)):
            load_tail(ck, wid, wlane, pool, sm, sl8, hc8)
            for j in T.unroll(8):
                tail_ballot(ck, j, wid, kn, sl8, hc8, tb)
                cnt[0] += popc(tb[0])
        if wlane == 0:
            sm.warp_due[wid] = cnt[0]
        T.sync_threads(14, NT)
        base = T.alloc_local((1,), I32)
        base[0] = 0
        for ww in T.serial(NWARPS):
            base[0] += T.if_then_else(ww < wid, sm.warp_due[ww], 0)
        tot = T.alloc_local((1,), I32)
        tot[0] = 0
        for ww in T.serial(NWARPS):
            tot[0] += sm.warp_due[ww]
        T.sync_threads(14, NT)  # warp_due reads done before due_list (which may share its smem) is written
        lmask = T.cast((T.int64(1) << T.cast(wlane, "int64")) - T.int64(1), "uint32")
        if cnt[0] > 0:  # warps without due programs skip the pass (masks past kn are zero)
            # next rank == bid (mod SMS) at or above base, and its list index (one division per thread)
            rst = T.alloc_local((2,), I32)
            rst[0] = base[0] + (bid - base[0] % sms + sms) % sms
            rst[1] = rst[0] // sms
            for k in T.unroll(KMAX):  # static indexing of the mask registers; one predicate per step, no division
                m = mk[k]
                rank = base[0] + popc(m & lmask)
                # the capacity guard only matters when idx names a slot twice (a caller error)
                mine = ((m >> T.cast(wlane, "uint32")) & T.uint32(1)) == T.uint32(1)
                if mine & (rank == rst[0]) & (rst[1] < MAXIT):
                    sm.due_list[rst[1]] = pool.idx[wid + NWARPS * k] * HV + wlane
                base[0] += popc(m)
                if rst[0] < base[0]:  # the warp's rank sequence passed the target (warp-uniform; one target per step)
                    rst[0] += sms
                    rst[1] += 1
            for ck in T.serial(T.ceildiv(kn[0] - KMAX, 8)):
                load_tail(ck, wid, wlane, pool, sm, sl8, hc8)
                for j in T.unroll(8):
                    tail_ballot(ck, j, wid, kn, sl8, hc8, tb)
                    if ((tb[0] >> T.cast(wlane, "uint32")) & T.uint32(1)) == T.uint32(1):
                        rank = base[0] + popc(tb[0] & lmask)
                        if (rank % sms == bid) & (rank // sms < MAXIT):
                            sm.due_list[rank // sms] = sl8[j] * HV + wlane
                    base[0] += popc(tb[0])
        if tx == 0:
            sm.due_count[0] = T.min(T.max(T.ceildiv(tot[0] - bid, sms), 0), MAXIT)

    # ---- producer: one TMA batch per due program into its group's stage ----
    @T.macro
    def zero_factor_padding(sm: Shared, tx):
        """Zero the padding k-rows R..7 of every factor stage, once (TMA fills only the rows < R)."""
        for i in T.serial(NCG * 4 * (8 - R) * 64 // PRODUCER_THREADS):
            e = tx + PRODUCER_THREADS * i
            sm.factors[e // (4 * (8 - R) * 64), (e // ((8 - R) * 64)) % 4, R + (e % ((8 - R) * 64)) // 64,
                       e % 64] = T.cast(0.0, F16)

    @T.macro
    def produce(pool: PoolViews, sm: Shared):
        """The producer warp: program k of the due list goes to stage k mod NCG once its group has released it."""
        T.fence_proxy_async()
        for k in T.serial(sm.due_count[0]):
            q = sm.due_list[k]
            s = k % NCG  # program k goes to group k mod NCG, whose stage is s
            ig = k // NCG
            hv = q % HV
            slot = q // HV
            T.mbarrier_wait_parity(sm.consumed[s], (ig & 1) ^ 1)
            T.tma_copy(pool.codes[slot, hv, :, :], sm.codes[s, :, :], barrier=sm.loaded[s])
            T.tma_copy(pool.s_kv[slot, hv, :], sm.scales[s, :], barrier=sm.loaded[s])
            T.tma_copy(pool.kbuf[slot, hv, :, 0:K // 2], sm.keys[s, 0, :, :], barrier=sm.loaded[s])
            T.tma_copy(pool.kbuf[slot, hv, :, K // 2:K], sm.keys[s, 1, :, :], barrier=sm.loaded[s])
            T.tma_copy(pool.ubuf[slot, hv, :, 0:V // 2], sm.updates[s, 0, :, :], barrier=sm.loaded[s])
            T.tma_copy(pool.ubuf[slot, hv, :, V // 2:V], sm.updates[s, 1, :, :], barrier=sm.loaded[s])
            T.tma_copy(pool.w[slot, hv, :], sm.weights[s, 0:L], barrier=sm.loaded[s])
            for cb in T.unroll(4):
                T.tma_copy(pool.uq[slot, hv, :, cb * 64:(cb + 1) * 64], sm.factors[s, cb, 0:R, :],
                           barrier=sm.loaded[s])
            if KDA:
                T.tma_copy(pool.gbuf[slot, hv, :, 0:K // 2], sm.keys_lo[s, 0, :, :], barrier=sm.loaded[s])
                T.tma_copy(pool.gbuf[slot, hv, :, K // 2:K], sm.keys_lo[s, 1, :, :], barrier=sm.loaded[s])
                T.tma_copy(pool.pcum[slot, hv, :], sm.pcum[s, :], barrier=sm.loaded[s])
            T.mbarrier_arrive(sm.loaded[s])

    # ---- consumer: set-up and hand-over of a program ----
    # each Regs array's (length, dtype), in the order they are allocated; KDA and GDN swap the A and B fragments'
    # lengths (KDA's ring product keeps the keys as B)
    reg_shapes = dict(row_scale=(4, F32), col_scale=(16, F32), afrag=(16 if KDA else 32, BF16),
                      bfrag=(32 if KDA else 16, BF16), cfrag=(64, F32), afrag2=(8, F16), afrag3=(8, F16),
                      bfr=(8, F16), ah=(32, F16), bh2=(8, F16), ao=(16, F16), aone=(8, F16), c32=(16, F32),
                      mc=(4, F32), mm=(8, F32), colp=(32, F32), esc=(2, F32), lo2=(L if KDA else 1, BF16))

    @T.macro
    def consumer_registers(th: Thread, sm: Shared):
        """Allocate the thread's :class:`Regs`, set their constant parts and zero the Q tile's columns R..7."""
        g, t = th.g, th.t
        # named as the fields, as an assignment would name them (the CUDA source keeps readable names)
        regs = Regs(**{name: IRBuilder.name(name, T.alloc_local((size,), dtype))
                       for name, (size, dtype) in reg_shapes.items()})
        for i in T.unroll(8):
            regs.aone[i] = T.cast(1.0, F16)
        for i in T.unroll(2):  # register pairs 1 and 3 of the old-factor fragments (m-rows 8..15) stay zero
            regs.ao[2 + i] = T.cast(0.0, F16)
            regs.ao[6 + i] = T.cast(0.0, F16)
            regs.ao[10 + i] = T.cast(0.0, F16)
            regs.ao[14 + i] = T.cast(0.0, F16)
        for r in T.unroll(4):  # this thread's row of the fp16 Q tile: columns R..7 stay zero
            sm.state[g, t, K + 4 + r] = T.cast(0.0, F16)
        for r in T.unroll(4 - R):
            sm.state[g, t, K + R + r] = T.cast(0.0, F16)
        return regs

    @T.macro
    def wait_program(th: Thread, sm: Shared, it0):
        """The group's program number ``it0`` as ``(slot, hv)``, once the producer has loaded its stage."""
        q = sm.due_list[th.g + it0 * NCG]
        hv = q % HV
        T.mbarrier_wait_parity(sm.loaded[th.g], it0 & 1)
        slot = q // HV
        return slot, hv

    @T.macro
    def ring_has_entries(th: Thread, sm: Shared, pool: PoolViews, slot, hv, live: T.Buffer):
        """``live[0]`` nonzero iff the program's ring holds something since its last flush: a nonzero weight, or the
        checkpoint's scale not the identity (KDA pcum from the stage, GDN pcum from the pool). Every thread of the group
        reads every value itself (broadcast reads of the stage), so the result is the group's without a reduction; NaN
        counts as something."""
        live[0] = 0
        for j in T.unroll(L):
            live[0] = live[0] | T.if_then_else(sm.weights[th.g, j] != 0.0, 1, 0)
        if live[0] == 0:  # the scale only for a ring without weights (rare: right after a flush)
            if KDA:
                for c in T.unroll(K):
                    live[0] = live[0] | T.if_then_else(sm.pcum[th.g, c] != 0.0, 1, 0)
            else:
                live[0] = live[0] | T.if_then_else(pool.pcum[slot, hv, 0] != 1.0, 1, 0)

    # ---- SPEC §3 steps 1-4, the rebuild: B = the state minus the old rank-R part, fp16 into state_shared ----
    @T.macro
    def decay_ring_keys(th: Thread, sm: Shared, rg: Regs):
        """KDA, thread per key column c = t: the decayed keys kd = w_j k_j d_j as bf16 hi (over the keys) + lo (over
        the decay factors) + lo2 (registers: the bits beyond hi + lo, so that the three pieces sum to the fp32 kd);
        pc = exp(pcum) to decay_shared; pc U_old^T in fp16 into the factor stage's rows R..2R-1."""
        g, t = th.g, th.t
        decay = T.alloc_local((L,), F32)  # this column's per-entry decay factors
        dcur = T.alloc_local((1,), F32)
        pcc = T.exp(sm.pcum[g, t])
        sm.decay[g, t] = pcc
        for jj in T.unroll(L):
            decay[jj] = T.cast(T.reinterpret(ring_at(sm.keys_lo, g, jj, t), F16), F32)
        group_sync(th)  # every lane holds its factors before the lo tile overwrites them
        dcur[0] = 1.0
        for jj in T.unroll(L):  # backward: d_{L-1} = 1, d_j = d_{j+1} e_{j+1}
            j = L - 1 - jj
            kd = T.cast(ring_at(sm.keys, g, j, t), F32) * (sm.weights[g, j] * dcur[0])
            khi = T.cast(kd, BF16)
            klo = T.cast(kd - T.cast(khi, F32), BF16)
            sm.keys[g, t // (K // 2), j, t % (K // 2)] = khi
            sm.keys_lo[g, t // (K // 2), j, t % (K // 2)] = klo
            # kd - hi and (kd - hi) - lo are exact in fp32 (each piece is kd's leading bits, rounded)
            rg.lo2[j] = T.cast(kd - T.cast(khi, F32) - T.cast(klo, F32), BF16)
            dcur[0] = dcur[0] * decay[j]
        # fp16 is enough for pc U^T: only the subspace iteration reads it (fp16 products); the residual takes the
        # unscaled rows 0..R-1
        for r in T.unroll(R):
            sm.factors[g, t // 64, R + r, t % 64] = T.cast(T.cast(factor(sm, g, r, t), F32) * pcc, F16)
        group_sync(th)

    @T.macro
    def load_row_scales(th: Thread, sm: Shared, rg: Regs, pn):
        """``row_scale`` = s_v / QMAX x ``pn`` (KDA: 1.0) of this lane's 4 accumulator rows."""
        for i in T.unroll(4):
            rg.row_scale[i] = sm.scales[th.g, K + acc_row(th.wp, i, th.r0)] * (pn / QMAX)

    @T.macro
    def load_col_scales(h, th: Thread, sm: Shared, rg: Regs, decayed: bool):
        """``col_scale`` = s_k (``decayed``: x pc) of this lane's 16 columns of half h."""
        for ntl in T.unroll(8):
            for c1 in T.vectorized(2):
                if decayed:
                    rg.col_scale[ntl * 2 + c1] = sm.scales[th.g, acc_col(h, ntl, th.q4, c1)] \
                        * sm.decay[th.g, acc_col(h, ntl, th.q4, c1)]
                else:
                    rg.col_scale[ntl * 2 + c1] = sm.scales[th.g, acc_col(h, ntl, th.q4, c1)]

    @T.macro
    def ring_a_fragments(th: Thread, sm: Shared, rg: Regs):
        """The ring's A operand, the values u_j of this warp's rows v: ``[m = v][k = j]`` fragments of two m-tiles."""
        g, wp, lane, q4 = th.g, th.wp, th.lane, th.q4
        afrag = rg.afrag
        if KDA:  # exact bf16 values (the weights and decays sit in the keys)
            for mt in T.unroll(2):
                ldmatrix(True, 4, value_rows(sm, g, wp * 32 + mt * 16, lane), afrag[mt * 8])
        else:  # GDN: w_j u_j split into bf16 hi (afrag[16 mt ..]) + lo (afrag[16 mt + 8 ..])
            araw = T.alloc_local((8,), BF16)
            wv = T.alloc_local((4,), F32)
            for i in T.unroll(4):
                wv[i] = sm.weights[g, 2 * q4 + (i % 2) + 8 * (i // 2)]
            for mt in T.unroll(2):
                ldmatrix(True, 4, value_rows(sm, g, wp * 32 + mt * 16, lane), araw[0])
                for i in T.unroll(8):
                    wu = wv[(i % 2) + 2 * (i // 4)] * T.cast(araw[i], F32)
                    afrag[mt * 16 + i] = T.cast(wu, BF16)
                    afrag[mt * 16 + 8 + i] = T.cast(wu - T.cast(afrag[mt * 16 + i], F32), BF16)

    @T.macro
    def dequantise_half(h, th: Thread, sm: Shared, rg: Regs):
        """The dequantised checkpoint into the accumulator half h: cfrag = C[v, c] (s_v[v] x) (s_k[c] x)."""
        g, wp, r0, q4 = th.g, th.wp, th.r0, th.q4
        qw = T.alloc_local((2,), I32)
        for rr in T.unroll(4):
            v0 = acc_row(wp, rr, r0)
            for jcl in T.unroll(4):  # 16-column chunk = n-tiles 2 jc, 2 jc + 1; lane q4 needs word q4 // 2 of each
                jc = h * 4 + jcl
                for nn in T.unroll(2):
                    qw[nn] = sm.codes[g, v0, jc * 4 + nn * 2 + q4 // 2]
                for nn in T.unroll(2):
                    ntl = jcl * 2 + nn
                    pkw = qw[nn] ^ T.int32(CODE_SIGN_FLIP)
                    # byte -> fp32 via the 2^23 magic number; the subtraction must stay a separate exact fp32 op:
                    # folding -K * skl into an FFMA costs ulp(2^23 skl) = half a code
                    for c1 in T.unroll(2):
                        x = T.reinterpret(byte_perm(pkw, T.int32(F32_TWO23), T.int32(BYTE_TO_F32) + (q4 % 2) * 2 + c1),
                                          F32) - TWO23_PLUS_BIAS
                        rg.cfrag[cf(ntl, rr) + c1] = x * rg.row_scale[rr] * rg.col_scale[ntl * 2 + c1]

    @T.macro
    def ring_product_half(h, th: Thread, sm: Shared, rg: Regs, with_lo2: bool = False):
        """The ring's product into the accumulator half h: cfrag += U_ring^T fragments x decayed keys (``B[k = j][n =
        c]`` from the key tiles; KDA: the hi and lo key tiles, GDN: the hi and lo value fragments). ``with_lo2`` (KDA's
        residual) adds the lo2 tile that store_factors parks in the dead B area of state_shared: rows
        LO2_ROW + 16 (c // 64) + j, columns 64 + c % 64 (272 B row stride: conflict-free ldmatrix rows)."""
        g, lane = th.g, th.lane
        afrag, bfrag, cfrag = rg.afrag, rg.bfrag, rg.cfrag
        for npl in T.unroll(4):
            n0 = (h * 4 + npl) * 16
            bo = (npl % 2) * (16 if KDA else 8)  # alternating fragment registers per unrolled step
            ldmatrix(True, 4, key_cols(sm.keys, g, n0, lane), bfrag[bo])
            if KDA:
                ldmatrix(True, 4, key_cols(sm.keys_lo, g, n0, lane), bfrag[bo + 8])
            for mt in T.unroll(2):
                for nn in T.unroll(2):
                    acc = cf(npl * 2 + nn, mt * 2)
                    if KDA:
                        mma("m16n8k16", "bf16", afrag, mt * 8, bfrag, bo + nn * 4, cfrag, acc)
                        mma("m16n8k16", "bf16", afrag, mt * 8, bfrag, bo + 8 + nn * 4, cfrag, acc)
                    else:
                        mma("m16n8k16", "bf16", afrag, mt * 16, bfrag, bo + nn * 4, cfrag, acc)
                        mma("m16n8k16", "bf16", afrag, mt * 16 + 8, bfrag, bo + nn * 4, cfrag, acc)
        if with_lo2:
            for npl in T.unroll(4):
                n0 = (h * 4 + npl) * 16
                bo = (npl % 2) * 16
                ldmatrix(True, 4, sm.state[g, LO2_ROW + 16 * (n0 // 64) + ldsm_row(lane),
                                           64 + n0 % 64 + ldsm_col(lane, 1)], bfrag[bo])
                for mt in T.unroll(2):
                    for nn in T.unroll(2):
                        mma("m16n8k16", "bf16", afrag, mt * 8, bfrag, bo + nn * 4, cfrag, cf(npl * 2 + nn, mt * 2))

    @T.macro
    def store_half(h, th: Thread, sm: Shared, rg: Regs):
        """The accumulator half h to state_shared as fp16 (stmatrix.x4: matrices (ntl, rows 0-7), (ntl, rows 8-15),
        (ntl + 1, rows 0-7), (ntl + 1, rows 8-15) of m-tile mt; one F2FP.PACK per pair)."""
        g, wp, lane = th.g, th.wp, th.lane
        ph = T.alloc_local((8,), F16)
        for mt in T.unroll(2):
            for npl in T.unroll(4):
                for jj in T.unroll(4):
                    for c1 in T.vectorized(2):
                        ph[jj * 2 + c1] = T.cast(rg.cfrag[cf(npl * 2 + jj // 2, mt * 2 + jj % 2) + c1], F16)
                stmatrix(4, sm.state[g, wp * 32 + mt * 16 + ldsm_row(lane), (h * 8 + npl * 2 + lane // 16) * 8], ph)

    @T.macro
    def rebuild(th: Thread, sm: Shared, rg: Regs, pool: PoolViews, slot, hv):
        """``B`` into state_shared and the iteration's start ``Q0`` into its pad columns. Returns ``pn``: GDN's gate
        product; KDA's 1.0 (its decay sits in the keys and in decay_shared)."""
        g, t = th.g, th.t
        if KDA:
            decay_ring_keys(th, sm, rg)
            load_row_scales(th, sm, rg, 1.0)
            pn = 1.0
        else:
            # floored: a fully decayed head's product underflows to a denormal, and 1 / pn = inf would poison the
            # residual; the floor changes E by at most PNMIN |LoR|
            pn = T.max(pool.pcum[slot, hv, 0], PNMIN)
            load_row_scales(th, sm, rg, pn)
        ring_a_fragments(th, sm, rg)
        for h in T.unroll(2):
            # dequantise first (independent FFMA chains), then the ring's mma accumulates on top
            load_col_scales(h, th, sm, rg, KDA)
            dequantise_half(h, th, sm, rg)
            ring_product_half(h, th, sm, rg)
            store_half(h, th, sm, rg)
        # this thread's row of Q0 (fp16 tile), before the barrier that publishes B
        for r in T.unroll(R):
            sm.state[g, t, K + r] = T.cast(pool.q0[t, r], F16)
        group_sync(th)
        return pn

    # ---- SPEC §3 step 5, the subspace iteration on B (and step 6's U = S^T Q16: the last round's P) ----
    @T.macro
    def add_old_rank(pn, th: Thread, sm: Shared, rg: Regs, col0: int, urow0: int, mrow0: int):
        """P += pn U_old M (P step) or Q += pn Q_old M2 (Q step) in the accumulator fragments: the old rank-R part of
        the state, carried algebraically. M sits in the m16n8 accumulator mc, M[a][n] in lane 4 a + q4; it is shuffled
        to mm[2 a + i] = M[mrow0 + a][2 q4 + i] in every lane. Fragment rows are columns (P) or rows (Q)
        col0 + 32 wp + .. of the factor stage, read from its rows urow0 + a."""
        g, wp, r0, q4 = th.g, th.wp, th.r0, th.q4
        c32, mc, mm = rg.c32, rg.mc, rg.mm
        uo = T.alloc_local((16,), F32)  # old factor entries of this lane's 4 rows
        for a in T.unroll(4):
            mm[a * 2] = T.shfl_sync(mc[0], (mrow0 + a) * 4 + q4)
            mm[a * 2 + 1] = T.shfl_sync(mc[1], (mrow0 + a) * 4 + q4)
        for mt in T.unroll(2):
            for hh in T.unroll(2):
                cc = col0 + wp * 32 + mt * 16 + hh * 8 + r0
                for a in T.unroll(4):
                    uo[(mt * 2 + hh) * 4 + a] = T.if_then_else(a < R, T.cast(factor(sm, g, urow0 + a, cc), F32), 0.0)
                for i in T.unroll(2):
                    c32[mt * 4 + hh * 2 + i] += pn * (
                        uo[(mt * 2 + hh) * 4] * mm[i] + uo[(mt * 2 + hh) * 4 + 1] * mm[2 + i]
                        + uo[(mt * 2 + hh) * 4 + 2] * mm[4 + i] + uo[(mt * 2 + hh) * 4 + 3] * mm[6 + i])

    @T.macro
    def product_p(pn, th: Thread, sm: Shared, rg: Regs):
        """P = B^T Q (K x R, this warp's columns 32 wp ..): ``A[m = c][k = v] = B[v][c]`` via ldmatrix.x4.trans,
        ``B[k = v][n = r]`` = the fp16 Q tile (state_shared pad columns) via ldmatrix.x2.trans; alongside
        M = Q_old^T Q (R x R, A = Q_old^T with m-rows 8..15 zero). Then the fp16 P tile P16[c][r] (columns >= R zero)
        via stmatrix.x2."""
        g, wp, lane, q4 = th.g, th.wp, th.lane, th.q4
        ah, bh2, ao, c32, mc = rg.ah, rg.bh2, rg.ao, rg.c32, rg.mc
        ph = T.alloc_local((4,), F16)
        for i in T.unroll(16):
            c32[i] = 0.0
        for i in T.unroll(4):
            mc[i] = 0.0
        for k0 in T.unroll(V // 16):
            kp = k0 % 2  # alternating fragment registers: the next step's ldmatrix can overlap this step's mma
            ldmatrix(True, 2, sm.state[g, k0 * 16 + ldsm_row(lane), K], bh2[kp * 4])
            for mt in T.unroll(2):
                m0 = wp * 32 + mt * 16
                ldmatrix(True, 4, sm.state[g, k0 * 16 + ldsm_row(lane, 1), m0 + ldsm_col(lane)], ah[(kp * 2 + mt) * 8])
                # two accumulator chains (even / odd k-steps)
                mma("m16n8k16", "fp16", ah, (kp * 2 + mt) * 8, bh2, kp * 4, c32, (k0 % 2) * 8 + mt * 4)
            ldmatrix(False, 1, factor(sm, g, lane % 8, K + k0 * 16), ao[kp * 8])
            ldmatrix(False, 1, factor(sm, g, lane % 8, K + k0 * 16 + 8), ao[kp * 8 + 4])
            mma("m16n8k16", "fp16", ao, kp * 8, bh2, kp * 4, mc, 0)
        for i in T.unroll(8):
            c32[i] += c32[8 + i]
        # KEXACT: the pc-scaled U_old sits in factor rows R..2R-1
        add_old_rank(pn, th, sm, rg, 0, R if KEX else 0, 0)
        for mt in T.unroll(2):
            for c1 in T.vectorized(2):
                ph[c1] = T.cast(T.if_then_else(2 * q4 + c1 < R, c32[mt * 4 + c1], 0.0), F16)
                ph[2 + c1] = T.cast(T.if_then_else(2 * q4 + c1 < R, c32[mt * 4 + 2 + c1], 0.0), F16)
            stmatrix(2, sm.newf_flat[g, p16_index(wp * 32 + mt * 16 + ldsm_row(lane))], ph)
        group_sync(th)

    @T.macro
    def product_q(pn, th: Thread, sm: Shared, rg: Regs):
        """Q = B P (V x R, this warp's rows 32 wp ..): ``A[m = v][k = c] = B[v][c]`` via ldmatrix.x4,
        ``B[k = c][n = r]`` = P16 via ldmatrix.x2.trans; alongside M2 = U_old^T P. The fp32 rows of Q go to the
        Q plane for the CholeskyQR."""
        g, wp, lane, r0, q4 = th.g, th.wp, th.lane, th.r0, th.q4
        ah, bh2, ao, c32, mc = rg.ah, rg.bh2, rg.ao, rg.c32, rg.mc
        for i in T.unroll(16):
            c32[i] = 0.0
        for i in T.unroll(4):
            mc[i] = 0.0
        for k0 in T.unroll(K // 16):
            kp = k0 % 2
            ldmatrix(True, 2, sm.newf_flat[g, p16_index(k0 * 16 + ldsm_row(lane))], bh2[kp * 4])
            for mt in T.unroll(2):
                m0 = wp * 32 + mt * 16
                ldmatrix(False, 4, sm.state[g, m0 + ldsm_row(lane), k0 * 16 + ldsm_col(lane, 1)], ah[(kp * 2 + mt) * 8])
                mma("m16n8k16", "fp16", ah, (kp * 2 + mt) * 8, bh2, kp * 4, c32, (k0 % 2) * 8 + mt * 4)
            ldmatrix(False, 1, factor(sm, g, lane % 8, k0 * 16), ao[kp * 8])
            ldmatrix(False, 1, factor(sm, g, lane % 8, k0 * 16 + 8), ao[kp * 8 + 4])
            mma("m16n8k16", "fp16", ao, kp * 8, bh2, kp * 4, mc, 0)
        for i in T.unroll(8):
            c32[i] += c32[8 + i]
        # KEXACT: M2 rows R..2R-1 are (pc U_old)^T P
        add_old_rank(pn, th, sm, rg, K, 0, R if KEX else 0)
        if q4 * 2 < R:
            for mt in T.unroll(2):
                sm.qrows[g, 0, wp * 32 + mt * 16 + r0, 2 * q4] = c32[mt * 4]
                sm.qrows[g, 0, wp * 32 + mt * 16 + r0, 2 * q4 + 1] = c32[mt * 4 + 1]
                sm.qrows[g, 0, wp * 32 + mt * 16 + r0 + 8, 2 * q4] = c32[mt * 4 + 2]
                sm.qrows[g, 0, wp * 32 + mt * 16 + r0 + 8, 2 * q4 + 1] = c32[mt * 4 + 3]
        group_sync(th)

    @T.macro
    def cholesky_qr2(th: Thread, sm: Shared):
        """CholeskyQR2 of Q, thread per row v = t, both passes in fp32 with the pivot floors (SPEC §3 step 5): an fp16
        Gram breaks down after a floored pivot (docs/DESIGN.md, "TileLang: the seed's warp-specialised design"). The
        Gram matrix by a warp-shuffle tree plus per-warp partials in colsum_shared row 4 (free during the iteration).
        The orthonormal Q leaves as the fp16 Q tile in the state_shared pad columns."""
        g, t, wp, lane = th.g, th.t, th.wp, th.lane
        qrow = T.alloc_local((4,), F32)  # this thread's row of Q
        gram = T.alloc_local((10,), F32)  # packed lower triangle: (0,0) (1,0) (1,1) (2,0) (2,1) (2,2) (3,0) .. (3,3)
        chol = T.alloc_local((10,), F32)  # Cholesky factor, same packing, reciprocals on the diagonal
        for r in T.unroll(4):
            qrow[r] = T.if_then_else(r < R, sm.qrows[g, 0, t, r], 0.0)
        for cq in T.serial(2):
            for r in T.unroll(4):
                for c in T.unroll(r + 1):
                    gram[r * (r + 1) // 2 + c] = qrow[r] * qrow[c]
            for off in T.unroll(5):
                for i in T.unroll(10):
                    gram[i] += T.shfl_xor(gram[i], 16 >> off)
            if lane == 0:
                for i in T.unroll(10):
                    sm.colsum[g, 4, wp * 16 + i] = gram[i]
            group_sync(th)
            for i in T.unroll(10):
                gram[i] = sm.colsum[g, 4, i] + sm.colsum[g, 4, 16 + i] + sm.colsum[g, 4, 32 + i] \
                    + sm.colsum[g, 4, 48 + i]
            chol[0] = T.rsqrt(T.max(gram[0], TINY))
            chol[1] = gram[1] * chol[0]
            chol[2] = inv_pivot(gram[2] - chol[1] * chol[1], gram[2])
            chol[3] = gram[3] * chol[0]
            chol[4] = (gram[4] - chol[3] * chol[1]) * chol[2]
            chol[5] = inv_pivot(gram[5] - chol[3] * chol[3] - chol[4] * chol[4], gram[5])
            chol[6] = gram[6] * chol[0]
            chol[7] = (gram[7] - chol[6] * chol[1]) * chol[2]
            chol[8] = (gram[8] - chol[6] * chol[3] - chol[7] * chol[4]) * chol[5]
            chol[9] = inv_pivot(gram[9] - chol[6] * chol[6] - chol[7] * chol[7] - chol[8] * chol[8], gram[9])
            qrow[0] = qrow[0] * chol[0]
            qrow[1] = (qrow[1] - qrow[0] * chol[1]) * chol[2]
            qrow[2] = (qrow[2] - qrow[0] * chol[3] - qrow[1] * chol[4]) * chol[5]
            qrow[3] = (qrow[3] - qrow[0] * chol[6] - qrow[1] * chol[7] - qrow[2] * chol[8]) * chol[9]
            for r in T.unroll(R):
                sm.state[g, t, K + r] = T.cast(qrow[r], F16)  # the next product's (and pass 2's) Q
            group_sync(th)

    # ---- SPEC §3 step 6, the new factors ----
    @T.macro
    def store_factors(th: Thread, sm: Shared, rg: Regs, pool: PoolViews, slot, hv):
        """The new fp16 factors to the pool (U^T[r][c] = P16[c][r], Q^T[r][v] = Q16[v][r]; thread t = c = v) and,
        after a barrier, -U^T over the P / Q planes as the residual mma's B operand (rows R..7 zero)."""
        g, t = th.g, th.t
        uh = T.alloc_local((4,), F16)
        qh = T.alloc_local((4,), F16)
        for r in T.unroll(R):
            uh[r] = sm.newf_flat[g, p16_index(t) + r]
            qh[r] = sm.state[g, t, K + r]
            pool.uq[slot, hv, r, t] = uh[r]
            pool.uq[slot, hv, r, K + t] = qh[r]
        group_sync(th)
        for r in T.unroll(R):
            sm.newf[g, r, t] = -uh[r]  # the residual mma accumulates the subtraction
        for r in T.unroll(8 - R):
            sm.newf[g, R + r, t] = T.cast(0.0, F16)
        if KDA:  # column t of the lo2 tile into the dead B area (see ring_product_half), for the residual
            for j in T.unroll(L):
                sm.state[g, LO2_ROW + 16 * (t // 64) + j, 64 + t % 64] = T.reinterpret(rg.lo2[j], F16)
        group_sync(th)

    # ---- SPEC §3 step 7, the residual E = S - q16 u16^T, over B in state_shared ----
    @T.macro
    def rank_r_product_half(h, th: Thread, sm: Shared, rg: Regs, new: bool):
        """A rank-R product into the accumulator half h, m16n8k8 over k = r (B's rows R.. zero): ``new`` False,
        cfrag += Q_old U_old^T (A = Q_old^T, B = the U_old rows of the factor stage); ``new`` True, cfrag += Q (-U^T)
        (A = Q16, B = -U^T from newf_shared)."""
        g, lane = th.g, th.lane
        for npl in T.unroll(4):
            n0 = (h * 4 + npl) * 16
            if new:
                ldmatrix(True, 2, sm.newf[g, lane % 8, n0 + ldsm_col(lane)], rg.bfr[(npl % 2) * 4])
            else:
                ldmatrix(True, 2, sm.factors[g, n0 // 64, lane % 8, n0 % 64 + ldsm_col(lane)], rg.bfr[(npl % 2) * 4])
            for mt in T.unroll(2):
                for nn in T.unroll(2):
                    mma("m16n8k8", "fp16", rg.afrag3 if new else rg.afrag2, mt * 4, rg.bfr, (npl % 2) * 4 + nn * 2,
                        rg.cfrag, cf(npl * 2 + nn, mt * 2))

    @T.macro
    def residual_half(h, pn, th: Thread, sm: Shared, rg: Regs):
        """The residual's half h into cfrag (rows of this warp, columns 64 h ..).

        KDA (KEXACT): E = (deq(C) + Q_old U_old^T) diag(pc) + ring - Q U^T, every term in fp32 from the stage (B read
        back from the fp16 state_shared would lose accuracy). GDN: E = pn (B / pn + Q_old U_old^T) - Q U^T, the
        accumulator starting from B (ldmatrix.x4 in the fragment layout) so that both rank-R mma chains accumulate
        straight into it."""
        g, wp, lane, q4 = th.g, th.wp, th.lane, th.q4
        cfrag = rg.cfrag
        if KEX:
            pcl = T.alloc_local((16,), F32)  # pc of this lane's columns
            load_col_scales(h, th, sm, rg, False)
            dequantise_half(h, th, sm, rg)
        else:
            efrag = T.alloc_local((8,), F16)  # B of (ntl, rows 0-7), (ntl, rows 8-15), (ntl + 1, ..) from ldmatrix.x4
            rpn = 1.0 / pn
            for mt in T.unroll(2):
                for npl in T.unroll(4):
                    ldmatrix(False, 4, sm.state[g, wp * 32 + mt * 16 + ldsm_row(lane),
                                                (h * 8 + npl * 2 + lane // 16) * 8], efrag[0])
                    for jj in T.unroll(4):
                        for c1 in T.unroll(2):
                            cfrag[cf(npl * 2 + jj // 2, mt * 2 + jj % 2) + c1] = T.cast(efrag[jj * 2 + c1], F32) * rpn
        rank_r_product_half(h, th, sm, rg, False)  # + Q_old U_old^T
        if KEX:
            for nt in T.unroll(8):
                for c1 in T.unroll(2):
                    pcl[nt * 2 + c1] = sm.decay[g, h * 64 + nt * 8 + 2 * q4 + c1]
                for mr in T.unroll(4):
                    for c1 in T.unroll(2):
                        cfrag[cf(nt, mr) + c1] = cfrag[cf(nt, mr) + c1] * pcl[nt * 2 + c1]
            ring_product_half(h, th, sm, rg, True)
        else:
            for i in T.unroll(64):
                cfrag[i] = cfrag[i] * pn
        rank_r_product_half(h, th, sm, rg, True)  # - Q U^T

    @T.macro
    def scale_residual_half(h, rg: Regs):
        """KEXACT: scale cfrag by 2^e per (warp, half) so that the block maximum of |E| lands in [2^14, 2^15): a tiny
        head keeps 11 significant bits in fp16 instead of sinking into subnormals. esc[h] = 2^-e undoes it exactly in
        the column sums and the quantisation."""
        cfrag = rg.cfrag
        emx = T.alloc_local((1,), F32)
        emx[0] = 0.0
        for i in T.unroll(64):
            emx[0] = T.max(emx[0], T.abs(cfrag[i]))
        for i in T.unroll(5):
            emx[0] = T.max(emx[0], T.shfl_xor(emx[0], 1 << i))
        ebx = T.min(T.max(268 - ((T.reinterpret(emx[0], I32) >> 23) & 255), 2), 252)
        rg.esc[h] = T.reinterpret((254 - ebx) << 23, F32)  # 2^-e
        emx[0] = T.reinterpret(ebx << 23, F32)  # 2^e
        for i in T.unroll(64):
            cfrag[i] = cfrag[i] * emx[0]

    @T.macro
    def column_sums_half(h, th: Thread, sm: Shared, rg: Regs):
        """Column partials of |E| over this warp's 32 rows on the tensor cores (half h's 8 n-tiles) into colp:
        C[m][c] = sum_v 1 * |E[v][c]| with A = ones and B = |E| read back from the fp16 E tile (ldmatrix.x2.trans and
        a sign-bit clear), accumulated into the dead cfrag; every m-row of C holds the sums, no shuffles."""
        g, wp, lane = th.g, th.wp, th.lane
        bh2, cfrag = rg.bh2, rg.cfrag
        bhi = T.alloc_local((4,), I32)
        T.sync_warp()
        for i in T.unroll(32):
            cfrag[i] = 0.0
        for ntl in T.unroll(8):
            for ks in T.unroll(2):
                ldmatrix(True, 2, sm.state[g, wp * 32 + ks * 16 + ldsm_row(lane), (h * 8 + ntl) * 8], bh2[ks * 4])
            for i in T.unroll(4):
                bhi[i] = T.reinterpret(bh2[i * 2:i * 2 + 2], I32) & T.int32(0x7FFF7FFF)
            for ks in T.unroll(2):
                mma("m16n8k16", "fp16", rg.aone, 0, bhi, ks * 2, cfrag, ntl * 4)
        for ntl in T.unroll(8):
            for c1 in T.unroll(2):
                if KEX:
                    rg.colp[(h * 8 + ntl) * 2 + c1] = cfrag[ntl * 4 + c1] * rg.esc[h]
                else:
                    rg.colp[(h * 8 + ntl) * 2 + c1] = cfrag[ntl * 4 + c1]

    @T.macro
    def residual(th: Thread, sm: Shared, rg: Regs, pn):
        """E in place of B in state_shared (fp16; KEXACT: scaled by 2^e per warp and half), and the column partials of
        |E| in colp."""
        g, wp, lane = th.g, th.wp, th.lane
        for mt in T.unroll(2):
            # A[m = v][k = r] = Q_old^T[r][v]: x2.trans -> (m 0-7), (m 8-15) of k-rows 0-7
            ldmatrix(True, 2, factor(sm, g, lane % 8, K + wp * 32 + mt * 16 + ldsm_col(lane)), rg.afrag2[mt * 4])
            # A[m = v][k = r] = Q16[v][r] (row-major, k 0-7): x2 -> rows 0-7, rows 8-15
            ldmatrix(False, 2, sm.state[g, wp * 32 + mt * 16 + ldsm_row(lane), K], rg.afrag3[mt * 4])
        if KEX:  # the ring's A fragments again (the rebuild's registers are long dead)
            load_row_scales(th, sm, rg, 1.0)
            ring_a_fragments(th, sm, rg)
        for h in T.unroll(2):
            residual_half(h, pn, th, sm, rg)
            if KEX:
                scale_residual_half(h, rg)
            if KDA and h == 1:
                group_sync(th)  # every warp has read the lo2 tile that E half 1 covers
            store_half(h, th, sm, rg)
            column_sums_half(h, th, sm, rg)

    @T.macro
    def release_stage(th: Thread, sm: Shared):
        """The residual's mma operands (newf_shared, the factor stage) are consumed: newf_shared may take the column
        partials, and the stage goes back to the producer."""
        group_sync(th)
        T.fence_proxy_async()
        T.mbarrier_arrive(sm.consumed[th.g])

    # ---- SPEC §3 step 8, the column scales ----
    @T.macro
    def column_scales(th: Thread, sm: Shared, rg: Regs, pool: PoolViews, slot, hv):
        """The warps' partials to colsum_shared rows 0..3; then, thread per column c = t, s_k = max(sqrt(mean_v |E|),
        EPS) to the pool and its reciprocal to colsum_shared row 6 (free once the partials are read)."""
        g, t, wp, q4 = th.g, th.t, th.wp, th.q4
        if th.r0 == 0:
            for nt in T.unroll(16):
                for c1 in T.vectorized(2):
                    sm.colsum[g, wp, nt * 8 + q4 * 2 + c1] = rg.colp[nt * 2 + c1]
        group_sync(th)
        msum = (sm.colsum[g, 0, t] + sm.colsum[g, 1, t] + sm.colsum[g, 2, t] + sm.colsum[g, 3, t]) * (1.0 / V)
        rskn = T.min(T.rsqrt(msum), 1.0 / EPS)  # 1 / max(sqrt(m), EPS) without the IEEE division slow path
        pool.s_k[slot, hv, t] = T.max(T.sqrt(msum), EPS)
        sm.colsum[g, 6, t] = rskn
        group_sync(th)

    # ---- SPEC §3 step 9, the row scales and codes ----
    @T.macro
    def quantise_rows(th: Thread, sm: Shared, rg: Regs, pool: PoolViews, slot, hv):
        """Warp wp takes rows 32 wp .., 8 lanes per row (16 columns each), 4 rows per pass: the row max over the 8
        lanes is s_v; the int8 codes are packed in registers (rounded half to even by ROUND_MAGIC) and stored with one
        coalesced 16 B store per lane and row."""
        g, wp, lane = th.g, th.wp, th.lane
        esc = rg.esc
        rk = T.alloc_local((16,), F32)  # this lane's 16 reciprocal column scales
        eh = T.alloc_local((32,), F16)  # 2 x 2 x 8 halfwords of E (alternating per row pass)
        ex = T.alloc_local((16,), F32)  # this lane's 16 scaled residual values of the row
        rmax = T.alloc_local((2,), F32)  # row max (= s_v), then QMAX / s_v
        qw = T.alloc_local((4,), I32)
        for i in T.unroll(4):
            for c1 in T.vectorized(4):
                if KEX:  # lanes 0-3 hold columns of half 0, lanes 4-7 of half 1
                    rk[i * 4 + c1] = sm.colsum[g, 6, (lane % 8) * 16 + i * 4 + c1] * T.if_then_else(
                        lane % 8 < 4, esc[0], esc[1])
                else:
                    rk[i * 4 + c1] = sm.colsum[g, 6, (lane % 8) * 16 + i * 4 + c1]
        # two passes per trip (eh alternates): a first program fetches this code cold (DESIGN, "Reliability")
        for ii in T.unroll(4, unroll_factor=1):
            for ip in T.unroll(2):
                i = ii * 2 + ip
                v0 = wp * 32 + i * 4 + lane // 8
                rmax[0] = 0.0
                for hh in T.unroll(2):
                    for c1 in T.vectorized(8):
                        eh[(ip * 2 + hh) * 8 + c1] = sm.state[g, v0, (lane % 8) * 16 + hh * 8 + c1]
                for hh in T.unroll(2):
                    for c1 in T.unroll(8):
                        ex[hh * 8 + c1] = T.cast(eh[(ip * 2 + hh) * 8 + c1], F32) * rk[hh * 8 + c1]
                        rmax[0] = T.max(rmax[0], T.abs(ex[hh * 8 + c1]))
                rmax[0] = T.max(rmax[0], T.shfl_xor(rmax[0], 1))
                rmax[0] = T.max(rmax[0], T.shfl_xor(rmax[0], 2))
                rmax[0] = T.max(rmax[0], T.shfl_xor(rmax[0], 4))
                rmax[0] = T.max(rmax[0], EPS)
                rmax[1] = QMAX * T.call_extern(F32, "__frcp_rn", rmax[0])
                if lane % 8 == 0:
                    pool.s_v[slot, hv, v0] = rmax[0]
                for c1 in T.unroll(4):
                    qw[c1] = byte_perm(
                        byte_perm(T.reinterpret(ex[c1 * 4] * rmax[1] + ROUND_MAGIC, I32),
                                  T.reinterpret(ex[c1 * 4 + 1] * rmax[1] + ROUND_MAGIC, I32), T.int32(PACK_LOW_BYTES)),
                        byte_perm(T.reinterpret(ex[c1 * 4 + 2] * rmax[1] + ROUND_MAGIC, I32),
                                  T.reinterpret(ex[c1 * 4 + 3] * rmax[1] + ROUND_MAGIC, I32), T.int32(PACK_LOW_BYTES)),
                        T.int32(PACK_LOW_HALVES))
                for c1 in T.vectorized(4):
                    pool.codes[slot, hv, v0, (lane % 8) * 4 + c1] = qw[c1]

    # ---- SPEC §3 step 10: the stores are in the phases above; what remains is the ring reset of SPEC §2 ----
    @T.macro
    def reset_ring(th: Thread, pool: PoolViews, slot, hv):
        """Empty the ring: w = 0; KDA pcum = 0, gbuf = fp16 1.0; GDN pcum = 1. hcnt stays at L ("flushed, ring empty"
        for the step kernels): resetting it here would change the due flags that other CTAs are still scanning."""
        t = th.t
        if t < L:
            pool.w[slot, hv, t] = 0.0
        if KDA:
            pool.pcum[slot, hv, t] = 0.0
            for jj in T.unroll(L):
                pool.gbuf[slot, hv, jj, t] = T.reinterpret(T.cast(1.0, F16), BF16)
        else:
            if t == 0:
                pool.pcum[slot, hv, 0] = 1.0

    @T.prim_func
    def flush(
        codes: T.StridedTensor((NS, HV, V, KW), (SS, HS, KW, 1), I32),
        s_k: T.StridedTensor((NS, HV, K), (SS, HS, 1), F32),
        s_v: T.StridedTensor((NS, HV, V), (SS, HS, 1), F32),
        s_kv: T.StridedTensor((NS, HV, K + V), (SS, HS, 1), F32),
        kbuf: T.Tensor((NS, HV, L, K), BF16),
        ubuf: T.Tensor((NS, HV, L, V), BF16),
        w: T.Tensor((NS, HV, L), F32),
        pcum: T.Tensor((NS, HV, K if KDA else 1), F32),
        # fp16 decay factors declared bf16 so that the TMA target (keys_lo_shared) matches; the bits are reinterpreted
        gbuf: T.Tensor((NS, HV, L, K) if KDA else (1, 1, 1, 1), BF16),
        hcnt: T.Tensor((NS, HV), I32),
        uq: T.StridedTensor((NS, HV, R, K + V), (2 * SS, 2 * HS, K + V, 1), F16),  # U^T | Q^T rows
        q0: T.Tensor((V, R), F32),  # the fixed start of the subspace iteration
        idx: T.Tensor((N,), I32),
    ):
        with T.Kernel(sms, threads=NT) as bid:
            # the stage of a program (one per group), filled by TMA
            codes_shared = T.alloc_shared((NCG, V, KW), I32)
            scales_shared = T.alloc_shared((NCG, K + V), F32)  # s_k | s_v
            # two 128 B-wide halves with the 128 B swizzle (conflict-free ldmatrix)
            keys_shared = T.alloc_shared((NCG, 2, L, K // 2), BF16)
            updates_shared = T.alloc_shared((NCG, 2, L, V // 2), BF16)
            weights_shared = T.alloc_shared((NCG, 32), F32)  # 128 B per stage (TMA destination alignment)
            # old factors U^T | Q^T in four 128 B-wide column blocks (swizzled: conflict-free ldmatrix rows), k-rows
            # padded to 8 (rows R.. zero; KEXACT: rows R..2R-1 of the U blocks hold pc U^T)
            factors_shared = T.alloc_shared((NCG, 4, 8, 64), F16)
            # per group: B (fp16) for the iteration, then the residual E in place; columns K.. = the fp16 Q tile
            # (V x 8, columns R.. zero)
            state_shared = T.alloc_shared((NCG, V, KP), F16)
            # per group: the new -U^T (rows R.. zero) for the residual mma; aliased by the fp32 Q rows (plane 0),
            # the fp16 P tile (at P16OFF) and the column partials of |E| (rows 0..3, Gram partials row 4, reciprocal
            # column scales row 6)
            newf_shared = T.alloc_shared((NCG, 8, KV8), F16)
            qrows_shared = T.view(newf_shared, (NCG, 2, KV8 // 2, 4), F32)
            newf_flat = T.view(newf_shared, (NCG, 8 * KV8), F16)
            colsum_shared = T.view(newf_shared, (NCG, 8, KV8 // 2), F32)
            due_list = T.alloc_shared((MAXIT,), I32)  # this CTA's due programs (rank == bid mod SMS), rank order
            due_count = T.alloc_shared((1,), I32)
            warp_due = T.alloc_shared((NWARPS,), I32)  # per-warp due counts of the compaction
            # over state_shared, which no one touches before the compaction's last barrier
            first_row = T.view(state_shared, (NCG * V * KP // 2,), I32)
            if KDA:
                # the decay factors (TMA target, fp16 bits), then the lo part of the decayed keys
                keys_lo_shared = T.alloc_shared((NCG, 2, L, K // 2), BF16)
                pcum_shared = T.alloc_shared((NCG, K), F32)
                decay_shared = T.alloc_shared((NCG, K), F32)  # pc = exp(pcum) per group
            else:
                keys_lo_shared = None
                pcum_shared = None
                decay_shared = None
            loaded = T.alloc_barrier([PRODUCER_THREADS] * NCG)
            consumed = T.alloc_barrier([GROUP_THREADS] * NCG)
            swizzled = [codes_shared, keys_shared, updates_shared, keys_lo_shared, factors_shared] if KDA \
                else [codes_shared, keys_shared, updates_shared, factors_shared]
            T.annotate_layout({buf: make_swizzled_layout(buf) for buf in swizzled})
            sm = Shared(codes=codes_shared, scales=scales_shared, keys=keys_shared, updates=updates_shared,
                        weights=weights_shared, factors=factors_shared, keys_lo=keys_lo_shared, pcum=pcum_shared,
                        state=state_shared, newf=newf_shared, qrows=qrows_shared, newf_flat=newf_flat,
                        colsum=colsum_shared, decay=decay_shared, due_list=due_list, due_count=due_count,
                        warp_due=warp_due, first_row=first_row, loaded=loaded, consumed=consumed)
            pool = PoolViews(codes=codes, s_k=s_k, s_v=s_v, s_kv=s_kv, kbuf=kbuf, ubuf=ubuf, w=w, pcum=pcum, gbuf=gbuf,
                             hcnt=hcnt, uq=uq, q0=q0, idx=idx)
            tx = T.get_thread_binding()
            compact_due(pool, sm, bid, tx)
            if tx < PRODUCER_THREADS:
                zero_factor_padding(sm, tx)
            T.sync_threads(14, NT)
            if tx < PRODUCER_THREADS:
                produce(pool, sm)
            else:
                g = (tx - PRODUCER_THREADS) // GROUP_THREADS
                t = (tx - PRODUCER_THREADS) % GROUP_THREADS
                wp = t // 32
                lane = t % 32
                q4 = lane % 4
                r0 = lane // 4
                bar = 8 + g  # the group's named barrier
                th = Thread(g=g, t=t, wp=wp, lane=lane, q4=q4, r0=r0, bar=bar)
                rg = consumer_registers(th, sm)
                live = T.alloc_local((1,), I32)
                for it0 in T.serial(T.ceildiv(due_count[0] - g, NCG)):
                    slot, hv = wait_program(th, sm, it0)
                    ring_has_entries(th, sm, pool, slot, hv, live)
                    if live[0] != 0:  # the same in every thread of the group
                        pn = rebuild(th, sm, rg, pool, slot, hv)  # SPEC §3 steps 1-4
                        for itr in T.serial(ITERS + 1):  # step 5; the last round's P = S^T Q16 is step 6's U
                            product_p(pn, th, sm, rg)
                            if itr < ITERS:
                                product_q(pn, th, sm, rg)
                                cholesky_qr2(th, sm)
                        store_factors(th, sm, rg, pool, slot, hv)  # step 6
                        residual(th, sm, rg, pn)  # step 7
                        release_stage(th, sm)
                        column_scales(th, sm, rg, pool, slot, hv)  # step 8
                        quantise_rows(th, sm, rg, pool, slot, hv)  # step 9
                        reset_ring(th, pool, slot, hv)  # step 10
                    else:  # flushed already (SPEC §2): nothing is written, the stage goes back
                        release_stage(th, sm)
                    group_sync(th)  # state_shared / newf_shared reuse by the group's next program

    return flush
