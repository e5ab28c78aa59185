"""The error checks of a captured step, run in the solver's process.

Export wraps torch.linalg's error checks (`torch.linalg.solve`, `inv`,
`cholesky`, ...: `aten._linalg_check_errors(info, api, is_matrix=)`) in
`with_effects`, an effectful op the daemon does not run: _graph.write ships
each check's `info` tensor as an extra step output instead (in the scan's
dtype: the wire's tensors are float32 or float64), so a scan's y is (the
body's y, (info, ...)) with each info stacked over the steps.  Here the
checks run as the eager loop would have run them: step by step, in graph
order within a step, the first failing one raising eager's own
torch.linalg.LinAlgError with eager's own message (the check is eager's
`torch._linalg_check_errors` on that step's info).  The steps after it ran in
the daemon on a singular system; their values are never handed out.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ._graph import Check


def run_checks(outputs: object, checks: Sequence[Check]) -> object:
    """The body's y from a scan's outputs (y, infos); raises LinAlgError as
    the eager loop would have."""
    if not isinstance(outputs, (tuple, list)) or len(outputs) != 2:
        raise RuntimeError("torchloopd returned outputs without the step's error checks")
    y, infos = outputs
    if not isinstance(infos, (tuple, list)) or len(infos) != len(checks) or \
            not all(isinstance(t, torch.Tensor) for t in infos):
        raise RuntimeError("torchloopd returned outputs without the step's error checks")
    infos = [t.to(torch.int32) for t in infos]  # shipped as the scan's dtype (_graph.py)
    failed = [t.reshape(t.shape[0], -1).ne(0).any(1) for t in infos]
    if not any(bool(f.any()) for f in failed):
        return y
    steps = torch.stack(failed)  # (check, step)
    first = int(steps.any(0).nonzero()[0])
    for check, info, f in zip(checks, infos, failed):
        if bool(f[first]):
            torch._linalg_check_errors(info[first], check.api, is_matrix=check.is_matrix)
    raise AssertionError("unreachable: a failing step's check passed")  # pragma: no cover
