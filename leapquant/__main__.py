"""Command line: ``python -m leapquant {info,demo,simulate}``."""

from __future__ import annotations

import argparse
import importlib.metadata as md
import platform
import sys
import time

import torch

import leapquant



def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


def device_lines() -> list[str]:
    lines = [f"python {platform.python_version()}, torch {torch.__version__}, triton {_version('triton')}, "
             f"tilelang {_version('tilelang')}, leapquant {leapquant.__version__}"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"cuda:{i} {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
                         f"{p.total_memory / 2**30:.0f} GiB (CUDA {torch.version.cuda})")
    else:
        lines.append("no CUDA device: kernels run on the CPU only through an interpreter (TRITON_INTERPRET=1)")
    return lines


def cmd_info(args) -> int:
    for line in device_lines():
        print(line)
    print()
    print(f"{'backend':<12} {'priority':>8}  status")
    for b in leapquant.backends():
        status = "available" if b.available else "unavailable"
        print(f"{b.name:<12} {b.priority:>8}  {status}: {b.reason}")
        if b.description:
            print(f"{'':<22}{b.description}")
        if b.available:
            for dev, why in leapquant.get_backend(b.name).not_for_auto.items():
                print(f"{'':<22}auto skips it on {dev}: {why}")
    print()
    from .memory import table

    for line in table(args.gib, heads=args.heads, head_k=args.head_k, head_v=args.head_v, ring=args.ring,
                      rank=args.rank, gate=args.gate):
        print(line)
    return 0


def _tokens(gate: str, B: int, H: int, HV: int, K: int, V: int, gen: torch.Generator) -> tuple:
    """One token per sequence: unit keys, Gaussian queries and values, per-channel (KDA) or scalar (GDN) log decays
    that forget over tens to hundreds of tokens, write strengths in (0, 1)."""
    q = torch.randn(B, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, H, K, generator=gen), dim=-1)
    v = torch.randn(B, HV, V, generator=gen)
    g = -0.05 * torch.rand(*((B, HV, K) if gate == "kda" else (B, HV)), generator=gen)
    beta = torch.rand(B, HV, generator=gen)
    return q, k, v, g, beta


def _exact_step(S, gate, q, k, v, g, beta, scale):
    """The gated delta rule in float64, V-first ``S [B, HV, V, K]``, in place; returns ``scale S q``."""
    G = S.shape[1] // q.shape[1]
    q, k = (t.double().repeat_interleave(G, 1) for t in (q, k))
    v, g, beta = v.double(), g.double(), beta.double()
    S.mul_(torch.exp(g)[:, :, None, :] if gate == "kda" else torch.exp(g)[:, :, None, None])
    p = torch.einsum("nhvk,nhk->nhv", S, k)
    S.add_(torch.einsum("nhv,nhk->nhvk", beta[..., None] * (v - p), k))
    return scale * torch.einsum("nhvk,nhk->nhv", S, q)


def _bar(done: int, total: int, width: int = 30) -> str:
    filled = width * done // total
    return "[" + "#" * filled + "." * (width - filled) + f"] {done}/{total}"


def cmd_demo(args) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    for line in device_lines():
        print(line)
    B, HV, H = args.seqs, args.heads, args.key_heads or args.heads
    pool = leapquant.Pool(B + 1, HV, gate=args.gate, device=device)  # slot 0: the null slot
    K, V, L = pool.head_k, pool.head_v, pool.ring
    idx = torch.arange(1, B + 1, dtype=torch.int32, device=device)
    best = leapquant.ops.select_step(pool, args.backend)
    print(f"\ndecoding {B} sequences x {HV} heads ({H} key heads) of {args.gate.upper()}, K = V = {K}, "
          f"{args.tokens} tokens each with leapquant.step, backend {best.name} "
          f"({'chosen by auto' if args.backend == 'auto' else 'asked for'}); a ring of {L} is flushed inside the "
          f"step every {L} tokens. Beside it: the exact float64 recurrence of the same stream.", flush=True)
    gen = torch.Generator().manual_seed(args.seed)
    S = torch.zeros(B, HV, V, K, dtype=torch.float64)
    scale = K ** -0.5
    out = torch.empty(B, HV, V, device=device)
    errs, seconds = [], 0.0
    for t in range(args.tokens):
        q, k, v, g, beta = _tokens(args.gate, B, H, HV, K, V, gen)
        exact = _exact_step(S, args.gate, q, k, v, g, beta, scale)
        dev_args = [x.to(device) for x in (q, k, v, g, beta)]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        # check=True once (reads idx on the host); the hot path after it, as an engine runs it
        leapquant.step(pool, idx, *dev_args, out=out, backend=best.name, check=t == 0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds += time.perf_counter() - t0 if t else 0.0  # the first call compiles
        errs.append(float((out.cpu().double() - exact).norm() / exact.norm()))
        print(f"\r{_bar(t + 1, args.tokens)}  output error now {errs[-1]:.2e}", end="", flush=True)
    print()
    rate = B * (args.tokens - 1) / seconds if seconds > 0 else float("nan")
    state_err = float((pool.states(idx.long()).cpu().double() - S).norm() / S.norm())
    flushes = args.tokens // L
    print(f"\n{rate:,.0f} tokens/s ({B} sequences; {1e3 * seconds / max(args.tokens - 1, 1):.2f} ms a step, "
          f"{flushes} flush{'es' if flushes != 1 else ''} inside)")
    print(f"output error against the exact recurrence: mean {sum(errs) / len(errs):.2e}, last {errs[-1]:.2e}, "
          f"worst {max(errs):.2e}; state error at the end {state_err:.2e}")
    print("(error = ||o - o_exact|| / ||o_exact|| over the batch; the bf16 ring and the int8 checkpoint, docs/SPEC.md)")
    if device.type == "cpu" and best.name == "reference":
        print("No GPU here: the reference ran. `TRITON_INTERPRET=1 python -m leapquant demo --backend triton` runs "
              "the Triton kernels in their interpreter on the CPU (correct, but slow).")
    return 0 if max(errs) < 0.05 else 1


def cmd_simulate(args) -> int:
    from .tools.simulate import main as simulate_main

    return simulate_main(args)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m leapquant", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("info", help="backends, devices and versions; why a backend is unavailable; bytes per sequence")
    i.add_argument("--gib", type=float, default=80.0, help="memory budget for the sequences-that-fit column (default 80)")
    i.add_argument("--heads", type=int, default=32, help="heads per sequence (per layer, per GPU; default 32)")
    i.add_argument("--head-k", type=int, default=128, help="key head dim K (default 128)")
    i.add_argument("--head-v", type=int, default=128, help="value head dim V (default 128)")
    i.add_argument("--ring", type=int, default=16, help="ring entries L (default 16)")
    i.add_argument("--rank", type=int, default=4, help="Compensator Tokens R (default 4)")
    i.add_argument("--gate", choices=["kda", "gdn"], default="kda", help="kda (gbuf, pcum[K]) or gdn (pcum[1])")
    d = sub.add_parser("demo", help="decode a batch token by token with leapquant.step, against the exact recurrence")
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
    try:
        from .tools.simulate import add_arguments
    except ImportError:
        add_arguments = None
    if add_arguments is not None:
        add_arguments(sub.add_parser("simulate", help="decode simulation: drift of LeapQuant state vs exact"))
    args = ap.parse_args(argv)
    try:
        return {"info": cmd_info, "demo": cmd_demo, "simulate": cmd_simulate}[args.cmd](args)
    except leapquant.BackendError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
