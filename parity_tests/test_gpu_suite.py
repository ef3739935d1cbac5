"""The GPU suite's reading of pytest's output: a test it misreads would drop out of the committed report."""

from .gpu_suite import parse_results

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
