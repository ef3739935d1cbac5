"""The benchmark's fp32 KDA step kernel (``bench/step.py``) against its float64 version; on the CPU through Triton's
interpreter (``TRITON_INTERPRET=1``, set by conftest), on CUDA as well where there is one."""

import pytest
import torch

from bench import step

from .conftest import compute_devices

# (N rows, HV, K, V, BV): square and non-square heads, a block of rows smaller than, equal to and larger than V
SHAPES = [(2, 2, 64, 64, 32), (1, 3, 128, 64, 64), (2, 1, 64, 128, 128)]


@pytest.mark.parametrize("device", compute_devices())
@pytest.mark.parametrize("N,HV,K,V,BV", SHAPES)
def test_step_matches_float64(device, N, HV, K, V, BV):
    """New states and outputs within fp32 rounding of float64; a padding row (idx -1) and slots not in idx are
    left bit for bit as they were (``check`` poisons ``o`` with NaN first)."""
    for seed in (0, 1):
        r = step.check(torch.device(device), N=N, HV=HV, K=K, V=V, BV=BV, seed=seed)
        assert r["untouched"], r
        assert r["err_state"] < 1e-5 and r["err_o"] < 1e-5, r
        assert r["ok"]


def test_step_floor_counts_state_twice_plus_inputs():
    N, HV, K, V = 3, 2, 128, 64
    state = torch.zeros(N + 1, HV, V, K)
    inp = step.make_inputs(N, HV, K, V, torch.Generator().manual_seed(0), "cpu")
    o = torch.empty_like(inp["v"])
    per_head = 2 * V * K * 4 + (2 * K + V) * 2 + K * 4 + 4 + V * 2  # state r+w; q, k, v bf16; g, beta fp32; o bf16
    assert step.step_floor_bytes(state, inp, o, N) == N * HV * per_head + N * 4


def test_step_rejects_wrong_layouts():
    state = torch.zeros(2, 1, 64, 64)
    inp = step.make_inputs(1, 1, 64, 64, torch.Generator().manual_seed(0), "cpu")
    with pytest.raises(ValueError):
        step.kda_step(state.double(), torch.zeros(1, dtype=torch.int32), **inp)
    with pytest.raises(ValueError):
        step.kda_step(state, torch.zeros(1, dtype=torch.int64), **inp)
    with pytest.raises(ValueError):
        step.kda_step(state, torch.zeros(1, dtype=torch.int32), **{**inp, "q": inp["q"][..., :32]})
