"""``python -m bench.engine --cpu-smoke``: the accept / copy_slots benchmark end to end on the CPU, and its floors'
byte counts against the pool's format counted by hand."""

import json

import torch

import leapquant
from bench import engine


def test_floor_bytes_by_hand():
    """KDA, 128 x 128, ring 16, rank 4. accept per head: start and count read, hcnt and count written (4 x 4 B), the
    history's pcum [128] and w [16] read and written to the pool (2 x 576 B); per entry taken back a 256 B gate row.
    copy_slots per head: the checkpoint (16,384 codes + 512 s_k + 512 s_v + 2,048 factors) and the ring (4,096 kbuf
    + 4,096 ubuf + 64 w + 512 pcum + 4,096 gbuf) and hcnt, read and written. GDN: one pcum word, no gates."""
    kda = engine.head_bytes(leapquant.Pool(2, 32))
    assert (kda["accept"], kda["accept_gate"], kda["copy"]) == (16 + 2 * 576, 256, 2 * (19456 + 12864 + 4))
    gdn = engine.head_bytes(leapquant.Pool(2, 4, gate="gdn"))
    assert (gdn["accept"], gdn["accept_gate"]) == (16 + 2 * (4 + 64), 0)
    pool = leapquant.Pool(2, 32)
    n = torch.tensor([0, 4, 2], dtype=torch.int32)  # 4 + 0 + 2 entries taken back
    assert engine.accept_bytes(pool, n) == 3 * (32 * (16 + 2 * 576) + 8) + 6 * 32 * 256


def test_cpu_smoke(tmp_path):
    """Every case timed beside a positive floor, the checks after timing passed, the JSON and markdown written."""
    assert engine.main(["--cpu-smoke", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "engine_cpu.json").read_text())
    assert [(c["gate"], c["case"]) for c in doc["cases"]] == [
        ("kda", "accept T=4"), ("kda", "copy_slots 2 pairs"), ("kda", "copy_slots 2 pairs, torch"),
        ("gdn", "accept T=4"), ("gdn", "copy_slots 2 pairs"), ("gdn", "copy_slots 2 pairs, torch")]
    assert all(c["floor_us"] > 0 and c["median_us"] > 0 for c in doc["cases"])
    assert doc["ok"] and len(doc["checks"]) == 4
    assert "| kda | accept T=4 |" in (tmp_path / "engine_cpu.md").read_text()
