"""The ``aiopersist`` command: doctor, inspect, verify, ls, gc, convert, bench, demo.

The command lives in `main`; the benchmarks and demos it runs in `aiopersist._bench`.
"""

from .main import main as main
