"""The package's layers (docs/development.md draws them): data flows down, and no module
imports one of a layer above its own. Every module must have a layer: a new one fails
here until it is placed (and documented)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "aiopersist"

LAYERS: dict[str, tuple[str, ...]] = {
    # 0. Shared by all: errors, knobs, on-disk names, thread pools.
    "base": ("_exceptions", "_knobs", "_names", "_units", "_workers", "_rng"),
    # 1. Pure: no asyncio, no files. Untrusted input is validated here.
    "model": (
        "_format",
        "_skeleton",
        "_flatten",
        "_manifest",
        "_partition",
        "_plan",
        "_readplan",
        "_into",
        "_retention",
    ),
    # 2. The engine: bytes, not meaning.
    "engine": ("_native", "_backends", "_direct", "_staging", "_stream", "_dist"),
    # 3. File-system conventions: temp, publish, fsync; what is at a path.
    "fs": ("_commit", "_locate", "_memory"),
    # 4. The executors of a WritePlan and of a ReadPlan.
    "exec": ("_save", "_load"),
    # 5. Lifecycle objects and the public API.
    "lifecycle": ("_checkpointer", "_manager", "_blocking", "__init__"),
    "integrations": ("integrations",),
    "cli": ("_cli", "_bench", "__main__"),
}
ORDER = list(LAYERS)
PURE = ("base", "model")


def _layer_of(module: str) -> str:
    """``module``: dotted, relative to the package (``_backends._uring``, ``__init__``)."""
    top = module.split(".")[0]
    for layer, names in LAYERS.items():
        if top in names:
            return layer
    raise AssertionError(f"aiopersist.{module} has no layer: add it to LAYERS and to docs/development.md")


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(module: str, path: Path) -> set[str]:
    """The package modules (relative names) and the event-loop libraries ``module`` imports."""
    package = module.split(".")[:-1] if path.name != "__init__.py" else module.split(".")
    if module == "__init__":
        package = []
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                if node.module:
                    found.add(".".join([*base, node.module]))
                else:
                    found.update(".".join([*base, a.name]) for a in node.names)
            elif node.module and (node.module == "aiopersist" or node.module.startswith("aiopersist.")):
                found.add(node.module.removeprefix("aiopersist").lstrip(".") or "__init__")
            elif node.module and node.module.split(".")[0] in ("asyncio", "anyio"):
                found.add("<event loop>")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in ("asyncio", "anyio"):
                    found.add("<event loop>")
    return found


def test_every_module_has_a_layer() -> None:
    for module in _modules():
        _layer_of(module)


def test_no_module_imports_a_layer_above_its_own() -> None:
    problems = []
    for module, path in sorted(_modules().items()):
        mine = ORDER.index(_layer_of(module))
        for dep in sorted(_imports(module, path) - {"<event loop>"}):
            if ORDER.index(_layer_of(dep)) > mine:
                problems.append(f"{module} ({ORDER[mine]}) imports {dep} ({_layer_of(dep)})")
    assert problems == []


def test_the_pure_layers_never_touch_the_event_loop() -> None:
    for module, path in _modules().items():
        if _layer_of(module) in PURE:
            assert "<event loop>" not in _imports(module, path), module


def test_the_import_walker_finds_imports() -> None:
    # The walk above must find imports at all, relative and absolute, or it proves nothing.
    assert "_plan" in _imports("_save", ROOT / "_save.py")
    assert "__init__" in _imports("_bench.train", ROOT / "_bench" / "train.py")
    assert "<event loop>" in _imports("_stream", ROOT / "_stream.py")
