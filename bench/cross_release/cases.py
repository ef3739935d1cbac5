"""``bench.decode``'s step fill 8, packed fill 8 and verify T=4 (without and with the history) at 256 sequences x 32
heads, engine layout: the native launch (the GPU machine's Triton), each release's build with the runtime's
specialisation (keys with the integer arguments), and for the one-token step the ``tl`` kernel that serves releases
outside ``GLUON_RELEASES``: every byte each build writes against the native launch's, and the times beside the floor
(``bench.decode.Timer``: CUDA-graph replays, medians)."""

from __future__ import annotations

import math

import torch

import leapquant
import leapquant_triton.step as ST
from bench import decode as D
from leapquant.pool import History

B, HV, T = 256, 32, 4
CASES = ("step fill 8", "packed fill 8", "verify T=4 (fill 8)", "verify T=4 (fill 8), history")


def _setup(device, gate: str, filled: bool = True):
    """The pool, the rows and every case's call: ``{case: (fn, out, floor bytes)}``. ``filled`` False: the same
    tensors, the pool left empty (for the keys alone)."""
    if filled:
        s = D.setup(device, B, HV, HV, 128, gate)
    else:
        pool = D.make_pool(2 * B + 1, HV, 128, gate, "engine", device)
        q, k, v, g, beta = D._inputs(B, HV, HV, 128, 128, gate, device, torch.Generator().manual_seed(0))
        slots = torch.arange(1, B + 1)
        s = D.Setup(pool, slots, slots.to(torch.int32).to(device), q, k, v, g, beta,
                    torch.empty(B, HV, 128, dtype=torch.bfloat16, device=device), None, HV)
    pool = s.pool
    many = [x[:, None].expand(x.shape[0], T, *x.shape[1:]).contiguous() for x in (s.q, s.k, s.v, s.g, s.beta)]
    out4 = torch.empty(B, T, HV, 128, dtype=torch.bfloat16, device=device)
    gen = torch.Generator().manual_seed(2)
    mixed = torch.cat([x.flatten(1) for x in (s.q, s.k, s.v)], 1)
    kda = gate == "kda"
    a = torch.randn(*((B, HV, 128) if kda else (B, HV)), generator=gen).to(device, torch.bfloat16)
    b = torch.randn(B, HV, generator=gen).to(device, torch.bfloat16)
    A_log = torch.full((HV,), math.log(0.05), device=device)
    dt_bias = torch.zeros(HV * 128 if kda else HV, device=device)
    ws = leapquant.packed_workspace(pool, B)
    backend = "triton"
    one = lambda: leapquant.step(pool, s.idx, s.q, s.k, s.v, s.g, s.beta, out=s.out, check=False,  # noqa: E731
                                 backend=backend)
    packed = lambda: leapquant.step_packed(pool, s.idx, mixed, a, b, A_log=A_log, dt_bias=dt_bias,  # noqa: E731
                                           use_qk_l2norm=True, out=s.out, workspace=ws, check=False,
                                           backend=backend)
    verify = lambda: leapquant.step(pool, s.idx, *many, out=out4, check=False, backend=backend)  # noqa: E731
    calls = {CASES[0]: (one, s.out, B * HV * D.step_bytes(pool, 7, HV, 2, 2)),
             CASES[1]: (packed, s.out, B * HV * D.packed_bytes(pool, 7, HV)),
             CASES[2]: (verify, out4, B * HV * D.verify_bytes(pool, 7, T, HV)),
             CASES[3]: (verify, out4, B * HV * D.verify_bytes(pool, 7, T, HV))}
    return s, pool, calls


def _tensors(pool) -> dict:
    out = {n: getattr(pool, n) for n in ("raw", "kbuf", "ubuf", "w", "pcum", "gbuf", "hcnt")}
    if pool.history is not None:
        out.update({"h" + n: getattr(pool.history, n) for n in ("start", "count", "pcum", "w")})
    return {n: t for n, t in out.items() if t is not None}


def _with_history(pool) -> None:
    object.__setattr__(pool, "history", History(pool, T))  # as Pool(max_tokens=T) keeps it


def capture(device="cpu") -> None:
    """Every case's launches, nothing run (the routing's dry capture)."""
    for gate in ("kda", "gdn"):
        _, pool, calls = _setup(device, gate, filled=False)
        for case in CASES:
            if case.endswith("history"):
                _with_history(pool)
            calls[case][0]()


def compare(a: dict, b: dict) -> str:
    """"same bytes", or per tensor how many elements differ and (floats) the largest difference over the tensor's
    largest magnitude: ulps mislead where ``v - p`` cancels to values near zero (the sweep's criteria hold there)."""
    notes = []
    for n in a:
        x, y = a[n].contiguous(), b[n].contiguous()
        if torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
            continue
        if x.dtype.is_floating_point:
            xf, yf = x.float(), y.float()
            rel = float((xf - yf).abs().max() / xf.abs().max().clamp_min(1e-30))
            notes.append(f"{n}: {int((x != y).sum())} of {x.numel()} differ, by up to {rel:.1e} of its largest")
        else:
            notes.append(f"{n}: {int((x.view(torch.uint8) != y.view(torch.uint8)).sum())} bytes differ")
    return "same bytes" if not notes else "; ".join(notes)


def run(state, releases, timer, device) -> list[dict]:
    rows = []
    for gate in ("kda", "gdn"):
        s, pool, calls = _setup(device, gate)
        base = {n: t.clone() for n, t in _tensors(pool).items()}
        for case in CASES:
            fn, out, nbytes = calls[case]
            for n, t in _tensors(pool).items():
                t.copy_(base[n])
            if case.endswith("history"):
                _with_history(pool)
            saved = {n: t.clone() for n, t in _tensors(pool).items()}

            def restore(pool=pool, saved=saved):
                for n, t in _tensors(pool).items():
                    t.copy_(saved[n])
                D._fills(pool, s.idx.long(), torch.full((B, HV), 7, device=device))

            def one(build: str, release: str | None, call=fn):
                state.release = release
                state.counts.update(routed=0, native=0)
                restore()
                out.fill_(float("nan"))
                call()
                torch.cuda.synchronize()
                routed = state.counts["routed"]
                got = {n: t.clone() for n, t in _tensors(pool).items()}
                got["out"] = out.clone()
                if release is not None and (state.counts["native"] or not routed):
                    state.release = None
                    return got, dict(gate=gate, case=case, build=build, status="no cubin")
                row = timer(f"{gate} {case} {build}", call, restore, nbytes)
                state.release = None
                return got, dict(gate=gate, case=case, build=build, status="ok", median_us=row["median_us"],
                                 floor_us=row["floor_us"])

            ref, row = one("native", None)
            row["bytes"] = "the reference"
            rows.append(row)
            for rel in releases:
                got, row = one(f"Triton {rel}", rel)
                row["bytes"] = compare(ref, got) if row["status"] == "ok" else "-"
                rows.append(row)
            if case == CASES[0]:  # the tl kernel: what a release outside GLUON_RELEASES takes
                tl = lambda: ST.step_pool(pool, s.idx, s.q, s.k, s.v, s.g, s.beta, 128 ** -0.5, False,  # noqa: E731
                                          s.out, kernel="mma")
                _, row = one("tl kernel", None, tl)
                row["bytes"] = "-"
                rows.append(row)
        object.__setattr__(pool, "history", None)
    return rows
