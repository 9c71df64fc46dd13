"""What the installed torch's ``WorkerInfo`` has, for tests that run on every supported torch.

``worker_method`` and ``rng`` are fields from torch 2.12 on; torch_spdl fills them where the
installed torch has them, and leaves them out where it does not, as torch does.
"""

from __future__ import annotations

from typing import Any

from torch_spdl.compat import WORKER_INFO_FIELDS

HAS_WORKER_METHOD = "worker_method" in WORKER_INFO_FIELDS
HAS_RNG = "rng" in WORKER_INFO_FIELDS
THREAD = "thread" if HAS_WORKER_METHOD else None
"""What ``worker_method`` reads in a torch_spdl worker thread (see :func:`method`)."""


def method(info: Any) -> str | None:
    """``info.worker_method``, or None on a torch whose WorkerInfo has no such field."""
    return getattr(info, "worker_method", None)
