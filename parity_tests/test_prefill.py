"""The prefill round trip (``leapquant.tools.prefill``): FLA's prefill state -> ``load_states`` -> ``leapquant.step`` ->
``states`` -> FLA's prefill resumed, against FLA continuing from the exact state. On a CPU FLA's naive recurrences
stand in for its GPU kernels; the Triton path runs through the interpreter. The GPU suite calls the same
``round_trip`` on CUDA with FLA's ``chunk_*`` and ``fused_recurrent_*`` kernels."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("fla")

from leapquant.tools.prefill import SIMULATION_OUTPUT_WORST, failures, main, round_trip, table  # noqa: E402

from .conftest import compute_devices  # noqa: E402


@pytest.mark.parametrize("gate,backend", [("kda", "reference"), ("gdn", "reference"),
                                          pytest.param("kda", "triton", marks=pytest.mark.slow)])
def test_round_trip_within_the_simulation_error(gate, backend):
    """Decode and resumed outputs within the decode simulation's worst LeapQuant output error of FLA's exact
    continuation; a ring flushed inside the decode (20 tokens, ring 16); FLA's own fp32 continuation within 1e-4 of
    the float64 recurrence, far below LeapQuant's few 1e-3 (so the comparison measures LeapQuant, not FLA)."""
    if backend == "triton":
        pytest.importorskip("triton")
    device = compute_devices()[0] if backend == "triton" else "cpu"
    r = round_trip(device, gate=gate, seqs=2, heads=2, head_k=64, head_v=64, prompt=64, decode=20, resume=32,
                   backend=backend, seed=1)
    assert r["config"]["backend"] == backend and r["config"]["step_backend"] == backend
    assert not failures(r), table(r)
    assert r["fla_vs_float64_output_error"]["worst"] < 1e-4, table(r)
    # the state was compressed (an int8 checkpoint: errors of a few 1e-3), not copied
    assert 1e-4 < r["load_state_error"]["mean"] < SIMULATION_OUTPUT_WORST["synthetic"], table(r)
    assert r["decode_output_error"]["worst"] > 0 and r["resume_output_error"]["worst"] > 0


def test_failures_and_cli(tmp_path, capsys):
    """The judge fails a non-finite result and one past the bound; the command line writes its figures."""
    r = round_trip("cpu", gate="kda", seqs=1, heads=1, head_k=64, head_v=64, prompt=16, decode=2, resume=16,
                   stream="structured", backend="reference")
    assert not failures(r)
    bad = {**r, "finite": False, "resume_output_error": {"mean": 1.0, "worst": float("nan")}}
    assert len(failures(bad)) == 2
    path = tmp_path / "rt.json"
    assert main(["--device", "cpu", "--seqs", "1", "--heads", "1", "--prompt", "16", "--decode", "2", "--resume",
                 "16", "--json", str(path)]) == 0
    assert "PASS" in capsys.readouterr().out and path.stat().st_size > 100
    assert torch.isfinite(torch.tensor(r["decode_output_error"]["worst"]))
