"""The demo: a batch of sequences decoded token by token with ``leapquant.step`` on the best backend here, its output
checked against the exact float64 recurrence of the same token stream, with the tokens per second.

    python -m leapquant demo                                   # the same as python -m leapquant.tools.demo
    TRITON_INTERPRET=1 python -m leapquant demo --backend triton   # the Triton kernels in their interpreter, on a CPU
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

import leapquant

from .cli import command_line
from .exact import output, recurrent_step, relative_error
from .machine import device_lines
from .streams import decode_stream


def add_arguments(d: argparse.ArgumentParser) -> None:
    d.add_argument("--seqs", type=int, default=4, help="sequences decoded together (default 4)")
    d.add_argument("--heads", type=int, default=32, help="value heads per sequence (default 32)")
    d.add_argument("--key-heads", type=int, default=None,
                   help="query / key heads, dividing --heads (grouped value heads; default: as many as --heads)")
    d.add_argument("--tokens", type=int, default=48, help="tokens per sequence (default 48: three flushes)")
    d.add_argument("--gate", choices=["kda", "gdn"], default="kda",
                   help="kda: per-channel decay (Kimi Delta Attention); gdn: scalar decay (Gated DeltaNet)")
    d.add_argument("--backend", default="auto",
                   help="auto (the fastest with a decode step that supports the pool here), reference or triton; on a "
                        "CPU, triton needs TRITON_INTERPRET=1 in the environment")
    d.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if there is a GPU, else cpu)")
    d.add_argument("--seed", type=int, default=0, help="seed of the generated token stream")


def rate_text(rate: float) -> str:
    """Tokens per second for the summary: whole numbers from 100 on, else three significant figures, so that a slow
    backend (the Triton interpreter, a busy CPU) shows its rate rather than 0."""
    if not math.isfinite(rate):
        return "n/a"
    return f"{rate:,.0f}" if rate >= 100 else f"{rate:.3g}"


def _bar(done: int, total: int, width: int = 30) -> str:
    filled = width * done // total
    return "[" + "#" * filled + "." * (width - filled) + f"] {done}/{total}"


def run(args) -> int:
    """The demo for parsed ``args`` (:func:`add_arguments`); exit status 0 when every output is within 5 % of the
    exact one."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    for line in device_lines():
        print(line)
    B, HV, H = args.seqs, args.heads, args.key_heads or args.heads
    pool = leapquant.Pool(B + 1, HV, gate=args.gate, device=device)  # slot 0: the null slot
    K, V, L = pool.head_k, pool.head_v, pool.ring
    idx = torch.arange(1, B + 1, dtype=torch.int32, device=device)
    best = leapquant.select(pool, args.backend, op="step")
    print(f"\ndecoding {B} sequences x {HV} heads ({H} key heads) of {args.gate.upper()}, K = V = {K}, "
          f"{args.tokens} tokens each with leapquant.step, backend {best.name} "
          f"({'chosen by auto' if args.backend == 'auto' else 'asked for'}); a ring of {L} is flushed inside the "
          f"step every {L} tokens. Beside it: the exact float64 recurrence of the same stream.", flush=True)
    x = decode_stream("synthetic", B, HV, K, V, args.tokens, args.gate, torch.Generator().manual_seed(args.seed),
                      key_heads=H)
    S = torch.zeros(B, HV, V, K, dtype=torch.float64)
    scale = K ** -0.5
    out = torch.empty(B, HV, V, device=device)
    errs, seconds = [], 0.0
    for t in range(args.tokens):
        q, k, v, g, beta = (x[n][t] for n in ("q", "k", "v", "g", "beta"))
        S = recurrent_step(S, k, v, g, beta, args.gate)
        exact = output(S, q, scale)
        dev_args = [y.to(device) for y in (q, k, v, g, beta)]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        # check=True once (reads idx on the host); the hot path after it, as an engine runs it
        leapquant.step(pool, idx, *dev_args, out=out, backend=best.name, check=t == 0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds += time.perf_counter() - t0 if t else 0.0  # the first call compiles
        errs.append(float(relative_error(out.cpu(), exact, None)))
        print(f"\r{_bar(t + 1, args.tokens)}  output error now {errs[-1]:.2e}", end="", flush=True)
    print()
    rate = B * (args.tokens - 1) / seconds if seconds > 0 else float("nan")
    state_err = float(relative_error(pool.states(idx.long()).cpu(), S, None))
    flushes = args.tokens // L
    print(f"\n{rate_text(rate)} tokens/s ({B} sequences; {1e3 * seconds / max(args.tokens - 1, 1):.2f} ms a step, "
          f"{flushes} flush{'es' if flushes != 1 else ''} inside)")
    print(f"output error against the exact recurrence: mean {sum(errs) / len(errs):.2e}, last {errs[-1]:.2e}, "
          f"worst {max(errs):.2e}; state error at the end {state_err:.2e}")
    print("(error = ||o - o_exact|| / ||o_exact|| over the batch; the bf16 ring and the int8 checkpoint, docs/SPEC.md)")
    if device.type == "cpu" and best.name == "reference":
        print("No GPU here: the reference ran. `TRITON_INTERPRET=1 python -m leapquant demo --backend triton` runs "
              "the Triton kernels in their interpreter on the CPU (correct, but slow).")
    return 0 if max(errs) < 0.05 else 1


def main(argv=None) -> int:
    return command_line("python -m leapquant.tools.demo", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
