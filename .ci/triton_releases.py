"""The Triton releases (major.minor) that pyproject's ``triton`` extra allows, oldest first, one a line.

``.ci/run`` tests the newest in its main environment and each older one in a venv of its own, so the releases CI
checks follow the range the package declares instead of a list kept beside it. Only the ``>=A.B,<C.D`` form is
understood (anything else fails here, loudly); releases are assumed to be 3.x minors, as every Triton since 3.0 is.

    python3 .ci/triton_releases.py            # every allowed release
    python3 .ci/triton_releases.py --older    # all but the newest
"""

from __future__ import annotations

import pathlib
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the test extra installs tomli, the same parser before it joined the stdlib
    import tomli as tomllib

from packaging.requirements import Requirement
from packaging.version import Version

PYPROJECT = pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml"


def allowed_releases(pyproject: pathlib.Path = PYPROJECT) -> list[tuple[int, int]]:
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    (requirement,) = (Requirement(r) for r in extras["triton"])
    bounds = {spec.operator: Version(spec.version).release[:2] for spec in requirement.specifier}
    if requirement.name != "triton" or set(bounds) != {">=", "<"} or len(requirement.specifier) != 2:
        raise SystemExit(f"cannot enumerate releases of {requirement}: expected the form triton>=A.B,<C.D")
    (low_major, low_minor), (high_major, high_minor) = bounds[">="], bounds["<"]
    if low_major != high_major:
        raise SystemExit(f"cannot enumerate releases of {requirement}: the range crosses a major version")
    return [(low_major, minor) for minor in range(low_minor, high_minor)]


if __name__ == "__main__":
    releases = allowed_releases()
    if sys.argv[1:] == ["--older"]:
        releases = releases[:-1]
    elif sys.argv[1:]:
        raise SystemExit(__doc__)
    print("\n".join(f"{major}.{minor}" for major, minor in releases))
