"""A small byte-level language model with KDA or Gated DeltaNet layers, its corpus and its training: what the
quality benchmark (bench/quality.py) decodes.

Plain torch around the recurrence. The recurrence runs through FLA's chunked kernels on a GPU (``chunk_kda``,
``chunk_gated_delta_rule``: training and prefill; :func:`fla_recurrence` says why GDN trains through ``chunk_kda``)
or written out token by token on a CPU (:func:`leapquant.tools.exact.recurrent_step`); :meth:`ByteLM.step` decodes one token per row and leaves the
recurrent state to its caller, which keeps it in the format under test.

One layer, pre-norm, ``h = rms(x)``::

    q, k, v = silu(conv4(W_qkv h))          causal depthwise convolution over 4 tokens; q, k L2-normalised per head
    beta = sigmoid(W_b h)                    [HV]
    g = -5 sigmoid(W_g h + dt_bias)          log decay, [HV, K] (KDA, W_g of rank 128) or [HV] (GDN)
    o = recurrence(q, k, v, g, beta)         o_t = K^-1/2 S_t q_t, S the [V, K] state of each head
    x = x + W_o(rms_head(o) * sigmoid(W_z h))
    x = x + W_down(silu(W_gate h') * W_up h'),  h' = rms(x)

The bound ``g > -5`` keeps 16 tokens' decay inside fp32's exponent, which FLA's KDA kernel needs within a sub-chunk
(its ``safe_gate`` range).

Corpus (:func:`stdlib_corpus`): the ``.py`` files of the running Python's standard library
(``sysconfig.get_paths()["stdlib"]``, no ``site-packages``), sorted by relative path; every 10th file (indices 9,
19, ...) is held out. Files are joined by a 0 byte, which no source file holds, as the document separator.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from leapquant.tools.exact import output, recurrent_step

GATE_FLOOR = -5.0  # the log decay's lower bound per token
HELD_OUT_EVERY = 10


@dataclass(frozen=True)
class Config:
    gate: str = "kda"
    vocab: int = 256
    d_model: int = 512
    layers: int = 4
    heads: int = 4
    head_k: int = 128
    head_v: int = 128
    mlp: int = 1536
    conv: int = 4
    gate_rank: int = 128  # KDA's low-rank decay projection

    @property
    def qk_dim(self) -> int:
        return self.heads * self.head_k

    @property
    def v_dim(self) -> int:
        return self.heads * self.head_v


# ---------------------------------------------------------------------------------------------------------------------
# the corpus


@dataclass
class Corpus:
    """Byte streams of the two splits, documents joined by 0 bytes, and what names them."""

    train: torch.Tensor  # uint8 [N]
    held_out: torch.Tensor  # uint8 [M]
    meta: dict


def stdlib_corpus(max_files: int | None = None) -> Corpus:
    """The standard library's ``.py`` sources of this Python, split as the module docstring says. ``max_files``
    takes the first files of the sorted list only (tiny CPU runs)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for here, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in ("site-packages", "dist-packages")]
        found += [Path(here, n) for n in names if n.endswith(".py") and Path(here, n).is_file()]
    files = sorted(found, key=lambda p: p.relative_to(root).as_posix())
    if max_files is not None:
        files = files[:max_files]
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    for i, p in enumerate(files):
        parts[i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1].append(p.read_bytes())
    streams = {k: b"\0".join(v) for k, v in parts.items()}
    meta = {
        "name": f"Python {sys.version.split()[0]} standard library, *.py under {root} (site-packages excluded)",
        "split": f"files sorted by relative path; index % {HELD_OUT_EVERY} == {HELD_OUT_EVERY - 1} held out; "
                 "documents joined by a 0 byte",
        "files": len(files), "train_files": len(parts[False]), "held_out_files": len(parts[True]),
        "train_bytes": len(streams[False]), "held_out_bytes": len(streams[True]),
        "train_sha256": hashlib.sha256(streams[False]).hexdigest(),
        "held_out_sha256": hashlib.sha256(streams[True]).hexdigest(),
    }

    def tensor(b: bytes) -> torch.Tensor:
        return torch.frombuffer(bytearray(b), dtype=torch.uint8)

    return Corpus(tensor(streams[False]), tensor(streams[True]), meta)


def unigram_loss(corpus: Corpus) -> float:
    """Cross-entropy (nats per byte) of the held-out split under the training split's byte frequencies (add-one)."""
    q = torch.bincount(corpus.train.long(), minlength=256).double() + 1
    p = torch.bincount(corpus.held_out.long(), minlength=256).double()
    return float(-(p / p.sum() * torch.log(q / q.sum())).sum())


def windows(stream: torch.Tensor, n: int, length: int) -> torch.Tensor:
    """``n`` windows of ``length`` bytes, evenly spaced over ``stream`` (int64 ``[n, length]``)."""
    if stream.numel() < length:
        raise ValueError(f"a stream of {stream.numel()} bytes holds no window of {length}")
    span = stream.numel() - length
    starts = [span * i // max(n - 1, 1) for i in range(n)]
    return torch.stack([stream[s:s + length] for s in starts]).long()


# ---------------------------------------------------------------------------------------------------------------------
# the recurrence


def naive_recurrence(q, k, v, g, beta, gate: str, state: torch.Tensor | None = None):
    """The gated delta rule token by token in the inputs' dtype: inputs ``[B, T, H, ...]`` as FLA takes them,
    ``state`` ``[B, HV, K, V]`` (FLA's layout). Returns ``(o [B, T, HV, V], S [B, HV, K, V])``."""
    B, T, HV, V = v.shape
    K = k.shape[-1]
    S = (torch.zeros(B, HV, V, K, dtype=v.dtype, device=v.device) if state is None
         else state.transpose(-1, -2).to(v.dtype))
    out = []
    for t in range(T):
        S = recurrent_step(S, k[:, t], v[:, t], g[:, t], beta[:, t], gate)
        out.append(output(S, q[:, t], K ** -0.5))
    return torch.stack(out, dim=1), S.transpose(-1, -2)


def fla_recurrence(q, k, v, g, beta, gate: str, state: torch.Tensor | None = None):
    """FLA's chunked kernel (a GPU); same contract as :func:`naive_recurrence`, the state fp32.

    GDN under autograd runs as KDA with the head's decay on every key channel, the same recurrence: FLA 0.6 refuses
    ``chunk_gated_delta_rule``'s backward under Triton 3.4-3.7.0 on Hopper (a kernel those releases miscompile, its
    issue 640), and the device's Triton is 3.6. Without autograd (prefill, evaluation) GDN takes its own kernel."""
    if gate == "gdn" and torch.is_grad_enabled():
        gate, g = "kda", g.unsqueeze(-1).expand(*g.shape, k.shape[-1]).contiguous()
    if gate == "kda":
        from fla.ops.kda import chunk_kda as chunk
    else:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as chunk
    # by keyword: the two functions' parameter lists differ past beta
    return chunk(q=q, k=k, v=v, g=g, beta=beta, initial_state=state, output_final_state=True)


def limit_fla_autotune(keep: int = 2) -> int:
    """Cut every loaded FLA autotuner to ``keep`` configurations (4 warps and 2 stages first); returns how many were
    cut. FLA tunes each kernel over up to 36 configurations, compiling each: about 200 compiles for KDA's training
    kernels, minutes of a device budget that buys the figures nothing (a configuration changes speed, not what is
    computed). Two rather than one so that a configuration that does not fit the GPU leaves another."""
    from triton.runtime.autotuner import Autotuner

    import fla.ops.gated_delta_rule  # noqa: F401  (the kernels' modules, loaded before they are cut)
    import fla.ops.kda  # noqa: F401

    cut, seen = 0, set()
    for name, mod in list(sys.modules.items()):
        if not name.startswith("fla.") or mod is None:
            continue
        for obj in list(vars(mod).values()):
            for _ in range(4):  # heuristics wrap autotuners: follow .fn
                if isinstance(obj, Autotuner):
                    if id(obj) not in seen and len(obj.configs) > keep:
                        order = sorted(range(len(obj.configs)),
                                       key=lambda i: (abs(obj.configs[i].num_warps - 4),
                                                      abs(obj.configs[i].num_stages - 2), i))
                        obj.configs = [obj.configs[i] for i in sorted(order[:keep])]
                        cut += 1
                    seen.add(id(obj))
                    break
                obj = getattr(obj, "fn", None)
                if obj is None:
                    break
    return cut


# ---------------------------------------------------------------------------------------------------------------------
# the model


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    # FLA's use_qk_l2norm_in_kernel and leapquant.step's use_qk_l2norm: x / sqrt(sum x^2 + 1e-6)
    return x * torch.rsqrt((x.float() * x.float()).sum(-1, keepdim=True) + 1e-6).to(x.dtype)


class Mixer(nn.Module):
    """The recurrent half of a layer (module docstring)."""

    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        inner = 2 * c.qk_dim + c.v_dim
        self.w_qkv = nn.Linear(c.d_model, inner, bias=False)
        self.conv = nn.Parameter(torch.empty(inner, c.conv))
        self.w_b = nn.Linear(c.d_model, c.heads, bias=False)
        if c.gate == "kda":
            self.w_g = nn.Sequential(nn.Linear(c.d_model, c.gate_rank, bias=False),
                                     nn.Linear(c.gate_rank, c.heads * c.head_k, bias=False))
            self.dt_bias = nn.Parameter(torch.empty(c.heads * c.head_k))
        else:
            self.w_g = nn.Linear(c.d_model, c.heads, bias=False)
            self.dt_bias = nn.Parameter(torch.empty(c.heads))
        self.w_z = nn.Linear(c.d_model, c.v_dim, bias=False)
        self.o_norm = nn.Parameter(torch.ones(c.head_v))
        self.w_o = nn.Linear(c.v_dim, c.d_model, bias=False)

    def gates(self, h: torch.Tensor):
        """``beta [..., HV]`` and the log decay ``g`` (``[..., HV, K]`` KDA, ``[..., HV]`` GDN), fp32."""
        c = self.c
        beta = torch.sigmoid(self.w_b(h).float())
        z = self.w_g(h).float() + self.dt_bias
        g = GATE_FLOOR * torch.sigmoid(z)
        if c.gate == "kda":
            g = g.unflatten(-1, (c.heads, c.head_k))
        return g, beta

    def heads(self, u: torch.Tensor):
        """Convolved projections ``u [..., inner]`` -> ``q, k [..., H, K]`` (normalised), ``v [..., HV, V]``."""
        c = self.c
        q, k, v = F.silu(u).split([c.qk_dim, c.qk_dim, c.v_dim], dim=-1)
        q = _l2norm(q.unflatten(-1, (c.heads, c.head_k)))
        k = _l2norm(k.unflatten(-1, (c.heads, c.head_k)))
        return q, k, v.unflatten(-1, (c.heads, c.head_v))

    def out(self, o: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        o = F.rms_norm(o, (self.c.head_v,), self.o_norm, eps=1e-6).flatten(-2)
        return self.w_o(o * torch.sigmoid(self.w_z(h)))

    def forward(self, h: torch.Tensor, recurrence: Callable):
        """Whole sequences ``h [B, T, D]``; returns ``(y, S [B, HV, K, V], conv state [B, conv-1, inner])``."""
        c = self.c
        T = h.shape[1]
        u = self.w_qkv(h)  # [B, T, inner]
        conv = F.conv1d(u.transpose(1, 2), self.conv.to(u.dtype).unsqueeze(1), padding=c.conv - 1,
                        groups=u.shape[-1])[..., :T].transpose(1, 2)
        q, k, v = self.heads(conv)
        g, beta = self.gates(h)
        o, S = recurrence(q, k, v, g, beta.to(q.dtype), c.gate)
        tail = F.pad(u, (0, 0, max(c.conv - 1 - T, 0), 0))[:, -(c.conv - 1):]
        return self.out(o.to(h.dtype), h), S, tail

    def step(self, h: torch.Tensor, tail: torch.Tensor, mix: Callable):
        """One token per row, ``h [R, D]``, ``tail [R, conv-1, inner]`` (updated in place); ``mix(q, k, v, g, beta)``
        returns ``o [R, HV, V]``."""
        u = self.w_qkv(h)
        window = torch.cat([tail, u.unsqueeze(1)], dim=1)  # [R, conv, inner]
        conv = torch.einsum("rji,ij->ri", window, self.conv)
        tail.copy_(window[:, 1:])
        q, k, v = self.heads(conv)
        g, beta = self.gates(h)
        return self.out(mix(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous()), h)


class Block(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.norm1 = nn.Parameter(torch.ones(c.d_model))
        self.mixer = Mixer(c)
        self.norm2 = nn.Parameter(torch.ones(c.d_model))
        self.w_gate = nn.Linear(c.d_model, c.mlp, bias=False)
        self.w_up = nn.Linear(c.d_model, c.mlp, bias=False)
        self.w_down = nn.Linear(c.mlp, c.d_model, bias=False)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        h = F.rms_norm(x, x.shape[-1:], self.norm2, eps=1e-6)
        return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


class ByteLM(nn.Module):
    """Embedding, ``layers`` blocks, a final norm and an untied head over 256 bytes."""

    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c.vocab, c.d_model)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = nn.Parameter(torch.ones(c.d_model))
        self.head = nn.Linear(c.d_model, c.vocab, bias=False)

    def init_weights(self, seed: int) -> None:
        """Seeded initialisation (the same weights on every machine for one seed): linear layers N(0, 0.02), the
        residual outputs scaled by (2 layers)^-1/2, the decays spread log-uniformly over memory lengths of about 2 to
        8,000 tokens."""
        gen = torch.Generator().manual_seed(seed)
        c = self.c
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("dt_bias"):
                    p.copy_(-9 + 7 * torch.rand(p.shape, generator=gen))
                elif name.endswith("conv"):
                    p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) / math.sqrt(c.conv))
                elif "norm" in name.split(".")[-1]:
                    p.fill_(1.0)
                else:
                    std = 0.02 / math.sqrt(2 * c.layers) if name.endswith(("w_o.weight", "w_down.weight")) else 0.02
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    def forward(self, tokens: torch.Tensor, recurrence: Callable = naive_recurrence):
        """Logits ``[B, T, vocab]`` (fp32) of whole sequences, with each layer's final state ``[B, HV, K, V]`` and
        convolution tail: ``(logits, states, tails)``."""
        x = self.embed(tokens)
        states, tails = [], []
        for blk in self.blocks:
            y, S, tail = blk.mixer(F.rms_norm(x, x.shape[-1:], blk.norm1, eps=1e-6), recurrence)
            x = blk.mlp(x + y)
            states.append(S)
            tails.append(tail)
        return self.head(F.rms_norm(x, x.shape[-1:], self.norm, eps=1e-6)).float(), states, tails

    def step(self, tokens: torch.Tensor, tails: list[torch.Tensor], mix: Callable) -> torch.Tensor:
        """Logits ``[R, vocab]`` for one token per row; ``mix(layer, q, k, v, g, beta) -> o [R, HV, V]`` keeps the
        recurrent state; ``tails`` (each ``[R, conv-1, inner]``) advance in place."""
        x = self.embed(tokens)
        for i, blk in enumerate(self.blocks):
            h = F.rms_norm(x, x.shape[-1:], blk.norm1, eps=1e-6)
            x = blk.mlp(x + blk.mixer.step(h, tails[i], lambda *a, i=i: mix(i, *a)))
        return self.head(F.rms_norm(x, x.shape[-1:], self.norm, eps=1e-6))


def parameters_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------------------------------
# training


@dataclass(frozen=True)
class TrainPlan:
    seq: int = 2048
    batch: int = 32
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.1
    seed: int = 0
    eval_windows: int = 64


def _lr(step: int, total: int, plan: TrainPlan) -> float:
    if step < plan.warmup:
        return plan.lr * (step + 1) / plan.warmup
    frac = (step - plan.warmup) / max(total - plan.warmup, 1)
    return plan.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(frac, 1.0))))


def autocast(device: torch.device):
    """bf16 matrix products on a GPU (training and prefill); nothing on a CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def held_out_loss(model: ByteLM, corpus: Corpus, plan: TrainPlan, recurrence: Callable, device) -> float:
    """Mean next-byte cross-entropy (nats) over ``plan.eval_windows`` evenly spaced held-out windows."""
    w = windows(corpus.held_out, plan.eval_windows, plan.seq + 1).to(device)
    total, count = 0.0, 0
    with torch.no_grad(), autocast(device):
        for chunk in w.split(8):
            logits, _, _ = model(chunk[:, :-1], recurrence)
            total += float(F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum"))
            count += chunk[:, 1:].numel()
    return total / count


def train(model: ByteLM, corpus: Corpus, plan: TrainPlan, recurrence: Callable, device, *, steps: int | None,
          seconds: float | None = None, log: Callable[[str], None] = print) -> dict:
    """AdamW on random training windows drawn from a generator seeded by ``plan.seed``: ``steps`` steps, or, with
    ``steps=None``, as many as fit ``seconds`` (fixed after 30 steps from their pace; the result names the count, and
    ``steps=`` that count replays the run). Warm-up then cosine decay to a tenth."""
    gen = torch.Generator().manual_seed(plan.seed + 1)
    data = corpus.train.to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n]
    other = [p for n, p in model.named_parameters() if not (p.dim() == 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": plan.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=plan.lr, betas=(0.9, 0.95), eps=1e-8)
    total = steps if steps is not None else 10**9
    t0 = time.perf_counter()
    losses = []
    span = torch.arange(plan.seq + 1, device=device)
    mark = None
    step = 0
    while step < total:
        if steps is None and step == 10:
            if device.type == "cuda":
                torch.cuda.synchronize()
            mark = time.perf_counter()
        if steps is None and step == 30:
            if device.type == "cuda":
                torch.cuda.synchronize()
            pace = (time.perf_counter() - mark) / 20
            left = (seconds or 0) - (time.perf_counter() - t0)
            total = max(30 + int(left / pace), plan.warmup + 1)
            log(f"  {pace * 1e3:.1f} ms a step: {total} steps fit {seconds:.0f} s")
        for group in opt.param_groups:
            group["lr"] = _lr(step, total, plan)
        starts = torch.randint(0, data.numel() - plan.seq - 1, (plan.batch,), generator=gen).to(device)
        batch = data[starts[:, None] + span].long()
        with autocast(device):
            logits, _, _ = model(batch[:, :-1], recurrence)
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.detach())
        step += 1
        if step % 200 == 0 or step == total:
            log(f"  step {step}/{total}: loss {loss.item():.4f} ({time.perf_counter() - t0:.0f} s)")
    if device.type == "cuda":
        torch.cuda.synchronize()
    last = torch.stack(losses[-50:]).float().mean()
    return {"steps": step, "tokens": step * plan.batch * plan.seq, "seconds": time.perf_counter() - t0,
            "final_train_loss": float(last), "plan": asdict(plan)}
