"""Decode simulation: how far LeapQuant state drifts from the exact KDA / GDN recurrence (project issue 3).

Token streams are driven through one :class:`~leapquant.Pool` per LeapQuant method (``pool.append`` per token, a
flush every ``L`` tokens, when every row is due) while the exact recurrence runs beside it in float64, in the
``[V, K]`` layout of SPEC §1 (FLA's ``naive_recurrent_kda`` / gated delta rule, transposed):

    KDA:  S <- S diag(exp g_t)        GDN:  S <- exp(g_t) S
          S <- S + beta_t (v_t - S k_t) k_t^T
          o_t = S q_t

Every ``M`` tokens each method's state ``S_m`` (for LeapQuant ``pool.states``: checkpoint plus ring as it stands) is
compared per (sequence, head): state error ``||S_m - S||_F / ||S||_F`` and output error ``||S_m q_t - S q_t|| /
||S q_t||``. Methods (``--methods``):

* ``leapquant-r{R}`` (R = 1..4), ``leapquant-r{R}-iters2``: the pool at rank R, ITERS 1 or 2, flushed by the
  reference; ``leapquant-r{R}@{backend}`` flushes with that backend instead (its curve must overlay the reference's).
* ``leapquant-r0``: the same int8 checkpoint with no compensator. Done with a rank-1 pool whose start matrix ``Q0`` is
  zero: the subspace iteration then returns ``Q = 0`` exactly (CholeskyQR of a zero column divides 0 by the TINY
  pivot), so ``q16 = u16 = 0``, the residual is ``S`` itself and the codes, column and row scales are the SPEC's.
* ``bf16``: the state stored in bf16 after every token, ``S = bf16(update(fp32(S)))``.
* ``int8-row``: the naive int8 state, re-quantised after every token with one scale per row (value channel):
  ``scale = max_k |S[v, k]| / 127``, ``C = round_half_even(S / scale)``.

Streams (``--streams``): ``synthetic`` (unit random keys and queries, per-channel memory lengths 10..1000 tokens,
beta in (0, 1); :func:`leapquant.workloads.token_stream`) and ``structured`` (keys and queries near three dominant
directions, two outlier key channels, four outlier value channels, a quarter of the key channels with memory lengths
10^3..10^5 tokens, i.e. decays within 1e-3 of 1).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from .backends import BackendError, backends, get
from .constants import EPS, QMAX
from .ops import flush
from .pool import Pool
from .workloads import token_stream

STREAMS = ("synthetic", "structured")
DEFAULT_METHODS = (
    "leapquant-r0", "leapquant-r1", "leapquant-r2", "leapquant-r3", "leapquant-r4",
    "leapquant-r1-iters2", "leapquant-r4-iters2", "bf16", "int8-row",
)
_LEAPQUANT = re.compile(r"^leapquant-r([0-4])(?:-iters([12]))?(?:@([A-Za-z0-9_.-]+))?$")


# ---------------------------------------------------------------------------------------------------------------------
# streams


def _normalise(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(x, dim=-1)


def _log_uniform(gen, lo: float, hi: float, *shape) -> torch.Tensor:
    return torch.exp(math.log(lo) + (math.log(hi) - math.log(lo)) * torch.rand(*shape, generator=gen))


def decode_stream(kind: str, n: int, heads: int, K: int, V: int, T: int, gate: str, gen: torch.Generator):
    """Decode inputs ``dict(q, k, v, g, beta)``, each ``[T, n, heads, ...]`` fp32: ``q, k [.., K]`` unit vectors,
    ``v [.., V]``, ``g`` log-gates (``[.., K]`` for KDA, ``[T, n, heads]`` for GDN), ``beta [T, n, heads]`` in (0, 1).
    """
    if kind == "synthetic":
        k, v, g, beta = token_stream(n, heads, K, V, T, gate, gen, structured=False)
        q = _normalise(torch.randn(T, n, heads, K, generator=gen))
        return dict(q=q, k=k, v=v, g=g, beta=beta)
    if kind != "structured":
        raise ValueError(f"unknown stream {kind!r}; known: {STREAMS}")
    # memory lengths tau: a quarter of the key channels (GDN: every other head) remember 10^3..10^5 tokens
    if gate == "kda":
        long = torch.rand(n, heads, K, generator=gen) < 0.25
        tau = torch.where(long, _log_uniform(gen, 1e3, 1e5, n, heads, K), _log_uniform(gen, 10.0, 1e3, n, heads, K))
    else:
        long = (torch.arange(heads) % 2 == 0).expand(n, heads)
        tau = torch.where(long, _log_uniform(gen, 1e3, 1e5, n, heads), _log_uniform(gen, 10.0, 1e3, n, heads))
    g_base = torch.log1p(-1.0 / tau)
    dirs = _normalise(torch.randn(n, heads, 3, K, generator=gen))
    weight = torch.tensor([3.0, 1.5, 1.0])
    # two "massive activation" key channels with a fixed offset per head, shared by keys and queries
    out_k = torch.randperm(K, generator=gen)[:2]
    offset = torch.zeros(n, heads, K)
    offset[..., out_k] = torch.sign(torch.randn(n, heads, 2, generator=gen))

    def near_dirs():
        coef = torch.randn(T, n, heads, 3, generator=gen) * weight
        noise = 0.3 * torch.randn(T, n, heads, K, generator=gen) / math.sqrt(K)
        return _normalise(torch.einsum("tnhd,nhdk->tnhk", coef, dirs) + offset + noise)

    k, q = near_dirs(), near_dirs()
    v = torch.randn(T, n, heads, V, generator=gen)
    v[..., torch.randperm(V, generator=gen)[:4]] *= 10.0
    beta = 0.05 + 0.9 * torch.rand(T, n, heads, generator=gen)
    jitter = 0.5 + torch.rand(T, *g_base.shape, generator=gen)
    return dict(q=q, k=k, v=v, g=g_base * jitter, beta=beta)


# ---------------------------------------------------------------------------------------------------------------------
# the exact recurrence and the dense formats


def recurrent_step(S: torch.Tensor, k, v, g, beta, gate: str) -> torch.Tensor:
    """One token of the gated delta rule on states ``S [..., V, K]`` in ``S.dtype``; returns the new state.

    ``k [..., K]``, ``v [..., V]``, ``beta [...]``; ``g [..., K]`` (KDA) or ``[...]`` (GDN), log-gates.
    """
    dt = S.dtype
    k, v, g, beta = k.to(dt), v.to(dt), g.to(dt), beta.to(dt)
    if gate == "kda":
        S = S * torch.exp(g)[..., None, :]
    else:
        S = S * torch.exp(g)[..., None, None]
    err = v - torch.einsum("...vk,...k->...v", S, k)  # [..., V]
    return S + (beta[..., None] * err)[..., :, None] * k[..., None, :]


def exact_recurrence(q, k, v, g, beta, gate: str, dtype=torch.float64):
    """The recurrence over ``T`` tokens from a zero state: inputs ``[T, ...]`` as :func:`decode_stream` gives them.

    Returns ``(o [T, ..., V], S [..., V, K])`` with ``o_t = S_t q_t`` (no ``1/sqrt(K)`` scale), in ``dtype``.
    """
    T, V, K = k.shape[0], v.shape[-1], k.shape[-1]
    S = torch.zeros(*v.shape[1:-1], V, K, dtype=dtype)
    out = []
    for t in range(T):
        S = recurrent_step(S, k[t], v[t], g[t], beta[t], gate)
        out.append(torch.einsum("...vk,...k->...v", S, q[t].to(dtype)))
    return torch.stack(out), S


def quantise_rows(S: torch.Tensor) -> torch.Tensor:
    """The naive int8 state: one scale per row ``max_k |S| / 127``, codes rounded half to even; returns the
    dequantised fp32 state it stores."""
    scale = torch.clamp_min(S.abs().amax(dim=-1, keepdim=True) / QMAX, EPS)
    return torch.round(S / scale).clamp(-QMAX, QMAX) * scale


# ---------------------------------------------------------------------------------------------------------------------
# methods


@dataclass(frozen=True)
class Method:
    """One way of keeping the state. ``kind`` is ``"leapquant"``, ``"bf16"`` or ``"int8-row"``."""

    name: str
    kind: str
    rank: int = 0
    iters: int = 1
    backend: str = "reference"

    @staticmethod
    def parse(name: str) -> "Method":
        if name in ("bf16", "int8-row"):
            return Method(name, name)
        m = _LEAPQUANT.match(name)
        if m is None:
            raise ValueError(f"unknown method {name!r}: leapquant-r{{0..4}}[-iters2][@backend], bf16 or int8-row")
        rank, iters, backend = int(m.group(1)), int(m.group(2) or 1), m.group(3) or "reference"
        return Method(name, "leapquant", rank, iters, backend)

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
    """A LeapQuant method: every stream's (sequence, head) in one pool, slots ``1..n``."""

    def __init__(self, method: Method, n, heads, K, V, L, gate):
        rank = max(method.rank, 1)
        q0 = torch.zeros(V, 1) if method.rank == 0 else None
        self.pool = Pool(n + 1, heads, K, V, L, rank, gate=gate, q0=q0, iters=method.iters)
        self.slots = torch.arange(1, n + 1)
        self.idx = self.slots.to(torch.int32)
        self.backend = method.backend
        self.rank0 = method.rank == 0

    def step(self, t: int, k, v, g, beta) -> None:
        self.pool.append(self.slots, k, v, g, beta)
        if (t + 1) % self.pool.ring == 0:
            # every row is due now (all slots advance together); the flush takes exactly those
            flush(self.pool, self.idx, backend=self.backend, check=False)
            if self.rank0 and bool(self.pool.uq.any()):
                raise RuntimeError(f"backend {self.backend!r} wrote a compensator from a zero start matrix")

    def states(self) -> torch.Tensor:
        return self.pool.states(self.slots)


class _DenseState:
    """bf16 or row-wise int8 state: the update in fp32, stored back in the format after every token."""

    def __init__(self, method: Method, n, heads, K, V, gate):
        self.store = (lambda S: S.to(torch.bfloat16)) if method.kind == "bf16" else quantise_rows
        self.S = self.store(torch.zeros(n, heads, V, K))
        self.gate = gate

    def step(self, t: int, k, v, g, beta) -> None:
        self.S = self.store(recurrent_step(self.S.float(), k, v, g, beta, self.gate))

    def states(self) -> torch.Tensor:
        return self.S.float()


def _rel(a: torch.Tensor, b: torch.Tensor, dims) -> torch.Tensor:
    num = torch.linalg.vector_norm(a.double() - b, dim=dims)
    den = torch.linalg.vector_norm(b, dim=dims)
    return num / torch.clamp_min(den, 1e-300)


# ---------------------------------------------------------------------------------------------------------------------
# the simulation


@dataclass
class Result:
    """Curves of one simulation. ``state[method]`` and ``output[method]`` are float64 ``[records, n, heads]`` with
    ``n = seqs * len(streams)`` rows ordered stream-major; ``tokens[i]`` is the token count at record ``i``."""

    config: dict
    tokens: list[int]
    methods: list[Method]
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    output: dict[str, torch.Tensor] = field(default_factory=dict)
    seconds: float = 0.0

    def rows(self, stream: str) -> slice:
        i, s = self.config["streams"].index(stream), self.config["seqs"]
        return slice(i * s, (i + 1) * s)

    def curve(self, name: str, stream: str, what: str = "state") -> torch.Tensor:
        """Mean over (sequence, head) of one stream at each record: ``[records]``."""
        return getattr(self, what)[name][:, self.rows(stream)].mean(dim=(1, 2))

    def summary(self) -> list[dict]:
        """Per stream and method: mean error at the last record, worst (any head, any record) error, and the mean
        error of each quarter of the run (``quarters``, for trend checks)."""
        out = []
        K, V, L, gate = (self.config[x] for x in ("head_k", "head_v", "ring", "gate"))
        for stream in self.config["streams"]:
            for m in self.methods:
                row = dict(method=m.name, stream=stream, bytes=m.state_bytes(K, V, L, gate))
                for what in ("state", "output"):
                    e = getattr(self, what)[m.name][:, self.rows(stream)]
                    row[f"{what}_final"] = float(e[-1].mean())
                    row[f"{what}_worst"] = float(e.max())
                    q = [float(c.mean()) for c in torch.tensor_split(e, 4, dim=0)]
                    row[f"{what}_quarters"] = q
                out.append(row)
        return out


def available_backends(gate: str, heads: int, K: int, V: int, L: int) -> tuple[list[str], list[str]]:
    """Backends that can flush the simulation's pools here, and a 'name: why not' line for each that cannot."""
    probe = Pool(2, heads, K, V, L, 4, gate=gate)
    ok, skipped = [], []
    for info in backends():
        if not info.available:
            skipped.append(f"{info.name}: {info.reason}")
            continue
        can, why = get(info.name).supports(probe)
        (ok if can else skipped).append(info.name if can else f"{info.name}: {why}")
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
    progress: Callable[[int, float, "Result"], None] | None = None,
    progress_every: int = 256,
) -> Result:
    """Run the decode simulation on the CPU and return its curves (see the module docstring).

    Args:
        gate: ``"kda"`` or ``"gdn"``. tokens: T per sequence. heads: heads per sequence. seqs: sequences per stream
        kind. every: M, tokens between records. streams: stream kinds. methods: method names (:class:`Method`).
        head_k, head_v, ring: K, V, L of the pools. seed: stream kind ``i`` draws from ``Generator(seed + i)``.
        progress: called as ``progress(tokens_done, seconds, result_so_far)`` every ``progress_every`` tokens.

    Raises:
        ValueError: an unknown method or stream, or sizes out of range.
        leapquant.BackendError: a method names a backend that cannot flush these pools here.
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
    n, K, V, L = seqs * len(streams), head_k, head_v, ring
    for b in {m.backend for m in parsed if m.kind == "leapquant"}:
        can, why = get(b).supports(Pool(2, heads, K, V, L, 4, gate=gate))
        if not can:
            raise BackendError(f"backend {b!r} cannot flush the simulation's pools: {why}")

    parts = [decode_stream(s, seqs, heads, K, V, tokens, gate, torch.Generator().manual_seed(seed + i))
             for i, s in enumerate(streams)]
    x = {key: torch.cat([p[key] for p in parts], dim=1) for key in parts[0]}  # [T, n, heads, ...]

    runners = {m.name: _PoolState(m, n, heads, K, V, L, gate) if m.kind == "leapquant"
               else _DenseState(m, n, heads, K, V, gate) for m in parsed}
    config = dict(gate=gate, tokens=tokens, heads=heads, seqs=seqs, every=every, streams=streams, head_k=K,
                  head_v=V, ring=L, seed=seed, methods=[m.name for m in parsed])
    result = Result(config, [], parsed)
    recs_state: dict[str, list] = {m.name: [] for m in parsed}
    recs_out: dict[str, list] = {m.name: [] for m in parsed}
    S = torch.zeros(n, heads, V, K, dtype=torch.float64)
    start = time.perf_counter()

    def publish():
        result.state = {k: torch.stack(v) if v else torch.zeros(0, n, heads) for k, v in recs_state.items()}
        result.output = {k: torch.stack(v) if v else torch.zeros(0, n, heads) for k, v in recs_out.items()}

    for t in range(tokens):
        k, v, g, beta = x["k"][t], x["v"][t], x["g"][t], x["beta"][t]
        S = recurrent_step(S, k, v, g, beta, gate)
        for r in runners.values():
            r.step(t, k, v, g, beta)
        if (t + 1) % every == 0 or t + 1 == tokens:
            q = x["q"][t].double()
            o = torch.einsum("nhvk,nhk->nhv", S, q)
            for name, r in runners.items():
                Sm = r.states()
                recs_state[name].append(_rel(Sm, S, (-2, -1)))
                recs_out[name].append(_rel(torch.einsum("nhvk,nhk->nhv", Sm.double(), q), o, (-1,)))
            result.tokens.append(t + 1)
        if progress is not None and ((t + 1) % progress_every == 0 or t + 1 == tokens):
            publish()
            progress(t + 1, time.perf_counter() - start, result)
    publish()
    result.seconds = time.perf_counter() - start
    return result


# ---------------------------------------------------------------------------------------------------------------------
# reporting


def _overlays(result: Result) -> list[str]:
    """For each ``name@backend``, how far its state curve strays from the reference's ``name`` (ratio range)."""
    lines = []
    names = {m.name for m in result.methods}
    for m in result.methods:
        base = m.name.split("@")[0]
        if m.backend == "reference" or base not in names:
            continue
        r = result.state[m.name] / torch.clamp_min(result.state[base], 1e-300)
        lines.append(f"{m.name} over {base} (state error ratio, every head and record): "
                     f"{float(r.min()):.4f} .. {float(r.max()):.4f}")
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

    return dict(
        config=result.config,
        seconds=round(result.seconds, 2),
        tokens=result.tokens,
        summary=result.summary(),
        curves={m.name: {s: dict(state=[float(f"{e:.4g}") for e in result.curve(m.name, s, "state")],
                                 output=[float(f"{e:.4g}") for e in result.curve(m.name, s, "output")])
                         for s in result.config["streams"]} for m in result.methods},
        per_head={m.name: dict(state=per_head(result.state[m.name]), output=per_head(result.output[m.name]))
                  for m in result.methods},
        note="curves: mean over (sequence, head) of each stream; per_head: [record][row][head], rows stream-major",
    )


def _style(m: Method):
    colours = {0: "#7f7f7f", 1: "#9ecae1", 2: "#4292c6", 3: "#2171b5", 4: "#08306b"}
    if m.kind == "bf16":
        return dict(color="#d62728", linestyle="-", linewidth=1.4)
    if m.kind == "int8-row":
        return dict(color="#ff7f0e", linestyle="-", linewidth=1.4)
    style = dict(color=colours[m.rank], linestyle="--" if m.iters == 2 else "-", linewidth=1.4)
    if m.backend != "reference":
        style.update(linestyle=":", linewidth=2.5)
    return style


def plot(result: Result, path: Path) -> bool:
    """Error against tokens, log y: one row per stream, state and output error side by side. False without
    matplotlib."""
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
                ax.plot(result.tokens, result.curve(m.name, s, what).numpy(), label=m.name, **_style(m))
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
            ax.set_title(f"{s} stream: relative {what} error")
            if i == len(streams) - 1:
                ax.set_xlabel("tokens decoded")
    c = result.config
    axes[0, 1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(f"{c['gate'].upper()} decode, K=V={c['head_k']}, L={c['ring']}: error vs exact float64 "
                 f"recurrence (mean of {c['seqs']} seqs x {c['heads']} heads, every {c['every']} tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------------------------------------------
# command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gate", choices=["kda", "gdn"], default="kda",
                   help="kda: per-channel decay (Kimi Delta Attention); gdn: scalar decay (Gated DeltaNet)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument("--heads", type=int, default=4, help="heads per sequence (default 4)")
    p.add_argument("--seqs", type=int, default=2, help="sequences per stream kind (default 2)")
    p.add_argument("--every", type=int, default=16, metavar="M", help="tokens between records (default 16 = L: "
                   "each record falls right after a flush, the checkpoint's error at its freshest)")
    p.add_argument("--streams", default=",".join(STREAMS), help=f"comma list of {STREAMS}")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help="comma list: leapquant-r{0..4}[-iters2][@backend], bf16, int8-row")
    p.add_argument("--backends", default="all", help="comma list of backends to overlay leapquant-r4 with, or "
                   "'all' (every backend that can flush here; on a CPU-only machine that is the reference)")
    p.add_argument("--out", default="simulate_out", help="directory for simulate.json, simulate.png, simulate.md")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated token streams (default 0)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: the tensors are small; on a "
                   "busy 2-core machine 2 threads made pool.append 20-200x slower)")


def main(args) -> int:
    torch.set_num_threads(args.threads)
    methods = [m for m in args.methods.split(",") if m]
    here, skipped = available_backends(args.gate, args.heads, 128, 128, 16)
    if args.backends == "all":
        extra = [b for b in here if b != "reference"]
    else:
        extra = [b for b in args.backends.split(",") if b and b != "reference"]
        missing = [b for b in extra if b not in here]
        if missing:
            why = "; ".join(s for s in skipped if s.split(":")[0] in missing) or "unknown backend"
            raise BackendError(f"cannot run backend(s) {missing}: {why}")
    methods += [f"leapquant-r4@{b}" for b in extra if f"leapquant-r4@{b}" not in methods]
    print(f"backends: {', '.join(['reference'] + extra)}" + (f" (not here: {'; '.join(skipped)})" if skipped else ""))
    c = args
    print(f"{c.gate.upper()}: {c.seqs} seqs x {c.heads} heads x {c.tokens} tokens per stream kind "
          f"({c.streams}), K=V=128, L=16, record every {c.every}; {len(methods)} methods", flush=True)

    def progress(done, secs, res):
        last = {m: float(res.state[m][-1].mean()) for m in ("leapquant-r4", "int8-row") if m in res.state
                and len(res.state[m])}
        tail = "  ".join(f"{m} {e:.2e}" for m, e in last.items())
        print(f"  {done:>6}/{c.tokens} tokens  {secs:6.1f} s  state error now: {tail}", flush=True)

    res = simulate(gate=c.gate, tokens=c.tokens, heads=c.heads, seqs=c.seqs, every=c.every,
                   streams=[s for s in c.streams.split(",") if s], methods=methods, seed=c.seed, progress=progress)
    print()
    print(table(res))
    for line in _overlays(res):
        print(line)
    out = Path(c.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "simulate.json").write_text(json.dumps(to_json(res)) + "\n")
    md = (f"{c.gate.upper()}, {c.seqs} sequences x {c.heads} heads x {c.tokens} tokens per stream kind, K = V = 128, "
          f"L = 16, recorded every {c.every} tokens (right after a flush when M is a multiple of L). "
          "*final*: mean over heads at the last record; *worst*: any head, any record. bytes/head: what the format "
          "keeps per head between tokens (LeapQuant: checkpoint + ring).\n\n" + table(res, markdown=True) + "\n")
    overlays = _overlays(res)
    if overlays:
        md += "\n" + "\n".join(f"* {line}" for line in overlays) + "\n"
    (out / "simulate.md").write_text(md)
    wrote = ["simulate.json", "simulate.md"] + (["simulate.png"] if plot(res, out / "simulate.png") else [])
    print(f"\n{res.seconds:.1f} s; wrote {', '.join(str(out / w) for w in wrote)}"
          + ("" if "simulate.png" in wrote else " (no plot: pip install matplotlib)"))
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m leapquant.simulate", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
