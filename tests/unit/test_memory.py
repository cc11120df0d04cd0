"""What host memory a load may still allocate, read from /proc and the cgroup file system
(made here as files)."""

from __future__ import annotations

from pathlib import Path

import pytest

from aiopersist import _memory

GiB = 1 << 30


def _files(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


@pytest.fixture
def system(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(_memory, "_PROC_MEMINFO", str(tmp_path / "meminfo"))
    monkeypatch.setattr(_memory, "_PROC_CGROUP", str(tmp_path / "cgroup"))
    monkeypatch.setattr(_memory, "_CGROUP_ROOT", str(tmp_path / "fs"))
    (tmp_path / "fs").mkdir()
    _files(
        tmp_path,
        {"meminfo": f"MemTotal: {64 << 20} kB\nMemAvailable: {8 << 20} kB\nSwapFree: {1 << 20} kB\n"},
    )
    return tmp_path


def test_free_memory_and_swap_without_a_cgroup_limit(system: Path) -> None:
    _files(system, {"cgroup": "0::/\n"})
    assert _memory.available_bytes() == 9 * GiB
    (system / "cgroup").unlink()
    assert _memory.available_bytes() == 9 * GiB
    (system / "meminfo").unlink()
    assert _memory.available_bytes() is None  # nothing readable: no answer


def test_the_tightest_cgroup_v2_limit_on_the_way_up_counts_its_page_cache_as_free(system: Path) -> None:
    _files(
        system,
        {
            "cgroup": "0::/job/step\n",
            "fs/memory.max": "max\n",
            "fs/memory.current": f"{40 * GiB}\n",
            "fs/job/memory.max": f"{6 * GiB}\n",
            "fs/job/memory.current": f"{4 * GiB}\n",
            "fs/job/memory.stat": f"anon {3 * GiB}\nfile {GiB}\n",
            "fs/job/step/memory.max": "max\n",
            "fs/job/step/memory.current": f"{4 * GiB}\n",
        },
    )
    # job: 2 GiB below its limit, 1 GiB of page cache it may drop; plus free swap.
    assert _memory.available_bytes() == 2 * GiB + GiB + GiB


def test_a_cgroup_v1_memory_limit(system: Path) -> None:
    _files(
        system,
        {
            "cgroup": "5:cpu,cpuacct:/x\n4:memory:/ns/job\n",
            "fs/memory/memory.limit_in_bytes": "9223372036854771712\n",
            "fs/memory/memory.usage_in_bytes": f"{GiB}\n",
            "fs/memory/ns/job/memory.limit_in_bytes": f"{3 * GiB}\n",
            "fs/memory/ns/job/memory.usage_in_bytes": f"{2 * GiB}\n",
            "fs/memory/ns/job/memory.stat": f"cache {GiB // 2}\ntotal_cache {GiB // 2}\n",
        },
    )
    assert _memory.available_bytes() == GiB + GiB // 2 + GiB


def test_a_cgroup_namespace_shows_its_own_root(system: Path) -> None:
    """/proc/self/cgroup names a path the namespace does not show: the root stands for it."""
    _files(
        system,
        {"cgroup": "0::/elsewhere/job\n", "fs/memory.max": f"{2 * GiB}\n", "fs/memory.current": f"{GiB}\n"},
    )
    assert _memory.available_bytes() == GiB + GiB


def test_a_negative_staging_keep_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiopersist import _knobs

    monkeypatch.setenv("AIOPERSIST_STAGING_KEEP_BYTES", "-1")
    with pytest.raises(ValueError, match="AIOPERSIST_STAGING_KEEP_BYTES='-1' must be at least 0"):
        _knobs.staging_keep_bytes()
