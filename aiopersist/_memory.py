"""How much host memory this process may still allocate (Linux; read, never assumed).

A load allocates every tensor it returns before it reads and checks a byte (the reads go
straight into them), so a checkpoint that claims more than the machine has (a sparse
file of a few blocks that says it holds terabytes) would be killed by the kernel's OOM
killer rather than refused. `available_bytes` is what a load compares its allocation
with first. It is generous, since a wrong refusal stops a load that would have worked:
``MemAvailable`` plus free swap, and no more than the memory cgroup this process runs
in still allows (its limit less its usage, page cache counted as free, plus free swap),
at every level of the cgroup hierarchy that can be read.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

_PROC_MEMINFO = "/proc/meminfo"
_PROC_CGROUP = "/proc/self/cgroup"
_CGROUP_ROOT = "/sys/fs/cgroup"


def available_bytes() -> int | None:
    """The bytes of host memory this process may still allocate; ``None`` where nothing
    can be read (not Linux)."""
    swap = 0
    found: list[int] = []
    meminfo = _meminfo()
    if "MemAvailable" in meminfo:
        swap = meminfo.get("SwapFree", 0)
        found.append(meminfo["MemAvailable"] + swap)
    room = _cgroup_room()
    if room is not None:
        found.append(room + swap)
    return min(found) if found else None


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(_PROC_MEMINFO) as f:
            for line in f:
                key, _, rest = line.partition(":")
                fields = rest.split()
                if fields and fields[0].isdigit():
                    out[key] = int(fields[0]) * (1024 if fields[1:2] == ["kB"] else 1)
    except OSError:
        pass
    return out


def _cgroup_room() -> int | None:
    """The least memory any memory cgroup above this process still allows; ``None`` where
    there is no limit or none can be read."""
    try:
        with open(_PROC_CGROUP) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    rooms: list[int] = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        hierarchy, controllers, path = fields
        if hierarchy == "0" and not controllers:  # cgroup v2
            base, names = _CGROUP_ROOT, ("memory.max", "memory.current", "file")
        elif "memory" in controllers.split(","):  # cgroup v1
            base = os.path.join(_CGROUP_ROOT, "memory")
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_cache")
        else:
            continue
        for directory in _up_from(base, path):
            room = _room(directory, *names)
            if room is not None:
                rooms.append(room)
    return min(rooms) if rooms else None


def _up_from(base: str, path: str) -> Iterator[str]:
    """The cgroup directories from ``path`` up to the hierarchy's root, those that exist
    (a cgroup namespace shows its own root at ``base``)."""
    parts = [p for p in path.split("/") if p]
    for i in range(len(parts), -1, -1):
        directory = os.path.join(base, *parts[:i])
        if os.path.isdir(directory):
            yield directory


def _room(directory: str, limit_name: str, usage_name: str, cache_key: str) -> int | None:
    """What the cgroup at ``directory`` still allows: its limit less its usage, plus its
    page cache (``cache_key`` in ``memory.stat``), which the kernel drops before it fails
    an allocation; ``None`` without a limit."""
    limit = _read_int(os.path.join(directory, limit_name))
    usage = _read_int(os.path.join(directory, usage_name))
    if limit is None or usage is None:
        return None
    cache = 0
    try:
        with open(os.path.join(directory, "memory.stat")) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == cache_key and value.strip().isdigit():
                    cache = int(value)
    except OSError:
        pass
    return max(0, limit - usage) + min(cache, usage)


def _read_int(path: str) -> int | None:
    """An integer file of the cgroup file system; ``None`` for ``max`` (no limit) or one
    that cannot be read."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
