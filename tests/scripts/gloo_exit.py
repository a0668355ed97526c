"""The end of a spawned gloo worker in the multi-process test scripts.

Once a worker has written its results and passed the final barrier, every rank is done with every
collective. Tearing the process group down then still aborted a rank now and then under load
("terminate called without an active exception" from a gloo thread at destruction, SIGABRT), which
failed a test whose results were already written and right. `exit_after_barrier` ends the worker
there without running any destructor; an exception before the barrier still tears the group down
and propagates, so a real failure stays a failure.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def exit_after_barrier() -> NoReturn:
    """End this worker process with status 0 at once (call right after the final ``dist.barrier()``)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
