"""What a tool's report says about the machine it ran on: versions and devices."""

from __future__ import annotations

import importlib.metadata as md
import platform

import torch

import leapquant


def version(dist: str) -> str:
    """The installed version of the distribution ``dist``, or ``"not installed"``."""
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


def device_lines() -> list[str]:
    """Versions, then one line per CUDA device (or why there is none): the head of ``info``, the demo, the GPU suite."""
    lines = [f"python {platform.python_version()}, torch {torch.__version__}, triton {version('triton')}, "
             f"tilelang {version('tilelang')}, leapquant {leapquant.__version__}"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"cuda:{i} {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
                         f"{p.total_memory / 2**30:.0f} GiB (CUDA {torch.version.cuda})")
    else:
        lines.append("no CUDA device: kernels run on the CPU only through an interpreter (TRITON_INTERPRET=1)")
    return lines


def versions(device: torch.device) -> str:
    """One line for a result file: versions and the device a run used."""
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.machine()})"
    return (f"python {platform.python_version()}, torch {torch.__version__}, triton {version('triton')}, "
            f"leapquant {leapquant.__version__}; {where}")
