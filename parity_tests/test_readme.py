"""The README's Python snippet runs as written (on the CPU in CI: the reference backend)."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_snippet_runs_as_written():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 1, "the README holds one Python snippet"
    # a fresh interpreter, as a reader would run it (no test fixtures, no TRITON_INTERPRET from conftest)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", blocks[0]], capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    due, state = res.stdout.splitlines()
    assert due == "32 of 32 heads due", res.stdout
    assert state.endswith("| state: (8, 4, 128, 128)"), res.stdout
