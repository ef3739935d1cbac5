"""The tools around LeapQuant (simulation, prefill round trip, workloads, op definition), apart from what an engine
imports. They use the core through the public ``leapquant`` API, ``leapquant.constants``, ``leapquant.geometry`` and
``leapquant.reference`` only (and the two names of :mod:`~leapquant.tools._core`); nothing in the core imports them.
"""
