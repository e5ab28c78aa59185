"""The Python client's copies of the protocol's constants agree with
proto/protocol.h, the one place they are defined (the C daemon, the C client
and the CLI include it): adapter bounds and defaults, the protocol version,
the frame limit and the release version."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from torchloop import _wire, adapter, client

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
