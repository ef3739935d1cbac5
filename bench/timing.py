"""Timing primitives shared by the flush and step benchmarks: L2 eviction, replay timing, copy bandwidth, versions.

On CUDA every timed call is a CUDA-graph replay bracketed by events, after the caller's restore step and a write of
a scratch buffer larger than L2, so each replay starts from DRAM as a serving step would. On the CPU (``--cpu-smoke``)
the same path runs with a host clock and without graphs or eviction.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

# H200 L2 is 50 MiB; 256 MiB written between replays leaves nothing of the last one
EVICT_BYTES = 256 << 20


@dataclass
class Timing:
    """Seconds per call over ``n`` timed replays."""

    median: float
    p20: float
    p80: float
    minimum: float
    n: int

    def as_dict(self) -> dict:
        return {"median_us": self.median * 1e6, "p20_us": self.p20 * 1e6, "p80_us": self.p80 * 1e6,
                "min_us": self.minimum * 1e6, "replays": self.n}


def summarise(seconds: list[float]) -> Timing:
    s = sorted(seconds)
    q = lambda f: s[min(len(s) - 1, int(f * len(s)))]  # noqa: E731
    return Timing(statistics.median(s), q(0.2), q(0.8), s[0], len(s))


class Evictor:
    """Evicts L2 before a timed call (CUDA only; a no-op on the CPU): writes ``nbytes`` of scratch, then reads half as
    much of a second buffer. The write replaces everything in L2; the read replaces the scratch's dirty lines with
    clean ones, so the timed call does not pay for writing the scratch back to DRAM."""

    def __init__(self, device: torch.device, nbytes: int = EVICT_BYTES):
        self.buf = self.clean = self.sink = None
        if device.type == "cuda":
            self.buf = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
            self.clean = torch.ones(nbytes // 8, dtype=torch.float32, device=device)
            self.sink = torch.empty((), dtype=torch.float32, device=device)
        self.i = 0

    def __call__(self) -> None:
        if self.buf is not None:
            self.i += 1
            self.buf.fill_(float(self.i))
            torch.sum(self.clean, dim=0, out=self.sink)


def capture(fn: Callable[[], None], device: torch.device) -> Callable[[], None]:
    """``fn`` captured in a CUDA graph (returns ``graph.replay``); on the CPU, ``fn`` itself. ``fn`` must have been
    run once eagerly first (compilation stays out of the capture)."""
    if device.type != "cuda":
        return fn
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize(device)

    def replay() -> None:  # the closure keeps the graph (and its memory pool) alive as long as the callable
        graph.replay()

    return replay


def time_replays(run: Callable[[], None], restore: Callable[[], None], device: torch.device, *, budget_s: float,
                 min_reps: int, max_reps: int, warmup: int = 3) -> Timing:
    """Median time of ``run`` over as many replays as fit ``budget_s`` (between ``min_reps`` and ``max_reps``).

    Before every replay, warm-up included: ``restore()`` (outside the timed region), then L2 eviction. On CUDA the
    replays are queued without host synchronisation and timed by events around ``run`` alone.
    """
    evict = Evictor(device)
    cuda = device.type == "cuda"
    t0 = time.perf_counter()
    for _ in range(warmup):
        restore()
        evict()
        run()
    if cuda:
        torch.cuda.synchronize(device)
    per_iter = max((time.perf_counter() - t0) / max(warmup, 1), 1e-6)
    reps = int(min(max_reps, max(min_reps, budget_s / per_iter)))
    times: list[float] = []
    if cuda:
        events = []
        for _ in range(reps):
            restore()
            evict()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run()
            b.record()
            events.append((a, b))
        torch.cuda.synchronize(device)
        times = [a.elapsed_time(b) * 1e-3 for a, b in events]
    else:
        for _ in range(reps):
            restore()
            t = time.perf_counter()
            run()
            times.append(time.perf_counter() - t)
    return summarise(times)


def copy_bandwidth(device: torch.device, nbytes: int, reps: int = 10) -> dict:
    """Device-to-device copy of ``nbytes`` into a second buffer; bytes moved = read + written = ``2 * nbytes``."""
    src = torch.rand(nbytes // 4, dtype=torch.float32, device=device)  # not zeros: time what real data costs
    dst = torch.empty_like(src)
    run = lambda: dst.copy_(src)  # noqa: E731
    for _ in range(2):
        run()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e-3)
    else:
        for _ in range(reps):
            t = time.perf_counter()
            run()
            times.append(time.perf_counter() - t)
    ok = torch.equal(dst, src)
    t = summarise(times)
    moved = 2 * src.numel() * src.element_size()
    return {"bytes_moved": moved, "buffer_bytes": src.numel() * src.element_size(), **t.as_dict(),
            "GBps": moved / t.median / 1e9, "copy_checked": ok}


def version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def module_version(name: str) -> str | None:
    """``__version__`` of a module this process has imported (TileLang unpacked on a path has no metadata)."""
    mod = sys.modules.get(name)
    v = getattr(mod, "__version__", None) if mod is not None else None
    return str(v) if v is not None else version(name)


def nvidia_smi() -> dict:
    """GPU name and driver from ``nvidia-smi`` (first GPU), or the reason there is none."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        if r.returncode != 0:
            return {"error": f"nvidia-smi rc={r.returncode}: {r.stderr.strip()[:200]}"}
        name, driver = [x.strip() for x in r.stdout.strip().splitlines()[0].split(",")[:2]]
        return {"name": name, "driver": driver}
    except Exception as e:  # no nvidia-smi on the CPU machine
        return {"error": f"{type(e).__name__}: {e}"}


def device_slug(name: str) -> str:
    """``"NVIDIA H200"`` -> ``"h200"``; ``"NVIDIA H100 80GB HBM3"`` -> ``"h100_80gb_hbm3"``."""
    s = re.sub(r"^(nvidia|amd)\s+", "", name.strip(), flags=re.I).lower()
    s = re.sub(r"[^a-z0-9]+", "_", s).strip("_")
    return s or "unknown"


def device_info(device: torch.device) -> dict:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(name=p.name, capability=f"sm_{p.major}{p.minor}", sms=p.multi_processor_count,
                    memory_gib=round(p.total_memory / 2**30, 1))
    else:
        info.update(name="cpu", capability=None, sms=None)
    return info


class Recorder:
    """One JSON object per line into the worker's results file, flushed at once (a killed worker keeps its lines)."""

    def __init__(self, path: str | None):
        self.f = open(path, "a") if path else None

    def __call__(self, **row) -> None:
        if self.f is not None:
            self.f.write(json.dumps(row) + "\n")
            self.f.flush()
