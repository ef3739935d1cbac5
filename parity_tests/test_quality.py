"""The quality benchmark's evaluation (bench/quality.py) on a tiny random model, on the CPU, with the reference
backend: the decode path computes the model's own function, an exact copy of the state scores KL 0, a perturbed
state and LeapQuant's state score KL > 0, and the formats count their bytes as leapquant.memory does."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import leapquant
from bench import lm, quality
from leapquant.memory import formats as memory_formats

TINY = dict(d_model=32, layers=2, heads=2, head_k=64, head_v=64, mlp=64, gate_rank=8)
PROMPT, DECODE = 12, 20  # 20 decoded tokens: the ring of 16 fills and is flushed once


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # tensors this small run faster on one thread, and far faster than two on a busy machine
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(gate: str, seed: int = 0) -> lm.ByteLM:
    model = lm.ByteLM(lm.Config(gate=gate, **TINY))
    model.init_weights(seed)
    return model


def _tokens(seed: int, n: int = 2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, PROMPT + DECODE + 1), generator=gen)


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_decode_matches_the_whole_sequence(gate):
    """Prefill, then one token at a time through an fp32 state: the logits of the model run over the whole sequence."""
    model, tokens = _model(gate, 1), _tokens(2)
    with torch.no_grad():
        whole, _, _ = model(tokens[:, :-1])
        _, states, tails = model(tokens[:, :PROMPT])
        banks = [quality.Bank([quality.Format.parse("fp32")], S, gate, "reference") for S in states]
        got = torch.stack([model.step(tokens[:, t], tails, lambda i, *a: banks[i](*a))
                           for t in range(PROMPT, PROMPT + DECODE)], dim=1)
    want = whole[:, PROMPT:]
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_gdn_is_kda_with_one_decay_per_head():
    """What GDN's training on a GPU rests on (bench.lm.fla_recurrence): KDA with the head's decay on every key
    channel is the GDN recurrence."""
    gen = torch.Generator().manual_seed(5)
    B, T, H, K = 2, 6, 2, 64
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(B, T, H, K, generator=gen)
    g = -torch.rand(B, T, H, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    o_gdn, S_gdn = lm.naive_recurrence(q, k, v, g, beta, "gdn")
    o_kda, S_kda = lm.naive_recurrence(q, k, v, g.unsqueeze(-1).expand(B, T, H, K), beta, "kda")
    assert torch.allclose(o_gdn, o_kda, rtol=1e-6, atol=1e-6) and torch.allclose(S_gdn, S_kda, rtol=1e-6, atol=1e-6)


def _copy(S):
    return S.clone()


def _perturbed(S):
    return S * (1 + 2.0 ** -8)


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_kl_zero_for_the_exact_state_positive_for_others(gate):
    fs = [quality.Format.parse("fp32"), quality.Format("copy", _copy, lambda K, V: 4 * V * K),
          quality.Format("perturbed", _perturbed, lambda K, V: 4 * V * K), quality.Format.parse("bf16"),
          quality.Format.parse("leapquant-r4"), quality.Format.parse("leapquant-r0")]
    ev = quality.evaluate(_model(gate), _tokens(3), PROMPT, fs, recurrence=lm.naive_recurrence,
                          backend="reference")
    rows = {r["format"]: r for r in ev["formats"]}
    names = [r["format"] for r in ev["formats"]]
    kl, nll, top1 = (ev["per_token"][n] for n in ("kl", "nll", "top1"))
    assert kl.shape == (len(fs), 2, DECODE) and ev["problems"] == []
    ref, copy = names.index("fp32"), names.index("copy")
    # the reference against itself, and an exact copy in other batch rows: zero, bit for bit
    assert torch.equal(kl[ref], torch.zeros_like(kl[ref]))
    assert torch.equal(kl[copy], torch.zeros_like(kl[copy]))
    assert torch.equal(nll[copy], nll[ref]) and bool(top1[copy].all())
    assert rows["copy"]["mean_kl"] == 0.0 and rows["copy"]["ppl_ratio"] == 1.0 and rows["copy"]["top1"] == 1.0
    # the decode continues the prefill: its fp32 perplexity is the whole-sequence pass's
    assert abs(rows["fp32"]["ppl"] / ev["whole_sequence_ppl"] - 1) < 1e-5
    assert bool(torch.isfinite(kl).all()) and float(kl.min()) >= -1e-12
    for name in ("perturbed", "bf16", "leapquant-r4", "leapquant-r0"):
        assert rows[name]["mean_kl"] > 0, name
        assert math.isfinite(rows[name]["ppl_ratio"]), name
    # a state scaled by 1 + 2^-8 after every token is further off than one rounded to bf16 (8 bits of mantissa)
    assert rows["perturbed"]["mean_kl"] > rows["bf16"]["mean_kl"]


def test_format_bytes():
    K = V = 128
    lq = {f.name: f.per_head(32) for f in memory_formats(heads=32, gate="kda")}
    assert quality.Format.parse("leapquant-r4").bytes_per_head(K, V, "kda") == lq["LeapQuant, compact layout"]
    assert quality.Format.parse("bf16").bytes_per_head(K, V, "kda") == lq["bf16 state"]
    assert quality.Format.parse("fp32").bytes_per_head(K, V, "gdn") == lq["fp32 state"]
    # rank 0 keeps codes and scales only: 128 * 128 + 4 * 128 + 4 * 128, a multiple of 128 bytes
    r0 = quality.Format.parse("leapquant-r0").bytes_per_head(K, V, "gdn")
    assert r0 == 17_408 + leapquant.memory.ring_bytes(K, V, 16, "gdn")
    assert quality.Format.parse("int8-row").bytes_per_head(K, V, "kda") == 16_384 + 512
    assert quality.Format.parse("fp8-tile").bytes_per_head(K, V, "kda") == 16_384 + 16
    with pytest.raises(ValueError):
        quality.Format.parse("leapquant-r5")
    with pytest.raises(ValueError):
        quality.ordered([quality.Format.parse("bf16")])  # no reference


def test_quantisers_keep_their_grids():
    gen = torch.Generator().manual_seed(4)
    S = torch.randn(3, 2, 64, 64, generator=gen) * torch.logspace(-3, 2, 64)  # columns of very different sizes
    for dim in (-1, -2):
        Q = quality.quantise_int8(S, dim)
        scale = S.abs().amax(dim=dim, keepdim=True) / 127
        codes = Q / scale
        assert torch.allclose(codes, codes.round(), atol=1e-3) and codes.abs().max() <= 127 + 1e-3
        assert ((Q - S).abs() <= scale / 2 * (1 + 1e-5)).all()
    F8 = quality.quantise_fp8_tiles(S)
    tiles = S.reshape(3, 2, 2, -1)
    scale = tiles.abs().amax(-1, keepdim=True) / quality.FP8_MAX
    codes = F8.reshape(tiles.shape) / scale
    # every stored value is an e4m3 code times its tile's scale (up to the division's rounding)
    assert torch.allclose(codes.to(torch.float8_e4m3fn).float(), codes, rtol=1e-6, atol=0)
    # e4m3 keeps 3 mantissa bits: within 2^-4 relative of every value not flushed by the tile's scale
    big = S.abs() > scale.repeat_interleave(32 * 64, -1).reshape(S.shape) * 2 ** -6
    assert ((F8 - S).abs()[big] <= S.abs()[big] * 2 ** -4 * (1 + 1e-5)).all()


def test_corpus_split():
    corpus = lm.stdlib_corpus(max_files=30)
    m = corpus.meta
    assert (m["files"], m["held_out_files"], m["train_files"]) == (30, 3, 27)
    # documents joined by one 0 byte each: Python refuses source files that hold one
    assert int((corpus.held_out == 0).sum()) == 2 and int((corpus.train == 0).sum()) == 26
    assert lm.unigram_loss(corpus) > 0


@pytest.mark.slow  # python -m pytest -m slow (CI runs it)
def test_tiny_run_end_to_end(tmp_path):
    """``python -m bench.quality --tiny``: corpus, training, preflight, evaluation, JSON, markdown and plot."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "bench.quality", "--tiny", "--steps", "3", "--out", str(tmp_path)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "quality_cpu_tiny.json").read_text())
    assert [m["gate"] for m in doc["models"]] == ["kda", "gdn"]
    names = list(dict.fromkeys(quality.FORMATS + quality.KNOBS))
    for m in doc["models"]:
        e = m["evaluation"]
        assert m["train"]["steps"] == 3 and e["problems"] == [] and e["decode"] == quality.TINY.decode
        rows = {r["format"]: r for r in e["formats"]}
        assert sorted(rows) == sorted(names)
        assert rows["fp32"]["mean_kl"] == 0.0
        assert all(r["mean_kl"] > 0 for n, r in rows.items() if n != "fp32")
    md = (tmp_path / "quality_cpu_tiny.md").read_text()
    assert "| leapquant-r4 |" in md and "Target (rank 4" in md
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "quality_cpu_tiny.png").stat().st_size > 1000
