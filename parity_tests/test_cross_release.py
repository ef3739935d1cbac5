"""bench/cross_release on the CPU: the launch keys the sweep and the cases make, the sweep's checks (they hold for
the interpreter's step and catch a wrong output), a key's ahead-of-time build, and the byte comparison. The GPU part
(each release's cubin launched through the driver API) runs on the device: bench/results/cross_release_*.md."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("triton")

import leapquant_triton.launcher as launcher  # noqa: E402
import leapquant_triton.step as ST  # noqa: E402
from bench.cross_release import cases, routing, sweep  # noqa: E402


@pytest.fixture
def capture(tmp_path, monkeypatch):
    """The routing installed for this test only, capturing keys without launching: the interpreter's launches (of the
    ``tl`` twin, keyed as the Gluon kernel's), as ``bench.cross_release.keys`` makes them; on a GPU the CPU pools of
    the cases have no Triton launches to capture, and ``bench.cross_release.check`` is the harness's GPU run."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("captures the Triton interpreter's launches (TRITON_INTERPRET=1, as on a machine without CUDA)")
    monkeypatch.setattr(launcher.Prepared, "__call__", routing._routed)
    path = tmp_path / "keys.jsonl"
    monkeypatch.setattr(routing, "state", routing.State(capture=str(path), dry=True))
    return path


def _keys(path):
    return [json.loads(line) for line in open(path)]


def test_sweep_keys(capture):
    """One key per launch at the Gluon kernel's shape: the one-token configurations' (no history), and a call of T > 4
    tokens as launches of at most four, as even as they can be, each with the history of the whole call."""
    sweep.capture()
    keys = _keys(capture)
    n_one = sum(c["T"] == 1 for c in sweep.CONFIGS)
    assert len(keys) == n_one + sum(1 if c["T"] <= 4 else 2 for c in sweep.CONFIGS if c["T"] > 1)
    assert all(k["K"] == k["V"] == 128 and k["L"] == 16 and "ints" not in k for k in keys)
    assert all(k["HIST"] is (k["T"] > 1 or k["TOFF"] > 0) for k in keys)
    long_calls = sorted((k["IS_KDA"], k["HT"], k["TOFF"], k["T"]) for k in keys if k["HT"] > 5)
    assert long_calls == sorted([(g, 7, 0, 3) for g in (True, False)] + [(g, 7, 3, 3) for g in (True, False)]
                                + [(g, 9, 0, 4) for g in (True, False)] + [(g, 9, 4, 4) for g in (True, False)])
    dtypes = {(k["ptrs"]["q"][0], k["ptrs"]["g"][0], k["ptrs"]["out"][0]) for k in keys}
    assert {("bf16", "fp32", "bf16"), ("fp32", "fp32", "fp32"), ("fp16", "fp16", "fp16"), ("bf16", "bf16", "fp32")} \
        <= dtypes
    assert {k["FIRST"] for k in keys} == {0, 1} and {k["USE_QK_L2NORM"] for k in keys} == {False, True}


def test_case_keys(capture, monkeypatch):
    """The cases' keys carry their integer arguments (what Triton's runtime specialises on): the 256-row benchmark
    here at 8 rows, the same tensors' strides and flags."""
    monkeypatch.setattr(cases, "B", 8)
    routing.state.ints = True
    cases.capture()
    keys = _keys(capture)
    assert len(keys) == 2 * len(cases.CASES)
    assert all(k["ints"]["G"] == 1 and k["ints"]["NS"] == 17 for k in keys)
    assert sorted((k["T"], k["HIST"], k["PACKED"]) for k in keys) == sorted(
        [(1, False, 0), (1, False, 1), (4, False, 0), (4, True, 0)] * 2)


def test_key_needs_the_gluon_shape():
    args = {n: 0 for n in routing.ARGS}
    args.update(K=64, V=64, L=16, R=4)
    assert routing.key_of(args) is None


def test_compare():
    a = {"x": torch.tensor([1.0, 2.0], dtype=torch.bfloat16), "n": torch.tensor([1, 2], dtype=torch.int32)}
    b = {"x": torch.tensor([1.0, 2.015625], dtype=torch.bfloat16), "n": torch.tensor([1, 3], dtype=torch.int32)}
    assert cases.compare(a, a) == "same bytes"
    assert cases.compare(a, b) == "x: 1 of 2 differ, by up to 7.8e-03 of its largest; n: 1 bytes differ"


@pytest.mark.slow
def test_sweep_checks_hold_and_catch(monkeypatch):
    """The sweep's criteria hold for the interpreter's step (nothing routed: no cubins) and fail for a step whose
    output is off by 1e-3 of a row."""
    monkeypatch.setattr(launcher.Prepared, "__call__", routing._routed)
    state = routing.State(lib="/nonexistent")
    monkeypatch.setattr(sweep, "CONFIGS", [c for c in sweep.CONFIGS if c["T"] in (1, 3)][:1]
                        + [c for c in sweep.CONFIGS if c["T"] == 3][:1])
    rows = sweep.run(state, ["here"])
    assert [r["results"]["here"] for r in rows] == ["pass", "pass"], rows
    step = ST.step_pool

    def off(*args, **kwargs):
        step(*args, **kwargs)
        out = kwargs["out"]
        out.add_(1e-3 * out.abs().amax(-1, keepdim=True))

    monkeypatch.setattr(ST, "step_pool", off)
    rows = sweep.run(state, ["here"])
    assert all("out" in r["results"]["here"] for r in rows), rows


_BUILD = """
import json, re, sys
from bench.cross_release.compile import build
key = json.load(open(sys.argv[1]))
out = {}
for name, k in (("plain", key), ("ints", dict(key, ints={"G": 1, "NS": 17}))):
    _, sig, ck = build(k)
    entry = re.search(r"\\.entry\\s+\\w+\\s*\\((.*?)\\)", ck.asm["ptx"], re.S).group(1)
    out[name] = dict(sig=sig, nparams=len(re.findall(r"\\.param\\s", entry)))
print(json.dumps(out))
"""


@pytest.mark.slow
def test_build_of_a_key(capture, tmp_path):
    """A key's build under the installed Triton (a subprocess without the interpreter, as the AOT check): its
    parameters the key's non-constexpr arguments and the two scratch pointers Triton appends; an integer argument of
    1 in the key a constant of the build, another a plain i32."""
    import os
    import subprocess
    import sys

    from leapquant_triton.step import gluon_kernel

    if gluon_kernel() is None:
        pytest.skip("this Triton is not a release of the Gluon step")
    sweep.capture()
    key = _keys(capture)[0]
    path = tmp_path / "key.json"
    path.write_text(json.dumps(key))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _BUILD, str(path)], capture_output=True, text=True, env=env,
                         timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for name in ("plain", "ints"):
        sig = out[name]["sig"]
        assert out[name]["nparams"] == sum(v != "constexpr" for v in sig.values()) + 2, out[name]
        assert sig["q"] == "*" + key["ptrs"]["q"][0] and sig["NS"] == "i32"
    assert out["plain"]["sig"]["G"] == "i32" and out["ints"]["sig"]["G"] == "constexpr"
