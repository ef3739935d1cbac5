"""The Triton backend's launcher (leapquant_triton/launcher.py): when it compiles through ``fn[grid]`` and when it
launches a kept kernel directly. A stand-in for the ``@triton.jit`` function records what happens, so these run on
any machine; test_triton_kernel.py checks on the GPU that direct launches write the same bytes as bound ones."""

from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("triton")

from leapquant_triton.launcher import Launcher  # noqa: E402


class _Compiled:
    """Stands in for Triton's CompiledKernel: ``kernel[grid](*args)`` records the launch."""

    function = object()

    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("direct", grid, args))


class _JitFn:
    """Stands in for a JITFunction ``f(x, y, n, B: constexpr)``: ``fn[grid](**kw)`` records a bound launch (which may
    compile) and returns the compiled kernel."""

    arg_names = ["x", "y", "n", "B"]
    __name__ = "f"

    def __init__(self, returns_kernel=True):
        self.log = []
        self.inside = []  # whether the compile context was entered at each bound launch
        self.context = False
        self.returns_kernel = returns_kernel

    def __getitem__(self, grid):
        def run(**kw):
            self.log.append(("bound", grid, kw))
            self.inside.append(self.context)
            return _Compiled(self.log) if self.returns_kernel else object()
        return run

    @contextlib.contextmanager
    def compile_context(self):
        self.context = True
        try:
            yield
        finally:
            self.context = False


def _launcher(fn, device=lambda: -1, **kw):
    """A launcher of the stand-in whose current device is the CPU tensors' (``Tensor.get_device()`` is -1 there)."""
    return Launcher(fn, fn.compile_context, direct=True, current_device=device, **kw)


def _args(x, y, n=128, B=True):
    return dict(x=x, y=y, n=n, B=B)


OPTS = dict(num_warps=8, enable_fp_fusion=True)


def test_second_launch_is_direct_with_arguments_in_signature_order():
    fn = _JitFn()
    la = _launcher(fn)
    x, y = torch.zeros(64), torch.zeros(64, dtype=torch.int32)
    la((4, 2), _args(x, y), OPTS)
    la((7,), _args(y=y, x=x), OPTS)  # keyword order does not matter; the grid is padded to three
    assert [e[0] for e in fn.log] == ["bound", "direct"]
    assert fn.inside == [True]
    assert fn.log[0][2] == dict(_args(x, y), **OPTS)
    grid, args = fn.log[1][1], fn.log[1][2]
    # tensors go as their addresses (Triton's launcher takes an int as the pointer, with no driver query)
    assert grid == (7, 1, 1) and args == (x.data_ptr(), y.data_ptr(), 128, True)


@pytest.mark.parametrize("change", ["misaligned", "dtype", "int", "constexpr", "option", "knob"])
def test_a_launch_triton_may_specialise_differently_compiles_again(change, monkeypatch):
    """Every input of Triton's specialisation key is part of the launcher's: a launch that differs in one goes
    through fn[grid] again (so Triton picks or compiles the right binary), and is then kept under its own key."""
    import triton

    fn = _JitFn()
    la = _launcher(fn)
    buf = torch.zeros(65)
    x, y = buf[:64], torch.zeros(64, dtype=torch.int32)
    la((1,), _args(x, y), OPTS)
    la((1,), _args(x, y), OPTS)
    a, o = _args(x, y), dict(OPTS)
    if change == "misaligned":
        a["x"] = buf[1:]  # 4 bytes past a 16-byte boundary
        assert a["x"].data_ptr() % 16 == 4
    elif change == "dtype":
        a["x"] = torch.zeros(64, dtype=torch.float16)
    elif change == "int":
        a["n"] = 1
    elif change == "constexpr":
        a["B"] = False
    elif change == "option":
        o["num_warps"] = 4
    else:
        monkeypatch.setattr(triton.knobs.runtime, "debug", not triton.knobs.runtime.debug)
    la((1,), a, o)
    la((1,), a, o)
    assert [e[0] for e in fn.log] == ["bound", "direct", "bound", "direct"]
    assert len(la.kernels) == 2


def test_the_current_device_is_part_of_the_key():
    """Triton's kernels and their handles are per device: the same arguments under another current device are
    another key (tensors on the CPU report device -1, the stand-in's device here)."""
    dev = [-1]
    la = _launcher(_JitFn(), device=lambda: dev[0])
    x, y = torch.zeros(64), torch.zeros(64, dtype=torch.int32)
    a = la.key(_args(x, y), OPTS)
    assert a[0] == -1 and a[1:] == la.key(_args(x, y), OPTS)[1:]
    dev[0] = 0
    with pytest.raises(ValueError, match="argument x is on cpu, but the current device is 0"):
        la.key(_args(x, y), OPTS)


@pytest.mark.parametrize("kept", [False, True])
def test_a_tensor_off_the_current_device_is_refused_before_any_launch(kept):
    """A direct launch passes addresses, which Triton's launcher does not check: the launcher refuses a tensor that is
    not on the current device (a kernel would fault on it), whether or not a kernel is kept for the key."""
    fn = _JitFn()
    dev = [-1]
    la = _launcher(fn, device=lambda: dev[0])
    x, y = torch.zeros(64), torch.zeros(64, dtype=torch.int32)
    if kept:
        la((1,), _args(x, y), OPTS)
    dev[0] = 0
    with pytest.raises(ValueError, match="argument x is on cpu"):
        la((1,), _args(x, y), OPTS)
    assert len(fn.log) == int(kept)


def test_not_direct_always_binds():
    fn = _JitFn()
    la = Launcher(fn, fn.compile_context, direct=False, current_device=lambda: 0)
    x, y = torch.zeros(64), torch.zeros(64, dtype=torch.int32)
    for _ in range(3):
        la((1,), _args(x, y), OPTS)
    assert [e[0] for e in fn.log] == ["bound"] * 3 and fn.inside == [True] * 3 and not la.kernels


def test_a_result_that_is_not_a_compiled_kernel_is_not_kept():
    fn = _JitFn(returns_kernel=False)
    la = _launcher(fn)
    x, y = torch.zeros(64), torch.zeros(64, dtype=torch.int32)
    la((1,), _args(x, y), OPTS)
    la((1,), _args(x, y), OPTS)
    assert [e[0] for e in fn.log] == ["bound", "bound"] and not la.kernels


def test_wrong_arguments_are_refused():
    fn = _JitFn()
    la = _launcher(fn)
    x, y = torch.zeros(64), torch.zeros(64, dtype=torch.int32)
    with pytest.raises(TypeError, match="takes"):
        la((1,), dict(x=x, y=y, n=1), OPTS)
    with pytest.raises(TypeError, match="launch key"):
        la((1,), dict(x=x, y=[y], n=1, B=True), OPTS)
    assert not fn.log


def test_direct_by_default_only_for_a_compiled_jit_function():
    assert not Launcher(_JitFn()).direct
    from leapquant_triton import flush, flush_kernel

    assert flush._launch_flush.direct == isinstance(flush_kernel.leapquant_flush_kernel,
                                                      __import__("triton").runtime.jit.JITFunction)


def test_prepared_launches_take_the_static_arguments_once():
    """``launcher.prepare(static, options)(grid, dynamic)`` launches like ``launcher(grid, {**static, **dynamic},
    options)``: bound the first time, then directly, with every argument in signature order as the launcher gives it
    (tensors as addresses); a static tensor's later contents do not matter, its address does (it stays put)."""
    fn = _JitFn()
    la = _launcher(fn)
    x, y = torch.zeros(64), torch.zeros(64, dtype=torch.int32)
    pr = la.prepare(dict(x=x, n=5, B=False), OPTS)
    assert pr.dynamic == ("y",)
    pr((3,), dict(y=y))
    pr((3, 2), dict(y=y))
    assert [e[0] for e in fn.log] == ["bound", "direct"] and fn.inside == [True]
    assert fn.log[0][2] == dict(x=x, y=y, n=5, B=False, **OPTS)
    assert fn.log[1][1] == (3, 2, 1) and fn.log[1][2] == (x.data_ptr(), y.data_ptr(), 5, False)
    assert not la.kernels  # the prepared launches keep their own kernels


@pytest.mark.parametrize("change", ["misaligned", "dtype", "knob"])
def test_a_prepared_launch_triton_may_specialise_differently_binds_again(change, monkeypatch):
    import triton

    fn = _JitFn()
    la = _launcher(fn)
    buf = torch.zeros(65)
    pr = la.prepare(dict(y=torch.zeros(64, dtype=torch.int32), n=5, B=False), OPTS)
    pr((1,), dict(x=buf[:64]))
    pr((1,), dict(x=buf[:64]))
    x = buf[:64]
    if change == "misaligned":
        x = buf[1:]
    elif change == "dtype":
        x = torch.zeros(64, dtype=torch.float16)
    else:
        monkeypatch.setattr(triton.knobs.runtime, "debug", not triton.knobs.runtime.debug)
    pr((1,), dict(x=x))
    pr((1,), dict(x=x))
    assert [e[0] for e in fn.log] == ["bound", "direct", "bound", "direct"]
    assert len(pr.kernels) == 2


def test_prepared_launches_refuse_wrong_arguments_and_devices():
    fn = _JitFn()
    dev = [-1]
    la = _launcher(fn, device=lambda: dev[0])
    x, y = torch.zeros(64), torch.zeros(64, dtype=torch.int32)
    with pytest.raises(TypeError, match="takes"):
        la.prepare(dict(x=x, z=1), OPTS)
    with pytest.raises(TypeError, match="launch key"):
        la.prepare(dict(x=[x]), OPTS)
    pr = la.prepare(dict(x=x, n=5, B=False), OPTS)
    with pytest.raises(TypeError, match="missing argument y"):
        pr((1,), dict())
    with pytest.raises(TypeError, match="dynamic arguments"):
        pr((1,), dict(y=y, n=6))
    pr((1,), dict(y=y))
    dev[0] = 0  # the static x is on the CPU (-1)
    with pytest.raises(ValueError, match="prepared tensors are on device"):
        pr((1,), dict(y=y))
    assert [e[0] for e in fn.log] == ["bound"]


def test_not_direct_prepared_launches_always_bind():
    fn = _JitFn()
    la = Launcher(fn, fn.compile_context, direct=False, current_device=lambda: 0)
    x, y = torch.zeros(64), torch.zeros(64, dtype=torch.int32)
    pr = la.prepare(dict(x=x, n=5, B=False), OPTS)
    for _ in range(3):
        pr((1,), dict(y=y))
    assert [e[0] for e in fn.log] == ["bound"] * 3 and not pr.kernels
