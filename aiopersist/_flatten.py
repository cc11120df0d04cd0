"""Flatten: the user's object to tensor entries plus a JSON skeleton, and back (pure).

Walking the object yields:

- the **skeleton**: the object with every tensor replaced by a reference to a stored
  tensor, encoded as strict JSON (see `encode`'s markers below);
- the **stored tensors**: what gets written, each under a unique name. Tensors that share
  storage are stored once: identical views become *aliases* of one stored tensor (tied
  weights), different views of one storage become *views* into one stored byte span;
- the **pickled** objects, only when the caller allowed pickle.

The skeleton's JSON markers are listed in `_skeleton`.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ._exceptions import CheckpointCorruptError, UnsupportedStateError
from ._format import dtype_from_name, supported_dtype, unwritable_shape
from ._skeleton import MAX_CONTAINER_DEPTH
from ._workers import gc_paused


@dataclass(frozen=True)
class StoredTensor:
    """A tensor written to a data file under ``name``; ``source`` holds its bytes."""

    name: str
    source: torch.Tensor
    """The tensor (or the byte span of a shared storage) whose bytes are written."""
    align: int = 0
    """Byte alignment its file offset needs: the element size, or for a span the largest
    element size of the views into it (so that they land aligned in memory on load)."""

    @property
    def alignment(self) -> int:
        return self.align or self.source.element_size()

    @property
    def nbytes(self) -> int:
        return self.source.numel() * self.source.element_size()


@dataclass(frozen=True)
class ViewSpec:
    """A tensor rebuilt as a strided view into a stored byte span."""

    base: str
    offset: int
    """Byte offset into the base span (a multiple of the dtype's size)."""
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass
class Flattened:
    """The result of `flatten`."""

    skeleton: Any
    stored: list[StoredTensor] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)
    """name -> name of the stored tensor it is identical to."""
    views: dict[str, ViewSpec] = field(default_factory=dict)
    pickled: list[object] = field(default_factory=list)
    pickled_paths: list[str] = field(default_factory=list)
    """Where each pickled object is in the saved object (for errors)."""
    model_only: bool = False
    """The object was a module or a flat mapping of names to tensors: a model's weights."""
    replicated: set[str] = field(default_factory=set)
    """Names of tensors known to be the same on every rank: inside a
    ``DistributedDataParallel`` module, or DTensors with a ``Replicate`` placement."""
    sharded: dict[str, tuple[tuple[int, ...], int]] = field(default_factory=dict)
    """Dim-0 shards (DTensors with a ``Shard(0)`` placement): name -> (the whole tensor's
    shape, the first row this rank holds). ``source`` is the local shard."""
    dtensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """The DTensors themselves, by name (their mesh and placements rebuild them on load)."""

    @property
    def tensor_bytes(self) -> int:
        return sum(s.nbytes for s in self.stored)


def _is_stateful(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _qualname(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _key_text(key: object) -> str:
    return f"[{key!r}]"


class _Walker:
    def __init__(self, allow_pickle: bool) -> None:
        self.allow_pickle = allow_pickle
        self.tensors: list[tuple[str, torch.Tensor]] = []  # (name, tensor) in walk order
        self.names: set[str] = set()
        self.pickled: list[object] = []
        self.pickled_paths: list[str] = []
        self.active: set[int] = set()
        self.replicated: set[str] = set()
        self.sharded: dict[str, tuple[tuple[int, ...], int]] = {}
        self.dtensors: dict[str, torch.Tensor] = {}
        self.in_ddp = 0

    def name_for(self, parts: list[str]) -> str:
        base = ".".join(parts) or "tensor"
        name, n = base, 1
        while name in self.names or name == "__metadata__":  # safetensors' reserved key
            n += 1
            name = f"{base}#{n}"
        self.names.add(name)
        return name

    def tensor(self, t: torch.Tensor, parts: list[str], where: str) -> str:
        shard: tuple[tuple[int, ...], int] | None = None
        replicated = self.in_ddp > 0
        dtensor = None
        if _is_dtensor(t):
            dtensor = t
            t, shard, replicated = _dtensor_local(t, where)
        if t.is_nested:
            raise UnsupportedStateError(f"{where}: nested tensors are not supported")
        if t.layout != torch.strided:
            raise UnsupportedStateError(f"{where}: {t.layout} tensors are not supported")
        if not (t.is_cpu or t.is_cuda):
            raise UnsupportedStateError(f"{where}: tensors on {t.device.type} are not supported")
        if not supported_dtype(t.dtype):
            raise UnsupportedStateError(f"{where}: dtype {t.dtype} has no safetensors equivalent")
        problem = unwritable_shape(t.shape)
        if problem is not None:
            raise UnsupportedStateError(f"{where}: {problem}")
        if t.numel() and not t.data_ptr():
            raise UnsupportedStateError(
                f"{where}: a {type(t).__name__} has no storage of its own (a wrapper tensor "
                "subclass): save the plain tensors it holds"
            )
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()
        name = self.name_for(parts)
        self.tensors.append((name, t.detach()))
        if dtensor is not None:
            self.dtensors[name] = dtensor
        if shard is not None:
            self.sharded[name] = shard
        elif replicated:
            self.replicated.add(name)
        return name

    def encode(self, obj: object, parts: list[str], where: str) -> Any:
        if isinstance(obj, torch.Tensor):
            return {"__tensor__": self.tensor(obj, parts, where)}
        if isinstance(obj, bool) or obj is None or type(obj) in (int, str):
            return obj
        if isinstance(obj, float):
            return obj if math.isfinite(obj) else {"__float__": repr(float(obj))}
        if isinstance(obj, int) and not isinstance(obj, np.generic):
            return int(obj)  # an int subclass (IntEnum): its value
        if isinstance(obj, bytes | bytearray):
            return {"__bytes__": base64.b64encode(bytes(obj)).decode("ascii")}
        if isinstance(obj, np.generic) and obj.dtype.kind in "biufc":
            # A numpy scalar (a metric, a step): kept as a 0-d array, so its dtype survives.
            return {"__npscalar__": self.tensor(torch.from_numpy(np.asarray(obj)), parts, where)}
        if isinstance(obj, np.ndarray):
            if obj.dtype.hasobject:
                return self.fallback(obj, where, "object arrays cannot be stored as tensors")
            try:
                t = torch.from_numpy(np.ascontiguousarray(obj))
            except TypeError as exc:
                return self.fallback(obj, where, f"numpy dtype {obj.dtype} has no tensor equivalent ({exc})")
            return {"__ndarray__": self.tensor(t, parts, where)}
        ident = id(obj)
        if isinstance(obj, Mapping | list | tuple | torch.nn.Module) or _is_stateful(obj):
            if ident in self.active:
                raise UnsupportedStateError(f"{where}: the object contains itself (a reference cycle)")
            if len(self.active) >= MAX_CONTAINER_DEPTH:
                raise UnsupportedStateError(
                    f"{where}: containers nested more than {MAX_CONTAINER_DEPTH} deep; "
                    "store such data flatter (or pickled inside a TorchSave extra file)"
                )
            self.active.add(ident)
            try:
                return self.container(obj, parts, where)
            finally:
                self.active.discard(ident)
        return self.fallback(obj, where, f"{_qualname(obj)} is not a tensor, container or JSON scalar")

    def container(self, obj: Any, parts: list[str], where: str) -> Any:
        if isinstance(obj, torch.nn.Module):
            ddp = isinstance(obj, torch.nn.parallel.DistributedDataParallel)
            self.in_ddp += ddp
            try:
                return {"__module__": _qualname(obj), "state": self.mapping(obj.state_dict(), parts, where)}
            finally:
                self.in_ddp -= ddp
        if isinstance(obj, Mapping):
            return self.mapping(obj, parts, where)
        if isinstance(obj, list):
            return [self.encode(v, [*parts, str(i)], f"{where}[{i}]") for i, v in enumerate(obj)]
        if type(obj) is tuple or isinstance(obj, torch.Size):
            items = [self.encode(v, [*parts, str(i)], f"{where}[{i}]") for i, v in enumerate(obj)]
            return {"__tuple__": items}
        if isinstance(obj, tuple):  # a namedtuple or other subclass: its type would be lost
            return self.fallback(obj, where, f"{_qualname(obj)} is a tuple subclass")
        return {"__stateful__": _qualname(obj), "state": self.encode(obj.state_dict(), parts, where)}

    def mapping(self, obj: Mapping[Any, Any], parts: list[str], where: str) -> Any:
        plain = all(type(k) is str and not k.startswith("__") for k in obj)
        if plain:
            return {k: self.encode(v, [*parts, k], f"{where}{_key_text(k)}") for k, v in obj.items()}
        pairs = []
        for k, v in obj.items():
            if not isinstance(k, str | int | float | tuple | type(None)):
                raise UnsupportedStateError(
                    f"{where}: dict key {k!r} of type {type(k).__name__} cannot be stored"
                )
            pairs.append(
                [
                    self.encode(k, parts, f"{where} (a key)"),
                    self.encode(v, [*parts, str(k)], f"{where}{_key_text(k)}"),
                ]
            )
        return {"__dict__": pairs}

    def fallback(self, obj: object, where: str, why: str) -> Any:
        if not self.allow_pickle:
            raise UnsupportedStateError(f"{where}: {why}; pass allow_pickle=True to store it with pickle")
        self.pickled.append(obj)
        self.pickled_paths.append(where)
        return {"__pickle__": len(self.pickled) - 1}


def _is_dtensor(t: torch.Tensor) -> bool:
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(t, DTensor)


def _dtensor_local(
    t: torch.Tensor, where: str
) -> tuple[torch.Tensor, tuple[tuple[int, ...], int] | None, bool]:
    """A DTensor's local tensor, its dim-0 shard (whole shape, first row) if sharded, and
    whether it is replicated."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    assert isinstance(t, DTensor)
    mesh, placements = t.device_mesh, t.placements
    local = t.to_local()
    if mesh.ndim != 1:
        raise UnsupportedStateError(
            f"{where}: a DTensor on a {mesh.ndim}-D device mesh; only 1-D meshes are supported "
            "(Shard(0) or Replicate)"
        )
    placement = placements[0]
    if placement.is_replicate():
        return local, None, True
    if placement.is_shard(dim=0):
        _, offset = compute_local_shape_and_global_offset(t.shape, mesh, placements)
        return local, (tuple(int(n) for n in t.shape), int(offset[0]) if offset else 0), False
    raise UnsupportedStateError(
        f"{where}: a DTensor placed as {placement}; only Shard(0) and Replicate are supported"
    )


def _view_key(t: torch.Tensor) -> tuple[object, ...]:
    return (t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _byte_extent(t: torch.Tensor) -> tuple[int, int]:
    """``[start, end)`` bytes of its storage that a view can touch."""
    size = t.element_size()
    start = int(t.storage_offset()) * size
    if t.numel() == 0:
        return start, start
    last = sum((int(n) - 1) * int(s) for n, s in zip(t.shape, t.stride(), strict=True))
    return start, start + (last + 1) * size


def _dedupe(walker: _Walker, flat: Flattened, *, materialize_views: bool) -> None:
    groups: dict[tuple[object, object], list[tuple[str, torch.Tensor]]] = {}  # in walk order
    for name, t in walker.tensors:
        storage = t.untyped_storage()
        # Empty tensors share no bytes with anything, whatever their data pointer says.
        empty = t.numel() == 0 or storage.nbytes() == 0
        key = ("empty", name) if empty else (t.get_device(), storage.data_ptr())
        groups.setdefault(key, []).append((name, t))
    for members in groups.values():
        if len(members) == 1:  # the common case: a storage of its own
            flat.stored.append(StoredTensor(*members[0]))
            continue
        distinct = {_view_key(t) for _, t in members}
        if len(distinct) == 1 or materialize_views:
            # Identical views (tied weights) are stored once; with materialize_views, each
            # distinct view is stored as a tensor of its own, as the Hugging Face layout
            # needs (a model's weights under their own names).
            firsts: dict[tuple[object, ...], str] = {}
            for name, t in members:
                first_name = firsts.setdefault(_view_key(t), name)
                if first_name == name:
                    flat.stored.append(StoredTensor(name, t))
                else:
                    flat.aliases[name] = first_name
            continue
        # Different views of one storage: store the bytes they cover once, rebuild each.
        extents = [_byte_extent(t) for _, t in members]
        span_start = min(s for s, _ in extents) // 16 * 16  # a multiple of every itemsize
        span_end = max(e for _, e in extents)
        storage = members[0][1].untyped_storage()
        span = torch.empty(0, dtype=torch.uint8).set_(storage, span_start, (span_end - span_start,), (1,))
        base = walker.name_for([f"__storage__{len(flat.stored)}"])
        flat.stored.append(StoredTensor(base, span, max(t.element_size() for _, t in members)))
        firsts = {}
        for (name, t), (start, _) in zip(members, extents, strict=True):
            first_name = firsts.setdefault(_view_key(t), name)
            if first_name != name:
                flat.aliases[name] = first_name  # the very same view: one object on load
                continue
            flat.views[name] = ViewSpec(base, start - span_start, t.dtype, tuple(t.shape), tuple(t.stride()))


def flatten(obj: object, *, allow_pickle: bool = False) -> Flattened:
    """Walk ``obj``; see the module docstring. Raises `UnsupportedStateError` naming the
    path (``state['optim']['param_groups'][0]['betas']``) of anything it cannot store."""
    with gc_paused():
        return _flatten(obj, allow_pickle)


def _flatten(obj: object, allow_pickle: bool) -> Flattened:
    walker = _Walker(allow_pickle)
    skeleton = walker.encode(obj, [], "state")
    model_only = isinstance(obj, torch.nn.Module) or (
        isinstance(obj, Mapping) and all(isinstance(v, torch.Tensor) for v in obj.values())
    )
    flat = Flattened(
        skeleton,
        pickled=walker.pickled,
        pickled_paths=walker.pickled_paths,
        model_only=model_only,
        replicated=walker.replicated,
        sharded=walker.sharded,
        dtensors=walker.dtensors,
    )
    _dedupe(walker, flat, materialize_views=model_only)
    return flat


# -- back -----------------------------------------------------------------------------------


def build_view(base: torch.Tensor, spec: ViewSpec) -> torch.Tensor:
    """The tensor ``spec`` describes, sharing ``base``'s (uint8) storage."""
    size = spec.dtype.itemsize
    if spec.offset % size:
        raise CheckpointCorruptError(f"view offset {spec.offset} is not a multiple of {size}")
    out = torch.empty(0, dtype=spec.dtype)
    byte_start = base.storage_offset() + spec.offset
    out.set_(base.untyped_storage(), byte_start // size, spec.shape, spec.stride)
    start, end = _byte_extent(out)
    if end > base.untyped_storage().nbytes() or start < 0:
        raise CheckpointCorruptError(f"view of {spec.base!r} reaches past its bytes")
    return out


def dtype_of(name: str) -> torch.dtype:
    try:
        return dtype_from_name(name)
    except KeyError:
        raise CheckpointCorruptError(f"unknown dtype {name!r}") from None
