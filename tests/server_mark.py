"""Preloaded by a test's fork server: where ``SERVER_MARK`` names a file, the server writes its
pid there as its interpreter exits, so that a test can tell an exit from a kill."""

from __future__ import annotations

import atexit
import os

MARK = "SERVER_MARK"


def _mark(path: str) -> None:
    with open(path, "a") as file:
        file.write(f"{os.getpid()}\n")


if os.environ.get(MARK):
    atexit.register(_mark, os.environ[MARK])
