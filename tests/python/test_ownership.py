"""Ownership of a captured graph's adapter (issue 53, rows 6 and 7), as uid
65534 against an adapter root registered: another user can neither replace
it -- its name hashes every field of its definition (daemon/graph/graphs.h,
ADAPTER_FIELDS), an `entry` on a graph is refused -- nor spend its
recompile budget: each uid has a share of its own.

Compiles: T = 1, 2 (65534's share) and 3 (root's) of one tiny body, once per
shared cache; every refusal is answered before any compile.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import torchloop
from torchloop._graph import identity

# budget 2: the attacker's two T spend its own share, not root's
DEF = dict(max_steps=4, max_elements=64, recompile_budget=2, strategy="unroll", dynamic="none")
CHANGED = dict(max_steps=3, max_elements=63, recompile_budget=3, strategy="scan",
               dynamic="batch")


def step(c: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return c + x, c + x


ATTACKER = textwrap.dedent("""\
    import json, os, sys, torch, torchloop
    from torchloop._graph import identity
    sock, text, D, CHANGED = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
    # torch and the package are imported as root (65534 cannot read them); the
    # daemon reads the peer's uid at connect
    os.setgid(65534)
    os.setuid(65534)
    c = torchloop.Client(sock)
    victim = identity(text, **D)
    def code(fn):
        try:
            fn()
            return ["OK", ""]
        except torchloop.TorchloopError as exc:
            return [exc.code, exc.message]
    out = {"uid": os.getuid()}
    # row 6: the victim's name with each field of the definition changed
    out["changed"] = {k: code(lambda k=k, v=v: c.register_graph(victim, text, **dict(D, **{k: v})))
                      for k, v in CHANGED.items()}
    out["expected"] = {k: identity(text, **dict(D, **{k: v})) for k, v in CHANGED.items()}
    out["entry"] = code(lambda: c.call("register", name=victim, body_graph=text, entry="other", **D))
    out["same"] = c.register_graph(victim, text, **D)
    out["health"] = c.health()["ready"]
    # row 7: scans at two new T spend 65534's own share; a third is refused
    carry = torch.zeros(2, dtype=torch.float64)
    for t in (1, 2, 3):
        xs = torch.arange(2.0 * t, dtype=torch.float64).reshape(t, 2)
        def scan(xs=xs):
            final, _ = c.scan(victim, carry, xs, params=())
            assert torch.equal(final, xs.sum(0)), (final, xs)
        out[f"T{t}"] = code(scan)
    out["health_after"] = c.health()["ready"]
    print(json.dumps(out))
    """)


def attacker(sock: str, text: str) -> dict[str, Any]:
    env = dict(os.environ, HOME="/tmp")
    proc = subprocess.run([sys.executable, "-c", ATTACKER, sock, text, json.dumps(DEF),
                           json.dumps(CHANGED)],
                          capture_output=True, text=True, env=env, timeout=600, cwd="/")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def scan(client: torchloop.Client, name: str, t: int) -> None:
    xs = torch.rand(t, 2, dtype=torch.float64)
    carry = torch.rand(2, dtype=torch.float64)
    final, ys = client.scan(name, carry, xs, params=())
    torch.testing.assert_close(final, carry + xs.sum(0), rtol=0, atol=1e-12)
    torch.testing.assert_close(ys, carry + xs.cumsum(0), rtol=0, atol=1e-12)


def shares(desc: dict) -> dict[int, int]:
    return {s["uid"]: s["used"] for s in desc["budget_shares"]}


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to switch to uid 65534")
def test_another_uid_can_neither_replace_a_graph_nor_spend_its_budget(open_daemon: str) -> None:
    from test_graph_loader import capture

    text = capture(step, torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64))
    name = identity(text, **DEF)
    with torchloop.Client(open_daemon) as client:
        client.register_graph(name, text, **DEF)
        before = client.describe(name)
        out = attacker(open_daemon, text)
        assert out["uid"] == 65534
        # row 6: every other definition under the victim's name is refused,
        # naming the name that definition has (the package's = the daemon's)
        for k in CHANGED:
            code, message = out["changed"][k]
            assert code == "PERMISSION_DENIED", (k, code, message)
            assert out["expected"][k] in message and out["expected"][k] != name, (k, message)
        assert out["entry"][0] == "INVALID_ARGUMENT" and "entry" in out["entry"][1], out["entry"]
        assert out["same"]["unchanged"] is True and out["health"] is True
        # row 7: 65534 spent its own share (T = 1, 2), not root's
        assert out["T1"] == out["T2"] == ["OK", ""], out
        assert out["T3"][0] == "RECOMPILE_BUDGET_EXHAUSTED", out["T3"]
        assert "uid 65534 holds recompile_budget=2" in out["T3"][1], out["T3"]
        assert out["health_after"] is True
        desc = client.describe(name)
        assert desc["owner"] == before["owner"] == 0
        assert {k: desc[k] for k in DEF} == DEF and desc["entry"] == "body"
        assert shares(desc) == {65534: 2} and desc["budget_used"] == 2
        # the owner uses 65534's T = 1 for free, and its next T spends its own share
        counters = desc["counters"]
        scan(client, name, 1)
        assert shares(client.describe(name)) == {65534: 2}
        assert client.describe(name)["counters"]["compiles"] == counters["compiles"]
        scan(client, name, 3)
        desc = client.describe(name)
        assert shares(desc) == {65534: 2, 0: 1} and desc["budget_used"] == 3
