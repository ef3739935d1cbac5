"""Benchmarks of the LeapQuant flush: ``python -m bench`` (see :mod:`bench.__main__`).

One run measures the device's copy bandwidth, times ``leapquant.flush`` for every requested backend over batch sizes,
due fractions and heads per GPU (CUDA graph replays, L2 evicted before each), times a full-precision KDA decode step
(:mod:`bench.step`) that the flush is amortised against, and writes a JSON file, a markdown table and a plot named
after the device (``bench/results/flush_<device>.{json,md,png}``).

Modules: ``timing`` (events, graph replays, L2 eviction, copy bandwidth, versions), ``flush`` (cases, floor bytes,
the per-backend worker), ``step`` (the Triton step kernel, its float64 check and worker), ``report`` (table, JSON,
markdown), ``plot`` (PNG). Each backend runs in its own subprocess so that a crash, a sticky CUDA error or a compile
that hangs costs that backend's numbers only.
"""
