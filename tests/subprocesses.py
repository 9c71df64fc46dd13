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
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TypeVar

REPO = Path(__file__).resolve().parent.parent
JOB_MARK = "TORCH_SPDL_TEST_JOB"
K = TypeVar("K")


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


@dataclass(frozen=True)
class Run:
    """One command of :func:`run_together`: its arguments, what it adds to (or, as None, takes
    from) the job's environment, and where it runs."""

    args: Sequence[str]
    env: Mapping[str, str | None] = field(default_factory=dict)
    cwd: Path = REPO


@dataclass(frozen=True)
class Ran:
    """What a group of :func:`run_together` gave: each command's exit code, and their standard
    outputs and standard errors, each joined."""

    codes: list[int | str]
    output: str
    errors: str

    def check(self) -> str:
        """The standard output, failing unless every command exited with 0."""
        assert self.codes == [0] * len(self.codes), self.output + self.errors
        return self.output


def run_together(groups: Mapping[K, Sequence[Run]], timeout: float = 180) -> dict[K, Ran]:
    """Every command of every group started at once, in one job (see :func:`job_env`): what each
    group gave. Most of such a run is starting interpreters and waiting for peers, so on two
    cores several finish in little more than the slowest's time.
    Outputs go to files, not pipes: a command blocked on a full pipe that nobody reads yet would
    stall its peers. A command still running at ``timeout`` s is killed and reads as
    ``"timeout"``."""
    deadline = time.monotonic() + timeout
    with contextlib.ExitStack() as stack, job_env() as env:
        started = {name: [_start(run, env, stack) for run in runs] for name, runs in groups.items()}
        ran = {name: [_finish(*one, deadline) for one in group] for name, group in started.items()}
    return {
        name: Ran(
            [code for code, _, _ in ran[name]],
            "\n".join(out for _, out, _ in ran[name]),
            "\n".join(err for _, _, err in ran[name]),
        )
        for name in groups
    }


Sinks = tuple[IO[str], IO[str]]


def _start(
    run: Run, env: Mapping[str, str], stack: contextlib.ExitStack
) -> tuple[subprocess.Popen, Sinks]:
    env = {**env, **run.env}
    env = {name: value for name, value in env.items() if value is not None}
    # both closed by ``stack``, which ruff does not see through a parameter
    output = stack.enter_context(tempfile.TemporaryFile("w+"))  # noqa: SIM115
    errors = stack.enter_context(tempfile.TemporaryFile("w+"))  # noqa: SIM115
    sinks = (output, errors)
    proc = subprocess.Popen(run.args, cwd=run.cwd, env=env, stdout=output, stderr=errors)
    return proc, sinks


def _finish(proc: subprocess.Popen, sinks: Sinks, deadline: float) -> tuple[int | str, str, str]:
    """``proc``'s exit code, output and errors, killing it once ``deadline`` has passed."""
    try:
        code: int | str = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        code = "timeout"
    finally:
        proc.kill()
        proc.wait()
    for sink in sinks:
        sink.seek(0)
    return code, sinks[0].read(), sinks[1].read()


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
