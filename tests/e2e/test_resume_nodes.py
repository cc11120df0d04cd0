"""The check of a checkpoint before a framework resumes from it (`verify_on_resume` of the
Trainer callback, Accelerate's `load_state`) runs on the first process of each node, for
a node may read the checkpoint from a disk of its own. Two real processes over gloo, the
second on a "node" of its own: its own host name (a UTS namespace) and its own copy of the
checkpoint under the same path (a mount namespace with a bind mount), damaged. Launched
without ``LOCAL_RANK``, as ``srun`` and ``mpirun`` launch: the nodes are told apart by the
processes, and both refuse the checkpoint, naming the second's damage."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import aiopersist
from tests.conftest import IS_ROOT, flip_byte

pytestmark = pytest.mark.root

CODE = """
import sys
import torch.distributed as dist
from aiopersist.integrations._common import checkpoint_problem
dist.init_process_group("gloo")
print("VERDICT", repr(checkpoint_problem(sys.argv[1], "threads", True)), flush=True)
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("damaged", ["second node", "no node"])
def test_each_node_checks_its_own_copy_without_local_rank(tmp_path: Path, damaged: str) -> None:
    if not IS_ROOT or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a second node's namespaces")
    ck = tmp_path / "checkpoint-4"
    aiopersist.save_sync({"w": torch.arange(4096, dtype=torch.float32)}, ck)
    other = tmp_path / "node1-disk"
    shutil.copytree(ck, other)
    if damaged == "second node":
        flip_byte(other / "model.safetensors")
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    python = [sys.executable, "-c", CODE, str(ck)]
    second = [
        "unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c",
        f'hostname aiopersist-node1 && mount --bind "{other}" "{ck}" && exec "$@"', "sh", *python,
    ]  # fmt: skip
    procs = [
        subprocess.Popen(
            cmd, env={**env, "RANK": str(rank)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for rank, cmd in enumerate([python, second])
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(out)
    verdicts = [line for out in outs for line in out.splitlines() if line.startswith("VERDICT")]
    assert len(verdicts) == 2, outs
    assert verdicts[0] == verdicts[1], verdicts  # every process takes the same decision
    if damaged == "second node":
        assert "process 1:" in verdicts[0], verdicts
        assert "model.safetensors" in verdicts[0], verdicts
        assert "process 0:" not in verdicts[0], verdicts
    else:
        assert verdicts[0] == "VERDICT None", verdicts
    assert asyncio.run(aiopersist.verify(ck)) is not None  # this node's copy is untouched
