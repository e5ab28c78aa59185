"""The torchloop package installed outside the checkout (client/python/setup.py):
from another working directory into a directory of its own, it builds its C
codec (the headers are found from setup.py, not from the working directory)
and ships its type information; a copy of client/python without the
checkout's proto/ fails loudly when the codec is required and says so when
it is not."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXT = str(sysconfig.get_config_var("EXT_SUFFIX"))


def pip_install(src: Path, target: Path, cwd: Path,
                require: bool) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("TORCHLOOP_BUILD_FAST", None)
    if require:
        env["TORCHLOOP_BUILD_FAST"] = "require"
    return subprocess.run(
        [sys.executable, "-m", "pip", "install", "-v", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(target), str(src)],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_an_install_elsewhere_builds_the_c_codec_and_ships_its_types(tmp_path: Path) -> None:
    site = tmp_path / "site"
    done = pip_install(ROOT / "client" / "python", site, tmp_path, require=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    pkg = site / "torchloop"
    assert (pkg / f"_fast{EXT}").is_file()
    assert (pkg / "py.typed").is_file() and (pkg / "_fast.pyi").is_file()
    # imported from there (not from the checkout), the C codec is in use
    probe = ("import torchloop, torchloop._wire as w; "
             "print(torchloop.__file__); print(w.fast is not None)")
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    where, fast = out.stdout.split()[-2:]
    assert Path(where).resolve().is_relative_to(site.resolve()), where
    assert fast == "True"


def test_a_copy_without_the_headers_fails_loudly_when_the_codec_is_required(
        tmp_path: Path) -> None:
    copy = tmp_path / "python"
    shutil.copytree(ROOT / "client" / "python", copy,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "*.so", "__pycache__"))
    required = pip_install(copy, tmp_path / "a", tmp_path, require=True)
    assert required.returncode != 0
    text = required.stdout + required.stderr
    assert "the C codec (_fast) did not build" in text and "protocol.h" in text, text[-3000:]
    # not required: installed on the Python codec, with a warning that says so
    optional = pip_install(copy, tmp_path / "b", tmp_path, require=False)
    assert optional.returncode == 0, optional.stderr[-3000:]
    assert "WARNING: torchloop: the C codec (_fast) did not build" in optional.stdout + optional.stderr
    assert not list((tmp_path / "b" / "torchloop").glob("_fast*.so"))
    assert (tmp_path / "b" / "torchloop" / "client.py").is_file()
