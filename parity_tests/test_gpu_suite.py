"""The GPU suite's reading of pytest's output (a test it misreads would drop out of the committed report) and the order
it has pytest run its tests in."""

import os
import subprocess
import sys

from .gpu_suite import LONG_FIRST, parse_results

# pytest -v in one process, then the same tests as pytest-xdist workers print them (with the test-id line each
# worker prints before it runs one); ids with brackets and spaces inside the parameters
SERIAL = """\
parity_tests/test_core.py::test_layout_is_byte_exact[32-128-128-16-4] PASSED [  0%]
parity_tests/test_parity.py::test_flush_meets_spec[triton-cuda] FAILED   [ 50%]
parity_tests/test_parity.py::test_flush_meets_spec[tilelang-cuda] PASSED [ 60%]
parity_tests/test_parity.py::test_value_domain[tilelang-cuda-2^-40] SKIPPED (out of its domain) [ 70%]
parity_tests/test_core.py::test_bad_idx[<lambda>-ValueError-idx values1] PASSED [ 80%]
parity_tests/test_core.py::test_start_matrix ERROR                      [ 90%]
parity_tests/test_triton_kernel.py::test_rank2_known[triton-cuda] XFAIL (known: fp16 iteration) [ 95%]
parity_tests/test_multi_gpu.py SKIPPED (needs two GPUs)                 [100%]
FAILED parity_tests/test_parity.py::test_flush_meets_spec[triton-cuda] - AssertionError
"""
XDIST = """\
parity_tests/test_core.py::test_layout_is_byte_exact[32-128-128-16-4] 
[gw1] [  0%] PASSED parity_tests/test_core.py::test_layout_is_byte_exact[32-128-128-16-4] 
parity_tests/test_parity.py::test_flush_meets_spec[triton-cuda] 
[gw0] [ 50%] FAILED parity_tests/test_parity.py::test_flush_meets_spec[triton-cuda] 
[gw1] [ 60%] PASSED parity_tests/test_parity.py::test_flush_meets_spec[tilelang-cuda] 
[gw0] [ 70%] SKIPPED parity_tests/test_parity.py::test_value_domain[tilelang-cuda-2^-40] 
[gw1] [ 80%] PASSED parity_tests/test_core.py::test_bad_idx[<lambda>-ValueError-idx values1] 
[gw1] [ 90%] ERROR parity_tests/test_core.py::test_start_matrix 
[gw0] [ 95%] XFAIL parity_tests/test_triton_kernel.py::test_rank2_known[triton-cuda] 
[gw1] [100%] SKIPPED parity_tests/test_multi_gpu.py 
FAILED parity_tests/test_parity.py::test_flush_meets_spec[triton-cuda] - AssertionError
"""
EXPECTED = {
    "test_core::test_layout_is_byte_exact 32": {"passed": 1, "failed": 0, "skipped": 0, "xfailed": 0},
    "test_parity::test_flush_meets_spec triton": {"passed": 0, "failed": 1, "skipped": 0, "xfailed": 0},
    "test_parity::test_flush_meets_spec tilelang": {"passed": 1, "failed": 0, "skipped": 0, "xfailed": 0},
    "test_parity::test_value_domain tilelang": {"passed": 0, "failed": 0, "skipped": 1, "xfailed": 0},
    "test_core::test_bad_idx <lambda>": {"passed": 1, "failed": 0, "skipped": 0, "xfailed": 0},
    "test_core::test_start_matrix": {"passed": 0, "failed": 1, "skipped": 0, "xfailed": 0},
    "test_triton_kernel::test_rank2_known triton": {"passed": 0, "failed": 0, "skipped": 0, "xfailed": 1},
    "test_multi_gpu": {"passed": 0, "failed": 0, "skipped": 1, "xfailed": 0},
}
FAILED = ["test_parity::test_flush_meets_spec[triton-cuda]", "test_core::test_start_matrix"]


def test_parse_results_reads_both_forms_alike():
    for text in (SERIAL, XDIST):
        results, failures = parse_results(text)
        assert results == EXPECTED
        assert failures == FAILED


def _collected(env_first: str | None, workers: int | None = None, keyword: str = "") -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LEAPQUANT_LONG_FIRST", "PYTEST_XDIST_WORKER_COUNT")}
    if env_first is not None:
        env["LEAPQUANT_LONG_FIRST"] = env_first
    if workers is not None:
        env["PYTEST_XDIST_WORKER_COUNT"] = str(workers)  # what pytest-xdist sets in each of its processes
    files = ["parity_tests/test_core.py", "parity_tests/test_prefill.py", "parity_tests/test_parity.py",
             "parity_tests/test_triton_step.py"]
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "-m", "slow or not slow", *(["-k", keyword] if keyword else []), *files], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return [line for line in r.stdout.splitlines() if "::" in line]


def test_long_tests_are_collected_first():
    """The GPU suite's LONG_FIRST names tests that exist (a renamed test would silently fall back to last), and with
    them named the collection puts them first, each group in its own order."""
    plain = _collected(None)
    ordered = _collected(",".join(LONG_FIRST))
    for prefix in LONG_FIRST:
        assert any(i.startswith(prefix) for i in plain), prefix
    long = [i for i in plain if i.startswith(LONG_FIRST)]
    rest = [i for i in plain if not i.startswith(LONG_FIRST)]
    assert plain[:len(long)] != long  # the files put them elsewhere: the ordering is what moved them
    assert ordered == long + rest


def test_long_tests_start_one_per_xdist_process():
    """Under pytest-xdist's ``load`` schedule each of W processes first takes a block of max(n // W // 4, 2)
    consecutive tests of the n selected; the long tests lead one block each (side by side, one process ran them all in
    turn), counted after -k's deselection."""
    keyword = "not test_bad"
    plain = _collected(None, keyword=keyword)
    ordered = _collected(",".join(LONG_FIRST), workers=14, keyword=keyword)
    assert sorted(ordered) == sorted(plain) and not any("test_bad" in i for i in plain)
    chunk = max(len(plain) // 14 // 4, 2)
    long = [i for i in plain if i.startswith(LONG_FIRST)]
    assert len(long) > 1 and chunk > 1
    assert [ordered[j * chunk] for j in range(len(long))] == long
    rest = [i for i in plain if not i.startswith(LONG_FIRST)]
    assert [i for i in ordered if not i.startswith(LONG_FIRST)] == rest
