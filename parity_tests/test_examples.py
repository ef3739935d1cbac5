"""examples/serving_loop.py, the README's "how to put LeapQuant in an engine", runs as written and its check bites."""

from __future__ import annotations

import importlib.util
import os
import sys

import leapquant

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _example():
    spec = importlib.util.spec_from_file_location("serving_loop", os.path.join(ROOT, "examples", "serving_loop.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_serving_loop_matches_the_exact_recurrence(capsys):
    assert _example().main() == 0
    out = capsys.readouterr().out
    assert "outputs checked against the exact recurrence" in out


def test_serving_loop_check_fails_without_rollback(monkeypatch):
    """With accept a no-op (the rejected draft tokens left in the state), the loop's own check fails."""
    mod = _example()
    monkeypatch.setattr(mod.leapquant, "accept", lambda *a, **k: None)
    assert mod.main() == 1
    assert leapquant.accept is not None
