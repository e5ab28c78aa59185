"""The Python that ships is typed and checks: mypy over the compile worker
(daemon/worker: its script and its package) and the torchloop package
(client/python/torchloop, with the C codec's stub _fast.pyi)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ["daemon/worker/compile_worker.py", "daemon/worker/torchloop_worker",
           "client/python/torchloop"]


def test_mypy_finds_no_errors_in_the_shipped_python(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "mypy"),
         "--ignore-missing-imports", "--follow-imports=silent", "--warn-unused-ignores",
         *CHECKED],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]
    assert "Success: no issues found" in done.stdout
