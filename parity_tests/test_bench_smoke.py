"""``python -m bench --cpu-smoke`` end to end (subprocess workers, records, report, JSON / markdown / plot), and the
floor's byte count against the SPEC's own figure; the same for ``python -m bench.host_overhead`` and
``python -m bench.decode`` (both gates, both layouts, the bounds, the batch sweep, FLA's anchors, ``--baseline``)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import leapquant
from bench.flush import floor_bytes, plan, program_bytes

ROOT = Path(__file__).resolve().parents[1]


def test_floor_bytes_match_the_seed_measurement():
    """The seed's H200 figures (docs/DESIGN.md): all 8,192 programs due at 256 x 32 heads, 4.25 TB/s copy bandwidth
    -> a 109 us floor."""
    pb = program_bytes(leapquant.Pool(2, 32))
    # checkpoint 16384 + 512 + 512 + 2048; ring 4096 kbuf + 4096 ubuf + 64 w + 512 pcum + 4096 gbuf; resets
    assert (pb["checkpoint"], pb["ring"], pb["resets"]) == (19456, 12864, 4672)
    fb = floor_bytes(pb, 256 * 32, 256)
    assert fb == 256 * 32 * (2 * 19456 + 12864 + 4672) + 256 * (32 * 4 + 4)
    assert round(fb / 4.25e12 * 1e6) == 109
    pg = program_bytes(leapquant.Pool(2, 4, gate="gdn"))
    assert pg["ring"] == 4096 + 4096 + 64 + 4 and pg["resets"] == 64 + 4


@pytest.mark.slow  # python -m pytest -m slow (CI runs it)
def test_cpu_smoke_end_to_end(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "bench", "--cpu-smoke", "--out", str(tmp_path),
                           "--backends", "reference,nonesuch"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "flush_cpu.json").read_text())
    assert doc["complete"]
    assert doc["bandwidth"]["GBps"] > 0 and doc["bandwidth"]["copy_checked"]
    assert doc["step"]["check"]["ok"], doc["step"]["check"]
    assert doc["step"]["best"]["median_us"] > 0
    cases = doc["cases"]
    assert len(cases) == len(plan("cpu").cases)
    for c in cases:
        ref = c["results"]["reference"]
        assert ref["status"] == "ok", ref
        assert ref["due_programs"] == c["due_programs"] >= 1
        assert ref["median_us"] > 0 and ref["x_floor"] > 0 and ref["GBps"] > 0
        # an unknown backend is listed with its reason, never dropped
        assert c["results"]["nonesuch"]["status"] == "unavailable"
        assert "unknown backend" in c["results"]["nonesuch"]["reason"]
    assert doc["amortisation"]["per_backend"]["reference"]["flush_per_token_us"] > 0
    md = (tmp_path / "flush_cpu.md").read_text()
    assert "| heads | N | due |" in md and "nonesuch: unavailable" in md
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "flush_cpu.png").stat().st_size > 1000
    else:
        assert "matplotlib" in doc["plot_error"]


def test_host_overhead_smoke(tmp_path):
    """``python -m bench.host_overhead`` on the CPU: every path timed for the reference backend, an unknown backend
    listed with its reason, the JSON and the markdown table written."""
    from bench import host_overhead

    assert host_overhead.main(["--device", "cpu", "--backends", "reference,nonesuch", "--rows", "1", "--calls", "2",
                               "--rounds", "2", "--warmup", "1", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "host_overhead_cpu.json").read_text())
    ref = doc["results"]["reference"]
    assert ref["status"] == "ok"
    for path in host_overhead.PATHS:
        if path == "bound":  # the Triton backend's launches without its launcher: not a path of the reference
            assert path not in ref
            continue
        assert ref[path]["wall_us"] >= ref[path]["host_us"] > 0 and ref[path]["calls"] == 2
    assert doc["results"]["nonesuch"] == {"status": "unavailable", "reason": "unknown backend"}
    md = (tmp_path / "host_overhead_cpu.md").read_text()
    assert "| reference |" in md and "| nonesuch | unknown backend |" in md and "| n/a |" in md


DECODE_CASES = ["step fill 1", "step fill 8", "step fill 15", "decode layer", "flush in layer", "flush, none due",
                "verify T=4 (fill 8)",
                "verify T=8 (fill 8)", "packed fill 8", "packed fill 8, gates apart", "packed verify T=4 (fill 8)",
                "packed verify T=4 (fill 8), gates apart", "step fill 8 (compact)", "decode layer (compact)"]
BOUNDS_LINE = ("Bounds (issue 38): step fill 8 <= 1.5x its floor; decode layer <= 1.15x step fill 8, <= 0.3x fla fp32, "
               "<= 0.5x fla bf16; verify T=4 (fill 8) <= 1.6x step fill 8.")


def _section(md: str, heading: str) -> str:
    """The markdown between ``heading`` and the next heading of the same level or above."""
    level = heading.split(" ")[0]
    body = md.split("\n" + heading + "\n", 1)[1]
    cut = [i for i in (body.find("\n" + "#" * n + " ") for n in range(1, len(level) + 1)) if i >= 0]
    return body[:min(cut)] if cut else body


def test_decode_bench_smoke(tmp_path):
    """``python -m bench.decode --cpu-smoke``: both gates' tables with the compact rows, every case timed beside a
    positive floor, the bounds stated and marked from the timings, the sweep's rows, the JSON, markdown and plot."""
    from bench import decode

    assert decode.main(["--cpu-smoke", "--batch", "2", "--heads", "2", "--sweep", "1,2", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "decode_cpu.json").read_text())
    md = (tmp_path / "decode_cpu.md").read_text()
    assert list(doc["gates"]) == ["kda", "gdn"]
    for gate, section in doc["gates"].items():
        rows = {c["case"]: c for c in section["cases"]}
        assert list(rows) == DECODE_CASES, gate
        for c in rows.values():
            assert c["status"] == "ok", c
            assert c["median_us"] > 0 and c["floor_us"] > 0 and c["bytes"] > 0 and c["backend"] == "reference"
            assert c["layout"] == ("compact" if c["case"].endswith("(compact)") else "engine")
        # fill 15 reads more ring entries than fill 1; the compact layout moves the same bytes as the engine one
        assert rows["step fill 15"]["bytes"] > rows["step fill 1"]["bytes"]
        assert rows["step fill 8 (compact)"]["bytes"] == rows["step fill 8"]["bytes"]
        assert rows["decode layer (compact)"]["bytes"] == rows["decode layer"]["bytes"]
        assert rows["decode layer"]["due"] == rows["decode layer (compact)"]["due"] >= 1
        # the layer's flush alone: its due rings' flush bytes; with nothing due, the fill counts read
        assert rows["flush in layer"]["due"] == rows["decode layer"]["due"]
        assert rows["flush in layer"]["bytes"] == rows["decode layer"]["due"] * program_bytes(
            decode.make_pool(5, 2, 64, gate, "engine", torch.device("cpu")))["total"]
        assert rows["flush, none due"]["bytes"] == 2 * 2 * 4 and rows["flush, none due"]["due"] == 0
        # a verify of 4 tokens moves more than one token's step, less than four
        assert rows["step fill 8"]["bytes"] < rows["verify T=4 (fill 8)"]["bytes"] < 4 * rows["step fill 8"]["bytes"]
        # the packed call reads bf16 gate inputs where the step reads fp32 gates: fewer bytes, the same either way
        packed, apart = rows["packed fill 8"], rows["packed fill 8, gates apart"]
        assert packed["bytes"] == apart["bytes"] < rows["step fill 8"]["bytes"]
        assert packed["fused"] is True and apart["fused"] is False and packed["fill"] == 8
        pv, pva = rows["packed verify T=4 (fill 8)"], rows["packed verify T=4 (fill 8), gates apart"]
        assert pv["bytes"] == pva["bytes"] < rows["verify T=4 (fill 8)"]["bytes"]
        assert pv["tokens"] == pva["tokens"] == 4 and pv["fused"] is True and pva["fused"] is False
        assert section["pool_slots"] == 5 and section["backend"] == {"engine": "reference", "compact": "reference"}
        m = section["memory_per_sequence"]
        assert m["fp32"] == 2 * m["bf16"] == 2 * 2 * 64 * 64 * 2 and m["leapquant_compact"] < m["leapquant_engine"]
        # the bounds: LeapQuant's own ratios measured and judged, FLA's not timed (no FLA in the smoke run)
        b = {(x["layout"], x["case"], x["against"]): x for x in section["bounds"]}
        assert len(b) == 9
        ver = b[("engine", "verify T=4 (fill 8)", "step fill 8")]
        assert ver["ratio"] == rows["verify T=4 (fill 8)"]["median_us"] / rows["step fill 8"]["median_us"]
        f8 = b[("compact", "step fill 8 (compact)", "floor")]
        assert f8["ratio"] == rows["step fill 8 (compact)"]["x_floor"] and f8["met"] == (f8["ratio"] <= 1.5)
        lay = b[("engine", "decode layer", "step fill 8")]
        assert lay["ratio"] == rows["decode layer"]["median_us"] / rows["step fill 8"]["median_us"]
        assert lay["met"] == (lay["ratio"] <= 1.15)
        fla = b[("engine", "decode layer", "fla bf16")]
        assert fla["met"] is None and fla["reason"] == "fla bf16 not timed"
        text = _section(md, f"## {gate.upper()}")
        for name in DECODE_CASES:
            assert f"| {name} | {rows[name]['median_us']:.1f} us |" in text
        assert BOUNDS_LINE in text
        lay_t, st_t, fl_t, no_t = (rows[n]["median_us"] for n in ("decode layer", "step fill 8", "flush in layer",
                                                                  "flush, none due"))
        split = (f"step fill 8 {st_t:.1f} us + flush in layer {fl_t:.1f} us = {st_t + fl_t:.1f} us against the "
                 f"layer's {lay_t:.1f} us ({lay_t - st_t - fl_t:+.1f} us); a flush call with nothing due takes "
                 f"{no_t:.1f} us")
        assert split in text
        mark = "met" if lay["met"] else "missed"
        assert f"decode layer / step fill 8 = {lay['ratio']:.2f}x (bound 1.15x: {mark})" in text
        assert "decode layer / fla fp32: not measured, fla fp32 not timed (bound 0.3x)" in text
    sweep = doc["sweep"]
    assert sweep["batches"] == [1, 2] and sweep["layout"] == "engine" and list(sweep["gates"]) == ["kda", "gdn"]
    for gate, rows in sweep["gates"].items():
        assert [(r["batch"], r["case"], r["status"]) for r in rows] == [
            (1, "decode layer", "ok"), (1, "decode cycle", "ok"), (2, "decode layer", "ok"), (2, "decode cycle", "ok")]
        layers = [r for r in rows if r["case"] == "decode layer"]
        assert layers[1]["bytes"] > layers[0]["bytes"] and all(r["due"] >= 1 for r in layers)
        text = _section(md, f"### {gate.upper()}")
        for r in layers:
            assert f"| {r['batch']} | {r['due']} | {r['median_us']:.1f} us | {r['floor_us']:.1f} us |" in text
        # over its 16 steps every head reads 0 .. 15 ring entries once and is flushed once, whatever its phase
        pool = decode.make_pool(5, 2, 64, gate, "engine", torch.device("cpu"))
        per_head = sum(decode.step_bytes(pool, e, 2, 2, 2) for e in range(pool.ring)) + program_bytes(pool)["total"]
        for r in (r for r in rows if r["case"] == "decode cycle"):
            assert r["steps"] == pool.ring and r["bytes"] == r["batch"] * 2 * per_head
            assert f"{r['median_us']:.1f} us" in text and r["floor_us"] * pool.ring * 0.999 < r["bytes"] / (
                doc["bandwidth"]["GBps"] * 1e3) < r["floor_us"] * pool.ring * 1.001
    if importlib.util.find_spec("matplotlib") is not None:
        assert doc["plot"] == "decode_cpu.png" and (tmp_path / "decode_cpu.png").stat().st_size > 1000
        assert "](decode_cpu.png)" in md
    else:
        assert "matplotlib" in doc["plot_error"]


def test_decode_bounds_are_judged_per_layout():
    """Each bound met or missed from the rows as the issue states it, per layout; a missing case leaves the bound
    unjudged with its reason, and the markdown line says met / missed / not measured accordingly."""
    from bench import decode

    def row(case, us, floor=None):
        return {"case": case, "status": "ok", "median_us": us, "x_floor": us / floor if floor else None}

    rows = [row("step fill 8", 150.0, 100.0), row("decode layer", 172.0), row("fla fp32", 600.0),
            row("fla bf16", 340.0), row("step fill 8 (compact)", 151.0, 100.0), row("decode layer (compact)", 100.0),
            {"case": "fla fp32@baseline", "status": "ok", "median_us": 1.0}]
    b = {(x["layout"], x["against"]): x for x in decode.bounds(rows) if x["case"] != decode.VERIFY}
    ver = [x for x in decode.bounds(rows) if x["case"] == decode.VERIFY]
    assert [(x["layout"], x["met"], x["reason"]) for x in ver] == [("engine", None, "verify T=4 (fill 8) not timed")]
    assert b[("engine", "floor")]["met"] is True  # 1.5 <= 1.5
    assert b[("engine", "step fill 8")]["met"] is True  # 172 / 150 = 1.147
    assert b[("engine", "fla fp32")]["met"] is True and b[("engine", "fla bf16")]["met"] is False  # 0.287, 0.506
    assert b[("compact", "floor")]["met"] is False  # 1.51
    assert b[("compact", "step fill 8 (compact)")]["ratio"] == 100.0 / 151.0
    assert b[("compact", "fla bf16")]["met"] is True
    lines = decode.bound_lines({"bounds": decode.bounds(rows)})
    assert lines[0] == BOUNDS_LINE
    assert "step fill 8 / its floor = 1.50x (bound 1.5x: met)" in lines[1]
    assert "decode layer / fla bf16 = 0.51x (bound 0.5x: missed)" in lines[1]
    assert "step fill 8 (compact) / its floor = 1.51x (bound 1.5x: missed)" in lines[2]
    b = {(x["layout"], x["against"]): x for x in decode.bounds(rows[:2]) if x["case"] != decode.VERIFY}
    assert b[("engine", "fla fp32")]["met"] is None and b[("engine", "fla fp32")]["reason"] == "fla fp32 not timed"
    assert b[("compact", "step fill 8 (compact)")]["reason"] == ("decode layer (compact) and step fill 8 (compact) "
                                                                 "not timed")


@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_floor_counts_the_checkpoint_in_both_layouts(head_dim):
    """The step's floor reads the checkpoint's own bytes in either layout (the compact layout only pads to 128 B,
    which no kernel reads): the same bytes for both, the pool's views' sum, 19,456 B at 128 x 128, rank 4."""
    from bench import decode

    engine, compact = (decode.make_pool(3, 2, head_dim, "kda", layout, "cpu") for layout in ("engine", "compact"))
    assert (engine.layout, compact.layout) == ("engine", "compact")
    cp = compact.geometry.checkpoint_bytes
    assert cp == engine.geometry.checkpoint_bytes == program_bytes(compact)["checkpoint"]
    assert cp <= 4 * compact.geometry.head_stride < cp + 128
    if head_dim == 128:
        assert cp == 19456
    for f in (0, 7, 15):
        assert decode.step_bytes(compact, f, 2, 2, 2) == decode.step_bytes(engine, f, 2, 2, 2)
    fills = torch.tensor([[16, 3], [7, 16]])
    want = (2 * decode.step_bytes(engine, 0, 2, 2, 2) + decode.step_bytes(engine, 3, 2, 2, 2)
            + decode.step_bytes(engine, 7, 2, 2, 2) + 2 * program_bytes(engine)["total"])
    assert decode.layer_bytes(engine, fills, 2) == decode.layer_bytes(compact, fills, 2) == want


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_decode_setup_and_compact_twin(gate):
    """A batch sits at distinct random slots of a pool of 2 B + 1; the compact twin holds the same states and rings in
    those slots (the reference reads them back equal), 1/16 of the layer's rings full."""
    from bench import decode

    s = decode.setup(torch.device("cpu"), 8, 2, 2, 64, gate)
    assert s.pool.num_slots == 17 and s.pool.layout == "engine"
    assert s.slots.tolist() != list(range(1, 9))  # not the first slots in batch order
    assert len(set(s.slots.tolist())) == 8 and 1 <= min(s.slots.tolist()) and max(s.slots.tolist()) <= 16
    assert torch.equal(s.idx.long(), s.slots)
    assert int((s.layer_fills == 16).sum()) == 8 * 2 // 16 and int(s.layer_fills.min()) >= 1
    c = decode.compact_twin(s)
    assert c.layout == "compact"
    assert torch.equal(c.states(s.slots, backend="reference"), s.pool.states(s.slots, backend="reference"))
    for name in ("kbuf", "ubuf", "w", "pcum", "hcnt") + (("gbuf",) if gate == "kda" else ()):
        assert torch.equal(getattr(c, name)[s.slots], getattr(s.pool, name)[s.slots]), name


def test_decode_sweep_stops_at_its_time_limit():
    """A sweep point not started by the deadline is listed as skipped with the reason, never dropped."""
    from bench import decode

    timer = decode.Timer(torch.device("cpu"), {"GBps": 1.0}, 0.01)
    rows = decode.sweep_rows(timer, torch.device("cpu"), "gdn", (1, 2), 2, 2, 64, "reference", True, deadline=0.0)
    assert [(r["batch"], r["case"], r["status"]) for r in rows] == [
        (b, n, "skipped") for b in (1, 2) for n in ("decode layer", "fla fp32", "fla bf16")]
    assert all("time limit" in r["reason"] for r in rows)


def _naive_step(state, q, k, v, g, beta, scale):
    """One token of the gated delta rule, V-first, fp32: S = exp(g) S; S += beta (v - S k) k^T; o = scale S q."""
    S = state * torch.exp(g)[..., None, :]
    S = S + (beta[..., None] * (v - (S @ k[..., None])[..., 0]))[..., None] * k[..., None, :]
    return (S @ (scale * q)[..., None])[..., 0], S


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_decode_fla_anchor_is_the_gate_step_in_place(gate):
    """FLA's anchor (under the Triton interpreter here) is the gate's step on the rows' slots of the state pool, in
    place: GDN's scalar gate broadcast over K gives GDN's recurrence; other slots stay untouched bit for bit. fla-core
    is a test dependency: a missing FLA fails this test."""
    from bench import decode

    s = decode.setup(torch.device("cpu"), 3, 2, 2, 64, gate)
    gen = torch.Generator().manual_seed(5)
    state = 0.05 * torch.randn(s.pool.num_slots, 2, 64, 64, generator=gen)
    before = state.clone()
    out = torch.full((3, 1, 2, 64), float("nan"), dtype=torch.bfloat16)
    decode.fla_step(s, state, out)()
    g = s.g if gate == "kda" else s.g[..., None].expand(3, 2, 64)
    o, S = _naive_step(before[s.slots], s.q.float(), s.k.float(), s.v.float(), g, s.beta, 64 ** -0.5)
    assert torch.allclose(state[s.slots], S, atol=1e-4, rtol=1e-4)
    assert torch.allclose(out[:, 0].float(), o, atol=2e-2, rtol=2e-2)
    rest = torch.ones(s.pool.num_slots, dtype=torch.bool)
    rest[s.slots] = False
    assert torch.equal(state[rest], before[rest])


@pytest.mark.slow  # FLA's kernels through the Triton interpreter
def test_decode_bench_with_fla_on_the_cpu(tmp_path):
    """``--cpu-smoke --fla``: FLA's anchors timed for both gates and in the sweep, every bound judged met or missed,
    the sweep's ratios written."""
    from bench import decode

    assert decode.main(["--cpu-smoke", "--fla", "--batch", "2", "--heads", "2", "--sweep", "1,2",
                        "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "decode_cpu.json").read_text())
    md = (tmp_path / "decode_cpu.md").read_text()
    for gate, section in doc["gates"].items():
        rows = {c["case"]: c for c in section["cases"]}
        assert list(rows) == DECODE_CASES + ["fla fp32", "fla bf16"]
        assert all(r["status"] == "ok" for r in rows.values()), rows
        # the state read and written whole: the fp32 pool moves about twice the bf16 one
        assert 1.9 < rows["fla fp32"]["bytes"] / rows["fla bf16"]["bytes"] < 2.0
        assert all(b["met"] in (True, False) for b in section["bounds"])
        sw = {(r["batch"], r["case"]): r for r in doc["sweep"]["gates"][gate]}
        assert all(sw[(b, n)]["status"] == "ok" for b in (1, 2) for n in ("decode layer", "fla fp32", "fla bf16"))
        lay, bf = sw[(2, "decode layer")], sw[(2, "fla bf16")]
        assert f"| {lay['median_us'] / bf['median_us']:.2f} |" in _section(md, f"### {gate.upper()}")


@pytest.mark.slow  # two subprocess benchmarks
def test_decode_bench_baseline_runs_the_other_tree(tmp_path):
    """``--baseline DIR`` times LeapQuant's cases again under DIR's packages: a copy whose ``step`` marks each call
    shows that the ``@baseline`` rows came from it; its ``Pool`` takes no ``layout`` (as before the compact layout),
    so its compact cases are listed as skipped and its engine ones timed."""
    import shutil

    from bench import decode

    root = Path(__file__).resolve().parents[1]
    base = tmp_path / "base"
    for pkg in ("leapquant", "leapquant_triton", "leapquant_tilelang"):
        shutil.copytree(root / pkg, base / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    mark = tmp_path / "baseline_step_ran"
    init = base / "leapquant" / "__init__.py"
    init.write_text(init.read_text() + f"\n_step = step\n\n\ndef step(*a, **k):\n    open({str(mark)!r}, 'a').close()\n"
                    "    return _step(*a, **k)\n\n\nclass _PoolWithoutLayout(Pool):\n    def __init__(self, *a, **k):\n"
                    "        if 'layout' in k:\n            raise TypeError('unexpected keyword argument layout')\n"
                    "        super().__init__(*a, **k)\n\n\nPool = _PoolWithoutLayout\n")
    out = tmp_path / "out"
    assert decode.main(["--cpu-smoke", "--batch", "2", "--heads", "2", "--out", str(out), "--baseline", str(base)]) == 0
    doc = json.loads((out / "decode_cpu.json").read_text())
    md = (out / "decode_cpu.md").read_text()
    assert mark.exists()
    for gate, section in doc["gates"].items():
        rows = {r["case"]: r for r in section["cases"]}
        assert list(rows) == DECODE_CASES + [f"{n}@baseline" for n in DECODE_CASES]
        for n in DECODE_CASES:
            assert rows[n]["status"] == "ok"
            theirs = rows[f"{n}@baseline"]
            if n.endswith("(compact)"):
                assert theirs["status"] == "skipped" and "takes no layout" in theirs["reason"]
            else:
                assert theirs["status"] == "ok" and theirs["bytes"] == rows[n]["bytes"]
        assert "Against the baseline" in _section(md, f"## {gate.upper()}")
    # this tree's sweep only (below the ring's 16 sequences, each batch's decode cycle beside its layer)
    assert [r["case"] for r in doc["sweep"]["gates"]["kda"]] == ["decode layer", decode.CYCLE] * 3


def test_schedule_cases_have_exactly_their_due_heads():
    """``bench.schedule``'s cases (``bench.flush``'s, f = 1/L per ring): distinct real slots, exactly round(f N HV)
    heads full, the others partly filled."""
    from bench.flush import Case, _set_due

    pool = leapquant.Pool(9, 4, 64, 64, ring=8)
    for batch, fraction, due in ((4, "1/8", 2), (3, "1", 12), (1, "1/8", 1)):
        case = Case(pool.heads, batch, fraction)
        idx = _set_due(pool, case, seed=batch)
        slots = idx.tolist()
        assert len(set(slots)) == batch and all(1 <= s < pool.num_slots for s in slots)
        fills = pool.hcnt[idx.long()]
        assert case.due_count() == due and int((fills == 8).sum()) == due
        assert bool(((fills >= 0) & (fills <= 8)).all())


def test_schedule_bench_cpu_smoke_needs_the_interpreter(tmp_path, monkeypatch, capsys):
    """Without ``TRITON_INTERPRET=1`` the CPU smoke run says how to run it and writes nothing."""
    from bench import schedule

    monkeypatch.delenv("TRITON_INTERPRET")
    assert schedule.main(["--cpu-smoke", "--out", str(tmp_path / "out")]) == 2
    assert "TRITON_INTERPRET=1 python -m bench.schedule --cpu-smoke" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_schedule_bench_smoke(tmp_path):
    """``python -m bench.schedule --cpu-smoke`` through the interpreter: both schedules of every case timed beside
    the floor counted by hand, the same bytes from both, the markdown's rows."""
    from bench import schedule

    assert schedule.main(["--cpu-smoke", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "schedule_cpu.json").read_text())
    md = (tmp_path / "schedule_cpu.md").read_text()
    rows = doc["rows"]
    assert [(r["ring"], r["iters"], r["fraction"], r["schedule"]) for r in rows] == [
        (ring, it, f, s) for ring, it in ((8, 1), (32, 2)) for f in ("1/L", "1") for s in ("list", "grid")]
    for r in rows:
        assert r["status"] == "ok", r
        HV, K, V, L, R = 2, 64, 64, r["ring"], 4
        assert r["due"] == (4 if r["fraction"] == "1" else 1) and r["programs"] == 4 and r["picked"] == "grid"
        # checkpoint (codes, scales, factors) read and written, the ring's rows read and w, pcum, gbuf reset
        checkpoint = V * K + 4 * (K + V) + 2 * R * (K + V)
        ring = L * (2 * K + 2 * V + 4 + 2 * K) + 4 * K
        resets = L * 4 + 4 * K + L * 2 * K
        scan = 2 * (HV * 4 + 4)
        assert r["bytes"] == r["due"] * (2 * checkpoint + ring + resets) + scan, r
        assert r["same_bytes"] is True and r["flushed"] is True
    for r in rows[::2]:
        assert f"| {r['ring']} | {r['iters']} | 2 | {r['due']} |" in md
    assert md.count("| grid | yes |") + md.count("| list | yes |") == len(rows) // 2
