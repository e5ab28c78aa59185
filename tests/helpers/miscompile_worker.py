"""A compile worker that builds wrong graphs, for the parity-check test
(tests/e2e/test_compile_path.c runs a daemon with --worker pointing here).
It is the real worker (daemon/worker/compile_worker.py) with one change:
every graph it compiles adds 0.5 to its first result.  Its script hash
differs from the real worker's, so its artifacts never share cache keys
with real ones (and none is ever committed: the parity check refuses them).
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "daemon", "worker"))
import compile_worker as cw  # noqa: E402
from torchloop_worker import compile as job  # noqa: E402

_capture = job.capture


def capture(*args, **kwargs):
    module, example = _capture(*args, **kwargs)
    import torch

    class Wrong(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *flat):
            out = self.inner(*flat)
            return (out[0] + 0.5,) + tuple(out[1:])

    return torch.export.export(Wrong(module), example, strict=False).module(), example


job.capture = capture  # the name compile_job calls

if __name__ == "__main__":
    sys.exit(cw.main())
