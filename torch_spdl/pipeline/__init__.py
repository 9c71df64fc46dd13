"""The torch_spdl engine: per-stage thread pools joined by bounded, stop-aware channels.

Usable on its own, without the DataLoader::

    from torch_spdl.pipeline import Pipeline, Stage

    with Pipeline(urls, [Stage("download", fetch, concurrency=32),
                         Stage("decode", decode, concurrency=2)]) as pipe:
        for image in pipe:
            ...
"""

from .channel import Channel, Closed, Slots, Stopped, StopSignal
from .items import End, Failure
from .pipeline import Pipeline
from .sources import SharedSource, WorkerSource
from .stages import Stage, Stream
from .stats import InFlight, StageReport

__all__ = [
    "Channel",
    "Closed",
    "End",
    "Failure",
    "InFlight",
    "Pipeline",
    "SharedSource",
    "Slots",
    "Stage",
    "StageReport",
    "StopSignal",
    "Stopped",
    "Stream",
    "WorkerSource",
]
