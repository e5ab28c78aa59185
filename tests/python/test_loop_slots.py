"""The scan op's loop on pointers into one arena
(daemon/worker/torchloop_worker/loop_slots.py), checked on wrapper text: what
a loop loop_pass.py rewrote becomes, and each use of a tensor that keeps the
loop on tensors.  (The blocked build in test_wrapper_pass.py runs the result
against eager.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "daemon" / "worker"))
from torchloop_worker.loop_pass import loop_buffers  # noqa: E402
from torchloop_worker.loop_slots import slot_wrapper  # noqa: E402

RUN = "void AOTInductorModel::run_impl("


def _alloc(name: str, array: str, dtype: str, ndim: int = 1) -> list[str]:
    strides = "int_array_9" if ndim else array
    return [f"        AtenTensorHandle {name}_handle;",
            f"        AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided({ndim}, {array}, {strides}, "
            f"cached_torch_dtype_{dtype}, cached_torch_device_type_cpu, this->device_idx_, "
            f"&{name}_handle));",
            f"        RAIIAtenTensorHandle {name}({name}_handle);"]


def _wrapper(in_loop: str = "", after: str = "", cond_dtype: str = "bool",
             item: str = "bool") -> str:
    """A run_impl with one scan-op-like loop: a scratch buffer s1, a carry
    c1 handed on to buf5 (set from the input arg0_1), a condition k1 handed
    on to cond and read back by an item."""
    return "\n".join([
        RUN,
        "    static constexpr int64_t int_array_9[] = {1L, };",
        "    static constexpr int64_t int_array_8[] = {16L, };",
        "    static constexpr int64_t *int_array_5=nullptr;",
        "    AtenTensorHandle buf5_handle;",
        "    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_assign_tensors_out(arg0_1, &buf5_handle));",
        "    RAIIAtenTensorHandle buf5(buf5_handle);",
        "    RAIIAtenTensorHandle cond;",
        "    while (1) {",
        *_alloc("k1", "int_array_5", cond_dtype, 0),
        "        kernel0((const double*)(buf5.data_ptr()), (bool*)(k1.data_ptr()));",
        "        cond.reset();",
        "        cond = std::move(k1);",
        "        bool cond_scalar;",
        f"        AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_item_{item}(cond, &cond_scalar));",
        "        if (!cond_scalar) break;",
        *_alloc("s1", "int_array_8", "float64"), *_alloc("c1", "int_array_8", "float64"),
        "        auto& x = buf5;  // a handle's reads",
        "        kernel((double*)(s1.data_ptr()), (const double*)(x.data_ptr()), (double*)(c1.data_ptr()));",
        *([in_loop] if in_loop else []),
        "        s1.reset();",
        "        buf5.reset();",
        "        buf5 = std::move(c1);",
        "    }",
        "    arg0_1.reset();",
        "    if (_check_aoti_runtime_check_inputs_env()) { assert_size_stride(buf5, {16L, }, {1L, }, "
        "\"torch.ops.while_loop\", cached_torch_dtype_float64, \"torch.float64\"); }",
        "    out_kernel((const double*)(buf5.data_ptr()), (double*)(arg1_1.data_ptr()));",
        *([after] if after else []),
        "} // AOTInductorModel::run_impl",
    ])


def test_a_loop_on_tensors_used_only_for_their_data_runs_on_pointers_into_one_arena() -> None:
    staged, hoisted, turns = loop_buffers(_wrapper())
    assert (hoisted, turns) == (1, 2)
    out, slotted, _, refused = slot_wrapper(staged)
    assert (slotted, refused) == (1, [])
    lines = [s.strip() for s in out.split("\n")]
    assert out.count("aoti_torch_empty_strided(") == 1  # the arena, once per run
    assert "aoti_torch_assign_tensors_out" not in out  # no handle per iteration
    assert "aoti_torch_item" not in out and "assert_size_stride" not in out
    assert "arg0_1.reset();" not in lines  # buf5 points into it until the end of the run
    # 64-byte aligned, in the order allocated: k1's turns (1 byte), s1, c1's turns (128 bytes)
    for slot in ("k1_turn0{torchloop_arena0_base + 0}", "k1_turn1{torchloop_arena0_base + 64}",
                 "s1{torchloop_arena0_base + 128}", "c1_turn0{torchloop_arena0_base + 256}",
                 "c1_turn1{torchloop_arena0_base + 384}"):
        assert f"TorchloopSlot {slot};" in lines
    assert "static constexpr int64_t torchloop_arena0_size[] = {512L};" in lines
    for line in ("TorchloopSlot buf5{arg0_1.data_ptr()};", "TorchloopSlot cond;",
                 "TorchloopSlot c1 = torchloop_turn0 ? c1_turn1 : c1_turn0;",
                 "cond_scalar = *static_cast<const bool*>(cond.data_ptr());",
                 "buf5 = std::move(c1);", "auto& x = buf5;  // a handle's reads"):
        assert line in lines
    assert lines.index("struct TorchloopSlot {  // torchloop: a tensor of the scan op's loop, "
                       "as its data pointer") < lines.index(RUN)
    assert "// torchloop: loop buffers" not in out


@pytest.mark.parametrize("code, why", [
    (_wrapper(after="    other_op(buf5);"), "buf5 used as a tensor"),
    (_wrapper(in_loop="        other_op(buf5, (double*)(s1.data_ptr()));"), "buf5 used as a tensor"),
    (_wrapper(item="int64", cond_dtype="bool"), "item_int64 of cond"),
    (_wrapper(after="    auto kept = std::move(arg0_1);"), "source arg0_1 changes"),
    (_wrapper(cond_dtype="float8_e4m3fn", item="float64"), "an allocation it cannot place"),
])
def test_a_loop_with_a_tensor_a_pointer_cannot_stand_for_stays_on_tensors(code: str, why: str) -> None:
    staged, hoisted, _ = loop_buffers(code)
    assert hoisted
    out, slotted, _, refused = slot_wrapper(staged)
    assert slotted == 0 and len(refused) == 1 and why in refused[0], refused
    assert out == staged.replace("    // torchloop: loop buffers\n", "")


def test_a_variable_handed_a_tensor_from_outside_the_arena_keeps_the_loop_on_tensors() -> None:
    code = _wrapper(in_loop="        cond = std::move(outside);")
    staged, _, _ = loop_buffers(code)
    out, slotted, _, refused = slot_wrapper(staged)
    assert slotted == 0 and "handed a tensor" in refused[0], refused


def test_a_carry_released_as_an_output_is_copied_into_a_new_tensor() -> None:
    staged, _, _ = loop_buffers(_wrapper(after="    output_handles[0] = buf5.release();"))
    out, slotted, _, refused = slot_wrapper(staged)
    assert (slotted, refused) == (1, [])
    tail = [s.strip() for s in out.split("\n")][-6:-1]
    assert tail == [
        "AtenTensorHandle buf5_out_handle;",
        "AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(1, int_array_8, int_array_9, "
        "cached_torch_dtype_float64, cached_torch_device_type_cpu, this->device_idx_, &buf5_out_handle));",
        "RAIIAtenTensorHandle buf5_out(buf5_out_handle);",
        "std::memcpy(buf5_out.data_ptr(), buf5.data_ptr(), 128);",
        "output_handles[0] = buf5_out.release();",
    ]


def _top(name: str, array: str, dtype: str = "float64") -> list[str]:
    return [s[4:] for s in _alloc(name, array, dtype)]


def test_the_runs_small_buffers_used_only_for_their_data_share_one_allocation() -> None:
    code = "\n".join([
        RUN,
        "    static constexpr int64_t int_array_9[] = {1L, };",
        "    static constexpr int64_t int_array_8[] = {16L, };",
        "    static constexpr int64_t int_array_7[] = {8193L, };",  # 64 KiB + 8 bytes
        *_top("a", "int_array_8"), *_top("b", "int_array_8", "int32"),
        *_top("big", "int_array_7"), *_top("out", "int_array_8"), *_top("handed", "int_array_8"),
        "    kernel((double*)(a.data_ptr()), (int32_t*)(b.data_ptr()), (double*)(big.data_ptr()));",
        "    auto a2 = std::move(a);  // reuse",
        "    kernel2((const double*)(a2.data_ptr()), (double*)(out.data_ptr()));",
        "    other_op(handed);",
        "    a2.reset();",
        "    b.reset();",
        "    output_handles[0] = out.release();",
        "} // AOTInductorModel::run_impl",
    ])
    out, loops, framed, refused = slot_wrapper(code)
    assert (loops, framed, refused) == (0, 2, [])
    lines = [s.strip() for s in out.split("\n")]
    assert "TorchloopSlot a{torchloop_frame_base + 0};" in lines
    assert "TorchloopSlot b{torchloop_frame_base + 128};" in lines  # 64-byte aligned
    assert "static constexpr int64_t torchloop_frame_size[] = {192L};" in lines
    assert out.count("aoti_torch_empty_strided(") == 4  # the frame, big, out, handed
    for kept in ("big", "out", "handed"):
        assert f"RAIIAtenTensorHandle {kept}({kept}_handle);" in lines
    assert lines.index("struct TorchloopSlot {  // torchloop: a tensor of the scan op's loop, "
                       "as its data pointer") < lines.index(RUN)
