"""``python -m torch_spdl.bench``: its data, its memory measurement, its outputs, and a smoke run.

Nothing here checks a speed: timings belong to the benchmark's own runs, not to tests.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import helper_pids
from host_load import least_wait
from PIL import Image
from subprocesses import Ran, Run, run_python, run_together

import torch_spdl
from torch_spdl import auto, gil
from torch_spdl.bench import (
    data,
    images,
    memory,
    profile,
    remote,
    report,
    series,
    strings,
    targets,
    training,
)
from torch_spdl.bench.measure import Result, Sample, Variant, measure, run_rounds
from torch_spdl.io.region import region_decoder

MIB = 2**20


# -- the synthetic ImageFolder -------------------------------------------------------------------
def test_cache_dir_follows_xdg_then_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert data.cache_dir() == tmp_path / "xdg" / "torch_spdl"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert data.cache_dir() == tmp_path / "home" / ".cache" / "torch_spdl"


def test_synthetic_imagefolder_is_imagenet_like_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    said: list[str] = []
    spec = data.ImageSpec(images=12, seed=3)
    root = data.synthetic_imagefolder(spec, progress=said.append)
    assert root.parent == tmp_path / "torch_spdl" / "bench"
    files = sorted(root.glob("class_*/*.jpg"))
    assert len(files) == 12 and len(said) == 1
    assert {f.parent.name for f in files} == {f"class_{k:02d}" for k in range(data.CLASSES)}
    sizes = []
    for path in files:
        with Image.open(path) as image:
            assert image.format == "JPEG" and image.mode == "RGB"
            width, height = image.size
            image.load()  # the whole file decodes
        assert data.WIDTHS[0] <= width <= data.WIDTHS[1], (path, width)
        assert data.HEIGHTS[0] <= height <= data.HEIGHTS[1], (path, height)
        sizes.append(path.stat().st_size)
    assert 70_000 < sum(sizes) / len(sizes) < 160_000, sizes  # ImageNet's ~110 KB
    # made once: the second call writes nothing and returns the same folder
    stamps = [f.stat().st_mtime_ns for f in files]
    assert data.synthetic_imagefolder(spec, progress=said.append) == root
    assert len(said) == 1
    assert [f.stat().st_mtime_ns for f in files] == stamps
    assert not [p for p in root.parent.iterdir() if p.name.startswith(".")], "staging left over"


# -- the fast path of workload A -----------------------------------------------------------------
def jpeg(width: int, height: int) -> bytearray:
    pixels = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8).numpy()
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=85)
    return bytearray(out.getvalue())


@pytest.mark.parametrize("size", [(500, 375), (1800, 1400)], ids=["imagenet-sized", "large"])
def test_fast_transform_matches_the_classic_output_shape(size):
    classic = images.classic_transform()(Image.open(io.BytesIO(jpeg(*size))).convert("RGB"))
    encoded = jpeg(*size)
    for _ in range(20):  # several crops, flipped and not
        out = images.fast_transform(encoded)
        assert out.shape == classic.shape == (3, 224, 224)
        assert out.dtype == classic.dtype == torch.uint8


def test_the_gil_wait_of_two_threads_tells_python_from_native_work():
    """Two threads of pure Python take turns on the GIL, each waiting about half its time;
    hashing a large buffer releases it (with the GIL off, neither waits). Other load on the
    machine is time in the run queue, which is not counted: beside two busy programs on 2 cores
    the Python threads still read a 0.28-0.35 wait, far above the share at which ``"auto"``
    takes a stage to processes, and the hashing ones none."""
    blob = os.urandom(4 << 20)

    def python(i: int) -> int:
        return sum(range(200_000))

    by_python = least_wait(lambda: profile.pooled(python, 120, 2).gil_wait)
    by_hashing = least_wait(
        lambda: profile.pooled(lambda i: hashlib.sha256(blob).digest(), 40, 2).gil_wait
    )
    assert by_hashing < auto.STAGE_WAIT, by_hashing
    if gil.gil_enabled():
        assert by_python > 4 * auto.STAGE_WAIT, by_python
    else:
        assert by_python < auto.STAGE_WAIT, by_python


# -- memory: PSS of the process tree -------------------------------------------------------------
@contextlib.contextmanager
def waiting_child(code: str) -> Iterator[subprocess.Popen]:
    """A child process that runs ``code``, says ``ready``, then waits until its stdin closes."""
    code += "\nprint('ready', flush=True); import sys; sys.stdin.read()"
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        yield child
    finally:
        child.stdin.close()
        child.wait(10)
        child.stdout.close()


@pytest.fixture
def child_with_64_mib():
    """A child process holding 64 MiB of touched, private memory until its stdin closes."""
    with waiting_child("block = bytes(range(256)) * (1 << 18)") as child:
        yield child


@pytest.mark.skipif(not memory.available(), reason="PSS needs Linux's smaps_rollup")
def test_tree_pss_counts_children_and_leaves_out_excluded_ones(child_with_64_mib):
    me, child = os.getpid(), child_with_64_mib.pid
    assert child in memory.tree(me)
    assert child not in memory.tree(me, exclude=[child])
    own = memory.pss(me)
    assert memory.pss(child) > 60 * MIB
    assert memory.tree_pss() > own + 60 * MIB
    # other children (a fork server an earlier test started) count in both
    assert memory.tree_pss() - memory.tree_pss(exclude=[child]) > 60 * MIB
    assert memory.pss(2**22 + 12345) == 0  # no such process: counted as gone, not an error


@pytest.mark.skipif(not memory.available(), reason="PSS needs Linux's smaps_rollup")
def test_peak_pss_thread_sees_memory_freed_before_the_block_ends():
    with memory.PeakPss(interval=0.01, duty=0.5) as peak:
        base = memory.tree_pss()
        block = bytes(range(256)) * (1 << 18)  # 64 MiB, touched
        seen = peak.readings
        deadline = time.monotonic() + 10
        while peak.readings < seen + 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # waiting for the sampler thread to read while the block is held
        del block
    # the lower reading: a child of an earlier test (a fork server, a worker) may exit meanwhile
    assert peak.peak > min(base, memory.tree_pss()) + 50 * MIB
    assert not peak._thread.is_alive()


@pytest.mark.skipif(not memory.available(), reason="PSS needs Linux's smaps_rollup")
def test_peak_pss_counts_its_own_cpu_which_measure_leaves_out(monkeypatch):
    """The sampler's CPU is the main process's: measure subtracts it, so it must be counted,
    from the thread's clock or, where there is none, by the thread itself."""
    with memory.PeakPss(interval=0.01, duty=0.5) as peak:
        deadline = time.monotonic() + 10
        while peak.readings < 4 and time.monotonic() < deadline:
            time.sleep(0.01)  # the main thread idle: what the process spends is the sampler's
        clock = peak.cpu_s()
        monkeypatch.delattr(time, "pthread_getcpuclockid", raising=False)
        counted = peak.cpu_s()
    assert peak.readings >= 4
    assert clock > 0 and counted > 0
    # the thread's count lags its clock by at most the reading in progress
    assert counted <= clock + 0.005
    assert counted >= clock - 3 * clock / peak.readings


def test_measure_leaves_the_samplers_cpu_out_of_the_main_process(monkeypatch):
    """What the PSS sampler spent over the timed loop is subtracted from the main process's CPU:
    5 s of it over 10 samples is 500 s per 1,000 fewer."""

    def main_cpu(sampler_s: float) -> float:
        readings = iter([0.0, sampler_s])
        monkeypatch.setattr(memory.PeakPss, "cpu_s", lambda self: next(readings))
        variant = Variant("A", "fake", 1, lambda: [[0] * 5] * 2, 2, len)
        return measure(variant).main_cpu_s_per_1000

    assert main_cpu(0.0) - main_cpu(5.0) == pytest.approx(500.0, abs=1.0)


_HOARD: list[bytes] = []


class Hoarding(torch.utils.data.Dataset):
    """Each worker process that reads it keeps 64 MiB of touched memory."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        if not _HOARD:
            _HOARD.append(bytes(range(256)) * (1 << 18))
        return index


@pytest.mark.skipif(not memory.available(), reason="PSS needs Linux's smaps_rollup")
def test_measure_reads_memory_while_torchs_workers_are_still_alive():
    """A whole pass is counted out, not run to exhaustion, after which torch stops its workers."""
    # this process, not the whole tree: a child of an earlier test still exiting would count in
    # the base and be gone by the peak; multiprocessing's long-lived helpers (which torch_spdl's
    # worker processes start) are not torch's loader's memory, and its measurement leaves them out.
    # The lower of the readings before and after: this process may hand back an earlier test's
    # garbage to the kernel meanwhile (32 MiB once, under free-threading's allocator).
    before = memory.pss(os.getpid())
    make = lambda: torch.utils.data.DataLoader(Hoarding(), batch_size=2, num_workers=2)
    sample = measure(Variant("C", "torch", 2, make, 0, len))
    assert sample.samples == 8
    over = (sample.peak_pss_bytes - min(before, memory.pss(os.getpid()))) / MIB
    assert over > 64, f"peak {over:.1f} MiB over the base: not both workers' 64 MiB each"


# -- the per-stage view ---------------------------------------------------------------------------
class BusySamples(torch.utils.data.Dataset):
    """Each sample costs ``ms`` of this thread's CPU."""

    def __init__(self, size: int, ms: float) -> None:
        self.size, self.ms = size, ms

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        end = time.thread_time() + self.ms / 1000
        while time.thread_time() < end:
            pass
        return index


def test_loader_cpu_charges_the_work_to_the_worker_threads():
    make = lambda: torch_spdl.DataLoader(BusySamples(32, 5.0), batch_size=8, num_workers=2)
    spent = profile.loader_cpu(make, batches=4, size=8)
    assert spent["stage fetch"] >= 4.0, spent  # 5 ms per sample, measured in clock ticks
    assert spent.get("main thread", 0) < 2.0, spent


def test_loader_cpu_leaves_out_what_a_process_already_there_had_spent():
    """A fork server an earlier loader started is a child of the bench: only its CPU during
    this loader's batches may count."""
    busy = "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass"
    with waiting_child(busy):
        make = lambda: torch_spdl.DataLoader(BusySamples(32, 1.0), batch_size=8, num_workers=2)
        spent = profile.loader_cpu(make, batches=4, size=8)
    assert spent.get("worker processes", 0) < 2.0, spent  # its 0.5 s would be 15 ms a sample


# -- results, targets, table, plot ---------------------------------------------------------------
def fake(
    workload: str,
    loader: str,
    workers: int,
    rate: float,
    first: float,
    pss_mib: float,
    cpu: float = 0.5,
    step: float = 0.0,
):
    sample = Sample(rate, first, int(pss_mib * MIB), 64, 64 / rate, cpu, step)
    return Result(workload, loader, workers, samples=[sample])


def fake_results() -> list[Result]:
    return [
        fake("A", images.PLAIN, 1, 100, 0.6, 500),
        fake("A", "torch", 1, 95, 0.7, 600),
        fake("A", "torch", 2, 180, 0.7, 700),
        fake("A", images.SWAPPED, 1, 98, 0.5, 550),
        fake("A", images.SWAPPED, 2, 185, 0.3, 560),
        fake("A", images.HOOKS, 2, 280, 0.2, 560),
        fake("B", "torch", 4, 150, 1.0, 800),
        fake("B", "torch", 64, 400, 2.0, 4000),
        fake("B", "torch_spdl async load", 64, 1000, 0.1, 600),
        fake("C", "torch", 0, 1000, 0.01, 700),
        fake("C", "torch", 4, 200, 0.5, 2000),
        fake("C", "torch_spdl", 2, 950, 0.02, 720),
        fake("D", series.ALONE, 0, 3000, 0.01, 400, 0.1, 0.020),
        fake("D", "torch", 1, 90, 0.7, 600, 1.0, 0.030),
        fake("D", "torch", 2, 150, 0.7, 700, 1.2, 0.034),
        fake("D", series.SWAPPED, 2, 120, 0.3, 560, 9.0, 0.054),
        fake("D", series.SPDL_PROCESS, 2, 140, 0.5, 700, 2.5, 0.036),
        fake("D", series.TORCH_TENSOR, 2, 200, 0.5, 700, 1.0, 0.030),
        fake("D", series.SPDL_TENSOR, 2, 260, 0.3, 560, 6.0, 0.022),
        fake("D", series.HOOKS, 2, 190, 0.2, 560, 0.8, 0.021),
    ]


def test_the_fork_server_is_not_torchs_memory():
    """torch_spdl's worker processes leave multiprocessing's fork server and resource tracker
    up; the PSS of torch's loader measured after them does not carry them, and those helpers
    are found by their command line."""
    list(torch_spdl.DataLoader(list(range(8)), num_workers=1, worker_method="process"))
    assert helper_pids() and set(memory.helpers()) == helper_pids()
    mine = memory.tree(os.getpid())
    assert helper_pids() <= set(mine)
    assert not helper_pids() & set(memory.tree(os.getpid(), passed=memory.helpers()))


class Decided:
    """A loader whose "auto" decided as ``executor`` says."""

    worker_method = "auto"

    def __init__(self, executor: str) -> None:
        self.executor = executor

    def stats(self):
        return self


def test_a_pass_that_ran_on_threads_is_labelled_so():
    """ "auto" chose processes for the next pass: this one ran on its threads."""
    from torch_spdl.bench.measure import auto_executor

    chose = "worker_method='auto' chose process: the GIL binds it"
    assert auto_executor(Decided(chose)) == "auto: process"
    later = f"{chose}; worker processes {auto.NEXT_PASS}"
    assert auto_executor(Decided(later)) == "auto: thread (process from the next pass)"


def test_targets_are_ratios_of_the_right_loaders(monkeypatch):
    monkeypatch.setattr(targets, "cores", lambda: 16)  # 2 workers keep 2 of them busy
    found = {t.name: t for t in targets.evaluate(fake_results())}
    limit = found["A: speed, torch_spdl (2) / 2-core limit (2 × plain loop, 1 thread)"]
    assert limit.value == pytest.approx(185 / 200) and limit.met
    monkeypatch.setattr(targets, "cores", lambda: 1)  # a 1-core quota: 2 workers share it
    found_on_one = {t.name: t for t in targets.evaluate(fake_results())}
    one = found_on_one["A: speed, torch_spdl (2) / 1-core limit (1 × plain loop, 1 thread)"]
    assert one.value == pytest.approx(185 / 100)
    swap = found["A: speed, torch_spdl (2) / torch (2)"]
    assert swap.value == pytest.approx(185 / 180) and not swap.met  # needs 1.1x
    hooks = found["A: speed, torch_spdl hooks+fast path (2) / torch (2)"]
    assert hooks.value == pytest.approx(280 / 180) and not hooks.met  # needs 1.6x
    assert found["B: speed, torch_spdl async load (64) / torch (4)"].met  # 6.7x
    assert found["B: speed, torch_spdl async load (64) / torch (64)"].met  # 2.5x
    memory_b = found["B: peak PSS, torch_spdl async load (64) / torch (64)"]
    assert memory_b.value == pytest.approx(600 / 4000) and memory_b.met
    assert found["C: peak PSS, torch_spdl (2) / torch (4)"].value == pytest.approx(0.36)
    assert found["C: speed, torch_spdl (2) / torch (0)"].met  # 0.95
    first = found["C: time to first batch, torch_spdl (2) / torch (4)"]
    assert first.value == pytest.approx(0.04) and first.met
    assert found["D: speed, torch_spdl (2) / torch (2)"].value == pytest.approx(120 / 150)
    step = found["D: consumer step, torch_spdl (2) / torch (2)"]
    assert step.value == pytest.approx(54 / 34) and not step.met  # slower beside the threads
    cpu = found["D: main-process CPU, torch_spdl process (2) / torch (2)"]
    assert cpu.value == pytest.approx(2.5 / 1.2) and not cpu.met
    tensor = found["D: speed, torch_spdl tensor path (2) / torch tensor path (2)"]
    assert tensor.value == pytest.approx(1.3) and tensor.met  # needs 1.2x
    fast = found["D: speed, torch_spdl hooks+fast path (2) / torch (2)"]
    assert fast.value == pytest.approx(190 / 150) and fast.met  # needs 1.2x
    assert len(found) == 17


def test_table_has_every_column_and_ratios_to_torchs_best():
    text = report.table(fake_results(), rounds=3)
    header = next(line for line in text.splitlines() if line.startswith("| workload"))
    assert [cell.strip() for cell in header.strip("|").split("|")] == list(report.COLUMNS)
    row = next(line for line in text.splitlines() if "hooks+fast path" in line)
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[3:5] == ["280", f"{280 / 180:.2f}"]  # against torch (2), A's fastest torch
    assert "Medians of 3" in text
    row = next(line for line in text.splitlines() if "| D | torch_spdl | 2 |" in line)
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[9:11] == ["9.00", f"{54 / 20:.2f}"]  # main CPU, step against consumer alone


def test_plot_writes_a_png_and_results_round_trip_through_json(tmp_path):
    path = tmp_path / "out" / "bench.png"
    report.plot(fake_results(), path)
    with Image.open(path) as image:
        assert image.format == "PNG" and image.width > 500 and image.height > 300
        image.verify()
    raw = tmp_path / "out" / "bench.json"
    report.write_json(raw, {"results": [r.to_json() for r in fake_results()]})
    loaded = [Result.from_json(r) for r in json.loads(raw.read_text())["results"]]
    assert loaded == fake_results()


def test_rounds_are_interleaved_and_each_variant_measured_every_round():
    order: list[str] = []

    def loader(name: str) -> Variant:
        def make():
            order.append(name)
            return [[1, 2], [3, 4], [5]]

        return Variant("C", name, 0, make, 0, len)

    results = run_rounds([loader("x"), loader("y")], rounds=3, progress=lambda m: None)
    assert order == ["x", "y", "y", "x", "x", "y"]  # the first variant rotates each round
    assert [len(r.samples) for r in results] == [3, 3]
    assert all(s.samples == 5 and s.peak_pss_bytes > 0 for r in results for s in r.samples)


# -- workloads B and C in this process, and a whole run in another ---------------------------------
def test_remote_variants_read_verified_items_and_leave_the_server_out():
    options = remote.Options(batches=2, torch_workers=(2,), io_workers=(8,))
    with remote.prepare(options) as variants:
        server = variants[0].exclude_pids[0]
        assert all(v.exclude_pids == (server,) for v in variants)
        assert server in memory.tree(os.getpid())  # a child of ours, but not measured
        assert server not in memory.tree(os.getpid(), exclude=[server])
        for variant in variants:  # torch with 2 worker processes, torch_spdl with 8 requests
            sample = measure(variant)  # variant.check verifies the first batch's bytes
            assert sample.samples == 2 * remote.BATCH and sample.peak_pss_bytes > 0
    assert server not in memory.tree(os.getpid())  # stopped with the block


def test_strings_variants_read_the_whole_list_in_batches_of_512():
    options = strings.Options(strings=3000, batches=0, torch_workers=(0, 2), spdl_workers=(2,))
    with strings.prepare(options) as variants:
        held = variants[0].make().dataset.items
        for variant in variants:
            assert measure(variant).samples == 3000  # 5 full batches and one of 440
    assert held == []  # the memory is given back before anything else is measured


# -- workload D ----------------------------------------------------------------------------------
def test_worker_sweep_follows_the_host():
    assert series.host_workers(2) == (1, 2)
    assert series.host_workers(16) == (1, 8, 16)
    assert series.host_workers(1) == (1,)


def test_the_training_step_is_calibrated_in_ops_and_runs_them():
    step = training.calibrate(2.0)
    assert step.ops >= 1
    step(None)
    step(None)
    assert step.state[0].item() == 2 * step.ops  # each op is one dispatch: nothing skipped


def test_training_variants_yield_checked_batches_and_measure_the_consumer(tmp_path, monkeypatch):
    """Every series of workload D reads the same kind of batch, and a measurement reports the
    consumer's step and the main process's CPU."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    root = data.synthetic_imagefolder(data.ImageSpec(images=64, seed=1), progress=lambda m: None)
    options = series.TrainingOptions(root=root, workers=(1,), batches=1, step_ms=1.0)
    with training.prepare(options) as variants:
        assert {v.loader for v in variants} == {
            series.ALONE,
            "torch",
            series.SWAPPED,
            series.SPDL_PROCESS,
            series.TORCH_TENSOR,
            series.SPDL_TENSOR,
            series.HOOKS,
            *([series.HOOKS_WHOLE] if region_decoder() is not None else []),
        }
        for variant in variants:
            if variant.loader in ("torch", series.SPDL_PROCESS):
                continue  # worker processes: the same batches, at a second each here
            sample = measure(variant)  # check_batch asserts the shape and dtype
            assert sample.samples == images.BATCH and sample.step_s > 0
            assert sample.main_cpu_s_per_1000 > 0


def test_workload_a_follows_the_host_and_its_analysis_can_be_skipped():
    from torch_spdl.bench import __main__ as bench

    config = bench.configure(bench.parse_args(["--quick"]))
    assert config.a.workers == series.host_workers() and config.analysis
    assert series.host_workers(16) == (1, 8, 16)
    assert not bench.configure(bench.parse_args(["--no-analysis"])).analysis


def test_warmup_gives_a_and_d_an_untimed_first_pass_of_that_many_batches(tmp_path, monkeypatch):
    """``--warmup``: A's loaders (not the plain loop, which starts nothing) and D's read that many
    batches before the timed pass; A's default stays a first pass, D's 8 (quick 2)."""
    from torch_spdl.bench import __main__ as bench

    default, quick = (
        bench.configure(bench.parse_args([])),
        bench.configure(bench.parse_args(["--quick"])),
    )
    assert (default.a.warmup, default.d.warmup, quick.a.warmup, quick.d.warmup) == (0, 8, 0, 2)
    given = bench.configure(bench.parse_args(["--warmup", "3"]))
    assert (given.a.warmup, given.d.warmup) == (3, 3)
    assert bench.configure(bench.parse_args(["--warmup", "0"])).d.warmup == 0
    with pytest.raises(SystemExit):
        bench.parse_args(["--warmup", "-1"])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    root = data.synthetic_imagefolder(data.ImageSpec(images=64, seed=1), progress=lambda m: None)
    options = series.ImageOptions(root=root, workers=(1,), batches=1, warmup=1)
    with images.prepare(options) as variants:
        assert {v.loader: v.warmup for v in variants}[series.PLAIN] == 0
        assert {v.warmup for v in variants if v.loader != series.PLAIN} == {1}
    longer = series.ImageOptions(root=root, workers=(1,), batches=1, warmup=2)
    with pytest.raises(ValueError, match="2 batches of 64 need 128"), images.prepare(longer):
        pass


@pytest.mark.integration
def test_only_the_images_workload_imports_torchvision():
    """B and C measure the memory of their processes: an unused torchvision (160 MB of PSS)
    would count on both sides of their ratios."""
    code = (
        "import sys; import torch_spdl.bench.__main__ as bench, torch_spdl.bench.remote, "
        "torch_spdl.bench.strings; bench.configure(bench.parse_args([])); "
        "print('torchvision' in sys.modules)"
    )
    assert run_python("-c", code).strip() == "False"


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory) -> dict[str, tuple[Ran, Path]]:
    """The two smoke runs below, at once (each mostly starts interpreters and loaders): what
    each gave and its folder."""
    one, several = tmp_path_factory.mktemp("bench-one"), tmp_path_factory.mktemp("bench-several")
    (several / "tmp").mkdir()
    bench = [sys.executable, "-m", "torch_spdl.bench", "--quick", "--workloads"]
    runs = {
        "one": Run(
            [*bench, "A", "--batches", "1", "--images", "64", "--out", str(one / "out")],
            env={"XDG_CACHE_HOME": str(one / "cache")},
        ),
        "several": Run(
            [*bench, "C,B", "--batches", "2", "--strings", "5000", "--out", str(several / "out")],
            env={"TMPDIR": str(several / "tmp")},
        ),
    }
    ran = run_together({name: [run] for name, run in runs.items()})
    return {"one": (ran["one"], one), "several": (ran["several"], several)}


@pytest.mark.integration
def test_quick_run_prints_the_table_and_writes_the_plot(smoke_runs):
    """Workload A end to end: the table, the targets, the per-stage view, the JSON and the PNG.
    One workload runs in the bench's own process."""
    ran, tmp_path = smoke_runs["one"]
    stdout = ran.check()
    out = tmp_path / "out"
    header = "| " + " | ".join(report.COLUMNS) + " |"
    assert header in stdout
    most = max(series.host_workers())  # the sweep follows the host: 1, half, all its cores
    assert f"\n| A | torch_spdl hooks+fast path | {most} |" in stdout, stdout
    assert "Targets:" in stdout
    assert "[met]" in stdout or "[NOT met]" in stdout
    assert "Workload A, loader CPU per sample by thread or process" in stdout
    assert f"[round 1/1] A torch_spdl hooks+fast path ({most})" in ran.errors  # progress
    assert (tmp_path / "cache" / "torch_spdl" / "bench").is_dir()  # not the real home cache
    with Image.open(out / "bench.png") as image:
        assert image.format == "PNG"
    raw = json.loads((out / "bench.json").read_text())
    loaders = {r["loader"] for r in raw["results"]}
    region = {series.HOOKS_WHOLE} if region_decoder() is not None else set()
    assert loaders == {images.PLAIN, images.TORCH, images.SWAPPED, images.HOOKS, *region}
    assert all(r["median_peak_pss_bytes"] > 0 for r in raw["results"])


@pytest.mark.integration
def test_several_workloads_run_in_fresh_processes_under_a_parent_without_torch(smoke_runs):
    """With several workloads each runs in its own process, under a parent that has not mapped
    torch: one that had would take its share of torch's pages off every PSS measured."""
    ran, tmp_path = smoke_runs["several"]
    stdout = ran.check()
    out = tmp_path / "out"
    assert "\n| B | torch_spdl async load | 16 |" in stdout, stdout
    assert "\n| C | torch_spdl | 2 |" in stdout, stdout
    assert ran.errors.index("workload C") < ran.errors.index("workload B")
    raw = json.loads((out / "bench.json").read_text())
    assert raw["environment"]["torch_outside"] is False
    assert raw["command"].endswith("--out " + str(out))  # the user's arguments only
    assert {r["workload"] for r in raw["results"]} == {"B", "C"}
    assert list((tmp_path / "tmp").iterdir()) == []  # the parent's work folder is gone
