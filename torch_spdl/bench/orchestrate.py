"""The parent of a run of several workloads: it starts each workload's process, then the report's.

``python -m torch_spdl.bench`` turns into this script (``os.execv``, the same process) once it has
read its arguments. It runs in a fresh interpreter (``python -I``, this file by path) and imports
only the standard library, so no process outside a workload's tree maps torch's libraries. PSS
charges a page shared by N processes 1/N to each: a parent holding torch would take its share of
torch's pages off every tree measured under it (about 150 MB on the development machine).

Usage, from :func:`torch_spdl.bench.__main__.orchestrate` only:
``python -I orchestrate.py WORK_DIR CLOCK_START ARG...``, where ``WORK_DIR/plan.json`` names the
workloads and the ARGs are the user's, which every child parses again.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path


def bench(*args: str) -> int:
    """Run ``python -m torch_spdl.bench ARGS`` to its end; its exit status."""
    command = [sys.executable, "-m", "torch_spdl.bench", *args]
    return subprocess.run(command, stdin=subprocess.DEVNULL).returncode


def main(argv: list[str]) -> int:
    work, start, *args = argv
    folder = Path(work)
    try:
        plan = json.loads((folder / "plan.json").read_text())
        for workload in plan["workloads"]:
            results = str(folder / f"{workload}.json")
            status = bench(
                *args, "--only", workload, "--results-to", results, "--clock-start", start
            )
            if status != 0:
                print(f"workload {workload} failed (exit status {status})", file=sys.stderr)
                return 1
        return bench(*args, "--report-from", work, "--clock-start", start)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
