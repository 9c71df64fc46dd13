"""Helpers for tests that run the checkout in fresh interpreters: examples, torchrun, Lightning."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def checkout_env(base: Mapping[str, str] = os.environ) -> dict[str, str]:
    """``base`` with the repository root first on ``PYTHONPATH``, so the checkout under test is
    imported even where torch_spdl is not installed (with ``pip install -e .`` it is the same)."""
    env = dict(base)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def free_port() -> int:
    """A loopback TCP port nobody listens on right now (for MASTER_PORT / --master_port)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_python(*args: str, timeout: float = 120) -> str:
    """``python ARGS`` on the checkout, in a fresh interpreter: its stdout; fails on rc != 0."""
    result = subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"python {args[0]} exited with {result.returncode}:\n{output}"
    return result.stdout


def run_example(script: str, *args: str, timeout: float = 120) -> str:
    """Run ``examples/<script>`` with ``sys.executable``; return its stdout, failing on rc != 0."""
    return run_python(str(REPO / "examples" / script), *args, timeout=timeout)
