"""Every name aiopersist gives to something on disk (pure: no I/O).

A checkpoint directory holds its data files, `MANIFEST_NAME`, the pickle file and, for a
sharded model, Hugging Face's index. Beside it, for a while, live the names of work in
progress; each carries a marker that nothing a user names contains, so that leftovers of
a crash are recognised (and only they are ever removed by aiopersist):

- ``.NAME.aiopersist-tmp-TOKEN``: a checkpoint being written (`temp_path`);
- ``.NAME.aiopersist-old-TOKEN``: a replaced checkpoint moved aside, without renameat2;
- ``.NAME.aiopersist-trash-TOKEN``: a checkpoint being deleted by a manager;

(these three beside it, or in the place `work_elsewhere` gives its directory);
- ``part-TOKEN``: the share of a checkpoint on another disk (`part_dir`), named by its
  save's token so that no two saves ever share one;
- ``.aiopersist-probe-TOKEN``: the scratch file of a direct-I/O probe;
- ``.aiopersist-manager.lock``: a manager's lock on its directory;
- ``step-N``: a manager's checkpoint of step ``N``;
- ``checkpoint-N``: a Hugging Face Trainer's checkpoint of step ``N`` in its
  ``output_dir`` (written by `AioPersistCallback` or by the Trainer's own save).

`StepLayout` names both kinds of numbered checkpoints, so that listing, retention and
deletion are the same code for a manager's directory and a Trainer's ``output_dir``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

MANIFEST_NAME = "aiopersist.json"
DCP_METADATA = ".metadata"
"""A ``torch.distributed.checkpoint`` directory's metadata file."""
PICKLE_FILE = "pickled.bin"
"""Where a checkpoint's pickled objects are (``allow_pickle=True``)."""
MODEL_FILE = "model.safetensors"
"""Hugging Face's name of a model's weights in one file."""
MODEL_INDEX = "model.safetensors.index.json"
"""Hugging Face's index of a sharded model's weights."""
TRAINER_STATE = "trainer_state.json"
"""The Hugging Face Trainer's state in a checkpoint (written after the weights and the
optimizer by the stock save; its ``best_model_checkpoint`` names the best checkpoint)."""

TMP_MARKER = ".aiopersist-tmp-"
OLD_MARKER = ".aiopersist-old-"
TRASH_MARKER = ".aiopersist-trash-"
LEFTOVER_MARKERS = (TMP_MARKER, OLD_MARKER, TRASH_MARKER)
PROBE_PREFIX = ".aiopersist-probe-"
LOCK_NAME = ".aiopersist-manager.lock"

PART_PREFIX = "part-"
PART_RE = re.compile(rf"^{PART_PREFIX}([0-9a-f]{{8,64}})\Z")
MAX_STEP = 10**18 - 1
"""The highest step number: 18 digits (a step name, with the work names made beside it,
stays far under a file name's 255 bytes; a name of hundreds of digits would make every
temporary name beside it too long)."""
STEP_RE = re.compile(r"step-(0|[1-9][0-9]{0,17})", re.ASCII)
CHECKPOINT_RE = re.compile(r"checkpoint-(0|[1-9][0-9]{0,17})", re.ASCII)
"""Step names are canonical: ASCII digits, no leading zero, at most `MAX_STEP`, nothing
after them (matched whole: ``step-03``, a step in another script's digits, or ``step-3``
and a newline would read as step 3, while ``step_name(3)`` is another directory). Other
names are not steps: never counted, never deleted."""


@dataclass(frozen=True)
class StepLayout:
    """How the checkpoints of numbered steps are named in a directory: ``PREFIX-N``.

    ``stock_file``: for a framework that also writes such checkpoints itself, the file
    whose presence makes a directory without an aiopersist manifest a complete checkpoint
    of the framework's own save (``None``: every checkpoint is aiopersist's)."""

    prefix: str
    pattern: re.Pattern[str]
    stock_file: str | None = None

    def name(self, step: int) -> str:
        return f"{self.prefix}{step}"

    def step_of(self, name: str) -> int | None:
        """The step ``name`` is the checkpoint of, or ``None`` when it is no such name."""
        m = self.pattern.fullmatch(name)
        return int(m.group(1)) if m is not None else None

    def step_at(self, path: str) -> int | None:
        """The step of the checkpoint at ``path``, by its last component (wherever the
        directory is now: a path recorded in another place or by another machine)."""
        return self.step_of(os.path.basename(os.path.normpath(path)))


MANAGER_STEPS = StepLayout("step-", STEP_RE)
"""A `CheckpointManager`'s directory: ``step-N``, all aiopersist checkpoints."""
TRAINER_STEPS = StepLayout("checkpoint-", CHECKPOINT_RE, TRAINER_STATE)
"""A Hugging Face Trainer's ``output_dir``: ``checkpoint-N``, written by
`AioPersistCallback` (with a manifest) or by the stock save (``trainer_state.json`` last)."""
STEP_LAYOUTS = (MANAGER_STEPS, TRAINER_STEPS)


_WORK_PLACES: dict[str, str] = {}
"""Directories whose checkpoints' work in progress goes elsewhere (`work_elsewhere`)."""


def work_elsewhere(directory: str, place: str) -> None:
    """From now on, in this process, put the work in progress of the checkpoints in
    ``directory`` (their temporary, replaced and trash directories, and the staging of
    their files) into ``place`` instead of beside them: for a directory where another
    program takes every entry for a checkpoint (Accelerate's ``checkpoints/``). ``place``
    must be on the same file system, as checkpoints are renamed out of it and into it."""
    _WORK_PLACES[os.path.abspath(directory)] = os.path.abspath(place)


def is_work_place(directory: str) -> bool:
    """Whether ``directory`` is a place `work_elsewhere` named: it exists only while work
    is in progress there (`aiopersist._commit.release_work_place`)."""
    return os.path.abspath(directory) in _WORK_PLACES.values()


def work_place(directory: str) -> str:
    """Where the work in progress of the checkpoints in ``directory`` goes: ``directory``
    itself, unless `work_elsewhere` said otherwise."""
    return _WORK_PLACES.get(os.path.abspath(directory), directory)


def beside(final: str, marker: str, token: str) -> str:
    """The hidden name of work in progress on ``final``, with ``marker`` and ``token``:
    its sibling, or in the place `work_elsewhere` gave its directory."""
    return os.path.join(work_place(os.path.dirname(final)), f".{os.path.basename(final)}{marker}{token}")


def temp_path(final: str, token: str) -> str:
    """Where the checkpoint ``final`` is written before its publication, for the save
    ``token``."""
    return beside(final, TMP_MARKER, token)


def part_dir(directory: str, token: str) -> str:
    """The part directory of the save ``token`` in ``directory`` (one disk's place for the
    checkpoint)."""
    return os.path.join(directory, f"{PART_PREFIX}{token}")


def step_name(step: int) -> str:
    return MANAGER_STEPS.name(step)
