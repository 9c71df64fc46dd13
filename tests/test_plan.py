"""The planner: options and dataset in, one plan out; and the loader runs the plan it reports."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from index_datasets import Indices, StagedIndices
from torch.utils.data import IterableDataset

import torch_spdl
from torch_spdl.auto import INLINE, PROCESS, THREAD, Decision
from torch_spdl.hooks import Hooks
from torch_spdl.options import Options
from torch_spdl.plan import AUTO, BATCHES, SAMPLES, STREAMS, make_plan

pytestmark = pytest.mark.usefixtures("no_leak")

STAGED = Hooks(load=lambda index: index, preprocess=lambda raw: raw)
FOLDER = Hooks(load=lambda index: index, preprocess=lambda raw: raw, from_folder=True)
OWN = Hooks(load=lambda index: index, preprocess=lambda raw: raw, own_load=True)


async def load_async(index):
    return index


def plan_of(
    options: Options | None = None,
    *,
    num_workers: int = 2,
    hooks: Hooks | None = None,
    iterable: bool = False,
    decided: Decision | None = None,
    persistent: bool = False,
    cached: bool = False,
    samples_per_batch: int = 4,
    stateful: bool = False,
    server_up: bool = True,
):
    return make_plan(
        options or Options(),
        num_workers=num_workers,
        prefetch_factor=2 if num_workers else None,
        in_order=True,
        persistent=persistent,
        iterable=iterable,
        hooks=hooks,
        cached=cached,
        decided=decided,
        pin_memory=False,
        samples_per_batch=samples_per_batch,
        stateful=stateful,
        server_up=server_up,
    )


# -- where the CPU stage runs ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "worker_method, num_workers, iterable, executor",
    [
        ("auto", 0, False, INLINE),
        ("process", 0, False, INLINE),  # num_workers=0 loads in the loop's thread, as torch's
        ("auto", 2, False, AUTO),
        ("thread", 2, False, THREAD),
        ("process", 2, False, PROCESS),
        ("multiprocessing", 2, False, PROCESS),
        ("auto", 2, True, THREAD),  # streams stay where they start
        ("process", 2, True, PROCESS),
    ],
)
def test_the_cpu_stage_runs_where_the_options_say(worker_method, num_workers, iterable, executor):
    plan = plan_of(Options(worker_method=worker_method), num_workers=num_workers, iterable=iterable)
    assert plan.executor == executor
    assert plan.shape == (STREAMS if iterable else BATCHES)


def test_streams_under_auto_say_why_they_stay_on_threads():
    plan = plan_of(iterable=True)
    assert plan.decision is not None and plan.decision.executor == THREAD
    assert "streams stay where they start" in str(plan.decision)


@pytest.mark.parametrize(
    "worker_method, num_workers, hooks, iterable, copies, executor",
    [
        ("auto", 2, None, False, True, THREAD),  # stays on the threads' copies
        ("thread", 2, None, False, True, THREAD),
        ("process", 2, None, False, True, PROCESS),  # a copy in each process
        ("auto", 0, None, False, False, INLINE),  # the loader's own dataset, as torch's
        ("auto", 2, STAGED, False, False, AUTO),  # hooks: the dataset is shared, not copied
        ("auto", 2, None, True, False, THREAD),  # a stream's copies are its workers' already
    ],
)
def test_a_dataset_with_state_is_read_from_a_copy_per_worker(
    worker_method, num_workers, hooks, iterable, copies, executor
):
    options = Options(worker_method=worker_method)
    plan = plan_of(options, num_workers=num_workers, hooks=hooks, iterable=iterable, stateful=True)
    assert (plan.copies, plan.executor) == (copies, executor)
    assert ("'s copy of the dataset" in str(plan)) is copies
    if copies and worker_method == "auto":
        assert plan.decision is not None and "stays on its workers' copies" in str(plan.decision)
    assert not plan_of(options, num_workers=num_workers, hooks=hooks, iterable=iterable).copies


@pytest.mark.parametrize(
    "decided, persistent, executor",
    [
        (PROCESS, False, PROCESS),
        (PROCESS, True, PROCESS),
        (INLINE, False, INLINE),
        (INLINE, True, INLINE),  # a persistent iterator's threads stop as the pass begins
        (THREAD, False, AUTO),
    ],
)
def test_an_earlier_auto_decision_is_followed(decided, persistent, executor):
    plan = plan_of(decided=Decision(decided, "measured"), persistent=persistent)
    assert plan.executor == executor
    assert plan.decision is not None and plan.decision.executor == decided


@pytest.mark.parametrize("persistent", [False, True])
def test_processes_whose_fork_server_still_imports_start_on_the_passs_threads(persistent):
    """The pass does not wait for the server: "auto" runs it on threads until they are up."""
    plan = plan_of(decided=Decision(PROCESS, "measured"), persistent=persistent, server_up=False)
    assert plan.executor == AUTO and plan.decision is not None
    assert plan.decision.executor == PROCESS
    fixed = plan_of(Options(worker_method="process"), server_up=False)  # asked for: they wait
    assert fixed.executor == PROCESS


def test_an_earlier_decision_does_not_apply_to_a_fixed_worker_method():
    plan = plan_of(Options(worker_method="thread"), decided=Decision(PROCESS, "measured"))
    assert (plan.executor, plan.decision) == (THREAD, None)


# -- which stages ---------------------------------------------------------------------------------
def test_hooks_make_a_sample_pipeline_with_enough_batches_for_the_io_threads():
    plan = plan_of(Options(io_workers=16), hooks=STAGED, samples_per_batch=2)
    assert (plan.shape, plan.stages) == (SAMPLES, ("load", "preprocess", "collate"))
    assert plan.in_flight == 8  # 16 I/O threads / 2 samples per batch > 2 workers x prefetch 2
    assert plan_of(hooks=STAGED, samples_per_batch=64).in_flight == 4


@pytest.mark.parametrize(
    "worker_method, options, shape",
    [
        ("thread", {}, SAMPLES),  # threads: the split pays (I/O threads, GIL-free decode)
        ("process", {}, BATCHES),  # processes: the folder runs whole in the worker, as torch's
        ("auto", {}, BATCHES),  # it may move to processes
        ("process", {"max_failures": 2}, SAMPLES),  # skipping a sample needs the split
    ],
)
def test_a_folder_runs_whole_where_the_stage_may_be_in_processes(worker_method, options, shape):
    plan = plan_of(Options(worker_method=worker_method, **options), hooks=FOLDER)
    assert plan.shape == shape
    assert plan_of(Options(worker_method=worker_method), hooks=FOLDER, cached=True).shape == SAMPLES


@pytest.mark.parametrize(
    "worker_method, hooks, options, decided, whole",
    [
        ("process", OWN, {}, None, True),  # in processes from the start: read whole there
        ("auto", OWN, {}, Decision(PROCESS, "measured"), True),  # moved there by an earlier pass
        ("auto", OWN, {}, None, False),  # threads first: the split spreads a batch over them
        ("thread", OWN, {}, None, False),
        ("process", STAGED, {}, None, False),  # load_fn=: a worker would need it pickled
        ("process", dataclasses.replace(OWN, load=load_async), {}, None, False),  # event loop
        ("process", dataclasses.replace(OWN, load_many=len), {}, None, False),  # one call
        ("process", OWN, {"max_failures": 2}, None, False),  # skipping a sample needs the split
    ],
)
def test_a_staged_dataset_is_read_whole_where_the_pass_starts_in_processes(
    worker_method, hooks, options, decided, whole
):
    plan = plan_of(Options(worker_method=worker_method, **options), hooks=hooks, decided=decided)
    assert (plan.whole is hooks, plan.shape) == ((True, BATCHES) if whole else (False, SAMPLES))
    assert plan.hooks is (None if whole else hooks)
    # a cache works per sample in the main process
    options = Options(worker_method=worker_method)
    cached = plan_of(options, hooks=hooks, decided=decided, cached=True)
    assert (cached.whole, cached.shape) == (None, SAMPLES)


@pytest.mark.parametrize(
    "num_workers, hooks, iterable, where",
    [
        (2, STAGED, False, "collate"),
        (0, STAGED, False, "fetch"),
        (2, None, False, "fetch"),
        (2, None, True, "fetch"),
    ],
)
def test_failing_samples_are_left_out_in_one_named_stage(num_workers, hooks, iterable, where):
    options = Options(max_failures=3, worker_method="thread")
    plan = plan_of(options, num_workers=num_workers, hooks=hooks, iterable=iterable)
    assert plan.skips_failures == where
    assert plan_of(Options(), hooks=hooks).skips_failures is None


def test_a_device_adds_a_transfer_stage():
    plan = plan_of(Options(device="cpu"), hooks=STAGED)
    assert plan.stages == ("load", "preprocess", "collate", "transfer")
    assert not plan.pins  # only a copy to CUDA is pinned first
    assert "transfer" not in plan_of().stages


# -- the loader runs the plan it reports ----------------------------------------------------------
class Stream(IterableDataset):
    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(start, 12, step))


@pytest.mark.parametrize(
    "dataset, kwargs, plan",
    [
        (Indices(12), {"worker_method": "thread"}, "batches: fetch; fetch on 2 threads"),
        (Indices(12), {"worker_method": "process"}, "batches: fetch; fetch in 2 worker processes"),
        (StagedIndices(12), {}, "samples: load -> preprocess -> collate; preprocess on 2 threads"),
        (
            StagedIndices(12),
            {"device": "cpu"},
            "samples: load -> preprocess -> collate -> transfer",
        ),
        (Stream(), {}, "streams: fetch; fetch on 2 threads;"),
    ],
)
def test_the_pipeline_runs_the_plan_it_reports_with_torchs_batches(dataset, kwargs, plan):
    loader = torch_spdl.DataLoader(dataset, batch_size=4, num_workers=2, **kwargs)
    reference = torch.utils.data.DataLoader(dataset, batch_size=4, num_workers=2)
    assert [b.tolist() for b in loader] == [b.tolist() for b in reference]
    report = loader.stats()
    assert report.plan.startswith(plan), report.plan
    stages = report.plan.split(";")[0].split(": ")[1].split(" -> ")
    assert [stage.name for stage in report.stages] == stages
    assert f"plan: {report.plan}" in str(report)
