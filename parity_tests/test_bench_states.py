"""``python -m bench.states --cpu-smoke``: the load_states / states benchmark end to end on the CPU, and its floors'
byte counts against the pool's format counted by hand."""

import json

import pytest

import leapquant
from bench import states

from .conftest import compute_devices


def test_floor_bytes_by_hand():
    """KDA, 128 x 128, ring 16, rank 4: the fp32 state 65,536 B; the checkpoint 16,384 codes + 512 s_k + 512 s_v +
    2,048 factors; the ring 4,096 kbuf + 4,096 ubuf + 64 w + 512 pcum + 4,096 gbuf; GDN's ring without gbuf and with
    one pcum word."""
    tb = states.transfer_bytes(leapquant.Pool(2, 32))
    assert (tb["state"], tb["checkpoint"], tb["ring"], tb["resets"]) == (65536, 19456, 12864, 4672)
    assert tb["load_states"] == 65536 + 19456 + 4672 + 4
    assert tb["states"] == 19456 + 12864 + 65536
    tg = states.transfer_bytes(leapquant.Pool(2, 4, gate="gdn"))
    assert (tg["ring"], tg["resets"]) == (4096 + 4096 + 64 + 4, 64 + 4)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=pytest.mark.slow)])
def test_cpu_smoke(tmp_path, backend):
    """Every case timed beside a positive floor, the check after timing passed, the JSON and markdown written; the
    Triton backend through its interpreter."""
    if backend == "triton":
        pytest.importorskip("triton")
        if compute_devices()[0] != "cpu":
            pytest.skip("the smoke run is the CPU path; on a GPU run python -m bench.states")
    assert states.main(["--cpu-smoke", "--batch", "2", "--heads", "2", "--backend", backend, "--out",
                        str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "states_cpu.json").read_text())
    assert doc["case"]["backend"] == backend
    names = [c["case"] for c in doc["cases"]]
    assert names == ["load_states", "states", "load_states, FLA layout", "states, FLA layout"]
    for c in doc["cases"]:
        assert c["median_us"] > 0 and c["floor_us"] > 0
        assert c["bytes"] == 2 * 2 * doc["bytes_per_head"][c["kind"]] + 2 * 4
    assert doc["check"]["ok"], doc["check"]
    assert "| states, FLA layout |" in (tmp_path / "states_cpu.md").read_text()
    # the flush of both layouts: all due and 1/16 due, the same bytes after one flush of the same contents
    lay = doc["layouts"]
    assert [(r["due"], r["layout"]) for r in lay] == [("1", "engine"), ("1", "compact"), ("1/16", "engine"),
                                                      ("1/16", "compact")]
    assert all(r["median_us"] > 0 and r["floor_us"] > 0 and r["same_bytes_as_engine"] for r in lay), lay
    # K = V = 64, rank 4: 5,632 B per compact checkpoint; the engine layout 16 KiB per head and a spare head
    assert (lay[0]["raw_bytes_per_slot"], lay[1]["raw_bytes_per_slot"]) == (3 * 16384, 2 * 5632)
