"""The decode simulation's report: its table (text and markdown), JSON, plot, and the markdown file beside them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .simulate import Method, Result


def overlays(result: Result) -> list[str]:
    """For each ``name@backend`` whose backend differs from ``name``'s: how far its curves stray from ``name``'s."""
    lines = []
    names = {m.name for m in result.methods}
    for m in result.methods:
        base = m.name.split("@")[0]
        if m.backend is None or base not in names or result.backends[m.name] == result.backends[base]:
            continue
        r = result.state[m.name] / torch.clamp_min(result.state[base], 1e-300)
        o = result.output[m.name].mean() / result.output[base].mean()
        lines.append(f"{m.name} over {base} ({result.backends[base]}): state error ratio, every head and record, "
                     f"{float(r.min()):.4f} .. {float(r.max()):.4f}; mean output error ratio {float(o):.4f}")
    return lines


def table(result: Result, markdown: bool = False) -> str:
    rows = result.summary()
    head = ["stream", "method", "bytes/head", "state final", "state worst", "output final", "output worst"]
    cells = [[r["stream"], r["method"], f"{r['bytes']:,}", f"{r['state_final']:.2e}", f"{r['state_worst']:.2e}",
              f"{r['output_final']:.2e}", f"{r['output_worst']:.2e}"] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        lines += ["| " + " | ".join(c) + " |" for c in cells]
        return "\n".join(lines)
    width = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(head)]
    fmt = lambda c: "  ".join(x.ljust(w) if i < 2 else x.rjust(w) for i, (x, w) in enumerate(zip(c, width)))  # noqa
    return "\n".join([fmt(head), fmt(["-" * w for w in width])] + [fmt(c) for c in cells])


def to_json(result: Result) -> dict:
    def per_head(t):
        return [[[float(f"{e:.3g}") for e in h] for h in rec] for rec in t.tolist()]

    def curve(t):
        return [float(f"{e:.4g}") for e in t]

    return dict(
        config=result.config,
        backends=result.backends,
        seconds=round(result.seconds, 2),
        tokens=result.tokens,
        summary=result.summary(),
        curves={m.name: {s: dict(state=curve(result.curve(m.name, s, "state")),
                                 output=curve(result.curve(m.name, s, "output")))
                         for s in result.config["streams"]} for m in result.methods},
        per_head={m.name: dict(state=per_head(result.state[m.name]), output=per_head(result.records(m.name, "output")))
                  for m in result.methods},
        note="curves: mean over (sequence, head) of each stream, state at each record token, output at every token; "
             "per_head: [record][row][head], rows stream-major, output averaged over each record's window of tokens",
    )


def _style(m: Method):
    colours = {0: "#7f7f7f", 1: "#9ecae1", 2: "#4292c6", 3: "#2171b5", 4: "#08306b"}
    if m.kind == "bf16":
        return dict(color="#d62728", linestyle="-", linewidth=1.4)
    if m.kind == "int8-row":
        return dict(color="#ff7f0e", linestyle="-", linewidth=1.4)
    style = dict(color=colours[m.rank], linestyle="--" if m.iters == 2 else "-", linewidth=1.4)
    if m.backend is not None:
        style.update(linestyle=":", linewidth=2.5)
    return style


def plot(result: Result, path: Path) -> bool:
    """Error against tokens, log y: one row per stream, state and output error side by side (output averaged over
    each record's window). False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    streams = result.config["streams"]
    fig, axes = plt.subplots(len(streams), 2, figsize=(12, 3.8 * len(streams)), squeeze=False, sharex=True)
    for i, s in enumerate(streams):
        for j, what in enumerate(("state", "output")):
            ax = axes[i, j]
            for m in result.methods:
                y = result.records(m.name, what)[:, result.rows(s)].mean(dim=(1, 2))
                ax.plot(result.tokens, y.numpy(), label=m.name, **_style(m))
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
            ax.set_title(f"{s} stream: relative {what} error" + (" (window means)" if what == "output" else ""))
            if i == len(streams) - 1:
                ax.set_xlabel("tokens decoded")
    c = result.config
    axes[0, 1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(f"{c['gate'].upper()} decode through leapquant.step, K=V={c['head_k']}, L={c['ring']}: error vs exact "
                 f"float64 recurrence (mean of {c['seqs']} seqs x {c['heads']} heads, records every {c['every']} tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True



def write(result: Result, out: Path, *, command: str, versions: str, backend: str) -> list[str]:
    """``simulate.json``, ``simulate.md`` and (with matplotlib) ``simulate.png`` in ``out``; returns the names
    written. ``command`` reproduces the run, ``versions`` says what it ran on, ``backend`` decoded the LeapQuant rows
    (those without ``@backend``)."""
    c = result.config
    out.mkdir(parents=True, exist_ok=True)
    (out / "simulate.json").write_text(json.dumps(to_json(result)) + "\n")
    md = (f"`{command}` ({result.seconds:.0f} s; {versions})\n\n"
          f"{c['gate'].upper()}, {c['seqs']} sequences x {c['heads']} heads x {c['tokens']} tokens per stream kind, "
          f"K = V = {c['head_k']}, L = {c['ring']}. The LeapQuant rows are decodes through `leapquant.step` (backend "
          f"{backend}: the flush of a full ring inside, the output it returns); errors are relative, per (sequence, "
          "head), against the exact float64 recurrence. *state*: recorded every "
          f"{c['every']} tokens (a full ring: its flush comes with the next token); *final*: mean over heads at the "
          "last record. *output*: `scale S_t q` of every token (bf16 and int8-row: from their stored state after "
          "the token), averaged per head over each record's window of tokens. *final*: mean over heads at the last "
          "record; *worst*: any head at any record. bytes/head: what the format keeps per head between tokens "
          "(LeapQuant: checkpoint + ring).\n\n"
          + table(result, markdown=True) + "\n")
    lines = overlays(result)
    if lines:
        md += "\n" + "\n".join(f"* {line}" for line in lines) + "\n"
    (out / "simulate.md").write_text(md)
    return ["simulate.json", "simulate.md"] + (["simulate.png"] if plot(result, out / "simulate.png") else [])
