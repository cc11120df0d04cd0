"""The JSON skeleton of a saved object (pure): its markers, their validation, and the
walkers over it.

A skeleton is the saved object with every tensor replaced by a reference, as strict
JSON. Special values are dicts whose first key is a marker:

| marker | meaning |
| --- | --- |
| ``{"__tensor__": name}`` | a tensor (stored, alias or view) |
| ``{"__ndarray__": name}`` | a numpy array, stored as a tensor |
| ``{"__npscalar__": name}`` | a numpy scalar, stored as a 0-d tensor |
| ``{"__tuple__": [...]}`` | a tuple (``torch.Size`` too) |
| ``{"__dict__": [[k, v], ...]}`` | a dict whose keys are not all plain strings |
| ``{"__float__": "nan"}`` | a non-finite float (``nan``, ``inf``, ``-inf``) |
| ``{"__bytes__": base64}`` | bytes |
| ``{"__module__": cls, "state": ...}`` | an ``nn.Module``, by its state dict |
| ``{"__stateful__": cls, "state": ...}`` | anything with ``state_dict``/``load_state_dict`` |
| ``{"__pickle__": i}`` | the i-th pickled object |

A skeleton read from disk is untrusted: `check_skeleton` validates every marker and the
nesting depth (iteratively) before anything walks it recursively.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ._exceptions import AiopersistError, CheckpointCorruptError

MARKERS = (
    "__tensor__",
    "__ndarray__",
    "__npscalar__",
    "__tuple__",
    "__dict__",
    "__float__",
    "__bytes__",
    "__module__",
    "__stateful__",
    "__pickle__",
)
REF_MARKERS = ("__tensor__", "__ndarray__", "__npscalar__")

MAX_CONTAINER_DEPTH = 64
"""Most containers nested in one another that a save stores (``flatten`` refuses deeper
objects, naming the path); far beyond any training state."""

MAX_SKELETON_DEPTH = 3 * MAX_CONTAINER_DEPTH + 8
"""Most JSON levels a skeleton read from disk may nest (a dict with non-string keys takes
three levels per container). Deeper means damaged or hostile: refused before any
recursive walk could overflow the stack."""

_FLOATS = ("nan", "inf", "-inf")


_MARKER_SET = frozenset(MARKERS)


def _marker(node: dict[str, Any]) -> str | None:
    first = next(iter(node), None)
    return first if first in _MARKER_SET else None


_Trail = tuple[Any, ...] | None
"""Where a node is, as a linked list ``(parent_trail, step)``: a path string is only made
for an error (a skeleton can hold a million nodes)."""


class _Field(str):
    """A step into a marker (``.state``, ``.key``, ``.value``), not a key of the data."""


_STATE, _KEY, _VALUE = _Field("state"), _Field("key"), _Field("value")


def _path(trail: _Trail) -> str:
    steps: list[str] = []
    while trail is not None:
        trail, step = trail
        steps.append(f".{step}" if isinstance(step, _Field) else f"[{step!r}]")
    return "skeleton" + "".join(reversed(steps))


def _bad(where: str, trail: _Trail, marker: str, why: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"{where}: {_path(trail)}: bad {marker} entry ({why})")


def check_skeleton(skeleton: Any, where: str, known: Callable[[str], bool]) -> list[str]:
    """Validate a skeleton read from disk; return the tensor names it refers to, in order.

    Every marker must have its exact form, every tensor reference must satisfy ``known``,
    and nothing may nest deeper than `MAX_SKELETON_DEPTH`. Walks iteratively, so a
    hostile depth cannot exhaust the stack. Raises `CheckpointCorruptError` naming the
    place in the skeleton.
    """
    found: list[str] = []
    stack: list[tuple[Any, _Trail, int]] = [(skeleton, None, 0)]
    while stack:
        node, trail, depth = stack.pop()
        if depth > MAX_SKELETON_DEPTH:
            raise CheckpointCorruptError(
                f"{where}: {_path(trail)}: nested deeper than {MAX_SKELETON_DEPTH} levels "
                "(damaged or hostile)"
            )
        if isinstance(node, list):
            stack.extend((v, (trail, i), depth + 1) for i, v in reversed(list(enumerate(node))))
            continue
        if not isinstance(node, dict):
            continue
        first = next(iter(node), None)
        if first not in _MARKER_SET:
            stack.extend((v, (trail, k), depth + 1) for k, v in reversed(list(node.items())))
            continue
        marker = first
        value = node[marker]
        if marker in REF_MARKERS and len(node) == 1 and isinstance(value, str) and known(value):
            found.append(value)  # the common case, first
            continue
        if marker in ("__module__", "__stateful__"):
            if len(node) != 2 or "state" not in node or not isinstance(value, str):
                raise _bad(where, trail, marker, "needs a class name and a state")
            stack.append((node["state"], (trail, _STATE), depth + 1))
            continue
        if len(node) != 1:
            raise _bad(where, trail, marker, f"{len(node)} keys, expected 1")
        if marker in REF_MARKERS:
            raise _bad(where, trail, marker, f"refers to unknown tensor {value!r}")
        if marker == "__tuple__":
            if not isinstance(value, list):
                raise _bad(where, trail, marker, "not a list")
            stack.extend((v, (trail, i), depth + 1) for i, v in reversed(list(enumerate(value))))
        elif marker == "__dict__":
            if not isinstance(value, list) or not all(isinstance(p, list) and len(p) == 2 for p in value):
                raise _bad(where, trail, marker, "not a list of [key, value] pairs")
            for i, (k, v) in reversed(list(enumerate(value))):
                stack.append((v, ((trail, i), _VALUE), depth + 2))
                stack.append((k, ((trail, i), _KEY), depth + 2))
        elif marker == "__float__":
            if value not in _FLOATS:
                raise _bad(where, trail, marker, f"{value!r} is not one of {', '.join(_FLOATS)}")
        elif marker == "__bytes__":
            if not isinstance(value, str):
                raise _bad(where, trail, marker, "not base64 text")
        elif marker == "__pickle__" and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise _bad(where, trail, marker, f"{value!r} is not a non-negative integer")
    return found


def refs(skeleton: Any) -> list[tuple[str, str]]:
    """The tensor references of a (validated or self-made) skeleton, in order: each as
    ``(name, marker)``."""
    out: list[tuple[str, str]] = []
    stack = [skeleton]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(reversed(node))
        elif isinstance(node, dict):
            marker = _marker(node)
            if marker in REF_MARKERS:
                out.append((node[marker], marker))
            elif marker == "__dict__":
                stack.extend(reversed([x for pair in node[marker] for x in pair]))
            elif marker == "__tuple__":
                stack.extend(reversed(node[marker]))
            elif marker in ("__module__", "__stateful__"):
                stack.append(node["state"])
            elif marker is None:
                stack.extend(reversed(list(node.values())))
    return out


def rename_refs(node: Any, names: Mapping[str, str]) -> Any:
    """The skeleton with every tensor reference in ``names`` renamed (a skeleton of our
    own making: its depth is bounded by ``flatten``)."""
    if isinstance(node, list):
        return [rename_refs(v, names) for v in node]
    if not isinstance(node, dict):
        return node
    if len(node) == 1 and next(iter(node)) in REF_MARKERS:
        key, value = next(iter(node.items()))
        return {key: names.get(value, value)}
    return {k: rename_refs(v, names) for k, v in node.items()}


def decode(
    node: Any,
    tensor: Callable[[str], torch.Tensor],
    pickled: Callable[[int], object],
) -> Any:
    """Rebuild an object from its (validated) skeleton; ``tensor(name)`` resolves stored
    tensors, ``pickled(i)`` the pickled objects."""
    if isinstance(node, list):
        return [decode(v, tensor, pickled) for v in node]
    if not isinstance(node, dict):
        return node
    marker = _marker(node)
    if marker is not None:
        return _decode_marker(marker, node, tensor, pickled)
    return {k: decode(v, tensor, pickled) for k, v in node.items()}


def _decode_marker(
    marker: str, node: dict[str, Any], tensor: Callable[[str], torch.Tensor], pickled: Callable[[int], object]
) -> Any:
    value = node[marker]
    try:
        if marker == "__tensor__":
            return tensor(value)
        if marker == "__ndarray__":
            return tensor(value).cpu().numpy()
        if marker == "__npscalar__":
            return tensor(value).cpu().numpy()[()]
        if marker == "__tuple__":
            return tuple(decode(v, tensor, pickled) for v in value)
        if marker == "__dict__":
            return {_key(decode(k, tensor, pickled)): decode(v, tensor, pickled) for k, v in value}
        if marker == "__float__":
            if value not in _FLOATS:
                raise ValueError(value)
            return float(value)
        if marker == "__bytes__":
            return base64.b64decode(value, validate=True)
        if marker in ("__module__", "__stateful__"):
            return decode(node["state"], tensor, pickled)
        if marker == "__pickle__":
            return pickled(int(value))
    except AiopersistError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointCorruptError(f"manifest skeleton: bad {marker} entry: {exc}") from exc
    raise AssertionError(marker)  # pragma: no cover


def _key(key: Any) -> Any:
    if isinstance(key, list | dict):
        raise ValueError(f"unhashable dict key {key!r}")
    return key
