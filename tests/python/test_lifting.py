"""The compile worker's lifting of the tensors a body captures from its module
into torch's scan op (daemon/worker/torchloop_worker/scan.py: captured_tensors,
rebound, Scan.hop), run eagerly -- no compile -- against a hand-written loop.

The body reaches its weights through a module-level helper, so these tests
fail if the lifted values do not reach the helpers as well as the body.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "daemon" / "worker"))
from torchloop_worker.compile import step_ops  # noqa: E402
from torchloop_worker.errors import JobError  # noqa: E402
from torchloop_worker.job import Job, load_body  # noqa: E402
from torchloop_worker.lowering import FlatModule  # noqa: E402
from torchloop_worker.scan import Scan, captured_tensors  # noqa: E402
from torchloop_worker.specs import tree_spec  # noqa: E402

SOURCE = '''
import pytest
import torch

W = torch.tensor([[2.0, 0.0], [1.0, 3.0]], dtype=torch.float64)
S = torch.tensor(0.5, dtype=torch.float64)
LIMIT = 4.0  # not a tensor: stays as it is


def helper(c):
    return (c @ W).clamp(-LIMIT, LIMIT)


def body(carry, x):
    c = helper(carry) * S + x
    return c, c.sum(-1)
'''


def _body():
    job = Job(body_source=SOURCE, body_file="<test_lifting>", entry="body")
    return load_body(job)


def _scan(body, carry, xs, strategy="scan"):
    return Scan(body=body, carry_spec=tree_spec(carry, "carry"),
                  inputs_spec=tree_spec(xs, "inputs"), steps=xs.shape[0],
                  dtype="float64", strategy=strategy)


def _by_hand(carry, xs, weight, scale):
    ys = []
    for x in xs:
        carry = (carry @ weight).clamp(-4.0, 4.0) * scale + x
        ys.append(carry.sum(-1))
    return carry, torch.stack(ys)


def _inputs():
    gen = torch.Generator().manual_seed(3)
    return (torch.rand(5, 2, dtype=torch.float64, generator=gen),
            torch.rand(6, 5, 2, dtype=torch.float64, generator=gen))


def test_captured_tensors_are_the_modules_tensors_named_in_its_functions():
    names = [n for n, _ in captured_tensors(_body())]
    assert names == ["S", "W"]


def test_the_scan_op_over_the_modules_own_tensors_is_the_loop():
    body = _body()
    carry, xs = _inputs()
    final, ys = _scan(body, carry, xs).forward(carry, xs)
    want_c, want_y = _by_hand(carry, xs, body.__globals__["W"], body.__globals__["S"])
    torch.testing.assert_close(final, want_c, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ys, want_y, rtol=1e-12, atol=1e-12)


def test_lifted_values_reach_the_helper_and_leave_the_module_alone():
    body = _body()
    g = body.__globals__
    carry, xs = _inputs()
    weight = torch.tensor([[0.0, -1.0], [1.0, 0.5]], dtype=torch.float64)
    scale = torch.tensor(0.25, dtype=torch.float64)
    saved_w, saved_helper = g["W"], g["helper"]
    # the order of captured_tensors: S, W
    final, ys = _scan(body, carry, xs).forward(carry, xs, lifted=[scale, weight])
    want_c, want_y = _by_hand(carry, xs, weight, scale)
    torch.testing.assert_close(final, want_c, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ys, want_y, rtol=1e-12, atol=1e-12)
    assert g["W"] is saved_w and g["helper"] is saved_helper
    # and the unrolled loop (no lifting) still reads the module's own tensors
    final_u, _ = _scan(body, carry, xs, "unroll").forward(carry, xs)
    torch.testing.assert_close(final_u, _by_hand(carry, xs, saved_w, g["S"])[0],
                               rtol=1e-12, atol=1e-12)


def test_a_body_without_captured_tensors_is_called_as_it_is():
    src = "def body(c, x):\n    return c + x, c * x\n"
    body = load_body(Job(body_source=src, body_file="<plain>", entry="body"))
    carry, xs = _inputs()
    assert captured_tensors(body) == []
    final, ys = _scan(body, carry, xs).forward(carry, xs)
    c, want = carry, []
    for x in xs:
        c, y = c + x, c * x
        want.append(y)
    torch.testing.assert_close(final, c)
    torch.testing.assert_close(ys, torch.stack(want))


@pytest.mark.parametrize("k", [2, 3, 4, 6])
def test_blocks_of_unrolled_steps_are_the_loop_with_or_without_a_tail(k: int) -> None:
    """strategy block<K> (daemon/worker/blocked.py): the scan op over 6 // k
    blocks, 6 % k steps after, lifted tensors reaching the helper in both."""
    body = _body()
    carry, xs = _inputs()
    weight = torch.tensor([[0.0, -1.0], [1.0, 0.5]], dtype=torch.float64)
    scale = torch.tensor(0.25, dtype=torch.float64)
    final, ys = _scan(body, carry, xs, f"block{k}").forward(carry, xs, lifted=[scale, weight])
    want_c, want_y = _by_hand(carry, xs, weight, scale)
    torch.testing.assert_close(final, want_c, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ys, want_y, rtol=1e-12, atol=1e-12)
    # the module's own tensors when nothing is lifted; the export the worker compiles
    g = body.__globals__
    scan = _scan(body, carry, xs, f"block{k}")
    ep = torch.export.export(FlatModule(scan), (carry, xs), strict=False)
    got_c, got_y = ep.module()(carry, xs)
    want_c, want_y = _by_hand(carry, xs, g["W"], g["S"])
    torch.testing.assert_close(got_c, want_c, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_y, want_y, rtol=1e-12, atol=1e-12)
    # the step's ATen calls: the scan op's graph counts its loop's own (clones) too
    ops = step_ops(ep.module(), f"block{k}", 6)
    quick = step_ops(torch.export.export(FlatModule(_scan(body, carry, xs)), (carry, xs),
                                           strict=False).module(), "scan", 6)
    assert 5 <= ops <= quick  # clamp, matmul, mul, add, sum at least


@pytest.mark.parametrize("strategy,kind", [("block1", "forward"), ("block6", "forward"),
                                           ("block3", "vjp"), ("blocks", "forward"),
                                           ("block03", "forward")])
def test_a_block_strategy_the_daemon_never_sends_is_a_malformed_job(strategy: str,
                                                                     kind: str) -> None:
    with pytest.raises(JobError, match="malformed job"):
        Job.parse({"body_source": "", "entry": "body", "strategy": strategy, "kind": kind,
                     "steps": 6})
