"""A compile job from start to reply: the eager dry run (and, for a symbolic
batch, the runs that find the outputs' batch dimensions), the capture, the
AOTInductor build, the artifact checks and the parity run; and the
register-time check of a body."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field, replace
from typing import Callable, TypeVar

import torch

from .blocked import block_size, graph_ops
from .build import build_artifact, build_placed
from .elf import check_artifact
from .errors import JobError
from .job import KINDS, Body, Job, load_body
from .lowering import BatchDims, Tensors, batch_dims, capture, capture_module, cotangents
from .parity import Case, eager_reference, example_inputs, parity_check, parity_reference
from . import saved
from .scan import Scan
from .specs import Spec, batch_y_spec, probe_batches, spec_bind, spec_has_batch, strip_dtype
from .stack_into import StackIntoOutputs

# A reply's result map (msgpack: strings, numbers, specs, maps of them).
Reply = dict[str, object]
R = TypeVar("R")


def check_body(job: Job) -> Reply:
    """Register-time check: the source imports and defines a callable entry,
    or the captured graph loads (every field checked, run over fake tensors)."""
    load_body(job)
    return {"ok": True}


def dry_run(scan: Scan, kind: str, sample: list[bytes] | None = None
            ) -> tuple[list[torch.Tensor], Tensors, Case]:
    """Eager scan at the scan's specs on the request's inputs (sample) or
    random ones: (inputs, outputs, the parity check's case at batch size 0).
    Body exceptions and carry changes get a step number and a leaf path
    before the tracer's messages can hide them."""
    args = example_inputs(scan, sample)
    with torch.no_grad():
        dry = replace(scan, strategy="unroll")
        outs = dry.forward(*args)
    scan.y_spec = dry.y_spec
    data = tuple(args) + (tuple(cotangents(outs)) if KINDS[kind] else ())
    return args, outs, (0, data, parity_reference(scan, args, outs, kind))


def use_sample(job: Job) -> bool:
    """Whether the eager runs may take the request's own inputs: for source
    bodies only.  A captured graph comes from any user, so no request data
    runs through eager ATen for it: its dry run and parity reference use
    generated inputs (uniform in [0, 1)) at the specs' shapes and dtype,
    which load_graph's fake run checked against the graph's declared inputs.
    Eager on those is safe because a graph calls only allow-listed ops
    (graph_schema.py: kernels that check the indices they read, no integral
    division), its constants were checked by size, and its intermediates
    are bounded one by one and in total (graph_loader.check_fake)."""
    return not job.body_graph


@dataclass
class Phases:
    """Where a compile's time went, phase by phase (the reply's "phases")."""

    started: float = field(default_factory=time.monotonic)
    mark: float = field(default_factory=time.monotonic)
    seconds: dict[str, float] = field(default_factory=dict)

    def end(self, name: str) -> None:
        now = time.monotonic()
        self.seconds[name] = now - self.mark
        self.mark = now


@dataclass
class Eager:
    """What the eager runs found: the scan to capture (at the first probe
    size for a symbolic batch), its example inputs and outputs, the parity
    cases, the per-step output spec and the symbolic batch (or None)."""

    scan: Scan
    args: list[torch.Tensor]
    outs: Tensors
    cases: list[Case]
    y_spec: Spec
    dyn: BatchDims | None
    random: bool  # the parity check runs on random inputs, not the request's


def eager_runs(job: Job, body: Body) -> Eager:
    """The dry run; with dynamic = batch, at two probe sizes (the outputs'
    batch dimensions) and at batch size 1 (which torch would otherwise
    specialize, for the parity check)."""
    carry, inputs, steps, kind = job.carry, job.inputs, job.steps, job.kind
    batched = spec_has_batch(carry) or spec_has_batch(inputs)
    b1, b2 = probe_batches(carry, inputs, steps) if batched else (0, 0)

    def at(batch: int) -> Scan:
        return Scan(body=body, carry_spec=spec_bind(carry, batch),
                    inputs_spec=spec_bind(inputs, batch), steps=steps, dtype=job.dtype,
                    strategy=job.strategy)

    def traced_at(batch: int, fn: Callable[[], R]) -> R:
        """A body error of a symbolic-batch compile says which batch size it ran at."""
        try:
            return fn()
        except JobError as exc:
            if batched:
                exc.message += f" (dynamic = batch: the body ran at batch size {batch})"
            raise

    scan = at(b1)
    if scan.dtype not in ("float32", "float64"):
        raise JobError("BAD_DTYPE", f"dtype {scan.dtype} is not float32 or float64")
    torch.manual_seed(0)
    sample = None if batched or not use_sample(job) else job.sample
    args, outs, (_, data, want) = traced_at(b1, lambda: dry_run(scan, kind, sample))
    found = Eager(scan, args, outs, [(b1, data, want)], scan.y_spec, None, sample is None)
    if batched:
        other = at(b2)
        traced_at(b2, lambda: dry_run(other, "forward"))
        found.y_spec = batch_y_spec(scan.y_spec, other.y_spec, b1, b2)
        _, _, (_, data1, want1) = traced_at(1, lambda: dry_run(at(1), kind))
        found.cases.append((1, data1, want1))
        found.dyn = batch_dims(carry, inputs, found.y_spec, steps, kind,
                               max(job.max_batch, b1, b2))
    return found


def compile_job(job: Job) -> Reply:
    phases = Phases()
    body = load_body(job)
    phases.end("setup")
    eager = eager_runs(job, body)
    scan, outs = eager.scan, eager.outs
    phases.end("eager")
    scan.tracing = True
    module, example, names, y = lowered(job, eager)
    phases.end("export")
    # AOTI writes its intermediates (wrapper/kernel sources, objects, the
    # extern-node json) beside output_path: give it a directory of its own,
    # named after the output so the daemon can remove it whatever happens here.
    job_dir = job.output + ".d"
    os.makedirs(job_dir, mode=0o700)

    def build(name: str, placer: StackIntoOutputs | None) -> str:
        so = build_artifact(module, example, os.path.join(job_dir, name),
                            eager.dyn is not None, placer)
        check_artifact(so, job_dir)
        phases.end("inductor")
        reference = None if job.kind in saved.KINDS else eager_reference(scan, job.kind)
        parity_check(so, eager.cases, scan.dtype, names, eager.random, reference,
                     len(eager.args), scan.notes)
        phases.end("parity")
        return so

    try:
        os.replace(build_placed(build, scan.notes), job.output)
    finally:
        shutil.rmtree(job_dir, ignore_errors=True)
    return {
        "so": job.output,
        "y": y,
        "n_inputs": len(example),
        "n_outputs": len(names),
        "torch": torch.__version__,
        "compile_seconds": time.monotonic() - phases.started,
        # where it went: import and set-up, the eager dry run (and the parity
        # reference), torch.export, AOTInductor (lowering + C++ compile), the
        # parity run
        "phases": phases.seconds,
        # how the loop was lowered, and why when not as the strategy asked
        "lowered": scan.lowered,
        "note": "; ".join(scan.notes),
        # the step's size in ATen calls: what the daemon's upgrade plan
        # estimates an unrolled compile from
        "step_ops": step_ops(module, scan.lowered, job.steps),
    }


def lowered(job: Job, eager: Eager) -> tuple[torch.nn.Module, Tensors, list[str], Spec]:
    """The graph to build (taking example, then one buffer per result), its
    results' names and the reply's "y": the outputs' spec, and for a saved
    kind (saved.py) the tuple of it and saved's."""
    scan, args, outs = eager.scan, eager.args, eager.outs
    y = strip_dtype(eager.y_spec)
    if job.kind not in saved.KINDS:
        module, example = capture(scan, args, outs, job.kind, job.strict, eager.dyn)
        nc, ny = scan.n_carry, len(outs) - scan.n_carry
        names = ["carry"] * nc + ["outputs"] * ny + (
            ["grad_carry"] * nc + ["grad_inputs"] * (len(args) - nc) if KINDS[job.kind] else [])
        return module, example, names, y
    if eager.dyn is not None or job.strategy != "unroll":
        raise JobError("COMPILE_FAILED", f"malformed job from the daemon: kind {job.kind} "
                       "is for an unrolled loop of static shapes")
    low = saved.lower(scan, args, outs, job.kind, y, job.wrt)
    eager.cases = [low.case]
    scan.lowered = "unroll"
    module, example = capture_module(low.module, low.example, low.case[2])
    return module, example, low.names, low.y


def step_ops(module: torch.nn.Module, lowered: str, steps: int) -> int:
    """ATen calls of one step of the captured loop."""
    k = block_size(lowered)
    per = k + steps % k if k else 1 if lowered == "scan" else steps
    return graph_ops(module) // max(per, 1)
