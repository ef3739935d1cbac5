"""What the tools' command lines share: a ``python -m`` usage line, the module docstring whole as the description,
and a backend that cannot run reported as one line with exit status 2 (as ``python -m leapquant`` does)."""

from __future__ import annotations

import argparse
import sys
from typing import Callable

import leapquant


def parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def command_line(prog: str, doc: str | None, add_arguments: Callable[[argparse.ArgumentParser], None],
                 run: Callable[[argparse.Namespace], int], argv=None) -> int:
    ap = parser(prog, doc)
    add_arguments(ap)
    try:
        return run(ap.parse_args(argv))
    except leapquant.BackendError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
