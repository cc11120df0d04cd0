"""The GPU check's report: gpu-check.md and gpu-check.json from what its steps left in the
report folder (the step log ``.steps``, ``doctor.txt``, ``cuda-tests.xml``,
``bench-gpu.json`` and ``bench-gpu.md``); the first two are folded into the report and
removed. Exits 0 only when every step passed.

What "passed" means for the tests: on a GPU, at least one CUDA test ran, none failed or
errored (collection errors included), and none was skipped for want of a CUDA device
(other skips, such as io_uring refused by the kernel, are listed but allowed). In a dry
run, the CUDA tests must be collected and all skipped, with no failure or error.

Usage: python scripts/gpu_report.py --out DIR --dry-run 0|1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from typing import Any

NO_CUDA_SKIP = "needs a CUDA device"


def read_steps(path: str) -> list[dict[str, Any]]:
    steps = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                name, status, seconds, detail = [*line.rstrip("\n").split("\t"), "", "", ""][:4]
                steps.append({"step": name, "status": status, "seconds": int(seconds or 0), "detail": detail})
    return steps


def read_junit(path: str) -> dict[str, Any] | None:
    if not os.path.exists(path):
        return None
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    result: dict[str, Any] = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "seconds": 0.0}
    for s in suites:
        for key in ("tests", "failures", "errors", "skipped"):
            result[key] += int(s.get(key, 0))
        result["seconds"] += float(s.get("time", 0))
    result["passed"] = result["tests"] - result["failures"] - result["errors"] - result["skipped"]
    skips: dict[str, int] = {}
    failed: list[str] = []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        for child in case:
            if child.tag == "skipped":
                reason = (child.get("message") or "").strip()
                skips[reason] = skips.get(reason, 0) + 1
            elif child.tag in ("failure", "error"):
                first = (child.get("message") or "").strip().splitlines()
                failed.append(f"{name}: {first[0] if first else child.tag}"[:300])
    result["skip_reasons"] = skips
    result["failed"] = failed
    return result


def judge_tests(junit: dict[str, Any] | None, dry_run: bool) -> tuple[bool, str]:
    if junit is None:
        return False, "no test results (cuda-tests.xml is missing)"
    if junit["tests"] == 0:
        return False, "pytest collected no CUDA tests"
    if junit["failures"] or junit["errors"]:
        return False, f"{junit['failures']} failed, {junit['errors']} errors"
    no_cuda = sum(n for reason, n in junit["skip_reasons"].items() if NO_CUDA_SKIP in reason)
    if dry_run:
        if junit["passed"]:
            return False, f"{junit['passed']} CUDA tests passed on a machine without CUDA: they test nothing"
        return True, f"{junit['tests']} CUDA tests collected, all skipped (dry run)"
    if no_cuda:
        return False, f"{no_cuda} tests skipped for want of a CUDA device: torch sees no GPU"
    if junit["passed"] == 0:
        return False, "no CUDA test ran"
    return True, f"{junit['passed']} passed, {junit['skipped']} skipped"


def judge_bench(bench: dict[str, Any] | None) -> tuple[bool, str]:
    """The benchmark counts as run when aiopersist's modes were measured at some cadence."""
    if bench is None:
        return False, "no benchmark figures (bench-gpu.json is missing)"
    measured = {r["mode"] for r in bench.get("results", []) if r.get("error") is None}
    if not {"none", "fence", "snapshot"} <= measured:
        return False, "the benchmark measured " + (", ".join(sorted(measured)) or "nothing") + (
            "; see its notes"
        )
    return True, ""


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {"python": sys.version.split()[0], "machine": platform.machine()}
    try:
        import torch

        env["torch"] = torch.__version__
        env["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            env["gpu"] = f"{p.name}, {p.total_memory / 2**30:.0f} GiB"
    except Exception as exc:  # the report is written whatever broke
        env["torch"] = f"not importable: {exc}"
    if shutil.which("nvidia-smi"):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        )
        env["nvidia_smi"] = out.stdout.strip()
    env["kernel"] = platform.release()
    env["cpus"] = os.cpu_count()
    return env


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", type=int, default=0)
    args = ap.parse_args()
    out = args.out
    dry = bool(args.dry_run)
    steps = read_steps(os.path.join(out, ".steps"))
    junit = read_junit(os.path.join(out, "cuda-tests.xml"))
    tests_ok, tests_detail = judge_tests(junit, dry)
    for s in steps:
        if s["step"] == "tests":
            s["status"] = "ok" if tests_ok else "failed"
            s["detail"] = tests_detail
    bench: dict[str, Any] | None = None
    bench_path = os.path.join(out, "bench-gpu.json")
    if os.path.exists(bench_path):
        with open(bench_path) as f:
            bench = json.load(f)
    bench_ok, bench_detail = judge_bench(bench)
    for s in steps:
        if s["step"] == "bench" and s["status"] == "ok" and not bench_ok:
            s["status"], s["detail"] = "failed", bench_detail
    doctor = ""
    if os.path.exists(os.path.join(out, "doctor.txt")):
        with open(os.path.join(out, "doctor.txt")) as f:
            doctor = f.read()
    expected = ["bundle", "venv", "wheels", "package", "doctor", "tests", "bench"]
    seen = {s["step"] for s in steps}
    missing = [name for name in expected if name not in seen]
    ok = not missing and all(s["status"] == "ok" for s in steps)
    report = {
        "ok": ok,
        "dry_run": dry,
        "environment": environment(),
        "steps": steps,
        "steps_not_run": missing,
        "tests": junit,
        "bench": bench,
        "doctor": doctor,
    }
    with open(os.path.join(out, "gpu-check.json"), "w") as f:
        json.dump(report, f, indent=1)

    lines = [
        f"# aiopersist GPU check{' (dry run, no GPU)' if dry else ''}: {'PASSED' if ok else 'FAILED'}",
        "",
        "## Machine",
        "",
    ]
    lines += [f"- {k}: {v}" for k, v in report["environment"].items()]
    lines += ["", "## Steps", "", "| step | status | seconds | detail |", "| --- | --- | --- | --- |"]
    lines += [f"| {s['step']} | {s['status']} | {s['seconds']} | {s['detail']} |" for s in steps]
    lines += [f"| {name} | not run | | |" for name in missing]
    if junit is not None:
        lines += [
            "",
            "## CUDA tests",
            "",
            f"{junit['tests']} collected: {junit['passed']} passed, {junit['failures']} failed, "
            f"{junit['errors']} errors, {junit['skipped']} skipped ({junit['seconds']:.0f} s).",
        ]
        lines += [f"- failed: {name}" for name in junit["failed"]]
        lines += [f"- skipped ({n}): {reason}" for reason, n in junit["skip_reasons"].items()]
    if doctor:
        lines += ["", "## doctor", "", "```", doctor.rstrip(), "```"]
    md_path = os.path.join(out, "bench-gpu.md")
    if os.path.exists(md_path):
        with open(md_path) as f:
            lines += ["", f.read().rstrip()]
    with open(os.path.join(out, "gpu-check.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    # Their content is in the report now; a device call brings back at most 8 files.
    for name in (".steps", "doctor.txt"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(out, name))
    print(f"gpu-check: {'PASSED' if ok else 'FAILED'}; report in {os.path.join(out, 'gpu-check.md')}")
    for s in steps:
        if s["status"] != "ok":
            print(f"gpu-check:   {s['step']}: {s['status']} {s['detail']}")
    for name in missing:
        print(f"gpu-check:   {name}: not run")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
