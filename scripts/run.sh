#!/usr/bin/env bash
# Set up and run VeloxQuant-MLX from a fresh clone, non-interactively.
#
#   bash scripts/run.sh demo [demo args...]   # needle-in-a-haystack demo on the embedded model
#   bash scripts/run.sh test [pytest args...] # the test suite (python -m pytest -q)
#
# Steps: (Linux) install OpenBLAS if it is missing (MLX's CPU wheel links a reference BLAS; OpenBLAS
# makes it ~35x faster); create or reuse the virtualenv .venv (falling back to the current interpreter
# if a virtualenv cannot be made); pip install -e ".[test]"; (test, Linux x86_64) install the arm64 cross compiler
# g++-aarch64-linux-gnu if apt-get can; run the demo or the tests.
#
# Environment: PYTHON (interpreter to build .venv from; default: the first python3 >= 3.10 found),
# VELOXQUANT_VENV (default .venv), VELOXQUANT_REINSTALL=1 (re-run pip even if pyproject.toml is
# unchanged since the last install), VELOXQUANT_TEST_WORKERS (test processes; default: the CPU count, at most 4;
# 1: one process).
set -euo pipefail

usage() { echo "usage: bash scripts/run.sh {demo|test} [args...]" >&2; exit 2; }
note() { echo "run.sh: $*" >&2; }

[ $# -ge 1 ] || usage
mode=$1
shift
case "$mode" in demo | test) ;; *) usage ;; esac

cd "$(dirname "${BASH_SOURCE[0]}")/.."
export DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1

# --------------------------------------------------------------------------- privileged apt-get
SUDO=unset
can_apt() {
    command -v apt-get >/dev/null 2>&1 || return 1
    if [ "$SUDO" = unset ]; then
        if [ "$(id -u)" = 0 ]; then
            SUDO=""
        elif command -v sudo >/dev/null 2>&1 && sudo -n true >/dev/null 2>&1; then
            SUDO="sudo -n"
        else
            SUDO=none
        fi
    fi
    [ "$SUDO" != none ]
}

APT_UPDATED=0
apt_install() { # apt_install PKG...: install, refreshing the package lists once if needed
    $SUDO apt-get install -y -q --no-install-recommends "$@" </dev/null && return 0
    [ "$APT_UPDATED" = 1 ] && return 1
    APT_UPDATED=1
    $SUDO apt-get update -q </dev/null || return 1
    $SUDO apt-get install -y -q --no-install-recommends "$@" </dev/null
}

# --------------------------------------------------------------------------- OpenBLAS (Linux)
have_openblas() {
    local p
    for p in /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
        /usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0; do
        [ -e "$p" ] && return 0
    done
    ldconfig -p 2>/dev/null | grep -q 'libopenblas\.so'
}

if [ "$(uname -s)" = Linux ] && ! have_openblas; then
    if can_apt; then
        note "installing OpenBLAS (apt-get install -y libopenblas0-pthread)"
        apt_install libopenblas0-pthread >&2 ||
            note "could not install libopenblas0-pthread; continuing with MLX's bundled (much slower) BLAS"
    else
        note "OpenBLAS not found and cannot install it (needs apt-get as root or passwordless sudo);" \
            "continuing with MLX's bundled BLAS (much slower). Debian/Ubuntu: apt-get install -y libopenblas0-pthread"
    fi
fi

# --------------------------------------------------------------------------- Python >= 3.10
py_ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 10))' >/dev/null 2>&1; }
find_python() {
    local c
    for c in ${PYTHON:-} python3 python3.13 python3.12 python3.11 python3.10 python; do
        if command -v "$c" >/dev/null 2>&1 && py_ok "$c"; then
            command -v "$c"
            return 0
        fi
    done
    return 1
}

if ! BASE_PY=$(find_python); then
    if can_apt; then
        note "no Python >= 3.10 found; installing python3 with apt-get"
        apt_install python3 python3-venv python3-pip >&2 || true
    fi
    BASE_PY=$(find_python) || { note "error: Python >= 3.10 is required"; exit 1; }
fi

# --------------------------------------------------------------------------- virtualenv
VENV=${VELOXQUANT_VENV:-.venv}
PY=""
if [ -x "$VENV/bin/python" ] && py_ok "$VENV/bin/python" && "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
    PY="$VENV/bin/python"
else
    if [ -e "$VENV" ]; then # a broken or foreign-interpreter virtualenv: rebuild it, but never delete other things
        [ -f "$VENV/pyvenv.cfg" ] || { note "error: $VENV exists and is not a virtualenv; move it away"; exit 1; }
        rm -rf "$VENV"
    fi
    note "creating virtualenv $VENV with $BASE_PY"
    if ! "$BASE_PY" -m venv "$VENV" >&2; then
        rm -rf "$VENV"
        # Debian/Ubuntu ship venv (ensurepip) separately.
        pyver=$("$BASE_PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
        if can_apt && apt_install "python${pyver}-venv" >&2 && "$BASE_PY" -m venv "$VENV" >&2; then
            :
        else
            rm -rf "$VENV"
        fi
    fi
    if [ -x "$VENV/bin/python" ]; then
        PY="$VENV/bin/python"
    else
        note "could not create a virtualenv; falling back to the current interpreter $BASE_PY" \
            "(packages are installed into its environment)"
        PY=$BASE_PY
        # A distribution's Python may be marked externally managed (PEP 668).
        export PIP_BREAK_SYSTEM_PACKAGES=1
        if ! "$PY" -m pip --version >/dev/null 2>&1; then
            "$PY" -m ensurepip --upgrade >&2 || { can_apt && apt_install python3-pip >&2; } || true
        fi
    fi
fi

# --------------------------------------------------------------------------- install
stamp="$VENV/.veloxquant-install-stamp"
want_stamp="$(cksum <pyproject.toml) $("$PY" -c 'import sys; print(sys.executable)')"
if [ "${VELOXQUANT_REINSTALL:-0}" != 1 ] && [ "$PY" = "$VENV/bin/python" ] && [ -f "$stamp" ] &&
    [ "$(cat "$stamp")" = "$want_stamp" ] && "$PY" -c 'import veloxquant_mlx.cli, pytest' >/dev/null 2>&1; then
    note "dependencies already installed in $VENV (VELOXQUANT_REINSTALL=1 forces pip)"
else
    note "installing the package and its dependencies: pip install -e \".[test]\""
    if [ "$PY" = "$VENV/bin/python" ]; then # never upgrade a system interpreter's pip
        "$PY" -m pip install -q --upgrade pip >&2 || note "could not upgrade pip; using $("$PY" -m pip --version)"
    fi
    "$PY" -m pip install -q -e ".[test]" >&2
    if [ "$PY" = "$VENV/bin/python" ]; then echo "$want_stamp" >"$stamp"; fi
fi

# --------------------------------------------------------------------------- run
case "$mode" in
demo)
    bindir=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
    if [ -x "$bindir/veloxquant" ]; then
        exec "$bindir/veloxquant" demo "$@"
    fi
    exec "$PY" -m veloxquant_mlx demo "$@"
    ;;
test)
    # The arm64 cross compiler (Linux x86_64 only): tests/test_native_cpu.py then compiles the CPU kernels' sources for
    # arm64, most users' CPUs (skipped where it cannot be installed)
    if [ "$(uname -s)-$(uname -m)" = Linux-x86_64 ] && ! command -v aarch64-linux-gnu-g++ >/dev/null 2>&1 &&
        can_apt; then
        apt_install g++-aarch64-linux-gnu >&2 ||
            note "could not install g++-aarch64-linux-gnu; the arm64 compile test skips"
    fi
    # On several workers (pytest-xdist, in the test extra): the 2-core build machine ran the suite in 989 s
    # against 1897 s in one process (session 39). Arguments naming -n or -p no:xdist are left to pytest.
    workers=${VELOXQUANT_TEST_WORKERS:-$(nproc 2>/dev/null || sysctl -n hw.ncpu 2>/dev/null || echo 1)}
    [ "$workers" -gt 4 ] && workers=4
    dist=()
    case " $* " in
    *" -n "* | *" -n="* | *" --numprocesses"* | *"no:xdist"*) ;;
    *) if [ "$workers" -gt 1 ] && "$PY" -c 'import xdist' >/dev/null 2>&1; then dist=(-n "$workers"); fi ;;
    esac
    exec "$PY" -m pytest -q ${dist[@]+"${dist[@]}"} "$@"
    ;;
esac
