"""The compile worker's target ISA, remembered across starts
(daemon/worker/torchloop_worker/isa.py): found once per key, read back
after, found again for a file that is damaged or was written for another
key; torch's build read from its version.py as torch reports it; and a
worker started on a cache that has the file answers hello without
importing torch.  No compile.
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

    def find() -> isa.Target:
        calls[0] += 1
        return isa.Target(f"vec=test{calls[0]};march=native", True)

    monkeypatch.setattr(isa, "find", find)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    return calls


def test_the_target_is_found_once_then_read_back(found: list[int], tmp_path: Path) -> None:
    assert isa.target().isa == "vec=test1;march=native"
    assert isa.target().isa == "vec=test1;march=native"
    assert found == [1]
    kept = json.loads((tmp_path / "inductor" / isa.FILE).read_text())
    assert kept == {"key": isa.key(), "isa": "vec=test1;march=native", "cxx11_abi": True}


@pytest.mark.parametrize("text", ["{not json", "[]", '{"key": "other", "isa": "vec=x;march=y"}',
                                  '{"isa": 3}', "KEY_WITHOUT_ABI"])
def test_a_damaged_or_foreign_file_is_not_believed(found: list[int], tmp_path: Path,
                                                   text: str) -> None:
    (tmp_path / "inductor").mkdir()
    if text == "KEY_WITHOUT_ABI":  # a file from before the ABI was kept
        text = json.dumps({"key": isa.key(), "isa": "vec=old;march=native"})
    (tmp_path / "inductor" / isa.FILE).write_text(text)
    assert isa.target().isa == "vec=test1;march=native"
    assert found == [1]
    assert isa.target().isa == "vec=test1;march=native" and found == [1]  # rewritten


@pytest.mark.parametrize("var", isa.ENV)
def test_the_environment_that_steers_inductor_is_part_of_the_key(
        found: list[int], monkeypatch: pytest.MonkeyPatch, var: str) -> None:
    assert isa.target().isa == "vec=test1;march=native"
    monkeypatch.setenv(var, "something-else")
    assert isa.target().isa == "vec=test2;march=native"
    assert found == [2]


def test_no_cache_directory_finds_it_every_time(found: list[int],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    isa.target().isa
    isa.target().isa
    assert found == [2]


def test_torch_build_is_what_torch_reports() -> None:
    import torch

    build = isa.torch_build()
    assert build.version == torch.__version__
    assert build.git == torch.version.git_version
    assert os.path.samefile(build.lib, os.path.join(os.path.dirname(torch.__file__), "lib"))


def test_a_worker_answers_hello_from_the_file_without_importing_torch(tmp_path: Path) -> None:
    cache = tmp_path / "inductor"
    cache.mkdir()
    (cache / isa.FILE).write_text(json.dumps({"key": isa.key(), "isa": "vec=kept;march=native",
                                              "cxx11_abi": False}))
    script = ("import sys, compile_worker as w; r = w.handle({'op': 'hello', 'id': 1})['result']; "
              "print(r['isa'], r['cxx11_abi'], 'torch' in sys.modules, r['protocol'], r['torch'])")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT / "daemon" / "worker",
                         env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)},
                         capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["vec=kept;march=native", "False", "False", "1",
                                  isa.torch_build().version]


@pytest.mark.parametrize("preload", ["1", "0"])
def test_a_worker_imports_the_compile_path_after_hello_unless_told_not_to(
        tmp_path: Path, preload: str) -> None:
    """The daemon's default: right after hello the worker imports what its
    jobs need; TORCHLOOP_WORKER_PRELOAD=0 (the test suite's) leaves that to
    the first job.  Either way it answers hello and exits cleanly at EOF."""
    import msgpack

    hello = msgpack.packb({"id": 1, "op": "hello"})
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "TORCHLOOP_WORKER_PRELOAD": preload}
    out = subprocess.run([sys.executable, "compile_worker.py"], cwd=ROOT / "daemon" / "worker",
                         input=len(hello).to_bytes(4, "big") + hello, env=env,
                         capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    reply = msgpack.unpackb(out.stdout[4:])
    assert reply["id"] == 1 and reply["result"]["protocol"] == 1
    assert ("compile path imported" in out.stderr.decode()) == (preload == "1")
    assert "Traceback" not in out.stderr.decode()
