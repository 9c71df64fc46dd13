"""Lightning's ``Trainer(strategy="ddp")`` on 2 CPU processes (gloo) with a torch_spdl loader.

Lightning re-creates a DataLoader subclass from its attributes when it injects a
DistributedSampler (``_update_dataloader``). Whatever path it takes, the loader it iterates must
still be a torch_spdl loader with every option kept, carry exactly one DistributedSampler over the
dataset (never Lightning's ``DistributedSamplerWrapper`` around ours), and show each sample exactly
once per epoch across the ranks, in a new permutation every epoch.

The fit runs as a script (``lightning_ddp_fit.py``) because Lightning's DDP launcher starts rank 1
by running the launching command line again.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

from subprocesses import Ran, Run, free_port, run_together  # noqa: E402
from torch.utils.data import DistributedSampler  # noqa: E402

pytestmark = [pytest.mark.timeout(240), pytest.mark.integration]

SCRIPT = Path(__file__).with_name("lightning_ddp_fit.py")
SIZE, BATCH, EPOCHS, WORLD = 32, 4, 2, 2
OPTIONS = {
    "io_workers": 3,
    "in_order": False,
    "prefetch_factor": 3,
    "persistent_workers": True,
    "num_workers": 2,
    "batch_size": BATCH,
}
# Variables that would make Lightning think it runs under a launcher or cluster already.
FOREIGN_ENV = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE")
FOREIGN_PREFIXES = ("SLURM_", "TORCHELASTIC_", "PL_", "OMPI_COMM_WORLD_", "PMI_", "LSB_", "JSM_")

CASES = [
    ("hook", "on"),  # built in train_dataloader(): Lightning re-creates it with its own sampler
    ("hook", "off"),  # distributed=False: Lightning re-creates it from the captured arguments
    ("prebuilt", "on"),  # built before fit: Lightning re-creates it from its attributes
]


def script_env() -> dict[str, str | None]:
    """What the fit's environment changes: it loses what would make Lightning think it runs
    under a launcher already (None), and gets a port of its own."""
    env: dict[str, str | None] = {
        key: None for key in os.environ if key in FOREIGN_ENV or key.startswith(FOREIGN_PREFIXES)
    }
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), PYTHONUNBUFFERED="1")
    return env


@pytest.fixture(scope="module")
def fits(tmp_path_factory) -> dict[tuple[str, str], list[dict] | str]:
    """Both ranks' records of each case's 2-epoch fit, or why there are none. The fits run at
    once, in one job: most of a fit is starting its processes."""
    outs = {case: tmp_path_factory.mktemp(f"lightning-{'-'.join(case)}") for case in CASES}
    ran = run_together({case: [script_run(case, out)] for case, out in outs.items()})
    return {case: records(outs[case], ran[case]) for case in CASES}


def script_run(case: tuple[str, str], out: Path) -> Run:
    """The fit of ``case``, writing its records to ``out`` (and running there)."""
    return Run([sys.executable, str(SCRIPT), *case, str(out)], script_env(), cwd=out)


def records(out: Path, ran: Ran) -> list[dict] | str:
    output = (ran.output + ran.errors)[-6000:]
    if ran.codes != [0]:
        return f"fit exited with {ran.codes[0]}:\n{output}"
    files = [out / f"rank{rank}.json" for rank in range(WORLD)]
    if not all(f.exists() for f in files):
        return f"missing rank records:\n{output}"
    return [json.loads(f.read_text()) for f in files]


@pytest.fixture(scope="module", params=CASES, ids=["-".join(case) for case in CASES])
def fit(request, fits) -> tuple[tuple[str, str], list[dict]]:
    """Both ranks' records of one case's fit."""
    found = fits[request.param]
    assert not isinstance(found, str), found
    return request.param, found


def test_each_rank_ran_every_epoch(fit):
    _, ranks = fit
    assert [r["rank"] for r in ranks] == list(range(WORLD))
    for record in ranks:
        assert record["world_size"] == WORLD
        assert len(record["epochs"]) == len(record["loaders"]) == EPOCHS


def test_lightning_iterates_a_torch_spdl_loader_with_every_option_kept(fit):
    (_, distributed), ranks = fit
    for record in ranks:
        for loader in record["loaders"]:
            assert loader["class"] == "torch_spdl.dataloader.DataLoader"
            assert loader["is_torch_spdl"]
            assert loader["dataset_is_ours"]
            assert {key: loader[key] for key in OPTIONS} == OPTIONS
            assert loader["load_fn_kept"]
            assert loader["preprocess_fn_kept"]
            assert loader["distributed"] is (distributed == "on")


def test_one_distributed_sampler_over_the_dataset_and_nothing_stacked(fit):
    _, ranks = fit
    for record in ranks:
        for epoch, loader in enumerate(record["loaders"]):
            mro = loader["sampler_mro"]
            assert loader["sampler_is_distributed"], mro
            assert "DistributedSamplerWrapper" not in mro
            assert loader["sampler_dataset_is_ours"], "the sampler wraps something else"
            assert loader["sampler_replicas"] == WORLD
            assert loader["sampler_shuffle"]
            assert loader["batch_sampler_mro"][0] == "BatchSampler"
            assert loader["batch_sampler_wraps_sampler"]
            assert loader["sampler_epoch"] == epoch
            # The loader shows torch's sampler, as torch's loader does, so Lightning builds it
            # anew with its own DistributedSampler, which the loader uses as is: sharded once.
            assert mro[0] == "DistributedSampler"


def test_each_sample_once_per_epoch_across_ranks_in_a_new_order(fit):
    _, ranks = fit
    for epoch in range(EPOCHS):
        shards = [record["epochs"][epoch] for record in ranks]
        for rank, shard in enumerate(shards):
            assert len(shard) == len(set(shard)) == SIZE // WORLD
            # the indices torch's DistributedSampler gives this rank and epoch (seed 0 on both
            # paths: ours without a generator, Lightning's without PL_GLOBAL_SEED)
            reference = DistributedSampler(range(SIZE), WORLD, rank, shuffle=True, seed=0)
            reference.set_epoch(epoch)
            assert sorted(shard) == sorted(reference)
        assert not set(shards[0]) & set(shards[1])
        assert set(shards[0]) | set(shards[1]) == set(range(SIZE))
    assert set(ranks[0]["epochs"][0]) != set(ranks[0]["epochs"][1])
