"""Starts the Python processes of the multi-process tests (``python -m MODULE ARGS`` and
``python -c CODE ARGS``) without paying for ``import torch`` in each: a server imports
torch once, then forks a child per request, and each child becomes the process that
command would have started: its own pid, environment, directory and arguments, stdout and
stderr on pipes to the test (passed over a Unix socket), stdin on ``/dev/null``, and the
interpreter's normal exit (``atexit`` handlers, non-daemon threads joined, an uncaught
exception printed with status 1).

What a fresh process decides before its code runs and a fork cannot change is kept equal:
the server is made for one environment, and a request whose environment differs from it
in a variable read at start-up or while torch loads (`IMPORT_TIME`) gets a plain
subprocess instead, as does a command of another shape. The server starts no thread
(torch's and OpenMP's pools start at first use; numpy's OpenBLAS pool, started on import,
is remade after a fork by OpenBLAS). A child dies with the server (``PR_SET_PDEATHSIG``).

`popen` and `run` are the tests' side: drop-in for ``subprocess.Popen`` (the part of it
the tests use) and ``subprocess.run`` with captured output.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import types
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]

IMPORT_TIME = (
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "KMP_AFFINITY", "GOMP_SPINCOUNT",
    "OMP_WAIT_POLICY", "LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONHOME", "PYTHONHASHSEED",
    "PYTHONWARNINGS", "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED", "PYTHONFAULTHANDLER",
    "PYTHONMALLOC", "PYTHONDEVMODE", "PYTHONSAFEPATH", "PYTHONNOUSERSITE", "TORCH_CPP_LOG_LEVEL",
    "TORCH_SHOW_CPP_STACKTRACES", "TORCH_DISTRIBUTED_DEBUG", "TORCH_LOGS", "CUDA_VISIBLE_DEVICES",
)  # fmt: skip
"""Variables read before a command's code runs (by the interpreter, the dynamic loader, and
torch and its thread pools on import): a child forked from the server would keep the
server's values, so a request that sets them otherwise gets a fresh process. (``PYTHONPATH``
is not one: a child's module search path is made from its own, see `_search_path`.)"""

_PR_SET_PDEATHSIG = 1
_MAX_MESSAGE = 1 << 20


def _pythonpath(env: dict[str, str] | os._Environ[str]) -> list[str]:
    """The entries ``PYTHONPATH`` puts on ``sys.path``, as ``site`` leaves them (absolute)."""
    return [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


def _search_path(first: str, env: dict[str, str], server: list[str]) -> list[str]:
    """``sys.path`` of a fresh process started with ``env``: ``first`` (the directory
    ``-m`` or ``-c`` puts there), its ``PYTHONPATH``, then the interpreter's own entries
    (the server's after its ``PYTHONPATH``), without repeats."""
    rest = sys.path[1 + len(server) :] if sys.path[1 : 1 + len(server)] == server else sys.path[1:]
    seen: set[str] = set()
    out = []
    for p in [first, *_pythonpath(env), *rest]:
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


def _child(
    req: dict[str, Any], fds: list[int], server_pid: int, sock: socket.socket, server_path: list[str]
) -> None:
    """In the forked child: become the process the command would have started, then run
    it. Never returns to the server's loop: the code's end (or its uncaught exception, or
    ``sys.exit``) ends the interpreter as it would a fresh one."""
    import runpy

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != server_pid:  # the server died between the fork and prctl
        os._exit(1)
    sock.close()
    if req.get("new_session"):
        os.setsid()
    os.environ.clear()
    os.environ.update(req["env"])
    tempfile.tempdir = None  # as a fresh process: its own TMPDIR, not the server's choice
    os.chdir(req["cwd"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's stdin from now on
    for fd, target in zip((1, 2), fds, strict=True):
        os.dup2(target, fd)
        os.close(target)
    if "module" in req:
        sys.path[:] = _search_path(os.getcwd(), req["env"], server_path)  # as ``python -m``
        sys.argv = [req["module"], *req["argv"]]  # runpy puts the module's file first
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
    else:
        sys.path[:] = _search_path("", req["env"], server_path)  # as ``python -c``
        sys.argv = ["-c", *req["argv"]]
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(req["code"], "<string>", "exec"), main.__dict__)
    sys.exit(0)


def serve(fd: int) -> None:
    # Loaded once here, so that no child pays for them; nothing is run with them.
    import torch
    import torch.distributed
    import torch.distributed.checkpoint  # noqa: F401

    me = os.getpid()
    server_path = _pythonpath(os.environ)
    sock = socket.socket(fileno=fd)
    children: set[int] = set()
    open_ = True
    while open_ or children:
        ready, _, _ = select.select([sock] if open_ else [], [], [], 0.02)
        if ready:
            data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 2)
            if not data:
                open_ = False  # the tests are done: their children go too
                for pid in children:
                    os.kill(pid, signal.SIGKILL)
            else:
                pid = os.fork()
                if pid == 0:
                    _child(json.loads(data), fds, me, sock, server_path)
                for f in fds:
                    os.close(f)
                children.add(pid)
                sock.send(json.dumps({"pid": pid}).encode())
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            if open_:
                sock.send(json.dumps({"exited": pid, "rc": os.waitstatus_to_exitcode(status)}).encode())


class Launched:
    """A child of the server with `subprocess.Popen`'s interface, as far as the tests use
    it: ``pid``, ``args``, ``stdout``, ``stderr``, ``returncode``, ``poll``, ``wait``,
    ``communicate``, ``send_signal``, ``kill``, ``terminate``."""

    def __init__(self, launcher: Launcher, args: list[str], pid: int, stdout: IO[Any], stderr: IO[Any]):
        self.launcher = launcher
        self.args = args
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            with self.launcher.changed:
                self.returncode = self.launcher.exits.pop(self.pid, None)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        launcher = self.launcher
        with launcher.changed:
            if not launcher.changed.wait_for(
                lambda: self.returncode is not None or self.pid in launcher.exits or launcher.dead, timeout
            ):
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        rc = self.poll()
        if rc is None:
            raise RuntimeError("the launch server died")
        return rc

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        """Both outputs to their ends, then the exit status (as ``Popen.communicate``)."""
        got: dict[str, Any] = {}
        readers = [
            threading.Thread(target=lambda n=n, f=f: got.__setitem__(n, f.read()), daemon=True)
            for n, f in (("out", self.stdout), ("err", self.stderr))
        ]
        for r in readers:
            r.start()
        for r in readers:
            r.join(timeout)
            if r.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        self.wait(timeout)
        self.stdout.close()
        self.stderr.close()
        return got["out"], got["err"]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Launcher:
    """The tests' side of one server, for the environment it was made with."""

    _shared: Launcher | None = None

    def __init__(self, env: dict[str, str]) -> None:
        self.env = dict(env)
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests._launch", str(theirs.fileno())],
            cwd=ROOT,
            env=self.env,
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.exits: dict[int, int] = {}
        self.pids: list[int] = []
        self.dead = False
        self.changed = threading.Condition()
        self.sending = threading.Lock()
        threading.Thread(target=self._read, name="launch-server-reader", daemon=True).start()

    @classmethod
    def shared(cls) -> Launcher:
        """One server per test process, for the environment the tests started with."""
        if cls._shared is None:
            cls._shared = cls(dict(os.environ))
            atexit.register(cls._shared.close)
        return cls._shared

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(_MAX_MESSAGE)
            except OSError:
                data = b""
            with self.changed:
                if not data:
                    self.dead = True
                    self.changed.notify_all()
                    return
                msg = json.loads(data)
                if "pid" in msg:
                    self.pids.append(msg["pid"])
                else:
                    self.exits[msg["exited"]] = msg["rc"]
                self.changed.notify_all()

    def takes(self, env: dict[str, str]) -> bool:
        return not self.dead and all(env.get(k) == self.env.get(k) for k in IMPORT_TIME)

    def start(self, req: dict[str, Any], args: list[str], text: bool) -> Launched:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            with self.sending, self.changed:
                before = len(self.pids)
                socket.send_fds(self.sock, [json.dumps(req).encode()], [out_w, err_w])
                if not self.changed.wait_for(lambda: len(self.pids) > before or self.dead, 120):
                    raise TimeoutError("the launch server did not fork in 120 s")
                if len(self.pids) <= before:
                    raise RuntimeError("the launch server died")
                pid = self.pids[before]
        except BaseException:
            os.close(out_r)
            os.close(err_r)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        mode = "r" if text else "rb"
        kwargs: dict[str, Any] = {"errors": "replace"} if text else {}
        return Launched(self, args, pid, open(out_r, mode, **kwargs), open(err_r, mode, **kwargs))

    def close(self) -> None:
        self.sock.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def popen(
    args: list[str],
    *,
    cwd: Path | str | None = None,
    env: dict[str, str] | None = None,
    text: bool = False,
    start_new_session: bool = False,
    fresh: bool = False,
) -> Launched | subprocess.Popen[Any]:
    """``subprocess.Popen(args, stdout=PIPE, stderr=PIPE, ...)``, forked from the shared
    server when ``args`` is ``[sys.executable, "-m", MODULE, ...]`` or ``[sys.executable,
    "-c", CODE, ...]`` and the environment allows (see the module's doc); ``fresh`` asks
    for a new interpreter whatever the command."""
    env = dict(os.environ if env is None else env)
    workdir = str(cwd if cwd is not None else os.getcwd())
    req: dict[str, Any] | None = None
    if len(args) >= 3 and args[0] == sys.executable and args[1] in ("-m", "-c"):
        key = "module" if args[1] == "-m" else "code"
        req = {key: args[2], "argv": list(args[3:]), "env": env, "cwd": workdir}
        req["new_session"] = start_new_session
    launcher = Launcher.shared()
    if req is None or fresh or not launcher.takes(env):
        return subprocess.Popen(
            args,
            cwd=workdir,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=text,
            start_new_session=start_new_session,
        )
    return launcher.start(req, list(args), text)


def run(
    args: list[str],
    *,
    cwd: Path | str | None = None,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    text: bool = False,
    check: bool = False,
) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run(args, capture_output=True, ...)`` through `popen`: on a timeout the
    process is killed and ``TimeoutExpired`` raised, as ``subprocess.run`` does."""
    proc = popen(args, cwd=cwd, env=env, text=text)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    rc = proc.returncode
    assert rc is not None
    done = subprocess.CompletedProcess(args, rc, out, err)
    if check:
        done.check_returncode()
    return done


if __name__ == "__main__":
    serve(int(sys.argv[1]))
