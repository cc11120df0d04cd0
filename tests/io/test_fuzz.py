"""Property-based fuzzing of what is read from disk: manifests (re-sealed, as a forger would),
Hugging Face indexes and safetensors headers, mutated at random. Every mutation gives a load
or a typed error (`AiopersistError`), never a hang (per-test timeout), a read or a deletion
outside the checkpoint, or an allocation larger than its files; and a manager with one
mutated step still lists, restores and retains the others, touching nothing of anyone
else's. Both backends."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import struct
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aiopersist
from aiopersist import _load
from aiopersist._backends._threads import ThreadsBackend
from aiopersist._manifest import _canonical
from tests.conftest import URING_OK

pytestmark = pytest.mark.timeout(600)

BACKENDS = [
    "threads",
    pytest.param("io_uring", marks=pytest.mark.skipif(not URING_OK, reason="io_uring unavailable")),
]
FUZZ = settings(
    max_examples=int(os.environ.get("AIOPERSIST_FUZZ_EXAMPLES", "80")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,  # the same cases on every run: a failure is reproducible
)

# -- watching what the code does ---------------------------------------------------------------


class Watch:
    """What aiopersist's code opens, deletes and allocates while ``active``."""

    def __init__(self) -> None:
        self.active = False
        self.opened: list[str] = []
        self.deleted: list[str] = []
        self.allocated = 0


WATCH = Watch()
_DELETIONS = {"os.remove", "os.rmdir", "os.rename", "shutil.rmtree"}


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if WATCH.active and event in _DELETIONS:
        path = os.fsdecode(args[0]) if isinstance(args[0], str | bytes | os.PathLike) else ""
        if os.path.isabs(path):  # relative: an entry removed by rmtree, inside the tree it reported
            WATCH.deleted.append(path)
    elif WATCH.active and event == "open" and isinstance(args[0], str | bytes | os.PathLike):
        WATCH.opened.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)  # audit hooks cannot be removed: this one records only while active


@pytest.fixture(autouse=True)
def _watch_opens_and_allocations(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    real_allocate = _load._allocate

    def allocate(shape: tuple[int, ...], dtype: torch.dtype, *args: Any) -> torch.Tensor:
        if WATCH.active:
            n = 1
            for d in shape:
                n *= d
            WATCH.allocated += n * dtype.itemsize
        return real_allocate(shape, dtype, *args)

    monkeypatch.setattr(_load, "_allocate", allocate)
    for cls in [ThreadsBackend] + ([_uring_backend()] if URING_OK else []):
        real_open = cls.open

        async def backend_open(
            self: Any, path: Any, flags: int, mode: int = 0o644, _real: Any = real_open
        ) -> int:
            if WATCH.active:
                WATCH.opened.append(os.fspath(path))
            fd: int = await _real(self, path, flags, mode)
            return fd

        monkeypatch.setattr(cls, "open", backend_open)
    yield
    WATCH.active = False


def _uring_backend() -> type:
    from aiopersist._backends._uring import UringBackend

    return UringBackend


def _inside(path: str, roots: list[Path]) -> bool:
    real = os.path.realpath(path)
    return any(real == str(r) or real.startswith(str(r) + os.sep) for r in roots)


async def _load_and_verify(path: Path, backend: str) -> None:
    for op in (aiopersist.load, aiopersist.verify):
        with contextlib.suppress(aiopersist.AiopersistError):
            await op(path, backend=backend)  # type: ignore[operator]


def _check(path: Path, backend: str, roots: list[Path]) -> None:
    """Load and verify under watch: typed errors only, nothing read outside ``roots``,
    nothing deleted, no allocation beyond the files' bytes."""
    budget = sum(f.stat().st_size for r in roots for f in r.rglob("*") if f.is_file() and not f.is_symlink())
    WATCH.opened, WATCH.deleted, WATCH.allocated = [], [], 0
    WATCH.active = True
    try:
        asyncio.run(_load_and_verify(path, backend))
    finally:
        WATCH.active = False
    # The memory check reads the machine's state (/proc/meminfo, the cgroups' limits): not a
    # path any checkpoint names.
    system = [Path("/proc"), Path("/sys/fs/cgroup")]
    outside = [p for p in WATCH.opened if not _inside(p, roots) and not _inside(p, system)]
    assert not outside, outside
    assert not WATCH.deleted, WATCH.deleted
    assert WATCH.allocated <= budget, (WATCH.allocated, budget)


# -- mutations ---------------------------------------------------------------------------------


def _deep() -> Any:
    node: Any = 0
    for _ in range(300):
        node = [node]
    return node


VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, 7, 4096, 2**31, 2**62, 2**63, 2**64, -1]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.sampled_from(
        [
            "..",
            ".",
            "",
            "/etc/passwd",
            "../outside.safetensors",
            "part-0123456789ab",
            "../../part-0123456789ab",
            "../..",
            "F32",
            "BF16",
            "I64",
            "U8",
            "state.safetensors",
            "aiopersist.json",
            "model.w",
            "__tensor__",
            "\x00",
        ]
    ),
    st.lists(st.integers(min_value=-3, max_value=2**40), max_size=4),
    st.lists(st.sampled_from([0, 1, 2**62, 2**64]), max_size=3),
    st.dictionaries(
        st.sampled_from(["__tensor__", "__tuple__", "__dict__", "x", "state"]), st.integers(), max_size=2
    ),
    # Fresh objects each time (st.just would share one, which a later mutation could change).
    st.builds(_deep),
    st.builds(lambda: [[".", ".."], ["..", "part-0123456789ab"]]),
)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list) and len(prefix) < 12:
        for i, v in enumerate(node[:6]):
            yield from _paths(v, (*prefix, i))


def _mutate(doc: Any, data: st.DataObject) -> Any:
    paths = [p for p in _paths(doc) if p]
    for _ in range(data.draw(st.integers(min_value=1, max_value=3))):
        if not paths:  # everything deleted already
            break
        path = data.draw(st.sampled_from(paths))
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        key = path[-1]
        action = data.draw(st.sampled_from(["replace", "replace", "replace", "delete", "rename"]))
        if action == "delete" and isinstance(parent, dict):
            parent.pop(key, None)
        elif action == "rename" and isinstance(parent, dict) and key in parent:
            parent[data.draw(VALUES.filter(lambda v: isinstance(v, str)))] = parent.pop(key)
        else:
            parent[key] = data.draw(VALUES)
        paths = [p for p in _paths(doc) if p]
    return doc


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    base = torch.arange(64, dtype=torch.float32)
    return {
        "model": {"w": torch.randn(32, 16), "b": torch.randn(16).to(torch.bfloat16)},
        "views": (base[:8], base[4:40]),
        "opt": {"state": {0: {"step": torch.tensor(3)}}, "lr": float("nan"), "betas": (0.9, 0.99)},
        "step": 3,
        "raw": b"\x00\x01",
    }


@pytest.fixture(scope="module")
def templates(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Valid checkpoints to mutate: one directory, two directories, a Hugging Face one."""
    root = tmp_path_factory.mktemp("fuzz-templates")

    async def make() -> None:
        await aiopersist.save(_state(), root / "one" / "c", backend="threads")
        big = {f"t{i}": torch.randn(64, 64) for i in range(6)}
        await aiopersist.save(
            {**big, "n": 1}, [root / "two" / "c", root / "two" / "d" / "c"], backend="threads"
        )
        await aiopersist.save(
            torch.nn.Linear(16, 8), root / "hf" / "c", backend="threads", max_shard_bytes=256
        )

    asyncio.run(make())
    return root


def _copy(template: Path) -> tuple[Path, list[Path]]:
    work = Path(tempfile.mkdtemp(prefix="aiopersist-fuzz-"))
    shutil.copytree(template, work / template.name, symlinks=True)
    return work, [work]


def _reseal(manifest: Path, doc: Any) -> None:
    if isinstance(doc, dict):
        doc.pop("manifest_checksum", None)
        with contextlib.suppress(ValueError, RecursionError, TypeError):  # then it stays unsealed
            doc["manifest_checksum"] = xxhash.xxh3_64_hexdigest(_canonical(doc))
    manifest.write_text(json.dumps(doc))


# -- the properties ----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["one", "two"])
def test_mutated_manifests_load_or_fail_typed(templates: Path, backend: str, layout: str) -> None:
    @FUZZ
    @given(data=st.data())
    def case(data: st.DataObject) -> None:
        work, roots = _copy(templates / layout)
        try:
            manifest = work / layout / "c" / "aiopersist.json"
            doc = _mutate(json.loads(manifest.read_text()), data)
            _reseal(manifest, doc)
            _check(work / layout / "c", backend, roots)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    case()


@pytest.mark.parametrize("backend", BACKENDS)
def test_mutated_indexes_and_headers_load_or_fail_typed(templates: Path, backend: str) -> None:
    @FUZZ
    @given(data=st.data(), target=st.sampled_from(["index", "header"]))
    def case(data: st.DataObject, target: str) -> None:
        work, roots = _copy(templates / "hf")
        try:
            ckpt = work / "hf" / "c"
            (ckpt / "aiopersist.json").unlink()  # a plain Hugging Face directory
            if target == "index":
                index = ckpt / "model.safetensors.index.json"
                index.write_text(json.dumps(_mutate(json.loads(index.read_text()), data)))
            else:
                shard = data.draw(st.sampled_from(sorted(ckpt.glob("*.safetensors"))))
                raw = shard.read_bytes()
                (n,) = struct.unpack("<Q", raw[:8])
                header = _mutate(json.loads(raw[8 : 8 + n]), data)
                body = json.dumps(header).encode()
                shard.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n :])
                _check(shard, backend, roots)  # the file named directly, too
            _check(ckpt, backend, roots)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    case()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_manager_survives_a_mutated_step(backend: str) -> None:
    """One step of a two-disk run gets a mutated manifest: the manager still lists, restores
    and retains the good ones (steps and restore never raise but for "nothing found"), and
    every deletion stays inside its own directories."""

    @settings(FUZZ, max_examples=max(8, FUZZ.max_examples // 6))
    @given(data=st.data())
    def case(data: st.DataObject) -> None:
        work = Path(tempfile.mkdtemp(prefix="aiopersist-fuzz-run-"))
        outside = work / "other" / "step-1" / "part-0123456789ab" / "precious.bin"
        outside.parent.mkdir(parents=True)
        outside.write_bytes(b"keep")
        dirs = [work / "run", work / "run-b"]

        async def scenario() -> None:
            async with aiopersist.CheckpointManager(dirs, backend=backend) as mgr:
                for step in (1, 2, 3):
                    state = {"step": step, "w": torch.full((64, 64), float(step)), "v": torch.ones(64, 64)}
                    await (await mgr.save(step, state)).done
            victim = data.draw(st.sampled_from([1, 2, 3]))
            manifest = dirs[0] / f"step-{victim}" / "aiopersist.json"
            _reseal(manifest, _mutate(json.loads(manifest.read_text()), data))
            WATCH.deleted = []
            WATCH.active = True
            try:
                async with aiopersist.CheckpointManager(dirs, keep_last=1, backend=backend) as mgr:
                    steps = mgr.steps()
                    assert set(steps) >= {1, 2, 3} - {victim}
                    back = await mgr.restore()
                    if mgr.restored_step != victim:  # the mutated one may be valid, and say anything
                        assert back["step"] == mgr.restored_step
                    await (
                        await mgr.save(4, {"step": 4, "w": torch.ones(64, 64), "v": torch.ones(64, 64)})
                    ).done
                    await mgr.wait()
                    assert 4 in mgr.steps()
            finally:
                WATCH.active = False
            roots = [work / "run", work / "run-b"]
            assert all(_inside(p, roots) for p in WATCH.deleted), WATCH.deleted
            assert outside.read_bytes() == b"keep"

        try:
            asyncio.run(scenario())
        finally:
            shutil.rmtree(work, ignore_errors=True)

    case()


def test_the_watch_sees_reads_and_deletions(tmp_path: Path) -> None:
    """The fuzz tests' watch is real: it records what a load opens and what a deletion
    removes (a watch that saw nothing would make them pass vacuously)."""

    async def run() -> None:
        await aiopersist.save({"w": torch.ones(4)}, tmp_path / "c", backend="threads")
        WATCH.opened, WATCH.deleted, WATCH.allocated = [], [], 0
        WATCH.active = True
        try:
            await aiopersist.load(tmp_path / "c", backend="threads")
            await asyncio.to_thread(shutil.rmtree, tmp_path / "c")
        finally:
            WATCH.active = False

    asyncio.run(run())
    assert any(p.endswith("model.safetensors") for p in WATCH.opened), WATCH.opened
    assert any(p.endswith("aiopersist.json") for p in WATCH.opened)
    assert WATCH.deleted, WATCH.deleted
    assert WATCH.allocated >= 16
