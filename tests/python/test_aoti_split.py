"""The AOTI interface compiled once, the wrapper built beside the kernels
(daemon/worker/torchloop_worker/aoti_split.py).

Each test AOT-compiles small graphs in this process with the worker's
build_artifact, under an Inductor cache directory of its own, and runs the
artifact against eager PyTorch; the daemon's artifact check (elf.py) must
accept it.  Six Inductor builds in all.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "daemon" / "worker"))
from torchloop_worker import aoti_split  # noqa: E402
from torchloop_worker.build import SPLIT, build_artifact  # noqa: E402
from torchloop_worker.elf import check_artifact  # noqa: E402
from torchloop_worker.errors import JobError  # noqa: E402

F64 = torch.float64

pytestmark = pytest.mark.skipif(not SPLIT, reason="TORCHLOOP_AOTI_SPLIT=0 in the environment")


class Step(torch.nn.Module):
    def __init__(self, k: float) -> None:
        super().__init__()
        self.k = k

    def forward(self, c: torch.Tensor, xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ys = []
        for t in range(xs.shape[0]):
            c = torch.sin(c) * xs[t] + self.k * c
            ys.append(c)
        return c, torch.stack(ys)


def _example(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(4, dtype=F64, generator=gen), torch.rand(3, 4, dtype=F64, generator=gen)


@pytest.fixture
def inductor_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An Inductor cache of the test's own: the interface object is built anew."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    return tmp_path / "inductor" / aoti_split.DIR


def _build_and_run(k: float, seed: int, out: Path) -> str:
    """Builds Step(k) into out/graph.so, checks it as the daemon does and
    against eager; returns the wrapper source's text."""
    out.mkdir()
    example = _example(seed)
    module = torch.export.export(Step(k), example).module()
    so = build_artifact(module, example, str(out / "graph.so"))
    check_artifact(so, str(Path(so).parent))
    got = torch._C._aoti.AOTIModelContainerRunnerCpu(so, 1).run(list(example))
    want = Step(k)(*example)
    assert all(torch.allclose(g, w, rtol=0, atol=1e-12) for g, w in zip(got, want))
    wrappers = list(Path(so).parent.rglob("*.wrapper.cpp"))
    assert len(wrappers) == 1
    return wrappers[0].read_text()


def test_the_interface_is_built_once_linked_into_every_artifact_and_rebuilt_if_damaged(
        inductor_dir: Path, tmp_path: Path) -> None:
    first = _build_and_run(0.5, 1, tmp_path / "a")
    # the graph's own wrapper carries the declaration, not the interface
    assert aoti_split.MARKER in first
    assert "AOTInductorModelContainerRun(" not in first
    objects = sorted(inductor_dir.glob("*.o"))
    assert len(objects) == 1
    stamp = objects[0].stat().st_mtime_ns
    _build_and_run(0.25, 2, tmp_path / "b")  # another graph: the same object, not rebuilt
    assert sorted(inductor_dir.glob("*.o")) == objects
    assert objects[0].stat().st_mtime_ns == stamp
    objects[0].write_bytes(b"\x7fELF truncated")  # a damaged cache: built again from source
    _build_and_run(0.75, 3, tmp_path / "c")
    assert objects[0].stat().st_size > 100_000


def test_a_wrapper_build_that_fails_fails_the_compile_at_its_link(
        inductor_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def merge(cmd: str, target: str, obj: str) -> None:
        raise OSError("g++ exited 1: torchloop test: the wrapper's merge fails")

    monkeypatch.setattr(aoti_split, "merge", merge)
    (tmp_path / "a").mkdir()
    example = _example(6)
    module = torch.export.export(Step(2.5), example).module()
    with pytest.raises(JobError) as err:
        build_artifact(module, example, str(tmp_path / "a" / "graph.so"))
    assert err.value.code == "COMPILE_FAILED"
    assert "the wrapper's merge fails" in err.value.message
    assert not aoti_split.PENDING.jobs  # waited for, nothing left running
    monkeypatch.undo()
    _build_and_run(2.5, 6, tmp_path / "b")  # the next build is unaffected


def test_an_interface_that_will_not_build_leaves_the_wrapper_whole(
        inductor_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(aoti_split, "INSTANTIATE", "\n#error torchloop test: no interface\n")
    monkeypatch.setattr(aoti_split, "FAILED", set())
    text = _build_and_run(1.5, 5, tmp_path / "a")
    assert "AOTInductorModelContainerRun(" in text  # torch's own, whole wrapper
    assert aoti_split.MARKER not in text
    assert not list(inductor_dir.glob("*.o"))
    assert "the AOTI interface object cannot be built" in capfd.readouterr().err
    assert not [p for p in os.listdir(inductor_dir) if not p.endswith(".o")]  # no leftovers
