"""The daemon's layering (docs/architecture.md), checked on the build under test.

The layers are daemon/'s folders: base/ (leaf modules: engine, cache,
compiler supervision, signature, runner, log, ...), graph/ (adapters,
specializations, the cold path, runs, the tier, the index), server/
(connections, requests, shared memory, start-up) and ops/ (one file per op
and the op table).

- No call cycle between daemon/ and proto/ files: the file-level graph of
  which object file uses which other's symbols (nm) has no strongly connected
  component of more than one file.  main.c wires the layers and is left out.
- base/ calls only base/ and proto/; graph/ calls nothing of server/ or ops/.
- No include cycle between their headers.
- The graph layer includes no server header and names no server type (the
  files also poison the names for the compiler).

Each check is also run on a made-up graph with a cycle, so that a check
that cannot fail is caught here too.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / os.environ.get("TORCHLOOP_TEST_BUILD", "build")
LAYERS = ("base", "graph", "server", "ops")


def layer_files(layer: str, ext: str) -> list[Path]:
    return sorted((ROOT / "daemon" / layer).glob(f"*.{ext}"))


GRAPH_LAYER = [p.name for p in layer_files("graph", "c")]
SERVER_HEADERS = tuple(p.name for layer in ("server", "ops") for p in layer_files(layer, "h"))


def test_every_daemon_source_is_in_a_layer_folder() -> None:
    loose = sorted(p.name for p in (ROOT / "daemon").glob("*.[ch]"))
    assert loose == [], f"daemon/ files outside a layer folder: {loose}"
    assert len(GRAPH_LAYER) > 5 and SERVER_HEADERS, "the layer folders are missing"


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def call_graph(objs: list[Path]) -> dict[str, set[str]]:
    defined: dict[str, str] = {}
    used: dict[str, set[str]] = {}
    for o in objs:
        name = o.stem
        used[name] = set()
        out = subprocess.run(["nm", str(o)], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[1] in "TDBR":
                defined[parts[2]] = name
            elif len(parts) == 2 and parts[0] == "U":
                used[name].add(parts[1])
    return {f: {defined[s] for s in syms if s in defined and defined[s] != f}
            for f, syms in used.items()}


def test_no_call_cycle_between_daemon_files() -> None:
    if shutil.which("nm") is None:
        pytest.fail("nm (binutils) is not installed: the layering cannot be checked")
    layer_of = {p.stem: layer for layer in LAYERS for p in layer_files(layer, "c")}
    objs = [o for layer in LAYERS for o in sorted((BUILD / "daemon" / layer).glob("*.o"))
            if o.stem in layer_of and o.stem != "main"]
    objs += sorted((BUILD / "proto").glob("*.o"))
    assert len(objs) > 20, f"no daemon objects in {BUILD}: build first"
    graph = call_graph(objs)
    assert cycles(graph) == [], "files that call each other (directly or around a loop)"
    allowed = {"base": {"base"}, "graph": {"base", "graph"}}
    for f, callees in graph.items():
        layer = layer_of.get(f)
        if layer not in allowed:
            continue
        above = {c for c in callees if layer_of.get(c, "proto") not in allowed[layer] | {"proto"}}
        assert not above, f"daemon/{layer}/{f}.c calls into a layer above: {sorted(above)}"


def includes(path: Path) -> set[str]:
    return set(re.findall(r'^#include "([^"]+)"', path.read_text(), re.M))


def test_no_include_cycle_and_the_graph_layer_includes_no_server_header() -> None:
    headers = {p.name: p for layer in LAYERS for p in layer_files(layer, "h")}
    headers.update({p.name: p for p in (ROOT / "proto").glob("*.h")})
    graph = {name: includes(p) & headers.keys() for name, p in headers.items()}
    assert cycles(graph) == []

    def closure(start: set[str]) -> set[str]:
        seen: set[str] = set()
        todo = list(start)
        while todo:
            h = todo.pop()
            if h in seen or h not in graph:
                continue
            seen.add(h)
            todo.extend(graph[h])
        return seen

    for f in GRAPH_LAYER:
        src = ROOT / "daemon" / "graph" / f
        reach = closure(includes(src))
        assert not reach & set(SERVER_HEADERS), f"{f} reaches {reach & set(SERVER_HEADERS)}"
        text = src.read_text()
        assert "#pragma GCC poison request conn outmsg daemon" in text, f
    assert not closure({"graphs.h"}) & set(SERVER_HEADERS)


def test_the_docs_cold_path_table_matches_the_stage_enum_and_table() -> None:
    """docs/architecture.md, "The cold path", lists exactly the stages of
    enum load_stage, in order, and coldpath.c's table has a row for each."""
    header = (ROOT / "daemon" / "graph" / "graphs_internal.h").read_text()
    body = re.search(r"enum load_stage \{(.*?)\};", header, re.S)
    assert body, "enum load_stage not found"
    enum = [m for m in re.findall(r"\bSTAGE_([A-Z_]+)\b", body.group(1))]
    assert enum and "STAGES" not in enum
    table = re.findall(r"\[STAGE_([A-Z_]+)\] = \{", (ROOT / "daemon" / "graph" / "coldpath.c").read_text())
    assert table == enum, f"coldpath.c's stages table {table} vs the enum {enum}"
    docs = (ROOT / "docs" / "architecture.md").read_text()
    section = docs.split("## The cold path", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([A-Z_]+)` \|", section, re.M)
    assert rows == enum, f"docs/architecture.md's cold path table {rows} vs the enum {enum}"
