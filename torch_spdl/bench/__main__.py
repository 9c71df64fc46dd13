"""``python -m torch_spdl.bench``: torch's DataLoader against torch_spdl's, on four workloads.

A: a JPEG ImageFolder decoded, cropped and flipped into uint8 batches (a synthetic ImageNet-like
one, made once and cached, or ``--data DIR``); B: samples behind a 20 ms HTTP round trip; C: a
dataset of 2 M Python strings (copy-on-read); D: A's images feeding a training loop that needs
the GIL, through the PIL path and a tensor path, at worker counts that follow the host. Each
loader runs once per round, rounds are interleaved, and the table gives medians, peak PSS of the
process tree, time to first batch and main-process CPU, with ratios against torch's best loader.
Progress goes to stderr, the table and the targets to stdout, and ``--out`` receives
``bench.json`` (every measurement) and ``bench.png`` (the plot).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import platform
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch

from ..cpus import cores
from . import memory, remote, report, series, strings
from .measure import Result, Variant, run_rounds
from .targets import evaluate

WORKLOADS = ("A", "B", "C", "D")


@dataclass(frozen=True)
class Config:
    """Everything a run does, after ``--quick`` and the overrides are applied."""

    workloads: tuple[str, ...]
    rounds: int
    data: Path | None
    images: int
    out: Path
    a: series.ImageOptions  # its root is filled in when the data is ready
    b: remote.Options
    c: strings.Options
    d: series.TrainingOptions  # its root is filled in when the data is ready
    analysis: bool = True  # workload A's per-stage view after its rounds


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m torch_spdl.bench",
        description=__doc__.split("\n\n")[0].replace("``", ""),
    )
    parser.add_argument("--data", type=Path, help="your own ImageFolder for workload A")
    parser.add_argument(
        "--out", type=Path, default=Path("torch_spdl_bench"), help="where bench.png/.json go"
    )
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 5, quick 1)")
    parser.add_argument(
        "--batches",
        type=int,
        help="batches per measurement, every workload (default A 16, B 128, C the whole set)",
    )
    parser.add_argument(
        "--workloads", default="A,B,C,D", help="a comma-separated subset of A,B,C,D"
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run of under a minute")
    parser.add_argument(
        "--no-analysis",
        dest="analysis",
        action="store_false",
        help="skip workload A's per-stage view (CPU per step, thread scaling, CPU per thread)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        help="batches of an untimed first pass of each loader of A and D, so that the timed one "
        "is a later epoch (default A 0, D 8, quick 2): on a many-core host A's first pass is "
        "mostly worker_method='auto''s trial and the start of its processes",
    )
    parser.add_argument("--images", type=int, help="synthetic images for A (default 2048)")
    parser.add_argument("--strings", type=int, help="strings in C's dataset (default 2,000,000)")
    # set by orchestrate.py for the process that runs one workload, and for the report's
    parser.add_argument("--only", choices=WORKLOADS, help=argparse.SUPPRESS)
    parser.add_argument("--results-to", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--report-from", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--clock-start", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    wanted = tuple(w.strip().upper() for w in args.workloads.split(",") if w.strip())
    unknown = [w for w in wanted if w not in WORKLOADS]
    if unknown or not wanted:
        parser.error(f"--workloads takes a subset of A,B,C,D, got {args.workloads!r}")
    for name in ("rounds", "batches", "images", "strings"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} must be a positive integer, got {value}")
    if args.warmup is not None and args.warmup < 0:
        parser.error(f"--warmup must be 0 or more, got {args.warmup}")
    args.workloads = wanted
    return args


def configure(args: argparse.Namespace) -> Config:
    """Defaults sized for about 10 minutes on 2 cores; ``--quick`` for well under one."""
    quick = args.quick

    def pick(given: int | None, default: int, small: int) -> int:
        if given is not None:
            return given
        return small if quick else default

    batches = args.batches
    return Config(
        workloads=args.workloads,
        rounds=pick(args.rounds, 5, 1),
        data=args.data,
        images=pick(args.images, 2048, 256),
        out=args.out,
        a=series.ImageOptions(
            root=None,
            workers=series.host_workers(),
            batches=pick(batches, 16, 2),
            warmup=args.warmup or 0,
        ),
        b=remote.Options(
            batches=pick(batches, 128, 8),
            torch_workers=(4, 16) if quick else (4, 64),
            io_workers=(16,) if quick else (16, 64),
        ),
        c=strings.Options(
            strings=pick(args.strings, 2_000_000, 200_000),
            batches=batches or 0,
            torch_workers=(0, 4) if quick else (0, 2, 4),
            spdl_workers=(2,) if quick else (0, 2, 4),
        ),
        d=series.TrainingOptions(
            root=None,
            workers=series.host_workers(),
            batches=pick(batches, 16, 2),
            step_ms=5.0 if quick else 20.0,
            warmup=pick(args.warmup, 8, 2),
        ),
        analysis=args.analysis,
    )


class Progress:
    """One line per event on stderr, stamped with the seconds since ``start`` (a ``time.time()``,
    so that the workload processes stamp on the same clock as the run that started them)."""

    def __init__(self, start: float | None = None) -> None:
        self.start = time.time() if start is None else start

    def elapsed(self) -> float:
        return time.time() - self.start

    def __call__(self, message: str) -> None:
        print(f"[{self.elapsed():7.1f} s] {message}", file=sys.stderr, flush=True)


def image_root(config: Config, say: Callable[[str], None]) -> Path:
    if config.data is not None:
        return config.data
    from .data import ImageSpec, synthetic_imagefolder

    return synthetic_imagefolder(ImageSpec(images=config.images), progress=say)


def run_workload(config: Config, workload: str, say: Progress) -> dict[str, Any]:
    """All rounds of one workload, in this process; the results as JSON-ready data."""
    # torch warns when worker processes outnumber the cores; for B that is the point
    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
    torch.manual_seed(0)
    analysis: dict[str, Any] = {}
    if workload == "A":
        from . import images  # torchvision: only the process that runs A imports it

        root = image_root(config, say)
        with images.prepare(dataclasses.replace(config.a, root=root)) as variants:
            results = run_rounds(variants, config.rounds, say)
            if config.analysis:
                analysis = analyse_images(root, variants, small=config.images < 512, say=say)
    elif workload == "D":
        from . import training  # torchvision, as for A

        root = image_root(config, say)
        with training.prepare(dataclasses.replace(config.d, root=root)) as variants:
            results = run_rounds(variants, config.rounds, say)
    elif workload == "B":
        with remote.prepare(config.b) as variants:
            results = run_rounds(variants, config.rounds, say)
    else:
        with strings.prepare(config.c) as variants:
            results = run_rounds(variants, config.rounds, say)
    return {
        "results": [r.to_json() for r in results],
        "analysis": analysis,
        # a parent holding torch would take its share of torch's pages off the measured PSS
        "torch_outside": memory.maps(os.getppid(), "libtorch"),
    }


def analyse_images(
    root: Path, variants: Sequence[Variant], small: bool, say: Callable[[str], None]
) -> dict[str, Any]:
    """Workload A's per-stage view (see :mod:`.profile`), with each loader at the sweep's most
    workers (the host's cores)."""
    from . import images, profile

    most = max(variant.workers for variant in variants)

    say("workload A: CPU per step, thread scaling, loader CPU by thread")
    found: dict[str, Any] = {
        "stage_costs_ms": profile.stage_costs(root, images=8 if small else 128),
        "thread_scaling": profile.thread_scaling(
            root, items=16 if small else 256, rounds=1 if small else 3
        ),
        "loader_cpu_ms": {},
        "loader_cpu_workers": most,
    }
    for variant in variants:
        if variant.workers == most and variant.loader != images.PLAIN:
            found["loader_cpu_ms"][variant.name] = profile.loader_cpu(
                variant.make, variant.batches, images.BATCH
            )
        if variant.workers == most and variant.loader == images.SWAPPED:
            found["intra_op_threads"] = profile.intra_op_effect(variant, rounds=1 if small else 3)
    return found


def orchestrate(
    argv: Sequence[str], before: dict[str, Any], config: Config, say: Progress
) -> NoReturn:
    """Become ``orchestrate.py``, which runs each workload in a fresh process, then the report.

    A fresh process per workload keeps the memory each one measures its own: what an earlier
    workload left in the heap (freed memory that malloc keeps, thread arenas) would otherwise
    count against every loader measured after it. This process has torch mapped, so it gives
    way (``execv``) to a parent that has not: see :mod:`.orchestrate`.
    """
    work = Path(tempfile.mkdtemp(prefix="torch_spdl-bench-"))
    plan = {"workloads": list(config.workloads), "argv": list(argv), "environment": before}
    report.write_json(work / "plan.json", plan)
    script = Path(__file__).with_name("orchestrate.py")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-I", str(script), str(work), repr(say.start), *argv])


def collected(work: Path) -> tuple[list[str], dict[str, Any], list[Result], dict[str, Any]]:
    """What the workload processes of a run wrote: its argv, environment, results, analysis."""
    plan = json.loads((work / "plan.json").read_text())
    results: list[Result] = []
    analysis: dict[str, Any] = {}
    environment = plan["environment"]
    for workload in plan["workloads"]:
        data = json.loads((work / f"{workload}.json").read_text())
        results += [Result.from_json(r) for r in data["results"]]
        analysis.update(data["analysis"])
        environment["torch_outside"] = environment.get("torch_outside") or data["torch_outside"]
    return plan["argv"], environment, results, analysis


def environment() -> dict[str, Any]:
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpus": os.cpu_count(),
        "cores": cores(),  # those this process may use: its affinity, its cgroup's quota
        "load_average": os.getloadavg(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": importlib.metadata.version("torchvision"),
        "platform": platform.platform(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if not memory.available():
        print("the benchmark reads PSS from /proc/<pid>/smaps_rollup: Linux only", file=sys.stderr)
        return 2
    if not report.plotting_available():
        print("the plot needs matplotlib: pip install 'torch_spdl[bench]'", file=sys.stderr)
        return 2
    config = configure(args)
    say = Progress(args.clock_start)
    if args.only is not None:  # a workload's process, started by orchestrate.py
        say(f"workload {report.WORKLOAD_TITLES[args.only]}")
        report.write_json(args.results_to, run_workload(config, args.only, say))
        return 0
    if args.report_from is not None:  # the last process of a run of several workloads
        return finish(config, say, *collected(args.report_from))
    before = environment()
    say(
        f"{before['cpus']} CPUs, load average {before['load_average'][0]:.2f}; workloads "
        f"{','.join(config.workloads)}, {config.rounds} round(s)"
    )
    if len(config.workloads) > 1:
        orchestrate(argv, before, config, say)
    (workload,) = config.workloads  # this process has measured nothing yet: fresh enough
    say(f"workload {report.WORKLOAD_TITLES[workload]}")
    data = run_workload(config, workload, say)
    found = [Result.from_json(r) for r in data["results"]]
    before["torch_outside"] = data["torch_outside"]
    return finish(config, say, argv, before, found, data["analysis"])


def finish(
    config: Config,
    say: Progress,
    argv: Sequence[str],
    before: dict[str, Any],
    results: list[Result],
    analysis: dict[str, Any],
) -> int:
    """Print the table, the targets and the analysis; write the plot and the JSON."""
    targets = evaluate(results)
    after = os.getloadavg()
    print(report.table(results, config.rounds))
    if targets:
        print("\nTargets:\n" + report.targets_text(targets))
    if analysis:
        print("\n" + report.analysis_text(analysis))
    plot, raw = config.out / "bench.png", config.out / "bench.json"
    report.plot(results, plot)
    report.write_json(
        raw,
        {
            "command": " ".join(["python -m torch_spdl.bench", *argv]),
            "environment": before,
            "load_average_after": after,
            "seconds": say.elapsed(),
            "results": [r.to_json() for r in results],
            "targets": [t.to_json() for t in targets],
            "analysis": analysis,
        },
    )
    print(
        f"\nload average {before['load_average'][0]:.2f} at the start, {after[0]:.2f} at the end; "
        f"{say.elapsed():.0f} s in all"
    )
    print(f"plot: {plot}\nraw results: {raw}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
