"""Forked worker processes, where a test needs them: torch's forked workers are the reference for
what a worker inherits, and since Python 3.14 torch's loader starts its workers from a fork
server unless asked to fork."""

from __future__ import annotations

import multiprocessing

import pytest

NEEDS_FORK = pytest.mark.skipif(
    "fork" not in multiprocessing.get_all_start_methods(), reason="no fork"
)
