"""The command lines of the tools and benchmarks: what a newcomer runs first."""

import pytest

from leapquant.tools.demo import rate_text


def test_demo_rate_keeps_its_digits_below_one_token_a_second():
    """A slow backend (the Triton interpreter) decodes under a token a second: its rate must not print as 0."""
    assert rate_text(0.4213) == "0.421"
    assert rate_text(0.004) == "0.004"
    assert rate_text(29.17) == "29.2"
    assert rate_text(12345.6) == "12,346"
    assert rate_text(float("nan")) == "n/a"
    assert all(rate_text(r) not in ("0", "0.0") for r in (0.3, 0.05, 0.0012))


def test_definition_help_writes_nothing(tmp_path, monkeypatch, capsys):
    """``--help`` prints the usage and leaves the committed files alone; writing takes ``--write``."""
    from leapquant.tools import definition

    monkeypatch.setattr(definition, "DIR", tmp_path)  # where a write would land
    with pytest.raises(SystemExit) as e:
        definition.main(["--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m leapquant.tools.definition")
    with pytest.raises(SystemExit) as e:
        definition.main([])  # no action asked for: an error, not a write
    assert e.value.code == 2
    assert list(tmp_path.iterdir()) == []
    assert definition.main(["--check"]) == 1  # nothing committed in tmp_path: both stale
    assert definition.main(["--write"]) == 0 and len(list(tmp_path.glob("*.json"))) == 2
    assert definition.main(["--check"]) == 0
