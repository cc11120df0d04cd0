"""The ``aiopersist`` command line: ``doctor``, ``demo``, ``bench``, and ``inspect``,
``verify`` and ``convert`` for checkpoints."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import unicodedata
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import torch

    from .._format import FileLayout
    from .._manager import StepInfo
    from .._manifest import Manifest

from .._backends import describe_platform, probe_io_uring
from .._direct import probe_directory
from .._exceptions import (
    AiopersistError,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    DirectoryInUseError,
    UnsupportedStateError,
    maps_os_errors,
)
from .._manifest import dcp_directories
from .progress import Progress, human

log = logging.getLogger("aiopersist")


def _doctor(args: argparse.Namespace) -> int:
    path = _existing_directories([args.path])[0]
    rows = list(describe_platform().items())
    rows.append(("path", path))
    try:
        dio = probe_directory(path)
    except OSError as exc:  # CheckpointIOError included
        rows.append(("O_DIRECT", f"cannot probe: {exc}"))
    else:
        rows.append(("O_DIRECT", "yes" if dio.direct else f"no: {dio.reason}"))
        rows.append(
            ("alignment", f"memory {dio.mem_align}, offset {dio.offset_align} (from {dio.source})")
            if dio.direct
            else ("alignment", "none needed (buffered I/O)")
        )
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def _demo_trainer(args: argparse.Namespace) -> int:
    if args.steps < 2 * args.every:
        print("aiopersist demo-trainer: --steps must be at least twice --every", file=sys.stderr)
        return 2
    if args.rounds < 1:
        print(f"aiopersist demo-trainer: --rounds must be at least 1; got {args.rounds}", file=sys.stderr)
        return 2
    for name in ("layers", "width"):
        value = getattr(args, name)
        if value < 1:
            print(f"aiopersist demo-trainer: --{name} must be at least 1; got {value}", file=sys.stderr)
            return 2
    # transformers: seconds to import
    from .._bench.demo_trainer import Shape, format_demo, plot_demo, run_demo

    shape = Shape(layers=args.layers, width=args.width)
    report = run_demo(
        os.path.abspath(args.dir), steps=args.steps, every=args.every, rounds=args.rounds, shape=shape
    )
    print(format_demo(report))
    if args.plot:
        plot_demo(report, args.plot)
        print(f"plot written to {args.plot}")
    return 0 if report.matched else 1


def _demo(args: argparse.Namespace) -> int:
    import torch

    directory = os.path.abspath(args.dir) if args.dir else tempfile.mkdtemp(prefix="aiopersist-demo-")
    os.makedirs(directory, exist_ok=True)
    # A transformer-shaped state: embeddings, per-layer attention and MLP weights in bf16/fp32.
    torch.manual_seed(0)
    hidden, layers = 1024, max(1, args.size_mib // 24)
    state: dict[str, torch.Tensor] = {"embed.weight": torch.randn(8192, hidden, dtype=torch.bfloat16)}
    for i in range(layers):
        state[f"layers.{i}.attn.qkv.weight"] = torch.randn(3 * hidden, hidden, dtype=torch.bfloat16)
        state[f"layers.{i}.attn.out.weight"] = torch.randn(hidden, hidden, dtype=torch.bfloat16)
        state[f"layers.{i}.mlp.up.weight"] = torch.randn(4 * hidden, hidden, dtype=torch.bfloat16)
        state[f"layers.{i}.mlp.down.weight"] = torch.randn(hidden, 4 * hidden, dtype=torch.bfloat16)
        state[f"layers.{i}.norm.weight"] = torch.ones(hidden, dtype=torch.float32)
    total = sum(t.numel() * t.element_size() for t in state.values())
    print(f"state: {len(state)} tensors, {total / (1 << 20):.0f} MiB, saved under {directory}")
    methods = ["torch.save"] + ["threads"] + (["io_uring"] if probe_io_uring().usable else [])
    saves: dict[str, list[float]] = {m: [] for m in methods}
    loads: dict[str, list[float]] = {m: [] for m in methods}
    print(f"{args.rounds} interleaved round(s), page cache dropped before each save and load (when root)")
    try:
        for r in range(args.rounds):
            for name in methods[r % len(methods) :] + methods[: r % len(methods)]:
                save_s, load_s, same = _demo_once(name, state, directory)
                if not same:
                    print(f"{name}: the loaded state differs from the saved one", file=sys.stderr)
                    return 1
                saves[name].append(save_s)
                loads[name].append(load_s)
    finally:
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)
    gib = total / (1 << 30)
    base_save, base_load = statistics.median(saves["torch.save"]), statistics.median(loads["torch.save"])
    cols = ("method", "save s", "GiB/s", "speedup", "load s", "GiB/s", "speedup")
    print("{:<11} {:>7} {:>6} {:>8} {:>7} {:>6} {:>8}  identical".format(*cols))
    for name in methods:
        s_med, l_med = statistics.median(saves[name]), statistics.median(loads[name])
        print(
            f"{name:<11} {s_med:>7.2f} {gib / s_med:>6.2f} {base_save / s_med:>7.2f}x "
            f"{l_med:>7.2f} {gib / l_med:>6.2f} {base_load / l_med:>7.2f}x  yes"
        )
    print("medians; torch.save is followed by an fsync so that both sides are durable")
    return 0


def _demo_once(name: str, state: dict[str, torch.Tensor], directory: str) -> tuple[float, float, bool]:
    """One save and one load by ``name``: seconds for each, and whether the state came back."""
    import torch

    from .._load import load
    from .._save import save

    if name == "torch.save":
        target = os.path.join(directory, "torch-save.pt")
        _drop_caches()
        t0 = time.perf_counter()
        with open(target, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        save_s = time.perf_counter() - t0
        _drop_caches()
        t0 = time.perf_counter()
        loaded = torch.load(target, weights_only=True)
        load_s = time.perf_counter() - t0
    else:
        target = os.path.join(directory, f"ckpt-{name}")
        _drop_caches()
        info = asyncio.run(save(state, target, backend=name, overwrite=True))
        save_s = info.seconds
        _drop_caches()
        t0 = time.perf_counter()
        loaded = asyncio.run(load(target, backend=name))
        load_s = time.perf_counter() - t0
    same = loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)
    return save_s, load_s, same


def _drop_caches() -> None:
    """Drop the page cache (root only) so that reads come from the disk, not memory."""
    if os.geteuid() != 0:
        return
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass


def _bench_ckpt(args: argparse.Namespace) -> int:
    from .._bench.ckpt import ckpt_report_json, format_ckpt, plot_ckpt, run_ckpt

    directory = os.path.abspath(args.dir)
    os.makedirs(directory, exist_ok=True)
    ranks, dirs = getattr(args, "ranks", 1), getattr(args, "dirs", 1)
    if ranks != 1 or dirs != 1:
        from .._bench.spread import format_spread, run_spread

        if ranks < 1 or dirs < 1:
            print("aiopersist bench save: --ranks and --dirs must be at least 1", file=sys.stderr)
            return 2
        spread = run_spread(
            directory, size_bytes=int(args.size_gib * (1 << 30)), ranks=ranks, dirs=dirs, rounds=args.rounds
        )
        print(format_spread(spread))
        return 0
    methods = [m.strip() for m in args.methods.split(",")] if args.methods else None
    report = run_ckpt(
        directory,
        kind=args.bench,
        size_bytes=int(args.size_gib * (1 << 30)),
        rounds=args.rounds,
        methods=methods,
        shape=args.state,
        out=sys.stderr if args.json else sys.stdout,
    )
    if args.json:
        print(json.dumps(ckpt_report_json(report), indent=2))
    else:
        print(format_ckpt(report))
    if args.plot:
        plot_ckpt(report, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _bench_dcp(args: argparse.Namespace) -> int:
    from .._bench.dcp import format_dcp, run_dcp

    directory = os.path.abspath(args.dir)
    os.makedirs(directory, exist_ok=True)
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    try:
        report = run_dcp(
            directory,
            size_bytes=int(args.size_gib * (1 << 30)),
            ranks=args.ranks,
            rounds=args.rounds,
            methods=methods,
        )
    except ValueError as exc:
        print(f"aiopersist bench dcp: {exc}", file=sys.stderr)
        return 2
    print(format_dcp(report))
    return 0


def _bench_modes(text: str, known: Sequence[str], bench: str) -> tuple[str, ...] | None:
    """``--modes`` of ``bench train`` and ``bench gpu``: comma-separated, among ``known``,
    with the ``none`` baseline; ``None`` (said on stderr) otherwise."""
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    if any(m not in known for m in modes) or "none" not in modes:
        print(
            f"aiopersist bench {bench}: --modes must name 'none' and only {', '.join(known)}; got {text!r}",
            file=sys.stderr,
        )
        return None
    return modes


def _bench_train(args: argparse.Namespace) -> int:
    import torch

    from .._bench.train import DCP_MODES, MODES, format_train, plot_train, run_train

    modes = _bench_modes(args.modes, MODES + DCP_MODES, "train")
    if modes is None:
        return 2
    if args.torch_threads:
        # Leaves cores to the writer: an OpenMP team waits for its slowest thread, so a
        # busy core slows every parallel op of the training step.
        torch.set_num_threads(args.torch_threads)
    report = run_train(
        os.path.abspath(args.dir),
        rounds=args.rounds,
        steps=args.steps,
        batch=args.batch,
        hidden=args.hidden,
        layers=args.layers,
        modes=modes,
    )
    print(format_train(report))
    if args.plot:
        plot_train(report, args.plot)
        print(f"plot written to {args.plot}")
    return 0


def _bench_gpu(args: argparse.Namespace) -> int:
    from .._bench.gpu import CADENCES, MODES, format_gpu, run_gpu, write_outputs

    modes = _bench_modes(args.modes, MODES, "gpu")
    if modes is None:
        return 2
    try:
        cadences = tuple(int(c) for c in args.every.split(",") if c.strip())
    except ValueError:
        cadences = ()
    if not cadences or any(c < 1 for c in cadences):
        print(
            f"aiopersist bench gpu: --every wants step counts >= 1, like 1,10; got {args.every!r}",
            file=sys.stderr,
        )
        return 2
    if args.rounds < 1 or args.micro_batch < 1 or args.params <= 0:
        print("aiopersist bench gpu: --rounds, --micro-batch and --params must be positive", file=sys.stderr)
        return 2
    try:
        report = run_gpu(
            os.path.abspath(args.dir),
            dry_run=args.dry_run,
            parameters=args.params,
            micro_batch=args.micro_batch,
            rounds=args.rounds,
            modes=modes,
            cadences=cadences or CADENCES,
            budget_s=args.budget_s,
        )
    except RuntimeError as exc:
        if "needs a CUDA device" not in str(exc):
            raise
        print(f"aiopersist bench gpu: {exc}", file=sys.stderr)
        return 1
    write_outputs(report, args.json, args.markdown)
    print(format_gpu(report))
    return 0


def _bench_raw(args: argparse.Namespace) -> int:
    from .._bench.raw import format_raw, run_raw

    directory = os.path.abspath(args.dir)
    os.makedirs(directory, exist_ok=True)
    report = run_raw(
        directory,
        size_bytes=int(args.size_gib * (1 << 30)),
        rounds=args.rounds,
        chunk_bytes=args.chunk_mib << 20 if args.chunk_mib else None,
        buffers=args.buffers,
    )
    print(format_raw(report))
    return 0


# -- inspect --------------------------------------------------------------------------------


@maps_os_errors("inspect")
def describe(path: str | os.PathLike[str], *, backend: str = "auto") -> dict[str, Any]:
    """What ``aiopersist inspect --json`` prints about the checkpoint at ``path``.

    ``path`` is an aiopersist checkpoint directory, a Hugging Face model directory or a
    safetensors file. Only the manifest or the safetensors headers are read, never the
    tensor data, so this is fast however large the checkpoint. Raises
    `CheckpointNotFoundError` or `CheckpointCorruptError` when the manifest or a header
    is unusable; a data file whose size differs from the manifest's is reported in its
    ``problem`` field instead (``aiopersist verify`` checks the data).
    """
    from .._locate import locate, part_places, read_manifest
    from .._names import MANIFEST_NAME

    target = os.path.abspath(os.fspath(path))
    if os.path.isdir(target) and os.path.lexists(os.path.join(target, MANIFEST_NAME)):
        manifest = read_manifest(target)
        return _describe_manifest(target, manifest, part_places(target, manifest))
    loc = locate(target)
    layouts = asyncio.run(_read_headers(loc.files, loc.sizes, backend))
    files: list[dict[str, Any]] = []
    tensors: list[dict[str, Any]] = []
    metadata: dict[str, str] = {}
    for full, layout in zip(loc.files, layouts, strict=True):
        name = os.path.relpath(full, loc.directory)
        files.append({"name": name, "bytes": loc.sizes[full], "checksum": None, "problem": None})
        for key, value in layout.metadata.items():
            metadata.setdefault(key, value)
        tensors.extend(_row(e.name, e.dtype, e.shape, name, "stored") for e in layout.entries)
    return _document(
        target,
        "hf-dir" if loc.kind == "hf-dir" else "safetensors",
        version=None,
        layout="hf-model" if loc.kind == "hf-dir" else "safetensors",
        created=None,
        metadata=metadata,
        files=files,
        tensors=tensors,
        pickle_file=None,
    )


async def _read_headers(files: Sequence[str], sizes: Mapping[str, int], backend: str) -> list[FileLayout]:
    from .._backends import open_backend
    from .._load import _read_header

    async with open_backend(backend) as be:
        return [await _read_header(be, f, sizes[f]) for f in files]


def _row(
    name: str,
    dtype: torch.dtype,
    shape: Sequence[int],
    file: str,
    kind: str,
    *,
    alias_of: str | None = None,
    view_of: str | None = None,
    numpy: bool = False,
) -> dict[str, Any]:
    from .._format import bounded_count, dtype_label

    return {
        "name": name,
        "dtype": dtype_label(dtype),  # a DCP checkpoint's may have no safetensors name
        "shape": list(shape),
        "bytes": (bounded_count(shape) or 0) * dtype.itemsize,  # shapes are checked: at most 2**62
        "file": file,
        "kind": kind,
        "alias_of": alias_of,
        "view_of": view_of,
        "numpy": numpy,
    }


def _dcp_rows(target: str) -> list[dict[str, Any]]:
    """The tensors of a torch.distributed.checkpoint directory written through aiopersist,
    from DCP's ``.metadata`` (checked against the manifest, read by the reader's restricted
    unpickler): each whole tensor, with the number of chunks it was saved in."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ..integrations.dcp import AiopersistReader

    metadata = AiopersistReader(target).read_metadata()
    rows = []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            chunks = len(md.chunks)
            rows.append(
                _row(
                    fqn, md.properties.dtype, tuple(md.size), f"{chunks} chunk{'s' * (chunks != 1)}", "stored"
                )
            )
    return rows


def _document(target: str, kind: str, **fields: Any) -> dict[str, Any]:
    tensors = fields["tensors"]
    count = {k: sum(1 for t in tensors if t["kind"] == k) for k in ("stored", "alias", "view", "storage")}
    totals = {
        "tensors": count["stored"] + count["alias"] + count["view"],
        "stored": count["stored"],
        "aliases": count["alias"],
        "views": count["view"],
        "storage_spans": count["storage"],
        "bytes": sum(t["bytes"] for t in tensors if t["kind"] in ("stored", "storage")),
    }
    return {"path": target, "kind": kind, **fields, "totals": totals}


def _describe_manifest(target: str, m: Manifest, places: Sequence[str]) -> dict[str, Any]:
    from .._locate import file_problem
    from .._names import MANIFEST_NAME
    from .._skeleton import refs

    files = []
    for rec in m.files.values():
        place = places[rec.directory]
        problem = file_problem(os.path.join(place, rec.name), rec.nbytes, root=place)
        files.append({"name": rec.name, "bytes": rec.nbytes, "checksum": rec.checksum, "problem": problem})

    # The tensors in the order the saved object holds them (the skeleton's order), each
    # alias target or view base just before its first user; anything the skeleton does
    # not name comes last, in the manifest's order.
    referenced = [(name, marker == "__ndarray__") for name, marker in refs(m.skeleton)]
    names = {n for n, _ in referenced}
    rows: list[dict[str, Any]] = []
    done: set[str] = set()
    view_bases = {spec.base for spec in m.views.values()}

    def where(name: str) -> str:
        if name in m.sliced:
            files = sorted({p.file for p in m.sliced[name].slices})
            return f"{len(m.sliced[name].slices)} slices in {', '.join(files)}"
        if name in m.views:
            return where(m.views[name].base)
        if name in m.aliases:
            return where(m.aliases[name])
        return m.tensors[name].file

    def typed(name: str) -> tuple[Any, tuple[int, ...]]:
        if name in m.sliced:
            return m.sliced[name].dtype, m.sliced[name].shape
        if name in m.aliases:
            return typed(m.aliases[name])
        if name in m.views:
            return m.views[name].dtype, m.views[name].shape
        return m.tensors[name].dtype, m.tensors[name].shape

    def emit(name: str, numpy: bool = False) -> None:
        if name in done:
            return
        if name in m.aliases:
            target_name = m.aliases[name]
            emit(target_name)
            dtype, shape = typed(target_name)
            row = _row(name, dtype, shape, where(target_name), "alias", alias_of=target_name, numpy=numpy)
        elif name in m.views:
            spec = m.views[name]
            emit(spec.base)
            row = _row(
                name,
                spec.dtype,
                spec.shape,
                where(spec.base),
                "view",
                view_of=spec.base,
                numpy=numpy,
            )
        elif name in m.tensors or name in m.sliced:
            kind = "storage" if name in view_bases and name not in names else "stored"
            dtype, shape = typed(name)
            row = _row(name, dtype, shape, where(name), kind, numpy=numpy)
        else:
            raise CheckpointCorruptError(
                f"{target}: the manifest's skeleton refers to unknown tensor {name!r}"
            )
        done.add(name)
        rows.append(row)

    for name, numpy in referenced:
        emit(name, numpy)
    for name in [*m.tensors, *m.sliced, *m.aliases, *m.views]:
        emit(name)
    if m.layout == "dcp":
        rows = _dcp_rows(target)
    elif m.layout == "fsdp":
        # Each torch.distributed.checkpoint subdirectory's tensors (their names carry the
        # subdirectory's own prefix: model., optimizer.).
        # Only those that are directories of their own: a link is reported, not followed.
        subs = [
            d
            for d in dcp_directories(m)
            if file_problem(os.path.join(target, d, MANIFEST_NAME), root=target) is None
        ]
        rows = [row for sub in subs for row in _dcp_rows(os.path.join(target, sub))]
    return _document(
        target,
        "aiopersist",
        version=m.version,
        layout=m.layout,
        created=m.created or None,
        metadata=dict(m.metadata),
        files=files,
        tensors=rows,
        pickle_file=m.pickle_file,
    )


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows, strict=True)]
    lines = []
    for row in [headers, *rows]:
        cells = [
            f"{c:>{w}}" if i in right else f"{c:<{w}}"
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  " + "  ".join(cells).rstrip())
    return lines


def _plural(n: int, word: str, plural: str | None = None) -> str:
    return f"{n} {word if n == 1 else plural or word + 's'}"


_UNPRINTABLE = ("Cc", "Cf", "Cs", "Zl", "Zp")
_SHORT_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: str) -> str:
    """``text`` safe to print on a terminal: control and format characters (escape
    sequences, carriage returns, bidirectional overrides, ...) and backslashes written as
    Python escapes. Names in a checkpoint are whatever its writer chose."""
    out = []
    for ch in text:
        if ch in _SHORT_ESCAPES:
            out.append(_SHORT_ESCAPES[ch])
        elif unicodedata.category(ch) in _UNPRINTABLE:
            code = ord(ch)
            out.append(
                f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
            )
        else:
            out.append(ch)
    return "".join(out)


def _escaped(node: Any) -> Any:
    if isinstance(node, str):
        return printable(node)
    if isinstance(node, Mapping):
        return {printable(str(k)): _escaped(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_escaped(v) for v in node]
    return node


def format_description(doc: Mapping[str, Any]) -> str:
    """The text ``aiopersist inspect`` prints for a `describe` document (every name from
    the checkpoint escaped: see `printable`)."""
    doc = _escaped(doc)
    head: list[tuple[str, str]] = [
        ("path", doc["path"]),
        ("kind", doc["kind"]),
        ("version", str(doc["version"]) if doc["version"] is not None else "-"),
        ("layout", doc["layout"]),
        ("created", doc["created"] or "-"),
    ]
    meta = [f"{k}: {v}" for k, v in doc["metadata"].items()] or ["-"]
    head.append(("metadata", meta[0]))
    head.extend(("", line) for line in meta[1:])
    width = max(len(k) for k, _ in head)
    lines = [f"{k:<{width}}  {v}".rstrip() for k, v in head]

    files = doc["files"]
    lines += ["", f"files ({len(files)}):"]
    file_rows = []
    for f in files:
        note = f["problem"] or ("pickled objects" if f["name"] == doc["pickle_file"] else "")
        file_rows.append([f["name"], human(f["bytes"]), f["checksum"] or "-", note])
    lines += _table(["name", "size", "checksum", "note"], file_rows, right=[1])

    tensors = doc["tensors"]
    lines += ["", "tensors:"]
    tensor_rows = []
    for t in tensors:
        notes = []
        if t["alias_of"]:
            notes.append(f"-> {t['alias_of']}")
        if t["view_of"]:
            notes.append(f"view of {t['view_of']}")
        if t["kind"] == "storage":
            notes.append("bytes shared by views")
        if t["numpy"]:
            notes.append("numpy array")
        shape = "[" + ", ".join(str(s) for s in t["shape"]) + "]"
        tensor_rows.append([t["name"], t["dtype"], shape, human(t["bytes"]), t["file"], ", ".join(notes)])
    if tensor_rows:
        lines += _table(["name", "dtype", "shape", "size", "file", "note"], tensor_rows, right=[3])
    else:
        lines.append("  (none)")

    tot = doc["totals"]
    parts = [_plural(tot["stored"], "stored", "stored")]
    if tot["aliases"]:
        parts.append(_plural(tot["aliases"], "alias", "aliases"))
    if tot["views"]:
        parts.append(_plural(tot["views"], "view") + f" of {_plural(tot['storage_spans'], 'shared storage')}")
    lines += [
        "",
        f"total: {_plural(tot['tensors'], 'tensor')} ({', '.join(parts)}), "
        f"{human(tot['bytes'])} of tensor data",
    ]
    problems = [f["name"] for f in files if f["problem"]]
    if problems:
        lines.append(f"warning: not as the manifest says: {', '.join(problems)}; run `aiopersist verify`")
    return "\n".join(lines)


def _inspect(args: argparse.Namespace) -> int:
    doc = describe(args.path, backend=args.backend)
    print(json.dumps(doc, indent=2) if args.json else format_description(doc))
    return 0


# -- verify ---------------------------------------------------------------------------------


def _verify(args: argparse.Namespace) -> int:
    from .._load import verify
    from ..integrations.dcp import check_metadata_of

    try:
        with Progress("verify") as bar:
            report = asyncio.run(verify(args.path, backend=args.backend, progress=bar.update))
        check_metadata_of(args.path)
    except CheckpointNotFoundError as exc:
        print(f"not found: {printable(str(exc))}")
        return 1
    except CheckpointCorruptError as exc:
        print(f"corrupt: {printable(str(exc))}")
        return 1
    kind = report.kind
    line = f"ok: {kind}, {_plural(len(report.files), 'file')}, {human(report.bytes_checked)} checked"
    if kind != "aiopersist" and len(report.checksummed) == len(report.files):
        line += " (checksums from the aiopersist checkpoint around it)"
    elif kind != "aiopersist" and report.checksummed:
        n = len(report.checksummed)
        line += f" ({n} with checksums from the aiopersist checkpoint around them, the rest headers only)"
    elif kind != "aiopersist":
        line += " (headers only: this format has no checksums)"
    print(line)
    return 0


# -- ls and gc ------------------------------------------------------------------------------


def _ls(args: argparse.Namespace) -> int:
    from .._manager import scan
    from .._names import TRAINER_STEPS

    directories = _existing_directories(args.dir)
    # As a manager of these directories sees them: parts looked for there only.
    found = scan(directories, "local")
    trainer = scan(directories[0], "local", TRAINER_STEPS)
    found += trainer
    if args.mirror:
        found += scan(_existing_directories([args.mirror])[:1], "mirror")  # as the manager scans it
    found.sort(key=lambda s: (s.step, s.tier != "local", os.path.basename(s.path)))
    best_step = _trainer_best(trainer, strict=False)
    best = next((c for c in trainer if c.step == best_step), None)
    if args.json:
        doc = [
            {
                "step": s.step,
                "name": os.path.basename(s.path),
                "tier": s.tier,
                "kind": s.kind,
                "path": s.path,
                "complete": s.complete,
                "bytes": s.nbytes,
                "problem": s.problem,
                "best": s is best,
            }
            for s in found
        ]
        print(json.dumps(doc, indent=2))
        return 0
    leftovers = _leftovers_in(directories[0])
    if not found:
        print(
            f"no step-N or checkpoint-N checkpoints in {args.dir[0]}"
            + (f" or {args.mirror}" if args.mirror else "")
        )
        _print_leftovers(leftovers)
        return 0
    rows = [
        [
            str(s.step),
            printable(os.path.basename(s.path)),
            s.tier,
            s.kind,
            "yes" if s.complete else "NO",
            human(s.nbytes) if s.complete else "-",
            printable(s.problem or "") or ("best (trainer_state.json)" if s is best else ""),
        ]
        for s in found
    ]
    headers = ["step", "name", "tier", "kind", "complete", "size", "note"]
    print("\n".join(_table(headers, rows, right=(0, 5))))
    _print_leftovers(leftovers)
    return 0


MAX_TRAINER_STATE_BYTES = 1 << 30
"""The largest ``trainer_state.json`` that `_trainer_best` reads (as large as a manifest
may be; the Trainer's log history of a very long run is some hundreds of MB at most)."""


def _trainer_best(checkpoints: Sequence[StepInfo], *, strict: bool) -> int | None:
    """The step of the best checkpoint (``best_model_checkpoint``) that the newest
    ``trainer_state.json`` of a Trainer's complete ``checkpoint-N`` records, known by its
    name wherever the run was; ``None`` when none records one. The file is read as a
    checkpoint's own files are (`read_json`: a regular file, not a link, of at most
    `MAX_TRAINER_STATE_BYTES`). One that cannot be read or understood, whatever the
    reason, raises `ValueError` when ``strict`` (gc must not guess what to keep), else is
    ``None`` (the listing goes on)."""
    from .._locate import read_json
    from .._names import TRAINER_STATE, TRAINER_STEPS

    for c in sorted(checkpoints, key=lambda c: c.step, reverse=True):
        path = os.path.join(c.path, TRAINER_STATE)
        if not c.complete or not os.path.lexists(path):
            continue
        try:
            state = read_json(path, MAX_TRAINER_STATE_BYTES)
            best = state.get("best_model_checkpoint") if isinstance(state, dict) else None
            if not isinstance(state, dict) or not isinstance(best, str | None):
                raise ValueError("not a Trainer state with a best_model_checkpoint")
            step = TRAINER_STEPS.step_at(best) if best else None
            if best and step is None:
                raise ValueError(f"best_model_checkpoint {best[:200]!r} names no checkpoint-N")
        except Exception as exc:  # whatever is wrong with it: the best is unknown
            log.debug("aiopersist: reading %s raised", path, exc_info=True)
            if strict:
                reason = str(exc).removeprefix(f"{path}: ")  # read_json's errors name it
                message = f"{path}: cannot tell the best checkpoint: {reason}; nothing was deleted"
                raise ValueError(message) from exc
            return None
        return step
    return None


def _leftovers_in(directory: str) -> list[str]:
    """What interrupted saves and deletions left in a manager's directory (or a Trainer's
    ``output_dir``)."""
    from .._names import LEFTOVER_MARKERS

    return sorted(n for n in os.listdir(directory) if any(m in n for m in LEFTOVER_MARKERS))


def _print_leftovers(leftovers: Sequence[str]) -> None:
    if leftovers:
        print(
            f"\nleftovers of interrupted saves or deletions ({len(leftovers)}; "
            "`aiopersist gc DIR --leftovers --apply` removes them when no save runs):"
        )
        for name in leftovers:
            print(f"  {printable(name)}")


def _gc(args: argparse.Namespace) -> int:
    from .._manager import DirectoryLock

    if args.keep_last is None and not args.leftovers:
        print("aiopersist gc: nothing to do: pass --keep-last N, --leftovers, or both", file=sys.stderr)
        return 2

    directories = [os.path.abspath(d) for d in args.dir]
    _existing_directories(directories[:1])  # the manager's own; a further disk may be gone
    if not (args.apply and os.path.isdir(directories[0])):
        return _gc_locked(args, directories)
    locks = []
    try:
        # A running manager could be writing or mirroring what this would delete.
        for d in directories:
            if os.path.isdir(d):
                locks.append(DirectoryLock(d))
        return _gc_locked(args, directories)
    except DirectoryInUseError as exc:
        print(f"aiopersist gc: {exc}", file=sys.stderr)
        return 1
    finally:
        for lock in locks:
            lock.release()


def _gc_locked(args: argparse.Namespace, directories: list[str]) -> int:
    from .._manager import clean_leftovers, delete_step, scan, step_paths
    from .._names import TRAINER_STEPS
    from .._retention import policy_of, to_delete

    directory = directories[0]
    retention = args.keep_last is not None
    # A manager's step-N: its retention; incomplete ones are left alone.
    steps = [s for s in scan(directories) if s.complete]
    gone = set(to_delete([s.step for s in steps], policy_of(args.keep_last, args.keep_every)))
    doomed_steps = [s for s in steps if s.step in gone]
    # A Trainer's checkpoint-N: save_total_limit's rotation, the best one kept; broken ones
    # older than the newest complete one go too (nothing resumes from them).
    ckpts = scan(directory, "local", TRAINER_STEPS)
    best = _trainer_best(ckpts, strict=True) if retention else None
    gone = set(
        to_delete(
            [c.step for c in ckpts if c.complete],
            policy_of(args.keep_last, args.keep_every, best=best),
            protected=() if best is None else (best,),
            incomplete=[c.step for c in ckpts if not c.complete and c.damaged] if retention else (),
        )
    )
    doomed_ckpts = [c for c in ckpts if c.step in gone]
    leftovers = _leftovers_in(directory) if args.leftovers and os.path.isdir(directory) else []

    verb = "deleting" if args.apply else "would delete"
    for s in doomed_steps:
        print(f"{verb} step-{s.step} ({human(s.nbytes)})")
    for c in doomed_ckpts:
        what = f"{c.kind}, {human(c.nbytes)}" if c.complete else f"{c.kind}, incomplete"
        print(f"{verb} {os.path.basename(c.path)} ({what})")
    for name in leftovers:
        print(f"{'removing' if args.apply else 'would remove'} leftover {printable(name)}")
    kept = [str(s.step) for s in steps if s not in doomed_steps]
    if steps or not ckpts:
        print(f"keeping {_plural(len(kept), 'complete step')}" + (f": {', '.join(kept)}" if kept else ""))
    if ckpts:
        kept = [
            f"{c.step} (best)" if c.step == best else str(c.step)
            for c in ckpts
            if c.complete and c not in doomed_ckpts
        ]
        print(
            f"keeping {_plural(len(kept), 'complete Trainer checkpoint')}"
            + (f": {', '.join(kept)}" if kept else "")
        )
    if not args.apply:
        if doomed_steps or doomed_ckpts or leftovers:
            print("dry run: pass --apply to delete")
        return 0
    # A step is complete only with its parts in the directories given: all are deleted.
    step_dirs = {s.step: step_paths(directories, os.path.basename(s.path)) for s in doomed_steps}
    count, deleted = len(doomed_steps) + len(doomed_ckpts), 0

    def one_more(bar: Progress, nbytes: int) -> None:
        nonlocal deleted
        deleted += 1
        bar.add(nbytes, note=f"{deleted} of {count} deleted")

    with Progress("gc", sum(s.nbytes for s in [*doomed_steps, *doomed_ckpts])) as bar:
        for s in doomed_steps:
            delete_step(step_dirs[s.step])
            one_more(bar, s.nbytes)
        failed: list[str] = []
        if doomed_ckpts:
            from ..integrations._common import delete_checkpoints

            sizes = {c.path: c.nbytes for c in doomed_ckpts}
            failed = delete_checkpoints(list(sizes), done=lambda p: one_more(bar, sizes[p]))
    if args.leftovers:
        clean_leftovers(directories)
    if failed:
        print(
            f"aiopersist gc: could not delete cleanly: {', '.join(map(printable, failed))}", file=sys.stderr
        )
        return 1
    return 0


# -- convert --------------------------------------------------------------------------------


def _leaves(obj: object, parts: list[str]) -> Iterator[tuple[list[str], object]]:
    """Every leaf of a loaded state (not a dict, list or tuple), with its path."""
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _leaves(v, [*parts, str(k)])
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from _leaves(v, [*parts, str(i)])
    else:
        yield parts, obj


def _named_tensors(state: object) -> tuple[dict[str, torch.Tensor], int, int]:
    """The tensors in ``state`` under dotted names (as the manifest names them), numpy
    arrays as tensors. Also the number of numpy arrays converted and of other leaves
    (scalars, strings, ...) left out."""
    import numpy as np
    import torch

    found: list[tuple[str, torch.Tensor]] = []
    taken: set[str] = set()
    arrays = others = 0
    for parts, leaf in _leaves(state, []):
        base = ".".join(parts) or "tensor"
        name, n = base, 1
        while name in taken:
            n += 1
            name = f"{base}#{n}"
        taken.add(name)
        if isinstance(leaf, torch.Tensor):
            found.append((name, leaf.detach()))
        elif isinstance(leaf, np.ndarray):
            try:  # its own memory and strides: a view is not copied here (see _write_safetensors)
                found.append((name, torch.from_numpy(leaf)))
            except TypeError as exc:
                raise ValueError(
                    f"{name}: numpy dtype {leaf.dtype} has no tensor equivalent ({exc})"
                ) from exc
            arrays += 1
        else:
            taken.discard(name)
            others += 1
    return dict(found), arrays, others


_WRITE_CHUNK = 16 << 20
"""Bytes written at a time by ``convert`` (the progress line moves by as much)."""


def _safetensors_layout(tensors: Mapping[str, torch.Tensor]) -> FileLayout:
    """The layout of the safetensors file ``convert`` writes for ``tensors``: their
    dtypes checked, every tensor at its full size (a view or an alias is written in full:
    safetensors shares nothing)."""
    from .._format import layout_file, supported_dtype

    for name, t in tensors.items():
        if not supported_dtype(t.dtype):
            raise ValueError(f"{name}: dtype {t.dtype} cannot be stored in a safetensors file")
        try:
            name.encode()
        except UnicodeEncodeError:  # a lone surrogate, which JSON (a manifest's skeleton) can hold
            raise ValueError(f"{name}: a name a safetensors file cannot hold (not UTF-8)") from None
    return layout_file([(n, t.dtype, t.shape) for n, t in tensors.items()], {"format": "pt"}, alignment=8)


def _pieces(t: torch.Tensor, limit: int = _WRITE_CHUNK) -> Iterator[torch.Tensor]:
    """The bytes of ``t`` in row-major order, as contiguous uint8 tensors of at most
    ``limit`` bytes (or one element, if larger), each valid until the next is asked for.
    A tensor that is not contiguous (a view with zero or overlapping strides may claim far
    more than its storage holds) is copied a piece at a time into one buffer, never whole."""
    import torch

    if t.is_contiguous():
        flat = t.reshape(-1).view(torch.uint8)
        for pos in range(0, flat.numel(), limit):
            yield flat[pos : pos + limit]
        return
    buffer = torch.empty(max(1, min(t.numel(), limit // t.element_size())), dtype=t.dtype)
    yield from _copied(t, buffer)


def _copied(t: torch.Tensor, buffer: torch.Tensor) -> Iterator[torch.Tensor]:
    """`_pieces` of a tensor that is not contiguous: as many rows at a time as ``buffer``
    holds, or each row's pieces (recursively) when one row is larger than it."""
    import torch

    if t.dim() == 0 or t.numel() <= buffer.numel():
        piece = buffer[: t.numel()].view(t.shape)
        piece.copy_(t)
        yield piece.reshape(-1).view(torch.uint8)
        return
    row = t[0].numel()
    if row <= buffer.numel():
        step = buffer.numel() // row
        for i in range(0, t.shape[0], step):
            yield from _copied(t[i : i + step], buffer)
    else:
        for i in range(t.shape[0]):
            yield from _copied(t[i], buffer)


def _write_safetensors(
    tmp: str, layout: FileLayout, tensors: Mapping[str, torch.Tensor], bar: Progress
) -> None:
    """``tensors`` as one safetensors file laid out by ``layout`` (`_safetensors_layout`),
    each written from its own memory a piece at a time (`_pieces`: at most
    `_WRITE_CHUNK` bytes copied at once, and only of a tensor that is not contiguous), so
    that tensors that share memory are written each in full without ever being held in
    full, and a view claiming terabytes costs one piece of memory; ``bar`` hears of every
    piece written."""
    with open(tmp, "wb") as f:
        f.write(layout.header)
        bar.add(len(layout.header))
        for t in tensors.values():
            for piece in _pieces(t.detach().cpu()):
                bar.add(f.write(piece.numpy().data))


def _largest(sizes: Iterable[tuple[str, int, int]]) -> tuple[str, int, int] | None:
    """Of ``(name, full size, bytes of memory it covers)``, the one of the largest full
    size (``None``: none)."""
    return max(sizes, key=lambda item: item[1], default=None)


def _sizes(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, int, int]]:
    """Each tensor's name, full size and the bytes of storage it covers (less than its
    size for a view with zero or overlapping strides)."""
    for name, t in named:
        covered = (
            0 if t.numel() == 0 else sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1
        )
        yield name, t.numel() * t.element_size(), covered * t.element_size()


def _what(largest: tuple[str, int, int] | None) -> str:
    """What ``convert``'s refusal says of the largest tensor (`_largest`)."""
    if largest is None:
        return ""
    name, size, covered = largest
    held = f", a view of {human(covered)} of stored data" if covered < size else ""
    return f"the largest is {printable(name)!r}: {human(size)}{held}"


def _check_room(out: str, needed: int, largest: tuple[str, int, int] | None) -> None:
    """`DiskFullError` when the file system of ``out`` has less free space than the
    ``needed`` bytes of the file ``convert`` would write (checked before anything is
    written: a view of a few bytes may claim terabytes, written in full)."""
    from .._commit import check_room

    check_room(os.path.dirname(out), needed, "convert", out, _what(largest) or "no tensor")


_PICKLED_ARRAY_COPIES = 6
"""Bytes of memory ``torch.save`` takes per byte of the numpy arrays it saves, at its peak
(measured, torch 2.x: the array's elements as bytes, the pickle's buffer as it grows, and
the copy of it written out), all at once, however little memory a view of a base shares."""


def _check_torch_save(out: str, state: object, path: str) -> None:
    """``torch.save`` of ``state`` checked before it starts: its size (each storage once,
    as ``torch.save`` writes it, and each numpy array in full) against the free space of
    ``out``'s file system, and the memory that pickling its numpy arrays takes
    (`_PICKLED_ARRAY_COPIES`) against the memory available."""
    import numpy as np
    import torch

    from .._load import _check_memory

    storages: dict[int, tuple[str, int, int]] = {}
    arrays: list[tuple[str, int, int]] = []
    for parts, leaf in _leaves(state, []):
        if isinstance(leaf, torch.Tensor):
            nbytes = leaf.untyped_storage().nbytes()
            storages[leaf.untyped_storage().data_ptr()] = (".".join(parts) or "tensor", nbytes, nbytes)
        elif isinstance(leaf, np.ndarray):
            last = sum((n - 1) * s for n, s in zip(leaf.shape, leaf.strides, strict=True))
            arrays.append(
                (".".join(parts) or "array", leaf.nbytes, 0 if leaf.size == 0 else last + leaf.itemsize)
            )
    array_bytes = sum(size for _, size, _ in arrays)
    largest = _largest(arrays)
    _check_memory(
        _PICKLED_ARRAY_COPIES * array_bytes,
        path,
        f"converting it to a torch.save file, which pickles its numpy arrays whole ({_what(largest)}),",
    )
    written = [*storages.values(), *arrays]
    _check_room(out, sum(size for _, size, _ in written), _largest(written))


class _CountingFile:
    """A binary file for ``torch.save`` that tells ``bar`` of every write."""

    def __init__(self, f: Any, bar: Progress) -> None:
        self._f = f
        self._bar = bar

    def write(self, data: Any) -> int:
        n = int(self._f.write(data))
        self._bar.add(n)
        return n

    def flush(self) -> None:
        self._f.flush()


def _fsync_path(path: str, *, directory: bool = False) -> None:
    fd = os.open(path, (os.O_RDONLY | os.O_DIRECTORY) if directory else os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(out: str, write: Callable[[str], None]) -> None:
    """``write(tmp)`` to a temporary file beside ``out``, fsync it, rename it to ``out``
    and fsync the directory: ``out`` is either the old file or the complete new one."""
    from .._names import TMP_MARKER, beside

    directory = os.path.dirname(out)
    tmp = beside(out, TMP_MARKER, str(os.getpid()))
    try:
        write(tmp)
        # The mode a new file gets here (some writers create theirs 0600).
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
        _fsync_path(tmp)
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_path(directory, directory=True)


def _convert(args: argparse.Namespace) -> int:
    from .._load import load

    out = os.path.abspath(args.out)
    if os.path.lexists(out) and not args.force:
        print(f"aiopersist: error: {out} exists; pass --force to replace it", file=sys.stderr)
        return 1
    if not os.path.isdir(os.path.dirname(out)):
        print(f"aiopersist: error: {os.path.dirname(out)}: no such directory", file=sys.stderr)
        return 1
    try:
        state = asyncio.run(load(args.path, backend=args.backend))
    except UnsupportedStateError as exc:  # pickled objects, which the command line never unpickles
        print(f"aiopersist: error: {args.path}: cannot convert: {exc}", file=sys.stderr)
        return 1
    if args.to == "safetensors":
        tensors, arrays, others = _named_tensors(state)
        if not tensors:
            print(f"aiopersist: error: {args.path} holds no tensors: nothing to convert", file=sys.stderr)
            return 1
        layout = _safetensors_layout(tensors)
        _check_room(out, layout.file_bytes, _largest(_sizes(tensors.items())))
        with Progress("convert", layout.file_bytes) as bar:
            _publish(out, lambda tmp: _write_safetensors(tmp, layout, tensors, bar))
        print(f"wrote {out}: safetensors, {_plural(len(tensors), 'tensor')}, {human(os.path.getsize(out))}")
        if arrays:
            print(f"note: numpy arrays stored as tensors: {arrays}")
        if others:
            print(f"note: values left out (not tensors: numbers, strings, ...): {others}")
    else:
        import torch

        _check_torch_save(out, state, args.path)

        def write(tmp: str) -> None:
            with open(tmp, "wb") as f:
                torch.save(state, cast(Any, _CountingFile(f, bar)))

        with Progress("convert") as bar:
            _publish(out, write)
        print(f"wrote {out}: torch.save, {human(os.path.getsize(out))}")
        import numpy as np

        arrays = sum(1 for _, leaf in _leaves(state, []) if isinstance(leaf, np.ndarray))
        if arrays:
            print(
                f"note: numpy arrays kept as numpy arrays: {arrays}; torch.load(weights_only=True) "
                "refuses them unless allowlisted (torch.serialization.safe_globals)"
            )
    return 0


def _version() -> str:
    import aiopersist

    return aiopersist.__version__


def _positive(text: str) -> int:
    """An argument that must be a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


class MissingPathError(Exception):
    """A path given on the command line does not exist (exit status 1, one line)."""


def _existing_directories(paths: Sequence[str]) -> list[str]:
    out = [os.path.abspath(p) for p in paths]
    for p in out:
        if not os.path.isdir(p):
            raise MissingPathError(f"{p}: {'not a directory' if os.path.lexists(p) else 'no such directory'}")
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aiopersist", description="Fast, asynchronous, crash-safe checkpoints."
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log what the engine decides; tracebacks on errors"
    )
    parser.add_argument("--version", action="version", version=f"aiopersist {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    doctor = sub.add_parser(
        "doctor", help="what this machine supports: io_uring, O_DIRECT, alignment, backend"
    )
    doctor.add_argument("path", nargs="?", default=".", help="directory to probe for O_DIRECT (default: .)")
    doctor.set_defaults(func=_doctor)

    demo = sub.add_parser("demo", help="save and load a generated state with each backend; print throughput")
    demo.add_argument("--dir", help="where to write (default: a temporary directory)")
    demo.add_argument("--size-mib", type=int, default=1024, help="approximate state size (default: 1024)")
    demo.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: 3)")
    demo.add_argument("--keep", action="store_true", help="keep the checkpoints")
    demo.set_defaults(func=_demo)

    trainer = sub.add_parser(
        "demo-trainer",
        help="the HF Trainer with AioPersistCallback: overhead, and a resume after kill -9",
    )
    trainer.add_argument("--dir", default=".demo-data/trainer", help="where the runs go (emptied first)")
    trainer.add_argument("--steps", type=int, default=20, help="training steps per run (default: 20)")
    trainer.add_argument("--every", type=int, default=5, help="checkpoint every N steps (default: 5)")
    trainer.add_argument("--rounds", type=int, default=4, help="interleaved rounds (default: 4)")
    trainer.add_argument("--layers", type=int, default=4, help="the GPT-2's layers (default: 4)")
    trainer.add_argument("--width", type=int, default=384, help="its width, n_embd (default: 384)")
    trainer.add_argument("--plot", metavar="FILE.png", help="also draw the step times and overheads")
    trainer.set_defaults(func=_demo_trainer)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    raw = bench_sub.add_parser("raw", help="sequential write/read: io_uring, threads, buffered, against fio")
    raw.add_argument("--dir", default="bench-data", help="scratch directory on the disk to measure")
    raw.add_argument("--size-gib", type=float, default=2.0, help="file size per method (default: 2)")
    raw.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: 3)")
    raw.add_argument("--chunk-mib", type=int, help="request size in MiB (default: the staging buffer size)")
    raw.add_argument("--buffers", type=int, help="staging buffers, i.e. requests in flight")
    raw.set_defaults(func=_bench_raw)
    for kind, peers in (
        ("save", "fio write, torch.save+fsync, safetensors, dcp"),
        ("load", "fio read, torch.load, safetensors, dcp"),
    ):
        ck = bench_sub.add_parser(
            kind, help=f"checkpoint {kind} of a transformer-shaped state against {peers}"
        )
        ck.add_argument("--dir", default="bench-data", help="scratch directory on the disk to measure")
        ck.add_argument("--size-gib", type=float, default=2.0, help="state size (default: 2)")
        ck.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: 3)")
        ck.add_argument("--methods", help="comma-separated subset of the methods")
        ck.add_argument("--json", action="store_true", help="print the report as JSON")
        ck.add_argument("--plot", metavar="FILE.png", help="also draw a bar chart")
        ck.add_argument(
            "--state",
            choices=("transformer", "small"),
            default="transformer",
            help="transformer-shaped (default) or small: 4 KiB tensors (51,200 in 200 MiB)",
        )
        if kind == "save":
            ck.add_argument(
                "--ranks", type=int, default=1, help="ranks saving together (gloo), against 1 rank x 1 dir"
            )
            ck.add_argument("--dirs", type=int, default=1, help="directories (SSDs) the save is spread over")
        ck.set_defaults(func=_bench_ckpt)
    dcpb = bench_sub.add_parser(
        "dcp", help="torch.distributed.checkpoint.save on several ranks: FileSystemWriter, aiopersist, fio"
    )
    dcpb.add_argument("--dir", default="bench-data", help="scratch directory on the disk to measure")
    dcpb.add_argument("--size-gib", type=float, default=2.0, help="state size over all ranks (default: 2)")
    dcpb.add_argument("--ranks", type=int, default=2, help="ranks saving together, gloo (default: 2)")
    dcpb.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: 3)")
    dcpb.add_argument(
        "--methods", default="fs-t1,fs-t2,fs-t4,aiopersist,fio", help="comma-separated subset of the methods"
    )
    dcpb.set_defaults(func=_bench_dcp)
    train = bench_sub.add_parser("train", help="a training loop checkpointing every step: overhead per mode")
    train.add_argument("--dir", default="bench-data", help="where the checkpoints go")
    train.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: 3)")
    train.add_argument("--steps", type=int, default=6, help="steps per mode and round (default: 6)")
    train.add_argument("--batch", type=int, help="batch size (default: calibrated to the save time)")
    train.add_argument("--hidden", type=int, default=2048, help="MLP width (default: 2048)")
    train.add_argument("--layers", type=int, default=12, help="MLP depth (default: 12; ~50M parameters)")
    train.add_argument("--torch-threads", type=int, help="torch.set_num_threads for the training loop")
    train.add_argument(
        "--modes",
        default="none,torch.save,fio,fence,snapshot",
        help="comma-separated modes; 'none' is the baseline (default: all but dcp and dcp-aiopersist)",
    )
    train.add_argument("--plot", metavar="FILE.png", help="also draw the overheads and blocked times")
    train.set_defaults(func=_bench_train)
    gpu = bench_sub.add_parser(
        "gpu", help="a ~1B-parameter GPT training on the GPU, checkpointing every step and every 10"
    )
    gpu.add_argument("--dir", default="bench-data", help="where the checkpoints go (the disk measured)")
    gpu.add_argument("--params", type=float, default=1.0e9, help="model size in parameters (default: 1e9)")
    gpu.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch (default: 4)")
    gpu.add_argument("--rounds", type=int, default=2, help="interleaved rounds, at most (default: 2)")
    gpu.add_argument("--every", default="1,10", help="checkpoint cadences in steps (default: 1,10)")
    gpu.add_argument(
        "--modes",
        default="none,fence,snapshot,dcp,torch.save",
        help="comma-separated modes; 'none' is the baseline (default: all)",
    )
    gpu.add_argument("--budget-s", type=float, help="seconds the benchmark may take: fewer rounds if needed")
    gpu.add_argument("--dry-run", action="store_true", help="rehearse on the CPU with a tiny model")
    gpu.add_argument("--json", help="also write the figures as JSON here")
    gpu.add_argument("--markdown", help="also write the report as markdown here")
    gpu.set_defaults(func=_bench_gpu)

    backends = ("auto", "io_uring", "threads")
    inspect = sub.add_parser(
        "inspect", help="list a checkpoint's files and tensors (reads the manifest or headers only)"
    )
    inspect.add_argument(
        "path", help="checkpoint directory, Hugging Face model directory or .safetensors file"
    )
    inspect.add_argument("--json", action="store_true", help="print a JSON document instead of text")
    inspect.add_argument("--backend", choices=backends, default="auto", help="I/O backend (default: auto)")
    inspect.set_defaults(func=_inspect)

    verify = sub.add_parser("verify", help="check every file's size and checksum; exit 1 if corrupt")
    verify.add_argument(
        "path", help="checkpoint directory, Hugging Face model directory or .safetensors file"
    )
    verify.add_argument("--backend", choices=backends, default="auto", help="I/O backend (default: auto)")
    verify.set_defaults(func=_verify)

    ls = sub.add_parser(
        "ls", help="the step-N of a CheckpointManager directory, the checkpoint-N of a Trainer's output_dir"
    )
    ls.add_argument(
        "dir",
        nargs="+",
        help="the manager's directory (its other disks' after it), or a Trainer's output_dir",
    )
    ls.add_argument("--mirror", help="its mirror too")
    ls.add_argument("--json", action="store_true", help="print a JSON document instead of text")
    ls.set_defaults(func=_ls)

    gc = sub.add_parser(
        "gc",
        help="retention in a CheckpointManager directory or a Trainer's output_dir (dry run by default)",
    )
    gc.add_argument(
        "dir",
        nargs="+",
        help="the manager's directory (its other disks' after it), or a Trainer's output_dir",
    )
    gc.add_argument(
        "--keep-last",
        type=_positive,
        help="keep the newest N complete steps; in a Trainer's output_dir, as save_total_limit=N, the best "
        "one counted (without it: retention is not applied)",
    )
    gc.add_argument("--keep-every", type=_positive, help="and every step divisible by K")
    gc.add_argument(
        "--leftovers",
        action="store_true",
        help="also remove leftovers of interrupted saves (not while a save runs)",
    )
    gc.add_argument("--apply", action="store_true", help="delete; without it, only print what would go")
    gc.set_defaults(func=_gc)

    convert = sub.add_parser(
        "convert", help="write a checkpoint as one safetensors file or a torch.save file"
    )
    convert.add_argument(
        "path", help="checkpoint directory, Hugging Face model directory or .safetensors file"
    )
    convert.add_argument("--to", choices=("safetensors", "torch"), required=True, help="output format")
    convert.add_argument("out", help="the file to write")
    convert.add_argument("--force", action="store_true", help="replace OUT if it exists")
    convert.add_argument("--backend", choices=backends, default="auto", help="I/O backend (default: auto)")
    convert.set_defaults(func=_convert)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return int(args.func(args))
    except (AiopersistError, OSError, ValueError, RuntimeError, MissingPathError) as exc:
        if args.verbose:
            traceback.print_exc()
        print(f"aiopersist: error: {printable(str(exc))}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
