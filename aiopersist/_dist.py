"""Coordination of a save between ranks, through ``torch.distributed``.

Only metadata travels between ranks, gathered over a gloo mesh of the checkpoint's own
(`_Mesh`): the tensors never leave their rank. The gathers run in worker threads, so the
event loop goes on writing meanwhile, and they have a timeout (`AIOPERSIST_DIST_TIMEOUT`,
seconds), so a rank that died cannot hang the others forever.

The mesh is a gloo process group made over the job's store under a generation number,
outside torch's registry of groups: making it is no collective of the training's, and a
mesh that breaks (gloo closes it on a timeout: a rank was late) is replaced, at the next
exchange of every rank, by the next generation's. A group made with ``new_group`` would
stay broken, and every later save with it.

Every phase of a distributed save ends with one exchange in which each rank says whether
it got through. If any rank failed, every rank raises: the failed rank its own error, the
others [`RankFailedError`][aiopersist.RankFailedError] naming the rank and its error. So a
save either commits on every rank or on none.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import datetime
import itertools
import logging
import os
import pickle
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from . import _knobs
from ._backends._base import to_thread_to_the_end
from ._exceptions import RankFailedError
from ._workers import ProcessExitingError, close_exit_gate, exit_gate, kept

log = logging.getLogger("aiopersist")

# The checkpoint's own meshes, by the group they serve (None: the default group), each as
# (the default group and the served group, held weakly; the mesh). A mesh is shut down
# when its world is destroyed (destroy_process_group(): torch's registry lets go of the
# groups, and the finalizer runs) or at exit: one left running keeps its gloo threads
# into interpreter shutdown, where a thread dropping the last reference to a finished
# collective's tensors needs the GIL, cannot have it, and aborts the process ("terminate
# called without an active exception"). After a new init_process_group(), the weak
# references are dead, so a mesh of the old world is never used, nor one cached under a
# recycled id().
_groups: dict[object, tuple[Callable[[], Any], Callable[[], Any], _Mesh]] = {}


def _weak(obj: Any) -> Callable[[], Any]:
    """A weak reference to ``obj``; a strong one to what takes none (``None``, and the
    ``int`` torch gives ranks outside a group)."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


class GroupRef:
    """Holds a process group without keeping it alive past ``destroy_process_group()``
    (see `_groups`); `get` returns it, or raises once it has been destroyed."""

    def __init__(self, group: Any) -> None:
        self._ref = _weak(group)

    def get(self) -> Any:
        group = self._ref()
        if group is None:
            raise RuntimeError(
                "the process group this checkpoint was set up with has been destroyed "
                "(torch.distributed.destroy_process_group): no rank can save through it any more"
            )
        return group


@dataclass(frozen=True)
class _Outcome:
    rank: int
    value: Any = None
    error: str | None = None
    """``"TypeName: message"`` of the exception this rank raised, or ``None``."""
    tag: str = ""
    """Which exchange this is (its number and what it is): every rank must be at the same."""
    number: int = 0
    """The exchange's number (in ``tag`` too)."""
    given_up: tuple[str, ...] = ()
    """The tags of the exchanges this rank gave up on, when it gathered this."""
    attempt: int = 0
    """How many times this rank gathered this exchange before (see `_gathers_again`)."""


def _gathers_again(outcome: _Outcome, tags: set[str]) -> bool:
    """Whether the rank of ``outcome``, having gathered ``tags``, gathers its exchange
    again: the ranks at other exchanges are all at ones it gave up on (they come to its
    exchange next), and it has not done so `_MAX_CATCH_UP` times yet. Every rank computes
    this for every rank from the same gathered outcomes."""
    behind = tags - {outcome.tag}
    return bool(behind) and behind <= set(outcome.given_up) and outcome.attempt + 1 < _MAX_CATCH_UP


FAILURES = (Exception, asyncio.CancelledError)
"""What a rank tells the other ranks of a save or restore at its next exchange (see
`Coordinator.exchange`): an error, or the caller cancelling it on this rank alone."""


class _Cancelled(Exception):
    """Stands for this rank's ``CancelledError`` in the exchange that tells the others."""


def _told(error: BaseException) -> str:
    """What the other ranks are told of ``error``."""
    if isinstance(error, _Cancelled):
        return "it was cancelled there (asyncio.CancelledError)"
    return f"{type(error).__name__}: {error}"


_MAX_CATCH_UP = 8
"""How many times an exchange is gathered again for ranks still at exchanges this rank
gave up on (see `Coordinator.exchange`)."""


class StoreTimeoutError(RuntimeError):
    """The job's store (``torch.distributed``'s key-value store) did not answer within
    ``AIOPERSIST_DIST_TIMEOUT`` seconds."""


_AFTER_FAILURE_SECONDS = 5.0
"""How long a failed gather waits, at most, for the store's further answers (moving the
mesh to its next generation, where the ranks are): the store may be what failed, and is
not waited for a whole timeout again. Also what connecting a mesh gets past gloo's own
timeout, so that gloo's error (a rank did not come) is the one reported."""


class _StoreCall:
    """``fn(*args)`` (a call into the job's store), started at once in a daemon thread of
    its own; `result` waits for it with a bound.

    The store's own calls wait without a bound for an answer (``add``, ``compare_set``,
    ``set``: their timeout is for keys that do not exist yet): a stopped process that
    holds the store (rank 0 under ``init_method="tcp://..."`` or ``env://`` without
    torchrun; SIGSTOP, a debugger, a machine swapping) would hang every other rank's save
    for good. A call given up on goes on in its thread: it ends when the store answers
    (``discard`` then gets its result, unless `result` is asked again and takes it first), or
    with the process. Later calls into the same store client wait behind it."""

    def __init__(
        self, fn: Callable[..., Any], *args: Any, discard: Callable[[Any], None] | None = None
    ) -> None:
        self._done = threading.Event()
        self._box: list[Any] = []
        self._lock = threading.Lock()
        self._given_up = False
        self._discard = discard
        threading.Thread(target=self._call, args=(fn, *args), name="aiopersist-store", daemon=True).start()

    def _call(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            with exit_gate.inside():
                self._run(fn, *args)
        except ProcessExitingError as exc:
            with self._lock:
                self._box.append(exc)
            self._done.set()

    def _run(self, fn: Callable[..., Any], *args: Any) -> None:
        # In a region of calls into torch: what it lets go of (a process group given up
        # on) is let go of here.
        try:
            result = fn(*args)
        except BaseException as exc:
            result = exc
        with self._lock:
            self._box.append(result)
            late = self._given_up and not isinstance(result, BaseException)
            if late and self._discard is not None:
                self._box.clear()  # discarded: not for a later `result`
        self._done.set()
        if late and self._discard is not None:
            with contextlib.suppress(Exception):
                self._discard(result)

    def result(self, what: str, seconds: float | None = None) -> Any:
        """The call's result (its exception raised), waited for at most ``seconds``
        (``AIOPERSIST_DIST_TIMEOUT`` by default); `StoreTimeoutError` saying ``what`` did
        not end after that."""
        limit = _knobs.dist_timeout() if seconds is None else seconds
        self._done.wait(limit)
        with self._lock:
            if not self._box:
                self._given_up = True
                raise StoreTimeoutError(
                    f"{what}: the job's store (torch.distributed's) did not answer within {limit:.0f} s: the "
                    "process that holds it (rank 0, or the launcher's agent) is stopped, hung or unreachable"
                )
            self._given_up = False
            (result,) = self._box
            if self._discard is not None:  # a process group: held by the caller alone
                self._box.clear()
        if isinstance(result, BaseException):
            raise result
        return result


def _bounded(
    fn: Callable[..., Any],
    *args: Any,
    what: str,
    seconds: float | None = None,
    discard: Callable[[Any], None] | None = None,
) -> Any:
    """``fn(*args)``, a call into the job's store, waited for at most ``seconds``
    (``AIOPERSIST_DIST_TIMEOUT`` by default): see `_StoreCall`."""
    return _StoreCall(fn, *args, discard=discard).result(what, seconds)


def _wait(works: list[Any]) -> None:
    """``works[-1].wait()`` (a gloo collective's, which ends by gloo's timeout at the
    latest), by polling in short sleeps rather than blocking in ``wait()``; the work is
    not bound to a name here, so that no frame of an error keeps it (see `aiopersist._workers.exit_gate`).

    A thread blocked in ``wait()`` holds torch's C++ frames with the GIL released: if the
    collective ends while the interpreter is shutting down (an exit that gave up on a save
    in flight: see `aiopersist._blocking`), the thread cannot have the GIL back, is ended
    through those frames, and the process aborts ("terminate called without an active
    exception"). A thread in ``time.sleep`` is ended cleanly there."""
    delay = 1e-4
    while not works[-1].is_completed():
        exit_gate.sleep(delay)
        delay = min(2 * delay, _POLL_SECONDS)
    works[-1].wait()  # at once: raises the collective's error, if any


_POLL_SECONDS = 0.005
"""The longest sleep between two looks at a collective in flight (`_wait`)."""


def _shut_down(pg: Any) -> None:
    """A gloo group made after its gather gave up on it: shut down (its threads end)."""
    pg.shutdown()


class _Mesh:
    """The checkpoint's gloo mesh over the ranks of one group: ``rank`` of ``size``.

    The mesh of generation *g* is a ``ProcessGroupGloo`` made over the job's store under
    ``aiopersist/<group>/<m>/<g>/``, where *m* numbers the meshes each rank has made for
    that group (a group made again, or a world started again over the same store, never
    meets an old mesh's keys) and the current generation is a counter in the store. A
    gather that fails (a timeout, a lost peer) moves the counter on, once however many
    ranks see the failure (compare-and-set), and every rank makes the next generation's
    mesh at its next gather: the ranks meet again there, where the broken mesh would fail
    every gather for good. Gathers of one mesh run one at a time."""

    def __init__(self, store: Any, rank: int, size: int, name: str) -> None:
        self._job_store = store
        self._name = name
        self.store: Any = None
        """The mesh's own keys in the job's store: made by the first gather (`_keys`)."""
        self._made: _StoreCall | None = None
        self.rank = rank
        self.size = size
        self._pg: Any = None
        self._generation = -1
        self._lock = threading.Lock()
        self._close_after = False
        self._numbers = itertools.count(1)
        self.given_up: list[str] = []
        """The tags of the exchanges this rank gave up on (a failure, a rank at another
        exchange), newest last."""

    def number(self) -> int:
        """The next exchange's number: every rank numbers the exchanges over the mesh (the
        saves', the restores', the integrations' gathers) in the order it makes them, so
        that ranks at different ones tell so, whatever their names."""
        return next(self._numbers)

    def number_next(self, number: int) -> None:
        """Number the next exchange ``number`` (see `Coordinator._step_again`)."""
        self._numbers = itertools.count(number)

    def gather(self, obj: Any, at: str = "") -> list[Any]:
        """Every rank's ``obj`` (pickled), by rank. Raises ``RuntimeError`` when the mesh
        cannot be made or the gather fails; the next gather uses a new mesh. ``at`` says
        which exchange this is, for `absent` on the other ranks."""
        with self._lock:
            from torch.distributed import distributed_c10d as c10d

            try:
                store = self._keys()
                generation = int(_bounded(self._arrive, store, at, what="reading the mesh's generation"))
                try:
                    if self._pg is None or generation != self._generation:
                        self._close()
                        seconds = _knobs.dist_timeout()
                        prefixed = c10d.PrefixStore(f"{generation}/", store)
                        self._pg = _bounded(
                            c10d.ProcessGroupGloo,
                            prefixed,
                            self.rank,
                            self.size,
                            datetime.timedelta(seconds=seconds),
                            what="connecting the ranks' gloo mesh",
                            # gloo's own error first, where a rank did not come (at `seconds`)
                            seconds=seconds + _AFTER_FAILURE_SECONDS,
                            discard=_shut_down,
                        )
                        self._generation = generation
                    return self._gather(obj)
                except RuntimeError as exc:
                    self._close()
                    if not isinstance(exc, StoreTimeoutError):  # else it would wait again
                        # The store itself gone (rank 0 died), or not answering: the next
                        # gather fails on it too.
                        with contextlib.suppress(RuntimeError):
                            _bounded(
                                store.compare_set,
                                "generation",
                                str(generation),
                                str(generation + 1),
                                what="moving the mesh to its next generation",
                                seconds=min(_knobs.dist_timeout(), _AFTER_FAILURE_SECONDS),
                            )
                    raise
            finally:
                if self._close_after:
                    self._close()

    def _arrive(self, store: Any, at: str) -> int:
        """Say in the store that this rank is at exchange ``at``; the mesh's generation."""
        store.set(f"at/{self.rank}", at)
        return int(store.add("generation", 0))

    def absent(self, at: str) -> str:
        """Which ranks are not at exchange ``at`` (by what each said last in the store), in
        words, for the message of a gather that failed there: ``""`` when every rank came
        to it (one was lost during it)."""
        store = self.store
        if store is None:
            return ""

        def said() -> list[str | None]:
            # A get of a key not set yet would wait for it: checked first.
            keys = [f"at/{r}" for r in range(self.size)]
            return [store.get(k).decode(errors="replace") if store.check([k]) else None for k in keys]

        try:
            where = _bounded(said, what="asking where the ranks are", seconds=_AFTER_FAILURE_SECONDS)
        except RuntimeError:
            # Gone with the process that held it, most often: rank 0, unless torchrun's agent holds it.
            return (
                "; the job's store does not answer either (is the process that holds it, often rank 0, gone?)"
            )
        away = [(r, last) for r, last in enumerate(where) if r != self.rank and last != at]
        return "".join(
            f"; rank {r} did not come to it (its last exchange: {last})"
            if last is not None
            else f"; rank {r} has made no exchange here yet"
            for r, last in away
        )

    def _keys(self) -> Any:
        """`store`, made at the first gather: a store that does not answer fails that
        gather (`_bounded`) rather than the caller's thread (an event loop) for good."""
        if self.store is None:
            from torch.distributed import distributed_c10d as c10d

            if self._made is None:
                # Made once: one given up on still counts when the store answers, and is
                # waited for again at the next gather rather than counted twice.
                self._made = _StoreCall(self._job_store.add, f"aiopersist/{self._name}/made/{self.rank}", 1)
            made = int(self._made.result("numbering this rank's meshes"))
            self.store = c10d.PrefixStore(f"aiopersist/{self._name}/{made}/", self._job_store)
        return self.store

    def _gather(self, obj: Any) -> list[Any]:
        data = pickle.dumps(obj)
        works: list[Any] = []
        with exit_gate.inside():
            try:
                size = torch.tensor([len(data)], dtype=torch.int64)
                sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
                works.append(self._pg.allgather([sizes], [size]))
                _wait(works)
                longest = max(int(n) for n in sizes)
                mine = torch.zeros(longest, dtype=torch.uint8)
                mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                theirs = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)]
                works.append(self._pg.allgather([theirs], [mine]))
                _wait(works)
                # From the job's own ranks, as all_gather_object's.
                pairs = zip(theirs, sizes, strict=True)
                return [pickle.loads(t[: int(n)].numpy().tobytes()) for t, n in pairs]
            finally:
                exit_gate.drop(works)  # in the region, unless the exit refused this thread meanwhile

    def _close(self) -> None:
        refs = [self._pg] if self._pg is not None else []
        self._pg = None
        if not refs:
            return
        try:
            with exit_gate.inside():
                with contextlib.suppress(Exception):  # a broken mesh may refuse to shut down
                    refs[0].shutdown()
                refs.clear()  # the last reference, most often: torch waits for its threads
        except ProcessExitingError:
            kept.extend(refs)  # refused: see `_ExitGate.drop`

    def close(self) -> None:
        """Shut the mesh down (its gloo threads end); a later gather makes a new one. Never
        waits for a gather in flight (a finalizer may call this from any thread, that one
        included): the gather shuts it down as it ends."""
        if self._lock.acquire(blocking=False):
            try:
                self._close()
            finally:
                self._lock.release()
        else:
            self._close_after = True


class Coordinator:
    """The ranks of one save: ``rank`` of ``world_size``, exchanging metadata over the
    checkpoint's gloo mesh of their group.

    Every exchange over the mesh (a save's, a restore's, an integration's gather) is
    numbered (`_Mesh.number`) and tagged: ranks at different exchanges all raise
    `RankFailedError` rather than take each other's values. A rank still at an exchange
    that this rank gave up on (it timed out waiting for it) is gathered again, until it
    gives that one up in turn and comes to this one."""

    def __init__(self, rank: int, world_size: int, local_rank: int, mesh: _Mesh) -> None:
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.mesh = mesh

    def all_gather(self, obj: Any, what: str = "a gather") -> list[Any]:
        """Every rank's ``obj``, by rank (blocking: from a worker thread, or code that is
        not on an event loop). Raises `RankFailedError` when a rank does not come, or is
        at another exchange."""
        return self.settle(obj, None, what, what)

    def barrier(self) -> None:
        """Wait for every rank (blocking, as `all_gather`)."""
        self.settle(None, None, "a barrier", "a barrier")

    def check_all(self, error: BaseException | None, what: str) -> None:
        """Blocking, as `all_gather`: every rank tells whether its part of ``what`` went
        through (``error``: it did not). Raises ``error`` on its rank, and
        `RankFailedError` naming the first rank that failed on the others: a rank that
        fails alone does not leave the others waiting at the next collective."""
        self.settle(None, error, what, what)

    async def exchange(
        self, value: Any, error: BaseException | None = None, label: Any = None, what: str = "the save"
    ) -> list[Any]:
        """`settle` in a worker thread: the event loop goes on writing meanwhile. A save
        makes its exchanges one after another; concurrent saves over the same ranks are
        not supported (a Checkpointer with several ranks runs one at a time). Awaited to
        its end even if the caller is cancelled: a gather left running on the mesh would
        meet the next save's. An ``error`` that is ``CancelledError`` (the caller cancelled
        this rank's save between its exchanges) is told to the others as a failure, then
        raised."""
        number = self.mesh.number()  # here, in the order of the calls
        if isinstance(error, asyncio.CancelledError):
            # A cancellation on this rank is a failure of the save (or restore) for the
            # others: told here, it makes them raise at once where they would wait for this
            # rank until the timeout; then the cancellation goes on.
            told = _Cancelled()
            try:
                await to_thread_to_the_end(self.settle, None, told, label, what, number)
            except Exception as exc:
                if exc is not told:
                    error.add_note(f"aiopersist: telling the other ranks of this cancellation failed: {exc}")
            raise error
        return await to_thread_to_the_end(self.settle, value, error, label, what, number)

    def settle(
        self, value: Any, error: BaseException | None, label: Any, what: str, number: int | None = None
    ) -> list[Any]:
        """Every rank's ``value``, by rank. If any rank reports an error (``error`` here),
        every rank raises: this rank its own ``error``, the others `RankFailedError` naming
        it (``what`` failed on rank ...). ``label`` says what this exchange is (a save's
        name and its place in it)."""
        number = self.mesh.number() if number is None else number
        tag = repr((number, label))
        text = None if error is None else _told(error)
        outcome = _Outcome(self.rank, None if error is not None else value, text, tag, number)
        try:
            gathered = self._gather_in_step(outcome)
        except BaseException:
            self._give_up(tag)
            raise
        tags = {o.tag for o in gathered}
        failed = [o for o in gathered if o.error is not None]
        if error is not None or failed or len(tags) > 1:
            self._give_up(tag)
        if len(tags) > 1:
            self._step_again(gathered, tags)
        # A failure is named first (also one at another exchange: a rank whose path was
        # what failed); then ranks at different exchanges.
        if error is not None:
            raise error
        if failed:
            first = failed[0]
            raise RankFailedError(
                f"{what} failed on rank {first.rank}: {first.error}"
                + (f" (and on {len(failed) - 1} more ranks)" if len(failed) > 1 else "")
            )
        if len(tags) > 1:
            raise RankFailedError(
                "the ranks are not at the same save or exchange: "
                + ", ".join(f"rank {o.rank} at {o.tag}" for o in gathered)
                + " (a rank failed, was late or was cancelled alone, then went on)"
            )
        return [o.value for o in gathered]

    def _give_up(self, tag: str) -> None:
        given_up = self.mesh.given_up
        given_up.append(tag)
        del given_up[:-_MAX_CATCH_UP]

    def _step_again(self, gathered: list[_Outcome], tags: set[str]) -> None:
        """After a gather of ranks at different exchanges, which this rank leaves (it
        raises), number its next exchange so that the ranks meet again there: the number
        of the exchange that ranks gathering theirs again wait at (a late rank's catch-up),
        else one past the highest gathered. Every rank that leaves computes the same from
        the same outcomes. A rank that skipped an exchange (it failed between two without
        telling the others) would otherwise be one number behind at every later one."""
        waiting = [o.number for o in gathered if _gathers_again(o, tags)]
        self.mesh.number_next(max(waiting) if waiting else max(o.number for o in gathered) + 1)

    def _gather_in_step(self, outcome: _Outcome) -> list[_Outcome]:
        """Gather ``outcome``; gathered again while some ranks are still at exchanges this
        rank gave up on: those ranks fail theirs meanwhile (at another exchange than this
        rank) and come to this one next. A rank that timed out waiting for a late one
        would otherwise meet it one exchange behind, at every save."""
        for attempt in range(_MAX_CATCH_UP):
            outcome = dataclasses.replace(outcome, given_up=tuple(self.mesh.given_up), attempt=attempt)
            try:
                raw = self.mesh.gather(outcome, outcome.tag)
            except ProcessExitingError:
                raise  # not the other ranks' doing
            except RuntimeError as exc:  # gloo's timeouts and lost peers
                where = "" if isinstance(exc, StoreTimeoutError) else self.mesh.absent(outcome.tag)
                raise RankFailedError(
                    f"rank {self.rank}: exchanging checkpoint metadata with the other ranks failed "
                    f"(a rank died or did not come within {_knobs.dist_timeout():.0f} s) "
                    f"at exchange {outcome.tag}{where}: {exc}"
                ) from exc
            gathered = [
                o if isinstance(o, _Outcome) else _Outcome(r, None, None, f"another ({type(o).__name__})")
                for r, o in enumerate(raw)
            ]
            if not _gathers_again(outcome, {o.tag for o in gathered}):
                return gathered
        return gathered


class Exchanges:
    """The exchanges of one save or restore, in order: ``await exchanges(value, error)``
    is `Coordinator.exchange` labelled ``(*name, n)`` for the ``n``-th; with no
    coordinator (one process) it returns ``[value]``, or raises ``error``."""

    def __init__(self, coord: Coordinator | None, name: tuple[Any, ...], what: str = "the save") -> None:
        self.coord = coord
        self.name = name
        self.what = what
        self.count = 0

    async def __call__(self, value: Any, error: BaseException | None = None) -> list[Any]:
        if self.coord is None:
            if error is not None:
                raise error
            return [value]
        self.count += 1
        return await self.coord.exchange(value, error, (*self.name, self.count), self.what)


_lock = threading.Lock()
"""Held while a group's mesh is looked up or made."""


def coordinator(group: Any = None) -> Coordinator | None:
    """The coordinator for ``group`` (the default process group when ``None``), or ``None``
    when ``torch.distributed`` is not initialised or the group has one rank. Makes nothing
    that the other ranks must make with it: the mesh is made by the first gather."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        if group is not None:
            raise ValueError("group= given, but torch.distributed is not initialised")
        return None
    import torch.distributed as dist

    world = dist.get_world_size(group)
    if world < 0:
        raise ValueError(f"group=: this process (rank {dist.get_rank()}) is not a member of {group}")
    if world <= 1:
        return None
    key = id(group) if group is not None else None
    world_group = dist.group.WORLD
    with _lock:
        entry = _groups.get(key)
        mesh = None
        if entry is not None and entry[0]() is world_group and entry[1]() is group:
            mesh = entry[2]
        if mesh is None:
            if entry is not None:
                entry[2].close()  # of a world or group that is gone
            name = "world" if group is None else f"group-{group.group_name}"
            mesh = _Mesh(dist.distributed_c10d._get_default_store(), dist.get_rank(group), world, name)
            # Shut down with its group: torch lets go of the groups at destroy_process_group()
            # (gloo threads left running into interpreter shutdown can abort the process).
            weakref.finalize(world_group, mesh.close)
            if group is not None:
                weakref.finalize(group, _forget, key, mesh)
            _groups[key] = (_weak(world_group), _weak(group), mesh)
    rank = dist.get_rank(group)
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    return Coordinator(rank, world, local_rank, mesh)


def _forget(key: object, mesh: _Mesh) -> None:
    """A subgroup is gone: its mesh is shut down and forgotten."""
    mesh.close()
    with _lock:
        entry = _groups.get(key)
        if entry is not None and entry[2] is mesh:
            del _groups[key]


_derived_groups: dict[tuple[object, str], tuple[Callable[[], Any], Callable[[], Any]]] = {}
"""(id(checkpoint mesh), which) -> (that mesh, the group made from it), held weakly."""


def _derived_group(coord: Coordinator, which: str, ranks: list[int] | None) -> Any:
    import torch.distributed as dist

    key = (id(coord.mesh), which)
    entry = _derived_groups.get(key)
    group = entry[1]() if entry is not None and entry[0]() is coord.mesh else None
    if group is None:
        # With the checkpoint's timeout, as the checkpoint group: a rank that died fails
        # the others' saves after AIOPERSIST_DIST_TIMEOUT, not torch's 30 minutes.
        group = dist.new_group(
            ranks, backend="gloo", timeout=datetime.timedelta(seconds=_knobs.dist_timeout())
        )
        _derived_groups[key] = (_weak(coord.mesh), _weak(group))
    return group


def process0_group(coord: Coordinator) -> Any:
    """A gloo group holding process 0 alone, for saves that process 0 writes by itself
    (the Hugging Face layouts): given as ``group=``, the save needs no other rank.

    Made once per checkpoint group. Making a group is a collective: every rank calls
    this, in the same order, from the thread that issues the training's collectives.
    """
    return _derived_group(coord, "process 0", [0])


def background_group(coord: Coordinator) -> Any:
    """A gloo group of every rank for the collectives of saves that run in a background
    thread (the FSDP checkpoints of the Hugging Face integrations): its own, so that they
    never interleave with the training's or the checkpoint group's. Made once per
    checkpoint group, as `process0_group` is (a collective: every rank calls it, in the
    same order)."""
    return _derived_group(coord, "background", None)


@atexit.register
def _release_groups() -> None:
    """At exit, while the interpreter is still whole: destroy the checkpoint's own groups
    that the program left alive (it never called ``destroy_process_group()``), so that
    their gloo threads are joined now rather than during interpreter shutdown (see
    `_groups`). The training's groups are the program's, and are left alone.

    First, aiopersist's threads make no more calls into torch, and those under way are
    waited for (`aiopersist._workers.close_exit_gate`)."""
    import torch.distributed as dist

    close_exit_gate()
    for entry in _groups.values():
        entry[2].close()
    ours = [entry[1]() for entry in _derived_groups.values()]
    _groups.clear()
    _derived_groups.clear()
    if not dist.is_available() or not dist.is_initialized():
        return
    for group in ours:
        if isinstance(group, dist.ProcessGroup):
            # Destroyed already (ValueError), or failing: the process is exiting anyway.
            with contextlib.suppress(Exception):
                dist.destroy_process_group(group)
