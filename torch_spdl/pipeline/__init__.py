"""The torch_spdl engine: per-stage thread pools joined by bounded, stop-aware channels.

Usable on its own, without the DataLoader, through SPDL's builder (docs/pipeline.md)::

    from torch_spdl.pipeline import PipelineBuilder

    pipeline = (
        PipelineBuilder()
        .add_source(urls)
        .pipe(fetch, concurrency=32, output_order="input")
        .pipe(decode, concurrency=2, output_order="input")
        .add_sink()
        .build()
    )
    with pipeline.auto_stop():
        for image in pipeline:
            ...

or its parts: ``Pipeline(urls, [Stage("download", fetch, 32), Stage("decode", decode, 2)])``.
"""

from .builder import PipelineBuilder
from .channel import Channel, Closed, Gate, Slots, Stopped, StopSignal
from .items import End, EngineError, Failure
from .pipeline import Pipeline, WaitTimeout
from .regroup import Regroup
from .sources import SharedSource, WorkerSource
from .stages import Stage, Stream
from .stats import InFlight, StageReport

__all__ = [
    "Channel",
    "Closed",
    "End",
    "EngineError",
    "Failure",
    "Gate",
    "InFlight",
    "Pipeline",
    "PipelineBuilder",
    "Regroup",
    "SharedSource",
    "Slots",
    "Stage",
    "StageReport",
    "StopSignal",
    "Stopped",
    "Stream",
    "WaitTimeout",
    "WorkerSource",
]
