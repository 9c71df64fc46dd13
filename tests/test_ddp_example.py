"""examples/ddp_train.py trains under real torchrun jobs (gloo, CPU), and in one process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from subprocesses import REPO, free_port, job_env

SCRIPT = str(REPO / "examples" / "ddp_train.py")
TORCHRUN = (sys.executable, "-m", "torch.distributed.run")
OK_SHARDS = (
    "OK: in each of 2 epochs the {world} rank(s) read disjoint shards covering all 256 samples"
)
OK_EPOCHS = "OK: every epoch read a new permutation"


def run_all(*commands: list[str], tmp: Path, timeout: float = 180) -> str:
    """Run ``commands`` side by side from the repo root; their joined output, failing on rc != 0.

    The checkout goes first on PYTHONPATH. One job (:func:`~subprocesses.job_env`): however the
    test ends, torchrun's rank processes end too. Temporary files go to ``tmp``: torchrun makes a
    ``torchelastic_*`` log directory there and never removes it.
    """
    outputs = []
    with job_env() as env:
        env["TMPDIR"] = str(tmp)
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)  # a test run under some other launcher must not leak into ours
        procs = [
            subprocess.Popen(
                command,
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for command in commands
        ]
        try:
            for proc in procs:
                outputs.append(proc.communicate(timeout=timeout)[0])
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
                proc.stdout.close()
    out = "\n".join(outputs)
    assert [proc.returncode for proc in procs] == [0] * len(procs), out
    return out


def test_ddp_example_with_torchrun(tmp_path):
    port = f"--master_port={free_port()}"
    out = run_all([*TORCHRUN, "--nproc_per_node=2", port, SCRIPT, "--epochs", "2"], tmp=tmp_path)
    for rank in range(2):
        assert f"rank {rank}/2: sampler AutoEpochSampler, 4 batches per epoch" in out, out
        for epoch in range(2):
            line = f"rank {rank}/2: epoch {epoch}: sampler AutoEpochSampler, 4 batches, 128 samples"
            assert line in out, out
    assert OK_SHARDS.format(world=2) in out, out
    assert OK_EPOCHS in out, out


def test_ddp_example_in_one_process(tmp_path):
    out = run_all([sys.executable, SCRIPT, "--epochs", "2"], tmp=tmp_path)
    assert "rank 0/1: sampler RandomSampler, 8 batches per epoch" in out, out
    assert "rank 0/1: epoch 1: sampler RandomSampler, 8 batches, 256 samples" in out, out
    assert OK_SHARDS.format(world=1) in out, out
    assert OK_EPOCHS in out, out


def test_ddp_example_two_nodes_on_one_host(tmp_path):
    """``--nnodes=2`` with c10d rendezvous, both "nodes" here: 4 global ranks, one shard each."""
    port = free_port()
    node = [
        *TORCHRUN,
        "--nnodes=2",
        "--nproc_per_node=2",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{port}",
        f"--rdzv_id=ddp-example-{port}",
        "--max_restarts=0",
        SCRIPT,
        "--epochs",
        "2",
    ]
    out = run_all(node, node, tmp=tmp_path)
    for rank in range(4):
        assert f"rank {rank}/4: sampler AutoEpochSampler, 2 batches per epoch" in out, out
    assert OK_SHARDS.format(world=4) in out, out
