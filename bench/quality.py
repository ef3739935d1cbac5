"""Quality on a trained language model: next-token KL of every recurrent-state format against the exact fp32 state.

    python -m bench.quality                   # on the GPU: trains both models, evaluates, writes bench/results/
    python -m bench.quality --tiny            # the whole path on a CPU in about a minute (tiny model, reference)

For each gate (KDA, GDN) a byte-level model (:mod:`bench.lm`: 4 layers, d_model 512, 4 heads of 128 x 128) is
trained from a fixed seed on the Python standard library's sources (the training split of
:func:`bench.lm.stdlib_corpus`), for a number of steps that fits ``--train-seconds`` (or ``--steps``). Then
``--seqs`` held-out windows are each prefilled over ``--prompt`` bytes by FLA's chunked kernel (as in training: bf16
products, the fp32 state; on a CPU the recurrence in fp32), and decoded teacher-forced for ``--decode`` bytes, one
token per step, every layer's recurrent state kept in one format per batch row:

* ``fp32`` (the reference), ``bf16``, ``fp16``: the update in fp32, the state stored in that dtype after every
  token, the output from the stored state;
* ``int8-row``: int8 codes with one fp32 scale per (head, value row), ``amax / 127``, re-quantised every token;
  ``int8-key``: one scale per (head, key channel), the vLLM pull request's per-(head, channel) layout;
  ``fp8-tile``: e4m3 codes with one fp32 scale per (head, tile of 32 value rows x K), ``amax / 448``, the SGLang
  proposal's tiles;
* ``leapquant-r{R}[-ring{L}][-iters{I}]``: a ``leapquant.Pool`` per layer (compact layout), filled from the prefill
  state by ``pool.load_states`` and decoded by ``leapquant.step`` (Triton on a GPU, the reference on a CPU); rank 0
  is a rank-1 pool whose start matrix is zero, so no compensator is ever written (checked).

Per format, against the fp32 rows of the same batch: the KL divergence ``KL(p_fp32 || p_format)`` of the next-byte
distribution at every position (mean, over the last 1,024 positions, over the first 1,024), top-1 agreement,
perplexity of the true next bytes over fp32's, and the state's bytes per sequence (all layers and heads; the
convolution tails, the same for every format, left out). ``--formats`` and ``--knobs`` choose the formats; the
knobs are LeapQuant variants (rank, ring, iterations) that show which one moves the KL most.

Writes ``quality_<device>.json``, ``.md`` and ``.png`` (KL against position) to ``--out``, after each model.

On a GPU the run first goes through every code path on untrained models (the preflight: two training steps, 40
decoded tokens, every format), which also compiles the kernels: FLA's autotuning is cut to two configurations a
kernel (:func:`bench.lm.limit_fla_autotune`), and the preflight took 57 s and 108 s for KDA in two H200 runs.
``--budget S`` then fits both trainings into S seconds with 50 s held back for each evaluation. FLA (fla-core 0.6)
must be importable.

The committed result, bench/results/quality_h200.{json,md,png}, is ``python -m bench.quality --budget 290`` on one
H200 (its markdown writes the budget as 290.0). That run took about 336 s, not 290: each evaluation took about 64 s
against the 50 s held back, so give an outer timeout room. The budget left 16 s of training for KDA (101 steps, the
warm-up's 100 + 1) and 10 s for GDN (105 steps); ``--gates kda --steps 101`` and ``--gates gdn --steps 105`` (each
with its own ``--out``) train the same schedules without a budget. Its PNG was drawn again from the JSON by
:func:`plot`: the run's outer timeout cut the first file short.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

import leapquant
from leapquant.constants import EPS, QMAX
from leapquant.memory import compact_checkpoint_bytes, ring_bytes
from leapquant.tools.exact import output, recurrent_step

from . import lm

FORMATS = ("fp32", "bf16", "fp16", "leapquant-r4", "leapquant-r0", "int8-row", "int8-key", "fp8-tile")
KNOBS = ("leapquant-r2", "leapquant-r4-iters2", "leapquant-r4-ring8", "leapquant-r4-ring32")
REFERENCE = "fp32"
FP8_TILE = 32  # value rows per fp8 scale
FP8_MAX = 448.0  # e4m3fn's largest finite value
CURVE_WINDOW = 64  # tokens per point of the KL curve
LAST = 1024
_LEAPQUANT = re.compile(r"^leapquant-r([0-4])(?:-ring(8|16|32))?(?:-iters([12]))?$")


# ---------------------------------------------------------------------------------------------------------------------
# the formats


def quantise_int8(S: torch.Tensor, dim: int) -> torch.Tensor:
    """int8 codes, one scale ``amax / 127`` per slice along ``dim`` reduced, rounded half to even; returns the fp32
    values stored."""
    scale = torch.clamp_min(S.abs().amax(dim=dim, keepdim=True) / QMAX, EPS)
    return torch.round(S / scale).clamp(-QMAX, QMAX) * scale


def quantise_fp8_tiles(S: torch.Tensor) -> torch.Tensor:
    """e4m3 codes with one scale ``amax / 448`` per tile of :data:`FP8_TILE` value rows x K of ``S [..., V, K]``."""
    V, K = S.shape[-2:]
    t = S.reshape(*S.shape[:-2], V // FP8_TILE, FP8_TILE * K)
    scale = torch.clamp_min(t.abs().amax(dim=-1, keepdim=True) / FP8_MAX, EPS)
    codes = (t / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (codes.float() * scale).reshape(S.shape)


DENSE: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[int, int], int]]] = {
    # name: (what storing the fp32 state S [..., V, K] keeps, bytes per head at K, V)
    "fp32": (lambda S: S, lambda K, V: 4 * V * K),
    "bf16": (lambda S: S.to(torch.bfloat16).float(), lambda K, V: 2 * V * K),
    "fp16": (lambda S: S.to(torch.float16).float(), lambda K, V: 2 * V * K),
    "int8-row": (lambda S: quantise_int8(S, -1), lambda K, V: V * K + 4 * V),
    "int8-key": (lambda S: quantise_int8(S, -2), lambda K, V: V * K + 4 * K),
    "fp8-tile": (quantise_fp8_tiles, lambda K, V: V * K + 4 * -(-V // FP8_TILE)),
}


@dataclass(frozen=True)
class Format:
    """One way of keeping the state: ``store`` for a dense format (None for LeapQuant), or rank, ring, iterations."""

    name: str
    store: Callable[[torch.Tensor], torch.Tensor] | None = None
    dense_bytes: Callable[[int, int], int] | None = None
    rank: int = 4
    ring: int = 16
    iters: int = 1

    @property
    def dense(self) -> bool:
        return self.store is not None

    @staticmethod
    def parse(name: str) -> "Format":
        if name in DENSE:
            return Format(name, *DENSE[name])
        m = _LEAPQUANT.match(name)
        if m is None:
            raise ValueError(f"unknown format {name!r}: {', '.join(DENSE)} or leapquant-r{{0..4}}[-ring{{8,16,32}}]"
                             "[-iters{1,2}]")
        return Format(name, rank=int(m.group(1)), ring=int(m.group(2) or 16), iters=int(m.group(3) or 1))

    def bytes_per_head(self, K: int, V: int, gate: str) -> int:
        """What the format keeps per (sequence, head) between tokens; LeapQuant: the compact checkpoint (no factors
        at rank 0) and the ring."""
        if self.dense:
            return self.dense_bytes(K, V)
        return compact_checkpoint_bytes(K, V, self.rank) + ring_bytes(K, V, self.ring, gate)


def ordered(formats: Sequence[Format]) -> list[Format]:
    """Dense formats first (one batched update), LeapQuant after; the reference among them."""
    if REFERENCE not in [f.name for f in formats]:
        raise ValueError(f"the formats must include the reference, {REFERENCE!r}")
    if len({f.name for f in formats}) != len(formats):
        raise ValueError("format names must be distinct")
    return [f for f in formats if f.dense] + [f for f in formats if not f.dense]


class Bank:
    """One layer's recurrent state for every row of the batch: row ``f * B + b`` holds sequence ``b`` in format
    ``formats[f]`` (dense formats first). Called with one token per row, it advances every state and returns
    ``o [R, HV, V]``."""

    def __init__(self, formats: list[Format], S0: torch.Tensor, gate: str, backend: str):
        B, HV, K, V = S0.shape
        self.B, self.gate, self.scale = B, gate, K ** -0.5
        self.dense = [f for f in formats if f.dense]
        self.backend = backend
        Sv = S0.transpose(-1, -2).float()  # [B, HV, V, K]
        self.S = torch.cat([f.store(Sv) for f in self.dense]) if self.dense else None
        self.idx = torch.arange(1, B + 1, dtype=torch.int32, device=S0.device)  # slot 0: the null slot
        self.pools = []
        for f in formats:
            if f.dense:
                continue
            q0 = torch.zeros(V, 1) if f.rank == 0 else None
            pool = leapquant.Pool(B + 1, HV, K, V, f.ring, max(f.rank, 1), gate=gate, device=S0.device, q0=q0,
                                  iters=f.iters, layout="compact")
            pool.load_states(self.idx, S0.float().contiguous(), state_v_first=False, backend=backend)
            self.pools.append((f, pool))
        self.first = True

    def __call__(self, q, k, v, g, beta) -> torch.Tensor:
        B, Rd = self.B, len(self.dense) * self.B
        o = torch.empty(q.shape[0], v.shape[1], v.shape[2], dtype=torch.float32, device=q.device)
        if self.dense:
            S = recurrent_step(self.S, k[:Rd], v[:Rd], g[:Rd], beta[:Rd], self.gate)
            for i, f in enumerate(self.dense):
                if f.name != REFERENCE:
                    S[i * B:(i + 1) * B] = f.store(S[i * B:(i + 1) * B])
            self.S = S
            o[:Rd] = output(S, q[:Rd], self.scale)
        for j, (f, pool) in enumerate(self.pools):
            r = slice(Rd + j * B, Rd + (j + 1) * B)
            # check=True reads idx and the tokens on the host: the first token only, then the engine's hot path
            leapquant.step(pool, self.idx, q[r], k[r], v[r], g[r], beta[r], scale=self.scale, out=o[r],
                           backend=self.backend, check=self.first)
        self.first = False
        return o

    def problems(self) -> list[str]:
        """Rank 0 must stay free of compensators (a zero start matrix gives Q = 0 in the subspace iteration)."""
        return [f"{f.name}: a compensator was written from a zero start matrix" for f, pool in self.pools
                if f.rank == 0 and bool(pool.uq.any())]


# ---------------------------------------------------------------------------------------------------------------------
# the evaluation


def evaluate(model: lm.ByteLM, tokens: torch.Tensor, prompt: int, formats: Sequence[Format], *,
             recurrence: Callable, backend: str) -> dict:
    """Prefill ``tokens[:, :prompt]`` once, then decode the rest teacher-forced in every format.

    ``tokens`` int64 ``[B, prompt + D + 1]`` on the model's device. Returns the per-format figures (module
    docstring) and ``per_token``: float64 tensors ``kl``, ``nll`` and bool ``top1``, each ``[F, B, D]`` in the
    order of ``ordered(formats)``.
    """
    fs = ordered(formats)
    device = tokens.device
    B, D = tokens.shape[0], tokens.shape[1] - prompt - 1
    if D < 1:
        raise ValueError("nothing to decode: tokens must be longer than prompt + 1")
    Fn, ref = len(fs), [f.name for f in fs].index(REFERENCE)
    c = model.c
    with torch.no_grad():
        with lm.autocast(device):
            _, states, tails = model(tokens[:, :prompt], recurrence)
            # the same positions by the whole-sequence path (FLA's kernel on a GPU): its perplexity beside the fp32
            # decode's says that the decode continues the prefill's state (layout, gates, scale) as FLA defines it
            whole, _, _ = model(tokens[:, :-1], recurrence)
        whole_nll = F.cross_entropy(whole[:, prompt:].flatten(0, 1).float(), tokens[:, prompt + 1:].flatten())
        del whole
        banks = [Bank(fs, S.float(), c.gate, backend) for S in states]
        tails = [t.float().repeat(Fn, 1, 1) for t in tails]
        kl = torch.empty(Fn, B, D, dtype=torch.float64, device=device)
        nll = torch.empty_like(kl)
        top1 = torch.empty(Fn, B, D, dtype=torch.bool, device=device)
        t0 = time.perf_counter()
        for t in range(D):
            logits = model.step(tokens[:, prompt + t].repeat(Fn), tails, lambda i, *a: banks[i](*a))
            lp = F.log_softmax(logits.double(), dim=-1).view(Fn, B, -1)
            r = lp[ref]
            kl[:, :, t] = (r.exp() * (r - lp)).sum(-1)
            top1[:, :, t] = lp.argmax(-1) == r.argmax(-1)
            nll[:, :, t] = -lp.gather(-1, tokens[:, prompt + t + 1].view(1, B, 1).expand(Fn, B, 1)).squeeze(-1)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
    problems = sorted({p for bank in banks for p in bank.problems()})
    last = min(LAST, D)
    ppl = torch.exp(nll.mean((1, 2)))
    K, V, HV = c.head_k, c.head_v, c.heads
    rows = []
    for i, f in enumerate(fs):
        per_seq = c.layers * HV * f.bytes_per_head(K, V, c.gate)
        curve = kl[i].mean(0)
        n = D // CURVE_WINDOW
        rows.append({
            "format": f.name,
            "bytes_per_sequence": per_seq,
            "bytes_vs_bf16": per_seq / (c.layers * HV * 2 * V * K),
            "mean_kl": float(kl[i].mean()),
            "kl_last_1024": float(kl[i, :, -last:].mean()),
            "kl_first_1024": float(kl[i, :, :last].mean()),
            "kl_p99": float(torch.quantile(kl[i].flatten().float(), 0.99)),
            "top1": float(top1[i].float().mean()),
            "ppl": float(ppl[i]),
            "ppl_ratio": float(ppl[i] / ppl[ref]),
            "kl_curve": ([float(x) for x in curve[:n * CURVE_WINDOW].view(n, CURVE_WINDOW).mean(1)] if n
                         else [float(curve.mean())]),
        })
    return {"seqs": B, "prompt": prompt, "decode": D, "curve_window": CURVE_WINDOW, "decode_seconds": seconds,
            "backend": backend, "whole_sequence_ppl": float(torch.exp(whole_nll)), "problems": problems, "formats": rows,
            "per_token": {"kl": kl.cpu(), "nll": nll.cpu(), "top1": top1.cpu()}}


# ---------------------------------------------------------------------------------------------------------------------
# the run


@dataclass(frozen=True)
class Setup:
    """Sizes of one run: the full one (a GPU) or ``--tiny`` (a CPU)."""

    config: dict
    plan: lm.TrainPlan
    seqs: int
    prompt: int
    decode: int
    max_files: int | None


FULL = Setup(config={}, plan=lm.TrainPlan(), seqs=8, prompt=1024, decode=4096, max_files=None)
TINY = Setup(config=dict(d_model=64, layers=2, heads=2, head_k=64, head_v=64, mlp=128, gate_rank=16),
             plan=lm.TrainPlan(seq=64, batch=4, lr=3e-3, warmup=5, eval_windows=4), seqs=2, prompt=32, decode=64,
             max_files=120)


def versions() -> dict:
    from .timing import module_version, nvidia_smi

    smi = nvidia_smi() if torch.cuda.is_available() else {}
    return {"device": smi.get("name") or (torch.cuda.get_device_name() if torch.cuda.is_available() else
                                          f"CPU ({platform.machine()})"),
            "driver": smi.get("driver"), "python": platform.python_version(), "torch": torch.__version__,
            "triton": module_version("triton"), "fla": module_version("fla"),
            "leapquant": leapquant.__version__}


def preflight(gates: Sequence[str], setup: Setup, corpus: lm.Corpus, formats: Sequence[Format], recurrence,
              backend: str, device, log) -> None:
    """Every code path of the run on an untrained model in seconds (two training steps, 40 decoded tokens, every
    format), so that a mistake costs seconds of the device, not a trained model."""
    for gate in gates:
        model = lm.ByteLM(lm.Config(gate=gate, **setup.config)).to(device)
        model.init_weights(0)
        plan = lm.TrainPlan(**{**setup.plan.__dict__, "batch": 2, "warmup": 1})
        lm.train(model, corpus, plan, recurrence, device, steps=2, log=lambda s: None)
        tokens = lm.windows(corpus.held_out, setup.seqs, 64 + 40 + 1).to(device)
        problems = evaluate(model, tokens, 64, formats, recurrence=recurrence, backend=backend)["problems"]
        if problems:
            raise RuntimeError(f"preflight {gate}: " + "; ".join(problems))
        log(f"preflight {gate}: ok")


def run_gate(gate: str, setup: Setup, corpus: lm.Corpus, formats, recurrence, backend, device, *, steps,
             train_seconds, seed, log) -> dict:
    c = lm.Config(gate=gate, **setup.config)
    plan = lm.TrainPlan(**{**setup.plan.__dict__, "seed": seed})
    model = lm.ByteLM(c).to(device)
    model.init_weights(seed)
    log(f"{gate}: {lm.parameters_count(model):,} parameters; training")
    trained = lm.train(model, corpus, plan, recurrence, device, steps=steps, seconds=train_seconds, log=log)
    loss = lm.held_out_loss(model, corpus, plan, recurrence, device)
    log(f"{gate}: {trained['steps']} steps in {trained['seconds']:.0f} s; held-out loss {loss:.4f} nats/byte")
    tokens = lm.windows(corpus.held_out, setup.seqs, setup.prompt + setup.decode + 1).to(device)
    ev = evaluate(model, tokens, setup.prompt, formats, recurrence=recurrence, backend=backend)
    ev.pop("per_token")
    log(f"{gate}: decoded {setup.seqs} x {ev['decode']} tokens in {ev['decode_seconds']:.0f} s; perplexity "
        f"{ref_ppl(ev):.4f} (fp32 decode), {ev['whole_sequence_ppl']:.4f} (whole-sequence pass)")
    return {"gate": gate, "config": c.__dict__, "parameters": lm.parameters_count(model),
            "train": trained, "held_out_loss": loss, "evaluation": ev}


def target(rows: list[dict]) -> dict | None:
    """The product's target for rank 4: at most bf16's bytes and at most half of bf16's mean KL."""
    by = {r["format"]: r for r in rows}
    if "leapquant-r4" not in by or "bf16" not in by:
        return None
    lq, bf = by["leapquant-r4"], by["bf16"]
    kl_ratio = lq["mean_kl"] / bf["mean_kl"] if bf["mean_kl"] > 0 else math.inf
    bytes_ratio = lq["bytes_per_sequence"] / bf["bytes_per_sequence"]
    return {"kl_vs_bf16": kl_ratio, "bytes_vs_bf16": bytes_ratio, "met": kl_ratio <= 0.5 and bytes_ratio <= 1.0}


def ref_ppl(ev: dict) -> float:
    return next(r["ppl"] for r in ev["formats"] if r["format"] == REFERENCE)


def markdown(doc: dict) -> str:
    v = doc["versions"]
    lines = [f"# Quality on a trained byte-level model ({v['device']})", "",
             f"`{doc['command']}`; {v['device']}, driver {v['driver']}; Python {v['python']}, torch {v['torch']}, "
             f"Triton {v['triton']}, fla {v['fla']}, leapquant {v['leapquant']}; {doc['date_utc']}.", "",
             f"Corpus: {doc['corpus']['name']}; {doc['corpus']['split']}: {doc['corpus']['train_files']:,} files "
             f"({doc['corpus']['train_bytes']:,} bytes) for training, {doc['corpus']['held_out_files']:,} "
             f"({doc['corpus']['held_out_bytes']:,} bytes) held out; sha256 {doc['corpus']['train_sha256'][:16]}... / "
             f"{doc['corpus']['held_out_sha256'][:16]}...", "",
             "| model | parameters | steps | tokens | train s | train loss | held-out loss (nats/byte) | bits/byte "
             "| unigram (nats/byte) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for m in doc["models"]:
        if "error" in m:
            continue
        t = m["train"]
        lines.append(f"| {m['gate'].upper()} | {m['parameters']:,} | {t['steps']:,} | {t['tokens']:,} | "
                     f"{t['seconds']:.0f} | {t['final_train_loss']:.3f} | {m['held_out_loss']:.3f} | "
                     f"{m['held_out_loss'] / math.log(2):.3f} | {doc['unigram_loss']:.3f} |")
    for m in doc["models"]:
        if "error" in m:
            lines += ["", f"## {m['gate'].upper()}: not measured", "", f"`{m['error']}`"]
            continue
        e, c = m["evaluation"], m["config"]
        lines += ["", f"## {m['gate'].upper()}: {e['seqs']} held-out sequences, a {e['prompt']}-byte prompt, "
                      f"{e['decode']} bytes decoded",
                  "", f"{c['layers']} layers x {c['heads']} heads of {c['head_k']} x {c['head_v']}; LeapQuant by "
                      f"the {e['backend']} backend; KL(fp32 || format) of the next-byte distribution, nats. "
                      f"Perplexity of the decoded bytes: {ref_ppl(e):.4f} by the fp32 decode, "
                      f"{e['whole_sequence_ppl']:.4f} by the whole-sequence pass (prefill path, bf16 products on a "
                      "GPU).", "",
                  "| format | bytes / sequence | x bf16 | mean KL | KL, last 1,024 | KL, first 1,024 | top-1 | "
                  "ppl / fp32 |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in e["formats"]:
            lines.append(f"| {r['format']} | {r['bytes_per_sequence']:,} | {r['bytes_vs_bf16']:.3f} | "
                         f"{r['mean_kl']:.3e} | {r['kl_last_1024']:.3e} | {r['kl_first_1024']:.3e} | "
                         f"{100 * r['top1']:.2f} % | {r['ppl_ratio']:.5f} |")
        if e["problems"]:
            lines += ["", "Problems: " + "; ".join(e["problems"]) + "."]
        tg = target(e["formats"])
        if tg:
            lines += ["", f"Target (rank 4 at most bf16's bytes and half its KL): KL {tg['kl_vs_bf16']:.2f}x bf16's, "
                          f"bytes {tg['bytes_vs_bf16']:.3f}x: {'met' if tg['met'] else 'not met'}."]
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in doc["models"] if "error" not in m]
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 5), squeeze=False)
    for ax, m in zip(axes[0], models):
        e = m["evaluation"]
        for r in e["formats"]:
            if r["format"] == REFERENCE:
                continue
            xs = [(i + 0.5) * e["curve_window"] for i in range(len(r["kl_curve"]))]
            knob = r["format"] in KNOBS
            ax.plot(xs, [max(y, 1e-12) for y in r["kl_curve"]], linestyle="--" if knob else "-",
                    linewidth=1 if knob else 1.6, marker="o" if len(xs) < 8 else None, label=r["format"])
        ax.set_yscale("log")
        ax.set_xlabel(f"bytes decoded after a {e['prompt']}-byte prompt")
        ax.set_ylabel("KL(fp32 || format), nats")
        ax.set_title(f"{m['gate'].upper()}: mean over {e['seqs']} sequences and windows of {e['curve_window']} bytes")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(doc: dict, out: Path, slug: str, log) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"quality_{slug}.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / f"quality_{slug}.md").write_text(markdown(doc))
    try:
        plot(doc, out / f"quality_{slug}.png")
    except ImportError as e:  # matplotlib is the bench extra's; the figures are in the JSON either way
        log(f"no plot: {e}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (the whole path in about a minute)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if there is a GPU and not --tiny)")
    p.add_argument("--gates", default="kda,gdn", help="comma list of kda, gdn")
    p.add_argument("--formats", default=",".join(FORMATS), help="comma list (fp32 must be among them)")
    p.add_argument("--knobs", default=",".join(KNOBS), help="LeapQuant variants evaluated beside the formats")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: as many as --train-seconds fit)")
    p.add_argument("--train-seconds", type=float, default=100.0, help="training time per model when --steps is not "
                   "given (default 100)")
    p.add_argument("--budget", type=float, default=None, help="seconds for the whole run: training is cut so that "
                   "the evaluations fit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default=None, help="LeapQuant backend (default triton on a GPU, else reference)")
    p.add_argument("--no-preflight", action="store_true", help="skip the untrained dry run of every code path")
    p.add_argument("--out", default="bench/results", help="where the JSON, markdown and PNG go")


def _command(a: argparse.Namespace) -> str:
    parts = ["python -m bench.quality"]
    for flag, val, default in (("--tiny", a.tiny, False), ("--gates", a.gates, "kda,gdn"),
                               ("--formats", a.formats, ",".join(FORMATS)), ("--knobs", a.knobs, ",".join(KNOBS)),
                               ("--steps", a.steps, None), ("--train-seconds", a.train_seconds, 100.0),
                               ("--budget", a.budget, None), ("--seed", a.seed, 0), ("--backend", a.backend, None)):
        if val != default:
            parts.append(flag if val is True else f"{flag} {val}")
    return " ".join(parts)


def setup_steps(a: argparse.Namespace, setup: Setup) -> int | None:
    """``--steps``, else 40 for ``--tiny`` and a fit to ``--train-seconds`` otherwise."""
    if a.steps is not None:
        return a.steps
    return 40 if setup is TINY else None


EVAL_RESERVE_S = {"cuda": 50.0, "cpu": 30.0}  # seconds an evaluation takes, held back from training by --budget


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.quality", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() and not a.tiny else "cpu"))
    setup = TINY if a.tiny else FULL
    backend = a.backend or ("triton" if device.type == "cuda" else "reference")
    names = [n for n in a.formats.split(",") if n] + [n for n in a.knobs.split(",") if n]
    formats = [Format.parse(n) for n in dict.fromkeys(names)]
    gates = [g for g in a.gates.split(",") if g]
    if device.type == "cuda":
        lm.limit_fla_autotune()
        recurrence = lm.fla_recurrence
        # the reference rows must be fp32 products; training and prefill use bf16 autocast anyway
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    else:
        recurrence = lm.naive_recurrence

    def log(s: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f} s] {s}", flush=True)

    corpus = lm.stdlib_corpus(setup.max_files)
    log(f"corpus: {corpus.meta['files']} files, {corpus.meta['train_bytes']:,} + {corpus.meta['held_out_bytes']:,} "
        "bytes")
    if not a.no_preflight:
        preflight(gates, setup, corpus, formats, recurrence, backend, device, log)
    slug = "cpu_tiny" if a.tiny else (re.sub(r"[^a-z0-9]+", "_", re.sub(r"^nvidia\s+", "", torch.cuda.get_device_name(
        device), flags=re.I).lower()).strip("_") if device.type == "cuda" else "cpu")
    doc = {"what": "next-token KL of recurrent-state formats on trained byte-level models (bench/quality.py)",
           "command": _command(a), "versions": versions(), "corpus": corpus.meta,
           "unigram_loss": lm.unigram_loss(corpus), "models": [],
           "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    rc = 0
    for i, gate in enumerate(gates):
        seconds = a.train_seconds
        if a.budget is not None:
            left = a.budget - (time.perf_counter() - t_start)
            reserve = EVAL_RESERVE_S[device.type] * (len(gates) - i)
            seconds = max(min(seconds, (left - reserve) / (len(gates) - i)), 10.0)
        try:
            doc["models"].append(run_gate(gate, setup, corpus, formats, recurrence, backend, device,
                                          steps=setup_steps(a, setup), train_seconds=seconds, seed=a.seed, log=log))
        except Exception as e:  # the other model's figures are still worth writing
            import traceback

            traceback.print_exc()
            doc["models"].append({"gate": gate, "error": f"{type(e).__name__}: {e}"})
            rc = 1
        write(doc, Path(a.out), slug, log)
    print(markdown(doc))
    log("done")
    return rc


if __name__ == "__main__":
    sys.exit(main())
