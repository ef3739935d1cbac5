"""Decode simulation: how far LeapQuant's decode drifts from the exact KDA / GDN recurrence.

    python -m leapquant simulate --out DIR            # the same as python -m leapquant.tools.simulate

Token streams (:mod:`leapquant.tools.streams`) are decoded through one :class:`~leapquant.Pool` per LeapQuant method
with :func:`leapquant.step` (one call per token: a full ring flushed inside, the attention output returned), while
the gated delta rule runs beside it exactly, in float64 (:mod:`leapquant.tools.exact`, whose docstring has the
formula; ``scale = K^-1/2``).

Per (sequence, head), at every token, the **output error** ``||o_m - o_t|| / ||o_t||``: for LeapQuant ``o_m`` is what
``step`` returned (fp32), for the dense formats ``scale S_m q_t`` from their stored state after the token. Every ``M``
tokens, the **state error** ``||S_m - S||_F / ||S||_F`` (for LeapQuant ``pool.states``: checkpoint plus ring after the
token; with ``M`` a multiple of ``L`` the ring is then full and the next token's step flushes it). Methods
(``--methods``):

* ``leapquant-r{R}`` (R = 1..4), ``leapquant-r{R}-iters2``: the pool at rank R, ITERS 1 or 2, decoded by the
  simulation's backend (``--backend``: ``auto`` is Triton on a GPU, the reference on a CPU);
  ``leapquant-r{R}@{backend}`` by that backend instead (its curves must overlay the others').
* ``leapquant-r0``: the same int8 checkpoint with no compensator. Done with a rank-1 pool whose start matrix ``Q0`` is
  zero: the subspace iteration then returns ``Q = 0`` exactly (CholeskyQR of a zero column divides 0 by the TINY
  pivot), so ``q16 = u16 = 0``, the residual is ``S`` itself and the codes, column and row scales are the SPEC's.
* ``bf16``: the state stored in bf16 after every token, ``S = bf16(update(fp32(S)))``.
* ``int8-row``: the naive int8 state, re-quantised after every token with one scale per row (value channel):
  ``scale = max_k |S[v, k]| / 127``, ``C = round_half_even(S / scale)``.

Streams (``--streams``): ``synthetic`` and ``structured``, as :mod:`leapquant.tools.streams` describes them; queries
are drawn like the keys, from the same seeded generator. :mod:`leapquant.tools.report` writes the tables, JSON and
plot; :mod:`leapquant.tools.drift` is the decode-drift check built on :func:`simulate`.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

import leapquant
from leapquant import BackendError, Pool, backends
from leapquant.constants import EPS, QMAX

from . import cli, report
from .exact import output, recurrent_step, relative_error
from .machine import versions
from .streams import STREAMS, decode_stream

DEFAULT_METHODS = (
    "leapquant-r0", "leapquant-r1", "leapquant-r2", "leapquant-r3", "leapquant-r4",
    "leapquant-r1-iters2", "leapquant-r4-iters2", "bf16", "int8-row",
)
_LEAPQUANT = re.compile(r"^leapquant-r([0-4])(?:-iters([12]))?(?:@([A-Za-z0-9_.-]+))?$")


# ---------------------------------------------------------------------------------------------------------------------
# the dense formats


def quantise_rows(S: torch.Tensor) -> torch.Tensor:
    """The naive int8 state: one scale per row ``max_k |S| / 127``, codes rounded half to even; returns the
    dequantised fp32 state it stores."""
    scale = torch.clamp_min(S.abs().amax(dim=-1, keepdim=True) / QMAX, EPS)
    return torch.round(S / scale).clamp(-QMAX, QMAX) * scale


# ---------------------------------------------------------------------------------------------------------------------
# methods


@dataclass(frozen=True)
class Method:
    """One way of keeping the state. ``kind`` is ``"leapquant"``, ``"bf16"`` or ``"int8-row"``; ``backend`` None
    means the simulation's backend."""

    name: str
    kind: str
    rank: int = 0
    iters: int = 1
    backend: str | None = None

    @staticmethod
    def parse(name: str) -> "Method":
        if name in ("bf16", "int8-row"):
            return Method(name, name)
        m = _LEAPQUANT.match(name)
        if m is None:
            raise ValueError(f"unknown method {name!r}: leapquant-r{{0..4}}[-iters2][@backend], bf16 or int8-row")
        return Method(name, "leapquant", int(m.group(1)), int(m.group(2) or 1), m.group(3))

    def state_bytes(self, K: int, V: int, L: int, gate: str) -> int:
        """Bytes per head the format keeps between tokens (LeapQuant: checkpoint plus ring, SPEC §1)."""
        if self.kind == "bf16":
            return 2 * V * K
        if self.kind == "int8-row":
            return V * K + 4 * V
        ckpt = V * K + 4 * K + 4 * V + 2 * self.rank * (K + V)
        ring = L * (2 * K + 2 * V + 4) + (L * 2 * K + 4 * K if gate == "kda" else 4)
        return ckpt + ring


class _PoolState:
    """A LeapQuant method: every stream's (sequence, head) in one pool (slots ``1..n``) on ``device``, decoded by
    :func:`leapquant.step` with ``backend``."""

    def __init__(self, method: Method, backend: str, n, heads, K, V, L, gate, device):
        rank = max(method.rank, 1)
        q0 = torch.zeros(V, 1) if method.rank == 0 else None
        self.pool = Pool(n + 1, heads, K, V, L, rank, gate=gate, q0=q0, iters=method.iters, device=device)
        self.slots = torch.arange(1, n + 1, device=device)
        self.idx = self.slots.to(torch.int32)
        self.out = torch.empty(n, heads, V, device=device)
        self.backend = backend
        self.rank0 = method.rank == 0

    def step(self, t: int, q, k, v, g, beta) -> torch.Tensor:
        # check=True on the first token only (it reads idx on the host); after it the engine's hot path
        leapquant.step(self.pool, self.idx, q, k, v, g, beta, out=self.out, backend=self.backend, check=t == 0)
        if self.rank0 and t > 0 and t % self.pool.ring == 0 and bool(self.pool.uq.any()):
            # every ring was full before this token, so the step flushed all of them
            raise RuntimeError(f"backend {self.backend!r} wrote a compensator from a zero start matrix")
        return self.out

    def states(self) -> torch.Tensor:
        return self.pool.states(self.slots)


class _DenseState:
    """bf16 or row-wise int8 state: the update in fp32, stored back in the format after every token; the output from
    the stored state."""

    def __init__(self, method: Method, n, heads, K, V, gate, scale, device):
        self.store = (lambda S: S.to(torch.bfloat16)) if method.kind == "bf16" else quantise_rows
        self.S = self.store(torch.zeros(n, heads, V, K, device=device))
        self.gate, self.scale = gate, scale

    def step(self, t: int, q, k, v, g, beta) -> torch.Tensor:
        self.S = self.store(recurrent_step(self.S.float(), k, v, g, beta, self.gate))
        return self.scale * torch.einsum("nhvk,nhk->nhv", self.S.float(), q)

    def states(self) -> torch.Tensor:
        return self.S.float()


# ---------------------------------------------------------------------------------------------------------------------
# the simulation


@dataclass
class Result:
    """Curves of one simulation, float64 with ``n = seqs * len(streams)`` rows ordered stream-major:
    ``output[method]`` ``[tokens, n, heads]``, the output error at every token; ``state[method]``
    ``[records, n, heads]``, the state error at the tokens ``tokens[i]`` (every ``M``-th and the last)."""

    config: dict
    tokens: list[int]
    methods: list[Method]
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    output: dict[str, torch.Tensor] = field(default_factory=dict)
    backends: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    def rows(self, stream: str) -> slice:
        i, s = self.config["streams"].index(stream), self.config["seqs"]
        return slice(i * s, (i + 1) * s)

    def curve(self, name: str, stream: str, what: str = "state") -> torch.Tensor:
        """Mean over (sequence, head) of one stream: ``[records]`` (state) or ``[tokens]`` (output)."""
        return getattr(self, what)[name][:, self.rows(stream)].mean(dim=(1, 2))

    def records(self, name: str, what: str = "state") -> torch.Tensor:
        """``[records, n, heads]``: the state error at each record, or the output error averaged per head over each
        record's window of tokens (those after the previous record, up to this one)."""
        e = getattr(self, what)[name]
        return e if what == "state" else windows(e, self.tokens[:len(self.state[name])])

    def summary(self) -> list[dict]:
        """Per stream and method, of :meth:`records`: ``*_final`` the mean over heads at the last record, ``*_worst``
        any head at any record, ``*_quarters`` the mean of each quarter of the records (for trend checks)."""
        out = []
        K, V, L, gate = (self.config[x] for x in ("head_k", "head_v", "ring", "gate"))
        for stream in self.config["streams"]:
            for m in self.methods:
                row = dict(method=m.name, backend=self.backends.get(m.name), stream=stream,
                           bytes=m.state_bytes(K, V, L, gate))
                for what in ("state", "output"):
                    e = self.records(m.name, what)[:, self.rows(stream)]
                    row[f"{what}_final"] = float(e[-1].mean())
                    row[f"{what}_worst"] = float(e.max())
                    row[f"{what}_quarters"] = [float(c.mean()) for c in torch.tensor_split(e, 4, dim=0)]
                out.append(row)
        return out


def available_backends(gate: str, heads: int, K: int, V: int, L: int, device="cpu") -> tuple[list[str], list[str]]:
    """Backends that can decode the simulation's pools on ``device`` here, and a 'name: why not' line for each that
    cannot."""
    probe = Pool(2, heads, K, V, L, 4, gate=gate, device=device)
    ok, skipped = [], []
    for info in backends():
        if not info.available:
            skipped.append(f"{info.name}: {info.reason}")
            continue
        try:
            leapquant.select(probe, info.name, op="step")
            ok.append(info.name)
        except BackendError as e:
            skipped.append(f"{info.name}: {e}")
    return ok, skipped


def simulate(
    *,
    gate: str = "kda",
    tokens: int = 2048,
    heads: int = 4,
    seqs: int = 2,
    every: int = 16,
    streams: Sequence[str] = STREAMS,
    methods: Sequence[str] = DEFAULT_METHODS,
    head_k: int = 128,
    head_v: int = 128,
    ring: int = 16,
    seed: int = 0,
    backend: str = "auto",
    device: str | torch.device = "cpu",
    jobs: int = 1,
    progress: Callable[[int, float, "Result"], None] | None = None,
    progress_every: int = 256,
) -> Result:
    """Run the decode simulation and return its curves (see the module docstring).

    Args:
        gate: ``"kda"`` or ``"gdn"``. tokens: T per sequence. heads: heads per sequence. seqs: sequences per stream
        kind. every: M, tokens between state records. streams: stream kinds. methods: method names
        (:class:`Method`). head_k, head_v, ring: K, V, L of the pools. seed: stream kind ``i`` draws from
        ``Generator(seed + i)`` (on the CPU, whatever the device). backend: decodes the LeapQuant methods without
        ``@backend`` (``"auto"``: the fastest with a decode step on ``device``). device: where the pools, the dense
        states and the exact recurrence live. jobs: CPU processes; the LeapQuant methods are dealt out among them
        (each decodes the same streams and its own exact recurrence; this process takes the dense formats and reports
        progress). The results do not depend on it.
        progress: called as ``progress(tokens_done, seconds, result_so_far)`` every ``progress_every`` tokens.

    Raises:
        ValueError: an unknown method or stream, or sizes out of range.
        leapquant.BackendError: a method's backend cannot decode these pools here.
    """
    if gate not in ("kda", "gdn"):
        raise ValueError(f"gate must be 'kda' or 'gdn', got {gate!r}")
    if min(tokens, heads, seqs, every) < 1:
        raise ValueError("tokens, heads, seqs and every must be positive")
    streams = list(streams)
    for s in streams:
        if s not in STREAMS:
            raise ValueError(f"unknown stream {s!r}; known: {STREAMS}")
    parsed = [Method.parse(m) for m in methods]
    if len({m.name for m in parsed}) != len(parsed):
        raise ValueError(f"a method is named twice: {list(methods)}")
    device = torch.device(device)
    n, K, V, L = seqs * len(streams), head_k, head_v, ring
    probe = Pool(2, heads, K, V, L, 4, gate=gate, device=device)
    chosen = {m.name: leapquant.select(probe, m.backend or backend, op="step").name for m in parsed if m.kind == "leapquant"}
    pooled = [m.name for m in parsed if m.kind == "leapquant"]
    jobs = max(1, min(jobs, len(pooled))) if device.type == "cpu" else 1
    if jobs > 1:
        kw = dict(gate=gate, tokens=tokens, heads=heads, seqs=seqs, every=every, streams=streams, head_k=head_k,
                  head_v=head_v, ring=ring, seed=seed, backend=backend, device=device)
        return _simulate_jobs(kw, [m.name for m in parsed], pooled, jobs, progress, progress_every)

    parts = [decode_stream(s, seqs, heads, K, V, tokens, gate, torch.Generator().manual_seed(seed + i))
             for i, s in enumerate(streams)]
    x = {key: torch.cat([p[key] for p in parts], dim=1).to(device) for key in parts[0]}  # [T, n, heads, ...]

    scale = K ** -0.5
    runners = {m.name: _PoolState(m, chosen[m.name], n, heads, K, V, L, gate, device) if m.kind == "leapquant"
               else _DenseState(m, n, heads, K, V, gate, scale, device) for m in parsed}
    config = dict(gate=gate, tokens=tokens, heads=heads, seqs=seqs, every=every, streams=streams, head_k=K,
                  head_v=V, ring=L, seed=seed, methods=[m.name for m in parsed], device=device.type)
    result = Result(config, [], parsed, backends=chosen)
    recs_state: dict[str, list] = {m.name: [] for m in parsed}
    out_err = {m.name: torch.zeros(tokens, n, heads, dtype=torch.float64, device=device) for m in parsed}
    S = torch.zeros(n, heads, V, K, dtype=torch.float64, device=device)
    start = time.perf_counter()

    def publish(done: int):
        result.state = {k: torch.stack(v).cpu() if v else torch.zeros(0, n, heads, dtype=torch.float64)
                        for k, v in recs_state.items()}
        result.output = {k: v[:done].cpu() for k, v in out_err.items()}

    for t in range(tokens):
        q, k, v, g, beta = (x[key][t] for key in ("q", "k", "v", "g", "beta"))
        S = recurrent_step(S, k, v, g, beta, gate)
        o = output(S, q, scale)
        for name, r in runners.items():
            out_err[name][t] = relative_error(r.step(t, q, k, v, g, beta), o, (-1,))
        if (t + 1) % every == 0 or t + 1 == tokens:
            for name, r in runners.items():
                recs_state[name].append(relative_error(r.states(), S, (-2, -1)))
            result.tokens.append(t + 1)
        if progress is not None and ((t + 1) % progress_every == 0 or t + 1 == tokens):
            publish(t + 1)
            progress(t + 1, time.perf_counter() - start, result)
    publish(tokens)
    result.seconds = time.perf_counter() - start
    return result


def _worker_init(threads: int) -> None:
    torch.set_num_threads(threads)


def _simulate_jobs(kw: dict, names: list[str], pooled: list[str], jobs: int, progress, progress_every) -> Result:
    """:func:`simulate` with the LeapQuant methods dealt out to ``jobs`` processes (this one included), merged."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    parts = [pooled[i::jobs] for i in range(jobs)]  # round robin: the costs of the methods are about equal
    here = parts[0] + [m for m in names if m not in pooled]
    start = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")  # a forked child of a process that ran torch ops can hang
    with ProcessPoolExecutor(jobs - 1, mp_context=ctx, initializer=_worker_init,
                             initargs=(torch.get_num_threads(),)) as ex:
        futures = [ex.submit(simulate, **kw, methods=part) for part in parts[1:]]
        result = simulate(**kw, methods=here, progress=progress, progress_every=progress_every)
        others = [f.result() for f in futures]
    for r in others:
        result.state.update(r.state)
        result.output.update(r.output)
        result.backends.update(r.backends)
    by_name = {m.name: m for r in [result] + others for m in r.methods}
    result.methods = [by_name[n] for n in names]
    result.config["methods"] = list(names)
    result.backends = {n: result.backends[n] for n in names if n in result.backends}
    result.state = {n: result.state[n] for n in names}
    result.output = {n: result.output[n] for n in names}
    result.seconds = time.perf_counter() - start
    return result


def windows(errors: torch.Tensor, tokens: Sequence[int]) -> torch.Tensor:
    """Per-token errors ``[T, ...]`` averaged over the window that ends at each record token: ``[records, ...]``
    (the tokens after the previous record up to this one)."""
    edges = [0] + list(tokens)
    return torch.stack([errors[a:b].mean(dim=0) for a, b in zip(edges[:-1], edges[1:])])


# ---------------------------------------------------------------------------------------------------------------------
# command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gate", choices=["kda", "gdn"], default="kda",
                   help="kda: per-channel decay (Kimi Delta Attention); gdn: scalar decay (Gated DeltaNet)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument("--heads", type=int, default=4, help="heads per sequence (default 4)")
    p.add_argument("--seqs", type=int, default=2, help="sequences per stream kind (default 2)")
    p.add_argument("--every", type=int, default=16, metavar="M", help="tokens between state records (default 16 = "
                   "L: each record sees a full ring, which the next token's step flushes)")
    p.add_argument("--streams", default=",".join(STREAMS), help=f"comma list of {STREAMS}")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help="comma list: leapquant-r{0..4}[-iters2][@backend], bf16, int8-row")
    p.add_argument("--backend", default="auto", help="decodes the LeapQuant methods: auto (Triton on a GPU, the "
                   "reference on a CPU), reference or triton (on a CPU only with TRITON_INTERPRET=1, and slowly)")
    p.add_argument("--backends", default="", help="comma list of other backends to overlay leapquant-r4 with "
                   "(rows leapquant-r4@NAME), or 'all' (every other backend with a decode step here)")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if there is a GPU, else cpu)")
    p.add_argument("--out", default="simulate_out", help="directory for simulate.json, simulate.png, simulate.md")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated token streams (default 0)")
    p.add_argument("--jobs", type=int, default=2, help="CPU processes that share out the LeapQuant methods "
                   "(default 2; each runs --threads threads; the results do not depend on it)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: the tensors are small; on a "
                   "busy 2-core machine 2 threads made pool.append 20-200x slower)")


def _command(args) -> str:
    """The command line that reproduces ``args`` (options away from their defaults, and ``--out``)."""
    ref = argparse.ArgumentParser()
    add_arguments(ref)
    defaults = vars(ref.parse_args([]))
    opts = [f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
            if k in defaults and (v != defaults[k] or k == "out")]
    return " ".join(["python -m leapquant simulate"] + opts)


def main(args) -> int:
    torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    methods = [m for m in args.methods.split(",") if m]
    here, skipped = available_backends(args.gate, args.heads, 128, 128, 16, device)
    main_backend = leapquant.select(Pool(2, args.heads, gate=args.gate, device=device), args.backend, op="step").name
    if args.backends == "all":
        extra = [b for b in here if b != main_backend]
    else:
        extra = [b for b in args.backends.split(",") if b and b != main_backend]
        missing = [b for b in extra if b not in here]
        if missing:
            why = "; ".join(s for s in skipped if s.split(":")[0] in missing) or "unknown backend"
            raise BackendError(f"cannot run backend(s) {missing}: {why}")
    methods += [f"leapquant-r4@{b}" for b in extra if f"leapquant-r4@{b}" not in methods]
    c = args
    print(f"{c.gate.upper()}: {c.seqs} seqs x {c.heads} heads x {c.tokens} tokens per stream kind ({c.streams}), "
          f"K=V=128, L=16, state recorded every {c.every}; {len(methods)} methods; LeapQuant decoded by "
          f"leapquant.step with backend {main_backend} on {device}"
          + (f" (overlays: {', '.join(extra)})" if extra else ""), flush=True)

    def progress(done, secs, res):
        last = {m: float(res.output[m][-c.every:].mean()) for m in ("leapquant-r4", "int8-row") if m in res.output
                and len(res.output[m])}
        tail = "  ".join(f"{m} {e:.2e}" for m, e in last.items())
        print(f"  {done:>6}/{c.tokens} tokens  {secs:6.1f} s  output error now: {tail}", flush=True)

    res = simulate(gate=c.gate, tokens=c.tokens, heads=c.heads, seqs=c.seqs, every=c.every,
                   streams=[s for s in c.streams.split(",") if s], methods=methods, seed=c.seed,
                   backend=main_backend, device=device, jobs=c.jobs, progress=progress)
    print()
    print(report.table(res))
    for line in report.overlays(res):
        print(line)
    out = Path(c.out)
    wrote = report.write(res, out, command=_command(c), versions=versions(device),
                         backend=main_backend)
    print(f"\n{res.seconds:.1f} s; wrote {', '.join(str(out / w) for w in wrote)}"
          + ("" if "simulate.png" in wrote else " (no plot: pip install matplotlib)"))
    return 0


def command_line(argv=None) -> int:
    """``python -m leapquant.tools.simulate``: the same as ``python -m leapquant simulate``."""
    return cli.command_line("python -m leapquant.tools.simulate", __doc__, add_arguments, main, argv)


if __name__ == "__main__":
    sys.exit(command_line())
