"""Build glue for the optional native io_uring module.

Everything declarative lives in pyproject.toml. This file exists for one reason: the
cffi extension against the system liburing is *optional*. When ``<liburing.h>`` or
``liburing.so`` is missing, the build prints why and the package installs without the
native module (aiopersist then uses its ``threads`` backend; ``aiopersist doctor`` says so).
"""

from __future__ import annotations

import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

try:  # setuptools >= 59 vendors distutils; the error classes are the same objects
    from distutils.errors import CCompilerError, DistutilsError
except ImportError:  # pragma: no cover - Python without distutils shim
    from setuptools.errors import CCompilerError, DistutilsError  # type: ignore[no-redef]


def _skip(reason: BaseException) -> None:
    print(
        "aiopersist: building the native io_uring module failed; installing without it "
        f"(the threads backend will be used). Install liburing-dev to enable it. Reason: {reason}",
        file=sys.stderr,
    )


class OptionalBuildExt(build_ext):
    def run(self) -> None:
        try:
            super().run()
        except (CCompilerError, DistutilsError, OSError) as exc:
            _skip(exc)

    def build_extension(self, ext) -> None:  # type: ignore[no-untyped-def]
        try:
            super().build_extension(ext)
        except (CCompilerError, DistutilsError, OSError) as exc:
            _skip(exc)


setup(
    cffi_modules=["aiopersist/_native/_build_liburing.py:ffibuilder"],
    cmdclass={"build_ext": OptionalBuildExt},
)
