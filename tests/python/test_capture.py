"""Bodies captured in the solver's process (torchloop/capture.py), compiled
by the daemon: every body form the reference adapter accepts -- closures,
lambdas, partials, bound methods of modules with parameters, a step that
imports a helper from its package, Array-API code, a solver's per-run
closure over itself and a callback with carry (state, None) and a tuple of
1-D inputs -- each against the eager loop and an in-process
torch.compile(fullgraph=True, dynamic=False) of the same loop, forward and
first-order backward (captured tensors included).  Guards: a new closure
over the same objects is not captured again, a changed Python float is
(an attribute the step reads, or a free variable of a closure: a new graph),
new values of a captured tensor are neither captured nor compiled again.
Identity: two processes that build the same closure share one compile.
Who may register: uid 65534 registers and runs a graph and is refused
source; forged graphs get BAD_GRAPH and the daemon serves the next request.

Compiles: the six forms share one step graph (same math, same bounds), so
one forward and one VJP graph; the solver two; the changed float two more
plus their VJPs; the closure's changed float two forward graphs; the two
processes one.  T = 3 everywhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import FunctionType
from typing import Any, Callable

import pytest
import torch

import bodyforms  # tests/helpers (conftest.py puts it on the path)
import eager
import torchloop
from bodyforms import N, W0, Solver, make, rhs
from torchloop.errors import TorchloopError

ROOT = Path(__file__).resolve().parents[2]
BOUNDS = dict(max_steps=8, max_elements=4096)
DEFINITION = dict(BOUNDS, recompile_budget=8, strategy="unroll", dynamic="none")
T = 3
TOL = dict(rtol=1e-10, atol=1e-10)
def reference() -> Callable[..., Any]:
    """The reference adapter in process: torch.compile(fullgraph, static) of
    the loop, a code object of its own (its own recompile budget).  A test
    makes one and reuses it, as a solver keeps its adapter: dynamo's guards
    decide what it compiles again (each test stays under its 8 variants)."""
    code = eager.scan.__code__.replace()
    fn = FunctionType(code, eager.scan.__globals__)
    return torch.compile(fn, backend="inductor", fullgraph=True, dynamic=False)


def run_three(scan: Callable[..., Any], body: Callable[..., Any], carry: Any, xs: Any,
              params: list[torch.Tensor]) -> tuple[Any, list[torch.Tensor]]:
    """Forward, then first-order backward of a weighted sum: results and the
    gradients of every leaf (carry, inputs, captured tensors)."""
    leaves = [t for t in eager.leaves(carry) + eager.leaves(xs) + params]
    for t in leaves:
        t.grad = None
    final, ys = scan(body, carry, xs)
    gen = torch.Generator().manual_seed(5)
    loss = sum((t * torch.rand(t.shape, generator=gen, dtype=t.dtype)).sum()
               for t in eager.leaves(final) + eager.leaves(ys))
    loss.backward()
    grads = [t.grad.clone() for t in leaves]
    return (final, ys), grads


def assert_same(a: tuple[Any, list[torch.Tensor]], b: tuple[Any, list[torch.Tensor]]) -> None:
    for x, y in zip(eager.leaves(a[0]), eager.leaves(b[0]), strict=True):
        torch.testing.assert_close(x.detach(), y.detach(), **TOL)
    for x, y in zip(a[1], b[1], strict=True):
        torch.testing.assert_close(x, y, **TOL)


def check_against_references(adapter: Any, ref: Callable[..., Any], body: Callable[..., Any],
                             carry: Any, xs: Any, params: list[torch.Tensor]) -> None:
    ours = run_three(adapter.scan, body, carry, xs, params)
    assert_same(ours, run_three(eager.scan, body, carry, xs, params))
    assert_same(ours, run_three(ref, body, carry, xs, params))


@pytest.fixture(scope="module")
def adapter(open_daemon: str) -> Any:
    return torchloop.loop_adapter(**BOUNDS, socket=open_daemon)


def inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return bodyforms.inputs(seed, T)


def total_compiles(client: torchloop.Client) -> int:
    return sum(client.describe(a["name"])["counters"]["compiles"] for a in client.list())


def names_of(client: torchloop.Client) -> set[str]:
    return {a["name"] for a in client.list() if a["name"].startswith("g.")}


def test_every_body_form_matches_eager_and_torch_compile(adapter: Any, open_daemon: str,
                                                         tmp_path: Path) -> None:
    with torchloop.Client(open_daemon) as client:
        before = names_of(client)
        ref = reference()
        for i, form in enumerate(bodyforms.FORMS):
            body, W = bodyforms.form(form, tmp_path)
            carry, xs = inputs(i)
            try:
                check_against_references(adapter, ref, body, carry, xs, [W])
            except AssertionError as exc:
                raise AssertionError(f"{form}: {exc}") from None
        new = names_of(client) - before
        # the same math under the same bounds is one captured graph, one adapter
        assert len(new) <= 1, new
        for name in new:
            info = client.describe(name)
            assert (info["body"], info["owner"], info["persisted"]) == ("graph", os.getuid(), False)


def solver_inputs(seed: int) -> tuple[torch.Tensor, ...]:
    return bodyforms.solver_inputs(seed, T)


def check_solver(adapter: Any, ref: Callable[..., Any], solver: Solver, seed: int) -> None:
    y0, times, dts, forcing = solver_inputs(seed)

    def via(scan: Callable[..., Any]) -> tuple[Any, list[torch.Tensor]]:
        y0.grad = forcing.grad = None
        (final, _), ys = solver.run(scan, y0, times, dts, forcing)
        (final.sum() + 2.0 * ys.sum()).backward()
        return ((final, ys), [y0.grad.clone(), forcing.grad.clone()])

    ours = via(adapter.scan)
    assert_same(ours, via(eager.scan))
    assert_same(ours, via(ref))


def test_a_solver_closure_per_run_is_captured_once_and_a_changed_float_again(adapter: Any) -> None:
    capturer = adapter.scan.__self__.capturer
    solver = Solver(rhs, decay=0.25)
    ref = reference()
    check_solver(adapter, ref, solver, 1)
    seen = capturer.captures
    check_solver(adapter, ref, solver, 2)  # a new closure over the same objects, new values
    assert capturer.captures == seen, "a closure built anew per run was captured again"
    solver.decay = 0.5  # a Python float the step reads: specialised, so captured again
    check_solver(adapter, ref, solver, 3)
    assert capturer.captures == seen + 1
    # back to 0.25: both graphs are dynamo's now; its guards (checked by the
    # fast path, without dynamo's wrapper) pick the first one again
    fast = capturer.fast_calls
    solver.decay = 0.25
    check_solver(adapter, ref, solver, 4)
    assert capturer.captures == seen + 1 and capturer.fast_calls > fast


def test_a_closure_over_a_changed_python_float_is_a_new_graph(
        adapter: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """One adapter, bodyforms.make(k, W) for k = 0.3, 0.45, 0.3, 0.6: k is a
    free variable of the closure (a cell, not an attribute), a constant of
    the captured graph.  Each result against the eager loop; each new k runs
    a graph of its own, 0.3 again its first graph (no capture), and the
    three k give three results, so a reused graph cannot match eager.  Then
    one closure's cell is set to another k: the same function object runs
    that k's graph.  Compiles: two forward graphs (0.45, 0.6; 0.3 is the
    forms' graph, compiled here when this test runs alone), no VJP."""
    driver = adapter.scan.__self__
    capturer = driver.capturer
    sent: list[str] = []
    send = driver.send

    def recording(op: str, target: Any, **fields: Any) -> dict:
        sent.append(driver.name_of(target))  # the graph each request runs
        return send(op, target, **fields)

    monkeypatch.setattr(driver, "send", recording)
    W = W0.clone()
    carry, xs = (t.detach() for t in inputs(51))

    def run(body: Callable[..., Any]) -> tuple[torch.Tensor, str]:
        sent.clear()
        final, ys = adapter.scan(body, carry, xs)
        want_final, want_ys = eager.scan(body, carry, xs)
        torch.testing.assert_close(final, want_final, **TOL)
        torch.testing.assert_close(ys, want_ys, **TOL)
        assert len(set(sent)) == 1, sent
        return final, sent[0]

    results: dict[float, tuple[torch.Tensor, str]] = {}
    for k in (0.3, 0.45, 0.3, 0.6):
        seen = capturer.captures
        final, name = run(make(k, W))
        if k in results:  # a new closure over the same k and W: dynamo's guards pick it
            assert capturer.captures == seen and name == results[k][1]
            torch.testing.assert_close(final, results[k][0], rtol=0, atol=0)
        results[k] = final, name
    assert len({name for _, name in results.values()}) == 3, results
    finals = [final for final, _ in results.values()]
    for i, a in enumerate(finals):
        for b in finals[i + 1:]:
            assert (a - b).abs().max() > 1e-3, "two floats, one result: the test proves nothing"
    body = make(0.3, W)
    body.__closure__[body.__code__.co_freevars.index("k")].cell_contents = 0.45
    final, name = run(body)
    assert name == results[0.45][1]
    torch.testing.assert_close(final, results[0.45][0], rtol=0, atol=0)


def test_new_values_of_a_captured_tensor_neither_capture_nor_compile(adapter: Any,
                                                                      open_daemon: str) -> None:
    W = W0.clone().requires_grad_()
    body = make(0.3, W)
    carry, xs = inputs(11)
    adapter.scan(body, carry, xs)  # the forms' graph and its VJP: compiled already
    capturer = adapter.scan.__self__.capturer
    with torchloop.Client(open_daemon) as client:
        compiles = total_compiles(client)
        seen = capturer.captures
        ref = reference()
        for scale in (2.0, -1.0):
            with torch.no_grad():
                W.copy_(W0 * scale)  # the solver updates its weights between runs
            check_against_references(adapter, ref, body, carry, xs, [W])
        assert capturer.captures == seen
        assert total_compiles(client) == compiles


def test_under_no_grad_leaves_that_require_grad_run_as_plain_values(adapter: Any) -> None:
    """torch.no_grad() with a carry and a captured tensor that require grad:
    the scan sends their values, the results carry no autograd history, and
    the capture is the plain call's (no new trace, no new graph)."""
    W = W0.clone().requires_grad_()
    body = make(0.3, W)
    carry, xs = inputs(13)
    adapter.scan(body, carry, xs)  # the forms' graph: compiled already
    capturer = adapter.scan.__self__.capturer
    seen = capturer.captures
    carry.requires_grad_()
    with torch.no_grad():
        final, ys = adapter.scan(body, carry, xs)
        want_final, want_ys = eager.scan(body, carry, xs)
    assert not final.requires_grad and not ys.requires_grad
    torch.testing.assert_close(final, want_final, **TOL)
    torch.testing.assert_close(ys, want_ys, **TOL)
    assert capturer.captures == seen


def test_a_graph_break_is_refused_with_torchs_reason(adapter: Any) -> None:
    def breaks(c: torch.Tensor, x: torch.Tensor) -> tuple[Any, Any]:
        if c.sum() > 0:  # data-dependent Python control flow
            return c + x, c
        return c - x, c

    carry, xs = inputs(12)
    with pytest.raises(Exception) as ours:
        adapter.scan(breaks, carry.detach(), xs.detach())
    with pytest.raises(Exception) as ref:
        reference()(breaks, carry.detach(), xs.detach())
    assert type(ours.value) is type(ref.value)
    assert "data-dependent" in str(ours.value) or "generic_jump" in str(ours.value)


def test_lambda_errors_name_the_problem_not_the_adapter_name(adapter: Any) -> None:
    carry, xs = inputs(13)
    with pytest.raises(TypeError, match="must return \\(new_carry, y\\)"):
        adapter.scan(lambda c, x: c + x, carry.detach(), xs.detach())


CHILD = textwrap.dedent("""\
    import json, sys, torch, torchloop
    sys.path.insert(0, sys.argv[2])
    import test_capture as tc
    sock, what = sys.argv[1], sys.argv[3]
    out = {}
    ad = torchloop.loop_adapter(**tc.BOUNDS, socket=sock)
    carry, xs = tc.inputs(21)
    # a graph of each child's own (the nobody child's must be its uid's, to be evicted)
    body = tc.make(0.77 if what == "twin" else 0.55, tc.W0.clone())
    if what == "nobody":
        # the interpreter lives where uid 65534 cannot read (under /root): import
        # and trace once as root, then become 65534 before anything connects
        # (the daemon reads the peer's uid at connect)
        import os, test_graph_loader
        test_graph_loader.capture(body, carry.detach(), xs.detach()[0])
        texts = json.load(open(sys.argv[4]))
        os.setgid(65534)
        os.setuid(65534)
    final, ys = ad.scan(body, carry.detach(), xs.detach())
    ref = tc.eager.scan(body, carry.detach(), xs.detach())
    out["err"] = max((final - ref[0]).abs().max().item(), (ys - ref[1]).abs().max().item())
    out["name"] = next(iter(ad.scan.__self__.graphs))
    if what == "nobody":
        c = torchloop.Client(sock)
        def code(fn):
            try:
                fn()
                return "OK"
            except torchloop.TorchloopError as exc:
                return exc.code
        out["source"] = code(lambda: c.register("py.evil", "def body(c, x):\\n    return c, c\\n"))
        out["health"] = c.health()["ready"]
        D = tc.DEFINITION
        named = lambda t: torchloop._graph.identity(t, **D)
        out["forged"] = {k: code(lambda t=t: c.register_graph(named(t), t, **D))
                         for k, t in texts["forged"].items()}
        out["not_g"] = code(lambda: c.register_graph("mine", texts["valid"][0], **D))
        for t in texts["valid"]:
            out.setdefault("fill", []).append(code(lambda: c.register_graph(named(t), t, **D)))
        # another graph under a valid graph's name (squatting), or other bounds under it
        out["squat"] = code(lambda: c.register_graph(named(texts["valid"][0]), texts["valid"][1], **D))
        out["bounds"] = code(lambda: c.register_graph(named(texts["valid"][0]), texts["valid"][0],
                                                      **dict(D, max_steps=7)))
        final, ys = ad.scan(body, carry.detach(), xs.detach())  # evicted: registered again
        out["again"] = (final - ref[0]).abs().max().item()
    print(json.dumps(out))
    """)


def child(sock: str, what: str, texts: str = "") -> dict[str, Any]:
    here = Path(__file__).resolve().parent
    env = dict(os.environ, HOME="/tmp",
               PYTHONPATH=os.pathsep.join([str(here), str(here.parent / "helpers")]))
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, sock, str(Path(__file__).resolve().parent), what, texts],
        capture_output=True, text=True, env=env, timeout=600, cwd="/")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_two_processes_building_the_same_closure_share_one_compile(open_daemon: str) -> None:
    a, b = child(open_daemon, "twin"), child(open_daemon, "twin")
    assert a["name"] == b["name"] and a["err"] < 1e-12 and b["err"] < 1e-12
    with torchloop.Client(open_daemon) as client:
        counters = client.describe(a["name"])["counters"]
    # built once (or loaded once from the run's disk cache), never twice
    assert counters["compiles"] + counters["cache_hits"] == 1, counters
    assert counters["runs"] == 2


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to switch to uid 65534")
def test_a_non_admin_registers_graphs_but_not_source(open_daemon: str, tmp_path: Path) -> None:
    from test_graph_loader import FORGERIES, MARKER, capture, forged

    valid = [capture(make(0.1 * (i + 1), W0.clone()), torch.rand(N, dtype=torch.float64),
                     torch.rand(N, dtype=torch.float64)) for i in range(4)]
    texts = tmp_path / "texts.json"
    texts.write_text(json.dumps({"valid": valid,
                                 "forged": {h: forged(valid[0], h) for h in FORGERIES}}))
    with torchloop.Client(open_daemon) as client:
        evicted = client.stats()["graphs_evicted"]
    out = child(open_daemon, "nobody", str(texts))
    assert out["err"] < 1e-12, out
    assert out["source"] == "PERMISSION_DENIED" and out["health"] is True
    assert out["forged"] == {h: "BAD_GRAPH" for h in FORGERIES}
    assert not Path(MARKER).exists(), "a graph's kwarg key ran as code in the worker"
    assert out["not_g"] == "PERMISSION_DENIED"
    assert out["fill"] == ["OK"] * 4
    assert out["squat"] == out["bounds"] == "PERMISSION_DENIED"
    assert out["again"] < 1e-12
    with torchloop.Client(open_daemon) as client:
        stats = client.stats()
        assert stats["graphs_evicted"] > evicted
        owned = [a for a in stats["adapters"] if a["owner"] == 65534]
        assert len(owned) <= 4 and all(a["body"] == "graph" for a in owned), owned


def test_a_loop_adapter_pickles_and_works_in_a_spawned_process(adapter: Any) -> None:
    import multiprocessing
    import pickle

    clone = pickle.loads(pickle.dumps(adapter))
    carry, xs = inputs(31)
    body = make(0.3, W0.clone())
    final, _ = clone.scan(body, carry.detach(), xs.detach())
    torch.testing.assert_close(final, eager.scan(body, carry.detach(), xs.detach())[0], **TOL)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        err = pool.apply(spawned_scan, (adapter,))
    assert err < 1e-12


def spawned_scan(adapter: Any) -> float:
    carry, xs = inputs(32)
    body = make(0.3, W0.clone())
    final, ys = adapter.scan(body, carry.detach(), xs.detach())
    ref = eager.scan(body, carry.detach(), xs.detach())
    return max((final - ref[0]).abs().max().item(), (ys - ref[1]).abs().max().item())


def test_the_daemon_still_serves_after_every_refusal(adapter: Any, open_daemon: str) -> None:
    with torchloop.Client(open_daemon) as client:
        with pytest.raises(TorchloopError) as info:
            client.register_graph("g.junk", "{not json", **BOUNDS)
        assert info.value.code == "BAD_GRAPH"
        assert client.health()["ready"]
    carry, xs = inputs(33)
    body = make(0.3, W0.clone())
    final, _ = adapter.scan(body, carry.detach(), xs.detach())
    torch.testing.assert_close(final, eager.scan(body, carry.detach(), xs.detach())[0], **TOL)


@pytest.mark.parametrize("fields, code, path", [
    (dict(body_graph="{}", body_source="def body(c, x):\n    return c, c\n"),
     "INVALID_ARGUMENT", "body_source"),
    (dict(body_graph="{\"format\": \"torchloop.graph\"\u0000}"), "INVALID_ARGUMENT", "body_graph"),
    (dict(body_graph="x" * ((1 << 20) + 1)), "INVALID_ARGUMENT", "body_graph"),
    (dict(body_graph=7), "INVALID_ARGUMENT", "body_graph"),
    (dict(body_graph="[1, 2]"), "BAD_GRAPH", "graph"),
    (dict(body_graph="[1, 2]", entry="body"), "INVALID_ARGUMENT", "entry"),  # a graph has none
])
def test_bad_register_fields_get_their_code_and_the_daemon_serves_on(
        open_daemon: str, fields: dict[str, Any], code: str, path: str) -> None:
    with torchloop.Client(open_daemon) as client:
        with pytest.raises(TorchloopError) as info:
            client.call("register", name="g.bad", max_steps=8, **fields)
        assert (info.value.code, info.value.path) == (code, path), info.value
        assert "g.bad" not in {a["name"] for a in client.list()}
        assert client.health()["ready"]


def test_baked_captured_tensors_make_a_new_graph_when_their_values_change(adapter: Any) -> None:
    """An int64 index tensor and a float32 tensor inside a float64 scan are
    constants of the graph: new values are a new graph, with right results."""
    idx = torch.tensor([3, 2, 1, 0])
    shift = torch.rand(N, dtype=torch.float32)

    def body(c: torch.Tensor, x: torch.Tensor) -> tuple[Any, Any]:
        return c[idx] * 0.5 + x + shift.double(), c + 0.0

    carry, xs = (t.detach() for t in inputs(41))
    names = []
    for perm in ([3, 2, 1, 0], [1, 0, 3, 2]):
        idx.copy_(torch.tensor(perm))
        final, ys = adapter.scan(body, carry, xs)
        ref_final, ref_ys = eager.scan(body, carry, xs)
        torch.testing.assert_close(final, ref_final, rtol=0, atol=1e-15)
        torch.testing.assert_close(ys, ref_ys, rtol=0, atol=1e-15)
        names.append(sorted(adapter.scan.__self__.graphs))
    assert len(names[1]) == len(names[0]) + 1


def test_a_body_without_tensor_ops_and_one_that_mutates(adapter: Any) -> None:
    carry, xs = (t.detach() for t in inputs(42))
    final, ys = adapter.scan(lambda c, x: (x, c), carry, xs)  # the outputs are inputs
    torch.testing.assert_close(final, xs[-1], rtol=0, atol=0)
    torch.testing.assert_close(ys, torch.cat([carry[None], xs[:-1]]), rtol=0, atol=0)
    with pytest.raises(TypeError, match="mutates a tensor in place"):
        adapter.scan(lambda c, x: (c.add_(x), c * 2.0), carry.clone(), xs)


def test_a_graph_compiled_with_the_scan_op_lifts_its_constants(open_daemon: str) -> None:
    """strategy = scan (the quick tier's lowering): the graph's baked
    constants are lifted into the scan op's inputs, the live tensor rides in
    the carry; against the eager loop of the same step."""
    from test_graph_loader import IDX, TWO, W, capture, step

    c0, xs = torch.rand(N, dtype=torch.float64), torch.rand(T, N, dtype=torch.float64)
    text = capture(step, (c0, None), xs[0])
    name = "g.scan-op.test"  # an admin may name a graph anything
    with torchloop.Client(open_daemon) as client:
        client.register_graph(name, text, strategy="scan", **BOUNDS)
        res = client.scan(name, ((c0, None), (W,)), xs)
        (final, params), ys = res
        assert IDX.tolist() == [3, 0, 1, 2] and TWO.item() == 2
        (ref_final, _), ref_ys = eager.scan(step, (c0, None), xs)
        torch.testing.assert_close(final[0], ref_final, **TOL)
        torch.testing.assert_close(ys["y"], ref_ys["y"], **TOL)
        torch.testing.assert_close(params[0], W, rtol=0, atol=0)
        (sp,) = client.describe(name)["specializations"]
        assert sp["lowered"] == "scan", sp


def test_a_scan_unlike_its_captured_graph_is_spec_mismatch(open_daemon: str) -> None:
    """A graph adapter scanned with tensors other than those it was captured
    with (another length, a captured tensor missing): the worker's loader
    refuses the specialization with SPEC_MISMATCH before anything is built,
    and the graph then serves its own shapes (the scan-op test's graph)."""
    from test_graph_loader import W, capture, step

    c0, xs = torch.rand(N, dtype=torch.float64), torch.rand(T, N, dtype=torch.float64)
    text = capture(step, (c0, None), xs[0])
    name = "g.spec-mismatch.test"
    longer = torch.rand(N + 1, dtype=torch.float64), torch.rand(T, N + 1, dtype=torch.float64)
    with torchloop.Client(open_daemon) as client:
        client.register_graph(name, text, strategy="scan", **BOUNDS)
        for carry, inputs in [(((longer[0], None), (W,)), longer[1]), (((c0, None), ()), xs)]:
            with pytest.raises(TorchloopError) as info:
                client.scan(name, carry, inputs)
            assert info.value.code == "SPEC_MISMATCH", info.value
        (final, _), _ = client.scan(name, ((c0, None), (W,)), xs)
        (ref_final, _), _ = eager.scan(step, (c0, None), xs)
        torch.testing.assert_close(final[0], ref_final, **TOL)


def test_row_stand_ins_keep_leaves_apart_and_hold_nothing_of_the_callers(adapter: Any) -> None:
    """The step is captured and its guards checked at stand-ins for row 0
    (zero tensors kept per leaf position, shape, strides and dtype), not at
    views of the caller's inputs: two leaves alike stay two graph inputs
    (swapping them gives other results, not a new capture), a transposed
    leaf works, the C lookup finds what the Python path made, and no stand-in
    shares the caller's storage."""
    from torchloop import _wire, capture

    def step(c: torch.Tensor, x: tuple[torch.Tensor, torch.Tensor]) -> tuple[Any, Any]:
        return 0.5 * c + x[0] - 2.0 * x[1], c * x[1]

    gen = torch.Generator().manual_seed(21)
    c0 = torch.rand(N, generator=gen, dtype=torch.float64)
    a, b = (torch.rand(T, N, generator=gen, dtype=torch.float64) for _ in range(2))
    capturer = adapter.scan.__self__.capturer
    for k, xs in enumerate([(a, b), (b, a), (a, torch.rand(N, T, dtype=torch.float64).t())]):
        final, ys = adapter.scan(step, c0, xs)
        want_final, want_ys = eager.scan(step, c0, xs)
        torch.testing.assert_close(final, want_final, **TOL)
        torch.testing.assert_close(ys, want_ys, **TOL)
        if k == 0:
            seen = capturer.captures
        elif k == 1:
            assert capturer.captures == seen, "leaves alike, swapped: captured again"

    fresh = capture.Capturer()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(capture, "fast", None)  # the Python path makes them
        rows = fresh.rows([a, b], BOUNDS["max_steps"])
    assert rows is not None and rows[0] is not rows[1]
    for row, leaf in zip(rows, (a, b)):
        assert row.shape == leaf.shape[1:] and row.stride() == leaf.stride()[1:]
        assert row._base is None and not row.any()
        assert row.untyped_storage().data_ptr() != leaf.untyped_storage().data_ptr()
    again = fresh.rows([b.clone(), a.clone()], BOUNDS["max_steps"])  # C, when built
    assert again is not None and all(x is y for x, y in zip(again, rows, strict=True))
    if _wire.fast is not None:
        assert fresh.rows([a, b], BOUNDS["max_steps"]) is again, "the last list again"
    else:
        print("!!! the C codec (_fast) is not built: only the Python path was checked")
    assert fresh.rows([a, b[:2]], BOUNDS["max_steps"]) is None  # two lengths: check_rows says
