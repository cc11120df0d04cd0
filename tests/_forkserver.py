"""Runs short-lived Python programs for the end-to-end tests, each in a process of its
own, without paying for importing torch, transformers and accelerate every time: the
server imports them once, then forks one child per request. Used for the documentation's
examples (tests/e2e/test_docs.py) and for the ``aiopersist`` command (``python -m
aiopersist ARGS``, run as ``runpy`` runs it, in the CLI tests).

A child changes into the request's directory, reads nothing (stdin is ``/dev/null``),
writes its stdout and stderr to the request's files, and runs:

- ``{"script": PATH}``: the script twice as ``__main__``, each time in a fresh namespace
  (the second run finds what the first one left);
- ``{"module": NAME, "argv": [...]}``: ``python -m NAME ARGV...``.

Protocol, one JSON object a line: a request on stdin (with ``cwd``, ``stdout`` and
``stderr``); on stdout ``{"pid": PID}`` once the child runs, then ``{"rc": STATUS}``.
`ForkServer` is the tests' side.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _child(req: dict[str, Any]) -> None:
    import runpy

    os.chdir(req["cwd"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    for fd, name in ((1, req["stdout"]), (2, req["stderr"])):
        target = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    rc = 0
    try:
        if "script" in req:
            sys.argv = [req["script"]]
            for _ in range(2):
                runpy.run_path(req["script"], run_name="__main__")
        else:
            sys.argv = [req["module"], *req["argv"]]
            runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            rc = exc.code or 0
        else:  # sys.exit("message"): printed, status 1, as the interpreter does
            print(exc.code, file=sys.stderr)
            rc = 1
    except BaseException:
        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def main() -> None:
    # Imported before any fork, so that every child finds them loaded. Nothing else is
    # done with them here: no thread is started before a fork.
    import accelerate  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import aiopersist
    import aiopersist._cli.main  # noqa: F401

    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)


class ForkServer:
    """The tests' side: starts the server, sends requests, and kills a child that runs
    past its time."""

    _shared: ForkServer | None = None

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests._forkserver"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.spool = Path(tempfile.mkdtemp(prefix="aiopersist-forkserver-"))  # the children's output
        self.count = 0

    @classmethod
    def shared(cls) -> ForkServer:
        """One server for the whole test session, closed at its end."""
        if cls._shared is None:
            cls._shared = cls(offline_env())
            atexit.register(cls._shared.close)
        return cls._shared

    def _reply(self, timeout: float) -> dict[str, int]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError
        line = self.proc.stdout.readline()
        assert line, "the fork server died"
        return dict(json.loads(line))

    def run(self, request: dict[str, Any], workdir: Path, timeout: float = 280) -> tuple[int, str, str]:
        """Run one request in ``workdir``: its exit status, stdout and stderr."""
        assert self.proc.stdin is not None
        self.count += 1
        out, err = self.spool / f"{self.count}.stdout", self.spool / f"{self.count}.stderr"
        full = {**request, "cwd": str(workdir), "stdout": str(out), "stderr": str(err)}
        self.proc.stdin.write(json.dumps(full) + "\n")
        self.proc.stdin.flush()
        pid = self._reply(120)["pid"]
        try:
            rc = self._reply(timeout)["rc"]
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            self._reply(60)
            rc = -signal.SIGKILL
        try:
            return rc, out.read_text(errors="replace"), err.read_text(errors="replace")
        finally:
            out.unlink(missing_ok=True)
            err.unlink(missing_ok=True)

    def close(self) -> None:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        self.proc.stdout.close()
        shutil.rmtree(self.spool, ignore_errors=True)


def offline_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.update(TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    return env


def aiopersist_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m aiopersist ARGS`` in a forked child of the shared server, as a
    `subprocess.CompletedProcess` (the CLI tests' ``_cli``)."""
    workdir = cwd or Path.cwd()
    rc, out, err = ForkServer.shared().run({"module": "aiopersist", "argv": list(args)}, workdir, 300)
    return subprocess.CompletedProcess(["aiopersist", *args], rc, out, err)


if __name__ == "__main__":
    main()
