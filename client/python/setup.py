"""The C codec's build (torchloop/_fast*.c); everything else is in pyproject.toml.

_fast.c includes proto/protocol.h and proto/busypoll.h from the checkout this
directory belongs to (found from this file, whatever the working directory).
Without a C compiler or those headers the package installs and runs on
_wire.py alone, with a warning; TORCHLOOP_BUILD_FAST=require turns that into
a failed install (make setup and the tests ask for it).
"""

import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO = os.path.normpath(os.path.join(HERE, "..", "..", "proto"))
REQUIRED = os.environ.get("TORCHLOOP_BUILD_FAST", "") == "require"
HEADERS = ("protocol.h", "busypoll.h")
FAST_SOURCES = ["torchloop/_fast.c", "torchloop/_fast_enc.c", "torchloop/_fast_dec.c"]


class BuildFast(build_ext):
    """Builds _fast or says loudly why not (and fails when it is required)."""

    def run(self) -> None:
        missing = [h for h in HEADERS if not os.path.exists(os.path.join(PROTO, h))]
        try:
            if missing:
                raise OSError(f"{', '.join(missing)} not found in {PROTO} (the torchloopd "
                              "checkout's proto/): install from the checkout's client/python")
            super().run()
        except Exception as exc:  # noqa: BLE001 - reported, then raised or skipped
            if REQUIRED:
                raise SystemExit(f"torchloop: the C codec (_fast) did not build: {exc}") from exc
            print(f"WARNING: torchloop: the C codec (_fast) did not build ({exc}); the "
                  "package runs on its Python codec (slower). TORCHLOOP_BUILD_FAST=require "
                  "makes this an error.", flush=True)


setup(
    ext_modules=[Extension(
        "torchloop._fast", sources=FAST_SOURCES, depends=["torchloop/_fast.h"],
        include_dirs=[PROTO],
        extra_compile_args=["-std=c11", "-O2", "-Wall", "-Wextra", "-Werror"],
        optional=not REQUIRED)],
    cmdclass={"build_ext": BuildFast},
)
