"""``python -m bench --cpu-smoke`` end to end (subprocess workers, records, report, JSON / markdown / plot), and the
floor's byte count against the SPEC's own figure."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_decode_bench_smoke(tmp_path):
    """``python -m bench.decode --cpu-smoke``: every step case timed beside a positive floor, the JSON and markdown
    written, the memory per sequence of each format."""
    from bench import decode

    assert decode.main(["--cpu-smoke", "--batch", "2", "--heads", "2", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "decode_cpu.json").read_text())
    names = [c["case"] for c in doc["cases"]]
    assert names == ["step fill 1", "step fill 8", "step fill 15", "decode layer"]
    for c in doc["cases"]:
        assert c["median_us"] > 0 and c["floor_us"] > 0 and c["bytes"] > 0
    # the decode layer moves more than the half-full step (a flush inside), fill 15 more than fill 1
    assert doc["cases"][2]["bytes"] > doc["cases"][0]["bytes"]
    m = doc["memory_per_sequence"]
    assert m["fp32"] == 2 * m["bf16"] == 2 * 2 * 128 * 128 * 2
    assert "| decode layer |" in (tmp_path / "decode_cpu.md").read_text()


def test_decode_bench_baseline_runs_the_other_tree(tmp_path):
    """``--baseline DIR`` times LeapQuant's cases again under DIR's packages: a copy whose ``step`` marks each call
    shows that the ``@baseline`` rows came from it."""
    import shutil

    from bench import decode

    root = Path(__file__).resolve().parents[1]
    base = tmp_path / "base"
    for pkg in ("leapquant", "leapquant_triton", "leapquant_tilelang"):
        shutil.copytree(root / pkg, base / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    mark = tmp_path / "baseline_step_ran"
    init = base / "leapquant" / "__init__.py"
    init.write_text(init.read_text() + f"\n_step = step\n\n\ndef step(*a, **k):\n    open({str(mark)!r}, 'a').close()\n"
                    "    return _step(*a, **k)\n")
    out = tmp_path / "out"
    assert decode.main(["--cpu-smoke", "--batch", "2", "--heads", "2", "--out", str(out), "--baseline", str(base)]) == 0
    doc = json.loads((out / "decode_cpu.json").read_text())
    names = [r["case"] for r in doc["cases"]]
    assert names == ["step fill 1", "step fill 8", "step fill 15", "decode layer", "step fill 1@baseline",
                     "step fill 8@baseline", "step fill 15@baseline", "decode layer@baseline"]
    assert mark.exists()
    assert "Against the baseline" in (out / "decode_cpu.md").read_text()
