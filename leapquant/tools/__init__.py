"""The tools around LeapQuant, apart from what an engine imports.

* :mod:`~leapquant.tools.demo`: ``python -m leapquant demo``, a batch decoded with ``leapquant.step`` against the
  exact recurrence;
* :mod:`~leapquant.tools.simulate`: ``python -m leapquant simulate``, the decode simulation (the drift of LeapQuant's
  state and outputs from the exact recurrence, beside bf16 and int8 states), :mod:`~leapquant.tools.report` its
  tables, JSON and plot, :mod:`~leapquant.tools.drift` the decode-drift check built on it;
* :mod:`~leapquant.tools.prefill`: ``python -m leapquant.tools.prefill``, FLA's prefill -> ``load_states`` -> decode
  -> ``states`` -> resumed prefill;
* :mod:`~leapquant.tools.workloads`: pools filled with the value regimes the flush must handle (tests, benchmarks);
* :mod:`~leapquant.tools.definition`: ``python -m leapquant.tools.definition``, the op's FlashInfer-Trace definition;
* :mod:`~leapquant.tools.exact` (the gated delta rule in float64, the one every tool checks against) and
  :mod:`~leapquant.tools.streams` (the token streams every tool decodes).

The tools use the core through the public ``leapquant`` API (``leapquant.select(..., op=...)`` says which backend
runs an operation), ``leapquant.constants``, ``leapquant.geometry``, ``leapquant.formulas`` and ``leapquant.memory``
only; nothing in the core imports them.
"""
