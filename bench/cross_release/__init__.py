"""The Gluon decode step as Triton releases other than the GPU machine's compile it, checked and timed on that GPU.

The machine with the GPU has one Triton (3.6); ``step_gluon`` is claimed for 3.6-3.9 (``GLUON_RELEASES``). The
kernel's source is the same under all of them, but each release's compiler makes its own SASS. So each release's
build is made here, ahead of time, for sm_90, and launched on the GPU through the driver API
(:mod:`.routing`) with the very arguments the library computed for the launch it replaces. Three steps:

    TRITON_INTERPRET=1 python -m bench.cross_release.keys KEYS.jsonl      # the launches' build keys (CPU, dry)
    python -m bench.cross_release.compile KEYS.jsonl LIB                  # under each Triton release's venv
    python -m bench.cross_release.check --lib LIB --out bench/results     # on the GPU

``check`` runs :mod:`.sweep` (each release's build against the fp32 reference, SPEC §6's criteria token by token,
over gates, dtypes, l2 norm, conventions, grouped heads and T = 1-8 with the history) and :mod:`.cases`
(``bench.decode``'s one-token, packed and T = 4 cases at 256 x 32 heads: each build's bytes against the native
launch's, and its time beside the floor and the ``tl`` kernel that those releases took before), and writes
``cross_release_<device>.json`` / ``.md``.
"""
