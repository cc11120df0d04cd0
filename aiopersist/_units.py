"""Byte counts as people read them, in the messages of errors and of the command."""

from __future__ import annotations


def human(n: int) -> str:
    """A byte count for people: ``17 B``, ``512 KiB``, ``1.9 GiB`` (binary units; one
    decimal unless the count is a whole number of the unit)."""
    if n < 1024:
        return f"{n} B"
    for power, unit in enumerate(("KiB", "MiB", "GiB", "TiB", "PiB"), start=1):
        scale = 1 << (10 * power)
        if round(n / scale, 1) < 1024 or unit == "PiB":
            return f"{n // scale} {unit}" if n % scale == 0 else f"{n / scale:.1f} {unit}"
    raise AssertionError("unreachable")
