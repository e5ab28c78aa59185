"""`make bench`: what the daemon's graph convention costs or saves, in process.

usage: outvariant.py OUT_JSON

The daemon's graphs write their results into buffers they are given (the
out-variant, docs/architecture.md), so results can land in a client's shared
memory without a copy.  This compares, for the cumulative sum at
(N, T) = (4096, 16), (4096, 128) and (1048576, 1), float64, the same loop
compiled four ways and called from Python (p50 µs over 300 calls after 30):
  plain  - AOTInductor, results returned in tensors the graph allocates
  out    - AOTInductor, the out-variant as Inductor lowers it (the stacked
           outputs built in a temporary, then copied into the given buffer)
  placed - the out-variant with the compile worker's StackIntoOutputs pass
           (the daemon's graphs): the stacked outputs computed in place
  jit    - torch.compile(fullgraph=True, dynamic=False), the in-process way
Every compile here is cold (a private Inductor cache directory).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="tl-outvariant-")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "daemon",
                                "worker"))
from torchloop_worker.stack_into import StackIntoOutputs  # noqa: E402


def p50(f, k: int = 300) -> float:
    for _ in range(30):
        f()
    ts = []
    for _ in range(k):
        t0 = time.perf_counter()
        f()
        ts.append((time.perf_counter() - t0) * 1e6)
    ts.sort()
    return ts[len(ts) // 2]


def case(n: int, steps: int, tmp: str) -> dict:
    class Plain(torch.nn.Module):
        def forward(self, c, xs):
            ys = []
            for t in range(steps):
                c = c + xs[t]
                ys.append(c)
            return c, torch.stack(ys)

    class Out(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, c, xs, oc, oy):
            r = self.m(c, xs)
            oc.copy_(r[0])
            oy.copy_(r[1])
            return oc, oy

    c = torch.zeros(n, dtype=torch.float64)
    xs = torch.ones(steps, n, dtype=torch.float64)
    bufs = [torch.empty(n, dtype=torch.float64), torch.empty(steps, n, dtype=torch.float64)]
    ep = torch.export.export(Plain(), (c, xs), strict=False)
    plain = torch._inductor.aot_compile(ep.module(), (c, xs), options={
        "aot_inductor.output_path": os.path.join(tmp, f"plain-{n}-{steps}.so")})
    ep2 = torch.export.export(Out(ep.module()), (c, xs, *bufs), strict=False)
    out = torch._inductor.aot_compile(ep2.module(), (c, xs, *bufs), options={
        "aot_inductor.output_path": os.path.join(tmp, f"out-{n}-{steps}.so")})
    placer = StackIntoOutputs()
    placed = torch._inductor.aot_compile(ep2.module(), (c, xs, *bufs), options={
        "aot_inductor.output_path": os.path.join(tmp, f"placed-{n}-{steps}.so"),
        "post_grad_custom_post_pass": placer})
    # T = 1: torch.stack of one row is a view, no cat: nothing to place
    assert placer.rewritten == (steps > 1), placer.rewritten
    r1 = torch._C._aoti.AOTIModelContainerRunnerCpu(plain, 1)
    r2 = torch._C._aoti.AOTIModelContainerRunnerCpu(out, 1)
    r3 = torch._C._aoti.AOTIModelContainerRunnerCpu(placed, 1)
    jit = torch.compile(Plain(), fullgraph=True, dynamic=False, backend="inductor")
    for r in (r2, r3):
        bufs[1].fill_(float("nan"))
        r.run([c, xs, *bufs])
        assert torch.allclose(bufs[1], torch.cumsum(xs, 0) + c)
    return {"N": n, "T": steps, "plain_us": p50(lambda: r1.run([c, xs])),
            "out_us": p50(lambda: r2.run([c, xs, *bufs])),
            "placed_us": p50(lambda: r3.run([c, xs, *bufs])), "jit_us": p50(lambda: jit(c, xs))}


def main() -> None:
    out = sys.argv[1]
    tmp = tempfile.mkdtemp(prefix="tl-outvariant-so-")
    rows = [case(4096, 16, tmp), case(4096, 128, tmp), case(1048576, 1, tmp)]
    for r in rows:
        print(json.dumps(r), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
