"""Running an example as a user does: a fresh interpreter, from the repo root."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_example(script: str, *args: str, timeout: float = 120) -> str:
    """Run ``examples/<script>`` with ``sys.executable``; return its output, failing on rc != 0.

    The repository root goes first on ``PYTHONPATH`` so the checkout under test is imported even
    where torch_spdl is not installed (with ``pip install -e .`` it is the same code anyway).
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, str(REPO / "examples" / script), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{script} exited with {result.returncode}:\n{output}"
    return result.stdout
