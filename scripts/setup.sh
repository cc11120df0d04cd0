#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: system packages, .venv, torch, the package.
# Fast when everything is already in place, so every make target can depend on it.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
PY="$VENV/bin/python"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"

# pip, minus the warnings some machines' pip.conf produces for index folders that do not
# exist (one line per package; they drown what matters). pip's exit status is kept.
# pip byte-compiles what it installs (20 of setup's 68 s on a fresh clone here), and that
# stays: where PYTHONDONTWRITEBYTECODE is set (this machine's environment sets it), Python
# never writes the .pyc files itself, and without pip's every process compiled torch again
# (the suite took 14:53 instead of 9:36).
pip_install() {
    "$PY" -m pip install -q "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}

# 1. System packages (root + apt only): liburing headers for the native io_uring module,
#    fio for the benchmark, pkg-config to learn liburing's version. Without them the
#    package still installs and uses its threads backend.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    missing=()
    [ -f /usr/include/liburing.h ] || missing+=(liburing-dev)
    command -v fio >/dev/null 2>&1 || missing+=(fio)
    command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
    if [ ${#missing[@]} -gt 0 ]; then
        echo "setup: apt-get install ${missing[*]}"
        if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null; }; then
            echo "setup: warning: could not install ${missing[*]}; continuing (threads backend only)" >&2
        fi
    fi
elif [ ! -f /usr/include/liburing.h ]; then
    echo "setup: note: liburing-dev is missing and we are not root; the threads backend will be used" >&2
fi

# 2. The virtual environment.
if [ ! -x "$PY" ]; then
    echo "setup: creating $VENV"
    python3 -m venv "$VENV"
fi

# 3. torch first, so that the package's plain 'torch' requirement never pulls a CUDA build.
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "setup: installing $TORCH_SPEC"
    pip_install "$TORCH_SPEC"
fi

# 4. The package, editable, with its dev extras. Reinstalled when its build inputs
#    changed, or when liburing appeared since the native module was (not) built.
stamp="$VENV/.setup-stamp"
want="$(cat pyproject.toml setup.py aiopersist/_native/_build_liburing.py | sha256sum | cut -c1-16)"
[ -f /usr/include/liburing.h ] && want="$want+uring"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! "$PY" -c "import aiopersist" >/dev/null 2>&1; then
    echo "setup: installing aiopersist (editable, dev extras)"
    pip_install -e ".[dev]"
    echo "$want" > "$stamp"
fi
