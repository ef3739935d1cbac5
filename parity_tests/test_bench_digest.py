"""``python -m bench.digest --baseline``: it runs its cases under the other tree's packages and tells equal bytes from
different ones (the reference backend, so that it runs on a CPU)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# appended to the baseline copy's leapquant/__init__.py: every flush then flips one bit of the pool
TAMPER = '''
_flush_unchanged = flush


def flush(pool, idx, *args, **kwargs):
    out = _flush_unchanged(pool, idx, *args, **kwargs)
    pool.raw.view(torch.uint8).view(-1)[0] ^= 1
    return out
'''


def _baseline(tmp_path: Path, tamper: bool) -> Path:
    for pkg in ("leapquant", "leapquant_triton", "leapquant_tilelang"):
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    if tamper:
        init = tmp_path / "leapquant" / "__init__.py"
        init.write_text(init.read_text() + "\nimport torch\n" + TAMPER)
    return tmp_path


def _digest(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.digest", "--device", "cpu", "--backends", "reference", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # python -m pytest -m slow (CI runs it)
@pytest.mark.parametrize("tamper", [False, True], ids=["same-packages", "one-bit-flipped"])
def test_baseline_comparison(tmp_path, tamper):
    res = _digest("--baseline", str(_baseline(tmp_path, tamper)))
    n = 8  # bench.digest.CASES, all supported by the reference, each digested after a flush, a step and states
    if tamper:
        # only leapquant.flush flips its bit: the step and states records still agree
        assert res.returncode == 1, res.stdout + res.stderr
        assert f"{2 * n} cases with the same bytes, {n} different" in res.stdout
        assert res.stdout.count("DIFFERENT BYTES") == n
        assert all(line.split()[1] == "flush" for line in res.stdout.splitlines() if "DIFFERENT" in line)
    else:
        assert res.returncode == 0, res.stdout + res.stderr
        assert f"{3 * n} cases with the same bytes, 0 different" in res.stdout


def test_unknown_backend_is_refused():
    res = subprocess.run([sys.executable, "-m", "bench.digest", "--backends", "triton,fla"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert "--backends: fla; choose from triton, tilelang, reference" in res.stderr


@pytest.mark.slow  # python -m pytest -m slow (CI runs it)
def test_without_a_gpu_backend_it_says_so_and_fails():
    """On a CPU the default backends (Triton, TileLang) flush nothing: ``bench.digest`` must not report success."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU backend runs here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as a reader runs it, no interpreter
    res = subprocess.run([sys.executable, "-m", "bench.digest", "--device", "cpu"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600, env=env)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "needs a GPU backend" in res.stderr and "--backends reference" in res.stderr, res.stderr
