"""``python -m bench.cross_release.check --lib LIB [--out DIR]`` on the GPU: the sweep (:mod:`.sweep`) and the cases
(:mod:`.cases`) for every release with cubins under ``LIB``; writes ``DIR/cross_release_<device>.json`` and ``.md``
and exits non-zero if a configuration fails under a release or a release's cubin is missing for a launch."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

RELEASES = ("3.6", "3.7", "3.8", "3.9")


def markdown(doc: dict) -> str:
    rel = doc["releases"]
    head = (f"# The Gluon step under Triton {' / '.join(rel)} on {doc['device']['name']}\n\n"
            f"{doc['device']['name']}, driver {doc['driver']}; torch {doc['versions']['torch']}, Triton "
            f"{doc['versions']['triton']} (the native launch); {doc['date_utc']}. Each release's build compiled for "
            f"sm_90 ahead of time (`python -m bench.cross_release.compile` under that release) and launched through "
            f"the driver API with the library's launch arguments (bench/cross_release). Copy bandwidth "
            f"{doc['bandwidth']['GBps']:.0f} GB/s (same run).\n")
    lines = [head, "## Against the fp32 reference\n",
             "SPEC §6's criteria token by token (bench/cross_release/sweep.py): 6 slots x 4 heads of 128 x 128, ring "
             "16, rank 2; row 1 pads.\n",
             "| gate | T | q, k, v | g, beta | out | l2 norm | convention | key heads | " + " | ".join(rel) + " |",
             "| --- | ---: | --- | --- | --- | --- | --- | ---: | " + " | ".join("---" for _ in rel) + " |"]
    for r in doc["sweep"]:
        c = r["config"]
        lines.append(f"| {c['gate']} | {c['T']} | {c['tq']} | {c['tg']} | {c['to']} | {'yes' if c['l2'] else 'no'} | "
                     f"{c['conv']} | {c['H']} of 4 | " + " | ".join(r["results"].get(x, "-") for x in rel) + " |")
    ok = sum(all(r["results"].get(x) == "pass" for x in rel) for r in doc["sweep"])
    lines += [f"\n{ok} of {len(doc['sweep'])} configurations pass under every release.\n",
              "## bench.decode's cases, 256 sequences x 32 heads\n",
              "Bytes: every pool byte and `out` against the native launch's: how many elements differ, and by how much "
              "of the tensor's largest magnitude (the criteria are the sweep's). Times: medians of CUDA-graph replays "
              "(bench.decode.Timer); the tl kernel is what a release outside the Gluon kernel's took.\n",
              "| gate | case | build | time | floor | x floor | bytes |",
              "| --- | --- | --- | ---: | ---: | ---: | --- |"]
    for r in doc["cases"]:
        if r["status"] != "ok":
            lines.append(f"| {r['gate']} | {r['case']} | {r['build']} | {r['status']} | | | |")
            continue
        lines.append(f"| {r['gate']} | {r['case']} | {r['build']} | {r['median_us']:.1f} us | {r['floor_us']:.1f} us "
                     f"| {r['median_us'] / r['floor_us']:.2f} | {r['bytes']} |")
    return "\n".join(lines) + "\n"


def write(doc: dict, out: Path) -> Path:
    """``cross_release_<device>.json`` and ``.md`` under ``out``; returns their stem."""
    from bench.timing import device_slug

    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"cross_release_{device_slug(doc['device']['name'])}"
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(doc))
    return stem


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cross_release.check", description=__doc__)
    ap.add_argument("--lib", required=True, help="the cubins: LIB/<release>/<key hash>.cubin")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--budget", type=float, default=0.6, help="seconds of replays per timed case")
    args = ap.parse_args(argv)
    import torch

    from bench import decode as D
    from bench.timing import copy_bandwidth, device_info, module_version, nvidia_smi

    from . import cases, routing, sweep

    if not torch.cuda.is_available():
        print("needs a GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    state = routing.install()
    state.lib = args.lib
    releases = [r for r in RELEASES if os.path.isdir(os.path.join(args.lib, r))]
    bw = copy_bandwidth(device, 1 << 30)
    doc = {"what": "the Gluon step built by each Triton release: against the reference, and timed "
                   "(bench/cross_release)",
           "device": device_info(device), "driver": nvidia_smi().get("driver"),
           "versions": {m: module_version(m) for m in ("leapquant", "torch", "triton")}, "bandwidth": bw,
           "releases": releases, "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    doc["sweep"] = sweep.run(state, releases)
    state.ints = True
    doc["cases"] = cases.run(state, releases, D.Timer(device, bw, args.budget), device)
    stem = write(doc, Path(args.out))
    failed = [r for r in doc["sweep"] if any(r["results"].get(x) != "pass" for x in releases)]
    missing = [r for r in doc["cases"] if r["status"] != "ok"]
    print(f"{len(doc['sweep']) - len(failed)} of {len(doc['sweep'])} configurations pass under every release; "
          f"{len(missing)} case builds without a cubin; {stem}.md")
    return 1 if failed or missing else 0


if __name__ == "__main__":
    raise SystemExit(main())
