"""Every launch of the decode step at the Gluon kernel's shape keyed by what its build depends on, and the Gluon
kernel's launches routed to cubins that another Triton release compiled for that key.

:func:`install` wraps :class:`leapquant_triton.launcher.Prepared` (the step's launches go through it). Then, with
``state.capture`` set to a file, each step launch's key is appended to it (``state.dry``: and nothing is launched);
with ``state.release`` set, a launch of the Gluon kernel whose key has a cubin under ``state.lib/<release>`` runs that
cubin through the driver API (``cuModuleLoadData``, ``cuLaunchKernel`` on the current stream: graph-capturable), and
``state.counts`` counts the launches that did and did not find one."""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
from dataclasses import dataclass, field

import torch

import leapquant_triton.launcher as launcher

GLUON = "leapquant_step_gluon_kernel"
STEPS = ("leapquant_step_kernel", GLUON)  # the CPU runs the tl twin: its launches have the same arguments
CONSTS = ("FIRST", "K", "V", "L", "R", "IS_KDA", "USE_QK_L2NORM", "HIST", "HT", "T", "TOFF", "PACKED", "BETA_ROUND")
ARGS = ("idx", "q", "k", "v", "g", "beta", "out", "codes", "skv", "uq", "kbuf", "ubuf", "w", "pcum", "gbuf", "hcnt",
        "sq_n", "sq_h", "sk_n", "sk_h", "sv_n", "sv_h", "sg_n", "sg_h", "sb_n", "sb_h", "so_n", "so_h", "scale", "NS",
        "HV", "G", "SS", "HS", "sq_t", "sk_t", "sv_t", "sg_t", "sb_t", "so_t", "hstart", "hcount", "hpcum", "hw",
        "a_log", "dt_bias", "lower_bound")
_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32", torch.int8: "i8"}


@dataclass
class State:
    capture: str | None = None
    dry: bool = False
    ints: bool = False  # keys with the integer arguments: builds specialised as Triton's runtime specialises
    release: str | None = None
    lib: str = ""
    counts: dict = field(default_factory=lambda: {"routed": 0, "native": 0})


state = State()


def key_of(args: dict, ints: bool = False) -> dict | None:
    """None off the Gluon kernel's shape; else the constexprs, each pointer's dtype and 16-byte alignment (None for an
    argument passed as None), and with ``ints`` the integer arguments."""
    if not (args["K"] == args["V"] == 128 and args["L"] == 16 and args["R"] <= 4):
        return None
    key = {n: (bool(args[n]) if isinstance(args[n], bool) else int(args[n])) for n in CONSTS}
    ptrs = {}
    for n in ARGS:
        v = args[n]
        if isinstance(v, torch.Tensor):
            ptrs[n] = [_DTYPES[v.dtype], v.data_ptr() % 16 == 0]
        elif v is None:
            ptrs[n] = None
    key["ptrs"] = ptrs
    if ints:
        key["ints"] = {n: int(args[n]) for n in ARGS if isinstance(args[n], int) and not isinstance(args[n], bool)}
    return key


def key_hash(key: dict) -> str:
    return hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


_cuda = None
_loaded: dict = {}


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what}: CUresult {result}")


def _load(path: str):
    global _cuda
    if path not in _loaded:
        if _cuda is None:
            _cuda = ctypes.CDLL("libcuda.so.1")
        meta = json.load(open(path[:-len(".cubin")] + ".json"))
        image = open(path, "rb").read()
        module, fn = ctypes.c_void_p(), ctypes.c_void_p()
        torch.cuda.synchronize()  # the runtime's context current on this thread
        _check(_cuda.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(image)), "cuModuleLoadData")
        _check(_cuda.cuModuleGetFunction(ctypes.byref(fn), module, meta["name"].encode()), "cuModuleGetFunction")
        if meta["shared"] > 48 * 1024:
            _check(_cuda.cuFuncSetAttribute(fn, 8, meta["shared"]), "cuFuncSetAttribute")  # max dynamic shared
        _loaded[path] = (meta, fn, image)
    return _loaded[path]


def _launch(meta: dict, fn, grid: tuple, args: dict) -> None:
    """The kernel's parameters in order (its non-constexpr arguments, then the global and profile scratch pointers
    Triton appends: none here), on the current stream."""
    params = []
    for name in meta["arg_names"]:
        kind = meta["sig"][name]
        if kind == "constexpr":
            continue
        v = args[name]
        if kind.startswith("*"):
            params.append(ctypes.c_uint64(v.data_ptr()))
        elif kind == "fp32":
            params.append(ctypes.c_float(float(v)))
        else:
            params.append(ctypes.c_int32(int(v)))
    params += [ctypes.c_uint64(0), ctypes.c_uint64(0)]
    if len(params) != meta["nparams"]:
        raise RuntimeError(f"{len(params)} parameters for a kernel of {meta['nparams']}")
    arr = (ctypes.c_void_p * len(params))(*[ctypes.cast(ctypes.byref(p), ctypes.c_void_p) for p in params])
    g = tuple(grid) + (1,) * (3 - len(grid))
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    _check(_cuda.cuLaunchKernel(fn, g[0], g[1], g[2], 32 * meta["num_warps"], 1, 1, meta["shared"], stream, arr,
                                None), "cuLaunchKernel")


_native = launcher.Prepared.__call__


def _routed(self, grid, dynamic):
    name = self.launcher.name
    if name in STEPS and (state.capture or (state.release and name == GLUON)):
        args = {**self.static, **dynamic}
        key = key_of(args, state.ints)
        if key is not None and state.capture:
            with open(state.capture, "a") as f:
                f.write(json.dumps(key, sort_keys=True) + "\n")
            if state.dry:
                return
        if key is not None and state.release and name == GLUON:
            path = os.path.join(state.lib, state.release, key_hash(key) + ".cubin")
            if os.path.exists(path):
                meta, fn, _ = _load(path)
                _launch(meta, fn, grid, args)
                state.counts["routed"] += 1
                return
            state.counts["native"] += 1
    return _native(self, grid, dynamic)


def install() -> State:
    launcher.Prepared.__call__ = _routed
    return state
