"""The benchmark's outputs: a Markdown table on stdout, a JSON of every measurement, a PNG plot.

The table is Markdown so that it can be pasted into ``docs/performance.md`` as printed. Ratios
in it are against torch's best loader of the same workload (its fastest ``num_workers``), so a
row reads as "this much faster, this much sooner, this much memory, compared with the best
torch managed here". The plot has a column per workload: throughput (top) and peak PSS (bottom)
against the worker count of each loader.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..cpus import cores
from .measure import TORCH, Result
from .series import ALONE, PLAIN
from .targets import Lookup, Target

COLUMNS = (
    "workload",
    "loader",
    "workers",
    "samples/s",
    "× torch",
    "first batch (s)",
    "× torch",
    "peak PSS (MiB)",
    "× torch",
    "main CPU s/1k",
    "step × alone",
    "setting",
)
WORKLOAD_TITLES = {
    "A": "A: JPEG decode + RandomResizedCrop + flip",
    "B": "B: HTTP GET, 16 KB, 20 ms latency",
    "C": "C: 2 M Python strings (copy-on-read)",
    "D": "D: A's images feeding a GIL-bound training step",
}
X_LABELS = {
    "A": "num_workers",
    "B": "worker processes (torch) / io_workers (torch_spdl)",
    "C": "num_workers",
    "D": "num_workers",
}
MIB = 2**20


def plotting_available() -> bool:
    """Whether matplotlib (``pip install torch_spdl[bench]``) is there to draw the plot."""
    return importlib.util.find_spec("matplotlib") is not None


def torch_best(results: Sequence[Result], workload: str) -> Result | None:
    return Lookup(results).fastest(workload, TORCH)


def _seconds(value: float) -> str:
    """Two significant digits at least: workload C's CPU per 1,000 samples is a few 0.0001 s."""
    return f"{value:.2f}" if value >= 0.1 else f"{value:.2g}"


def _ratio(mine: float, theirs: float | None) -> str:
    return "" if not theirs else f"{mine / theirs:.2f}"


def table(results: Sequence[Result], rounds: int) -> str:
    """Medians over ``rounds``, one row per variant, in the order they were defined."""
    lines = [
        f"Medians of {rounds} interleaved round(s); × torch: ratio to the fastest row of "
        "torch's `DataLoader` series of the same workload (for D, its PIL path; the tensor "
        "paths' own ratio is in the targets).",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "|".join("---" if i < 3 or i == 11 else "---:" for i in range(len(COLUMNS))) + "|",
    ]
    best = {workload: torch_best(results, workload) for workload in {r.workload for r in results}}
    find = Lookup(results)
    for result in results:
        ref = best[result.workload]
        alone = find.at(result.workload, ALONE, 0)
        cells = [
            result.workload,
            result.loader,
            str(result.workers),
            f"{result.rate:,.0f}",
            _ratio(result.rate, ref.rate if ref else None),
            f"{result.first_batch:.3f}",
            _ratio(result.first_batch, ref.first_batch if ref else None),
            f"{result.peak_pss / MIB:,.0f}",
            _ratio(result.peak_pss, ref.peak_pss if ref else None),
            _seconds(result.main_cpu),
            _ratio(result.step, alone.step if alone else None) if result.step else "",
            "; ".join(text for text in (result.note, result.executors) if text),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets_text(targets: Sequence[Target]) -> str:
    return "\n".join(target.describe() for target in targets)


def analysis_text(analysis: Mapping[str, Any]) -> str:
    """Workload A's per-stage view (:mod:`.profile`) as three small Markdown tables."""
    costs = analysis.get("stage_costs_ms", {})
    lines = ["Workload A, CPU per step (one thread, no loader):", ""]
    lines += ["| step | CPU ms per sample |", "|---|---:|"]
    for name, value in costs.items():
        shown = f"{value:.1f} %" if name.endswith("(%)") else f"{value:.3f}"
        lines.append(f"| {name} | {shown} |")
    lines += ["", "Workload A, the per-sample work alone on plain threads, and intra-op threads:"]
    lines += ["", "| measure | value |", "|---|---:|"]
    for name, value in analysis.get("thread_scaling", {}).items():
        lines.append(f"| {name} | {value:,.2f} |")
    for name, value in analysis.get("intra_op_threads", {}).items():
        lines.append(f"| {name} | {value:,.0f} |")
    workers = analysis.get("loader_cpu_workers", 2)
    title = f"Workload A, loader CPU per sample by thread or process (ms), {workers} workers:"
    lines += ["", title, ""]
    lines += ["| loader | where | CPU ms per sample |", "|---|---|---:|"]
    for loader, groups in analysis.get("loader_cpu_ms", {}).items():
        for group, value in groups.items():
            lines.append(f"| {loader} | {group} | {value:.3f} |")
        lines.append(f"| {loader} | **total** | **{sum(groups.values()):.3f}** |")
    return "\n".join(lines)


def write_json(path: Path, payload: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n")


def plot(results: Sequence[Result], path: Path) -> None:
    """Throughput and peak PSS against workers, a line per loader, a column per workload.

    Workload A also gets the plain loop's rate and that times the cores (the core limit) as flat
    lines.
    Matplotlib's object API with no pyplot: nothing global, no display needed (Agg renders PNG).
    """
    from matplotlib.figure import Figure  # imported here: the bench extra, not a dependency

    workloads = list(dict.fromkeys(r.workload for r in results))
    figure = Figure(figsize=(5 * len(workloads), 7.5), layout="constrained")
    axes = figure.subplots(2, len(workloads), squeeze=False)
    for column, workload in enumerate(workloads):
        mine = [r for r in results if r.workload == workload]
        top, bottom = axes[0][column], axes[1][column]
        ticks = sorted({r.workers for r in mine})
        for loader in dict.fromkeys(r.loader for r in mine):
            if loader in (PLAIN, ALONE):
                continue
            series = sorted((r for r in mine if r.loader == loader), key=_workers)
            x = [ticks.index(r.workers) for r in series]
            top.plot(x, [r.rate for r in series], marker="o", label=loader)
            bottom.plot(x, [r.peak_pss / MIB for r in series], marker="o", label=loader)
        for plain in (r for r in mine if r.loader == PLAIN):
            top.axhline(
                plain.rate, color="grey", linestyle=":", label="torch's transform, 1 thread"
            )
            n = cores()
            top.axhline(
                n * plain.rate, color="black", linestyle="--", label=f"{n}-core limit ({n} × that)"
            )
        top.set_title(WORKLOAD_TITLES.get(workload, workload), fontsize=10)
        top.set_ylabel("samples/s (median)")
        bottom.set_ylabel("peak PSS of the process tree (MiB)")
        for ax in (top, bottom):
            ax.set_xticks(range(len(ticks)), [str(t) for t in ticks])
            ax.set_xlabel(X_LABELS.get(workload, "workers"))
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        top.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=80)


def _workers(result: Result) -> int:
    return result.workers
