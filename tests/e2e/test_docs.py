"""Every code block in README.md and docs/ is checked as written (issue 18).

- ``python`` blocks run as scripts in a fresh directory, twice in a row in that same
  directory (an example that cannot be run again, for instance because its checkpoint now
  exists, fails). A block whose first lines say ``# torchrun --nproc-per-node N ...`` runs
  under ``torchrun`` with N processes, as the comment tells a reader to, launched twice.
  The others run in a process of their own, forked from one that has imported torch,
  transformers and accelerate (``tests/_forkserver.py``), twice in that process,
  each time as ``__main__`` in a fresh namespace.
- ``console`` blocks: each ``$ aiopersist ...`` line must parse with the CLI's parser.
- ``bash`` blocks: ``make`` targets must exist in the Makefile, ``aiopersist`` command
  lines must parse, repository files they name must exist, and any other command must be
  one this file knows (a new kind of command fails until it is checked here).
- ``json`` blocks must parse; ``text`` blocks are output or drawings, not run.
- A block without a language, or with another one, fails: every block says what it is.

Nothing here downloads: the Hugging Face libraries run offline.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from aiopersist._cli.main import build_parser
from tests._forkserver import ForkServer, offline_env
from tests._launch import run

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(
    r"^(?P<indent>[ \t]*)(?P<fence>`{3,})(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)(?P=fence)[ \t]*$",
    re.MULTILINE | re.DOTALL,
)
TORCHRUN = re.compile(r"^#\s*torchrun\s+--nproc-per-node[ =](?P<n>\d+)\b", re.MULTILINE)


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    code: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _blocks() -> list[Block]:
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            lang = m.group("info").strip().split(" ")[0].lower()
            code = textwrap.dedent(m.group("body"))
            found.append(Block(page, text.count("\n", 0, m.start()) + 1, lang, code))
    return found


BLOCKS = _blocks()
PYTHON = [b for b in BLOCKS if b.lang == "python"]
# The README repeats examples of the docs' home page: the same code runs once, named by
# every place it appears.
DISTINCT: dict[str, list[Block]] = {}
for _b in PYTHON:
    DISTINCT.setdefault(_b.code, []).append(_b)
KNOWN = {"python", "console", "bash", "json", "text"}


def test_the_pages_have_the_blocks_this_file_checks() -> None:
    # A broken fence regex would find nothing and pass everything: it must find them all.
    assert len(PYTHON) >= 25, [b.name for b in PYTHON]
    fences = sum(p.read_text(encoding="utf-8").count("```") for p in PAGES)
    assert fences == 2 * len(BLOCKS), "an unclosed or nested fence"


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.name)
def test_every_block_names_a_language_this_file_checks(block: Block) -> None:
    assert block.lang in KNOWN, f"{block.name}: a code block must be one of {sorted(KNOWN)}"


@pytest.mark.parametrize(
    "block",
    [same[0] for same in DISTINCT.values()],
    ids=[" = ".join(b.name for b in s) for s in DISTINCT.values()],
)
def test_python_block_runs_as_written_twice(block: Block, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(block.code, encoding="utf-8")
    work = tmp_path / "work"
    work.mkdir()
    ranks = TORCHRUN.search("\n".join(block.code.splitlines()[:3]))
    if not ranks:
        rc, out, err = ForkServer.shared().run({"script": str(script)}, work)
        assert rc == 0, f"{block.name} failed:\n{out[-3000:]}\n{err[-6000:]}"
        return
    # Under torchrun: two launches (the process group is the launcher's, one per run). The
    # agent is forked from the launch server (tests/_launch.py; its workers are fresh
    # processes, as torchrun makes them): so that the environment is the server's, the
    # thread count is left to torchrun, which gives each worker OMP_NUM_THREADS=1.
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    env = {k: v for k, v in offline_env().items() if k != "OMP_NUM_THREADS"}
    for i in (1, 2):
        proc = run([*launcher, ranks.group("n"), str(script)], cwd=work, env=env, text=True, timeout=280)
        assert proc.returncode == 0, (
            f"{block.name} failed (launch {i}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )


def _parses(argv: list[str], where: str) -> None:
    parser = build_parser()
    try:
        parser.parse_args(argv)
    except SystemExit as exc:  # argparse's way of saying "usage error"
        pytest.fail(f"{where}: `aiopersist {shlex.join(argv)}` does not parse (exit {exc.code})")


def _targets() -> set[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([A-Za-z][\w-]*):", text, re.MULTILINE))


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "console"], ids=lambda b: b.name)
def test_console_commands_parse(block: Block) -> None:
    commands = [ln[2:] for ln in block.code.splitlines() if ln.startswith("$ ")]
    assert commands, f"{block.name}: a console block shows at least one `$ ` command"
    for line in commands:
        argv = shlex.split(line, comments=True)
        assert argv[0] == "aiopersist", f"{block.name}: console blocks show aiopersist commands"
        _parses(argv[1:], block.name)


def _check_bash_line(argv: list[str], where: str, targets: set[str]) -> None:
    head = argv[0]
    if head == "sudo":
        argv = argv[1:]
        head = argv[0]
    if head == "make":
        missing = [t for t in argv[1:] if not t.startswith("-") and t not in targets]
        assert not missing, f"{where}: no Makefile target {missing}"
    elif head == "aiopersist":
        _parses(argv[1:], where)
    elif head in ("pip", "apt-get", "accelerate", "torchrun", "bash"):
        pass  # installs and launchers; the files they name are checked below
    elif head.startswith((".ci/", ".venv/bin/", "scripts/")):
        assert head.startswith(".venv/") or (ROOT / head).exists(), f"{where}: {head} does not exist"
    else:
        pytest.fail(f"{where}: `{head}` is a command this test does not check; add it here")
    for arg in argv[1:]:
        if re.fullmatch(r"(integrations|scripts|tests|\.ci|docs)/[\w./-]+", arg):
            assert (ROOT / arg).exists(), f"{where}: {arg} does not exist"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "bash"], ids=lambda b: b.name)
def test_bash_commands_are_real(block: Block) -> None:
    targets = _targets()
    joined = re.sub(r"\\\n", " ", block.code)
    lines = [ln for ln in (shlex.split(x, comments=True) for x in joined.splitlines()) if ln]
    assert lines, f"{block.name}: an empty block"
    for argv in lines:
        _check_bash_line(argv, block.name, targets)


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "json"], ids=lambda b: b.name)
def test_json_blocks_parse(block: Block) -> None:
    json.loads(block.code)
