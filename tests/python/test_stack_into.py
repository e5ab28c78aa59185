"""The compile worker's stacked results written straight into the daemon's
result buffers (daemon/worker/torchloop_worker/stack_into.py: StackIntoOutputs, the
torchloop::cat_into_ op and its Inductor lowering, build_placed).

The pattern tests trace small functions with make_fx and Inductor's own
decompositions (torch.stack becomes the cat + view the post-grad graph holds),
run the pass, and run the rewritten graph eagerly; one test AOT-compiles an
unrolled loop with the pass and runs it against a hand-written eager loop.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "daemon" / "worker"))
from torchloop_worker import stack_into  # noqa: E402
from torchloop_worker import wrapper_pass  # noqa: E402
from torchloop_worker.build import build_artifact, build_placed  # noqa: E402
from torchloop_worker.errors import JobError  # noqa: E402
from torchloop_worker.lowering import OutModule  # noqa: E402

F64 = torch.float64


def _trace(fn, *args):
    return make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args)


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _rand(*shape, seed=0, dtype=F64):
    return torch.rand(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def test_a_stack_copied_into_a_result_buffer_becomes_cat_into():
    def fn(out, a, b):
        out.copy_(torch.stack([a * 2, b + 1, a]))
        return out

    a, b = _rand(2, 4, seed=1), _rand(2, 4, seed=2)
    gm = _trace(fn, torch.empty(3, 2, 4, dtype=F64), a, b)
    placer = stack_into.StackIntoOutputs()
    placer(gm.graph)
    gm.recompile()
    targets = _targets(gm)
    assert placer.rewritten == 1
    assert stack_into.cat_into_op() in targets
    assert torch.ops.aten.copy_.default not in targets
    assert torch.ops.aten.cat.default not in targets

    out = torch.full((3, 2, 4), float("nan"), dtype=F64)
    got = gm(out, a, b)
    # by hand: row t of the stack is the t-th tensor
    assert torch.equal(out[0], a * 2) and torch.equal(out[1], b + 1) and torch.equal(out[2], a)
    assert got.data_ptr() == out.data_ptr()


def test_a_cat_along_dim_0_of_unequal_parts_is_placed_in_order():
    def fn(out, a, b):
        out.copy_(torch.cat([a, b * 3]))
        return out

    a, b = _rand(1, 3, seed=3), _rand(2, 3, seed=4)
    gm = _trace(fn, torch.empty(3, 3, dtype=F64), a, b)
    placer = stack_into.StackIntoOutputs()
    placer(gm.graph)
    gm.recompile()
    assert placer.rewritten == 1
    out = torch.zeros(3, 3, dtype=F64)
    gm(out, a, b)
    assert torch.equal(out, torch.tensor([[*a[0]], [*(b[0] * 3)], [*(b[1] * 3)]], dtype=F64))


@pytest.mark.parametrize("case", ["cat_dim_1", "transposed_buffer", "other_dtype", "cat_used_twice",
                                  "not_an_input"])
def test_copies_the_pass_must_not_touch_stay_as_they_are(case):
    a, b = _rand(2, 3, seed=5), _rand(2, 3, seed=6)
    if case == "cat_dim_1":
        def fn(out, a, b):
            out.copy_(torch.cat([a, b], dim=1))
            return out
        args = (torch.empty(2, 6, dtype=F64), a, b)
    elif case == "transposed_buffer":
        def fn(out, a, b):
            out.copy_(torch.cat([a, b]))
            return out
        args = (torch.empty(3, 4, dtype=F64).t(), a, b)
    elif case == "other_dtype":
        def fn(out, a, b):
            out.copy_(torch.cat([a, b]))
            return out
        args = (torch.empty(4, 3, dtype=torch.float32), a, b)
    elif case == "cat_used_twice":
        def fn(out, a, b):
            c = torch.cat([a, b])
            out.copy_(c)
            return out, c.sum()
        args = (torch.empty(4, 3, dtype=F64), a, b)
    else:
        def fn(out, a, b):
            scratch = torch.empty(4, 3, dtype=F64)
            scratch.copy_(torch.cat([a, b]))
            return out.copy_(scratch * 2)
        args = (torch.empty(4, 3, dtype=F64), a, b)

    gm = _trace(fn, *args)
    before = [str(n.format_node()) for n in gm.graph.nodes]
    placer = stack_into.StackIntoOutputs()
    placer(gm.graph)
    assert placer.rewritten == 0
    assert [str(n.format_node()) for n in gm.graph.nodes] == before


def test_compiled_unrolled_loop_writes_its_stacks_into_the_buffers(tmp_path):
    """An AOT compile with the pass: two stacked outputs, one of them the
    carry itself (also the final carry) and one a row of the inputs (an
    input view: copied in, not placed), against the eager loop by hand."""
    steps = 4

    class Loop(torch.nn.Module):
        def forward(self, c, xs):
            ys, zs = [], []
            for t in range(steps):
                c = torch.tanh(c * 0.5 + xs[t])
                ys.append(c)
                zs.append(xs[t])
            return c, torch.stack(ys), torch.stack(zs)

    c0, xs = _rand(2, 3, seed=7), _rand(steps, 2, 3, seed=8)
    bufs = (torch.empty(2, 3, dtype=F64), torch.empty(steps, 2, 3, dtype=F64),
            torch.empty(steps, 2, 3, dtype=F64))
    inner = torch.export.export(Loop(), (c0, xs), strict=False).module()
    ep = torch.export.export(OutModule(inner, 2), (c0, xs, *bufs), strict=False)
    placer = stack_into.StackIntoOutputs()
    so = build_artifact(ep.module(), (c0, xs, *bufs), str(tmp_path / "graph.so"), False, placer)
    assert placer.rewritten == 2

    runner = torch._C._aoti.AOTIModelContainerRunnerCpu(so, 1)
    given = [torch.full_like(b, float("nan")) for b in bufs]
    got = runner.run([c0, xs, *given])

    c, ys = c0, []
    for t in range(steps):
        c = torch.tanh(c * 0.5 + xs[t])
        ys.append(c)
    assert torch.allclose(given[0], c, rtol=0, atol=1e-12)
    assert torch.allclose(given[1], torch.stack(ys), rtol=0, atol=1e-12)
    assert torch.equal(given[2], xs)
    assert [g.data_ptr() for g in got] == [b.data_ptr() for b in given]


def _builder(fail_with_placer, rewritten=1, transient=False):
    calls = []

    def build(name, placer):
        calls.append((name, placer is not None))
        if placer is not None:
            placer.rewritten = rewritten
            if fail_with_placer:
                raise JobError("PARITY_FAILED", "the graph does not match eager",
                           transient=transient)
        return name

    return build, calls


def test_build_placed_uses_the_pass_when_it_works():
    build, calls = _builder(fail_with_placer=False)
    notes = []
    assert build_placed(build, notes) == "graph.so"
    assert calls == [("graph.so", True)] and notes == []


def test_build_placed_builds_again_without_the_pass_when_a_rewritten_graph_fails():
    build, calls = _builder(fail_with_placer=True)
    notes = []
    assert build_placed(build, notes) == "graph-copied.so"
    assert calls == [("graph.so", True), ("graph-copied.so", False)]
    assert len(notes) == 1 and "PARITY_FAILED" in notes[0]


@pytest.mark.parametrize("rewritten,transient", [(0, False), (1, True)])
def test_build_placed_does_not_retry_what_the_pass_did_not_cause(rewritten, transient):
    build, calls = _builder(fail_with_placer=True, rewritten=rewritten, transient=transient)
    with pytest.raises(JobError):
        build_placed(build, [])
    assert calls == [("graph.so", True)]


def test_build_placed_builds_again_without_the_wrapper_rewrite_when_a_rewritten_graph_fails():
    """Nothing placed, but wrapper_pass.py changed the wrapper: the second
    build has the pass off, and the pass is on again after it."""
    seen = []

    def build(name, placer):
        seen.append((name, wrapper_pass.STATE.on))
        if placer is not None:
            wrapper_pass.STATE.changed = 3
            raise JobError("MISCOMPILE", "max |compiled - eager| = 1")
        return name

    notes = []
    assert build_placed(build, notes) == "graph-copied.so"
    assert seen == [("graph.so", True), ("graph-copied.so", False)]
    assert wrapper_pass.STATE.on and len(notes) == 1 and "MISCOMPILE" in notes[0]
