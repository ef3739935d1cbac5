"""The PNGs: flush time vs batch (log-log) at the main head count, one line per backend and due fraction, the floor
of each due fraction drawn dashed, and the fp32 decode step at its batch for scale (:func:`plot`); the decode layer
and FLA's in-place steps vs batch, one panel per gate (:func:`decode_sweep`)."""

from __future__ import annotations

from fractions import Fraction

from .flush import HEADS

MARKERS = {"triton": "o", "tilelang": "s", "reference": "^"}
STYLES = {"triton": "-", "tilelang": "--", "reference": ":"}


def plot(doc: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = HEADS if any(c["heads"] == HEADS for c in doc["cases"]) else max(c["heads"] for c in doc["cases"])
    cases = [c for c in doc["cases"] if c["heads"] == heads]
    fractions = sorted({c["due_fraction"] for c in cases}, key=Fraction)
    colours = dict(zip(fractions, ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"]))
    fig, ax = plt.subplots(figsize=(8.5, 6))
    for f in fractions:
        cs = sorted((c for c in cases if c["due_fraction"] == f), key=lambda c: c["batch"])
        fl = [(c["batch"], c["floor_us"]) for c in cs if c["floor_us"]]
        if fl:
            ax.plot(*zip(*fl), color=colours[f], linestyle=(0, (2, 2)), linewidth=1, alpha=0.7,
                    label=f"floor, {f} due")
        for b in doc["backends"]:
            pts = [(c["batch"], c["results"][b]["median_us"]) for c in cs
                   if c["results"][b].get("status") == "ok" and c["results"][b].get("median_us")]
            if pts:
                ax.plot(*zip(*pts), color=colours[f], linestyle=STYLES.get(b, "-."), marker=MARKERS.get(b, "x"),
                        markersize=5, label=f"{b}, {f} due")
    best = doc["step"].get("best")
    if best and best.get("heads") == heads:
        ax.plot([best["batch"]], [best["median_us"]], marker="*", color="black", markersize=12, linestyle="none",
                label=f"fp32 KDA step ({best['batch']} x {best['heads']})")
    ax.set_xscale("log", base=2)
    batches = sorted({c["batch"] for c in cases})
    ax.set_xticks(batches)
    ax.set_xticklabels([str(n) for n in batches])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_xlabel("batch (sequences)")
    ax.set_ylabel("time per flush (us)")
    env, bw = doc["env"], doc["bandwidth"]
    bw_txt = f", copy {bw['GBps']:.0f} GB/s" if "GBps" in bw else ""
    ax.set_title(f"LeapQuant flush, {heads} heads, {doc['geometry']['gate'].upper()} — {env.get('name')}{bw_txt}",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# the decode sweep's lines: (case, colour, marker)
DECODE_LINES = (("decode layer", "tab:blue", "o"), ("fla fp32", "tab:red", "s"), ("fla bf16", "tab:orange", "^"))


def decode_sweep(doc: dict, path) -> None:
    """``bench.decode``'s sweep: time vs batch (log-log) per gate, the decode layer, FLA's fp32 and bf16 in-place
    steps, and the layer's floor dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sw = doc["sweep"]
    gates = list(sw["gates"])
    fig, axes = plt.subplots(1, len(gates), figsize=(6.5 * len(gates), 5.5), sharey=True, squeeze=False)
    for ax, gate in zip(axes[0], gates):
        rows = [r for r in sw["gates"][gate] if r.get("status") == "ok"]
        for case, colour, marker in DECODE_LINES:
            pts = sorted((r["batch"], r["median_us"]) for r in rows if r["case"] == case)
            if pts:
                ax.plot(*zip(*pts), color=colour, marker=marker, markersize=5, label=case)
        floor = sorted((r["batch"], r["floor_us"]) for r in rows if r["case"] == "decode layer")
        if floor:
            ax.plot(*zip(*floor), color="tab:blue", linestyle=(0, (2, 2)), linewidth=1, alpha=0.7,
                    label="decode layer's floor")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sw["batches"])
        ax.set_xticklabels([str(b) for b in sw["batches"]])
        ax.minorticks_off()
        ax.set_yscale("log")
        ax.set_xlabel("batch (sequences)")
        ax.set_title(f"{gate.upper()}, {sw['heads']} heads, {sw['layout']} layout", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("time per decode step of a layer (us)")
    bw = doc["bandwidth"]
    fig.suptitle(f"LeapQuant decode layer vs FLA's in-place step — {doc['device'].get('name')}, copy "
                 f"{bw['GBps']:.0f} GB/s", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
