"""The README's Python example, run as written (from the checkout's root)
against the test daemon, its gradient checked against eager autograd."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_snippet() -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- readme-python:[^>]*-->\s*```python\n(.*?)```", text, re.S)
    assert m, "README has no marked Python example"
    return m.group(1)


def test_the_readme_example_runs_and_its_gradient_is_right(daemon: str) -> None:
    code = readme_snippet()
    assert len(code.strip().splitlines()) == 3, "three lines: connect, adapter, scan + backward"
    env = dict(os.environ, TORCHLOOP_SOCKET=daemon)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    # ema: c' = 0.75 c + 0.25 x, y_t = c_t: d(final + sum ys)/dc0 = 0.75^16 + sum_t 0.75^(t+1)
    want = 0.75 ** 16 + sum(0.75 ** (t + 1) for t in range(16))
    got = [float(v) for v in re.findall(r"[-0-9.e]+", out.stdout.split("[", 1)[1])[:4]]
    assert all(abs(g - want) < 1e-3 for g in got), (out.stdout, want)
