#!/usr/bin/env bash
# `make gpu-bundle`: everything the lent GPU machine lacks for scripts/gpu-check.sh, built
# here (where PyPI and Debian's archive can be reached) into a git-ignored folder that the
# device call carries (64 MiB at most):
#
#   wheels/    cffi and pycparser (the native module's build), setuptools and wheel (the
#              build backend), pytest, pluggy, iniconfig, pytest-asyncio, pytest-timeout
#              (the test runner this project's pytest configuration needs), for the target
#              Python; the versions are those of this checkout's .venv where it has them
#              (setuptools and wheel: the newest, which know the target Python).
#   liburing/  include/ and lib/ from Debian's liburing-dev and liburing2 packages,
#              unpacked (no symbolic links: the real files, so nothing points outside).
#   bin/fio    the fio reference, built from Debian's fio source with no optional
#              libraries (it needs only libc, libm and libz), for `bench gpu`'s write figure.
#   MANIFEST.json  what is in it, with versions and sizes.
#
# Usage: scripts/gpu-bundle.sh [--python X.Y] [--out DIR]
#   --python  the target Python (default 3.12, the GPU image's)
#   --out     the folder to make (default .gpu-bundle); replaced only once the new one is whole
# Downloads and the fio build are cached per user (every clone and worktree shares them), in
# ${GPU_BUNDLE_CACHE:-${XDG_CACHE_HOME:-~/.cache}/aiopersist/gpu-bundle}.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

PYVER=3.12
OUTDIR=.gpu-bundle
while [ $# -gt 0 ]; do
    case "$1" in
        --python) PYVER=$2; shift 2 ;;
        --out) OUTDIR=$2; shift 2 ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        *) echo "gpu-bundle: unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
done
case "$PYVER" in
    3.[0-9]|3.[0-9][0-9]) ;;
    *) echo "gpu-bundle: --python wants a version like 3.12, not '$PYVER'" >&2; exit 2 ;;
esac
CACHE=${GPU_BUNDLE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/aiopersist/gpu-bundle}
mkdir -p "$CACHE"
CACHE=$(cd "$CACHE" && pwd)
LIMIT=$((64 * 1024 * 1024))

# The Python that runs pip here: the checkout's .venv (made by `make setup`) or python3.
HOSTPY=${GPU_BUNDLE_HOST_PYTHON:-}
if [ -z "$HOSTPY" ]; then
    if [ -x .venv/bin/python ]; then HOSTPY=.venv/bin/python; else HOSTPY=python3; fi
fi

say() { echo "gpu-bundle: $*"; }
die() { echo "gpu-bundle: error: $*" >&2; exit 1; }

WORK=$(mktemp -d "${TMPDIR:-/tmp}/aiopersist-gpu-bundle.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
NEW="$WORK/bundle"
mkdir -p "$NEW/wheels" "$NEW/liburing/include" "$NEW/liburing/lib" "$NEW/bin"

# -- 1. wheels ------------------------------------------------------------------------------
# name==version: this .venv's version where it has the package, else the newest pip finds.
pin() {
    local v
    case "$1" in setuptools|wheel) echo "$1"; return ;; esac  # the newest: the target Python's
    v=$("$HOSTPY" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass" "$1" 2>/dev/null || true)
    if [ -n "$v" ]; then echo "$1==$v"; else echo "$1"; fi
}
NODOT=${PYVER/./}
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    PLATFORMS+=(--platform "$p")
done
WHEELS=(cffi pycparser setuptools wheel pytest pluggy iniconfig pytest-asyncio pytest-timeout)
specs=()
for w in "${WHEELS[@]}"; do specs+=("$(pin "$w")"); done
say "wheels for Python $PYVER: ${specs[*]}"
mkdir -p "$CACHE/wheels-cp$NODOT"
if ! "$HOSTPY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$PYVER" --implementation cp --abi "cp$NODOT" --abi abi3 --abi none \
    "${PLATFORMS[@]}" --platform any -d "$CACHE/wheels-cp$NODOT" "${specs[@]}" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); then
    die "pip could not download the wheels (is PyPI reachable?)"
fi
for w in "${WHEELS[@]}"; do
    name=${w//-/_}
    spec=$(pin "$w")
    version=${spec#*==}
    [ "$version" = "$spec" ] && version="*"
    # shellcheck disable=SC2206
    found=( $(ls "$CACHE/wheels-cp$NODOT"/ 2>/dev/null | grep -i "^${name}-${version//\*/.*}-" | sort -V | tail -1) )
    [ ${#found[@]} -eq 1 ] || die "no wheel of $w for Python $PYVER in $CACHE/wheels-cp$NODOT"
    cp "$CACHE/wheels-cp$NODOT/${found[0]}" "$NEW/wheels/"
done

# -- 2. liburing from Debian's packages ------------------------------------------------------
command -v apt-get >/dev/null 2>&1 || die "apt-get is needed to fetch liburing's packages"
mkdir -p "$CACHE/debs"
(
    cd "$CACHE/debs"
    if ! ls liburing-dev_*.deb liburing2_*.deb >/dev/null 2>&1; then
        say "apt-get download liburing-dev liburing2"
        apt-get download -qq liburing-dev liburing2 >/dev/null 2>&1 || {
            # The package lists may be missing on a fresh machine (root only can refresh them).
            [ "$(id -u)" = 0 ] && apt-get update -qq >/dev/null 2>&1
            apt-get download -qq liburing-dev liburing2 >/dev/null
        }
    fi
) || die "could not download liburing-dev and liburing2 with apt-get"
UNPACK="$WORK/uring"
mkdir -p "$UNPACK"
for deb in "$CACHE"/debs/liburing-dev_*.deb "$CACHE"/debs/liburing2_*.deb; do
    dpkg-deb -x "$deb" "$UNPACK"
done
URING_VERSION=$(dpkg-deb -f "$(ls "$CACHE"/debs/liburing2_*.deb | head -1)" Version)
cp -rL "$UNPACK/usr/include/." "$NEW/liburing/include/"
libdir=$(dirname "$(find "$UNPACK" -name 'liburing.so.2*' -type f | head -1)")
[ -n "$libdir" ] || die "liburing2's package holds no liburing.so.2"
# The runtime under its soname, and the link-time name: both real files (cp -L).
cp -L "$libdir/liburing.so.2" "$NEW/liburing/lib/liburing.so.2"
cp -L "$libdir/liburing.so.2" "$NEW/liburing/lib/liburing.so"
[ -f "$NEW/liburing/include/liburing.h" ] || die "liburing-dev's package holds no liburing.h"

# -- 3. fio ---------------------------------------------------------------------------------
FIO_NOTE=""
build_fio() {
    local src="$CACHE/fio-src" lists="$CACHE/apt-src-lists"
    mkdir -p "$src" "$lists/partial"
    if ! ls "$src"/fio_*.orig.tar.* >/dev/null 2>&1; then
        printf 'deb-src http://deb.debian.org/debian %s main\n' \
            "$(. /etc/os-release && echo "${VERSION_CODENAME:-bookworm}")" > "$CACHE/apt-src.list"
        local o=(-o "Dir::Etc::SourceList=$CACHE/apt-src.list" -o Dir::Etc::SourceParts=/dev/null
                 -o "Dir::State::Lists=$lists")
        apt-get "${o[@]}" update -qq >/dev/null 2>&1 || return 1
        (cd "$src" && apt-get "${o[@]}" source --download-only -qq fio >/dev/null 2>&1) || return 1
    fi
    local tarball
    tarball=$(ls "$src"/fio_*.orig.tar.* | head -1)
    local build="$WORK/fio-build"
    mkdir -p "$build"
    tar -xf "$tarball" -C "$build"
    local dir
    dir=$(find "$build" -mindepth 1 -maxdepth 1 -type d | head -1)
    # No optional libraries (rbd, gluster, rdma, ...): the binary must run on another
    # distribution; the io_uring and psync engines are built in.
    (cd "$dir" && ./configure --disable-native --disable-rdma --disable-rados --disable-rbd \
        --disable-http --disable-gfapi --disable-libnfs --disable-pmem --disable-numa \
        --disable-xnvme --disable-libzbc --disable-tcmalloc --disable-dfs >/dev/null 2>&1 \
        && make -j"$(nproc)" fio >/dev/null 2>&1) || return 1
    strip "$dir/fio" 2>/dev/null || true
    "$dir/fio" --version >/dev/null || return 1
    # Only libraries every glibc system has (libaio, libnuma... would be found here and be
    # missing there).
    if ldd "$dir/fio" | grep -vE 'linux-vdso|ld-linux|lib(c|m|mvec|z|pthread|dl|rt)\.so' | grep -q '=>'; then
        say "fio links libraries the GPU image may lack: $(ldd "$dir/fio" | tr '\n' ' ')"
        return 1
    fi
    cp "$dir/fio" "$CACHE/fio.bin"
}
if [ -x "$CACHE/fio.bin" ] || { say "building fio from Debian's source (once; cached)"; build_fio; }; then
    cp "$CACHE/fio.bin" "$NEW/bin/fio"
else
    FIO_NOTE="fio could not be built here (no deb-src access or no compiler): bench gpu reports no fio ratio"
    say "warning: $FIO_NOTE"
fi

# -- 4. the manifest, the size check, and the swap --------------------------------------------
"$HOSTPY" - "$NEW" "$PYVER" "$URING_VERSION" "$FIO_NOTE" "$LIMIT" <<'EOF'
import json, os, subprocess, sys
root, pyver, uring, fio_note, limit = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
files, total = {}, 0
for d, _, names in os.walk(root):
    for n in sorted(names):
        p = os.path.join(d, n)
        if os.path.islink(p):
            sys.exit(f"gpu-bundle: error: {p} is a symbolic link; the bundle must hold real files")
        size = os.path.getsize(p)
        files[os.path.relpath(p, root)] = size
        total += size
fio = os.path.join(root, "bin", "fio")
fio_version = None
if os.path.exists(fio):
    fio_version = subprocess.run([fio, "--version"], capture_output=True, text=True).stdout.strip()
manifest = {
    "python": pyver,
    "liburing": uring,
    "fio": fio_version,
    "notes": [fio_note] if fio_note else [],
    "bytes": total,
    "files": files,
}
with open(os.path.join(root, "MANIFEST.json"), "w") as f:
    json.dump(manifest, f, indent=1, sort_keys=True)
if total > limit:
    sys.exit(f"gpu-bundle: error: the bundle is {total} bytes, over the {limit}-byte limit a device call carries")
print(f"gpu-bundle: {len(files)} files, {total / 2**20:.1f} MiB (limit {limit >> 20} MiB); "
      f"liburing {uring}, fio {fio_version or 'missing'}")
EOF
rm -rf "$OUTDIR.old"
[ -e "$OUTDIR" ] && mv "$OUTDIR" "$OUTDIR.old"
mkdir -p "$(dirname "$OUTDIR")"
cp -r "$NEW" "$OUTDIR"
rm -rf "$OUTDIR.old"
say "ready: $OUTDIR (carry it: see docs/development.md, 'The GPU check')"
