"""The compile worker's target ISA, remembered across starts
(daemon/worker/torchloop_worker/isa.py): found once per key, read back
after, found again for a file that is damaged or was written for another
key; and a worker started on a cache that has the file answers hello
without importing Inductor.  No compile.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "daemon" / "worker"))
from torchloop_worker import isa  # noqa: E402


@pytest.fixture
def found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """isa.find replaced by a counter; a cache directory of the test's own."""
    calls = [0]

    def find() -> str:
        calls[0] += 1
        return f"vec=test{calls[0]};march=native"

    monkeypatch.setattr(isa, "find", find)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    return calls


def test_the_target_is_found_once_then_read_back(found: list[int], tmp_path: Path) -> None:
    assert isa.target_isa() == "vec=test1;march=native"
    assert isa.target_isa() == "vec=test1;march=native"
    assert found == [1]
    kept = json.loads((tmp_path / "inductor" / isa.FILE).read_text())
    assert kept == {"key": isa.key(), "isa": "vec=test1;march=native"}


@pytest.mark.parametrize("text", ["{not json", "[]", '{"key": "other", "isa": "vec=x;march=y"}',
                                  '{"isa": 3}'])
def test_a_damaged_or_foreign_file_is_not_believed(found: list[int], tmp_path: Path,
                                                   text: str) -> None:
    (tmp_path / "inductor").mkdir()
    (tmp_path / "inductor" / isa.FILE).write_text(text)
    assert isa.target_isa() == "vec=test1;march=native"
    assert found == [1]
    assert isa.target_isa() == "vec=test1;march=native" and found == [1]  # rewritten


@pytest.mark.parametrize("var", isa.ENV)
def test_the_environment_that_steers_inductor_is_part_of_the_key(
        found: list[int], monkeypatch: pytest.MonkeyPatch, var: str) -> None:
    assert isa.target_isa() == "vec=test1;march=native"
    monkeypatch.setenv(var, "something-else")
    assert isa.target_isa() == "vec=test2;march=native"
    assert found == [2]


def test_no_cache_directory_finds_it_every_time(found: list[int],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    isa.target_isa()
    isa.target_isa()
    assert found == [2]


def test_a_worker_answers_hello_from_the_file_without_importing_inductor(tmp_path: Path) -> None:
    cache = tmp_path / "inductor"
    cache.mkdir()
    (cache / isa.FILE).write_text(json.dumps({"key": isa.key(), "isa": "vec=kept;march=native"}))
    script = ("import sys, compile_worker as w; r = w.hello(); "
              "print(r['isa'], 'torch._inductor' in sys.modules, r['protocol'])")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT / "daemon" / "worker",
                         env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)},
                         capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["vec=kept;march=native", "False", "1"]
