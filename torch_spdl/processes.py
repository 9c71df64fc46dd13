"""Worker processes for GIL-bound per-sample work: ``DataLoader(..., worker_method="process")``.

Threads scale on work that releases the GIL (decoders, most torch and numpy ops, I/O); pure-Python
per-sample code does not. For that case the loader's CPU stage (``fetch`` without hooks,
``preprocess`` with them, an IterableDataset's iterators) runs in ``num_workers`` processes:

- **The engine is unchanged.** The stage still has ``num_workers`` threads. Thread *w* owns worker
  process *w* and one pipe to it, and keeps the process's next task queued behind the one it is
  on (:mod:`torch_spdl.pipeline.ahead`), as torch's workers have their next indices queued.
  Ordering, back-pressure (``prefetch_factor``), ``timeout``, persistent workers and stop/join are
  the engine's own.
- **Workers start from a fork server** unless the program chose otherwise (see
  :func:`start_context`): forking a process whose other threads may hold locks can deadlock the
  child.
- **The dataset is sent once per worker**, at start: pickled once with ``forkserver``/``spawn``,
  inherited with ``fork``, as torch's workers get it (so the same picklability rules apply).
  Its large NumPy arrays are shared, not copied: every worker maps their data copy-on-write
  (:mod:`torch_spdl.shared_buffers`), as a forked worker shares the parent's pages.
  A staged dataset's own synchronous ``load`` runs in the worker too, on I/O threads of the
  worker's own, which collates the batch (:class:`WholeJob`, where the pass starts in
  processes); other ``load`` hooks stay on the main process's I/O threads, and only
  ``preprocess`` (and what it is given) crosses over, sample by sample.
- **Tensors come back in shared memory** through torch's multiprocessing reductions, and
  ``default_collate`` builds a batch in shared memory directly, since ``get_worker_info()`` is set
  in the worker. Tensors under :data:`INLINE_BYTES` travel inside the message instead (see
  :func:`dumps`). Pinning and device transfer stay in the main process.
- **Errors keep their type and place.** A worker catches an exception in torch's
  ``ExceptionWrapper``; it reaches the consumer as a :class:`~torch_spdl.pipeline.Failure` in the
  item's place, worded like the thread path's (stage, dataset index, ``worker process N``).
- **A worker that dies never hangs the loader.** The waiting thread watches the process's
  sentinel along with the pipe, and fails the item with a RuntimeError naming the worker and its
  exit code.
- **Every stop of the pipeline stops the processes** (:meth:`ProcessPool.close` is registered with
  :meth:`~torch_spdl.pipeline.Pipeline.on_stop`): exhaustion, ``break``, ``del``, garbage
  collection, errors, ``close()``; persistent workers live as long as their pipeline.
"""

from __future__ import annotations

import contextlib
import copy
import faulthandler
import functools
import multiprocessing
import os
import pickle
import random
import select
import signal
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from multiprocessing import connection, util
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import numpy as np
import torch
import torch.multiprocessing  # registers torch's reductions: tensors travel in shared memory

from . import inherited, orphans
from .batching import FetchTask, SampleTask
from .blas import single_threaded_blas
from .compat import (
    MP_STATUS_CHECK_INTERVAL,
    ExceptionWrapper,
    is_iterable,
    numpy_seed,
    set_thread_name,
    set_worker_signal_handlers,
)
from .copies import CopyTask
from .jobs import FetchJob, IterableJob, Job, OpJob, PreprocessJob, WholeJob
from .main_script import unguarded_main, unreachable_main
from .messages import END, ERROR, READY, RESET, RUN, Packed, Reply, dumps, pack, release_received
from .pickled import contents, copies_too_large
from .pipeline import EngineError, Failure, Pipeline
from .pipeline.ahead import NOT_YET, Result
from .pipeline.items import RAISED_IN
from .priority import below_this_process, run_at
from .start_method import (
    SERVER_LOCK,
    exit_code,
    explain_pickling,
    modules_of,
    start_context,
    start_server,
)
from .stream_state import WithState
from .workers import set_process_worker_info, worker_info

if TYPE_CHECKING:
    from .plan import Plan
    from .worker_state import StateWatch

WORKER_METHODS = ("auto", "thread", "process", "multiprocessing")
PROCESS_WORKER_METHOD = "multiprocessing"
"""``WorkerInfo.worker_method`` in a worker process: the value torch's own worker processes report
(``WorkerInfo``'s default), so dataset code written against torch sees what it expects."""

SHUTDOWN_GRACE = MP_STATUS_CHECK_INTERVAL
"""Seconds the processes get to exit on their own before they are terminated (torch's figure)."""


def uses_processes(worker_method: Any) -> bool:
    """Whether ``worker_method`` asks for worker processes; ValueError if it names no method."""
    if not isinstance(worker_method, str) or worker_method not in WORKER_METHODS:
        raise ValueError(
            "worker_method option should be 'auto', 'thread' or 'process' ('multiprocessing', the "
            "name torch's WorkerInfo uses, means 'process'), but got "
            f"worker_method={worker_method!r}"
        )
    return worker_method in ("process", "multiprocessing")


STACK_SIGNAL = getattr(signal, "SIGUSR2", None)
"""Asks a worker process for its Python stack (:func:`faulthandler.register`): what a stuck
loader's diagnosis shows of it (:meth:`ProcessPool.stack`)."""

_stack_pipe: Any = None  # the worker's end: faulthandler writes to it, so it must stay open


def _write_stack_on_request(pipe: connection.Connection | None) -> None:
    """In a worker process: write every thread's stack to ``pipe`` on :data:`STACK_SIGNAL`."""
    global _stack_pipe
    if pipe is None or STACK_SIGNAL is None or not hasattr(faulthandler, "register"):
        return
    _stack_pipe = pipe
    faulthandler.register(STACK_SIGNAL, file=pipe.fileno(), all_threads=True, chain=False)


def _worker_main(
    settings: inherited.Settings,
    sent: WorkerStart,
    worker: int,
    num_workers: int,
    base_seed: int,
    conn: connection.Connection,
    read: Any,
    stack_pipe: connection.Connection | None,
    forked: bool,
    niceness: int | None,
) -> None:
    """A worker process: set up as torch's ``_worker_loop`` does, then answer until told to stop
    (the main process closes its end of the pipe) or until the main process is gone. ``read``:
    a shared count of the requests it has read (:meth:`_Worker.has_read`). ``forked``: it was
    forked from the main process (``multiprocessing_context="fork"``). ``niceness``: the CPU
    priority it runs at (:mod:`torch_spdl.priority`); None, the one it started with."""
    job, worker_init_fn = sent
    try:
        run_at(niceness)  # before any thread starts: they inherit it
        inherited.apply(settings)  # what a forked worker would have had
        set_worker_signal_handlers()
        set_thread_name("pt_data_worker")
        _write_stack_on_request(stack_pipe)
        if not forked:  # a forked one keeps the main process's, as torch's do: see blas.py
            single_threaded_blas()
        status, payload = _start_worker(job, worker, num_workers, base_seed, worker_init_fn)
        conn.send_bytes(dumps((status, payload), reply=True))
        if status == READY:
            _serve(job, worker, conn, read)
    except (KeyboardInterrupt, EOFError, BrokenPipeError, ConnectionResetError):
        pass  # Ctrl-C reaches the main process too; EOF and broken pipes: it has stopped us
    finally:
        conn.close()


def _start_worker(
    job: Job,
    worker: int,
    num_workers: int,
    base_seed: int,
    worker_init_fn: Callable[[int], None] | None,
) -> Reply:
    """Seeds, ``get_worker_info()`` and ``worker_init_fn``, in torch's order and with its seeds."""
    torch.set_num_threads(1)
    seed = base_seed + worker
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(numpy_seed(base_seed, worker))
    info = worker_info(
        job.info_dataset(worker), worker, num_workers, base_seed, PROCESS_WORKER_METHOD
    )
    set_process_worker_info(info)
    try:
        if worker_init_fn is not None:
            worker_init_fn(worker)
    except KeyboardInterrupt:
        raise
    except BaseException:
        where = f"in the start of stage {job.stage!r} (worker process {worker})"
        return ERROR, ExceptionWrapper(where=where)
    return READY, None


class _MainWatch:
    """Whether the main process is still there, checked by its pid. torch's ``ManagerWatchdog``
    watches the parent process, which for a worker started by a fork server is the server: a
    server killed (say by the OOM killer) would end every worker the main process still uses.
    Its pipe closing ends a worker at once anyway; this is the backstop, as torch's is."""

    def __init__(self) -> None:
        parent = multiprocessing.parent_process()  # the process that started us, not the server
        self.main = os.getppid() if parent is None or parent.pid is None else parent.pid

    def is_alive(self) -> bool:
        try:
            os.kill(self.main, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # there, though not ours to signal
            pass
        return True


def _serve(job: Job, worker: int, conn: connection.Connection, read: Any) -> None:
    """Answer requests one at a time; between them, check on the main process like torch does.
    Each request read is counted in ``read`` before it runs: should this process die, the main
    process knows which of its requests it had not begun."""
    watchdog = _MainWatch()
    while watchdog.is_alive():
        if not conn.poll(MP_STATUS_CHECK_INTERVAL):
            continue
        try:
            request = conn.recv()
        except (EOFError, OSError):
            raise
        except Exception:  # the task arrived but does not unpickle here (a missing class, say)
            where = f"in reading a task of stage {job.stage!r} in worker process {worker}"
            request = ExceptionWrapper(where=where)
        read.value += 1
        if isinstance(request, ExceptionWrapper):
            _send(conn, (ERROR, request), job.stage, worker)
            continue
        op, payload = request
        reply = job.reset(worker, payload) if op == RESET else job.run(payload, worker)
        about = None if op == RESET else functools.partial(job.describe, payload)
        del payload
        _send(conn, reply, job.stage, worker, about)
        del reply, about  # do not keep the last batch's shared memory alive while idle


def _send(
    conn: connection.Connection,
    reply: Reply,
    stage: str,
    worker: int,
    about: Callable[[], str | None] | None = None,
) -> None:
    """Send ``reply``; if it cannot be pickled (pickling happens before anything is written), send
    that error instead, naming what the task was ``about``, so the item fails rather than the
    loader hanging. An exception that cannot be pickled (a class defined in a function) is sent
    as a RuntimeError with its own traceback."""
    try:
        message = dumps(reply, reply=True)
    except Exception:
        status, payload = reply
        if status == ERROR:
            message = dumps((ERROR, _picklable(payload)), reply=True)
        else:
            what = None if about is None else about()
            where = f"in sending the result of stage {stage!r}"
            where += f" for {what}" if what else ""
            where += f" from worker process {worker}"
            message = dumps((ERROR, ExceptionWrapper(where=where)), reply=True)
    conn.send_bytes(message)


def _picklable(wrapper: Any) -> Any:
    """``wrapper`` (an exception carried to the main process) as a RuntimeError that says what
    the exception was: its type (and whatever it holds) could not be pickled."""
    carried = copy.copy(wrapper)
    name = getattr(wrapper.exc_type, "__qualname__", repr(wrapper.exc_type))
    carried.exc_type = RuntimeError
    carried.exc_msg = f"{wrapper.exc_msg}({name} cannot be pickled: it is raised as a RuntimeError)"
    return carried


# -- the main process's side ----------------------------------------------------------------------
def _warn_again(died: WorkerDied) -> None:
    """A process died between tasks: a task it had not begun, or one whose reply the main process
    had not read (:class:`_ReplyLost`), runs again on its replacement. Nothing fails, so the
    death is told here."""
    if isinstance(died, _ReplyLost):
        what = "its last reply, not read yet, was lost with it, and its task runs again"
    else:
        what = "it had not begun the task sent to it, which runs again"
    warnings.warn(f"{died}; {what}", RuntimeWarning, stacklevel=2)


class _Sent(NamedTuple):
    """A request sent ahead (:meth:`ProcessPool._post`), not answered yet."""

    request: tuple[str, Any]
    number: int  # its number with its process (:meth:`_Worker.has_read`)
    error: BaseException | None = None  # why it could not be sent to a replacement


class WorkerDied(EngineError):
    """A worker process ended while the main process waited on it: killed (the OOM killer's
    SIGKILL), or crashed in native code (SIGSEGV). A ``RuntimeError``, as torch's loader raises
    for a worker that exited unexpectedly."""

    worker_kind = "process"


class _ReplyLost(WorkerDied):
    """A worker process replied, then died before the main process had read its reply: the
    reply's large tensors are fetched from their sender (:mod:`torch_spdl.segments`), and went
    with it. The request it answered did not fail: it runs again on the replacement."""


@dataclass(eq=False)
class _Worker:
    """One worker process and the main process's end of its pipe.

    ``lock`` is held for a whole request/reply exchange (for each send and each receive of a
    request sent ahead), so :meth:`_Processes.close` can take the pipe from its thread between
    them. Re-entrant: a garbage-collection finaliser may close the pool from inside an exchange
    on the same thread.
    """

    id: int
    process: Any
    conn: connection.Connection
    then: str  # what happens after it dies, for the error message
    stacks: connection.Connection | None  # where it writes its stack when asked
    read: Any  # a shared count of the requests it has read (:func:`_serve`)
    lock: threading.RLock = field(default_factory=threading.RLock)
    dead: bool = False
    ready: bool = False  # it has said it is set up (:meth:`ProcessPool.wait_ready`)
    sent: int = 0  # requests sent to it
    orphan: int | None = None  # a pidfd that watches it once its fork server died (:mod:`orphans`)

    @property
    def sentinel(self) -> Any:
        """What turns readable when it ends."""
        return self.process.sentinel if self.orphan is None else self.orphan

    def outlived_its_server(self) -> bool:
        """Whether it runs on though its sentinel says it ended: its fork server died. It is
        watched through a pidfd from then on."""
        if self.orphan is None:
            self.orphan = orphans.watch(self.process)
            return self.orphan is not None
        return False  # the pidfd turned readable: it has ended

    def exited(self, timeout: float) -> bool:
        """Whether it has ended, waiting up to ``timeout`` seconds (its status is read under
        :data:`SERVER_LOCK`, not waited for under it)."""
        if self.orphan is None:
            connection.wait([self.process.sentinel], timeout)
            if exit_code(self.process, 0) is None:
                return False
            if not self.outlived_its_server():
                return True
        return orphans.ended(cast(int, self.orphan), timeout)

    def send(self, message: bytes) -> int:
        """Send a request (the caller holds :attr:`lock`); its number, for :meth:`has_read`. A
        pipe broken by the process's death is not an error here: the wait for the reply finds
        the death, and the request's number, which the process never read, says it did not
        run."""
        self.sent += 1
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.conn.send_bytes(message)
        return self.sent

    def has_read(self, number: int) -> bool:
        """Whether the process read request ``number`` before it died. One it had not read did
        not run there: it is no sample's failure, and runs again on the replacement."""
        return bool(self.read.value >= number)

    def close(self) -> None:
        """Close our ends of its pipes (it then exits, if it has not)."""
        with self.lock:  # its thread has left its exchange and will start no other
            self.conn.close()
            if self.stacks is not None:
                self.stacks.close()

    def died(self) -> WorkerDied:
        """The error for its death; it is replaced before its next task (:meth:`ProcessPool
        ._current`)."""
        self.dead = True
        return WorkerDied(f"{self.ended()}; {self.then}")

    def ended(self) -> str:
        """How it ended: its pid, and its exit code or signal."""
        text = f"DataLoader worker process {self.id} (pid {self.process.pid}) exited unexpectedly"
        if self.orphan is not None:
            if not self.exited(SHUTDOWN_GRACE):
                return f"{text}: it closed its pipe and is still running"
            return f"{text} (its exit code is unknown: its fork server died before it)"
        code = exit_code(self.process, SHUTDOWN_GRACE)  # it has closed its pipe: it is exiting
        if code is None:
            return f"{text}: it closed its pipe and is still running"
        text += f" with exit code {code}"
        if code < 0:
            with contextlib.suppress(ValueError):  # not a signal this platform names
                text += f" (killed by signal {signal.Signals(-code).name})"
        return text


def _start_process(
    context: Any,
    settings: inherited.Settings,
    job: Job,
    worker: int,
    num_workers: int,
    base_seed: int,
    sent: WorkerStart | Packed,
    niceness: int | None = None,
) -> _Worker:
    """Worker process ``worker`` of ``job``, which it is sent with its ``worker_init_fn`` as
    ``sent`` (:func:`worker_start`); it runs at ``niceness`` (None: at the priority it starts
    with)."""
    forked = context.get_start_method() == "fork"
    ours, theirs = context.Pipe()
    read = context.RawValue("Q", 0)
    stacks, stack_pipe = context.Pipe(duplex=False) if STACK_SIGNAL is not None else (None, None)
    # Processes forked later (our other workers included) must not hold our end: then a worker
    # reads EOF when the main process closes it or dies, and we get EPIPE when a worker is gone.
    for end in (ours, stacks):
        if end is not None:
            util.register_after_fork(end, connection.Connection.close)
    process = context.Process(
        target=_worker_main,
        args=(
            settings,
            sent,
            worker,
            num_workers,
            base_seed,
            theirs,
            read,
            stack_pipe,
            forked,
            niceness,
        ),
        name=f"torch_spdl-{job.stage}-{worker}",
        daemon=True,  # a backstop at exit only: close() is what stops it
    )
    try:
        with SERVER_LOCK:  # no restart of the fork server while it forks this worker
            process.start()
    except BaseException as error:
        for end in (ours, stacks):
            if end is not None:
                end.close()
        if isinstance(error, (TypeError, AttributeError, pickle.PicklingError)):
            explain_pickling(context, error, job.stage if isinstance(job, OpJob) else None)
        raise
    finally:
        for end in (theirs, stack_pipe):  # the worker has its own copies now
            if end is not None:
                end.close()
    then = (
        "its stream ends for this epoch, and a new worker process starts its stream next epoch"
        if isinstance(job, IterableJob)
        else "a new worker process takes over its next tasks"
    )
    return _Worker(worker, process, ours, then, stacks, read)


class _Processes:
    """The processes, pipes and wake-up pipe of a pool; no reference to the pool itself, so a
    dropped pool can be finalised."""

    def __init__(self) -> None:
        self.workers: list[_Worker] = []
        self.wake, self._waker = connection.Pipe(duplex=False)
        util.register_after_fork(self.wake, connection.Connection.close)
        util.register_after_fork(self._waker, connection.Connection.close)
        self.closing = False
        self._joined = False
        self.broken: BaseException | None = None  # why a dead worker could not be replaced
        self._lock = threading.Lock()
        self._owner = os.getpid()

    def replace(self, old: _Worker, new: _Worker) -> bool:
        """Put ``new`` in ``old``'s place; False if the pool is closing (then ``new`` is not
        in it, and the caller must stop it)."""
        with self._lock:
            if self.closing:
                return False
            self.workers[self.workers.index(old)] = new
            return True

    def release(self) -> None:
        """Wake every waiting thread and close the pipes (each worker then exits), at once."""
        if os.getpid() != self._owner:
            return  # a forked child's copy: not its processes to stop
        with self._lock:
            if self.closing:
                return
            self.closing = True
        self._waker.send_bytes(b"")  # readable from now on: no thread waits on a worker again
        for worker in self.workers:
            worker.close()

    def close(self) -> None:
        """:meth:`release`, then join the processes and terminate those still running after
        :data:`SHUTDOWN_GRACE` seconds."""
        if os.getpid() != self._owner:
            return
        self.release()
        with self._lock:
            if self._joined:
                return
            self._joined = True
        deadline = time.monotonic() + SHUTDOWN_GRACE
        try:
            for worker in self.workers:
                worker.exited(max(0.0, deadline - time.monotonic()))
        except BaseException:  # a Ctrl-C in the wait: no grace, and no process left behind
            for worker in self.workers:
                _signal(worker, signal.SIGKILL)
            for worker in self.workers:
                _reap(worker)  # killed, it exits at once: no zombie either
            raise
        for worker in self.workers:
            _terminate(worker)
        self.wake.close()
        self._waker.close()


def _terminate(worker: _Worker) -> None:
    """End a process still running after the grace period (stuck in user code): SIGTERM as torch
    does, then SIGKILL if it outlives another grace period (it may handle SIGTERM)."""
    if not worker.exited(0):
        _signal(worker, signal.SIGTERM)
        worker.exited(SHUTDOWN_GRACE)
    if not worker.exited(0):
        _signal(worker, signal.SIGKILL)
    _reap(worker)


def _signal(worker: _Worker, sig: signal.Signals) -> None:
    """Send ``sig`` to ``worker``'s process, through its pidfd once its fork server died (the
    process object then takes it for ended, and sends nothing)."""
    if worker.orphan is not None:
        orphans.send(worker.orphan, sig)
    elif sig == signal.SIGTERM:
        worker.process.terminate()
    else:
        worker.process.kill()


def _reap(worker: _Worker) -> None:
    """Wait for ``worker``'s process to end, and close what watched it."""
    if worker.orphan is None:
        worker.process.join()
    else:
        orphans.ended(worker.orphan, None)
        os.close(worker.orphan)
    worker.process.close()  # its sentinel's file descriptor


WorkerStart = tuple[Job, Callable[[int], None] | None]
"""What a worker process is given: its job and ``worker_init_fn``."""


def worker_start(
    context: Any, job: Job, worker_init_fn: Callable[[int], None] | None
) -> WorkerStart | Packed:
    """What each worker of ``context`` is sent: ``job`` and ``worker_init_fn`` pickled together,
    once for all of them, not once per worker; or the two as they are, where workers are forked
    (they inherit them). In one pickle, a ``worker_init_fn`` bound to the dataset (or holding
    it) is bound in the worker to the dataset the worker reads, as in a forked worker of
    torch's: pickled apart, it was bound to a second copy, and what it set up there, no read
    saw."""
    start = (job, worker_init_fn)
    return start if context.get_start_method() == "fork" else pack(start)


class ProcessPool:
    """``num_workers`` worker processes running ``job``, driven by the engine's stage threads.

    The processes start at construction, from the calling thread (before the pipeline's threads
    exist, which keeps ``fork`` away from locks other threads hold). The stage's ``on_start`` is
    :meth:`start`: it binds the calling thread to process ``worker_id`` and waits until that
    process is set up. The stage function is :meth:`fetch`, :meth:`preprocess`, or :meth:`batches`
    as a :class:`~torch_spdl.pipeline.WorkerSource`'s function, matching ``job``. The processes
    run ``nice`` below this process's CPU priority as the pool starts (:mod:`torch_spdl.priority`).
    ``packed``: ``job`` and ``worker_init_fn`` as the caller already packed them for these
    workers (:func:`worker_start`), if it did; else they are packed here.
    """

    def __init__(
        self,
        job: Job,
        num_workers: int,
        *,
        base_seed: int,
        worker_init_fn: Callable[[int], None] | None = None,
        context: Any = None,
        pin: Callable[[Any], Any] | None = None,
        nice: int = 0,
        packed: WorkerStart | Packed | None = None,
    ) -> None:
        self.job = job
        self._pin_batch = pin
        self._local = threading.local()
        self._processes = _Processes()
        self._finalizer = weakref.finalize(self, self._processes.close)
        context = start_context(context, modules_of(job), nice)
        settings = inherited.capture()  # as they are now, for every worker, replacements too
        niceness = below_this_process(nice)  # this process's priority now, less ``nice``
        self._threads: dict[int, int] = {}  # thread id -> the worker process it drives

        def spawn(worker: int, sent: WorkerStart | Packed | None = None) -> _Worker:
            """Start process ``worker``; a replacement (for one that died) is sent the job as
            it is then."""
            sent = (job, worker_init_fn) if sent is None else sent
            return _start_process(
                context, settings, job, worker, num_workers, base_seed, sent, niceness
            )

        self._spawn = spawn
        if packed is None:
            packed = worker_start(context, job, worker_init_fn)
        try:
            for worker in range(num_workers):
                self._processes.workers.append(self._spawn(worker, packed))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop and join every process; safe to call more than once and from any thread."""
        self._finalizer()

    def release(self) -> None:
        """Tell every process to stop, and wake the threads that wait on them, without waiting
        for the processes (:meth:`close` does)."""
        self._processes.release()

    # -- one exchange with this thread's process --------------------------------------------------
    def start(self, worker_id: int) -> None:
        """``on_start``: bind this thread to its process and wait until it is set up; an error in
        ``worker_init_fn`` is raised here with its type, which makes it fatal, as with threads."""
        worker = self._processes.workers[worker_id]
        self._local.worker = worker
        self._local.sent = deque()  # requests sent ahead (:meth:`_post`), oldest first
        self._threads[threading.get_ident()] = worker_id
        self._await_start(worker)

    def wait_ready(self) -> None:
        """Wait until every worker process is set up, as :meth:`start` does for one. ``"auto"``
        waits here, in a thread of its own, before its stage threads use the processes: a pool
        whose workers die at start (a class they cannot unpickle, say) then costs no sample."""
        for worker in self._processes.workers:
            self._await_ready(worker)  # a death is raised: "auto" stays on its threads

    def _await_start(self, worker: _Worker) -> None:
        """:meth:`_await_ready`, where a process that died before it was set up (killed, or a
        crash in native code) ran no task: like one that dies between tasks, it is replaced
        before its first (:meth:`_current`), and a warning says so. Its replacement dying too
        breaks the pool, with that death as the reason."""
        try:
            self._await_ready(worker)
        except WorkerDied as died:
            warnings.warn(
                f"{died}; it died while it started, before any task", RuntimeWarning, stacklevel=2
            )

    def _await_ready(self, worker: _Worker) -> None:
        """Receive ``worker``'s word that it is set up, once; raise what it sent if it failed."""
        with worker.lock:
            if worker.ready:
                return
            status, payload = self._receive(worker)
            worker.ready = status != ERROR
        if status == ERROR:
            try:
                payload.reraise()
            except BaseException as error:
                setattr(error, RAISED_IN, "process")  # named so: not "worker thread"
                raise

    def stack(self, thread: int, wait: float = 1.0, quiet: float = 0.05) -> str | None:
        """The Python stack of the worker process that thread ``thread`` drives (None if it
        drives none), as the process writes it when signalled: what arrives within ``wait`` s,
        until nothing more comes for ``quiet`` s."""
        worker_id = self._threads.get(thread)
        if worker_id is None or self._processes.closing:
            return None
        worker = self._processes.workers[worker_id]
        header = f"worker process {worker_id} (pid {worker.process.pid}):\n"
        if worker.stacks is None or STACK_SIGNAL is None:
            return None
        try:
            os.kill(worker.process.pid, STACK_SIGNAL)
        except (ProcessLookupError, ValueError):
            return header + "  (it has exited)\n"
        fd, chunks = worker.stacks.fileno(), list[bytes]()
        while select.select([fd], [], [], quiet if chunks else wait)[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
        text = b"".join(chunks).decode(errors="replace")
        return header + (text or f"  (no stack within {wait} s)\n")

    def _check_open(self) -> None:
        if self._processes.closing:
            raise RuntimeError("the DataLoader's worker processes have been shut down")

    def _current(self) -> _Worker:
        """This thread's worker process: a new one in place of one that died (started like the
        first, ``worker_init_fn`` included). A pool that could not replace one is broken: every
        later task fails at once, with why (concurrent.futures' BrokenProcessPool)."""
        worker: _Worker = self._local.worker
        if not worker.dead:
            return worker
        self._check_open()
        cannot = f"DataLoader worker process {worker.id} died and could not be replaced"
        if isinstance(self._processes.broken, WorkerDied):
            raise WorkerDied(str(self._processes.broken))
        if self._processes.broken is not None:
            raise RuntimeError(cannot) from self._processes.broken
        try:
            new = self._spawn(worker.id)
            if not self._processes.replace(worker, new):  # closing: close() ends the dead one
                new.close()
                _terminate(new)
                self._check_open()
            worker.close()  # out of the pool now: reap it
            _terminate(worker)
            self._await_ready(new)
        except WorkerDied:  # none takes its next tasks, then
            self._processes.broken = WorkerDied(f"{cannot}: {new.ended()}, as it started")
            raise WorkerDied(str(self._processes.broken)) from None
        except BaseException as error:
            self._processes.broken = error
            raise
        self._local.worker = new
        return new

    def _exchange(self, request: tuple[str, Any], worker: _Worker | None = None) -> Reply:
        """One request to ``worker`` (this thread's process if None) and its reply; never while
        this thread has requests sent ahead to it (their replies come first). If the process
        dies before it has read the request, or after it replied but before the reply is read
        (:class:`_ReplyLost`), the request is asked of the replacement; a copy's process
        (``worker`` given: :meth:`fetch_on`) is not replaced."""
        replaceable = worker is None and self._may_run_again(request)
        worker = worker or self._current()
        with worker.lock:
            self._check_open()
            # a copy's batch (:meth:`fetch_on`) may reach a process before the thread bound to
            # it has waited for its start: its word that it is set up must not pass for a reply
            self._await_ready(worker)
            number = worker.send(dumps(request))
            try:
                return self._receive(worker)
            except WorkerDied as error:
                died = error
            if not replaceable or (worker.has_read(number) and not isinstance(died, _ReplyLost)):
                raise died
        _warn_again(died)
        return self._exchange(request)

    def _may_run_again(self, request: tuple[str, Any]) -> bool:
        """Whether ``request`` may go to the process that replaces a dead one: not a stream's
        next batch, which the new process's stream has not begun (it ends for this epoch)."""
        return not (isinstance(self.job, IterableJob) and request[0] == RUN)

    # -- requests sent ahead: the process has the next one queued while this thread works -------
    def _post(self, request: tuple[str, Any]) -> None:
        """Send ``request`` to this thread's process without waiting for the reply, which
        :meth:`_take` receives, replies in the order of their requests. A pipe broken by the
        process's death is not an error here (:meth:`_Worker.send`)."""
        message = dumps(request)  # a task that cannot be pickled fails before anything is sent
        worker = self._current()
        with worker.lock:
            self._check_open()
            self._await_ready(worker)
            number = worker.send(message)
        self._local.sent.append(_Sent(request, number))

    def _take(self, bell: int | None) -> Any:
        """The reply to this thread's oldest request, or :data:`NOT_YET` if ``bell`` turns
        readable first. If the process died running that request, those sent after it never
        ran: they go to the process that replaces it, in their order; if it died before it had
        read it, that one goes too."""
        worker, sent = self._local.worker, self._local.sent
        oldest = sent[0]
        if isinstance(oldest.error, WorkerDied):  # the process died running it
            raise sent.popleft().error
        if oldest.error is not None:
            raise RuntimeError(
                f"DataLoader worker process {worker.id} died with this task queued, and no "
                "process could take the task over"
            ) from sent.popleft().error
        try:
            with worker.lock:
                reply = self._receive(worker, bell)
        except _ReplyLost as lost:
            return self._again(lost, bell)
        except WorkerDied as died:
            if not worker.has_read(oldest.number):  # it died before it: nothing failed
                _warn_again(died)
                self._resend()
                return self._take(bell)
            sent.popleft()
            self._resend()
            raise
        except BaseException:
            sent.popleft()
            raise
        if reply is not NOT_YET:
            sent.popleft()
        return reply

    def _again(self, lost: _ReplyLost, bell: int | None) -> Any:
        """The oldest request's reply was lost with its process (:class:`_ReplyLost`): it runs
        again on the replacement, with those sent after it, except the next if the process had
        read it: it died running that one, which fails with the death, as where no reply was
        lost."""
        worker, sent = self._local.worker, self._local.sent
        again = sent.popleft()
        died_on = sent.popleft() if sent and worker.has_read(sent[0].number) else None
        sent.appendleft(again)
        self._resend()
        if died_on is None:  # it died between requests: nothing failed
            _warn_again(lost)
        else:
            sent.insert(1, died_on._replace(error=WorkerDied(str(lost))))
        return self._take(bell)

    def _resend(self) -> None:
        """Send this thread's unanswered requests again, to the process that replaces its dead
        one; those it cannot send are kept with why, for :meth:`_take` to raise."""
        sent = self._local.sent
        queued = [entry.request for entry in sent]
        sent.clear()
        for position, request in enumerate(queued):
            try:
                self._post(request)
            except Exception as error:
                sent.extend(_Sent(later, 0, error) for later in queued[position:])
                return

    def _ahead(self, request: tuple[str, Any], done: Callable[[Reply], Any]) -> Result:
        """Send ``request`` ahead; what waits for its reply and gives ``done(reply)``."""
        self._post(request)

        def result(bell: int | None) -> Any:
            reply = self._take(bell)
            return reply if reply is NOT_YET else done(reply)

        return result

    def stage(self, name: str) -> Ahead:
        """Stage function ``name`` (``"fetch"``, ``"preprocess"``, ``"call"``), which its
        stage's threads send ahead (:mod:`torch_spdl.pipeline.ahead`)."""
        return Ahead(getattr(self, name), getattr(self, f"send_{name}"))

    def _receive(self, worker: _Worker, bell: int | None = None) -> Any:
        """The worker's reply; RuntimeError if it dies first or the pool is closed meanwhile;
        :data:`NOT_YET` if ``bell`` (a file descriptor) turns readable first."""
        self._check_open()  # a thread starting late, after the pipeline stopped
        wake = self._processes.wake
        waits: list[Any] = [worker.conn, worker.sentinel, wake]
        ready = connection.wait(waits if bell is None else [*waits, bell])
        if worker.conn in ready:
            try:
                message = worker.conn.recv_bytes()
            except (EOFError, ConnectionResetError):  # its end closed, or reset as it was killed
                raise worker.died() from None
            try:
                return pickle.loads(message)
            except Exception as error:  # shared tensors are fetched from their sender: gone?
                if worker.exited(0):
                    raise _ReplyLost(str(worker.died())) from error
                raise
        if wake in ready:
            self._check_open()
        if worker.sentinel not in ready and bell in ready:
            return NOT_YET
        if worker.outlived_its_server():
            return self._receive(worker, bell)
        raise worker.died()

    def _pin(self, data: Any) -> Any:
        """``data`` pinned, if asked; the shared memory it came in is given back then."""
        if self._pin_batch is None:
            return data
        pinned = self._pin_batch(data)
        release_received(data, pinned)
        return pinned

    # -- stage functions ------------------------------------------------------------------------
    def fetch(
        self,
        task: FetchTask,
        worker: _Worker | None = None,
        keep: Callable[[Any], None] | None = None,
    ) -> Any:
        """The ``fetch`` stage: the worker (this thread's, if None) reads and collates the batch;
        pinned here. A state the worker sends with it goes to ``keep``."""
        task.current = task.index  # what an error here (a dead worker) is about
        return self._fetched(task, self._exchange((RUN, task.index), worker), keep)

    def send_fetch(self, task: FetchTask) -> Result:
        """:meth:`fetch`, sent ahead."""
        task.current = task.index
        return self._ahead((RUN, task.index), functools.partial(self._fetched, task))

    def _fetched(
        self, task: FetchTask, reply: Reply, keep: Callable[[Any], None] | None = None
    ) -> Any:
        status, payload = reply
        payload = _kept(payload, keep)
        if status == ERROR:
            return Failure(payload, task, "fetch")
        return self._pin(payload)

    def fetch_on(self, task: CopyTask, keep: Callable[[Any], None]) -> Any:
        """The ``fetch`` stage for a dataset with state of its own: process ``task.copy`` reads
        the batch on its copy (:mod:`torch_spdl.copies`), after loading the state the copy
        begins the pass from, and sends its state with the batch, for ``keep``. A process that
        died took its copy's state with it: it is not replaced."""
        worker = self._processes.workers[task.copy]
        if worker.dead:
            raise RuntimeError(
                f"DataLoader worker process {worker.id} died earlier, and its copy of the "
                "dataset, whose state this batch needs, with it"
            )
        if task.start is not None:
            status, payload = self._exchange((RESET, task.start), worker)
            if status == ERROR:
                return Failure(payload, task, "fetch")
        return self.fetch(task, worker, keep)

    def call(self, value: Any) -> Any:
        """An ``OpJob``'s stage: this thread's worker applies the op to ``value``."""
        return self._called(value, self._exchange((RUN, value)))

    def send_call(self, value: Any) -> Result:
        """:meth:`call`, sent ahead."""
        return self._ahead((RUN, value), functools.partial(self._called, value))

    def _called(self, value: Any, reply: Reply) -> Any:
        status, payload = reply
        return Failure(payload, value, self.job.stage) if status == ERROR else payload

    def preprocess(self, task: SampleTask) -> SampleTask | Failure:
        """The ``preprocess`` stage: ``task.value`` (what ``load`` returned) goes to the worker."""
        if not task.size:
            return task
        return self._preprocessed(task, self._exchange((RUN, (task.index, task.value))))

    def send_preprocess(self, task: SampleTask) -> Result | None:
        """:meth:`preprocess`, sent ahead; None for a task with no sample, which needs no
        worker."""
        if not task.size:
            return None
        request = (RUN, (task.index, task.value))
        return self._ahead(request, functools.partial(self._preprocessed, task))

    def _preprocessed(self, task: SampleTask, reply: Reply) -> SampleTask | Failure:
        status, payload = reply
        if status == ERROR:
            return Failure(payload, task, "preprocess")
        task.value = payload
        return task

    def batches(
        self,
        worker_id: int,
        restored: dict[str, Any] | None = None,
        every: int = 1,
        keep: Callable[[dict[str, Any]], None] | None = None,
        seed: int | None = None,
    ) -> Iterator[Any]:
        """An IterableDataset epoch of this thread's worker: a fresh iterator there (its state
        put back from ``restored``), then its batches; an error is yielded in its place and
        iteration goes on, as in torch's workers. A stream with state of its own sends it
        every ``every`` batches, for ``keep``."""
        status, payload = self._exchange((RESET, (restored, every, seed)))
        if status == ERROR:
            yield Failure(payload)
            return
        if payload is not None and keep is not None:
            keep(payload)
        while True:
            status, payload = self._exchange((RUN, None))
            if status == END:
                if payload is not None and keep is not None:
                    keep(payload)
                return
            payload = _kept(payload, keep)
            yield Failure(payload) if status == ERROR else self._pin(payload)


@dataclass(frozen=True)
class Ahead:
    """A pool's stage function and its ``send_ahead``
    (:class:`~torch_spdl.pipeline.ahead.SendsAhead`)."""

    run: Callable[[Any], Any]
    send_ahead: Callable[[Any], Result | None]

    def __call__(self, value: Any) -> Any:
        return self.run(value)


def _kept(payload: Any, keep: Callable[[Any], None] | None) -> Any:
    """A worker's reply less the state it sent with it (:class:`WithState`), which goes to
    ``keep``."""
    if not isinstance(payload, WithState):
        return payload
    if keep is not None:
        keep(payload.state)
    return payload.batch


def process_pool(
    iterator: Any, loader: Any, plan: Plan | None = None, taking_over: bool = False
) -> PoolStarter:
    """What starts the worker processes of a loader's iterator, made now from plain values (it
    holds neither the iterator nor the loader, so the threads that may call it keep neither
    alive).

    ``taking_over``: the processes take the stage over from threads that began the pass
    (``"auto"``). Their seeds then follow the threads' and the I/O threads' (``base_seed +
    num_workers + io_workers + id``): seeded as the threads were, a worker process would draw
    again the numbers its thread drew from ``get_worker_info().rng``, and a ``worker_init_fn``
    that seeds NumPy from ``get_worker_info().seed`` would repeat the thread's draws.

    ``iterator`` is the loader's ``_ThreadDataLoaderIter``; the job mirrors what its thread stage
    would run under ``plan`` (the iterator's own if None): torch's fetch without hooks,
    ``preprocess`` with them, each batch whole where the plan says so, a per-worker iterator for
    an IterableDataset (over the iterator's dataset, which may be a per-rank shard of the
    loader's).
    """
    auto, collate = iterator._auto_collation, iterator._collate_fn
    plan = plan or iterator._plan
    watch: StateWatch | None = None
    if is_iterable(iterator._dataset):
        batch_size = iterator._iterable_batch_size()
        job: Job = IterableJob(iterator._streams, auto, collate, iterator._drop_last, batch_size)
    elif (whole := plan.whole) is not None:
        io_workers = loader._options.io_workers  # the load stage's threads, shared among them
        io_threads = -(-io_workers // iterator._num_workers)
        job = WholeJob(loader.dataset, auto, collate, hooks=whole, io_threads=io_threads)
    elif plan.hooks is None:
        job = FetchJob(loader.dataset, auto, collate, records=plan.copies)
        watch = None if plan.copies else loader._watch
    else:
        job = PreprocessJob(plan.hooks.preprocess, loader.dataset)
    base_seed = int(iterator._base_seed)
    if taking_over:
        base_seed += iterator._num_workers + loader._options.io_workers
    return PoolStarter(
        job,
        iterator._num_workers,
        base_seed,
        loader.worker_init_fn,
        loader.multiprocessing_context,
        iterator._pinner(),
        watch,
        loader._options.worker_nice,
    )


class Vetting(NamedTuple):
    """What ``"auto"`` learns of worker processes before it starts them."""

    why: str | None  # why they must not start, or None
    job_bytes: int  # what each is sent, pickled (arrays it would share left out)


@dataclass(frozen=True)
class PoolStarter:
    """A :class:`ProcessPool` to be, as plain values; calling it starts the processes."""

    job: Job
    num_workers: int
    base_seed: int
    worker_init_fn: Callable[[int], None] | None
    multiprocessing_context: Any
    pin: Callable[[Any], Any] | None
    # a FetchJob's dataset as worker threads read it: the workers get it as it was before
    watch: StateWatch | None = None
    nice: int = 0  # the workers' CPU priority below this process's (torch_spdl.priority)

    def _job(self) -> Job:
        """The job, its dataset as it was before worker threads set state on it, if they did
        (:meth:`StateWatch.pristine`): each worker opens its own, as torch's do."""
        if self.watch is None or not self.watch.keeps_state:
            return self.job
        return replace(self.job, dataset=self.watch.pristine())

    def __call__(self) -> ProcessPool:
        # torch's warning when worker processes outnumber the CPUs, given where torch gives it
        torch.utils.data.DataLoader.check_worker_number_rationality(self)  # type: ignore[arg-type]
        job = self._job()
        context = start_context(self.multiprocessing_context, modules_of(job), self.nice)
        packed = worker_start(context, job, self.worker_init_fn)
        self._check_main(context, job, packed)
        return ProcessPool(
            job,
            self.num_workers,
            base_seed=self.base_seed,
            worker_init_fn=self.worker_init_fn,
            context=context,
            pin=self.pin,
            nice=self.nice,
            packed=packed,
        )

    def warm(self) -> bool:
        """Start the fork server the workers will come from, if they will, with what they import
        preloaded, without waiting for it: it imports torch and more in a new interpreter (12 s
        on a 16-core host, where forking a worker from it then takes milliseconds), meanwhile
        the stage's threads go on. Whether the workers come from a fork server. A server that
        fails to start is reported by the start of the workers, which starts it again."""
        context = start_context(self.multiprocessing_context, modules_of(self._job()), self.nice)
        if context.get_start_method() != "forkserver":
            return False
        start_server(self.nice)
        return True

    def vet(self, returned: Any = None) -> Vetting:
        """Whether ``"auto"`` may start these workers, and the size of what each is sent. Not
        where a main module they could not import, or a script without a main guard that they
        would (see :mod:`.main_script`), or copies of the dataset too large for this host (see
        :mod:`.pickled`), or where ``returned`` (what the stage returned on a thread) could not
        be sent back from one: a sample holding a lambda or a lock, which threads pass as it
        is, would fail each batch from then on. It pickles what each is sent to look (the job
        and ``worker_init_fn``), and ``returned`` to nowhere: ``"auto"`` asks only where it
        would start them. Forked workers are sent nothing: they inherit the job."""
        sent_back = contents(returned).unpicklable
        if sent_back:
            return Vetting(f"what the stage returns cannot be pickled back ({sent_back})", 0)
        context = start_context(self.multiprocessing_context)
        if context.get_start_method() == "fork":
            return Vetting(None, 0)
        try:
            job = self._job()
        except TypeError as error:  # the dataset cannot be copied as it was
            return Vetting(str(error), 0)
        found = contents((job, self.worker_init_fn))
        unpicklable = (
            found.unpicklable
            and f"what worker processes would be sent cannot be pickled ({found.unpicklable})"
        )
        why = (
            unpicklable
            or unreachable_main(job, found.main_names)
            or _reruns_main()
            or copies_too_large(found, self.num_workers)
        )
        return Vetting(why, found.copied_bytes)

    def _check_main(self, context: Any, job: Job, packed: WorkerStart | Packed) -> None:
        """Raise at once where no worker could run ``job`` (see :func:`unreachable_main`), rather
        than fail every batch with a dead worker; torch's default ``fork`` meets no such case.
        What ``packed`` found as it was pickled spares the check a pickle of its own."""
        if context.get_start_method() == "fork":
            return
        names = packed.main_names if isinstance(packed, Packed) else None
        reason = unreachable_main(job, names) or _reruns_main()
        if reason is not None:
            raise RuntimeError(
                f"worker_method='process' cannot start its workers by "
                f"{context.get_start_method()!r}: {reason}. Run the script from a file with its "
                'work under `if __name__ == "__main__":` and what the workers need importable, '
                "pass multiprocessing_context='fork' to fork them from this process (safe only "
                "while no other thread holds a lock), or use worker_method='thread'."
            )


def _reruns_main() -> str | None:
    """Why workers that import the main script would run it again, or None (see
    :func:`unguarded_main`)."""
    path = unguarded_main()
    if path is None:
        return None
    return (
        f"worker processes would run the main script again: {path} has no "
        '`if __name__ == "__main__":` guard'
    )


def attach(pipeline: Pipeline[Any], pool: ProcessPool | None) -> Pipeline[Any]:
    """Stop ``pool`` whenever ``pipeline`` stops, before its threads are joined."""
    if pool is not None:
        pipeline.on_stop(pool.release, then=pool.close)
    return pipeline
