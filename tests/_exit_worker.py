"""``python -m tests._exit_worker SCENARIO RANK WORLD PORT DIR BACKEND``: a rank of
`tests._dist_worker` that also reports, into ``DIR/exit-RANK.json``, the gloo threads still
running once every exit handler but this one has run.

Its handler is registered before aiopersist is imported, so it runs after aiopersist's
own (exit handlers run last registered, first run): what it sees is what interpreter
shutdown would start from.
"""

from __future__ import annotations

import atexit
import json
import os
import sys


def _report() -> None:
    from tests._dist_worker import gloo_threads

    rank, base = sys.argv[2], sys.argv[5]
    with open(os.path.join(base, f"exit-{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(gloo_threads(), f)


atexit.register(_report)

from tests._dist_worker import main  # noqa: E402  (after the handler, on purpose)

if __name__ == "__main__":
    main()
