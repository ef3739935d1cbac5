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


def _first_paragraph(doc: str) -> str:
    return " ".join(doc.strip().split("\n\n")[0].split())


@pytest.mark.parametrize("module,entry,prog", [
    ("leapquant.__main__", "main", "python -m leapquant"),
    ("leapquant.tools.demo", "main", "python -m leapquant.tools.demo"),
    ("leapquant.tools.simulate", "command_line", "python -m leapquant.tools.simulate"),
    ("leapquant.tools.prefill", "main", "python -m leapquant.tools.prefill"),
    ("leapquant.tools.definition", "main", "python -m leapquant.tools.definition"),
    ("bench.digest", "main", "python -m bench.digest"),
    ("bench.decode", "main", "python -m bench.decode"),
    ("bench.states", "main", "python -m bench.states"),
    ("bench.host_overhead", "main", "python -m bench.host_overhead"),
    ("bench.engine", "main", "python -m bench.engine"),
    ("bench.schedule", "main", "python -m bench.schedule"),
])
def test_help_names_the_command_and_keeps_the_description_whole(module, entry, prog, capsys):
    """``--help`` shows how the command is run (``python -m ...``, not a file name) and the module's description
    uncut: its whole first paragraph, not the docstring's first line."""
    import importlib

    mod = importlib.import_module(module)
    with pytest.raises(SystemExit) as e:
        getattr(mod, entry)(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {prog} "), out[:200]
    assert _first_paragraph(mod.__doc__) in " ".join(out.split()), out[:800]


@pytest.mark.parametrize("command", ["demo", "simulate"])
def test_leapquant_subcommand_help_describes_its_tool(command, capsys):
    from leapquant.__main__ import main
    from leapquant.tools import demo, simulate

    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m leapquant {command} ")
    assert _first_paragraph({"demo": demo, "simulate": simulate}[command].__doc__) in " ".join(out.split())
