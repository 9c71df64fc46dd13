"""The executor behind ``worker_method="auto"``: a CPU stage that can move while it runs.

The stage keeps its ``num_workers`` threads throughout; what changes is what each thread does
with a task. During the trial it runs the task itself, measured (:class:`~torch_spdl.auto.Trial`);
once :func:`~torch_spdl.auto.decide` has spoken, a thread either goes on doing so, or hands the
task to the worker process it drives (the same exchange as ``worker_method="process"``), or hands
it on unrun, as a :class:`Deferred` that the training loop's thread runs when the batch is
delivered (what ``num_workers=0`` does; the loader's iterator then cuts the pass with a
:class:`Cut`, and the loop fetches the batches the threads have not taken itself). Every task is
run exactly once, by whichever executor holds the route when a thread takes it, and the engine
keeps the order: nothing is lost, repeated or reordered by a switch.

Worker processes start in a thread of their own while the stage threads keep working, and the
route changes only once every process is set up, so the switch costs no pause, and processes that
cannot come up cost no sample; a thread binds to its process (``ProcessPool.start``) on its first
task after the switch. The pool stops with the pipeline (:meth:`close`, from ``Pipeline.on_stop``).
Where their fork server still imports, the processes start only once it is up
(:mod:`torch_spdl.server_up`), in a wait the close cuts short: a worker started before then
would wait for it in a handshake nothing can cut short, and the pass's end with it. A pass that
begins before processes decided in an earlier one could start runs on the stage's threads
meanwhile (:meth:`Switch.start_pending`).

A stage that ``hands_over`` moves further than its own tasks: a staged dataset whose samples,
once in processes, are best read whole there (``Plan.whole``: each worker loads, preprocesses and
collates its batches, which come back through shared memory). Its threads go on with the
samples they have, and the processes it starts are handed to the loader's iterator
(:meth:`Switch.take_pool`), which reads the rest of the pass from them in a pipeline of its own:
the pass's sampler is :class:`Cut` between the two at a batch boundary, so every batch is read by
exactly one of them, and the first's batches are delivered before the second's.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from . import server_up
from .auto import INLINE, PROCESS, THREAD, Decision, Trial
from .inherited import in_thread
from .pipeline import Gate
from .pipeline.ahead import Result
from .processes import PoolStarter, ProcessPool


@dataclass(frozen=True, slots=True)
class Deferred:
    """A task to run in the training loop's thread when its batch is delivered."""

    fn: Callable[[Any], Any]
    task: Any

    def run(self) -> Any:
        return self.fn(self.task)


class Switch:
    """A stage function that runs on threads, in worker processes or inline, as decided.

    ``local`` is the thread path's stage function; ``remote`` names the :class:`ProcessPool`
    stage function that does the same in a process (``"fetch"`` or ``"preprocess"``);
    ``make_pool`` starts the pool; ``conclude`` turns the trial's figures into a decision;
    ``start`` is the threads' own ``on_start``. Nothing starts before the decision (a fork
    server importing torch beside the trial would take the cores it measures), except on a host
    of many cores where the loader started the server as it was made (:mod:`.early_server`);
    a decision for processes from the next pass starts their fork server at once
    (:meth:`PoolStarter.warm`).
    """

    def __init__(
        self,
        local: Callable[[Any], Any],
        remote: str,
        *,
        start: Callable[[int], None],
        make_pool: PoolStarter,
        conclude: Callable[[Trial], Decision],
        trial: Trial | None,
        route: str = THREAD,
        hands_over: bool = False,
        keep: Callable[[Decision], None] = lambda decision: None,
    ) -> None:
        self.gate = _narrow_gate(trial)
        self._local = local
        self._remote = remote
        self._start = start
        self._make_pool = make_pool
        self._conclude = conclude
        self.trial = trial
        self.route = route
        self.decision: Decision | None = None
        self.unsure: Decision | None = None  # the last trial's, where it measures again
        self._lock = threading.Lock()
        self._ids = threading.local()  # this thread's worker id, and whether it is bound
        self._pool: ProcessPool | None = None
        self._starter: threading.Thread | None = None
        self.starting = False  # worker processes are being started (or are up) for this stage
        self._start_error: BaseException | None = None
        self._closed = threading.Event()  # close(): a start waiting for the server stops too
        self._hands_over = hands_over
        self._keep = keep
        self.pool_ready = False  # hands_over: the processes are up, for take_pool

    # -- the stage's on_start and fn --------------------------------------------------------------
    def on_start(self, worker_id: int) -> None:
        self._ids.worker = worker_id
        self._ids.bound = False
        self._start(worker_id)

    def __call__(self, task: Any) -> Any:
        route = self.route
        if route == PROCESS:
            return self._in_process(task)
        if route == INLINE:
            return Deferred(self._local, task)
        trial = self.trial
        if trial is None:
            return self._local(task)
        try:
            return trial.run(self._local, task)
        finally:
            if trial.ready():
                self._decide(trial)

    def send_ahead(self, task: Any) -> Result | None:
        """The task sent to this thread's worker process, once the stage runs there
        (:mod:`torch_spdl.pipeline.ahead`); None on the other routes, where :meth:`__call__`
        runs it."""
        if self.route != PROCESS:
            return None
        send: Callable[[Any], Result | None] = getattr(self._bound_pool(), f"send_{self._remote}")
        return send(task)

    def _decide(self, trial: Trial) -> None:
        # another thread decides (or has): the conclusion may pickle the dataset to look at
        # what worker processes would be sent, which this thread's next task must not wait for
        if self.trial is not trial:
            return
        with self._lock:
            if self.trial is not trial:  # another thread decided
                return
            self.trial = None
            trial.stop()
            decision = self._conclude(trial)
            trial.returned = None  # a batch, held no longer than the decision needs it
            if decision.measure_again:  # other programs took the cores: this trial could not tell
                self.trial, self.unsure = trial.again(), decision
                return
            if decision.free and trial.narrow:
                # the GIL does not bind a few threads: whether it binds all of them decides
                self.trial = trial.widened()
                self._widen()
                return
            self.decision = decision
            self._keep(decision)  # processes that come up after this pass serve the next
            # a deferred decision leaves this pass on threads; processes deferred to the next
            # pass have their fork server started now
            if decision.executor == PROCESS:
                self.starting = not decision.deferred
                self._run_starter(self._warm if decision.deferred else self._start_pool)
            elif not decision.deferred:
                self.route = decision.executor
                self._widen()
            # a stage that waits for processes, here or from the next pass, is one the GIL
            # binds: until they take over, its few threads do better than all of them

    def measure_anew(self, total: int | None) -> None:
        """A persistent pipeline's next pass begins, of ``total`` tasks: a trial the pass before
        left undecided starts over on it (:meth:`Trial.anew`), on the same threads."""
        with self._lock:
            trial = self.trial
            if trial is None:
                return
            trial.stop()
            self.trial = trial.anew(total)

    def start_pending(self, decision: Decision, trial: Trial) -> None:
        """Start the worker processes ``decision`` chose in an earlier pass, whose fork server
        was still importing as this pass began (deferred to this pass, or cut short by the end
        of that one): until they are up, the stage's threads run its tasks, only as many as
        ``trial`` (the pass's first trial, not run) would use (a GIL-bound stage's few threads do
        better than all of them), and the route then changes as a switch decided in this pass
        would. Called before the stage's threads start."""
        self.decision, self.starting = decision, True
        self.gate = _narrow_gate(trial)
        self._run_starter(self._start_pool)

    def _run_starter(self, work: Callable[[], None]) -> None:
        """Run ``work`` (:meth:`_warm` or :meth:`_start_pool`) on a thread of its own, which
        :meth:`close` joins."""
        self._starter = threading.Thread(
            target=in_thread(work), name="torch_spdl.auto-start", daemon=False
        )
        self._starter.start()

    def _widen(self) -> None:
        """Let every thread of the stage take tasks."""
        if self.gate is not None:
            self.gate.widen()

    def _warm(self) -> None:
        """Start the next pass's fork server (:meth:`PoolStarter.warm`). Where it cannot start,
        the next pass's start of the workers says why, and falls back to threads, as without
        it: a failure here fails nothing."""
        with contextlib.suppress(Exception):
            self._make_pool.warm()

    def _start_pool(self) -> None:
        """Start the worker processes; the stage threads switch to them once every one is set
        up. A pool that cannot start, or whose workers fail to come up, leaves the stage on its
        threads, and says why in the decision. The pool is the stage's from its start, so that
        :meth:`close` stops it without waiting for a worker still setting up."""
        pool: ProcessPool | None = None
        try:
            # a worker started before its fork server is up waits for it in a handshake
            # nothing can cut short: wait here instead, where close() can
            if self._make_pool.warm() and not server_up.wait(self._closed):
                self._untried(True)
                return
            pool = self._make_pool()
            self._untried(False)  # they start: the next passes may start them at once
            with self._lock:
                if self._closed.is_set():
                    pool.close()
                    return
                self._pool = pool
            pool.wait_ready()
        except Exception as error:  # an unpicklable dataset, no fork server, a worker died, ...
            self._fall_back(pool, error)
            return
        with self._lock:
            if self._closed.is_set():  # close() has stopped the pool
                return
            if self._hands_over:  # the threads finish the batches they took, as few as now
                self.pool_ready = True
            else:
                self.route = PROCESS
                self._widen()  # each thread drives a process of its own

    def _untried(self, untried: bool) -> None:
        """Keep, for the next passes, whether the decision's processes are yet to be tried: the
        stage closed while they waited for their fork server (none started, and whether they
        can is not known: the next pass finds out as this one would have), or they started."""
        decision = self.decision
        if decision is not None and decision.untried != untried:
            self.decision = replace(decision, untried=untried)
            self._keep(self.decision)

    def _fall_back(self, pool: ProcessPool | None, error: Exception) -> None:
        """Stay on threads after ``pool`` failed to start or to come up, and keep that for the
        next passes in place of the processes, saying why; unless the stage closed while the
        pool came up: the error may then be the close's own, and the next pass starts them."""
        with self._lock:
            if self._pool is pool:
                self._pool = None
            interrupted = self._closed.is_set() and pool is not None
        if pool is not None:
            pool.close()
        if interrupted:
            return
        self._start_error = error
        self._widen()  # threads for good, as from the next pass
        self.decision = Decision(
            THREAD, f"worker processes could not start ({type(error).__name__}: {error})"
        )
        self._keep(self.decision)

    def _in_process(self, task: Any) -> Any:
        return getattr(self._bound_pool(), self._remote)(task)

    def _bound_pool(self) -> ProcessPool:
        """The worker processes, this thread bound to its own on its first task there."""
        pool = self._pool
        assert pool is not None
        if not self._ids.bound:
            pool.start(self._ids.worker)
            self._ids.bound = True
        return pool

    def take_pool(self) -> ProcessPool | None:
        """The worker processes a stage that ``hands_over`` started, once they are up (None
        before, and once the stage has closed); the caller owns them from then on."""
        with self._lock:
            if not self.pool_ready:  # not up yet, closed, or routed to by the stage itself
                return None
            pool, self._pool = self._pool, None
            self.pool_ready = False
        return pool

    @property
    def start_error(self) -> BaseException | None:
        """Why worker processes could not start, if they could not."""
        return self._start_error

    def release(self) -> None:
        """Tell the worker processes to stop, and the trial, without waiting for either (as the
        pipeline stops: :meth:`close` waits, once its threads are joined)."""
        self._closed.set()  # a starter that waits for it wakes at once
        # read without the lock, which a thread concluding the trial holds while it looks at
        # what worker processes would be sent (a pickle of the dataset): a pool made after this
        # is closed by its starter, which sees the flag, and close() stops what this misses
        trial, pool = self.trial, self._pool
        if trial is not None:
            trial.stop()
        if pool is not None:
            pool.release()

    def close(self) -> None:
        """Stop the worker processes, those still coming up included, then wait for the thread
        that starts them."""
        self._closed.set()  # before the lock, so a starter that waits for it wakes at once
        with self._lock:
            starter, trial = self._starter, self.trial
            pool, self._pool = self._pool, None
            self.pool_ready = False
        if trial is not None:
            trial.stop()
        if pool is not None:
            pool.close()  # wakes a starter waiting for it to come up
        if starter is not None and starter is not threading.current_thread():
            starter.join()  # one that made its pool after this closes the pool itself


class Cut:
    """The batches of a pass for the pipeline it starts with: the sampler's, until :meth:`cut`.

    After the cut the first pipeline's source ends at once (its epoch ends after the batches it
    took), and :attr:`rest` holds the sampler's batches from the next one on, for the pipeline
    the pass moves to. A batch is taken and counted under one lock, so the count the cut returns
    is exactly the batches the first pipeline has."""

    def __init__(self, batches: Iterator[Any]) -> None:
        self.rest = batches
        self._lock = threading.Lock()
        self._taken = 0
        self._cut = False

    def __iter__(self) -> Cut:
        return self

    def __next__(self) -> Any:
        with self._lock:
            if self._cut:
                raise StopIteration
            batch = next(self.rest)
            self._taken += 1
            return batch

    def cut(self) -> int:
        """End the first pipeline's batches here; how many it took."""
        with self._lock:
            self._cut = True
            return self._taken


def _narrow_gate(trial: Trial | None) -> Gate | None:
    """A trial on a few of the stage's threads keeps the others from taking tasks until the
    stage has decided (:meth:`Switch._widen` lets them)."""
    return Gate(trial.workers) if trial is not None and trial.narrow else None
