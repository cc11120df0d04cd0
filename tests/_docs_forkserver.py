"""Runs documentation examples for tests/e2e/test_docs.py, each in a process of its own,
without paying for importing torch, transformers and accelerate every time: this process
imports them once, then forks one child per example. The child changes into the example's
directory, sends its output to files, and runs the script twice as ``__main__``, each
time in a fresh namespace (the second run finds what the first one left).

Protocol, one JSON object a line: a request on stdin
``{"script": PATH, "cwd": DIR, "stdout": FILE, "stderr": FILE}``; on stdout
``{"pid": PID}`` when the child has started, then ``{"rc": EXIT_STATUS}`` when it ended.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback

# Imported here, before any fork, so that every child finds them loaded. Nothing else is
# done with them: no thread is started before a fork.
import accelerate  # noqa: F401
import torch  # noqa: F401
import transformers  # noqa: F401

import aiopersist  # noqa: F401


def _child(script: str, cwd: str, out: str, err: str) -> None:
    os.chdir(cwd)
    for fd, name in ((1, out), (2, err)):
        target = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = [script]
    rc = 0
    try:
        for _ in range(2):
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def main() -> None:
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req["script"], req["cwd"], req["stdout"], req["stderr"])
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
