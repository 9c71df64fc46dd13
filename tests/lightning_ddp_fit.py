"""A 2-process CPU ``strategy="ddp"`` fit with a torch_spdl loader (run by test_lightning.py).

Usage: ``python lightning_ddp_fit.py {hook,prebuilt} {on,off} OUT_DIR``. Lightning's DDP launcher
runs this same command line again for rank 1, so it must be a script. Each rank writes
``OUT_DIR/rank{r}.json`` with the loader Lightning actually iterated (class, options, sampler) and
the dataset indices it saw per epoch.

- ``hook``: the loader is built in ``train_dataloader()``, when the process group is already up.
  With ``distributed=True`` (``on``) it shards itself and Lightning should keep it as it is; with
  ``off`` Lightning re-instantiates it from the arguments it captured in the hook.
- ``prebuilt``: the loader is built before ``trainer.fit``, so before the group exists; Lightning
  then injects its own DistributedSampler by re-instantiating the loader from its attributes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import lightning.pytorch.utilities.data as pl_data
import torch
from torch.utils.data import Dataset, DistributedSampler

import torch_spdl

SIZE = 32
BATCH = 4
EPOCHS = 2

# The non-default options the loader is built with; the test expects each to survive Lightning.
OPTIONS = dict(
    batch_size=BATCH,
    shuffle=True,
    num_workers=2,
    prefetch_factor=3,
    persistent_workers=True,
    in_order=False,
    io_workers=3,
)


class Samples(Dataset):
    """``(index, features)`` pairs; ``read`` is the I/O half, used as ``load_fn``."""

    def __len__(self) -> int:
        return SIZE

    def read(self, index: int) -> tuple[int, list[float]]:
        return index, [float(index), 1.0, -1.0]

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor]:
        return to_tensor(self.read(index))


def to_tensor(raw: tuple[int, list[float]]) -> tuple[int, torch.Tensor]:
    """The CPU half, used as ``preprocess_fn``."""
    index, features = raw
    return index, torch.tensor(features)


def make_loader(dataset: Samples, distributed: bool) -> torch_spdl.DataLoader:
    return torch_spdl.DataLoader(
        dataset, load_fn=dataset.read, preprocess_fn=to_tensor, distributed=distributed, **OPTIONS
    )


class Recorder(pl.LightningModule):
    """Records the loader Lightning iterates, and the indices of every batch, per epoch."""

    def __init__(self, dataset: Samples, distributed: bool) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.dataset = dataset
        self.loader_distributed = distributed
        self.built: list[int] = []  # ids of the loaders this process built itself
        self.epochs: list[list[int]] = []
        self.loaders: list[dict] = []

    def on_train_epoch_start(self) -> None:
        self.epochs.append([])
        self.loaders.append(describe(self.trainer.train_dataloader, self))

    def training_step(self, batch, batch_idx):
        indices, features = batch
        self.epochs[-1].extend(int(i) for i in indices)
        return self.layer(features).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class HookRecorder(Recorder):
    """Builds the loader in the hook, which Lightning calls once the process group is up."""

    def train_dataloader(self) -> torch_spdl.DataLoader:
        loader = make_loader(self.dataset, self.loader_distributed)
        self.built.append(id(loader))
        return loader


def describe(loader, module: Recorder) -> dict:
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    return {
        "class": f"{type(loader).__module__}.{type(loader).__qualname__}",
        "is_torch_spdl": isinstance(loader, torch_spdl.DataLoader),
        "built_by_us": id(loader) in module.built,
        "dataset_is_ours": getattr(loader, "dataset", None) is module.dataset,
        "io_workers": getattr(loader, "io_workers", None),
        "load_fn_kept": getattr(loader, "load_fn", None) == module.dataset.read,
        "preprocess_fn_kept": getattr(loader, "preprocess_fn", None) is to_tensor,
        "distributed": getattr(loader, "distributed", None),
        "in_order": getattr(loader, "in_order", None),
        "prefetch_factor": getattr(loader, "prefetch_factor", None),
        "persistent_workers": getattr(loader, "persistent_workers", None),
        "num_workers": getattr(loader, "num_workers", None),
        "batch_size": getattr(loader, "batch_size", None),
        "sampler_mro": [cls.__name__ for cls in type(sampler).__mro__],
        "sampler_is_distributed": isinstance(sampler, DistributedSampler),
        "sampler_dataset_is_ours": getattr(sampler, "dataset", None) is module.dataset,
        "sampler_shuffle": getattr(sampler, "shuffle", None),
        "sampler_replicas": getattr(sampler, "num_replicas", None),
        "sampler_epoch": getattr(sampler, "epoch", None),
        "batch_sampler_mro": [cls.__name__ for cls in type(batch_sampler).__mro__],
        "batch_sampler_wraps_sampler": getattr(batch_sampler, "sampler", None) is sampler,
    }


def spy_on_reinstantiation(calls: list[dict]) -> None:
    """Record what Lightning re-instantiates a dataloader with (for the report; not needed)."""
    original = pl_data._reinstantiate_wrapped_cls

    def spy(orig_object, *args, **kwargs):
        calls.append(
            {
                "class": type(orig_object).__qualname__,
                "args": len(args),
                "kwargs": sorted(kwargs),
                "sampler": type(kwargs.get("sampler")).__name__,
                "batch_sampler": type(kwargs.get("batch_sampler")).__name__,
            }
        )
        return original(orig_object, *args, **kwargs)

    pl_data._reinstantiate_wrapped_cls = spy


def main(build: str, distributed: str, out: Path) -> None:
    if build not in ("hook", "prebuilt") or distributed not in ("on", "off"):
        raise SystemExit(__doc__)
    calls: list[dict] = []
    spy_on_reinstantiation(calls)
    dataset = Samples()
    model = (HookRecorder if build == "hook" else Recorder)(dataset, distributed == "on")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=EPOCHS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    if build == "hook":
        trainer.fit(model)
    else:
        loader = make_loader(dataset, distributed == "on")
        model.built.append(id(loader))
        trainer.fit(model, train_dataloaders=loader)
    result = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "reinstantiated": calls,
        "loaders": model.loaders,
        "epochs": model.epochs,
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result, indent=1))
    # Lightning's launcher does not wait for the ranks it started: do it here, so the test sees
    # every rank's file, and a failing rank 1 as a failing run.
    launcher = trainer.strategy.launcher
    for proc in getattr(launcher, "procs", []):
        if proc.wait(timeout=120) != 0:
            raise SystemExit(f"rank process {proc.pid} exited with {proc.returncode}")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
