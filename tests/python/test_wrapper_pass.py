"""The generated wrapper with less per-call work
(daemon/worker/torchloop_worker/wrapper_pass.py, loop_pass.py, loop_slots.py).

The rewrites are checked on wrapper text (no compile): what each replaces,
and each reason to leave a view, a buffer or a handle alone.  Then one
AOTInductor build of a scan op over blocks of unrolled steps (the worker's
blocked()), run against eager: the while loop allocates no buffer that
nothing uses, allocates nothing per iteration (scratch buffers once, the
buffers it hands on two, taken in turn, all in one arena), makes no view
per stacked row, no handle and no item call per iteration.  One Inductor build in all.
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
from torchloop_worker.loop_pass import alias_handles, loop_buffers  # noqa: E402
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



def _alloc(name: str, array: str = "int_array_8") -> list[str]:
    return [f"        AtenTensorHandle {name}_handle;",
            f"        AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(1, {array}, int_array_9, "
            f"cached_torch_dtype_float64, cached_torch_device_type_cpu, this->device_idx_, "
            f"&{name}_handle));",
            f"        RAIIAtenTensorHandle {name}({name}_handle);"]


def _loop_of(body: list[str]) -> list[str]:
    return ["    static constexpr int64_t int_array_9[] = {1L, };", "    while (1) {",
            "        static constexpr int64_t int_array_8[] = {16L, };", *body, "    }"]


def test_a_loops_scratch_buffer_is_allocated_once_and_a_handed_on_one_taken_in_turn() -> None:
    code = "\n".join(_loop_of([
        *_alloc("s1"), *_alloc("c1"),
        "        auto s2 = std::move(s1);  // reuse",
        "        kernel((double*)(s2.data_ptr()), (double*)(c1.data_ptr()));",
        "        s2.reset();",
        "        buf5.reset();",
        "        buf5 = std::move(c1);",  # the next iteration's carry
    ]))
    out, hoisted, turns = loop_buffers(code)
    assert (hoisted, turns) == (1, 1)
    turn = [t.replace("c1", "c1_turn0") for t in _alloc("c1")] + \
        [t.replace("c1", "c1_turn1") for t in _alloc("c1")]
    assert out.split("\n") == [
        "    static constexpr int64_t int_array_9[] = {1L, };",
        "    // torchloop: loop buffers",  # where loop_slots.py finds them
        "        static constexpr int64_t int_array_8[] = {16L, };", *_alloc("s1"), *turn,
        "    int torchloop_turn0 = 0;",
        "    while (1) {",
        "        AtenTensorHandle c1_handle;",
        "        AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_assign_tensors_out("
        "torchloop_turn0 ? c1_turn1 : c1_turn0, &c1_handle));",
        "        RAIIAtenTensorHandle c1(c1_handle);",
        "        auto& s2 = s1;  // reuse (hoisted)",
        "        kernel((double*)(s2.data_ptr()), (double*)(c1.data_ptr()));",
        "        buf5.reset();",
        "        buf5 = std::move(c1);",
        "        torchloop_turn0 ^= 1;",
        "    }",
    ]


@pytest.mark.parametrize("use", [
    "        AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_item_int64(s1, &u0_raw));",  # a tensor
    "        buf5 = std::move(s1);\n        buf6 = std::move(s1);",  # handed on twice
    "        auto s2 = wrap_with_raii_handle_if_needed(reinterpret_tensor_wrapper(s1, 1, a, b, 0L));",
])
def test_a_loop_buffer_used_as_a_tensor_is_allocated_each_iteration(use: str) -> None:
    code = "\n".join(_loop_of([*_alloc("s1"), "        kernel((double*)(s1.data_ptr()));", use]))
    assert loop_buffers(code) == (code, 0, 0)


def test_no_buffer_is_taken_in_turn_where_a_variable_gets_another_ones_tensor() -> None:
    # buf6 = buf5's old tensor (a handle made from it): two variables could
    # then hold the turn buffers, and one would be overwritten while read
    code = "\n".join(_loop_of([
        *_alloc("c1"), *_handle("a5", "buf5"),
        "        kernel((double*)(a5.data_ptr()), (double*)(c1.data_ptr()));",
        "        buf5 = std::move(c1);",
        "        buf6 = std::move(a5);",
    ]))
    assert loop_buffers(code) == (code, 0, 0)


def test_a_buffer_outside_a_loop_read_after_it_or_in_an_inner_block_stays() -> None:
    outside = "\n".join([*_alloc("s1"), "        kernel((double*)(s1.data_ptr()));"])
    assert loop_buffers(outside) == (outside, 0, 0)
    after = "\n".join([*_loop_of([*_alloc("s1"), "        kernel((double*)(s1.data_ptr()));"]),
                       "    other((double*)(s1.data_ptr()));"])
    assert loop_buffers(after) == (after, 0, 0)
    inner = "\n".join(_loop_of(["        if (x) {", *["    " + t for t in _alloc("s1")],
                                 "            kernel((double*)(s1.data_ptr()));", "        }"]))
    assert loop_buffers(inner) == (inner, 0, 0)


def _handle(name: str, base: str) -> list[str]:
    return [f"        AtenTensorHandle {name}_handle;",
            f"        AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_assign_tensors_out({base}, &{name}_handle));",
            f"        RAIIAtenTensorHandle {name}({name}_handle);"]


def test_a_handle_only_read_becomes_a_reference_and_an_unused_one_goes() -> None:
    code = "\n".join([
        *_handle("a0", "buf3"), *_handle("a1", "buf4"),
        "        AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_item_int64(a0, &u0_raw));",
        "        kernel((const int64_t*)(a0.data_ptr()));",
        "        a0.reset();",
        "        buf3.reset();",
    ])
    out, n = alias_handles(code)
    assert n == 2
    assert out.split("\n") == [
        "        auto& a0 = buf3;  // a handle's reads",
        "        AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_item_int64(a0, &u0_raw));",
        "        kernel((const int64_t*)(a0.data_ptr()));",
        "        buf3.reset();",
    ]


@pytest.mark.parametrize("use", [
    "        buf4 = std::move(a0);",  # handed on: its own tensor
    "        buf3.reset();\n        kernel((double*)(a0.data_ptr()));",  # read after its source changed
    "        other(a0);",  # passed as a tensor
])
def test_a_handle_used_as_a_tensor_or_outliving_its_source_is_kept(use: str) -> None:
    code = "\n".join([*_handle("a0", "buf3"), use])
    assert alias_handles(code) == (code, 0)


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
def test_the_scan_ops_loop_allocates_nothing_and_every_buffer_is_used(
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
    code = wrapper.read_text()
    loop = _loop(code)
    assert "reinterpret_tensor_wrapper" not in loop  # no view per stacked row
    allocated = re.findall(ALLOCATED, code)
    assert allocated
    for buf in allocated:  # each is used by something: no buffer that fusion removed
        assert _used(code.split("\n"), buf), f"{buf} is allocated and nothing uses it"
    per_iteration = re.findall(ALLOCATED, loop)
    assert not per_iteration, f"allocated at every iteration: {per_iteration}"
    # loop_slots.py: its tensors are pointers into one arena, its items loads
    assert "TorchloopSlot" in loop
    for call in ("aoti_torch_assign_tensors_out", "aoti_torch_item_"):
        assert call not in loop, f"{call} at every iteration"


ALLOCATED = r"aoti_torch_empty_strided\([^;]*&(\w+)_handle\)\);"


def _used(lines: list[str], name: str) -> bool:
    """Whether a line other than name's own allocation, handle and resets
    names it (or a reuse of it: `auto [&]other = [std::move(]name[)];`)."""
    own = (f"AtenTensorHandle {name}_handle;", f"&{name}_handle));",
           f"RAIIAtenTensorHandle {name}({name}_handle);", f"{name}.reset();")
    word = re.compile(rf"\b{name}\b")
    for line in lines:
        if not word.search(line) or any(o in line for o in own):
            continue
        reuse = re.match(rf"^\s*auto&? (\w+) = (?:std::move\()?{name}\)?;", line)
        if reuse is None or _used(lines, reuse.group(1)):
            return True
    return False
