"""Prefill in and out, end to end (SPEC §5): FLA's chunked prefill -> ``Pool.load_states`` -> decode with
``leapquant.step`` -> a prefix continued from ``Pool.states``, each against FLA continuing from the exact state.

    python -m leapquant.tools.prefill                     # on the GPU if there is one (FLA's chunk_kda), else the CPU
    python -m leapquant.tools.prefill --gate gdn --prompt 2048 --decode 64

What :func:`round_trip` does, for ``seqs`` sequences of ``heads`` heads:

1. **prefill**: FLA over a prompt of ``prompt`` tokens from a zero state, the final fp32 state ``S0`` in FLA's
   ``[N, HV, K, V]`` layout (on CUDA ``chunk_kda`` / ``chunk_gated_delta_rule``; on a CPU, where those need a GPU,
   FLA's ``naive_recurrent_kda`` / ``naive_recurrent_gated_delta_rule``);
2. **load**: ``pool.load_states(slots, S0, state_v_first=False)``: compressed into checkpoints, rings empty;
3. **decode**: ``decode`` tokens with ``leapquant.step``, against FLA's recurrent step continuing from the exact
   ``S0`` (``fused_recurrent_*``; naive on a CPU) and against the float64 recurrence from ``S0``;
4. **resume**: ``pool.states(slots, state_v_first=False)`` as the initial state of FLA's chunked prefill over
   ``resume`` more tokens (a prompt continuing a cached prefix), against the same from FLA's exact state.

Errors are relative, per (sequence, head), as the decode simulation records them (bench/results/simulate): output
``||o - o_exact|| / ||o_exact||`` per token, state ``||S - S_exact||_F / ||S_exact||_F``; each is reported as the mean
and the worst over heads (and tokens). :func:`failures` judges a result against a fixed per-token bound
(:data:`SIMULATION_OUTPUT_WORST`).
"""

from __future__ import annotations

import json
import sys
import time

import torch

from .cli import parser
from .exact import exact_recurrence, relative_error
from .streams import STREAMS, decode_stream

# The bound a round trip's decode and resumed outputs are held to, per token and (sequence, head), per stream. It was
# set from the decode simulation's per-token worst output error (KDA, rank 4, ring 16, 2,048 tokens, any head at every
# 16th token) and stays a fixed acceptance bound: it is no current figure of the simulation, whose results
# (bench/results/simulate/simulate.md) are means over windows of 16 tokens, a smaller statistic, and are not quoted
# here so that they cannot go stale
SIMULATION_OUTPUT_WORST = {"synthetic": 1.87e-2, "structured": 7.84e-3}


def fla_functions(device: torch.device, gate: str) -> dict:
    """FLA's ``chunk`` (prefill and resume) and ``recurrent`` (the exact decode continuation) for ``gate``, each called
    as ``fn(q, k, v, g, beta, initial_state=..., output_final_state=True) -> (o, state)`` with ``[B, T, H, ...]``
    inputs and ``[B, HV, K, V]`` states. FLA's chunked and fused kernels are Triton kernels for a GPU; on a CPU both
    are FLA's naive recurrences."""
    if gate == "kda":
        from fla.ops.kda import naive

        if device.type == "cuda":
            from fla.ops.kda import chunk_kda, fused_recurrent_kda

            return {"chunk": chunk_kda, "recurrent": fused_recurrent_kda, "names": ("chunk_kda", "fused_recurrent_kda")}
        return {"chunk": naive.naive_recurrent_kda, "recurrent": naive.naive_recurrent_kda,
                "names": ("naive_recurrent_kda", "naive_recurrent_kda")}
    from fla.ops.gated_delta_rule import naive as gnaive

    if device.type == "cuda":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

        return {"chunk": chunk_gated_delta_rule, "recurrent": fused_recurrent_gated_delta_rule,
                "names": ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")}

    def naive_gdn(q, k, v, g, beta, initial_state=None, output_final_state=False):
        return gnaive.naive_recurrent_gated_delta_rule(q, k, v, beta, g, initial_state=initial_state,
                                                       output_final_state=output_final_state)

    return {"chunk": naive_gdn, "recurrent": naive_gdn,
            "names": ("naive_recurrent_gated_delta_rule", "naive_recurrent_gated_delta_rule")}


def token_inputs(seqs: int, heads: int, head_k: int, head_v: int, tokens: int, gate: str, stream: str,
                 gen: torch.Generator) -> dict:
    """``q, k, v, g, beta``, each ``[seqs, tokens, heads, ...]`` fp32 on the CPU (FLA's ``[B, T, H, ...]``): the
    decode simulation's token streams (:func:`leapquant.tools.streams.decode_stream`)."""
    x = decode_stream(stream, seqs, heads, head_k, head_v, tokens, gate, gen)
    return {n: x[n].transpose(0, 1).contiguous() for n in ("q", "k", "v", "g", "beta")}


def _span(x: dict, a: int, b: int) -> dict:
    return {n: t[:, a:b].contiguous() for n, t in x.items()}


def _exact(S0: torch.Tensor, x: dict, gate: str, scale: float) -> torch.Tensor:
    """Outputs ``[B, T, HV, V]`` of the gated delta rule from ``S0 [B, HV, K, V]`` (FLA's layout) in float64."""
    tokens_first = {n: x[n].transpose(0, 1) for n in ("q", "k", "v", "g", "beta")}
    o, _ = exact_recurrence(**tokens_first, gate=gate, state=S0.transpose(-1, -2), scale=scale)
    return o.transpose(0, 1)


def _stats(e: torch.Tensor) -> dict:
    return {"mean": float(e.mean()), "worst": float(e.max())}


def round_trip(device: str | torch.device = "cpu", *, gate: str = "kda", seqs: int = 2, heads: int = 4,
               head_k: int = 128, head_v: int = 128, prompt: int = 256, decode: int = 32, resume: int = 64,
               stream: str = "synthetic", backend: str = "auto", seed: int = 0,
               dtype: torch.dtype = torch.float32) -> dict:
    """The round trip of the module's docstring; returns its figures (a JSON-able dict).

    ``backend`` serves ``load_states``, ``states`` and ``step`` (``"auto"``: Triton on CUDA, else the reference). On
    CUDA FLA's Triton kernels run the prefill, the exact continuation and the resume; on a CPU its naive recurrences.
    ``dtype``: of the token inputs (q, k, v, g, beta) every path takes, FLA, ``leapquant.step`` and the float64
    recurrence alike; states are fp32 throughout.
    """
    import leapquant


    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    B, HV, K, V = seqs, heads, head_k, head_v
    x = {n: t.to(device, dtype) for n, t in token_inputs(B, HV, K, V, prompt + decode + resume, gate, stream,
                                                          gen).items()}
    fla = fla_functions(device, gate)
    scale = K ** -0.5
    times = {}

    def timed(name, fn, *args, **kw):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        r = fn(*args, **kw)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times[name] = time.perf_counter() - t0
        return r

    def run(fn, span, state):  # by keyword: fused_recurrent_gated_delta_rule's fifth parameter is gk, not beta
        return fn(**span, initial_state=state, output_final_state=True)

    # 1. prefill
    _, S0 = timed("prefill", run, fla["chunk"], _span(x, 0, prompt), None)
    S0 = S0.float().contiguous()
    # 2. load
    pool = leapquant.Pool(B + 1, HV, K, V, gate=gate, device=device)  # slot 0: vLLM's null slot
    idx = torch.arange(1, B + 1, dtype=torch.int32, device=device)
    timed("load_states", pool.load_states, idx, S0, state_v_first=False, backend=backend, check=False)
    loaded = pool.states(idx, state_v_first=False, backend=backend)
    # 3. decode
    dec = _span(x, prompt, prompt + decode)
    outs = []
    t0 = time.perf_counter()
    for t in range(decode):
        o = leapquant.step(pool, idx, *(dec[n][:, t] for n in ("q", "k", "v", "g", "beta")), scale=scale,
                           backend=backend, check=t == 0)
        outs.append(o.clone())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times["decode"] = time.perf_counter() - t0
    o_lq = torch.stack(outs, dim=1)  # [B, T, HV, V]
    o_fla, S1 = run(fla["recurrent"], dec, S0.clone())
    o_64 = _exact(S0, dec, gate, scale)
    # 4. resume from the pool's state
    res = _span(x, prompt + decode, prompt + decode + resume)
    S_lq = timed("states", pool.states, idx, state_v_first=False, backend=backend, check=False)
    o_res_lq, _ = run(fla["chunk"], res, S_lq.clone())
    o_res_fla, _ = run(fla["chunk"], res, S1.float().contiguous())

    per_token = relative_error(o_lq, o_fla, (-1,))  # [B, T, HV]
    return {
        "what": "prefill round trip (leapquant/tools/prefill.py)",
        "config": dict(device=str(device), gate=gate, seqs=B, heads=HV, head_k=K, head_v=V, prompt=prompt,
                       decode=decode, resume=resume, stream=stream, seed=seed, dtype=str(dtype).split(".")[-1],
                       backend=leapquant.select(pool, backend, op="states").name,
                       step_backend=leapquant.select(pool, backend, op="step").name, fla=list(fla["names"])),
        "load_state_error": _stats(relative_error(loaded, S0, (-2, -1))),
        "decode_output_error": _stats(per_token),
        "decode_output_error_last": _stats(per_token[:, -1]),
        "decode_output_error_first": _stats(per_token[:, 0]),
        "fla_vs_float64_output_error": _stats(relative_error(o_fla, o_64, (-1,))),
        "leapquant_vs_float64_output_error": _stats(relative_error(o_lq, o_64, (-1,))),
        "state_error_after_decode": _stats(relative_error(S_lq, S1, (-2, -1))),
        "resume_output_error": _stats(relative_error(o_res_lq, o_res_fla, (-1,))),
        "finite": bool(torch.isfinite(o_lq).all() and torch.isfinite(S_lq).all() and torch.isfinite(o_res_lq).all()),
        "seconds": times,
    }


def failures(result: dict) -> list[str]:
    """What a :func:`round_trip` result gets wrong: non-finite values, or decode or resume outputs further from FLA's
    exact continuation than the per-token bound for that stream (:data:`SIMULATION_OUTPUT_WORST`)."""
    bound = SIMULATION_OUTPUT_WORST[result["config"]["stream"]]
    out = []
    if not result["finite"]:
        out.append("non-finite outputs or states")
    for key in ("decode_output_error", "resume_output_error"):
        worst = result[key]["worst"]
        if not worst <= bound:  # NaN fails too
            out.append(f"{key} worst {worst:.3e} > {bound:.3e} (the per-token bound)")
    return out


def table(result: dict) -> str:
    c = result["config"]
    lines = [f"{c['gate'].upper()}, {c['seqs']} sequences x {c['heads']} heads, K = {c['head_k']}, V = {c['head_v']}, "
             f"{c['stream']} stream on {c['device']}: prompt {c['prompt']} tokens ({c['fla'][0]}), "
             f"load_states / states by {c['backend']}, {c['decode']} tokens by leapquant.step ({c['step_backend']}) "
             f"against {c['fla'][1]} from the exact state, resume {c['resume']} tokens ({c['fla'][0]}).",
             "", f"{'relative error, per (sequence, head)':<52} {'mean':>10} {'worst':>10}"]
    for key, label in (("load_state_error", "state after load_states vs FLA's prefill state"),
                       ("decode_output_error_first", "decode output, first token"),
                       ("decode_output_error", "decode output, every token"),
                       ("decode_output_error_last", "decode output, last token"),
                       ("leapquant_vs_float64_output_error", "decode output vs float64 recurrence"),
                       ("fla_vs_float64_output_error", "FLA's own decode output vs float64"),
                       ("state_error_after_decode", "pool.states after decode vs FLA's state"),
                       ("resume_output_error", "resumed prefill output from pool.states")):
        lines.append(f"{label:<52} {result[key]['mean']:10.3e} {result[key]['worst']:10.3e}")
    bound = SIMULATION_OUTPUT_WORST[c["stream"]]
    bad = failures(result)
    lines += ["", f"bound per token ({c['stream']} stream, SIMULATION_OUTPUT_WORST): {bound:.2e}: "
              + ("PASS" if not bad else "FAIL: " + "; ".join(bad))]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = parser("python -m leapquant.tools.prefill", __doc__)
    ap.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if there is a GPU, else cpu)")
    ap.add_argument("--gate", choices=["kda", "gdn"], default="kda", help="kda (chunk_kda) or gdn")
    ap.add_argument("--seqs", type=int, default=None, help="sequences (default 2 on a CPU, 8 on a GPU)")
    ap.add_argument("--heads", type=int, default=None, help="heads per sequence (default 4 on a CPU, 32 on a GPU)")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 256 on a CPU, 4096 on a GPU)")
    ap.add_argument("--decode", type=int, default=32, help="decoded tokens (default 32: two flushes)")
    ap.add_argument("--resume", type=int, default=64, help="tokens of the resumed prefill (default 64)")
    ap.add_argument("--stream", choices=STREAMS, default="synthetic",
                    help="token stream of the decode simulation (default synthetic)")
    ap.add_argument("--backend", default="auto", help="backend of load_states, states and step (default auto)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the token stream")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="dtype of the token inputs of every path (default float32)")
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")
    a = ap.parse_args(argv)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = device.type == "cuda"
    r = round_trip(device, gate=a.gate, seqs=a.seqs or (8 if gpu else 2), heads=a.heads or (32 if gpu else 4),
                   prompt=a.prompt or (4096 if gpu else 256), decode=a.decode, resume=a.resume, stream=a.stream,
                   backend=a.backend, seed=a.seed, dtype=getattr(torch, a.dtype))
    print(table(r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0 if not failures(r) else 1


if __name__ == "__main__":
    sys.exit(main())
