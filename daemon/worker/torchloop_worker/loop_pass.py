"""The scan op's while loop in the generated wrapper, with less work per
iteration (torch 2.14; installed by wrapper_pass.py, which says when).

Inductor lowers the scan op to `while (1) { cond subgraph; body subgraph;
hand the results on }`, and for the small states of a solver's step the
loop's handles cost more than its kernels.  Per iteration it allocated every
buffer its kernels write (the step's intermediates, the block's rows, the new
carry, the counter, the condition), about 0.3 us each, and made a new handle
per carried tensor for each subgraph.  Three rewrites of the wrapper's text,
each applied only where the text says plainly that it is safe:

- `hoist_buffers`: a scratch buffer -- every use of it in the loop, under its
  name or a reuse's, is a kernel's pointer or its reset -- is allocated once,
  before the loop.
- `pingpong_buffers`: a buffer handed on as the next iteration's value of a
  variable declared before the loop (`buf5 = std::move(new)`: the carry, the
  counter, the condition) is one of two allocated before the loop, taken in
  turn: iteration k writes one while the variable still holds the other
  (iteration k - 1's), which nothing else holds by then.  Only in a loop
  whose every hand-on is a new buffer or the variable's own handle.
- `alias_handles`: a handle made from a tensor (`assign_tensors_out`) that is
  only read -- a kernel's pointer, an `item` -- while its source keeps its
  tensor becomes a reference to the source; one nothing reads goes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

WORD = re.compile(r"\b\w+\b")
CAST = r"\(((?:const )?[\w:]+\*)\)\({name}\.data_ptr\(\)\)"
RESET = re.compile(r"^\s*(\w+)\.reset\(\);$")
ALLOC = re.compile(r"^\s*AOTI_TORCH_ERROR_CODE_CHECK\(aoti_torch_empty_strided\(\d+, (\w+), (\w+), "
                   r"[^;]*&(\w+)_handle\)\);$")
ARRAY = re.compile(r"^\s*static constexpr int64_t (?:\*(\w+)=nullptr|(\w+)\[\] = \{[^{}]*\});$")
ASSIGN = re.compile(r"^\s*AOTI_TORCH_ERROR_CODE_CHECK\(aoti_torch_assign_tensors_out\((\w+), "
                    r"&(\w+)_handle\)\);$")
ITEM = r"AOTI_TORCH_ERROR_CODE_CHECK\(aoti_torch_item_\w+\({name}, &\w+\)\);"
REUSE = re.compile(r"^\s*auto (\w+) = std::move\((\w+)\);\s*// reuse$")
HANDOFF = re.compile(r"^\s*(\w+) = std::move\((\w+)\);$")
LOOP = "while (1) {"
SEEN = "  // torchloop: loop rewritten"
MARK = "// torchloop: loop buffers"


def index(lines: list[str]) -> dict[str, list[int]]:
    """Each identifier -> the lines that name it, in order."""
    where: dict[str, list[int]] = {}
    for i, line in enumerate(lines):
        for w in set(WORD.findall(line)):
            where.setdefault(w, []).append(i)
    return where


def base_stable(lines: list[str], start: int, end: int, base: str) -> bool:
    """Whether base keeps its tensor from line start to line end."""
    changes = re.compile(rf"\b{base}\.reset\(|std::move\({base}\)|^\s*{base}\s*=|\b{base}\.release\(")
    return not any(changes.search(lines[i]) for i in range(start + 1, end + 1))


def triple(lines: list[str], i: int, name: str) -> bool:
    """Whether lines i - 1 and i + 1 declare name's handle and its RAII holder
    (the wrapper's three lines around an allocation or a new handle)."""
    return (0 < i < len(lines) - 1 and lines[i - 1].strip() == f"AtenTensorHandle {name}_handle;"
            and lines[i + 1].strip() == f"RAIIAtenTensorHandle {name}({name}_handle);")


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def _loop_end(lines: list[str], start: int) -> int | None:
    """The line of the brace closing the loop opened at start (at its
    indentation), or None when the braces do not say so plainly."""
    depth = 0
    for j in range(start, len(lines)):
        depth += lines[j].count("{") - lines[j].count("}")
        if depth == 0:
            return j if lines[j] == _indent(lines[start]) + "}" else None
    return None


@dataclass
class Chain:
    """An allocation in a loop and the names it goes by (reuses)."""

    at: int  # the allocation's line; the declaration before it, the RAII handle after
    names: list[str]
    reuses: list[int] = field(default_factory=list)
    resets: list[int] = field(default_factory=list)
    handoffs: list[int] = field(default_factory=list)  # `outer = std::move(name);`
    arrays: list[int] = field(default_factory=list)  # size/stride declarations in the loop


def _chain(lines: list[str], where: dict[str, list[int]], start: int, end: int,
           at: int) -> Chain | None:
    """The loop's own allocation at line at and its uses, or None when a name
    it goes by is used other than as a kernel's pointer, a reset or a
    hand-on, or outside the loop."""
    m = ALLOC.match(lines[at])
    name = m.group(3) if m else ""
    if not (m and start < at - 1 and at + 1 < end and triple(lines, at, name)
            and _indent(lines[at]) == _indent(lines[start]) + "    "):
        return None
    c = Chain(at, [name])
    for i in range(at + 2, end):
        r = REUSE.match(lines[i])
        if r and r.group(2) in c.names:
            c.names.append(r.group(1))
            c.reuses.append(i)
    for n in c.names:
        cast, word = re.compile(CAST.format(name=n)), re.compile(rf"\b{n}\b")
        for i in where.get(n, []):
            if i in (at, at + 1) or i in c.reuses:
                continue
            reset, hand = RESET.match(lines[i]), HANDOFF.match(lines[i])
            if not start < i < end:
                return None
            if reset and reset.group(1) == n:
                c.resets.append(i)
            elif hand and hand.group(2) == n:
                c.handoffs.append(i)
            elif word.search(cast.sub("", lines[i])):
                return None
    for a in (m.group(1), m.group(2)):
        decls = [i for i in where.get(a, []) if ARRAY.match(lines[i])]
        if len(decls) != 1:
            return None
        if start < decls[0] < end and decls[0] not in c.arrays:
            c.arrays.append(decls[0])
    return c


def _own_handles(lines: list[str], start: int, end: int) -> dict[str, str]:
    """Handles made in the loop from a tensor: handle -> its source."""
    found = {}
    for i in range(start + 1, end):
        m = ASSIGN.match(lines[i])
        if m:
            found[m.group(2)] = m.group(1)
    return found


def _pingpong_safe(lines: list[str], start: int, end: int, fresh: set[str]) -> bool:
    """Whether every hand-on in the loop is a new buffer (fresh) or the
    variable's own handle: then no variable holds another's old tensor."""
    own = _own_handles(lines, start, end)
    for i in range(start + 1, end):
        h = HANDOFF.match(lines[i])
        if h and h.group(2) not in fresh and own.get(h.group(2)) != h.group(1):
            return False
    return True


def _rewrite_loop(lines: list[str], start: int, end: int, n_loop: int) -> tuple[int, int]:
    """Hoists and ping-pongs the loop's buffers (lines[start: end + 1]
    replaced); (hoisted, ping-ponged)."""
    where = index(lines)
    chains = [c for at in range(start + 1, end) if (c := _chain(lines, where, start, end, at))]
    fresh = {n for c in chains for n in c.names}
    pp_ok = _pingpong_safe(lines, start, end, fresh)
    before: list[str] = []
    moved: set[int] = set()
    drop: set[int] = set()
    flip = f"torchloop_turn{n_loop}"
    hoisted = pingponged = 0
    for c in chains:
        if c.handoffs and not (pp_ok and len(c.handoffs) == 1):
            continue
        before += [lines[i] for i in c.arrays if i not in moved]
        moved.update(c.arrays)
        name, three = c.names[0], lines[c.at - 1: c.at + 2]
        if not c.handoffs:  # a scratch buffer: one, before the loop
            before += three
            moved.update(range(c.at - 1, c.at + 2))
            drop.update(c.resets)
            for i in c.reuses:
                r = REUSE.match(lines[i])
                assert r is not None
                lines[i] = f"{_indent(lines[i])}auto& {r.group(1)} = {r.group(2)};  // reuse (hoisted)"
            hoisted += 1
            continue
        for k in (0, 1):  # handed on: two, before the loop, taken in turn
            before += [re.sub(rf"\b{name}(_handle)?\b", lambda m: f"{name}_turn{k}{m.group(1) or ''}", t)
                       for t in three]
        lines[c.at] = (f"{_indent(lines[c.at])}AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_assign_tensors_out("
                       f"{flip} ? {name}_turn1 : {name}_turn0, &{name}_handle));")
        pingponged += 1
    if hoisted + pingponged:  # where loop_slots.py finds the loop's buffers
        before.insert(0, f"{_indent(lines[start])}{MARK}")
    if pingponged:
        before.append(f"{_indent(lines[start])}int {flip} = 0;")
        lines[end] = f"{_indent(lines[start])}    {flip} ^= 1;\n{lines[end]}"
    kept = [s for i, s in enumerate(lines[start: end + 1], start) if i not in drop and i not in moved]
    lines[start: end + 1] = before + "\n".join(kept).split("\n")
    return hoisted, pingponged


def loop_buffers(code: str) -> tuple[str, int, int]:
    """code with each scan-op loop's scratch buffers allocated once before
    the loop, and the buffers it hands on taken in turn from two allocated
    before it; (new code, buffers hoisted, buffers ping-ponged)."""
    lines = code.split("\n")
    hoisted = pingponged = n_loop = 0
    while True:
        start = next((i for i, s in enumerate(lines) if s.strip() == LOOP), None)
        if start is None:
            break
        end = _loop_end(lines, start)
        lines[start] += SEEN
        if end is not None:
            h, p = _rewrite_loop(lines, start, end, n_loop)
            hoisted, pingponged = hoisted + h, pingponged + p
        n_loop += 1
    return "\n".join(lines).replace(SEEN, ""), hoisted, pingponged


def _handle_uses(lines: list[str], where: dict[str, list[int]], name: str,
                 skip: set[int]) -> tuple[list[int], list[int]] | None:
    """(lines reading name: a kernel's pointer or an item; lines resetting
    it) outside skip, or None when a line uses it any other way."""
    cast, word = re.compile(CAST.format(name=name)), re.compile(rf"\b{name}\b")
    item = re.compile(ITEM.format(name=name))
    reads, resets = [], []
    for i in where.get(name, []):
        if i in skip:
            continue
        reset = RESET.match(lines[i])
        if reset and reset.group(1) == name:
            resets.append(i)
        elif word.search(item.sub("", cast.sub("", lines[i]))):
            return None
        else:
            reads.append(i)
    return reads, resets


def alias_handles(code: str) -> tuple[str, int]:
    """code with each new handle to a tensor that is only read, and only
    while its source keeps its tensor, replaced by a reference to the
    source; one that is not used at all, dropped.  (new code, handles)"""
    lines = code.split("\n")
    where = index(lines)
    drop: set[int] = set()
    replaced = 0
    for i, line in enumerate(lines):
        m = ASSIGN.match(line)
        name = m.group(2) if m else ""
        if not (m and triple(lines, i, name)):
            continue
        uses = _handle_uses(lines, where, name, {i, i + 1})
        if uses is None:
            continue
        reads, resets = uses
        if reads and not base_stable(lines, i, reads[-1], m.group(1)):
            continue
        drop.update([i - 1, i, *resets])
        if reads:
            lines[i + 1] = f"{_indent(lines[i + 1])}auto& {name} = {m.group(1)};  // a handle's reads"
        else:
            drop.add(i + 1)
        replaced += 1
    return "\n".join(s for j, s in enumerate(lines) if j not in drop), replaced
