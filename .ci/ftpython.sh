#!/usr/bin/env bash
# .ci/ftpython.sh - build a free-threaded (no-GIL) CPython 3.13 for the CI's free-threaded leg.
#
# Usage:  bash .ci/ftpython.sh PREFIX      -> PREFIX/bin/python3.13t, built with --disable-gil
#
# Debian ships no free-threaded interpreter, so this builds one from Debian's python3.13 *source*
# package (the upstream tarball inside it), fetched with apt-get source through a private apt
# configuration under PREFIX/_work/apt (the system's apt sources and state are not touched; the
# mirror is the one the system's own sources use): sid first, then trixie. Build dependencies
# (-dev packages) come from the system's own apt sources. No configure flags beyond --disable-gil
# (no PGO/LTO), like a pyenv build. Idempotent: with the interpreter in place it only re-checks.
# About 4 minutes on an idle 2-core machine, up to 15 on a busy one.
# Knobs: FT_JOBS (make -j, default nproc), FT_DEBIAN_MIRROR, FT_DEBIAN_KEYRING, FT_PY_TARBALL
# (a local Python-3.13.x.tar.xz instead of Debian's).
# The packages (torch, torchvision, ...) and the venv are the leg's business: .ci/free-threaded.
set -euo pipefail

PREFIX=${1:?usage: ftpython.sh PREFIX}
PREFIX=$(mkdir -p "$PREFIX" && cd "$PREFIX" && pwd)
WORK=$PREFIX/_work
PY=$PREFIX/bin/python3.13t
FT_JOBS=${FT_JOBS:-$(nproc)}
T0=$(date +%s)

say() { printf '[ftpython %4ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
die() { say "ERROR: $*"; exit 1; }
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"

say "prefix: $PREFIX"
mkdir -p "$WORK"

# ---------------------------------------------------------------- 1. build dependencies
build_deps="build-essential pkg-config libssl-dev zlib1g-dev libffi-dev libbz2-dev liblzma-dev
 libsqlite3-dev libreadline-dev libncurses-dev uuid-dev xz-utils"
if [ ! -x "$PY" ]; then
    missing=""
    for p in $build_deps; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing="$missing $p"
    done
    if [ -n "$missing" ]; then
        say "installing build dependencies from the system's apt sources:$missing"
        $SUDO apt-get update -qq
        # shellcheck disable=SC2086
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing
    else
        say "build dependencies: already installed"
    fi
fi

# ---------------------------------------------------------------- 2. CPython source
debian_mirror() {
    if [ -n "${FT_DEBIAN_MIRROR:-}" ]; then echo "$FT_DEBIAN_MIRROR"; return; fi
    local u
    # shellcheck disable=SC2016  # $(...) here is apt's own format syntax
    u=$(apt-get indextargets --format '$(REPO_URI) $(ORIGIN) $(LABEL)' 2>/dev/null \
        | awk '$2=="Debian" && $3=="Debian" {print $1; exit}' || true)
    if [ -z "$u" ]; then
        u=$( { grep -hE '^[[:space:]]*URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}'
               grep -hE '^[[:space:]]*deb(-src)?[[:space:]]' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
                 | sed -E 's/\[[^]]*\]//' | awk '{print $2}'; } | grep -E '/debian/?$' | head -1 || true)
    fi
    echo "${u%/}"
}

fetch_source() {   # leaves one Python-3.13.*.tar.* (or Debian .orig.tar.*) in $WORK/src
    mkdir -p "$WORK/src"
    if [ -n "${FT_PY_TARBALL:-}" ]; then
        cp "$FT_PY_TARBALL" "$WORK/src/"; return
    fi
    local mirror apt="$WORK/apt"
    mirror=$(debian_mirror)
    [ -n "$mirror" ] || die "no Debian mirror found in the system's apt sources; set FT_DEBIAN_MIRROR"
    say "fetching Debian's python3.13 source package via a private apt config ($apt)"
    mkdir -p "$apt/lists/partial" "$apt/state" "$apt/cache/archives/partial" "$apt/preferences.d"
    local key=${FT_DEBIAN_KEYRING:-/usr/share/keyrings/debian-archive-keyring.gpg} status
    status=$(apt-config dump 2>/dev/null | awk -F'"' '$1 ~ /^Dir::State::status /{print $2}')
    {
        echo "deb-src [signed-by=$key] $mirror sid main"
        echo "deb-src [signed-by=$key] $mirror trixie main"
    } > "$apt/sources.list"
    cat > "$apt/apt.conf" <<EOF
Dir::Etc::SourceList "$apt/sources.list";
Dir::Etc::SourceParts "-";
Dir::Etc::PreferencesParts "$apt/preferences.d";
Dir::State "$apt/state";
Dir::State::Lists "$apt/lists";
Dir::State::status "${status:-/var/lib/dpkg/status}";
Dir::Cache "$apt/cache";
APT::Sandbox::User "root";
EOF
    export APT_CONFIG="$apt/apt.conf"
    # one suite failing (e.g. a key the system keyring lacks) is fine as long as some source is found
    apt-get update -qq 2>&1 | grep -vE '^(W: |N: )' || true
    local versions v
    versions=$(apt-cache showsrc python3.13 2>/dev/null | awk '/^Version:/{print $2}' | sort -u -V -r)
    [ -n "$versions" ] || die "apt-cache showsrc python3.13 found nothing (mirror: $mirror)"
    for v in $versions; do
        say "trying python3.13=$v"
        if (cd "$WORK/src" && apt-get source -qq --download-only "python3.13=$v" >/dev/null 2>"$WORK/src/apt-source.err"); then
            say "got python3.13 $v"
            unset APT_CONFIG; return
        fi
        say "  not downloadable: $(grep -m1 -oE '(404|403)[^[]*' "$WORK/src/apt-source.err" || head -c 200 "$WORK/src/apt-source.err")"
        rm -f "$WORK/src/python3.13_${v%-*}"* 2>/dev/null || true
    done
    unset APT_CONFIG
    die "no python3.13 source version could be downloaded"
}

find_tarball() {   # newest upstream or Debian .orig tarball in $WORK/src, or nothing
    local f
    for f in "$WORK"/src/Python-3.13*.tar.* "$WORK"/src/python3.13_*.orig.tar.*; do
        case $f in *'*'*|*.asc) ;; *) echo "$f" ;; esac
    done | sort -V | tail -1
}

if [ -x "$PY" ] && "$PY" -c 'import sys; sys.exit(sys._is_gil_enabled())' 2>/dev/null; then
    say "interpreter: $PY already built ($("$PY" -VV | head -1))"
else
    tarball=$(find_tarball)
    if [ -z "$tarball" ]; then
        fetch_source
        tarball=$(find_tarball)
        [ -n "$tarball" ] || die "no source tarball in $WORK/src"
    else
        say "source: $tarball already downloaded"
    fi
    srcdir=$WORK/build/$(basename "$tarball" | sed -E 's/\.tar\..*$//')
    if [ ! -f "$srcdir/configure" ]; then
        say "unpacking $(basename "$tarball")"
        rm -rf "$srcdir"; mkdir -p "$srcdir"
        tar xf "$tarball" -C "$srcdir" --strip-components=1
    fi
    cd "$srcdir"
    if [ ! -f Makefile ] || ! grep -q -- '--disable-gil' config.log 2>/dev/null; then
        say "configure --disable-gil --prefix=$PREFIX (log: $srcdir/ft-configure.log)"
        ./configure --disable-gil --prefix="$PREFIX" --with-ensurepip=install > ft-configure.log 2>&1 \
            || { tail -30 ft-configure.log; die "configure failed"; }
    fi
    say "make -j$FT_JOBS (log: $srcdir/ft-make.log)"
    make -j"$FT_JOBS" > ft-make.log 2>&1 || { tail -40 ft-make.log; die "make failed"; }
    grep -A8 'necessary bits to build these optional modules were not found' ft-make.log || true
    grep -A4 'Failed to build these modules' ft-make.log && die "some stdlib modules failed to build"
    say "make install (log: $srcdir/ft-install.log)"
    make install > ft-install.log 2>&1 || { tail -40 ft-install.log; die "make install failed"; }
    cd "$PREFIX"
    "$PY" -c 'import sys, ssl, zlib, bz2, lzma, sqlite3, ctypes, readline, uuid; sys.exit(sys._is_gil_enabled())' \
        || die "$PY: missing stdlib modules or GIL enabled"
    rm -rf "$WORK/build"   # ~500 MB of objects; the source tarball stays in $WORK/src
    say "interpreter: $("$PY" -VV | head -1)"
fi

