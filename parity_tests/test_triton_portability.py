"""Ahead-of-time compile of the Triton flush and step kernels for every architecture the backend claims (no GPU
needed; the states kernels' builds: test_states.py).

Runs ``python -m leapquant_triton.portability --quick`` (the default shape, 128 x 128, ring 16, rank 4, KDA, and
64 x 64) for the claimed compute capabilities: the kernels must compile with Triton's bundled ptxas and fit each
architecture's registers, shared memory and spill allowance. It runs in a subprocess because conftest sets
``TRITON_INTERPRET=1`` on GPU-less machines, and the interpreter's kernel object cannot be compiled.
The full shape table is ``python -m leapquant_triton.portability``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia.compiler")

from leapquant_triton.flush import SCHEDULES  # noqa: E402
from leapquant_triton.portability import (MAX_SPILL_BYTES, PACKED_BUILDS, STEP, STEP_GLUON,  # noqa: E402
                                          STEP_GLUON_PACKED, STEP_GLUON_PACKED_TOKENS)
from leapquant_triton.step import gluon_kernel  # noqa: E402
from leapquant_triton.targets import STEP_CAPABILITIES, SUPPORTED_CAPABILITIES  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(*args: str, unset: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``python *args`` from the repository root, without ``TRITON_INTERPRET`` (and the variables in ``unset``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", *unset)}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def _run(*args: str) -> subprocess.CompletedProcess:
    return _python("-m", "leapquant_triton.portability", *args)


@pytest.mark.slow  # python -m pytest -m slow (CI runs it)
def test_claimed_architectures_fit():
    res = _run("--quick", "--ops", "flush,step", "--arch", ",".join(map(str, SUPPORTED_CAPABILITIES)))
    assert res.returncode == 0, res.stdout + res.stderr[-4000:]
    rows = [line for line in res.stdout.splitlines() if line.startswith("sm_")]
    # the flush's schedules and the step's two kernels, per shape
    assert len(rows) == 2 * (len(SCHEDULES) + 2) * len(SUPPORTED_CAPABILITIES), res.stdout
    # the Gluon step is built where the backend launches it: the 128 x 128 shape under its Triton releases
    gluon_here = gluon_kernel() is not None
    for line in rows:
        if " step-gluon " in line and not (gluon_here and " K128 V128 L16 " in line):
            assert "--" in line and "not built" in line and "(not claimed)" in line, line
            continue
        kernels = "|".join(SCHEDULES + (STEP, STEP_GLUON))
        m = re.search(rf" ({kernels}) +ok +warps +\d+ +regs +(\d+)/255 +spill +(\d+) B +smem +([\d.]+)/(\d+) KiB"
                      r" +(\S+) +sass +(\d+) ", line)
        assert m, line
        regs, spill, smem, limit = int(m[2]), int(m[3]), float(m[4]), int(m[5])
        assert 0 < regs <= 255 and spill <= MAX_SPILL_BYTES and 0 < smem <= limit, line
        # the flush and the step (its int8 and bf16 products): the mma.sync lowering on every target, Hopper and
        # Blackwell included (targets.mma_sync_only; the Gluon kernel's explicit mma_v2)
        assert m[6] == "mma.sync", line
        # the static SASS count, read from every claimed target's cubin
        assert int(m[7]) > 500, line
    assert sum(" step-gluon " in line and " ok " in line for line in rows) == (
        len(SUPPORTED_CAPABILITIES) if gluon_here else 0), res.stdout
    # the Gluon step exists to execute fewer instructions than the tl kernel (docs/DESIGN.md, "Triton: the decode
    # step"): at 128 x 128 its static count stays well below the tl kernel's on every target (about 0.6x under 3.9)
    sass = {(m[1], m[2], m[3]): int(m[4]) for m in (re.search(
        r"^(sm_\d+) +(\w+ K128 V128 L16 R4) +(step|step-gluon) +ok .* sass +(\d+) ", line) for line in rows) if m}
    for (arch, shape, kernel), n in sass.items():
        if kernel == STEP_GLUON:
            assert n < 0.8 * sass[arch, shape, STEP], (arch, shape, n, sass[arch, shape, STEP])
    assert len(sass) == len(SUPPORTED_CAPABILITIES) * (2 if gluon_here else 1), sass


@pytest.mark.slow  # python -m pytest -m slow (CI runs it, under every Triton release the extra takes)
def test_packed_step_builds_fit():
    """``step_packed``'s builds (the gates computed in the prologue; one token, and as many as a launch takes with
    the history) compile and fit on sm_80 and sm_90: the ``tl`` kernel at both shapes, the Gluon kernel at 128 x 128
    where it is taken (its Triton releases), elsewhere not built. The Gluon build of one token has no spills (its
    registers hold the gates beside the token's keys); its T-token build parks the gates for its second phase and
    spills at most 48 B more than the T-token step without the gates (``step-gluon``; -16 to +36 B under Triton
    3.6-3.9 on sm_80 and sm_90; computed again in phase two, +108 B under 3.9 on sm_90)."""
    res = _run("--quick", "--ops", "packed,step", "--arch", "80,90")
    assert res.returncode == 0, res.stdout + res.stderr[-4000:]
    rows = [line for line in res.stdout.splitlines() if line.startswith("sm_")]
    assert len(rows) == 2 * 2 * 6, res.stdout
    gluon_here = gluon_kernel() is not None
    packed = [line for line in rows if any(f" {b} " in line for b in PACKED_BUILDS)]
    assert len(packed) == 2 * 2 * 4, res.stdout
    fits = r"^(sm_\d+) +\w+ (K\d+ V\d+ L\d+) R\d +(\S+) +ok +warps +\d+ +regs +(\d+)/255 +spill +(\d+) B "
    spill = {(m[1], m[2], m[3]): int(m[5]) for m in (re.search(fits, line) for line in rows) if m}
    for line in packed:
        gluon = "-gluon-" in line
        if gluon and not (gluon_here and " K128 V128 L16 " in line):
            assert "not built" in line and "(not claimed)" in line, line
            continue
        m = re.search(fits, line)
        assert m and int(m[5]) <= MAX_SPILL_BYTES and " mma.sync " in line, line
        if m[3] == STEP_GLUON_PACKED:
            assert int(m[4]) <= 128 and int(m[5]) == 0, line
        elif m[3] == STEP_GLUON_PACKED_TOKENS:
            assert int(m[4]) <= 128 and int(m[5]) <= spill[m[1], m[2], STEP_GLUON] + 48, line
    assert sum("-gluon-packed" in line and " ok " in line for line in rows) == (4 if gluon_here else 0)


@pytest.mark.slow
def test_forced_flush_build_fits():
    """The forced flush's build (FORCE, grid schedule: fill counts read, partial rings masked, hcnt stored) fits every
    claimed architecture as the flush's builds do."""
    res = _run("--quick", "--ops", "force", "--arch", ",".join(map(str, SUPPORTED_CAPABILITIES)))
    assert res.returncode == 0, res.stdout + res.stderr[-4000:]
    rows = [line for line in res.stdout.splitlines() if line.startswith("sm_")]
    assert len(rows) == 2 * len(SUPPORTED_CAPABILITIES), res.stdout
    for line in rows:
        m = re.search(r" grid-force +ok +warps +\d+ +regs +(\d+)/255 +spill +(\d+) B .* mma\.sync ", line)
        assert m and int(m[2]) <= MAX_SPILL_BYTES, line


@pytest.mark.slow
def test_engine_kernels_fit():
    """accept's, step_packed's gate and copy_slots' kernels fit every architecture the step claims, sm_75 included,
    with no tensor-core instruction and no spill."""
    res = _run("--quick", "--ops", "engine", "--arch", ",".join(map(str, STEP_CAPABILITIES)))
    assert res.returncode == 0, res.stdout + res.stderr[-4000:]
    rows = [line for line in res.stdout.splitlines() if line.startswith("sm_")]
    assert len(rows) == 3 * 2 * len(STEP_CAPABILITIES), res.stdout
    for line in rows:
        m = re.search(r" (accept|gates|copy) +ok +warps +\d+ +regs +(\d+)/255 +spill +(\d+) B .* none ", line)
        assert m and int(m[3]) == 0 and "(not claimed)" not in line, line


@pytest.mark.parametrize("ptx,family", [
    ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1, %f2, %f3, %f4}, ...;", "mma.sync"),
    ("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%f1}, %rd1, %rd2, 1, 1, 1, 0, 0;", "wgmma"),
    ("tcgen05.mma.cta_group::1.kind::f16 [%r1], %rd2, %rd3, %r4, 1;", "tcgen05"),
    ("fma.rn.f32 %f1, %f2, %f3, %f4;", "none"),
    ("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 ...;\nwgmma.mma_async.sync.aligned.m64n32k16 ...;",
     "mma.sync+wgmma"),
])
def test_mma_family(ptx, family):
    from leapquant_triton.portability import mma_family

    assert mma_family(ptx) == family


@pytest.mark.slow  # python -m pytest -m slow (CI runs it)
def test_list_build_prefetches_from_sm_90_only():
    """The AOT check compiles the list build as an H200 launches it, with the L2 prefetch of the pair one round ahead
    (flush.prefetch_ahead: five bulk prefetches), and the sm_80 list build and the grid builds without it."""
    code = (
        "import leapquant_triton.portability as p\n"
        "for arch, kernel in ((90, 'list'), (100, 'list'), (80, 'list'), (90, 'grid')):\n"
        "    r = p.compile_one(arch, p.SHAPES[0], kernel)\n"
        "    print('RESULT', arch, kernel, r.ok, r.prefetches, r.error)\n"
    )
    res = _python("-c", code)
    assert res.returncode == 0, res.stdout + res.stderr[-4000:]
    got = {(x.split()[1], x.split()[2]): x.split()[3:5] for x in res.stdout.splitlines() if x.startswith("RESULT")}
    assert got == {("90", "list"): ["True", "5"], ("100", "list"): ["True", "5"], ("80", "list"): ["True", "0"],
                   ("90", "grid"): ["True", "0"]}, res.stdout


@pytest.mark.slow  # python -m pytest -m slow (CI runs it)
def test_unclaimed_target_reported_not_failed():
    """sm_75 (no bf16 tensor cores: FMA dots that spill) is compiled and reported as not fitting the flush, and does
    not fail the check because the backend does not claim the flush there; the step is claimed on sm_75, where its
    FMA kernel (no tensor cores) fits."""
    assert 75 not in SUPPORTED_CAPABILITIES and 75 in STEP_CAPABILITIES
    res = _run("--quick", "--ops", "flush,step", "--arch", "75")
    assert res.returncode == 0, res.stdout + res.stderr[-4000:]
    rows = [line for line in res.stdout.splitlines() if line.startswith("sm_75")]
    flush = [line for line in rows if f" {STEP} " not in line and f" {STEP_GLUON} " not in line]
    step = [line for line in rows if f" {STEP} " in line and f" {STEP_GLUON} " not in line]
    gluon = [line for line in rows if f" {STEP_GLUON} " in line]  # sm_80 and later only: not built here
    assert len(gluon) == 2 and all("not built" in line and "(not claimed)" in line for line in gluon), res.stdout
    assert flush and all("(not claimed)" in line for line in flush), res.stdout
    assert any(" FAIL " in line for line in flush), res.stdout
    assert len(step) == 2 and all(" ok " in line and "(not claimed)" not in line for line in step), res.stdout


def test_unknown_architecture_rejected():
    res = _run("--arch", "42")
    assert res.returncode != 0 and "unknown architectures" in res.stderr


@pytest.mark.slow  # python -m pytest -m slow (CI runs it)
def test_check_fails_a_wgmma_build():
    """The mma check can fail: compiled for sm_90 without ``mma_sync_only``, Triton takes wgmma and the check says
    so (the build the backend must never launch)."""
    code = (
        "import contextlib, leapquant_triton.portability as p\n"
        "p.mma_sync_only = contextlib.nullcontext\n"
        "r = p.compile_one(90, p.SHAPES[0], 'grid')\n"
        "print('RESULT', r.ok, r.mma, r.error)\n"
    )
    res = _python("-c", code, unset=("DISABLE_MMA_V3", "DISABLE_MMA_V5"))
    assert res.returncode == 0, res.stdout + res.stderr[-4000:]
    line = [x for x in res.stdout.splitlines() if x.startswith("RESULT")][0]
    assert line.split()[1:3] == ["False", "wgmma"], line


def _ci_releases():
    """``.ci/triton_releases.py``, the enumeration of the ``triton`` extra that CI's release loop runs on."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("triton_releases", os.path.join(ROOT, ".ci", "triton_releases.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ci_checks_the_declared_triton_range(tmp_path):
    """CI tests every release the ``triton`` extra allows, as .ci/triton_releases.py reads them from pyproject.toml:
    the oldest must be the backend's MIN_TRITON (else CI would test a release the backend refuses, or skip one it
    takes), the running Triton must be one of them, and a range it cannot enumerate fails instead of testing none."""
    from leapquant_triton.targets import MIN_TRITON, triton_release

    import triton

    script = _ci_releases()
    releases = script.allowed_releases()
    assert releases[0] == MIN_TRITON, (releases, MIN_TRITON)
    assert triton_release(triton.__version__) in releases, (triton.__version__, releases)
    res = _python(os.path.join(".ci", "triton_releases.py"), "--older")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [f"{a}.{b}" for a, b in releases[:-1]], res.stdout

    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project.optional-dependencies]\ntriton = ["triton>=3.5"]\n')
    with pytest.raises(SystemExit, match="expected the form"):
        script.allowed_releases(pyproject)
    pyproject.write_text('[project.optional-dependencies]\ntriton = ["triton>=3.5,<3.7"]\n')
    assert script.allowed_releases(pyproject) == [(3, 5), (3, 6)]
