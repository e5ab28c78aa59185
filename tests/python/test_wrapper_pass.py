"""The generated wrapper with less per-call work
(daemon/worker/torchloop_worker/wrapper_pass.py).

The view rewrite is checked on wrapper text (no compile): what it replaces,
and each reason to leave a view alone.  Then one AOTInductor build of a scan
op over blocks of unrolled steps (the worker's blocked()), run against
eager: the while loop allocates no buffer that nothing uses, and makes no
view per stacked row.  One Inductor build in all.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "daemon" / "worker"))
from torchloop_worker.blocked import blocked  # noqa: E402
from torchloop_worker.build import WRAPPER_PASS, build_artifact  # noqa: E402
from torchloop_worker.elf import check_artifact  # noqa: E402
from torchloop_worker.wrapper_pass import alias_pointers  # noqa: E402

F64 = torch.float64


def _view(name: str, base: str, offset: int) -> str:
    return (f"    auto {name} = wrap_with_raii_handle_if_needed(reinterpret_tensor_wrapper("
            f"{base}, 1, int_array_8, int_array_9, {offset}L));  // alias")


def test_a_view_used_only_for_its_pointer_becomes_pointer_arithmetic_on_its_base() -> None:
    code = "\n".join([
        "    RAIIAtenTensorHandle buf9(buf9_handle);",
        _view("buf1", "buf9", 0),
        _view("buf2", "buf9", 16),
        "    kernel((double*)(buf1.data_ptr()), (const double*)(buf2.data_ptr()), (double*)(buf2.data_ptr()));",
        "    buf9.reset();",
        "    buf2.reset();",
        "    buf1.reset();",
    ])
    out, n = alias_pointers(code)
    assert n == 2
    assert out.split("\n") == [
        "    RAIIAtenTensorHandle buf9(buf9_handle);",
        "    kernel(((double*)(buf9.data_ptr())), ((const double*)(buf9.data_ptr()) + 16), "
        "((double*)(buf9.data_ptr()) + 16));",
        "    buf9.reset();",
    ]


@pytest.mark.parametrize("use", [
    "    output_handles[0] = buf1.release();",  # the view leaves the graph
    "    auto buf3 = std::move(buf1);  // reuse",  # it lives on under another name
    "    other(buf1, (double*)(buf1.data_ptr()));",  # a handle, not a pointer
    "    auto buf4 = wrap_with_raii_handle_if_needed(reinterpret_tensor_wrapper(buf1, 1, a, b, 0L));",
])
def test_a_view_used_as_a_tensor_is_kept(use: str) -> None:
    code = "\n".join([_view("buf1", "buf9", 8), use, "    buf1.reset();"])
    assert alias_pointers(code) == (code, 0)


@pytest.mark.parametrize("change", ["    buf9.reset();", "    buf5 = std::move(buf9);",
                                    "    buf9 = std::move(buf5);"])
def test_a_view_whose_base_changes_before_its_last_use_is_kept(change: str) -> None:
    code = "\n".join([_view("buf1", "buf9", 8), change, "    kernel((double*)(buf1.data_ptr()));"])
    assert alias_pointers(code) == (code, 0)


def _step(x: torch.Tensor, v: torch.Tensor, f: torch.Tensor) -> list[torch.Tensor]:
    """A damped oscillator's semi-implicit Euler step: carry (x, v), y = x."""
    v = v + 0.1 * (f - 4.0 * x - 0.3 * v)
    x = x + 0.1 * v
    return [x, v, x * x]


class Blocked(torch.nn.Module):
    def forward(self, x: torch.Tensor, v: torch.Tensor, fs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return blocked(_step, 2, fs.shape[0], 4, [x, v], [fs], [])


def _eager(x: torch.Tensor, v: torch.Tensor, fs: torch.Tensor) -> list[torch.Tensor]:
    ys = []
    for f in fs:
        x, v, y = _step(x, v, f)
        ys.append(y)
    return [x, v, torch.stack(ys)]


def _loop(wrapper: str) -> str:
    start = wrapper.index("while (1) {")
    return wrapper[start:wrapper.index("\n    }\n", start)]


@pytest.mark.skipif(not WRAPPER_PASS, reason="TORCHLOOP_WRAPPER_PASS=0 in the environment")
def test_the_scan_ops_loop_allocates_only_what_its_kernels_use(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    gen = torch.Generator().manual_seed(3)
    example = (torch.rand(8, dtype=F64, generator=gen), torch.rand(8, dtype=F64, generator=gen),
               torch.rand(12, 8, dtype=F64, generator=gen))
    module = torch.export.export(Blocked(), example, strict=False).module()
    so = build_artifact(module, example, str(tmp_path / "out" / "graph.so"))
    check_artifact(so, str(Path(so).parent))
    got = torch._C._aoti.AOTIModelContainerRunnerCpu(so, 1).run([t.clone() for t in example])
    for g, w in zip(got, _eager(*example), strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)

    (wrapper,) = Path(so).parent.rglob("*.wrapper.cpp")
    loop = _loop(wrapper.read_text())
    assert "reinterpret_tensor_wrapper" not in loop  # no view per stacked row
    allocated = re.findall(r"aoti_torch_empty_strided\([^;]*&(\w+)_handle\)\);", loop)
    assert allocated
    for buf in allocated:  # each is read or written by a kernel, under its name or a reuse's
        names, used = {buf}, False
        for a, b in re.findall(r"auto (\w+) = std::move\((\w+)\);", loop):
            if b in names:
                names.add(a)
        for name in names:
            used |= f"{name}.data_ptr()" in loop
        assert used, f"{buf} is allocated at every iteration and no kernel uses it"
