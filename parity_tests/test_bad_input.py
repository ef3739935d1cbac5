"""Bad and edge inputs: each case raises a TypeError or ValueError that names the argument, or leaves every byte it
may not write unchanged (compared as bytes: int8 codes read as fp32 can be NaN, and NaN != NaN). SPEC §5,
"Guarantees".

The cases the reliability guarantees were built for, each with a test that failed on the code before them:

1. a second flush with no token in between re-compressed: ``test_flush_twice_changes_nothing``,
   ``test_step_after_flush_is_the_step``;
2. a repeated slot with ``check=False`` was flushed once per repeat: ``test_repeated_slot_is_flushed_once``;
3. tiny states gave NaN in the reference: ``test_fully_decayed_head_compresses_to_zeros``,
   ``test_load_states_of_tiny_states``;
4. the reference rewrote whole pool tensors: ``test_reference_computes_only_the_due_programs``,
   ``test_threads_flushing_disjoint_slots``;
5. ``Pool.from_tensors`` took short, too-small and strided tensors: ``test_from_tensors_refuses``,
   ``test_from_tensors_never_resizes_raw``;
6. a wrong or NaN ``q0``: ``test_bad_q0_is_refused``, ``test_nan_q0_with_check``;
7. ``append`` / ``load_states`` inputs: ``test_append_refuses``, ``test_load_states_refuses``;
8. pickling: ``test_pickled_pool_aliases_raw``;
9. unclear messages: ``test_clear_messages``, ``test_compile_with_check``.

The Triton kernel runs through its interpreter on the CPU (the conftest sets ``TRITON_INTERPRET=1``), on small pools
(64 x 64 heads, two heads), in both of its schedules.
"""

import threading

import pytest
import torch

import leapquant
from leapquant import parity
from leapquant.tools.workloads import fill

from .conftest import backends_here
from .strategies import reloaded

BACKENDS = ["reference"] + (["triton:grid", "triton:list"] if "triton" in backends_here("cpu") else [])
GATES = ["kda", "gdn"]


def _pool(gate="kda", num_slots=6, heads=2, convention="vllm", seed=1, due=None):
    pool = leapquant.Pool(num_slots, heads, 64, 64, 16, 4, gate=gate, convention=convention)
    first = 1 if convention == "vllm" else 0
    fill(pool, list(range(first, num_slots)), "gaussian", torch.Generator().manual_seed(seed), due=due)
    return pool


def _flush(backend, pool, idx, monkeypatch, check=True):
    """``leapquant.flush`` with ``backend`` (``"triton:grid"`` / ``"triton:list"``: that schedule of the kernel)."""
    if backend.startswith("triton:"):
        import leapquant_triton.flush as flush

        monkeypatch.setattr(flush, "schedule_for", lambda rows, heads, s=backend.split(":")[1]: s)
        backend = "triton"
    leapquant.flush(pool, idx, backend=backend, check=check)


def _same_bytes(a: dict, b: dict) -> list[str]:
    return [n for n in a if not torch.equal(a[n], b[n])]


def _shrunk(t, keep_bytes):
    """``t`` (a fresh tensor) with its storage cut to ``keep_bytes``: its shape still says more."""
    t = t.clone()
    t.untyped_storage().resize_(keep_bytes)
    return t


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32)


# --- 1. idempotence ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_flush_twice_changes_nothing(backend, gate, monkeypatch):
    """A flushed ring is empty: flushing it again, with no token in between, writes no byte (it used to compress the
    state again, the error growing flush after flush)."""
    pool = _pool(gate)
    idx = _i32(3, 1, 0, 4)
    _flush(backend, pool, idx, monkeypatch)
    once = parity.snapshot(pool)
    assert _same_bytes(once, parity.snapshot(_pool(gate))), "the first flush must write something"
    _flush(backend, pool, idx, monkeypatch, check=False)
    assert _same_bytes(once, parity.snapshot(pool)) == []


@pytest.mark.parametrize("gate", GATES)
def test_step_after_flush_is_the_step(gate):
    """``step`` on rings a ``flush`` just emptied writes entry 0 without flushing again: the same bytes and output as
    a ``step`` that flushes the full rings itself."""
    B, HV, K, V = 3, 2, 64, 64
    a = _pool(gate, num_slots=B + 1)
    b = parity.twin(a)
    idx = torch.arange(1, B + 1, dtype=torch.int32)
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(B, HV, K, generator=gen), torch.nn.functional.normalize(torch.randn(B, HV, K, generator=gen), dim=-1)
    v = torch.randn(B, HV, V, generator=gen)
    g = -0.1 * torch.rand(*((B, HV, K) if gate == "kda" else (B, HV)), generator=gen)
    beta = torch.rand(B, HV, generator=gen)
    leapquant.flush(a, idx, backend="reference")
    o_a = leapquant.step(a, idx, q, k, v, g, beta, backend="reference")
    o_b = leapquant.step(b, idx, q, k, v, g, beta, backend="reference")
    assert _same_bytes(parity.snapshot(a), parity.snapshot(b)) == []
    assert torch.equal(o_a, o_b)


def test_empty_ring_of_a_new_pool_is_left_alone():
    """A ring in the state a flush leaves (a new pool's: w = 0, pcum = 0) with hcnt = L is not flushed: not a byte
    changes, the poisoned checkpoint included (its state is the checkpoint, whatever it holds)."""
    pool = leapquant.Pool(3, 2, 64, 64, 16, 4)
    pool.codes[1].fill_(9)
    pool.s_kv[1].fill_(float("nan"))
    pool.hcnt.fill_(pool.ring)
    before = parity.snapshot(pool)
    leapquant.flush(pool, _i32(1, 2), backend="reference")
    assert _same_bytes(before, parity.snapshot(pool)) == []


# --- 2. at most once per call -----------------------------------------------------------------------------------


@pytest.mark.parametrize("convention", ["vllm", "sglang"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_repeated_slot_is_flushed_once(backend, convention, monkeypatch):
    """With ``check=False`` a slot named several times is flushed once: the bytes of a flush of the distinct slots
    (on a GPU the repeats were programs writing one region at once)."""
    pool = _pool("kda", convention=convention)
    twin = parity.twin(pool)
    pad = 0 if convention == "vllm" else -1
    _flush(backend, pool, _i32(2, 1, 2, pad, 1, 2), monkeypatch, check=False)
    _flush(backend, twin, _i32(2, 1), monkeypatch)
    assert _same_bytes(parity.snapshot(pool), parity.snapshot(twin)) == []


def test_repeated_slot_is_refused_with_check():
    pool = _pool()
    before = parity.snapshot(pool)
    with pytest.raises(ValueError, match="idx names slots more than once"):
        leapquant.flush(pool, _i32(2, 1, 2), backend="reference")
    assert _same_bytes(before, parity.snapshot(pool)) == []


# --- 3. the whole value range -----------------------------------------------------------------------------------


def _decayed_empty_ring(pool):
    """Every real slot's state decays to about 1e-41 (KDA pcum = -95, below fp32's normal range) with nothing in the
    ring: what a fully decayed head is at its flush."""
    pool.w.zero_()
    pool.pcum.fill_(-95.0)
    pool.hcnt.fill_(pool.ring)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_decayed_head_compresses_to_zeros(backend, monkeypatch):
    """max|S| below 2^-126: finite, all-zero codes and U, s_k = s_v = EPS, in the reference as in the kernel (the
    reference's power-of-two normaliser overflowed to infinity: NaN scales and factors for good)."""
    pool = _pool()
    _decayed_empty_ring(pool)
    _flush(backend, pool, _i32(1, 2), monkeypatch)
    for name in ("s_kv", "uq"):
        assert bool(torch.isfinite(getattr(pool, name)[1:3]).all()), name
    assert int(pool.codes[1:3].abs().max()) == 0
    assert float(pool.u[1:3].abs().max()) == 0.0
    assert bool((pool.s_kv[1:3] == leapquant.EPS).all())


def test_reference_matches_the_kernel_on_tiny_states(monkeypatch):
    if "triton:grid" not in BACKENDS:
        pytest.skip("needs the Triton interpreter")
    a = _pool()
    _decayed_empty_ring(a)
    b = parity.twin(a)
    _flush("reference", a, _i32(1, 2), monkeypatch)
    _flush("triton:grid", b, _i32(1, 2), monkeypatch)
    for name in ("codes", "s_kv", "u"):
        assert torch.equal(getattr(a, name)[1:3], getattr(b, name)[1:3]), name


@pytest.mark.parametrize("scale", [1e-40, 0.0])
def test_load_states_of_tiny_states(scale):
    pool = leapquant.Pool(3, 2, 64, 64, 16, 4)
    S = scale * torch.randn(2, 2, 64, 64, generator=torch.Generator().manual_seed(2))
    pool.load_states([1, 2], S)
    assert bool(torch.isfinite(pool.s_kv[1:3]).all()) and bool(torch.isfinite(pool.uq[1:3]).all())
    assert bool(torch.isfinite(pool.states([1, 2])).all())
    assert float(pool.states([1, 2]).abs().max()) <= 1e-30


# --- 4. the reference writes only the due programs -----------------------------------------------------------------


def test_reference_computes_only_the_due_programs(monkeypatch):
    """Memory and time follow the due programs: 4,000 padding rows with nothing due compute no state (they used to
    rebuild and compress every row, 1.3 GiB at 8,000 rows), and a flush of one due program rebuilds one."""
    from leapquant import reference

    seen = []
    real = reference.rebuild
    monkeypatch.setattr(reference, "rebuild", lambda *a, **k: seen.append(real(*a, **k).shape[:-2]) or real(*a, **k))
    pool = _pool(due=torch.zeros(5, 2, dtype=torch.bool))
    pool.hcnt[3, 1] = pool.ring
    leapquant.flush(pool, torch.zeros(4000, dtype=torch.int32), backend="reference", check=False)
    assert seen == []
    leapquant.flush(pool, _i32(0, 3, 0, 0, 4), backend="reference")
    assert [tuple(s) for s in seen] == [(1,)]


def test_threads_flushing_disjoint_slots():
    """Two threads flushing disjoint slots of one pool at once keep each other's writes (whole-tensor rewrites lost
    them): after every round the pool holds the bytes of the two flushes made one after the other."""
    pool = leapquant.Pool(13, 4, 64, 64, 16, 4)
    gen = torch.Generator().manual_seed(9)
    halves = (_i32(1, 2, 3, 4, 5, 6), _i32(7, 8, 9, 10, 11, 12))
    for round_ in range(16):
        fill(pool, list(range(1, 13)), "gaussian", gen)
        twin = parity.twin(pool)
        for idx in halves:
            leapquant.flush(twin, idx, backend="reference")
        start = threading.Barrier(2)
        errors = []

        def work(idx):
            try:
                start.wait()
                leapquant.flush(pool, idx, backend="reference", check=False)
            except Exception as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(idx,)) for idx in halves]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert _same_bytes(parity.snapshot(pool), parity.snapshot(twin)) == [], f"round {round_}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_poisoned_pool_untouched_outside_the_due_programs(backend, monkeypatch):
    """Random bytes everywhere (NaN included), repeated and padding rows: only the due programs' checkpoints and
    ring resets change, once."""
    pool = leapquant.Pool(7, 2, 64, 64, 16, 4)
    gen = torch.Generator().manual_seed(4)
    for name in parity.POOL_TENSORS:
        if getattr(pool, name) is not None and name != "hcnt":
            iv = getattr(pool, name).view(torch.uint8)
            iv.copy_(torch.randint(0, 256, iv.shape, generator=gen, dtype=torch.uint8))
    due = torch.tensor([[True, False], [True, True]])
    fill(pool, [2, 5], "lowrank", gen, due=due)
    idx = _i32(5, 0, 2, 5, 9, 2)
    rows, heads = pool.due(idx).nonzero(as_tuple=True)
    first = torch.tensor([True, False, True, False, False, False])[rows]  # the first row of each slot
    before = parity.snapshot(pool)
    _flush(backend, pool, idx, monkeypatch, check=False)
    assert parity.untouched_failures(pool, before, idx.long()[rows][first], heads[first]) == []


# --- 5. Pool.from_tensors and the metadata of every call -------------------------------------------------------


def _parts(pool):
    return dict(raw=pool.raw, kbuf=pool.kbuf, ubuf=pool.ubuf, w=pool.w, pcum=pool.pcum, gbuf=pool.gbuf,
                hcnt=pool.hcnt, q0=pool.q0)


def _geometry(pool, **over):
    g = pool.geometry
    kw = dict(num_slots=g.num_slots, heads=g.heads, head_k=g.head_k, head_v=g.head_v, ring=g.ring, rank=g.rank,
              gate=g.gate, convention=pool.convention)
    kw.update(over)
    return kw


FROM_TENSORS_BAD = {
    "short w": (lambda p: dict(w=p.w[:-1]), ValueError, r"\bw must have shape"),
    "short kbuf": (lambda p: dict(kbuf=p.kbuf.reshape(-1)[:-64].reshape(-1, 64)), ValueError, r"\bkbuf must have"),
    "strided w": (lambda p: dict(w=torch.zeros(6, 2, 32)[..., ::2]), ValueError, r"\bw must be contiguous"),
    "short raw": (lambda p: dict(raw=p.raw[:-4]), ValueError, r"\braw must hold"),
    "w as fp64": (lambda p: dict(w=p.w.double()), TypeError, r"\bw must be torch.float32"),
    "hcnt as int64": (lambda p: dict(hcnt=p.hcnt.long()), TypeError, r"\bhcnt must be torch.int32"),
    "gbuf missing (KDA)": (lambda p: dict(gbuf=None), TypeError, r"\bgbuf must be a torch.Tensor"),
    "q0 of another rank": (lambda p: dict(q0=torch.zeros(64, 3)), ValueError, r"\bq0 must have shape"),
    "q0 as fp16": (lambda p: dict(q0=p.q0.half()), TypeError, r"\bq0 must be torch.float32"),
    "q0 on meta": (lambda p: dict(q0=p.q0.to("meta")), ValueError, r"\bq0 must be on cpu"),
    "misaligned raw": (lambda p: dict(raw=torch.zeros(p.raw.numel() + 1)[1:]), ValueError, r"\braw must start at"),
    "pcum over w": (None, ValueError, "overlap"),
    "gate": (lambda p: {}, ValueError, "gate must be"),
}


@pytest.mark.parametrize("case", list(FROM_TENSORS_BAD))
def test_from_tensors_refuses(case):
    """Whatever ``check`` a flush will take, ``from_tensors`` refuses a tensor a kernel would index out of bounds or
    write over another's bytes, naming it (it took them all, and Triton read and wrote past a short ``w``)."""
    pool = _pool()
    make, exc, words = FROM_TENSORS_BAD[case]
    parts = _parts(pool)
    over = {}
    if case == "pcum over w":
        buf = torch.zeros(pool.w.numel() + pool.pcum.numel())
        parts["w"] = buf[:pool.w.numel()].view(pool.w.shape)
        parts["pcum"] = buf[16:16 + pool.pcum.numel()].view(pool.pcum.shape)
    elif case == "gate":
        over = dict(gate="foo")
    else:
        parts.update(make(pool))
    with pytest.raises(exc, match=words):
        leapquant.Pool.from_tensors(**parts, **_geometry(pool, **over))


def test_from_tensors_never_resizes_raw():
    """``num_slots`` larger than ``raw`` holds: refused, and the caller's storage keeps its size and address (setting
    up the views used to grow and move it)."""
    pool = _pool()
    ptr, nbytes = pool.raw.untyped_storage().data_ptr(), pool.raw.untyped_storage().nbytes()
    parts = _parts(pool)
    with pytest.raises(ValueError, match=r"\braw must hold"):
        leapquant.Pool.from_tensors(**parts, **_geometry(pool, num_slots=9))
    assert (pool.raw.untyped_storage().data_ptr(), pool.raw.untyped_storage().nbytes()) == (ptr, nbytes)


def test_storage_shrunk_under_a_tensor():
    pool = _pool()
    w = torch.zeros(pool.w.numel() + 64)
    view = w[64:].view(pool.w.shape)
    w.untyped_storage().resize_(64 * 4)
    with pytest.raises(ValueError, match=r"\bw reaches byte"):
        leapquant.Pool.from_tensors(**{**_parts(pool), "w": view}, **_geometry(pool))


def test_raw_inside_a_larger_buffer():
    """A ``raw`` carved out of a larger allocation (storage offset not 0) works: the views start at its first word,
    and a flush through it writes the bytes a pool of its own would."""
    pool = _pool()
    big = torch.zeros(pool.raw.numel() + 1024)
    raw = big[1024:]
    raw.copy_(pool.raw)
    other = leapquant.Pool.from_tensors(**{**_parts(parity.twin(pool)), "raw": raw}, **_geometry(pool))
    assert other.codes.data_ptr() == raw.data_ptr() + 4 * pool.base
    leapquant.flush(pool, _i32(1, 3), backend="reference")
    leapquant.flush(other, _i32(1, 3), backend="reference")
    assert torch.equal(parity.as_bytes(other.raw), parity.as_bytes(pool.raw))
    assert float(big[:1024].abs().sum()) == 0.0


SPOILED = {
    "short w": (lambda p: setattr(p, "w", p.w[:, :1]), ValueError, r"pool\.w must have shape"),
    "strided w": (lambda p: setattr(p, "w", p.w.transpose(0, 1).contiguous().transpose(0, 1)), ValueError,
                  r"pool\.w must be contiguous"),
    "q0 of another rank": (lambda p: setattr(p, "q0", torch.zeros(64, 2)), ValueError, r"pool\.q0 must have shape"),
    "q0 as fp64": (lambda p: setattr(p, "q0", p.q0.double()), TypeError, r"pool\.q0 must be torch.float32"),
    "codes not of raw": (lambda p: setattr(p, "codes", p.codes.clone()), ValueError, r"pool\.codes must be a view"),
    "s_k shifted": (lambda p: setattr(p, "s_k", p.s_v), ValueError, r"pool\.s_k must be raw's view"),
}


@pytest.mark.parametrize("case", list(SPOILED))
@pytest.mark.parametrize("backend", BACKENDS[:2])
def test_replaced_tensor_is_checked_with_check_false(case, backend, monkeypatch):
    """A pool tensor replaced after construction is checked again before the next launch, with ``check=False`` too
    (metadata only), and nothing is written."""
    pool = _pool()
    make, exc, words = SPOILED[case]
    _flush(backend, pool, _i32(1), monkeypatch, check=False)  # checked and remembered
    make(pool)
    before = parity.snapshot(pool)
    with pytest.raises(exc, match=words):
        _flush(backend, pool, _i32(2, 3), monkeypatch, check=False)
    assert _same_bytes(before, parity.snapshot(pool)) == []


# --- 6. q0 ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(64, 3), (128, 4), (64,)])
def test_bad_q0_is_refused(shape):
    """``Pool(q0=...)`` of the wrong shape is refused (the kernels read it as [V, R]: Triton read past it); a wrong
    dtype is refused where it cannot be converted (``from_tensors``, a replaced ``pool.q0``: the cases above)."""
    with pytest.raises(ValueError, match=r"pool\.q0 must have shape \[64, 4\]"):
        leapquant.Pool(3, 2, 64, 64, 16, 4, q0=torch.zeros(shape))


def test_nan_q0_with_check():
    """``check=True`` reads ``q0``: a NaN start matrix is refused before anything is written (it turned every due
    program into NaN)."""
    pool = _pool()
    pool.q0[3, 1] = float("nan")
    before = parity.snapshot(pool)
    with pytest.raises(ValueError, match=r"pool\.q0 must be finite"):
        leapquant.flush(pool, _i32(1, 2), backend="reference")
    assert _same_bytes(before, parity.snapshot(pool)) == []


# --- 7. append and load_states ----------------------------------------------------------------------------------


def _token(pool, B, gate=None, **over):
    gen = torch.Generator().manual_seed(3)
    HV, K, V = pool.heads, pool.head_k, pool.head_v
    t = dict(k=torch.randn(B, HV, K, generator=gen), v=torch.randn(B, HV, V, generator=gen),
             g=-0.1 * torch.rand(*((B, HV, K) if pool.gate == "kda" else (B, HV)), generator=gen),
             beta=torch.rand(B, HV, generator=gen))
    t.update(over)
    return t


APPEND_BAD = {
    "repeated slot": (dict(slots=[1, 1]), ValueError, "slots names slots more than once"),
    "slot out of range": (dict(slots=[1, 9]), ValueError, r"slots must lie in \[0, 6\)"),
    "float slots": (dict(slots=torch.tensor([1.0, 2.0])), TypeError, "slots must hold integers"),
    "hcnt -1": (dict(hcnt=-1), ValueError, r"pool\.hcnt of the appended slots must lie in \[0, 16\]"),
    "hcnt past L": (dict(hcnt=17), ValueError, r"pool\.hcnt of the appended slots"),
    "NaN k": (dict(k=float("nan")), ValueError, "append: k must be finite"),
    "inf v": (dict(v=float("inf")), ValueError, "append: v must be finite"),
    "huge v": (dict(v=1e30), ValueError, r"append: v must have max\|x\| <= 2\^64"),
    "gate overflowing fp16": (dict(g=12.0), ValueError, "append: g must be <= 11"),
    "NaN beta": (dict(beta=float("nan")), ValueError, "append: beta must be finite"),
    "wrong g shape": (dict(g_shape=True), ValueError, "append: g must be"),
    "int k": (dict(k_int=True), TypeError, "append: k must be a floating-point tensor"),
}


@pytest.mark.parametrize("case", list(APPEND_BAD))
def test_append_refuses(case):
    """``append`` refuses what would corrupt a ring (a repeated slot lost a token, hcnt = -1 failed inside torch),
    naming the argument, before writing anything."""
    pool = _pool()
    over, exc, words = APPEND_BAD[case]
    slots = over.get("slots", [1, 2])
    B = len(slots)
    t = _token(pool, B)
    for name in ("k", "v", "g", "beta"):
        if name in over:
            t[name] = torch.full_like(t[name], over[name])
    if "g_shape" in over:
        t["g"] = t["g"][..., :1]
    if "k_int" in over:
        t["k"] = t["k"].to(torch.int32)
    if "hcnt" in over:
        pool.hcnt[2, 1] = over["hcnt"]
    before = parity.snapshot(pool)
    with pytest.raises(exc, match=words):
        pool.append(slots, **t)
    assert _same_bytes(before, parity.snapshot(pool)) == []


LOAD_BAD = {
    "NaN": (float("nan"), "states must be finite"),
    "inf": (float("inf"), "states must be finite"),
    "near fp32's max": (3e38, r"states must have max\|x\| <= 2\^64"),
}


@pytest.mark.parametrize("case", list(LOAD_BAD))
def test_load_states_refuses(case):
    """NaN and out-of-range states are refused (they were stored as NaN codes and scales without a word)."""
    pool = _pool()
    value, words = LOAD_BAD[case]
    S = torch.randn(2, 2, 64, 64, generator=torch.Generator().manual_seed(1))
    S[1, 0, 3, 4] = value
    before = parity.snapshot(pool)
    with pytest.raises(ValueError, match=words):
        pool.load_states([1, 2], S)
    assert _same_bytes(before, parity.snapshot(pool)) == []


def test_load_states_refuses_a_repeated_slot():
    pool = _pool()
    with pytest.raises(ValueError, match="more than once"):
        pool.load_states([2, 2], torch.zeros(2, 2, 64, 64))


# --- 8. pickling ------------------------------------------------------------------------------------------------


def _aliases(pool) -> bool:
    st = pool.raw.untyped_storage().data_ptr()
    return all(getattr(pool, n).untyped_storage().data_ptr() == st for n in ("codes", "codes32", "s_k", "s_v", "s_kv",
                                                                            "uq", "u", "q"))


@pytest.mark.parametrize("how", ["pickle", "torch.save", "torch.save weights_only", "deepcopy"])
def test_pickled_pool_aliases_raw(how):
    """A pool comes back from pickle and ``torch.save`` / ``torch.load`` with its views aliasing its ``raw`` again,
    so a flush (``check=False``) updates the loaded ``raw``: the bytes a flush of the original gives."""
    pool = _pool()
    back = reloaded(pool, how)
    assert isinstance(back, leapquant.Pool) and _aliases(back)
    assert back.raw.data_ptr() != pool.raw.data_ptr()
    assert _same_bytes(parity.snapshot(back), parity.snapshot(pool)) == []
    idx = _i32(2, 4)
    leapquant.flush(pool, idx, backend="reference")
    leapquant.flush(back, idx, backend="reference", check=False)
    assert _same_bytes(parity.snapshot(back), parity.snapshot(pool)) == []


# --- 9. clear messages ------------------------------------------------------------------------------------------


def _run_args(B=2, HV=2, K=64, V=64, L=8, R=2):
    return dict(codes=torch.zeros(B, HV, V, K, dtype=torch.int8), s_k=torch.ones(B, HV, K), s_v=torch.ones(B, HV, V),
                u=torch.zeros(B, HV, R, K, dtype=torch.float16), q=torch.zeros(B, HV, R, V, dtype=torch.float16),
                kbuf=torch.zeros(B, HV, L, K, dtype=torch.bfloat16), ubuf=torch.zeros(B, HV, L, V, dtype=torch.bfloat16),
                gbuf=torch.ones(B, HV, L, K, dtype=torch.float16), w=torch.zeros(B, HV, L), pcum=torch.zeros(B, HV, K),
                q0=leapquant.start_matrix(V, R))


MESSAGES = {
    "flush without a pool": (lambda: leapquant.flush(None, _i32(1), check=False), TypeError,
                             "pool must be a leapquant.Pool"),
    "step without a pool": (lambda: leapquant.step("pool", _i32(1), *[torch.zeros(1, 2, 64)] * 5, check=False),
                            TypeError, "pool must be a leapquant.Pool"),
    "run: q of another rank": (lambda: leapquant.run(**{**_run_args(), "q": torch.zeros(2, 2, 3, 64,
                                                                                       dtype=torch.float16)}),
                               ValueError, r"\bq must have shape \[2, 2, 2, 64\]"),
    "run: w of another ring": (lambda: leapquant.run(**{**_run_args(), "w": torch.zeros(2, 2, 16)}), ValueError,
                               r"\bw must have shape"),
    "run: s_k as fp16": (lambda: leapquant.run(**{**_run_args(), "s_k": torch.ones(2, 2, 64).half()}), TypeError,
                         r"\bs_k must be torch.float32"),
    "run: codes 3-D": (lambda: leapquant.run(**{**_run_args(), "codes": torch.zeros(2, 64, 64, dtype=torch.int8)}),
                       ValueError, r"\bcodes must be a 4-D tensor"),
}


@pytest.mark.parametrize("case", list(MESSAGES))
def test_clear_messages(case):
    call, exc, words = MESSAGES[case]
    with pytest.raises(exc, match=words):
        call()


def test_run_gives_the_flush():
    """The checked ``run`` still flushes: its outputs are the reference's for the same inputs."""
    args = _run_args()
    args["w"] = torch.rand(2, 2, 8, generator=torch.Generator().manual_seed(1))
    args["ubuf"] = torch.randn(2, 2, 8, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    args["kbuf"] = torch.randn(2, 2, 8, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    codes, s_k, s_v, u, q = leapquant.run(**args, backend="reference")
    S = leapquant.formulas.rebuild(**{k: v for k, v in args.items() if k != "q0"}, gate="kda")
    want = leapquant.formulas.compress(S, args["q0"])
    assert torch.equal(codes, want[0]) and torch.equal(s_k, want[1]) and torch.equal(u, want[3])


def test_compile_with_check():
    """``leapquant.flush(..., check=True)`` under ``torch.compile(fullgraph=True)``: the checks run inside the op at
    run time (they read ``idx`` on the host, which tracing cannot), so the call compiles, flushes as in eager mode,
    and a bad ``idx`` still raises the checks' error."""
    pool = _pool()
    twin = parity.twin(pool)

    @torch.compile(backend="eager", fullgraph=True)
    def go(idx):
        leapquant.flush(pool, idx, backend="reference", check=True)

    go(_i32(2, 0, 3))
    leapquant.flush(twin, _i32(2, 0, 3), backend="reference")
    assert _same_bytes(parity.snapshot(pool), parity.snapshot(twin)) == []
    before = parity.snapshot(pool)
    with pytest.raises(Exception, match="idx names slots more than once"):
        go(_i32(4, 4, 5))
    assert _same_bytes(before, parity.snapshot(pool)) == []


# =================================================================================================================
# States in and out (Pool.states, Pool.load_states, Pool.append, Pool.checkpoint, Pool(...)): the hostile-caller
# cases, each with a test that failed on the code before the checks. Both calls on the reference and on the Triton
# kernels (through the interpreter on the CPU).
# =================================================================================================================

STATE_BACKENDS = ["reference"] + (["triton"] if "triton" in backends_here("cpu") else [])


def _region(pool, n: int = 1) -> torch.Tensor:
    """``[n, HV, V, K]`` fp32 words of ``pool.raw`` from its first checkpoint on (several checkpoints' words in the
    compact layout, the default; a region's in the engine layout): dense, so every check of ``out`` and ``states``
    but aliasing passes."""
    return pool.raw[pool.base:pool.base + n * pool.heads * pool.head_v * pool.head_k].view(n, pool.heads, pool.head_v,
                                                                                             pool.head_k)


def _heads_overlapping(pool, n=2) -> torch.Tensor:
    """An ``out`` whose heads are each dense, but row 1's head 0 is row 0's head 1 (strides [2VK, 2VK, K, 1]): the
    dense-heads check passes, the heads share memory."""
    VK = pool.head_v * pool.head_k
    return torch.zeros((n + 1) * 2 * VK).as_strided((n, pool.heads, pool.head_v, pool.head_k),
                                                    (2 * VK, 2 * VK, pool.head_k, 1))


OUT_ALIASED = {
    "out in raw": (lambda p, s: _region(p, 2), r"out and pool\.raw share memory"),
    "out over slots": (None, r"out and slots share memory"),
    "out heads sharing memory": (lambda p, s: _heads_overlapping(p), r"out must not have elements that share memory"),
}


@pytest.mark.parametrize("check", [True, False], ids=["check", "nocheck"])
@pytest.mark.parametrize("case", list(OUT_ALIASED))
@pytest.mark.parametrize("backend", STATE_BACKENDS)
def test_states_out_aliasing_is_refused(backend, case, check):
    """``states(out=)`` with ``out`` inside a pool tensor, over ``slots`` or over itself is refused, whatever
    ``check``, before anything is written (``out`` inside ``raw`` wrote 32 KB of it here: SPEC says ``states``
    writes nothing in the pool)."""
    pool = _pool()
    make, words = OUT_ALIASED[case]
    slots = torch.tensor([1, 2])
    if case == "out over slots":
        out = torch.zeros(2, pool.heads, pool.head_v, pool.head_k)
        slots = out.view(-1)[-4:].view(torch.int64)  # out's last four words
        slots.copy_(torch.tensor([1, 2]))
    else:
        out = make(pool, slots)
    before = parity.snapshot(pool)
    out_before = out.clone()
    with pytest.raises(ValueError, match=words):
        pool.states(slots, out=out, backend=backend, check=check)
    assert _same_bytes(before, parity.snapshot(pool)) == []
    assert torch.equal(parity.as_bytes(out), parity.as_bytes(out_before))


# (with check=True an int32 slots tensor is copied to int64 first: no alias is left, so that case is check=False's)
LOAD_ALIASED = {
    "states in raw": ("states", r"states and pool\.raw share memory", [True, False]),
    "slots in hcnt": ("slots", r"slots and pool\.hcnt share memory", [False]),
}


@pytest.mark.parametrize("case,check", [(c, ch) for c, (_, _, checks) in LOAD_ALIASED.items() for ch in checks],
                         ids=[f"{c}-{'check' if ch else 'nocheck'}" for c, (_, _, checks) in LOAD_ALIASED.items()
                              for ch in checks])
@pytest.mark.parametrize("backend", STATE_BACKENDS)
def test_load_states_input_aliasing_the_pool_is_refused(backend, case, check):
    """``load_states`` refuses ``states`` or ``slots`` that share bytes with a pool tensor it writes (a state read
    from ``raw`` while ``raw`` is written), before anything is written or read."""
    pool = _pool()
    which, words, _ = LOAD_ALIASED[case]
    if which == "states":
        slots, states = torch.tensor([1]), _region(pool)
        states.copy_(torch.randn(states.shape, generator=torch.Generator().manual_seed(2)))  # finite values
    else:
        pool.hcnt[1, 0] = 2
        slots, states = pool.hcnt[1, :1], torch.randn(1, pool.heads, pool.head_v, pool.head_k)
    before = parity.snapshot(pool)
    with pytest.raises(ValueError, match=words):
        pool.load_states(slots, states, backend=backend, check=check)
    assert _same_bytes(before, parity.snapshot(pool)) == []


STORAGE_SHORT = {
    "states: slots": ("states", "slots", r"slots reaches byte"),
    "states: out": ("states", "out", r"out reaches byte"),
    "load_states: slots": ("load", "slots", r"slots reaches byte"),
    "load_states: states": ("load", "states", r"states reaches byte"),
}


@pytest.mark.parametrize("check", [True, False], ids=["check", "nocheck"])
@pytest.mark.parametrize("case", list(STORAGE_SHORT))
@pytest.mark.parametrize("backend", STATE_BACKENDS)
def test_state_arguments_inside_their_storage(backend, case, check):
    """Every tensor argument of ``states`` and ``load_states`` lies inside its storage, checked whatever ``check``
    (a storage cut under a view sent the calls past the allocation)."""
    pool = _pool()
    op, arg, words = STORAGE_SHORT[case]
    n, HV, V, K = 2, pool.heads, pool.head_v, pool.head_k
    slots = torch.tensor([1, 2])
    if arg == "slots":
        slots = _shrunk(torch.zeros(n, dtype=torch.int64), 8)  # the first slot's bytes, not the second's
    args = dict(slots=slots, out=torch.zeros(n, HV, V, K), states=torch.randn(n, HV, V, K))
    if arg == "out":
        args["out"] = _shrunk(torch.zeros(n, HV, V, K), 4 * HV * V * K)
    if arg == "states":
        args["states"] = _shrunk(torch.zeros(n, HV, V, K), 4 * HV * V * K)
    before = parity.snapshot(pool)
    with pytest.raises(ValueError, match=words):
        if op == "states":
            pool.states(args["slots"], out=args["out"], backend=backend, check=check)
        else:
            pool.load_states(args["slots"], args["states"], backend=backend, check=check)
    assert _same_bytes(before, parity.snapshot(pool)) == []


BAD_SLOT_LISTS = {"floats": [1.7, 2.2], "bools": [True, False], "numpy floats": "np", "mixed": [1, True]}


@pytest.mark.parametrize("call", ["states", "load_states", "append", "checkpoint"])
@pytest.mark.parametrize("case", list(BAD_SLOT_LISTS))
def test_slot_lists_hold_ints_only(case, call):
    """A slot list of floats or bools is refused with a TypeError naming ``slots`` (``load_states([1.7, 2.2], S)``
    loaded slots 1 and 2, ``[True, False]`` slot 1 and the null slot); ints and numpy integers are taken."""
    import numpy as np

    pool = _pool()
    slots = BAD_SLOT_LISTS[case]
    if slots == "np":
        slots = np.array([1.0, 2.0])
    S = torch.randn(2, pool.heads, pool.head_v, pool.head_k)

    def go(s):
        if call == "states":
            return pool.states(s, backend="reference")
        if call == "load_states":
            return pool.load_states(s, S, backend="reference")
        if call == "append":
            return pool.append(s, **_token(pool, 2))
        return pool.checkpoint(s)

    before = parity.snapshot(pool)
    with pytest.raises(TypeError, match=r"slots must hold Python ints"):
        go(slots)
    assert _same_bytes(before, parity.snapshot(pool)) == []
    go([np.int64(1), 2])  # ints and numpy integers are fine


def _state_backend(backend: str, monkeypatch) -> str:
    """``backend`` by name; ``"reference:graph"``: the reference's path without host synchronisation (CUDA's), taken
    on the CPU."""
    if backend == "reference:graph":
        import leapquant.reference as reference

        monkeypatch.setattr(reference, "_graph_capturable", lambda pool: True)
        return "reference"
    return backend


@pytest.mark.parametrize("bad", [-1, 6], ids=["minus_one", "num_slots"])
@pytest.mark.parametrize("backend", STATE_BACKENDS + ["reference:graph"])
def test_load_states_skips_out_of_range_slots_without_check(backend, bad, monkeypatch):
    """``load_states(check=False)`` skips a slot outside ``[0, NS)`` (nothing written for it, as the kernels do) and
    loads the others whole: the bytes of loading the in-range rows alone (the reference wrote slot 1's checkpoint,
    then raised with its old ring left; -1 loaded the last slot)."""
    pool = _pool()
    twin = parity.twin(pool)
    S = torch.randn(3, pool.heads, pool.head_v, pool.head_k, generator=torch.Generator().manual_seed(4))
    twin.load_states(torch.tensor([1, 3]), S[[0, 2]], backend=backend.split(":")[0], check=False)
    backend = _state_backend(backend, monkeypatch)
    pool.load_states(torch.tensor([1, bad, 3]), S, backend=backend, check=False)
    assert _same_bytes(parity.snapshot(twin), parity.snapshot(pool)) == []
    # only out-of-range slots: nothing at all
    before = parity.snapshot(pool)
    pool.load_states(torch.tensor([bad], dtype=torch.int32), S[:1], backend=backend, check=False)
    assert _same_bytes(before, parity.snapshot(pool)) == []


@pytest.mark.parametrize("backend", STATE_BACKENDS + ["reference:graph"])
def test_states_of_out_of_range_slots_without_check(backend, monkeypatch):
    """``states(check=False)`` gives zero rows for slots outside ``[0, NS)`` and the in-range rows' states bit for
    bit, into a new tensor or a caller's, and writes nothing in the pool (the reference read slot NS-1 for -1 and
    raised for NS)."""
    pool = _pool()
    backend = _state_backend(backend, monkeypatch)
    before = parity.snapshot(pool)
    want = pool.states(torch.tensor([2]), backend=backend, check=False)
    got = pool.states(torch.tensor([-1, 2, 6]), backend=backend, check=False)
    out = torch.full_like(got, float("nan"))
    pool.states(torch.tensor([-1, 2, 6], dtype=torch.int32), out=out, backend=backend, check=False)
    for t in (got, out):
        assert torch.equal(parity.as_bytes(t[1:2]), parity.as_bytes(want))
        assert (t[0] == 0).all() and (t[2] == 0).all()
    assert _same_bytes(before, parity.snapshot(pool)) == []


def _no_memory(monkeypatch):
    import leapquant.pool as pool_module

    monkeypatch.setattr(pool_module, "_device_memory", lambda device: None)  # the allocator's failure is caught


POOL_BAD = {
    "num_slots too large for the device": (dict(num_slots=10**13), None, r"num_slots=10000000000000 needs a pool of "
                                                                           r"[\d,]+ bytes"),
    "num_slots the allocator refuses": (dict(num_slots=10**13), _no_memory, r"num_slots=10000000000000 needs a pool "
                                                                             r"of [\d,]+ bytes .* could not allocate"),
    "cuda without CUDA": (dict(device="cuda"), None, r"device='cuda': CUDA is not available"),
    "meta": (dict(device="meta"), None, r"device='meta' holds no data"),
}


@pytest.mark.parametrize("case", list(POOL_BAD))
def test_pool_construction_errors_name_the_argument(case, monkeypatch):
    """``Pool(...)`` says which argument is wrong: a ``num_slots`` too large (the bytes it needs; the allocator's
    own error did not name it), CUDA asked for without CUDA (torch's assertion), ``device="meta"`` (it said ``hcnt``
    and ``w`` overlap)."""
    over, setup, words = POOL_BAD[case]
    if case == "cuda without CUDA" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    if setup is not None:
        setup(monkeypatch)
    kw = dict(num_slots=4, heads=2, head_k=64, head_v=64, ring=8, rank=2)
    kw.update(over)
    with pytest.raises(ValueError, match=words):
        leapquant.Pool(**kw)


def _autograd_free(pool) -> list[str]:
    names = list(parity.POOL_TENSORS) + ["codes", "codes32", "s_k", "s_v", "s_kv", "uq", "u", "q", "q0"]
    return [n for n in dict.fromkeys(names) if getattr(pool, n) is not None
            and (getattr(pool, n).requires_grad or getattr(pool, n).grad_fn is not None)]


@pytest.mark.parametrize("backend", STATE_BACKENDS + ["reference:graph"])
def test_no_autograd_history_from_the_state_calls(backend, monkeypatch):
    """Inputs that require grad (``append``'s tokens, ``load_states``' states, ``states``' ``out``, a ``q0``) leave
    no autograd history in the pool: no pool tensor requires grad or has a ``grad_fn`` afterwards (``append`` and
    the reference's ``load_states`` recorded one)."""
    backend = _state_backend(backend, monkeypatch)
    pool = leapquant.Pool(6, 2, 64, 64, 16, 4, q0=leapquant.start_matrix(64, 4).requires_grad_())
    t = {n: x.requires_grad_() for n, x in _token(pool, 2).items()}
    pool.append([1, 2], **t)
    S = torch.randn(2, 2, 64, 64).requires_grad_()
    pool.load_states([3, 4], S, backend=backend)
    pool.load_states(torch.tensor([1, 5]), S.detach().requires_grad_(), backend=backend, check=False)
    out = torch.zeros(2, 2, 64, 64, requires_grad=True)
    pool.states([1, 3], out=out, backend=backend)
    assert _autograd_free(pool) == []
    leapquant.flush(pool, _i32(1, 2), backend="reference")
    assert _autograd_free(pool) == []


# --- 10. the decode step's arguments ------------------------------------------------------------------------------
#
# Every call, check=False included: ``out`` shares no byte with the pool, the inputs or itself
# (``test_step_out_that_aliases_is_refused``: it overwrote another slot's checkpoint, or gave wrong outputs after the
# flush had written); every tensor argument lies inside its storage (``test_storage_shorter_than_the_tensor``: the
# kernels read and wrote past it); ``scale`` a finite real number (``test_bad_scale_is_refused``). With check=True:
# the token values ``append`` refuses (``test_step_refuses_values``) and fill counts outside [0, L]
# (``test_out_of_domain_hcnt_is_refused``). Always: no autograd history enters the pool
# (``test_no_autograd_history_from_the_step``); with check=False an out-of-domain count writes nothing outside its
# program (``test_out_of_domain_hcnt_stays_in_its_program``).

STEP_BACKENDS = ["reference"] + (["triton"] if "triton" in backends_here("cpu") else [])


def _tokens(pool, B, H=None, seed=3):
    gen = torch.Generator().manual_seed(seed)
    HV, K, V = pool.heads, pool.head_k, pool.head_v
    H = HV if H is None else H
    return dict(q=torch.randn(B, H, K, generator=gen),
                k=torch.nn.functional.normalize(torch.randn(B, H, K, generator=gen), dim=-1),
                v=torch.randn(B, HV, V, generator=gen),
                g=-0.1 * torch.rand(*((B, HV, K) if pool.gate == "kda" else (B, HV)), generator=gen),
                beta=torch.rand(B, HV, generator=gen))


def _raw_view_of_slot(pool, slot, B):
    """``[B, HV, V]`` fp32 over the checkpoint bytes of ``slot`` in ``raw``."""
    n = B * pool.heads * pool.head_v
    start = pool.base + slot * pool.slot_stride
    return pool.raw[start:start + n].view(B, pool.heads, pool.head_v)


OUT_ALIASES = {
    "a view of raw": (lambda pool, t, B: _raw_view_of_slot(pool, 5, B), "out and pool.raw"),
    "heads sharing memory": (lambda pool, t, B: torch.zeros(B, 1, pool.head_v).expand(B, pool.heads, pool.head_v),
                             "out must not have elements that share memory"),
    "q itself": (lambda pool, t, B: t["q"], "out and q"),
    "v itself": (lambda pool, t, B: t["v"][:], "out and v"),
    "a view of kbuf": (lambda pool, t, B: pool.kbuf[5].view(torch.float32).reshape(-1)[:B * pool.heads * pool.head_v]
                       .view(B, pool.heads, pool.head_v), "out and pool.kbuf"),
    "a view of pcum": (lambda pool, t, B: pool.pcum.reshape(-1)[-B * pool.heads * pool.head_v:]
                       .view(B, pool.heads, pool.head_v), "out and pool.pcum"),
}


@pytest.mark.parametrize("check", [False, True])
@pytest.mark.parametrize("case", list(OUT_ALIASES))
@pytest.mark.parametrize("backend", STEP_BACKENDS)
def test_step_out_that_aliases_is_refused(backend, case, check):
    """An ``out`` that shares bytes with a pool tensor, an input or itself is refused with check=False too, before
    the flush of the full rings writes anything (a view of ``raw`` overwrote slot 5's checkpoint; heads sharing
    memory gave wrong outputs on Triton and a torch error on the reference after the flush)."""
    pool = _pool("kda", num_slots=8)
    B = 3
    idx = _i32(1, 2, 3)
    t = _tokens(pool, B)
    make, words = OUT_ALIASES[case]
    out = make(pool, t, B)
    before = parity.snapshot(pool)
    inputs = {n: x.clone() for n, x in t.items()}
    with pytest.raises(ValueError, match=words):
        leapquant.step(pool, idx, **t, out=out, backend=backend, check=check)
    assert _same_bytes(before, parity.snapshot(pool)) == []
    assert all(torch.equal(inputs[n], t[n]) for n in t)


@pytest.mark.parametrize("name", ["idx", "q", "k", "v", "g", "beta", "out"])
@pytest.mark.parametrize("backend", STEP_BACKENDS)
def test_storage_shorter_than_the_tensor(backend, name):
    """With check=False, a token tensor, ``out`` or ``idx`` whose storage is shorter than its shape and strides say
    is refused, naming it, before anything is written (the kernels read and wrote past the allocation)."""
    pool = _pool("kda", num_slots=5)
    B = 3
    t = dict(_tokens(pool, B), idx=_i32(1, 2, 3), out=torch.zeros(B, pool.heads, pool.head_v))
    t[name] = _shrunk(t[name], t[name].element_size() * (t[name].numel() // 2))
    before = parity.snapshot(pool)
    with pytest.raises(ValueError, match=rf"\b{name} reaches byte"):
        leapquant.step(pool, backend=backend, check=False, **t)
    assert _same_bytes(before, parity.snapshot(pool)) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_flush_idx_shorter_than_its_storage(backend, monkeypatch):
    pool = _pool("kda", num_slots=5)
    idx = _shrunk(_i32(1, 2, 3, 4), 8)
    before = parity.snapshot(pool)
    with pytest.raises(ValueError, match=r"\bidx reaches byte"):
        _flush(backend, pool, idx, monkeypatch, check=False)
    assert _same_bytes(before, parity.snapshot(pool)) == []


STEP_VALUES_BAD = {
    "KDA gate overflowing fp16": ("kda", "g", 60.0, "g must be <= 11"),
    "GDN gate overflowing fp32": ("gdn", "g", 100.0, "g must be <= 88"),
    "NaN q": ("kda", "q", float("nan"), r"\bq must be finite"),
    "inf k": ("gdn", "k", float("inf"), r"\bk must be finite"),
    "NaN v": ("kda", "v", float("nan"), r"\bv must be finite"),
    "NaN g": ("kda", "g", float("nan"), r"\bg must be finite"),
    "-inf g": ("gdn", "g", -float("inf"), r"\bg must be finite"),
    "NaN beta": ("gdn", "beta", float("nan"), r"\bbeta must be finite"),
}


@pytest.mark.parametrize("case", list(STEP_VALUES_BAD))
@pytest.mark.parametrize("backend", STEP_BACKENDS)
def test_step_refuses_values(backend, case):
    """With check=True the step refuses the token values ``append`` refuses (KDA ``g = 60`` stored ``gbuf = inf``
    and every output was non-finite; GDN ``g = 100`` made ``pcum`` and ``w`` infinite), naming the tensor, before the
    flush of the full rings writes anything."""
    gate, name, value, words = STEP_VALUES_BAD[case]
    pool = _pool(gate, num_slots=5)
    t = _tokens(pool, 3)
    t[name] = t[name].clone()
    t[name].view(-1)[1] = value
    before = parity.snapshot(pool)
    with pytest.raises(ValueError, match=words):
        leapquant.step(pool, _i32(1, 2, 3), **t, backend=backend)
    assert _same_bytes(before, parity.snapshot(pool)) == []


def test_step_values_of_padding_rows_are_not_read():
    """Padding rows are neither read nor written (SPEC §6): check=True does not refuse their values."""
    pool = _pool("kda", num_slots=5)
    t = _tokens(pool, 3)
    for name in t:
        t[name][1] = float("nan")
    o = leapquant.step(pool, _i32(1, 0, 3), **t, backend="reference")
    assert float(o[1].abs().max()) == 0.0 and bool(torch.isfinite(o).all())


SCALES_BAD = {
    "NaN": (float("nan"), ValueError),
    "inf": (float("inf"), ValueError),
    "-inf": (-float("inf"), ValueError),
    "a string": ("abc", TypeError),
    "a bool": (True, TypeError),
    "a complex": (1j, TypeError),
    "a list": ([0.5], TypeError),
}


@pytest.mark.parametrize("check", [False, True])
@pytest.mark.parametrize("case", list(SCALES_BAD))
@pytest.mark.parametrize("backend", STEP_BACKENDS)
def test_bad_scale_is_refused(backend, case, check):
    """``scale`` is a host number: a finite real is required on every call (NaN and inf were taken, and "abc" failed
    parsing a float without naming it), before anything is written."""
    value, exc = SCALES_BAD[case]
    pool = _pool("kda", num_slots=5)
    before = parity.snapshot(pool)
    with pytest.raises(exc, match=r"\bscale\b"):
        leapquant.step(pool, _i32(1, 2, 3), **_tokens(pool, 3), scale=value, backend=backend, check=check)
    assert _same_bytes(before, parity.snapshot(pool)) == []


def test_step_takes_real_scales():
    import numpy as np

    pool = _pool("kda", num_slots=5)
    outs = [leapquant.step(parity.twin(pool), _i32(1, 2, 3), **_tokens(pool, 3), scale=s, backend="reference")
            for s in (2, 2.0, np.float32(2.0))]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


POOL_ATTRS = parity.POOL_TENSORS + ("codes", "codes32", "s_k", "s_v", "s_kv", "uq", "u", "q")


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("backend", STEP_BACKENDS)
def test_no_autograd_history_from_the_step(backend, gate):
    """Inputs that require grad (a token tensor, the pool's ``q0``) leave no autograd history in the pool: on the
    reference ``kbuf``, ``ubuf``, ``s_k``, ``u`` kept a ``grad_fn`` (memory grew step after step)."""
    pool = _pool(gate, num_slots=5)
    pool.q0.requires_grad_(True)
    t = _tokens(pool, 3)
    for x in t.values():
        x.requires_grad_(True)
    leapquant.step(pool, _i32(1, 2, 3), **t, backend=backend)  # every ring full: flushed first, with q0
    leapquant.flush(pool, _i32(1, 2, 3), backend=backend)
    leapquant.step(pool, _i32(1, 2, 3), **t, out=torch.empty(3, pool.heads, pool.head_v), backend=backend,
                   check=False)
    tracked = [n for n in POOL_ATTRS if getattr(pool, n) is not None
               and (getattr(pool, n).requires_grad or getattr(pool, n).grad_fn is not None)]
    assert tracked == []


@pytest.mark.parametrize("op", ["step", "flush"])
@pytest.mark.parametrize("bad", [17, -3])
@pytest.mark.parametrize("backend", STEP_BACKENDS)
def test_out_of_domain_hcnt_is_refused(backend, bad, op):
    """With check=True a named row whose fill count lies outside [0, L] is refused, naming pool.hcnt (a count above L
    dropped the ring's entries without flushing them; a negative one dropped the token and counted further down);
    the same count in a slot that is not named is no error."""
    pool = _pool("kda", num_slots=6)
    pool.hcnt[2, 1] = bad
    pool.hcnt[5, 0] = bad
    before = parity.snapshot(pool)
    t = _tokens(pool, 3)

    def call(idx):
        if op == "step":
            leapquant.step(pool, idx, **t, backend=backend)
        else:
            leapquant.flush(pool, idx, backend=backend)

    with pytest.raises(ValueError, match=r"pool\.hcnt"):
        call(_i32(1, 2, 3))
    assert _same_bytes(before, parity.snapshot(pool)) == []
    call(_i32(1, 3, 4))


def _program_bytes(pool, snap, slot, head):
    """The bytes of program (slot, head) in a snapshot: its checkpoint and its ring rows."""
    g = pool.geometry
    start = 4 * (pool.base + slot * g.slot_stride + head * g.head_stride)
    out = {"raw": snap["raw"].view(-1)[start:start + g.checkpoint_bytes]}
    for name in snap:
        if name != "raw":
            t = getattr(pool, name)
            out[name] = snap[name].view(t.shape[0], t.shape[1], -1)[slot, head]
    return out


@pytest.mark.parametrize("op", ["step", "flush"])
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("backend", STEP_BACKENDS)
def test_out_of_domain_hcnt_stays_in_its_program(backend, gate, op):
    """With check=False a program whose fill count lies outside [0, L] (L + 5, -3, the int32 extremes) gets an
    undefined result, but nothing outside it changes: over random pool bytes, every other program of the named
    slots holds the bytes a call on in-domain counts gives, and every byte outside the named slots' programs is as
    it was (an entry index past the ring would write the next head's ring)."""
    L = 16
    pool = leapquant.Pool(6, 3, 64, 64, L, 4, gate=gate)
    gen = torch.Generator().manual_seed(8)
    for name in parity.POOL_TENSORS:
        if getattr(pool, name) is not None and name != "hcnt":
            iv = getattr(pool, name).view(torch.uint8)
            iv.copy_(torch.randint(0, 256, iv.shape, generator=gen, dtype=torch.uint8))
    fill(pool, [1, 2, 3, 4], "gaussian", gen, due=torch.rand(4, 3, generator=gen) < 0.5)
    bad = {(2, 0): L + 5, (2, 2): -3, (3, 1): 2**31 - 1, (4, 2): -2**31}
    good = parity.twin(pool)
    for (s, h), value in bad.items():
        pool.hcnt[s, h] = value
        good.hcnt[s, h] = 3
    idx = _i32(2, 0, 3, 4)
    before = parity.snapshot(pool)
    t = _tokens(pool, idx.numel(), seed=5)
    for p in (pool, good):
        if op == "step":
            leapquant.step(p, idx, **t, backend=backend, check=False)
        else:
            leapquant.flush(p, idx, backend=backend, check=False)
    after, want = parity.snapshot(pool), parity.snapshot(good)
    programs = [(s, h) for s in (2, 3, 4) for h in range(3)]
    mask = pool.checkpoint_mask(torch.tensor([s for s, _ in programs]), torch.tensor([h for _, h in programs]))
    assert torch.equal(after["raw"][~mask], before["raw"][~mask]), "raw outside the named programs changed"
    for name in after:
        if name != "raw":
            n = getattr(pool, name).shape[0]
            rows = torch.ones(n, dtype=torch.bool)
            rows[[2, 3, 4]] = False
            a, b = after[name].view(n, -1), before[name].view(n, -1)
            assert torch.equal(a[rows], b[rows]), f"{name} of a slot not named changed"
    for s, h in programs:
        if (s, h) not in bad:
            got, exp = _program_bytes(pool, after, s, h), _program_bytes(good, want, s, h)
            assert [n for n in got if not torch.equal(got[n], exp[n])] == [], (s, h)
