#!/usr/bin/env bash
# The GPU check: on a lent GPU machine, from the repo root, with the bundle carried
# (`make gpu-bundle`), in one call:
#   1. a venv over the image's Python and torch (--system-site-packages, plus a .pth to the
#      image's own site-packages when its python3 is itself a venv);
#   2. the bundle's wheels, then this package, editable, its native module built against
#      the bundle's liburing (headers at build time, the runtime found through an rpath);
#   3. `aiopersist doctor` on the benchmark's disk;
#   4. every `cuda`-marked test (pytest -m cuda), on both backends;
#   5. `aiopersist bench gpu` in the time that is left;
#   6. a report: gpu-check.md and gpu-check.json (with the test results, the benchmark's
#      figures and each step's status) in $OUT, beside cuda-tests.xml, bench-gpu.json,
#      bench-gpu.md and check.log.
# Exit status 0 only when every step passed.
#
# Usage: scripts/gpu-check.sh [--dry-run] [--bundle DIR] [--out DIR] [--budget-s N]
#   --dry-run   on a CPU machine: build a bundle for this machine's Python into a venv here
#               and run everything that needs no GPU (the CUDA tests are collected and
#               skipped; the benchmark runs its CPU rehearsal, `bench gpu --dry-run`)
#   --bundle    the bundle (default .gpu-bundle; with --dry-run, .gpu-bundle-dry, built if missing)
#   --out       where the report goes (default $OUT, else gpu-check-out)
#   --budget-s  seconds the whole check may take (default 570: a device call's limit is 600)
# Environment: GPU_CHECK_PYTHON (the image's Python; default python3, or .venv/bin/python
# with --dry-run), GPU_CHECK_VENV (default a fresh folder under /tmp), GPU_CHECK_DIR (the
# disk to benchmark; default .gpu-check-bench in the working tree, removed at the end),
# GPU_CHECK_BENCH_ARGS (more arguments for `bench gpu`).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
START=$(date +%s)

DRY=0
BUNDLE=""
REPORT_DIR=${OUT:-}
BUDGET=570
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1; shift ;;
        --bundle) BUNDLE=$2; shift 2 ;;
        --out) REPORT_DIR=$2; shift 2 ;;
        --budget-s) BUDGET=$2; shift 2 ;;
        -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
        *) echo "gpu-check: unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
done
case "$BUDGET" in ''|*[!0-9]*) echo "gpu-check: --budget-s wants whole seconds, not '$BUDGET'" >&2; exit 2 ;; esac
REPORT_DIR=${REPORT_DIR:-gpu-check-out}
mkdir -p "$REPORT_DIR"
REPORT_DIR=$(cd "$REPORT_DIR" && pwd)
LOG="$REPORT_DIR/check.log"
: > "$LOG"
STATUS="$REPORT_DIR/.steps"  # one line per step: name, status, seconds, detail
: > "$STATUS"

say() { echo "gpu-check: $*" | tee -a "$LOG"; }
step_done() {  # name status started detail
    printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$(( $(date +%s) - $3 ))" "${4:-}" >> "$STATUS"
    say "step $1: $2${4:+ ($4)}"
}
left() { echo $(( BUDGET - ($(date +%s) - START) )); }

if [ $DRY = 1 ]; then
    PYTHON=${GPU_CHECK_PYTHON:-$ROOT/.venv/bin/python}
    [ -x "$PYTHON" ] || PYTHON=python3
else
    PYTHON=${GPU_CHECK_PYTHON:-python3}
fi
PYVER=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])') || {
    echo "gpu-check: cannot run $PYTHON" >&2; exit 1; }

# -- the bundle -------------------------------------------------------------------------------
t=$(date +%s)
if [ -z "$BUNDLE" ]; then
    if [ $DRY = 1 ]; then BUNDLE=.gpu-bundle-dry; else BUNDLE=.gpu-bundle; fi
fi
if [ $DRY = 1 ] && [ ! -f "$BUNDLE/MANIFEST.json" ]; then
    say "building a bundle for Python $PYVER into $BUNDLE"
    if ! GPU_BUNDLE_HOST_PYTHON="$PYTHON" bash scripts/gpu-bundle.sh --python "$PYVER" --out "$BUNDLE" >>"$LOG" 2>&1; then
        step_done bundle failed "$t" "scripts/gpu-bundle.sh failed: see check.log"
    fi
fi
if [ ! -f "$BUNDLE/MANIFEST.json" ]; then
    grep -q '^bundle' "$STATUS" || step_done bundle failed "$t" "no bundle at $BUNDLE: run 'make gpu-bundle' and carry it"
    "$PYTHON" scripts/gpu_report.py --out "$REPORT_DIR" --dry-run "$DRY"
    exit 1
fi
BUNDLE=$(cd "$BUNDLE" && pwd)
BUNDLE_PY=$("$PYTHON" -c 'import json,sys; print(json.load(open(sys.argv[1]))["python"])' "$BUNDLE/MANIFEST.json")
if [ "$BUNDLE_PY" != "$PYVER" ]; then
    step_done bundle failed "$t" "the bundle is for Python $BUNDLE_PY, this Python is $PYVER: make it with scripts/gpu-bundle.sh --python $PYVER"
    "$PYTHON" scripts/gpu_report.py --out "$REPORT_DIR" --dry-run "$DRY"
    exit 1
fi
step_done bundle ok "$t" "$BUNDLE"

# -- 1. the venv over the image's torch -------------------------------------------------------
t=$(date +%s)
VENV=${GPU_CHECK_VENV:-$(mktemp -d /tmp/aiopersist-gpu-check.XXXXXX)/venv}
rm -rf "$VENV"
# Without ensurepip (a distribution's Python without its venv package), the venv is made
# without pip, and the image's pip installs into it (pip --python).
PIP=("$VENV/bin/python" -m pip)
if ! "$PYTHON" -m venv --system-site-packages "$VENV" >>"$LOG" 2>&1; then
    rm -rf "$VENV"
    "$PYTHON" -m venv --system-site-packages --without-pip "$VENV" >>"$LOG" 2>&1 && PIP=("$PYTHON" -m pip --python "$VENV/bin/python")
fi
if [ -x "$VENV/bin/python" ]; then
    # The image's python3 may itself be a venv: then --system-site-packages reaches the
    # interpreter's site-packages, not the image's (where torch is). A .pth adds those.
    site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$PYTHON" -c 'import site; print("\n".join(site.getsitepackages()))' > "$site/_aiopersist_image.pth"
    if "$VENV/bin/python" -c 'import torch' >>"$LOG" 2>&1; then
        step_done venv ok "$t" "$("$VENV/bin/python" -c 'import sys, torch; print(f"Python {sys.version.split()[0]}, torch {torch.__version__}")')"
    else
        step_done venv failed "$t" "torch is not importable from the venv: see check.log"
    fi
else
    step_done venv failed "$t" "python -m venv failed: see check.log"
fi
VPY="$VENV/bin/python"
pip_install() { "${PIP[@]}" install -q --disable-pip-version-check --no-index --no-deps "$@" >>"$LOG" 2>&1; }

# -- 2. the wheels and the package ------------------------------------------------------------
t=$(date +%s)
if pip_install "$BUNDLE"/wheels/*.whl; then
    step_done wheels ok "$t" "$(ls "$BUNDLE/wheels" | wc -l) wheels"
else
    step_done wheels failed "$t" "pip could not install the bundle's wheels: see check.log"
fi
t=$(date +%s)
URING_VERSION=$("$PYTHON" -c 'import json,sys; print(json.load(open(sys.argv[1]))["liburing"])' "$BUNDLE/MANIFEST.json")
if CFLAGS="-I$BUNDLE/liburing/include ${CFLAGS:-}" \
    LDFLAGS="-L$BUNDLE/liburing/lib -Wl,-rpath,$BUNDLE/liburing/lib ${LDFLAGS:-}" \
    AIOPERSIST_LIBURING_VERSION="$URING_VERSION" \
    pip_install --no-build-isolation -e .; then
    native=$("$VPY" -c 'from aiopersist import _native as n; print("ok" if n.has_liburing else "missing: " + str(n.unavailable_reason))' 2>>"$LOG")
    if [ "$native" = ok ]; then
        step_done package ok "$t" "native module built against liburing $URING_VERSION"
    else
        step_done package failed "$t" "installed, but the native module is $native (see check.log: the compiler's output)"
    fi
else
    step_done package failed "$t" "pip install -e . failed: see check.log"
fi
AIOP="$VENV/bin/aiopersist"

# -- 3. doctor --------------------------------------------------------------------------------
t=$(date +%s)
# The benchmark's disk: beside the working tree (on the machine's disk; /tmp may be memory).
BENCH_DIR=${GPU_CHECK_DIR:-$ROOT/.gpu-check-bench}
mkdir -p "$BENCH_DIR"
if "$AIOP" doctor "$BENCH_DIR" > "$REPORT_DIR/doctor.txt" 2>&1; then
    step_done doctor ok "$t"
else
    step_done doctor failed "$t" "exit status $?: see the doctor section of the report"
fi
df -hT "$BENCH_DIR" >> "$REPORT_DIR/doctor.txt" 2>&1
cat "$REPORT_DIR/doctor.txt" >> "$LOG"

# -- 4. the CUDA tests ------------------------------------------------------------------------
t=$(date +%s)
export PATH="$BUNDLE/bin:$PATH"  # the bundle's fio, for the benchmark
# Only the plugins this project's configuration needs: the image's own (pytest-cov,
# xdist, benchmark...) were built for its pytest, not the bundle's.
PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 "$VPY" -m pytest -p pytest_asyncio.plugin -p pytest_timeout \
    -m cuda -p no:cacheprovider -q -rs --continue-on-collection-errors \
    --junitxml="$REPORT_DIR/cuda-tests.xml" tests >>"$LOG" 2>&1
rc=$?
# Exit 5 (nothing collected) and exit 0 with every test skipped are read from the
# junit file by the report, which decides; here only the exit status is kept.
step_done tests "rc=$rc" "$t" "pytest -m cuda"

# -- 5. the benchmark -------------------------------------------------------------------------
t=$(date +%s)
budget=$(( $(left) - 60 ))
if [ "$budget" -lt 30 ]; then
    step_done bench skipped "$t" "no time left (the budget was spent by the steps above)"
else
    dry_arg=()
    [ $DRY = 1 ] && dry_arg=(--dry-run)
    # shellcheck disable=SC2086
    # The benchmark plans within its budget; past it (a bad estimate), SIGINT makes it
    # report what it has, and 30 s later it is killed: the report is written either way.
    if timeout -s INT -k 30 "$((budget + 20))" "$AIOP" bench gpu --dir "$BENCH_DIR" --budget-s "$budget" "${dry_arg[@]}" \
        --json "$REPORT_DIR/bench-gpu.json" --markdown "$REPORT_DIR/bench-gpu.md" \
        ${GPU_CHECK_BENCH_ARGS:-} 2>&1 | tee -a "$LOG"; then
        step_done bench ok "$t"
    else
        step_done bench failed "$t" "see check.log"
    fi
fi
rm -rf "$BENCH_DIR"/.aiopersist-bench-gpu-* 2>/dev/null
[ -z "${GPU_CHECK_DIR:-}" ] && rm -rf "$BENCH_DIR"

# -- 6. the report ----------------------------------------------------------------------------
RPY=$VPY
[ -x "$RPY" ] || RPY=$PYTHON
"$RPY" scripts/gpu_report.py --out "$REPORT_DIR" --dry-run "$DRY" 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
