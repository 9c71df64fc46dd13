"""examples/ddp_train.py trains under real torchrun jobs (gloo, CPU), and in one process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from subprocesses import REPO, Ran, Run, free_port, run_together

pytestmark = pytest.mark.integration

SCRIPT = str(REPO / "examples" / "ddp_train.py")
TORCHRUN = (sys.executable, "-m", "torch.distributed.run")
OK_SHARDS = (
    "OK: in each of 2 epochs the {world} rank(s) read disjoint shards covering all 256 samples"
)
OK_EPOCHS = "OK: every epoch read a new permutation"


# a launcher's variables from a run under some other launcher must not leak into ours
CLEAN = dict.fromkeys(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def torchrun(*args: str, tmp: Path) -> Run:
    """torchrun with ``args`` and the example; temporary files go to ``tmp``, where torchrun
    makes a ``torchelastic_*`` log directory it never removes."""
    return Run([*TORCHRUN, *args, SCRIPT, "--epochs", "2"], env={**CLEAN, "TMPDIR": str(tmp)})


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Ran]:
    """The three jobs, run at once: most of each is starting interpreters and rendezvous."""
    tmp = tmp_path_factory.mktemp("ddp")
    port = free_port()
    node = (
        "--nnodes=2",
        "--nproc_per_node=2",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{port}",
        f"--rdzv_id=ddp-example-{port}",
        "--max_restarts=0",
    )
    return run_together(
        {
            "torchrun": [torchrun("--nproc_per_node=2", f"--master_port={free_port()}", tmp=tmp)],
            "one process": [Run([sys.executable, SCRIPT, "--epochs", "2"], env=CLEAN)],
            "two nodes": [torchrun(*node, tmp=tmp), torchrun(*node, tmp=tmp)],
        }
    )


def test_ddp_example_with_torchrun(runs):
    out = runs["torchrun"].check()
    for rank in range(2):
        assert f"rank {rank}/2: sampler AutoEpochSampler, 4 batches per epoch" in out, out
        for epoch in range(2):
            line = f"rank {rank}/2: epoch {epoch}: sampler AutoEpochSampler, 4 batches, 128 samples"
            assert line in out, out
    assert OK_SHARDS.format(world=2) in out, out
    assert OK_EPOCHS in out, out


def test_ddp_example_in_one_process(runs):
    out = runs["one process"].check()
    assert "rank 0/1: sampler RandomSampler, 8 batches per epoch" in out, out
    assert "rank 0/1: epoch 1: sampler RandomSampler, 8 batches, 256 samples" in out, out
    assert OK_SHARDS.format(world=1) in out, out
    assert OK_EPOCHS in out, out


def test_ddp_example_two_nodes_on_one_host(runs):
    """``--nnodes=2`` with c10d rendezvous, both "nodes" here: 4 global ranks, one shard each."""
    out = runs["two nodes"].check()
    for rank in range(4):
        assert f"rank {rank}/4: sampler AutoEpochSampler, 2 batches per epoch" in out, out
    assert OK_SHARDS.format(world=4) in out, out
