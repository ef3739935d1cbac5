"""Profiles, devices and backends under test.

Hypothesis profiles: ``ci`` (loaded when ``CI`` is set), ``dev`` (quick, the default), ``gpu`` (the GPU suite), all
derandomised so that a run draws the same examples every time; ``long`` (``HYPOTHESIS_PROFILE=long``, for a night
run) draws fresh ones, to look for new failures.
``LEAPQUANT_TEST_BACKENDS=a,b`` restricts the backend-parametrised tests to those backends (e.g. to check one backend
on a GPU while another is known broken there); the default is every backend available here. On a machine without CUDA, Triton kernels run through
its interpreter: ``TRITON_INTERPRET=1`` is set here before anything imports Triton.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

import leapquant  # noqa: E402

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", derandomize=True, max_examples=12, print_blob=True, **_common)
settings.register_profile("dev", derandomize=True, max_examples=6, **_common)
settings.register_profile("gpu", derandomize=True, max_examples=40, **_common)
settings.register_profile("long", max_examples=200, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def devices() -> list[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def backends_here(device: str) -> list[str]:
    """Backends that can flush a default pool (32 heads of 128 x 128) on ``device`` here (compiled backends on the
    CPU only through an interpreter)."""
    probe = leapquant.Pool(2, 32, device=device)
    only = [b for b in os.environ.get("LEAPQUANT_TEST_BACKENDS", "").split(",") if b]
    out = []
    for info in leapquant.backends():
        if only and info.name not in only:
            continue
        if info.available and leapquant.get_backend(info.name).supports(probe)[0]:
            out.append(info.name)
    return out


def pytest_generate_tests(metafunc):
    if "backend_device" in metafunc.fixturenames:
        params = [(b, d) for d in devices() for b in backends_here(d)]
        metafunc.parametrize("backend_device", params, ids=[f"{b}-{d}" for b, d in params])


def compute_devices() -> list[str]:
    """Where compiled kernels run: the GPU if there is one, else the CPU (through the Triton interpreter)."""
    return ["cuda"] if torch.cuda.is_available() else ["cpu"]


def pytest_report_header(config):
    rows = [f"{i.name}: {'available' if i.available else 'unavailable'} ({i.reason})" for i in leapquant.backends()]
    return ["leapquant backends: " + "; ".join(rows), f"devices under test: {devices()}"]


@pytest.fixture
def one_torch_thread():
    """One torch CPU thread for the test: its tensors are small, and two threads on a busy 2-core runner made the
    simulation's steps many times slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
