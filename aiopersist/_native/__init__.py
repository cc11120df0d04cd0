"""The optional compiled part: a cffi binding to the system liburing.

``has_liburing`` says whether the compiled module is importable (and not switched off with
``AIOPERSIST_NATIVE=0``). When it is not, ``unavailable`` says why, classified where the
import failed (`status.classify_import_error`: never built, built for another Python,
``liburing.so`` missing at run time, ...), and ``unavailable_reason`` is that as one
sentence. Only `binding` touches ``ffi``/``lib``; everything above it calls the functions there.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from .. import _knobs
from .status import UringUnavailable, classify_import_error, switched_off

has_liburing: bool
unavailable: UringUnavailable | None
unavailable_reason: str | None


def _import_compiled() -> UringUnavailable | None:
    # import_module, not ``from . import _liburing``: inside this package's own
    # initialisation the latter turns "no such module" into a misleading "cannot import
    # name ... (most likely due to a circular import)" and loses which module was missing.
    qualname = f"{__name__}._liburing"
    try:
        importlib.import_module(qualname)
    except ImportError as exc:
        return classify_import_error(exc, Path(__file__).parent, qualname)
    return None


unavailable = _import_compiled() if _knobs.native_enabled() else switched_off()
has_liburing = unavailable is None
unavailable_reason = None if unavailable is None else str(unavailable)

__all__ = ["has_liburing", "unavailable", "unavailable_reason"]
