"""The GPU check on the CPU: `scripts/gpu-check.sh --dry-run` builds a bundle for this
machine's Python (real downloads from PyPI and Debian, a real fio build, cached per user
as `make gpu-bundle` caches them), installs the package from it into a fresh venv over this one's torch,
and runs doctor, the CUDA tests (collected, all skipped) and `bench gpu --dry-run`; its
report must say every step passed. The report's verdicts are unit-tested too, and so is
`bench gpu` on its own."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from aiopersist._bench.gpu import format_gpu, run_gpu, write_outputs
from aiopersist._cli import main

REPO = Path(__file__).resolve().parents[2]


def _report_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_report", REPO / "scripts" / "gpu_report.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _junit(tmp_path: Path, cases: list[str]) -> Path:
    """A junit file with one test case per entry: 'pass', 'fail', 'error' or 'skip:REASON'."""
    body = []
    counts = {"failures": 0, "errors": 0, "skipped": 0}
    for i, case in enumerate(cases):
        inner = ""
        if case == "fail":
            inner, key = '<failure message="assert 1 == 2">tb</failure>', "failures"
        elif case == "error":
            inner, key = '<error message="collection failed">tb</error>', "errors"
        elif case.startswith("skip:"):
            inner, key = f'<skipped message="{case[5:]}" type="pytest.skip" />', "skipped"
        else:
            key = ""
        if key:
            counts[key] += 1
        body.append(f'<testcase classname="tests.io.test_cuda" name="t{i}" time="0.1">{inner}</testcase>')
    xml = (
        f'<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" '
        f'errors="{counts["errors"]}" failures="{counts["failures"]}" skipped="{counts["skipped"]}" '
        f'tests="{len(cases)}" time="1.0">{"".join(body)}</testsuite></testsuites>'
    )
    path = tmp_path / "cuda-tests.xml"
    path.write_text(xml)
    return path


@pytest.mark.parametrize(
    ("cases", "dry_run", "ok", "says"),
    [
        (["pass", "pass", "skip:io_uring unavailable"], False, True, "2 passed"),
        (["pass", "skip:needs a CUDA device"], False, False, "for want of a CUDA device"),
        (["pass", "fail"], False, False, "1 failed"),
        (["pass", "error"], False, False, "1 errors"),
        (["skip:io_uring unavailable"], False, False, "no CUDA test ran"),
        ([], False, False, "collected no CUDA tests"),
        (["skip:needs a CUDA device"] * 3, True, True, "all skipped (dry run)"),
        (["skip:needs a CUDA device", "pass"], True, False, "test nothing"),
        ([], True, False, "collected no CUDA tests"),
    ],
)
def test_report_judges_the_cuda_tests(
    tmp_path: Path, cases: list[str], dry_run: bool, ok: bool, says: str
) -> None:
    report = _report_module()
    verdict, detail = report.judge_tests(report.read_junit(str(_junit(tmp_path, cases))), dry_run)
    assert verdict is ok
    assert says in detail


@pytest.mark.parametrize(
    ("measured", "ok"),
    [
        ({"none", "fence", "snapshot", "dcp", "torch.save"}, True),
        ({"none", "fence", "snapshot"}, True),
        ({"none", "fence"}, False),
        (set(), False),
    ],
)
def test_report_judges_the_benchmark(measured: set[str], ok: bool) -> None:
    report = _report_module()
    results = [{"mode": m, "error": None if m in measured else "not run: time budget"} for m in
               ("none", "fence", "snapshot", "dcp", "torch.save")]  # fmt: skip
    verdict, detail = report.judge_bench({"results": results})
    assert verdict is ok
    if not ok:
        assert "the benchmark measured" in detail
    assert report.judge_bench(None)[0] is False


def test_report_without_results_fails(tmp_path: Path) -> None:
    report = _report_module()
    verdict, detail = report.judge_tests(report.read_junit(str(tmp_path / "missing.xml")), False)
    assert verdict is False
    assert "missing" in detail


def _run_check(args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """The script on a copy of this working tree (its builds must not land in ours)."""
    tree = tmp_path / "repo"
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        src = REPO / rel
        if src.is_file() and not src.is_symlink():
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, tree / rel)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "OUT"))}
    full_env.update(
        {
            "GPU_CHECK_PYTHON": sys.executable,
            "GPU_CHECK_VENV": str(tmp_path / "venv"),
            "GPU_CHECK_DIR": str(tmp_path / "bench"),
            **env,
        }
    )
    return subprocess.run(
        ["bash", "scripts/gpu-check.sh", *args], cwd=tree, env=full_env, capture_output=True, text=True
    )


def test_check_without_a_bundle_fails_and_says_how_to_make_one(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _run_check(["--out", str(out), "--bundle", str(tmp_path / "nothing")], tmp_path)
    assert proc.returncode == 1
    report = (out / "gpu-check.md").read_text()
    assert "FAILED" in report
    assert "make gpu-bundle" in report


def test_check_refuses_a_bundle_for_another_python(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "MANIFEST.json").write_text(json.dumps({"python": "3.1", "liburing": "2.3"}))
    out = tmp_path / "out"
    proc = _run_check(["--out", str(out), "--bundle", str(bundle)], tmp_path)
    assert proc.returncode == 1
    data = json.loads((out / "gpu-check.json").read_text())
    assert data["ok"] is False
    bundle_step = next(s for s in data["steps"] if s["step"] == "bundle")
    assert "for Python 3.1" in bundle_step["detail"]


def test_unknown_argument_is_refused(tmp_path: Path) -> None:
    proc = _run_check(["--frobnicate"], tmp_path)
    assert proc.returncode == 2
    assert "unknown argument" in proc.stderr


def _cuda_tests_in_the_suite(request: pytest.FixtureRequest) -> int:
    """How many of the suite's tests are marked ``cuda``: counted in this session's own
    collection when it is the whole suite, unfiltered (as under ``make test``; an xdist
    worker collects every test too), else by a collection of its own."""
    config = request.config
    if (
        [Path(a).resolve() for a in config.args] == [REPO / "tests"]
        and not config.option.keyword
        and not config.option.markexpr
        and not config.getoption("deselect", None)
    ):
        return sum(1 for item in request.session.items if item.get_closest_marker("cuda"))
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "cuda", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=REPO,
        capture_output=True,
        text=True,
    ).stdout
    return sum(1 for line in collected.splitlines() if "::" in line)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("apt-get") is None, reason="the bundle is made from Debian's packages")
def test_dry_run_passes_every_step_on_the_cpu(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    out = tmp_path / "out"
    # One round of the benchmark (its default is two): every mode and cadence still runs.
    proc = _run_check(
        ["--dry-run", "--out", str(out), "--budget-s", "400"], tmp_path, GPU_CHECK_BENCH_ARGS="--rounds 1"
    )
    log = (out / "check.log").read_text() if (out / "check.log").exists() else proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    data = json.loads((out / "gpu-check.json").read_text())
    assert data["ok"] is True
    assert data["dry_run"] is True
    assert [s["step"] for s in data["steps"]] == [
        "bundle", "venv", "wheels", "package", "doctor", "tests", "bench",
    ]  # fmt: skip
    assert all(s["status"] == "ok" for s in data["steps"]), data["steps"]
    package = next(s for s in data["steps"] if s["step"] == "package")
    assert "native module built against liburing" in package["detail"]
    # Every CUDA test of the suite was collected (and skipped: no GPU here).
    n = _cuda_tests_in_the_suite(request)
    assert n >= 20
    assert data["tests"]["tests"] == n
    assert data["tests"]["skipped"] == n
    # The benchmark ran every mode at both cadences, and said it was a rehearsal.
    bench = data["bench"]
    assert bench["dry_run"] is True
    ran = {(r["mode"], r["cadence"]) for r in bench["results"] if r["error"] is None}
    assert ran == {(m, c) for m in ("none", "torch.save", "dcp", "fence", "snapshot") for c in (1, 10)}
    assert "dry run" in (out / "gpu-check.md").read_text()
    # What comes back from a device call: at most 8 plain files.
    assert len(os.listdir(out)) <= 8
    # The bundle holds real files only, under the size a device call carries.
    manifest = json.loads((tmp_path / "repo" / ".gpu-bundle-dry" / "MANIFEST.json").read_text())
    assert manifest["bytes"] < 64 << 20
    assert any(name.startswith("wheels/cffi-") for name in manifest["files"])
    assert "liburing/lib/liburing.so.2" in manifest["files"]


def test_bench_gpu_dry_run_reports_every_mode(tmp_path: Path) -> None:
    modes = ("none", "torch.save", "snapshot")
    report = run_gpu(str(tmp_path), dry_run=True, rounds=1, modes=modes, cadences=(1,))
    assert report.dry_run
    assert report.targets == []  # no target is judged on a rehearsal
    assert {r.mode for r in report.results} == {"none", "torch.save", "snapshot"}
    snap = next(r for r in report.results if r.mode == "snapshot")
    assert snap.error is None
    assert snap.save_s is not None
    assert snap.save_s > 0
    assert report.load["bytes"]
    write_outputs(report, str(tmp_path / "b.json"), str(tmp_path / "b.md"))
    data: dict[str, Any] = json.loads((tmp_path / "b.json").read_text())
    assert data["results"][0]["mode"] == "none"
    assert (tmp_path / "b.md").read_text() == format_gpu(report)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".aiopersist-bench-gpu")]


@pytest.mark.parametrize(
    "argv",
    [
        ["--modes", "fence"],  # no baseline
        ["--modes", "none,zip"],
        ["--every", "0"],
        ["--every", "x"],
        ["--rounds", "0"],
    ],
)
def test_bench_gpu_refuses_bad_arguments(
    tmp_path: Path, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "gpu", "--dry-run", "--dir", str(tmp_path), *argv]) == 2
    assert "aiopersist bench gpu:" in capsys.readouterr().err


def test_bench_gpu_without_cuda_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["bench", "gpu", "--dir", str(tmp_path)]) == 1
    assert "--dry-run" in capsys.readouterr().err
