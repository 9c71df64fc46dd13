"""Helpers for tests that run the checkout in fresh interpreters: examples, torchrun, Lightning.

Every such run is a *job* (:func:`job_env`): whatever way the test ends, every process the job
started is ended with it, launchers' children included.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
JOB_MARK = "TORCH_SPDL_TEST_JOB"


def checkout_env(base: Mapping[str, str] = os.environ) -> dict[str, str]:
    """``base`` with the repository root first on ``PYTHONPATH``, so the checkout under test is
    imported even where torch_spdl is not installed (with ``pip install -e .`` it is the same)."""
    env = dict(base)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


@contextlib.contextmanager
def job_env(base: Mapping[str, str] = os.environ) -> Iterator[dict[str, str]]:
    """:func:`checkout_env` for a job of processes, each of which is killed when the block ends.

    Launchers put their children in sessions of their own (torchrun's ranks), and a child whose
    launcher died is reparented away from us, so neither process groups nor the process tree
    find them all. Their environment does: every process carrying this job's mark is killed.
    """
    env = checkout_env(base)
    env[JOB_MARK] = uuid.uuid4().hex
    try:
        yield env
    finally:
        end_job(env[JOB_MARK])


def end_job(mark: str) -> None:
    """SIGKILL every process whose environment has ``JOB_MARK=mark`` (Linux's /proc)."""
    needle = f"{JOB_MARK}={mark}".encode()
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:  # gone, or not ours to read
            continue
        if needle in environ and int(entry.name) != os.getpid():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)


def spawn_ranks(
    fn: Callable[..., None],
    args: tuple,
    ranks: int,
    timeout: float = 150,
    stalled: Callable[[], str | None] | None = None,
) -> None:
    """``fn(rank, *args)`` in ``ranks`` spawned processes (``torch.multiprocessing``), failing if
    one fails, if all have not finished within ``timeout`` s, or as soon as ``stalled()`` (polled
    every second) says why they are stuck (a :class:`TimeoutError`).

    None is left running either way, nor anything they started (their worker processes, a fork
    server): the ranks are started with a job mark in their environment, which every descendant
    inherits, and the whole job is killed at the end (:func:`end_job`).
    """
    import torch.multiprocessing as mp

    mark = uuid.uuid4().hex
    with _environ(JOB_MARK, mark):  # spawned children copy os.environ as it is at their start
        context = mp.start_processes(fn, args=args, nprocs=ranks, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=min(1.0, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the {ranks} ranks did not finish within {timeout:.0f} s")
            why = stalled() if stalled is not None else None
            if why is not None:
                raise TimeoutError(why)
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join()
        end_job(mark)


@contextlib.contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    """``os.environ[name] = value`` inside the block only (what processes started there see)."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            del os.environ[name]
        else:
            os.environ[name] = previous


def free_port() -> int:
    """A loopback TCP port nobody listens on right now (for MASTER_PORT / --master_port)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_python(*args: str, timeout: float = 120) -> str:
    """``python ARGS`` on the checkout, in a fresh interpreter: its stdout; fails on rc != 0."""
    with job_env() as env:
        result = subprocess.run(
            [sys.executable, *args],
            cwd=REPO,
            env=env,
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
