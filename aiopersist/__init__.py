"""aiopersist: fast, asynchronous, crash-safe deep-learning checkpoints.

The implementation lives in private modules; this module only re-exports the public API.
"""

from __future__ import annotations

from ._backends import IOBackend as IOBackend
from ._backends import UringCause as UringCause
from ._backends import UringProbe as UringProbe
from ._backends import UringUnavailable as UringUnavailable
from ._backends import create_backend as create_backend
from ._backends import open_backend as open_backend
from ._backends import probe_io_uring as probe_io_uring
from ._blocking import BlockingCheckpointer as BlockingCheckpointer
from ._blocking import BlockingCheckpointManager as BlockingCheckpointManager
from ._blocking import BlockingManagedSaveHandle as BlockingManagedSaveHandle
from ._blocking import BlockingSaveHandle as BlockingSaveHandle
from ._blocking import load_sync as load_sync
from ._blocking import save_sync as save_sync
from ._checkpointer import Checkpointer as Checkpointer
from ._checkpointer import SaveHandle as SaveHandle
from ._checkpointer import SnapshotBudgetError as SnapshotBudgetError
from ._direct import DirectIOInfo as DirectIOInfo
from ._direct import probe_directory as probe_directory
from ._exceptions import AiopersistError as AiopersistError
from ._exceptions import BackendUnavailableError as BackendUnavailableError
from ._exceptions import CheckpointCorruptError as CheckpointCorruptError
from ._exceptions import CheckpointExistsError as CheckpointExistsError
from ._exceptions import CheckpointIOError as CheckpointIOError
from ._exceptions import CheckpointNotFoundError as CheckpointNotFoundError
from ._exceptions import ClosedError as ClosedError
from ._exceptions import DirectoryInUseError as DirectoryInUseError
from ._exceptions import DiskFullError as DiskFullError
from ._exceptions import LinkedFileError as LinkedFileError
from ._exceptions import NewerFormatError as NewerFormatError
from ._exceptions import NotEnoughMemoryError as NotEnoughMemoryError
from ._exceptions import RankFailedError as RankFailedError
from ._exceptions import StateMismatchError as StateMismatchError
from ._exceptions import UnsupportedStateError as UnsupportedStateError
from ._load import VerifyReport as VerifyReport
from ._load import load as load
from ._load import verify as verify
from ._manager import CheckpointManager as CheckpointManager
from ._manager import ManagedSaveHandle as ManagedSaveHandle
from ._manager import StepInfo as StepInfo
from ._retention import KeepAll as KeepAll
from ._retention import KeepAny as KeepAny
from ._retention import KeepEvery as KeepEvery
from ._retention import KeepLast as KeepLast
from ._retention import KeepSteps as KeepSteps
from ._retention import Retention as Retention
from ._rng import RNGState as RNGState
from ._save import SafetensorsSave as SafetensorsSave
from ._save import SaveInfo as SaveInfo
from ._save import TorchSave as TorchSave
from ._save import save as save
from ._staging import StagingPool as StagingPool
from ._stream import FileWriter as FileWriter
from ._stream import read_segments as read_segments

__version__ = "0.1.0"

__all__ = [
    "AiopersistError",
    "BackendUnavailableError",
    "BlockingCheckpointManager",
    "BlockingCheckpointer",
    "BlockingManagedSaveHandle",
    "BlockingSaveHandle",
    "CheckpointCorruptError",
    "CheckpointExistsError",
    "CheckpointIOError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "Checkpointer",
    "ClosedError",
    "DirectIOInfo",
    "DirectoryInUseError",
    "DiskFullError",
    "NewerFormatError",
    "FileWriter",
    "IOBackend",
    "KeepAll",
    "KeepAny",
    "KeepEvery",
    "KeepLast",
    "KeepSteps",
    "LinkedFileError",
    "ManagedSaveHandle",
    "NotEnoughMemoryError",
    "RNGState",
    "RankFailedError",
    "Retention",
    "SaveHandle",
    "SaveInfo",
    "SnapshotBudgetError",
    "StagingPool",
    "StateMismatchError",
    "StepInfo",
    "SafetensorsSave",
    "TorchSave",
    "UnsupportedStateError",
    "UringCause",
    "UringProbe",
    "UringUnavailable",
    "VerifyReport",
    "__version__",
    "create_backend",
    "load",
    "load_sync",
    "open_backend",
    "probe_directory",
    "probe_io_uring",
    "read_segments",
    "save",
    "save_sync",
    "verify",
]
