from __future__ import annotations

import sys

import aiopersist
from tests._launch import run


def test_all_is_complete_and_importable() -> None:
    public = {n for n in dir(aiopersist) if not n.startswith("_")}
    public.discard("annotations")
    public.discard("integrations")  # a subpackage, imported on its own (it pulls its framework)
    assert set(aiopersist.__all__) - {"__version__"} == public
    for name in aiopersist.__all__:
        assert getattr(aiopersist, name) is not None


def test_import_does_not_pull_integrations() -> None:
    code = "import sys, aiopersist; print(any(m in sys.modules for m in ('transformers', 'accelerate')))"
    out = run([sys.executable, "-c", code], text=True, check=True).stdout
    assert out.strip() == "False"


def test_every_error_shares_the_root() -> None:
    for name in aiopersist.__all__:
        obj = getattr(aiopersist, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, aiopersist.AiopersistError)


def test_the_trainer_integration_without_transformers_says_how_to_install_it() -> None:
    code = "import sys; sys.modules['transformers'] = None\nimport aiopersist.integrations.transformers"
    proc = run([sys.executable, "-c", code], text=True)
    assert proc.returncode == 1
    assert (
        "ModuleNotFoundError: aiopersist.integrations.transformers needs the transformers package"
        in proc.stderr
    )
    assert "pip install 'aiopersist[hf]'" in proc.stderr
