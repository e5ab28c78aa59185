"""Tensors as pointers where the wrapper uses them only for their data
(torch 2.14; after loop_pass.py, which marks each loop it rewrote).

loop_pass leaves a loop whose buffers are allocated before it (scratch
buffers once, handed-on ones two, taken in turn), but each is still a tensor:
an `aoti_torch_empty_strided` per buffer per run (about 0.3 us each: 17 for
lorenz in blocks), a new handle per iteration for each turn taken, and the
counter and condition read back through `aoti_torch_item_*` (the
dispatcher).  When the wrapper uses every tensor of the loop only through its
data pointer, none of that is needed: `slot_loops` allocates the loop's
buffers as one arena (one allocation per run, each buffer at a 64-byte
aligned offset) and turns every tensor of the loop -- the arena's buffers,
the variables the loop hands on, the handles it takes -- into a
`TorchloopSlot`, a pointer with the two methods the wrapper calls on it
(`data_ptr`, `reset`).  Then a turn taken is a pointer copied, and an item
read a load.  All or nothing per loop: a loop where any of those names is
used another way (handed to an op as a tensor, read by an item of another
dtype, set from a source that changes) is left as loop_pass left it.  A
variable set before the loop from an outside tensor points into that
tensor's storage, so the source's resets are dropped (it lives to the end of
the run instead); one released as an output is copied into a new tensor.

`frame_arena` does the same for the run's own small buffers (at most
FRAME_MAX_BUFFER each, FRAME_MAX in all): allocated at run_impl's top level
and used only through `data_ptr()`, they share one allocation per run (30
for lorenz's unrolled T = 128 step chain).  They then all live for the whole
run, hence the bounds; larger buffers cost their arithmetic, not their
allocation.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .loop_pass import CAST, HANDOFF, MARK, RESET, REUSE, _indent, _loop_end, index, triple

SLOT_STRUCT = [
    "struct TorchloopSlot {  // torchloop: a tensor of the scan op's loop, as its data pointer",
    "    void* p = nullptr;",
    "    void* data_ptr() const { return p; }",
    "    void reset() {}",
    "};",
    "",
]
RUN_IMPL = "void AOTInductorModel::run_impl("
ELEMENT = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
           "int16": 2, "int8": 1, "uint8": 1, "bool": 1}
ITEM_TYPE = {"int64": "int64_t", "int32": "int32_t", "bool": "bool", "float64": "double",
             "float32": "float"}
ALIGN = 64
ALLOC = re.compile(r"^\s*AOTI_TORCH_ERROR_CODE_CHECK\(aoti_torch_empty_strided\((\d+), (\w+), (\w+), "
                   r"cached_torch_dtype_(\w+), cached_torch_device_type_cpu, this->device_idx_, "
                   r"&(\w+)_handle\)\);$")
ANY_ALLOC = re.compile(r"aoti_torch_empty_strided\(")
ARRAY = re.compile(r"^\s*static constexpr int64_t (?:\*(\w+)=nullptr|(\w+)\[\] = \{([^{}]*)\});$")
ASSIGN = re.compile(r"^\s*AOTI_TORCH_ERROR_CODE_CHECK\(aoti_torch_assign_tensors_out\((.+), "
                    r"&(\w+)_handle\)\);$")
PICK = re.compile(r"^(\w+) \? (\w+) : (\w+)$")
VIEW = re.compile(r"^wrap_with_raii_handle_if_needed\(reinterpret_tensor_wrapper\((\w+), [^()]*\)\)$")
REF = re.compile(r"^\s*auto& (\w+) = (\w+);")
EMPTY = re.compile(r"^\s*RAIIAtenTensorHandle (\w+);$")
ITEM = re.compile(r"^(\s*)AOTI_TORCH_ERROR_CODE_CHECK\(aoti_torch_item_(\w+)\((\w+), &(\w+)\)\);$")
RELEASE = re.compile(r"^\s*(output_handles\[\d+\]) = (\w+)\.release\(\);$")
CHECK = re.compile(r"^\s*if \(_check_aoti_runtime_check_inputs_env\(\)\) \{ assert_size_stride\((\w+), ")


class Refused(Exception):
    """The loop uses a tensor in a way a pointer cannot stand for."""


def _array(lines: list[str], where: dict[str, list[int]], name: str) -> list[int]:
    """The values of the size or stride array name ([] for nullptr)."""
    for i in where.get(name, []):
        m = ARRAY.match(lines[i])
        if m and name in (m.group(1), m.group(2)):
            return [int(v.strip().rstrip("L")) for v in (m.group(3) or "").split(",") if v.strip()]
    raise Refused(f"no array {name}")


def _nbytes(sizes: list[int], strides: list[int], dtype: str) -> int:
    """The bytes a buffer of these sizes and strides spans (at least one
    element, as the allocator gives)."""
    elements = 0 if 0 in sizes else 1 + sum((s - 1) * st for s, st in zip(sizes, strides))
    return max(elements, 1) * ELEMENT[dtype]


def _arena_lines(ind: str, arena: str, size: int) -> list[str]:
    """One allocation of size bytes, and its base pointer."""
    return [
        f"{ind}static constexpr int64_t {arena}_size[] = {{{max(size, 1)}L}};",
        f"{ind}static constexpr int64_t {arena}_stride[] = {{1L}};",
        f"{ind}AtenTensorHandle {arena}_handle;",
        f"{ind}AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(1, {arena}_size, {arena}_stride, "
        f"aoti_torch_dtype_uint8(), aoti_torch_device_type_cpu(), this->device_idx_, &{arena}_handle));",
        f"{ind}RAIIAtenTensorHandle {arena}({arena}_handle);",
        f"{ind}char* {arena}_base = static_cast<char*>({arena}.data_ptr());",
    ]


@dataclass(frozen=True)
class Buffer:
    """A buffer of the arena: where, and as what it was allocated."""

    offset: int
    dtype: str
    ndim: int
    sizes: str  # the wrapper's size and stride arrays
    strides: str
    nbytes: int


@dataclass
class Loop:
    """One marked loop: its lines and what the rewrite does to them."""

    mark: int
    start: int  # the `while (1) {` line
    end: int
    arena: dict[str, Buffer] = field(default_factory=dict)
    size: int = 0
    slots: set[str] = field(default_factory=set)
    edges: list[tuple[str, str]] = field(default_factory=list)  # values flowing between slots
    flow: set[int] = field(default_factory=set)  # lines handing a slot's value on
    new: dict[int, str] = field(default_factory=dict)  # line -> replacement
    drop: set[int] = field(default_factory=set)


def _arena(lines: list[str], where: dict[str, list[int]], lp: Loop, n: int) -> None:
    """The loop's buffers, allocated between its mark and its start, as
    slots of one arena."""
    for i in range(lp.mark + 1, lp.start):
        if not ANY_ALLOC.search(lines[i]):
            continue
        m = ALLOC.match(lines[i])
        if not (m and triple(lines, i, m.group(5)) and m.group(4) in ELEMENT):
            raise Refused(f"an allocation it cannot place: {lines[i].strip()}")
        sizes, strides = _array(lines, where, m.group(2)), _array(lines, where, m.group(3))
        if len(sizes) != int(m.group(1)) or len(strides) != len(sizes):
            raise Refused(f"{m.group(5)}: sizes and strides do not match")
        lp.size = -(-lp.size // ALIGN) * ALIGN
        name, ind = m.group(5), _indent(lines[i])
        lp.arena[name] = Buffer(lp.size, m.group(4), int(m.group(1)), m.group(2), m.group(3),
                                _nbytes(sizes, strides, m.group(4)))
        lp.slots.add(name)
        lp.new[i] = f"{ind}TorchloopSlot {name}{{torchloop_arena{n}_base + {lp.size}}};"
        lp.drop.update((i - 1, i + 1))
        lp.size += lp.arena[name].nbytes


def _declaration(lines: list[str], where: dict[str, list[int]], lp: Loop, var: str) -> None:
    """var, handed on in the loop, declared before it: a slot pointing at
    its source's data (or at nothing, when declared empty)."""
    holder = [i for i in where.get(var, []) if i < lp.mark and lines[i].strip() in (
        f"RAIIAtenTensorHandle {var}({var}_handle);", f"RAIIAtenTensorHandle {var};")]
    if len(holder) != 1:
        raise Refused(f"{var} is not declared once before the loop")
    at = holder[0]
    if EMPTY.match(lines[at]):
        lp.new[at] = f"{_indent(lines[at])}TorchloopSlot {var};"
        return
    m = ASSIGN.match(lines[at - 1])
    if not (m and m.group(2) == var and triple(lines, at - 1, var)):
        raise Refused(f"{var} is not declared from a tensor before the loop")
    source = m.group(1)
    view = VIEW.match(source)
    base = view.group(1) if view else source
    if not re.fullmatch(r"\w+", base):
        raise Refused(f"{var}'s source {source}")
    for i in where.get(base, []):  # the source keeps its storage to the end of the run
        if i <= at:
            continue
        reset = RESET.match(lines[i])
        if reset and reset.group(1) == base:
            lp.drop.add(i)
        elif re.search(rf"std::move\({base}\)|^\s*{base}\s*=|\b{base}\.release\(", lines[i]):
            raise Refused(f"{var}'s source {base} changes")
    lp.new[at - 1] = f"{_indent(lines[at - 1])}TorchloopSlot {var}{{{source}.data_ptr()}};"
    lp.drop.update((at - 2, at))


def _flows(lines: list[str], where: dict[str, list[int]], lp: Loop) -> None:
    """The loop's own names: the variables handed on, then, in order, the
    handles taken from slots, references and reuses of slots, with the
    edges values flow along."""
    handed = [h.group(1) for i in range(lp.start + 1, lp.end) if (h := HANDOFF.match(lines[i]))]
    lp.slots.update(handed)
    for var in dict.fromkeys(handed):
        _declaration(lines, where, lp, var)
    for i in range(lp.start + 1, lp.end):
        line = lines[i]
        m, r, u, h = ASSIGN.match(line), REF.match(line), REUSE.match(line), HANDOFF.match(line)
        if m and triple(lines, i, m.group(2)):
            pick = PICK.match(m.group(1))
            sources, target = ([pick.group(2), pick.group(3)] if pick else [m.group(1)]), m.group(2)
        elif r or u:
            g = r or u
            assert g is not None
            sources, target = [g.group(2)], g.group(1)
        elif h:
            if h.group(2) not in lp.slots:
                raise Refused(f"{h.group(1)} is handed a tensor: {line.strip()}")
            sources, target = [h.group(2)], h.group(1)
        else:
            continue
        if not all(s in lp.slots for s in sources):
            continue
        if m:
            lp.new[i] = f"{_indent(line)}TorchloopSlot {target} = {m.group(1)};"
            lp.drop.update((i - 1, i + 1))
        lp.flow.add(i)
        lp.slots.add(target)
        lp.edges += [(s, target) for s in sources]


def _uses(lines: list[str], where: dict[str, list[int]], lp: Loop) -> None:
    """Refuses a slot used other than through its pointer, a reset, an item,
    a flow line or its own declaration; items become loads, the runtime's
    size checks on slots go."""
    group = _groups(lp)
    for name in lp.slots:
        cast, word = re.compile(CAST.format(name=name)), re.compile(rf"\b{name}\b")
        for i in where.get(name, []):
            line = lines[i]
            item, check, release = ITEM.match(line), CHECK.match(line), RELEASE.match(line)
            if i in lp.new or i in lp.drop or i in lp.flow:
                continue
            if RESET.match(line) or not word.search(cast.sub("", line)):
                continue
            if check and check.group(1) == name:
                lp.drop.add(i)
            elif release and release.group(2) == name:
                lp.new[i] = _copy_out(lp, group[name], name, release.group(1), _indent(line))
            elif item and item.group(3) == name:
                dtypes = {lp.arena[s].dtype for s in group[name] if s in lp.arena}
                if dtypes != {item.group(2)} or item.group(2) not in ITEM_TYPE:
                    raise Refused(f"item_{item.group(2)} of {name} ({dtypes})")
                lp.new[i] = (f"{item.group(1)}{item.group(4)} = "
                             f"*static_cast<const {ITEM_TYPE[item.group(2)]}*>({name}.data_ptr());")
            else:
                raise Refused(f"{name} used as a tensor: {line.strip()}")


def _copy_out(lp: Loop, group: set[str], name: str, out: str, ind: str) -> str:
    """An output the wrapper released from slot name: a new tensor shaped
    as the arena's buffers of its group, with name's data copied in."""
    shapes = {lp.arena[s] for s in group if s in lp.arena}
    like = next(iter(shapes), None)
    if like is None or len({(b.dtype, b.ndim, b.nbytes) for b in shapes}) != 1:
        raise Refused(f"{name} released with no one shape")
    out_name = f"{name}_out"
    return "\n".join([
        f"{ind}AtenTensorHandle {out_name}_handle;",
        f"{ind}AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided({like.ndim}, {like.sizes}, "
        f"{like.strides}, cached_torch_dtype_{like.dtype}, cached_torch_device_type_cpu, "
        f"this->device_idx_, &{out_name}_handle));",
        f"{ind}RAIIAtenTensorHandle {out_name}({out_name}_handle);",
        f"{ind}std::memcpy({out_name}.data_ptr(), {name}.data_ptr(), {like.nbytes});",
        f"{ind}{out} = {out_name}.release();",
    ])


def _groups(lp: Loop) -> dict[str, set[str]]:
    """Each slot -> the slots its values come from or go to."""
    group = {s: {s} for s in lp.slots}
    for a, b in lp.edges:
        if a in group and b in group and group[a] is not group[b]:
            merged = group[a] | group[b]
            for s in merged:
                group[s] = merged
    return group


def _rewrite(lines: list[str], mark: int, n: int) -> Loop:
    """The rewrite of the loop marked at line mark (raises Refused)."""
    start = next(i for i in range(mark, len(lines)) if lines[i].strip() == "while (1) {")
    end = _loop_end(lines, start)
    if end is None:
        raise Refused("the loop's braces")
    lp = Loop(mark, start, end)
    where = index(lines)
    _arena(lines, where, lp, n)
    _flows(lines, where, lp)
    _uses(lines, where, lp)
    lp.new[mark] = "\n".join(_arena_lines(_indent(lines[mark]), f"torchloop_arena{n}", lp.size))
    return lp


def slot_loops(lines: list[str]) -> tuple[dict[int, str], set[int], int, list[str]]:
    """The rewrite of each loop loop_pass marked, on pointers where it can
    be: (new lines, dropped lines, loops rewritten, why each other was left)."""
    marks = [i for i, s in enumerate(lines) if s.strip() == MARK]
    new: dict[int, str] = {}
    drop: set[int] = set()
    refused = []
    for n, mark in enumerate(marks):
        try:
            lp = _rewrite(lines, mark, n)
        except Refused as e:
            refused.append(str(e))
            drop.add(mark)
            continue
        new.update(lp.new)
        drop |= lp.drop
    return new, drop, len(marks) - len(refused), refused


FRAME_MAX_BUFFER = 64 * 1024  # bytes: larger buffers cost their arithmetic, not their allocation
FRAME_MAX = 1024 * 1024  # bytes: what the frame may hold alive for the whole run
END_RUN_IMPL = "} // AOTInductorModel::run_impl"


def _frame_chain(lines: list[str], where: dict[str, list[int]], at: int, name: str,
                 end: int) -> bool:
    """Whether every line naming name or a reuse of it (after its triple at
    at, before end) uses it only through `.data_ptr()`, a reset or a reuse."""
    names = [name]
    for n in names:  # grows with the reuses found
        word, ptr = re.compile(rf"\b{n}\b"), re.compile(rf"\b{n}\.data_ptr\(\)")
        for i in where.get(n, []):
            if i in (at - 1, at, at + 1):
                continue
            reuse, reset = REUSE.match(lines[i]) or REF.match(lines[i]), RESET.match(lines[i])
            if not at < i < end:
                return False
            if reuse and reuse.group(1) == n:  # its own definition
                continue
            if reuse and reuse.group(2) == n:
                names.append(reuse.group(1))
            elif not (reset and reset.group(1) == n) and word.search(ptr.sub("", lines[i])):
                return False
    return True


def frame_arena(lines: list[str]) -> tuple[dict[int, str], set[int], int]:
    """run_impl's small buffers, allocated at its top level and used only
    through their data pointers, placed in one allocation per run: (new
    lines, dropped lines, buffers placed)."""
    start = next((i for i, s in enumerate(lines) if s.startswith(RUN_IMPL)), None)
    end = next((i for i, s in enumerate(lines) if s.startswith(END_RUN_IMPL)), None)
    if start is None or end is None:
        return {}, set(), 0
    where = index(lines)
    new: dict[int, str] = {}
    drop: set[int] = set()
    size, first = 0, None
    for i in range(start, end):
        m = ALLOC.match(lines[i])
        if not (m and _indent(lines[i]) == "    " and triple(lines, i, m.group(5))
                and m.group(4) in ELEMENT):
            continue
        try:
            sizes, strides = _array(lines, where, m.group(2)), _array(lines, where, m.group(3))
        except Refused:
            continue
        nbytes = _nbytes(sizes, strides, m.group(4))
        offset = -(-size // ALIGN) * ALIGN
        if (len(sizes) != int(m.group(1)) or nbytes > FRAME_MAX_BUFFER or offset + nbytes > FRAME_MAX
                or not _frame_chain(lines, where, i, m.group(5), end)):
            continue
        first = i - 1 if first is None else first
        new[i] = f"    TorchloopSlot {m.group(5)}{{torchloop_frame_base + {offset}}};"
        drop.update((i - 1, i + 1))
        size = offset + nbytes
    if first is None:
        return {}, set(), 0
    new[first] = "\n".join(_arena_lines("    ", "torchloop_frame", size))
    return new, drop, len(new) - 1


def _apply(lines: list[str], new: dict[int, str], drop: set[int]) -> list[str]:
    kept = [new.get(i, s) for i, s in enumerate(lines) if i not in drop or i in new]
    return "\n".join(kept).split("\n")


def slot_wrapper(code: str) -> tuple[str, int, int, list[str]]:
    """code with its marked loops and its run's small buffers on pointers
    into arenas; (new code, loops rewritten, run buffers placed, why each
    other marked loop was left)."""
    lines = code.split("\n")
    if not any(s.startswith(RUN_IMPL) for s in lines):
        marks = [s for s in lines if s.strip() == MARK]
        return "\n".join(s for s in lines if s.strip() != MARK), 0, 0, ["no run_impl"] * len(marks)
    new, drop, loops, refused = slot_loops(lines)
    lines = _apply(lines, new, drop)
    new, drop, frame = frame_arena(lines)
    lines = _apply(lines, new, drop)
    if loops + frame:
        at = next(i for i, s in enumerate(lines) if s.startswith(RUN_IMPL))
        lines[at:at] = SLOT_STRUCT
    return "\n".join(lines), loops, frame, refused
