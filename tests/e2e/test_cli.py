"""The command line, as a user runs it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import aiopersist
from aiopersist._cli.progress import human
from aiopersist._manager import check_step
from aiopersist._names import LOCK_NAME
from tests._forkserver import aiopersist_cli
from tests.conftest import URING_OK


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m aiopersist ARGS``, in a process forked from one that has imported torch
    and the Hugging Face libraries once (tests/_forkserver.py)."""
    return aiopersist_cli(*args)


def test_human_sizes() -> None:
    assert [human(n) for n in (0, 17, 1023, 1024, 512 << 10, 1536, 1023 * 1024 + 1000)] == [
        "0 B", "17 B", "1023 B", "1 KiB", "512 KiB", "1.5 KiB", "1.0 MiB",
    ]  # fmt: skip
    assert human(int(1.9 * (1 << 30))) == "1.9 GiB"
    assert human(3 << 40) == "3 TiB"


def test_doctor_reports_backend_and_direct_io(tmp_path: Path) -> None:
    proc = _cli("doctor", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for key in ("kernel", "io_uring", "liburing", "auto backend", "O_DIRECT", "alignment"):
        assert re.search(rf"^{key}\s", out, re.M), key
    assert re.search(rf"^path\s+{re.escape(str(tmp_path))}$", out, re.M)
    assert bool(re.search(r"^auto backend\s+io_uring$", out, re.M)) == URING_OK


def test_a_missing_path_is_an_error_in_one_line(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing")
    for args in (("doctor", missing), ("ls", missing), ("gc", missing, "--keep-last", "1")):
        proc = _cli(*args)
        assert proc.returncode == 1, (args, proc.stdout, proc.stderr)
        assert proc.stderr.strip() == f"aiopersist: error: {missing}: no such directory", args
        assert proc.stdout == ""
    (tmp_path / "file").write_text("x")
    proc = _cli("ls", str(tmp_path / "file"))
    assert proc.returncode == 1
    assert "not a directory" in proc.stderr


def test_bad_arguments_version_and_tracebacks(tmp_path: Path) -> None:
    proc = _cli("gc", str(tmp_path), "--keep-last", "-1")
    assert proc.returncode == 2  # argparse's usage error
    assert "must be at least 1, got -1" in proc.stderr
    proc = _cli("gc", str(tmp_path), "--keep-last", "2", "--keep-every", "x")
    assert proc.returncode == 2
    assert "'x' is not a whole number" in proc.stderr
    proc = _cli("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"aiopersist {aiopersist.__version__}"
    quiet = _cli("inspect", str(tmp_path / "none"))
    loud = _cli("-v", "inspect", str(tmp_path / "none"))
    assert quiet.returncode == loud.returncode == 1
    assert "Traceback" not in quiet.stderr
    assert "Traceback (most recent call last)" in loud.stderr


def test_demo_runs_and_verifies(tmp_path: Path) -> None:
    proc = _cli("demo", "--dir", str(tmp_path / "d"), "--size-mib", "48", "--rounds", "2")
    assert proc.returncode == 0, proc.stderr
    rows = [line.split()[0] for line in proc.stdout.splitlines() if line.endswith("  yes")]
    assert rows == ["torch.save", "threads"] + (["io_uring"] if URING_OK else [])
    assert not (tmp_path / "d").exists()  # cleaned up without --keep


def test_bench_save_and_load_small(tmp_path: Path) -> None:
    import json

    for kind, peer in (("save", "torch.save"), ("load", "safetensors")):
        plot = tmp_path / f"{kind}.png"
        proc = _cli(
            "bench", kind, "--dir", str(tmp_path / "d"), "--size-gib", "0.03", "--rounds", "1",
            "--methods", f"{peer},aiopersist-threads", "--json", "--plot", str(plot),
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        report = json.loads(proc.stdout)
        assert report["kind"] == kind
        names = [r["method"] for r in report["results"]]
        assert sorted(names) == sorted([peer, "aiopersist-threads"])
        assert plot.stat().st_size > 1000
        for r in report["results"]:  # the CPU figures (a run this short may be under a tick)
            assert r["ceiling_gibs"] is None or r["ceiling_gibs"] > 0
            assert all(0 <= run["busiest_thread_cpu_s"] <= run["total_cpu_s"] for run in r["runs"])
    assert not any((tmp_path / "d").iterdir())  # cleaned up


def test_thread_cpu_keeps_the_last_reading_of_a_thread_that_ended() -> None:
    import threading
    import time

    from aiopersist._bench.ckpt import _ThreadCpu

    burnt = threading.Event()
    leave = threading.Event()

    def burn() -> None:
        start = time.thread_time()
        while time.thread_time() - start < 0.3:
            pass
        burnt.set()
        leave.wait()

    # The sampler's own clock is left out (an hour): the test takes the sample itself,
    # while the thread lives, as the sampler does every interval.
    with _ThreadCpu(interval=3600) as cpu:
        worker = threading.Thread(target=burn)
        worker.start()
        burnt.wait()
        cpu._merge()
        leave.set()
        worker.join()  # ended before the block: /proc no longer lists it
    assert 0.25 <= cpu.busiest <= cpu.total


def test_bench_save_of_many_small_tensors(tmp_path: Path) -> None:
    import json

    proc = _cli(
        "bench", "save", "--dir", str(tmp_path / "d"), "--size-gib", "0.02", "--rounds", "1",
        "--methods", "torch.save,aiopersist-threads", "--state", "small", "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["state"]["shape"] == "small"
    assert report["state"]["tensors"] == (int(0.02 * (1 << 30)) // 4096)
    assert report["state"]["small_tensors"] == report["state"]["tensors"]


def test_bench_train_small(tmp_path: Path) -> None:
    plot = tmp_path / "train.png"
    proc = _cli(
        "bench", "train", "--dir", str(tmp_path / "d"), "--rounds", "2", "--steps", "3",
        "--hidden", "256", "--layers", "2", "--batch", "16", "--plot", str(plot),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {line.split()[0] for line in proc.stdout.splitlines() if line[:1].isalpha()}
    assert {"none", "torch.save", "fence", "snapshot"} <= rows
    # Each mode's overhead comes with its range over the rounds.
    for mode in ("torch.save", "fence", "snapshot"):
        assert re.search(
            rf"^{re.escape(mode)}\s+[\d.]+\s+-?[\d.]+%\s+[+-]\d+%\.\.[+-]\d+%\s", proc.stdout, re.M
        )
    assert f"plot written to {plot}" in proc.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot.stat().st_size > 10_000
    pace = next(line for line in proc.stdout.splitlines() if "pure-Python thread's pace" in line)
    assert "fence " in pace
    assert "snapshot " in pace
    if shutil.which("fio"):
        assert "fio" in rows
        assert "reference: fio alone" in proc.stdout
    assert not any((tmp_path / "d").iterdir())  # the checkpoints are cleaned up


def test_bench_train_dcp_modes_and_bench_dcp_small(tmp_path: Path) -> None:
    proc = _cli(
        "bench", "train", "--dir", str(tmp_path / "d"), "--rounds", "1", "--steps", "3",
        "--hidden", "128", "--layers", "2", "--batch", "8", "--modes", "none,dcp,dcp-aiopersist",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {line.split()[0] for line in proc.stdout.splitlines() if line[:1].isalpha()}
    assert {"none", "dcp", "dcp-aiopersist"} <= rows
    assert not any((tmp_path / "d").iterdir())
    proc = _cli(
        "bench", "dcp", "--dir", str(tmp_path / "e"), "--size-gib", "0.0625", "--rounds", "1",
        "--methods", "fs-t1,aiopersist",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "aiopersist bench dcp: 0.06 GiB over 2 ranks" in proc.stdout
    assert "the best FileSystemWriter (fs-t1)" in proc.stdout
    assert not any((tmp_path / "e").iterdir())
    bad = _cli("bench", "dcp", "--dir", str(tmp_path / "e"), "--methods", "nope")
    assert bad.returncode == 2
    assert "unknown methods ['nope']" in bad.stderr


def test_bench_train_calibrates_the_batch(tmp_path: Path) -> None:
    proc = _cli(
        "bench", "train", "--dir", str(tmp_path / "d"), "--rounds", "1", "--steps", "2",
        "--hidden", "128", "--layers", "2", "--modes", "none,fence",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    calibration = next(line for line in proc.stdout.splitlines() if line.startswith("calibration:"))
    batch = int(calibration.split("batch ")[1].split(":")[0])
    assert f"batch {batch}," in proc.stdout  # the loop runs with the batch it found


def test_calibration_converges_and_bounds_its_steps() -> None:
    """The secant search on a step that costs a fixed part plus a part per sample, and on
    noise that makes the slope useless."""
    from aiopersist._bench.train import next_batch

    def step(b: int) -> float:
        return 0.3 + 0.004 * b + 1e-6 * b * b  # not quite linear, as on a real CPU

    save_s = 1.5
    points = [(b, step(b)) for b in (32, 128)]
    while (b := next_batch(points, save_s)) is not None:
        assert points[-1][0] // 4 <= b <= 4 * points[-1][0]
        points.append((b, step(b)))
        assert len(points) < 12
    assert abs(step(points[-1][0]) / save_s - 1) <= 0.10
    # A second step measured faster than the first (noise): the batch grows, by 4x at most.
    assert next_batch([(32, 0.20), (128, 0.19)], save_s) == 512
    assert next_batch([(32, 0.20), (128, 0.19)], 0.5) == 337
    # Far too slow: it shrinks, never below 8.
    assert next_batch([(32, 0.5), (128, 40.0)], save_s) == 34
    assert next_batch([(8, 0.5), (12, 40.0)], 0.01) == 8
    assert next_batch([(32, 1.0), (128, 1.5)], save_s) is None  # within 10%


def test_bench_train_rejects_unknown_modes(tmp_path: Path) -> None:
    proc = _cli("bench", "train", "--dir", str(tmp_path / "d"), "--modes", "none,fast")
    assert proc.returncode == 2
    assert "--modes" in proc.stderr
    assert "'none,fast'" in proc.stderr


def test_bench_save_over_two_ranks_and_two_dirs(tmp_path: Path) -> None:
    proc = _cli(
        "bench", "save", "--dir", str(tmp_path / "d"), "--size-gib", "0.02", "--rounds", "1",
        "--ranks", "2", "--dirs", "2",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    layouts = {line.split()[0] for line in proc.stdout.splitlines() if line[:1].isdigit()}
    assert {"1x1", "2x2"} <= layouts
    assert "max/mean" in proc.stdout
    assert not any((tmp_path / "d").iterdir())


def test_inspect_a_checkpoint_over_two_directories(tmp_path: Path) -> None:
    import torch

    import aiopersist

    paths = [tmp_path / "a" / "ck", tmp_path / "b" / "ck"]
    aiopersist.save_sync({"w": torch.ones(1 << 20), "v": torch.zeros(3)}, paths)
    proc = _cli("inspect", str(paths[0]))
    assert proc.returncode == 0, proc.stderr
    assert "missing" not in proc.stdout
    assert "state-rank00000-dir01.safetensors" in proc.stdout
    assert "slices in" in proc.stdout  # the big tensor is split between the two disks


def test_ls_and_gc(tmp_path: Path) -> None:
    import json

    import torch

    import aiopersist

    with aiopersist.BlockingCheckpointManager(
        tmp_path / "ck", mirror=tmp_path / "m", mirror_keep_last=1
    ) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, {"w": torch.full((1000,), float(step))}).wait()
        mgr.wait()
    (tmp_path / "ck" / "step-9").mkdir()  # no manifest: listed, not complete
    (tmp_path / "ck" / ".step-5.aiopersist-tmp-0123456789ab").mkdir()
    proc = _cli("ls", str(tmp_path / "ck"), "--mirror", str(tmp_path / "m"))
    assert proc.returncode == 0, proc.stderr
    table = proc.stdout.split("\n\n")[0]  # the leftovers follow, after a blank line
    rows = [line.split() for line in table.splitlines()[1:]]
    assert table.splitlines()[0].split() == ["step", "name", "tier", "kind", "complete", "size", "note"]
    assert [(r[0], r[1], r[2], r[3], r[4]) for r in rows] == [
        ("1", "step-1", "local", "aiopersist", "yes"), ("2", "step-2", "local", "aiopersist", "yes"),
        ("3", "step-3", "local", "aiopersist", "yes"), ("4", "step-4", "local", "aiopersist", "yes"),
        ("4", "step-4", "mirror", "aiopersist", "yes"), ("9", "step-9", "local", "aiopersist", "NO"),
    ]  # fmt: skip
    size = check_step(str(tmp_path / "ck" / "step-1"))[1]  # 1000 float32 and the header
    assert size > 1024
    assert " ".join(rows[0][5:7]) == human(size)  # in human units
    assert "leftovers of interrupted saves or deletions (1;" in proc.stdout
    assert "  .step-5.aiopersist-tmp-0123456789ab" in proc.stdout
    doc = json.loads(_cli("ls", str(tmp_path / "ck"), "--json").stdout)
    assert [d["step"] for d in doc if d["complete"]] == [1, 2, 3, 4]
    nothing = _cli("gc", str(tmp_path / "ck"))
    assert nothing.returncode == 2
    assert "nothing to do" in nothing.stderr
    dry = _cli("gc", str(tmp_path / "ck"), "--keep-last", "1", "--keep-every", "2", "--leftovers")
    assert dry.returncode == 0, dry.stderr
    assert "would delete step-1" in dry.stdout
    assert "would delete step-3" in dry.stdout
    assert "would remove leftover .step-5.aiopersist-tmp-0123456789ab" in dry.stdout
    assert "dry run" in dry.stdout
    before = sorted(set(os.listdir(tmp_path / "ck")) - {LOCK_NAME})
    assert before[0] == ".step-5.aiopersist-tmp-0123456789ab"  # nothing changed
    alone = _cli("gc", str(tmp_path / "ck"), "--leftovers", "--apply")  # leftovers only: no retention
    assert alone.returncode == 0, alone.stderr
    assert sorted(set(os.listdir(tmp_path / "ck")) - {LOCK_NAME}) == [
        "step-1",
        "step-2",
        "step-3",
        "step-4",
        "step-9",
    ]
    (tmp_path / "ck" / ".step-6.aiopersist-trash-0123456789ab").mkdir()
    done = _cli("gc", str(tmp_path / "ck"), "--keep-last", "1", "--keep-every", "2", "--leftovers", "--apply")
    assert done.returncode == 0, done.stderr
    assert sorted(set(os.listdir(tmp_path / "ck")) - {LOCK_NAME}) == ["step-2", "step-4", "step-9"]


def test_demo_trainer_small(tmp_path: Path) -> None:
    plot = tmp_path / "demo.png"
    # Every warning shown, each time (-W always): the demo's own configuration must cause none.
    proc = subprocess.run(
        [sys.executable, "-W", "always", "-m", "aiopersist", "demo-trainer", "--dir", str(tmp_path / "d"),
         "--steps", "8", "--every", "2", "--rounds", "2", "--layers", "2", "--width", "128",
         "--plot", str(plot)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert proc.stderr == ""  # no warning, no progress bar of a library
    out = proc.stdout
    assert "(2 layers, width 128," in out  # the model asked for
    assert "MATCH the uninterrupted run" in out
    # Interleaved, the order reversed in the second round.
    runs = [line.split(" (")[0].strip() for line in out.splitlines() if line.endswith(" s/step")]
    order = ["no checkpoints", "stock Trainer saving", "AioPersistCallback"]
    assert runs == order + order[::-1]
    # The spread: every run's step times over the rounds, every method's overheads, and
    # a verdict on the noise for each method.
    pct = r"[+-]\d+%"
    assert re.search(r"^no checkpoints\s+[\d.]+\s+[\d.]+\.\.[\d.]+\s+-\s+-", out, re.M), out
    for label in ("stock Trainer saving", "AioPersistCallback"):
        assert re.search(rf"^{label}\s+[\d.]+\s+[\d.]+\.\.[\d.]+\s+{pct}\s+{pct}\.\.{pct}\s", out, re.M), out
        assert re.search(rf"^  {label}: {pct}, (WITHIN NOISE|beyond the baseline's spread)", out, re.M), out
    assert re.search(r"^noise: the baseline alone moved by \d+% between rounds", out, re.M), out
    assert re.search(r"^done in \d+ s$", out, re.M)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot.stat().st_size > 10_000


def test_demo_trainer_rejects_too_few_steps(tmp_path: Path) -> None:
    proc = _cli("demo-trainer", "--dir", str(tmp_path / "d"), "--steps", "3", "--every", "2")
    assert proc.returncode == 2
    assert "--steps" in proc.stderr
    proc = _cli("demo-trainer", "--dir", str(tmp_path / "d"), "--rounds", "0")
    assert proc.returncode == 2
    assert "--rounds must be at least 1; got 0" in proc.stderr
    proc = _cli("demo-trainer", "--dir", str(tmp_path / "d"), "--width", "0")
    assert proc.returncode == 2
    assert "--width must be at least 1; got 0" in proc.stderr
    assert not (tmp_path / "d").exists()


def test_demo_trainer_says_when_a_difference_is_within_the_noise() -> None:
    from aiopersist._bench.demo_trainer import DemoReport, Method, Shape, format_demo

    def report(base: tuple[float, ...], aio: tuple[float, ...]) -> DemoReport:
        methods = (
            Method("no checkpoints", base, (), None, None),
            Method(
                "AioPersistCallback",
                aio,
                tuple(a / b - 1 for a, b in zip(aio, base, strict=True)),
                0.2,
                1 << 27,
            ),
        )
        return DemoReport(1, Shape(), 20, 5, len(base), methods, "checkpoint-15", "checkpoint-10", True, 9.0)

    # The baseline moved by 19% between rounds; the callback's +4% is within that.
    noisy = report((0.25, 0.30, 0.27), (0.26, 0.32, 0.28))
    assert abs(noisy.baseline_spread - 0.05 / 0.27) < 1e-9
    assert noisy.within_noise(noisy.methods[1])
    text = format_demo(noisy)
    assert "noise: the baseline alone moved by 19% between rounds" in text
    assert "  AioPersistCallback: +4%, WITHIN NOISE" in text
    assert re.search(
        r"^AioPersistCallback\s+0\.280\s+0\.260\.\.0\.320\s+\+4%\s+\+4%\.\.\+7%\s", text, re.M
    ), text
    # A steady baseline: +30% is a finding.
    steady = report((0.250, 0.251, 0.250), (0.33, 0.32, 0.33))
    assert not steady.within_noise(steady.methods[1])
    assert "  AioPersistCallback: +32%, beyond the baseline's spread" in format_demo(steady)
