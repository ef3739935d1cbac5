"""How to put LeapQuant in an engine: a continuous-batching decode loop over a slot pool.

    python examples/serving_loop.py            # the CPU (reference backend) or a GPU (auto), a few seconds

What an engine does with a linear-attention layer's recurrent state, and the LeapQuant call for each:

* **a request arrives**: it gets a free slot; its prompt is prefilled exactly elsewhere (FLA's chunked kernels in a
  real engine; here the float64 recurrence) and the final state enters the pool with ``pool.load_states``;
* **a prefix is reused**: a request that starts with a cached prefix copies the cache slot into its own
  (``pool.copy_slots``) instead of prefilling it; the cache slot was made from the first request's state after
  ``leapquant.flush(..., force=True)``, so that the checkpoint alone holds it;
* **decode**: every running request gets one token per iteration, ``leapquant.step`` over the batch's slots;
* **speculative verify**: a request in draft mode verifies T draft tokens in one call (token tensors ``[B, T, ...]``)
  and a verifier accepts the first n; ``leapquant.accept`` takes the rest back (a cursor move, no state copy);
* **a request finishes**: its slot is free again (nothing to clear: ``load_states`` resets it on reuse).

Every output is checked against an exact float64 recurrence that sees the same tokens (the accepted ones only); the
script prints the worst relative error and exits non-zero past its tolerance. The layer's projections are stood in
for by a deterministic token stream per request (``leapquant.tools.streams``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

import leapquant
from leapquant.tools.exact import output, recurrent_step
from leapquant.tools.streams import decode_stream

HEADS, K, V, GATE = 4, 64, 64, "kda"
DRAFT = 3  # draft tokens per speculative verify
TOLERANCE = 0.05  # relative error of an output against the exact recurrence (the compression's, a few 1e-3)


@dataclass
class Request:
    rid: int
    prompt: int  # tokens prefilled
    decode: int  # tokens to decode after the prompt
    draft: bool = False  # verify DRAFT tokens per call
    prefix_of: int | None = None  # reuse this request's prompt state as a prefix (same first tokens)
    slot: int = -1
    done: int = 0
    state: torch.Tensor | None = None  # the exact float64 state [HEADS, V, K]
    tokens: dict = field(default_factory=dict)

    def token(self, t: int) -> dict:
        """The inputs of this request's token t, [HEADS, ...]: row t of its stream."""
        return {name: x[t, 0] for name, x in self.tokens.items()}


def stream(rid: int, n: int) -> dict:
    """A request's token stream (seeded by the request: two runs see the same tokens)."""
    return decode_stream("synthetic", 1, HEADS, K, V, n, GATE, torch.Generator().manual_seed(1000 + rid))


def exact_prefill(req: Request, start: torch.Tensor | None, first: int) -> torch.Tensor:
    """The exact state after tokens ``first .. prompt - 1`` of the request, from ``start`` (zero when None)."""
    S = torch.zeros(HEADS, V, K, dtype=torch.float64) if start is None else start.clone()
    for t in range(first, req.prompt):
        x = req.token(t)
        S = recurrent_step(S, x["k"], x["v"], x["g"], x["beta"], GATE)
    return S


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = "auto" if device == "cuda" else "reference"
    # 8 sequence slots (slot 0 is vLLM's null slot), one cache slot for a shared prefix; drafts of up to DRAFT tokens
    pool = leapquant.Pool(10, HEADS, K, V, gate=GATE, device=device, layout="compact", max_tokens=DRAFT)
    cache_slot, free = 9, list(range(1, 9))
    scale = K ** -0.5
    arrivals = {0: [Request(0, prompt=24, decode=40), Request(1, prompt=8, decode=30, draft=True)],
                3: [Request(2, prompt=24, decode=25, prefix_of=0)],  # shares request 0's 24-token prompt
                5: [Request(3, prompt=16, decode=20, draft=True), Request(4, prompt=4, decode=12)]}
    running: list[Request] = []
    cache: dict[int, torch.Tensor] = {}  # request id -> its prompt's exact state, for the prefix it leaves
    worst, checked, it = 0.0, 0, 0
    gen = torch.Generator().manual_seed(7)  # the verifier's acceptances

    def check(req: Request, o: torch.Tensor, x: dict) -> None:
        nonlocal worst, checked
        req.state = recurrent_step(req.state, x["k"], x["v"], x["g"], x["beta"], GATE)
        want = output(req.state, x["q"], scale)
        err = float((o.double().cpu() - want).norm() / want.norm())
        worst, checked = max(worst, err), checked + 1

    while it < 200 and (running or any(t >= it for t in arrivals)):
        # admit: a slot each; the prompt prefilled exactly (or its prefix copied from the cache) and loaded
        for req in arrivals.pop(it, []):
            req.slot = free.pop(0)
            req.tokens = stream(req.rid, req.prompt + req.decode)
            if req.prefix_of is not None:  # the shared prompt's tokens, then its own continuation
                shared = stream(req.prefix_of, req.prompt)
                req.tokens = {n: torch.cat([shared[n], x[req.prompt:]]) for n, x in req.tokens.items()}
            if req.prefix_of is not None and req.prefix_of in cache:
                pool.copy_slots([cache_slot], [req.slot])  # the cached prefix, bit for bit
                req.state = cache[req.prefix_of].clone()
            else:
                req.state = exact_prefill(req, None, 0)
                pool.load_states(torch.tensor([req.slot], device=device), req.state.float()[None].to(device),
                                 backend=backend)
            req.done = 0
            if req.rid == 0:  # its prompt is a prefix later requests share: cache it
                slot = torch.tensor([req.slot], dtype=torch.int32, device=device)
                leapquant.flush(pool, slot, force=True, backend=backend)  # the checkpoint alone is the state
                pool.copy_slots([req.slot], [cache_slot])
                cache[req.rid] = req.state.clone()
            running.append(req)
        # decode: the plain requests one token each, in one call
        plain = [r for r in running if not r.draft]
        if plain:
            idx = torch.tensor([r.slot for r in plain], dtype=torch.int32, device=device)
            xs = [r.token(r.prompt + r.done) for r in plain]
            batch = {n: torch.stack([x[n] for x in xs]).to(device) for n in ("q", "k", "v", "g", "beta")}
            o = leapquant.step(pool, idx, **batch, scale=scale, backend=backend)
            for r, x, o_r in zip(plain, xs, o):
                check(r, o_r, x)
                r.done += 1
        # speculative verify: DRAFT tokens per draft request in one call, then the verifier's acceptances
        drafts = [r for r in running if r.draft and r.decode - r.done >= DRAFT]
        if drafts:
            idx = torch.tensor([r.slot for r in drafts], dtype=torch.int32, device=device)
            xs = [[r.token(r.prompt + r.done + t) for t in range(DRAFT)] for r in drafts]
            batch = {n: torch.stack([torch.stack([x[n] for x in row]) for row in xs]).to(device)
                     for n in ("q", "k", "v", "g", "beta")}
            o = leapquant.step(pool, idx, **batch, scale=scale, backend=backend)  # [B, DRAFT, HEADS, V]
            n_acc = torch.randint(0, DRAFT + 1, (len(drafts),), generator=gen)
            leapquant.accept(pool, idx, n_acc.to(torch.int32).to(device))
            for r, row, o_r, n in zip(drafts, xs, o, n_acc.tolist()):
                for t in range(n):  # the accepted tokens' outputs were computed on the state the pool now has
                    check(r, o_r[t], row[t])
                r.done += n
        for r in [r for r in running if r.draft and 0 < r.decode - r.done < DRAFT]:
            r.draft = False  # the last few tokens one by one
        # finish
        for r in [r for r in running if r.done >= r.decode]:
            running.remove(r)
            free.append(r.slot)
        it += 1
    print(f"{checked} outputs checked against the exact recurrence on {device} ({backend}); worst relative error "
          f"{worst:.2e} (tolerance {TOLERANCE})")
    return 0 if checked > 0 and worst <= TOLERANCE and not running else 1


if __name__ == "__main__":
    sys.exit(main())
