"""The Python client's copies of the protocol's constants agree with
proto/protocol.h, the one place they are defined (the C daemon, the C client
and the CLI include it): adapter bounds and defaults, the protocol version,
the frame limit and the release version; and the fields a captured graph's
name hashes, with daemon/graph/graphs.h's ADAPTER_FIELDS."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from torchloop import _graph, _wire, adapter, client, errors

ROOT = Path(__file__).resolve().parents[2]


def header_defines() -> dict[str, str]:
    text = (ROOT / "proto" / "protocol.h").read_text()
    return dict(re.findall(r"^#define\s+(\w+)\s+(.+?)\s*(?:/\*.*)?$", text, re.M))


def c_value(expr: str) -> int:
    # the header's integer forms: 128, (1u << 30), (64u << 20)
    return int(eval(re.sub(r"(\d+)u", r"\1", expr), {}))  # noqa: S307 - our own header


def test_bounds_and_defaults_match_the_header() -> None:
    d = header_defines()
    assert adapter.MAX_STEPS == c_value(d["PROTO_MAX_STEPS"])
    assert adapter.DEFAULT_STEPS == c_value(d["PROTO_DEFAULT_STEPS"])
    assert adapter.MAX_ELEMENTS == c_value(d["PROTO_MAX_ELEMENTS"])
    assert adapter.DEFAULT_ELEMENTS == c_value(d["PROTO_DEFAULT_ELEMENTS"])
    assert adapter.DEFAULT_BUDGET == c_value(d["PROTO_DEFAULT_BUDGET"])


def test_protocol_frame_limit_and_version_match_the_header() -> None:
    d = header_defines()
    assert client.PROTOCOL == c_value(d["PROTO_VERSION"])
    assert _wire.FRAME_MAX == c_value(d["PROTO_FRAME_MAX"])
    assert _wire.ALIGN == c_value(d["PROTO_TENSOR_ALIGN"])
    release = d["TORCHLOOP_VERSION"].strip('"')
    pyproject = tomllib.loads((ROOT / "client" / "python" / "pyproject.toml").read_text())
    assert pyproject["project"]["version"] == release


def header_codes() -> set[str]:
    text = (ROOT / "proto" / "protocol.h").read_text()
    return {name for _, name in re.findall(r"X\((\w+), \"(\w+)\"", text)}


def test_error_codes_the_package_maps_are_the_headers() -> None:
    codes = header_codes()
    assert "INDEX_OUT_OF_RANGE" in codes and "ENGINE_ERROR" in codes
    for mapped in (errors.VALUE_CODES, errors.TYPE_CODES, errors.INDEX_CODES):
        assert mapped <= codes, sorted(mapped - codes)


def test_text_that_is_not_utf8_raises_a_value_error_as_a_unicode_error_would() -> None:
    assert "BAD_REQUEST" in header_codes()
    exc = errors.from_reply({"code": "BAD_REQUEST", "message": "name is not UTF-8",
                             "path": "name"})
    assert isinstance(exc, ValueError) and exc.code == "BAD_REQUEST" and exc.path == "name"


def test_an_index_out_of_range_raises_what_eager_torch_raises() -> None:
    exc = errors.from_reply({"code": "INDEX_OUT_OF_RANGE", "message": "index 20"})
    # eager: C[idx] and index_select raise IndexError, gather RuntimeError
    assert isinstance(exc, IndexError) and isinstance(exc, RuntimeError)
    assert exc.code == "INDEX_OUT_OF_RANGE"
    assert not isinstance(errors.from_reply({"code": "ENGINE_ERROR"}), IndexError)


def test_a_graph_name_hashes_the_daemons_adapter_fields_in_their_order() -> None:
    text = (ROOT / "daemon" / "graph" / "graphs.h").read_text()
    table = text[text.index("#define ADAPTER_FIELDS(X)"):]
    table = table[:table.index("\n\n")]
    keys = re.findall(r'X\(\w+,\s*"(\w+)",\s*\w+\)', table)
    assert len(keys) == 8 and tuple(keys) == _graph.IDENTITY_FIELDS
    # the vector tests/unit/test_adapter_def.c checks adapter_graph_name against
    assert _graph.identity('{"format":"torchloop.graph"}', 8, 4096, 8, "unroll", "none") == \
        "g.10c4494dda1b98148c596518a20a986642b62c18"
    # every field moves the name
    base = dict(max_steps=8, max_elements=4096, recompile_budget=8, strategy="unroll",
                dynamic="none")
    names = {_graph.identity("{}", **dict(base, **{k: v})) for k, v in [
        ("max_steps", 7), ("max_elements", 4095), ("recompile_budget", 2),
        ("strategy", "scan"), ("dynamic", "batch")]}
    assert len(names | {_graph.identity("{}", **base)}) == 6
