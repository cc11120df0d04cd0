"""The optional compiled part: a cffi binding to the system liburing.

``has_liburing`` says whether the compiled module is importable (and not switched off with
``AIOPERSIST_NATIVE=0``); ``unavailable_reason`` says why not. Only `binding` touches
``ffi``/``lib``; everything above it calls the functions there.
"""

from __future__ import annotations

from .. import _knobs

has_liburing: bool
unavailable_reason: str | None

if not _knobs.native_enabled():
    has_liburing = False
    unavailable_reason = "the native module is switched off (AIOPERSIST_NATIVE=0)"
else:
    try:
        from . import _liburing  # noqa: F401
    except ImportError as exc:
        has_liburing = False
        unavailable_reason = (
            f"the native io_uring module is not built ({exc}); install liburing-dev and reinstall aiopersist"
        )
    else:
        has_liburing = True
        unavailable_reason = None

__all__ = ["has_liburing", "unavailable_reason"]
