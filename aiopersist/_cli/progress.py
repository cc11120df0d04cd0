"""A progress line for the command's long work (verify, convert, gc), on stderr, drawn
only when stderr is a terminal: a pipe, a file or a test sees nothing.

The figures are what the work reports as it goes (bytes checked, written, deleted), never
a clock's guess. The line is redrawn in place with a carriage return, at most
`Progress.interval` apart, and ended with a newline when the work is done (or failed),
so that what is printed next starts on a line of its own.
"""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType
from typing import TextIO

from .._units import human as human  # the command prints sizes with it too


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):  # closed, or not a real stream
        return False


class Progress:
    """``label: 1.2 GiB / 1.9 GiB (63%), 850.3 MiB/s`` on ``stream`` (stderr by default),
    redrawn as `update` or `add` report work done; ``total`` may be unknown (``None``)
    or given later. Nothing is written unless ``stream`` is a terminal. Safe to call from
    several threads. Use as a context manager: `close` ends the line."""

    interval = 0.1
    """Seconds between two redraws, at least (the last one is always drawn)."""

    def __init__(self, label: str, total: int | None = None, *, stream: TextIO | None = None) -> None:
        self.label = label
        self.total = total
        self.done = 0
        self.note = ""
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = _is_terminal(self.stream)
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._drawn_at: float | None = None
        self._drawn_done = -1
        self._width = 0
        self._closed = False

    def update(self, done: int, total: int | None = None, *, note: str | None = None) -> None:
        """The work done so far (and its total, if now known): ``done`` bytes."""
        with self._lock:
            self.done = done
            if total is not None:
                self.total = total
            if note is not None:
                self.note = note
            self._maybe_draw()

    def add(self, n: int, *, note: str | None = None) -> None:
        """``n`` more bytes done."""
        with self._lock:
            self.done += n
            if note is not None:
                self.note = note
            self._maybe_draw()

    def line(self) -> str:
        """The text of the line as it stands."""
        parts = [human(self.done)]
        if self.total is not None:
            parts.append(f"/ {human(self.total)}")
            if self.total > 0:
                parts.append(f"({min(100, 100 * self.done // self.total)}%)")
        text = f"{self.label}: {' '.join(parts)}"
        elapsed = time.monotonic() - self._start
        if elapsed > 0 and self.done > 0:
            text += f", {human(int(self.done / elapsed))}/s"
        if self.note:
            text += f", {self.note}"
        return text

    def _maybe_draw(self) -> None:
        if not self.enabled or self._closed:
            return
        now = time.monotonic()
        finished = self.total is not None and self.done >= self.total
        if self._drawn_at is not None and now - self._drawn_at < self.interval and not finished:
            return
        self._draw()
        self._drawn_at = now

    def _draw(self) -> None:
        text = self.line()
        self._drawn_done = self.done
        pad = max(0, self._width - len(text))  # over what the longer line before left
        self._width = len(text)
        try:
            self.stream.write("\r" + text + " " * pad)
            self.stream.flush()
        except (OSError, ValueError):  # the terminal went away: the work goes on
            self.enabled = False

    def close(self) -> None:
        """Draw the last figures and end the line (nothing when nothing was reported)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if not self.enabled or (self._drawn_at is None and self.done == 0):
                return
            if self._drawn_done != self.done:
                self._draw()
            try:
                self.stream.write("\n")
                self.stream.flush()
            except (OSError, ValueError):
                pass

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
