"""Turn the workers' records into results: floors and ratios per case, the terminal table, JSON and markdown."""

from __future__ import annotations

import datetime as dt
import json
from fractions import Fraction

from .flush import Plan, floor_bytes, program_bytes

SHORT = {"unavailable": "n/a", "error": "ERROR", "skipped": "skipped", "wrong": "WRONG", "not run": "not run"}


def _program_bytes_for(plan_: Plan, heads: int) -> dict:
    """Per-program bytes counted from a real (tiny, CPU) pool of the plan's geometry and these heads."""
    import leapquant

    pool = leapquant.Pool(2, heads, plan_.head_k, plan_.head_v, plan_.ring, plan_.rank, gate=plan_.gate)
    return program_bytes(pool)


def build(plan_: Plan, backends: list[str], records: dict[str, list[dict]], meta: dict) -> dict:
    """The results document. ``records``: worker name -> its JSON lines (``step`` and one per backend)."""
    step_rows = records.get("step", [])
    bw = next((r for r in step_rows if r.get("kind") == "bandwidth"), None) or {"error": "no bandwidth record"}
    bw_Bps = bw["GBps"] * 1e9 if "GBps" in bw else None
    envs = [r for rows in records.values() for r in rows if r.get("kind") == "env"]
    for key in ("name", "capability", "sms", "memory_gib", "triton", "tilelang"):
        vals = [e[key] for e in envs if e.get(key) is not None]
        if vals and meta["env"].get(key) is None:
            meta["env"][key] = vals[-1]

    pb_by_heads = {h: _program_bytes_for(plan_, h) for h in sorted({c.heads for c in plan_.cases})}
    cases = []
    for c in plan_.cases:
        due = c.due_count()
        fb = floor_bytes(pb_by_heads[c.heads], due, c.batch)
        row = {"heads": c.heads, "batch": c.batch, "due_fraction": c.due_fraction, "due_programs": due,
               "floor_bytes": fb, "floor_us": fb / bw_Bps * 1e6 if bw_Bps else None, "results": {}}
        for b in backends:
            got = [r for r in records.get(b, []) if r.get("kind") == "case" and r["case"]["heads"] == c.heads
                   and r["case"]["batch"] == c.batch and r["case"]["due_fraction"] == c.due_fraction]
            if got:
                r = dict(got[-1])
            elif b not in records:
                r = {"status": "not run", "reason": "the run stopped before this backend's worker started"}
            else:
                r = {"status": "error", "reason": "no record from the worker"}
            for k in ("kind", "backend", "case"):
                r.pop(k, None)
            if r.get("due_programs") not in (None, due):
                r["note"] = f"worker saw {r['due_programs']} due programs, expected {due}"
            if r.get("median_us"):
                t = r["median_us"] * 1e-6
                r["GBps"] = fb / t / 1e9
                r["x_floor"] = r["median_us"] / row["floor_us"] if row["floor_us"] else None
            row["results"][b] = r
        base = row["results"].get("triton", {}).get("median_us")
        for b, r in row["results"].items():
            if base and r.get("median_us"):
                r["vs_triton"] = r["median_us"] / base
        cases.append(row)

    step = _step_summary(step_rows)
    amort = _amortisation(cases, step, plan_, backends)
    return {
        "schema": 1,
        "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        **meta,
        "geometry": {"head_k": plan_.head_k, "head_v": plan_.head_v, "ring": plan_.ring, "rank": plan_.rank,
                     "gate": plan_.gate, "regime": "gaussian"},
        "program_bytes": {str(h): v for h, v in pb_by_heads.items()},
        "bandwidth": bw,
        "backends": backends,
        "cases": cases,
        "step": step,
        "amortisation": amort,
        "method": METHOD,
    }


METHOD = (
    "Each case: idx = a random permutation of N distinct slots; exactly max(1, round(f*N*HV)) random (row, head) "
    "programs due. leapquant.flush(pool, idx, backend, check=False) captured in a CUDA graph; before every replay "
    "the rings a flush resets (w, pcum, gbuf) are copied back (outside the timed region), 256 MiB of scratch is "
    "written to evict L2 and 128 MiB of another buffer read (so no dirty scratch is written back while timed); the "
    "checkpoints evolve from replay to replay (each compresses what the last one stored); each replay is bracketed by CUDA events; median over the replays after warm-up. "
    "Floor = (due programs x (read checkpoint + ring, write checkpoint + ring resets) + N x (hcnt of every head + "
    "idx)) bytes, counted from the pool's dtypes and shapes, over the device-to-device copy bandwidth measured in "
    "the same run (bytes read + written). x floor = time / floor time; vs triton = time / triton's time."
)


def _step_summary(rows: list[dict]) -> dict:
    chk = next((r for r in rows if r.get("kind") == "step_check"), {"ok": False, "error": "no check record"})
    runs = [r for r in rows if r.get("kind") == "step"]
    ok = [r for r in runs if r.get("status") == "ok"]
    best = min(ok, key=lambda r: r["median_us"]) if ok else None
    out = {"check": {k: v for k, v in chk.items() if k != "kind"}, "configs": [
        {k: v for k, v in r.items() if k != "kind"} for r in runs], "best": None}
    if best is not None:
        out["best"] = {k: v for k, v in best.items() if k != "kind"}
        out["best"]["floor_us"] = None
    return out


def _amortisation(cases: list[dict], step: dict, plan_: Plan, backends: list[str]) -> dict:
    heads, batch = plan_.amortise
    ring = plan_.ring
    alldue = next((c for c in cases if c["heads"] == heads and c["batch"] == batch
                   and Fraction(c["due_fraction"]) == 1), None)
    best = step.get("best")
    out = {"batch": batch, "heads": heads, "ring": ring,
           "step_us": best["median_us"] if best else None, "per_backend": {}}
    if alldue is None:
        return out
    for b in backends:
        r = alldue["results"].get(b, {})
        if r.get("median_us"):
            per_tok = r["median_us"] / ring
            out["per_backend"][b] = {"flush_all_due_us": r["median_us"], "flush_per_token_us": per_tok,
                                     "fraction_of_step": per_tok / best["median_us"] if best else None}
    return out


def finish_step_floor(doc: dict) -> None:
    """The step's floor time needs the bandwidth: fill it in once both are known."""
    best, bw = doc["step"].get("best"), doc["bandwidth"].get("GBps")
    if best and bw:
        best["floor_us"] = best["floor_bytes"] / (bw * 1e9) * 1e6
        best["x_floor"] = best["median_us"] / best["floor_us"]
        best["GBps"] = best["floor_bytes"] / (best["median_us"] * 1e-6) / 1e9


def _us(x: float | None) -> str:
    return "-" if x is None else (f"{x:.1f}" if x >= 1 else f"{x:.2g}")


def _cell(r: dict, with_vs: bool) -> list[str]:
    st = r.get("status")
    n = 4 if with_vs else 3
    if st == "ok" and r.get("median_us") is not None:
        f = lambda x, fmt: (fmt % x) if x is not None else "-"  # noqa: E731
        gbps = r.get("GBps")
        cells = [f"{r['median_us']:.1f}" + ("" if r.get("timed", "graph") == "graph" else "*"),
                 f(r.get("x_floor"), "%.2f"), f(gbps, "%.0f" if gbps is not None and gbps >= 10 else "%.2g")]
        return cells + ([f(r.get("vs_triton"), "%.2f")] if with_vs else [])
    return [SHORT.get(st, str(st))] + [""] * (n - 1)


def table_lines(doc: dict, markdown: bool = False) -> list[str]:
    """One row per case; per backend: median us, x floor, GB/s and (if triton ran) time over triton's time.
    ``*`` marks a time taken eagerly, without a CUDA graph (see the case's ``timed`` field)."""
    backends = doc["backends"]
    vs = {b: "triton" in backends and b != "triton" for b in backends}
    head = ["heads", "N", "due", "programs", "floor us"]
    for b in backends:
        head += [f"{b} us", "x floor", "GB/s"] + (["vs triton"] if vs[b] else [])
    rows = []
    for c in sorted(doc["cases"], key=lambda c: (-c["heads"], c["batch"], Fraction(c["due_fraction"]))):
        row = [str(c["heads"]), str(c["batch"]), c["due_fraction"], str(c["due_programs"]),
               _us(c["floor_us"])]
        for b in backends:
            row += _cell(c["results"][b], vs[b])
        rows.append(row)
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "|".join(" ---: " for _ in head) + "|"]
        return out + ["| " + " | ".join(r) + " |" for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    fmt = lambda r: "  ".join(x.rjust(w) for x, w in zip(r, widths))  # noqa: E731
    return [fmt(head), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows]


def reasons(doc: dict) -> list[str]:
    """One line per (backend, distinct reason) for every case not measured, or timed without a graph."""
    seen: dict[tuple[str, str], list[str]] = {}
    for c in doc["cases"]:
        for b, r in c["results"].items():
            if r.get("status") != "ok":
                why = r.get("reason", "?")
                seen.setdefault((b, f"{r.get('status')}: {why}"), []).append(
                    f"{c['heads']}x{c['batch']}@{c['due_fraction']}")
        for b, r in c["results"].items():
            if r.get("status") == "ok" and r.get("timed", "graph") != "graph":
                seen.setdefault((b, f"* timed {r['timed']}"), []).append(
                    f"{c['heads']}x{c['batch']}@{c['due_fraction']}")
    return [f"{b}: {why} [{len(where)} case(s): {', '.join(where[:6])}{' ...' if len(where) > 6 else ''}]"
            for (b, why), where in seen.items()]


def summary_lines(doc: dict) -> list[str]:
    env, bw = doc["env"], doc["bandwidth"]
    lines = [f"device: {env.get('name')} ({env.get('capability')}, {env.get('sms')} SMs), driver "
             f"{env.get('driver')}, CUDA {env.get('cuda')}, torch {env.get('torch')}, triton {env.get('triton')}, "
             f"tilelang {env.get('tilelang')}"]
    if "GBps" in bw:
        lines.append(f"copy bandwidth: {bw['GBps']:.0f} GB/s ({bw['buffer_bytes'] / 2**30:.2f} GiB copied, bytes read "
                     f"+ written, median of {bw['replays']})")
    else:
        lines.append(f"copy bandwidth: not measured ({bw.get('error')}); floors unknown")
    st = doc["step"]
    chk = st["check"]
    if chk.get("ok"):
        lines.append(f"step kernel check vs float64: ok (state {chk['err_state']:.1e}, o {chk['err_o']:.1e})")
    else:
        lines.append(f"step kernel check vs float64: FAILED or not run ({chk})")
    best, am = st.get("best"), doc["amortisation"]
    if best:
        fl = f", floor {best['floor_us']:.1f} us = {best['x_floor']:.2f}x" if best.get("floor_us") else ""
        lines.append(f"fp32 KDA decode step, {best['batch']} x {best['heads']} heads: {best['median_us']:.1f} us "
                     f"(BV={best['BV']}, {best['num_warps']} warps{fl})")
    else:
        lines.append(f"fp32 KDA decode step: not measured ({[c.get('reason') for c in st['configs']]})")
    for b, a in am["per_backend"].items():
        frac = f" = {100 * a['fraction_of_step']:.1f} % of one step" if a.get("fraction_of_step") else ""
        lines.append(f"{b}: all-due flush at {am['batch']} x {am['heads']} = {a['flush_all_due_us']:.1f} us; "
                     f"per decoded token (/ L = {am['ring']}) {a['flush_per_token_us']:.1f} us{frac}")
    return lines


def markdown(doc: dict, png_name: str | None) -> str:
    env = doc["env"]
    out = [f"### Flush timings on {env.get('name')} ({doc['date_utc']})", ""]
    out += [f"- {line}" for line in summary_lines(doc)]
    out += ["", *table_lines(doc, markdown=True), ""]
    rs = reasons(doc)
    if rs:
        out += ["Not measured, or timed without a graph:", ""] + [f"- {r}" for r in rs] + [""]
    am = doc["amortisation"]
    if am["per_backend"] and am.get("step_us"):
        out += [f"Amortisation at {am['batch']} sequences x {am['heads']} heads: each (slot, head) is flushed once "
                f"every L = {am['ring']} tokens, so a flush costs (all-due time) / L per decoded token, against "
                f"{am['step_us']:.1f} us for one fp32 KDA step of the same batch (per layer).", "",
                "| backend | all-due flush us | per token us | % of a step |", "| --- | ---: | ---: | ---: |"]
        for b, a in am["per_backend"].items():
            out.append(f"| {b} | {a['flush_all_due_us']:.1f} | {a['flush_per_token_us']:.1f} | "
                       f"{100 * a['fraction_of_step']:.1f} |")
        out.append("")
    out += [f"Method: {doc['method']}", ""]
    if png_name:
        out += [f"![flush time vs batch]({png_name})", ""]
    return "\n".join(out)


def write_json(doc: dict, path) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=False)
        f.write("\n")
