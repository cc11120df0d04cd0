"""A process forked while aiopersist is in use (a data loader's workers, a launcher):
the child starts afresh, with none of the parent's threads or pending work to wait for.
(The DCP writer's case is in test_dcp_untrusted.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_forking_script

ROOT = str(Path(__file__).resolve().parents[2])

_AFTER_A_BLOCKING_SAVE = """
import os, sys
sys.path.insert(0, {root!r})
import torch, aiopersist
from aiopersist import _blocking
ck = aiopersist.BlockingCheckpointer(backend={b!r})  # open: its event loop runs in a thread
ck.save({{"w": torch.ones(8)}}, {path!r}).wait()
pid = os.fork()
if pid == 0:
    info = aiopersist.save_sync({{"w": torch.ones(8)}}, {path!r} + "-child", backend={b!r})
    print("child facades to close at exit", len(_blocking._open_facades), flush=True)
    sys.exit(0)  # the parent's checkpointer is not the child's to close
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status), flush=True)
ck.close()
"""

_INSIDE_A_GC_PAUSE = """
import gc, os, sys
sys.path.insert(0, {root!r})
from aiopersist import _workers
gc.enable()
with _workers.gc_paused():  # another thread's burst of work, at the moment of the fork
    pid = os.fork()
    if pid == 0:
        print("child gc", gc.isenabled(), _workers._gc_holders, flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
print("parent gc", gc.isenabled(), flush=True)
"""


@pytest.mark.timeout(120)
def test_a_child_of_a_process_with_an_open_checkpointer_saves_and_exits_at_once(
    backend_name: str, tmp_path: Path
) -> None:
    """The parent's ``BlockingCheckpointer`` is open (its loop in a thread the child does
    not have): the child saves on its own, and has none of the parent's checkpointers to
    close at exit. (Closing one would wait out the exit grace, here longer than the
    script may run: a regression fails the run.)"""
    script = _AFTER_A_BLOCKING_SAVE.format(root=ROOT, b=backend_name, path=str(tmp_path / "ck"))
    out = run_forking_script(script, {"AIOPERSIST_EXIT_GRACE": "600"})
    assert "child facades to close at exit 0" in out
    assert "child exit 0" in out
    assert (tmp_path / "ck-child" / "aiopersist.json").is_file()


def test_a_child_forked_inside_a_gc_pause_has_its_collector_back() -> None:
    out = run_forking_script(_INSIDE_A_GC_PAUSE.format(root=ROOT))
    assert "child gc True 0" in out
    assert "parent gc True" in out


def test_a_forked_child_does_not_reuse_its_parent_s_buffers() -> None:
    """A child's copies of the parent's idle buffers are dropped at the fork (with CUDA
    they would claim a registration the child does not have): its pools map their own."""
    script = (
        "import os, sys, asyncio\n"
        "import aiopersist\n"
        "from aiopersist import _staging\n"
        "async def fill():\n"
        "    pool = aiopersist.StagingPool(1 << 16, 2)\n"
        "    pool.release(await pool.acquire())\n"
        "    pool.close()\n"
        "asyncio.run(fill())\n"
        "assert len(_staging._spare) == 1\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os._exit(0 if _staging._spare == [] else 3)\n"
        "print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), len(_staging._spare))\n"
    )
    assert run_forking_script(script).split() == ["0", "1"]
