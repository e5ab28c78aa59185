"""Artifact checks: what the C engine cannot (or should not) load.

An artifact is refused when it needs AOTI's C++ proxy executor (an op without
a C shim), or when dlopen would leave it mapped for good or weaken the daemon:
an executable stack, text relocations, STB_GNU_UNIQUE symbols, thread-local
destructors.  The ELF headers are read once (Elf.parse).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

from .errors import JobError

PROXY_SYMBOL = b"aoti_torch_proxy_executor_call_function"
SHT_DYNSYM = 11
PT_DYNAMIC, PT_GNU_STACK = 2, 0x6474E551
PF_X = 1
DT_NULL, DT_TEXTREL, DT_FLAGS, DF_TEXTREL = 0, 22, 30, 0x4
STB_GNU_UNIQUE = 10
SYM_SIZE = 24


@dataclass(frozen=True)
class Section:
    type: int
    link: int
    offset: int
    size: int


@dataclass(frozen=True)
class Segment:
    header: int  # file offset of its program header
    type: int
    flags: int
    offset: int
    size: int


@dataclass(frozen=True)
class Elf:
    """A 64-bit little-endian ELF object's section and program headers."""

    data: bytes
    sections: list[Section]
    segments: list[Segment]

    @classmethod
    def parse(cls, data: bytes) -> Elf | None:
        if data[:4] != b"\x7fELF" or data[4] != 2:
            return None
        phoff, shoff = struct.unpack_from("<QQ", data, 0x20)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 0x36)
        sections = []
        for i in range(shnum):
            sh = struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
            sections.append(Section(type=sh[1], link=sh[6], offset=sh[4], size=sh[5]))
        segments = []
        for i in range(phnum):
            off = phoff + i * phentsize
            p_type, p_flags, p_offset = struct.unpack_from("<IIQ", data, off)
            (p_filesz,) = struct.unpack_from("<Q", data, off + 32)
            segments.append(Segment(off, p_type, p_flags, p_offset, p_filesz))
        return cls(data, sections, segments)

    def dynsyms(self) -> list[tuple[int, int, int, int]]:
        """(st_name, st_info, st_shndx, string table offset) of every .dynsym entry."""
        out = []
        for sh in self.sections:
            if sh.type != SHT_DYNSYM:
                continue
            strtab = self.sections[sh.link].offset
            for off in range(sh.offset, sh.offset + sh.size, SYM_SIZE):
                st_name, st_info, _, st_shndx = struct.unpack_from("<IBBH", self.data, off)
                out.append((st_name, st_info, st_shndx, strtab))
        return out

    def imports(self) -> set[bytes]:
        """Names of the undefined symbols in .dynsym."""
        names = set()
        for st_name, _, st_shndx, strtab in self.dynsyms():
            if st_shndx == 0 and st_name:
                end = self.data.index(b"\0", strtab + st_name)
                names.add(self.data[strtab + st_name:end])
        return names

    def problems(self) -> str:
        """Executable stack (PT_GNU_STACK with X), text relocations (DT_TEXTREL),
        symbols that pin the library in memory for good (STB_GNU_UNIQUE)."""
        issues = []
        for seg in self.segments:
            if seg.type == PT_GNU_STACK and seg.flags & PF_X:
                issues.append("executable stack")
            if seg.type == PT_DYNAMIC:
                for j in range(0, seg.size, 16):
                    tag, val = struct.unpack_from("<qQ", self.data, seg.offset + j)
                    if tag == DT_NULL:
                        break
                    if tag == DT_TEXTREL or (tag == DT_FLAGS and val & DF_TEXTREL):
                        issues.append("text relocations")
        unique = sum(info >> 4 == STB_GNU_UNIQUE for _, info, _, _ in self.dynsyms())
        if unique:
            issues.append(f"{unique} STB_GNU_UNIQUE symbols (the daemon could never unload it)")
        if b"__cxa_thread_atexit" in self.imports():
            issues.append("thread-local destructors (__cxa_thread_atexit: the daemon could "
                          "never unload it)")
        return ", ".join(sorted(set(issues)))

    def gnu_stack_flags(self) -> int | None:
        """File offset of PT_GNU_STACK's p_flags, if there is one."""
        return next((s.header + 4 for s in self.segments if s.type == PT_GNU_STACK), None)


def check_artifact(so_path: str, job_dir: str) -> None:
    """Refuses artifacts the C engine cannot (or should not) load.

    An op without a C shim is called through AOTI's C++ proxy executor: the
    generated code imports aoti_torch_proxy_executor_call_function and
    torch 2.14 writes the extern nodes to <key>.wrapper.json in the compile's
    directory (not beside the output .so). Either sign refuses the artifact,
    naming the aten ops from the json.
    """
    with open(so_path, "rb") as f:
        elf = Elf.parse(f.read())
    jsons = sorted(
        os.path.join(root, name)
        for root, _, names in os.walk(job_dir)
        for name in names
        if name.endswith(".wrapper.json") or name == os.path.basename(so_path)[:-3] + ".json"
    )
    ops = sorted({op for path in jsons for op in extern_ops(path)})
    if ops or (elf is not None and PROXY_SYMBOL in elf.imports()):
        raise JobError(
            "PROXY_EXECUTOR_REQUIRED",
            "the graph calls "
            + (", ".join(ops) or "an op without a C shim")
            + " through AOTI's C++ proxy executor, which a C daemon cannot provide; "
            "use ops Inductor lowers or that have a C shim",
        )
    problems = elf.problems() if elf is not None else "not a 64-bit ELF shared object"
    if problems:
        raise JobError("UNSAFE_ARTIFACT", f"{os.path.basename(so_path)}: {problems}")


def extern_ops(path: str) -> list[str]:
    """The aten ops of an AOTI extern-node file ({"nodes": [{"node": {"target"}}]})."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return []
    ops = set()
    for entry in doc.get("nodes", []) if isinstance(doc, dict) else []:
        node = entry.get("node") if isinstance(entry, dict) else None
        target = node.get("target") if isinstance(node, dict) else None
        if isinstance(target, str):
            ops.add(target)
    return sorted(ops)


def clear_exec_stack(so_path: str) -> bool:
    """Clears PF_X on PT_GNU_STACK (what `execstack -c` does).

    AOTI links an object without a .note.GNU-stack section, so ld marks the
    .so as needing an executable stack although generated C++ never does
    (only GCC's nested-function trampolines need one). Returns True if the
    flag was set and has been cleared.
    """
    return set_exec_stack(so_path, False)


def set_exec_stack(so_path: str, executable: bool) -> bool:
    """Sets or clears PF_X on PT_GNU_STACK; True if the flag changed."""
    with open(so_path, "r+b") as f:
        elf = Elf.parse(f.read())
        off = elf.gnu_stack_flags() if elf is not None else None
        if elf is None or off is None:
            return False
        (flags,) = struct.unpack_from("<I", elf.data, off)
        new = flags | PF_X if executable else flags & ~PF_X
        if new == flags:
            return False
        f.seek(off)
        f.write(struct.pack("<I", new))
    return True
