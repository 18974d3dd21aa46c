#!/usr/bin/env bash
# Builds Citus into a private PostgreSQL prefix, cached per machine, for the
# embedded Citus cluster (TALLY_EMBEDDED_WORKERS) and the tests that run on
# a coordinator and workers. `make citus` runs it; docs/running.md says more.
#
# The prefix is ${XDG_CACHE_HOME:-$HOME/.cache}/tally/citus-<citus>-pg<version>,
# <version> the installed Debian postgresql-<major>'s; as root without
# XDG_CACHE_HOME, /var/cache/tally/citus-…: the server then runs as an
# unprivileged user (internal/embeddedpg), which cannot reach root's home. It holds copies of
# the installed server's binaries and libraries (PostgreSQL is relocatable:
# its pg_config and postgres find the prefix's directories), the server
# headers of exactly that version (postgresql-server-dev-<major>, fetched with
# apt-get download and unpacked, never installed, so that the server is never
# upgraded), and Citus built against them. Nothing is written outside the
# cache. A complete prefix is left alone: a second run takes a second.
#
# Needs gcc, make, the tarball (TALLY_CITUS_TARBALL, else
# ../shared/vendor/citus-<citus>.tar.gz beside the repository or, in a git
# worktree, beside its main checkout), and Debian's
# libzstd-dev, liblz4-dev, libkrb5-dev and libpq-dev.
set -euo pipefail

CITUS_VERSION=13.2.2
# The sha256 of the vendored tarball: `git archive` of Citus's tag v13.2.2.
CITUS_SHA256=dd2453caec20a830e5e63f1def5c5a98cb6f57ae510407cdcd800916fcdab430
PACKAGES=(libzstd-dev liblz4-dev libkrb5-dev libpq-dev)

repo=$(cd "$(dirname "$0")/../.." && pwd)
die() { echo "make citus: $*" >&2; exit 1; }

# The newest PostgreSQL major installed the Debian way, as the embedded
# cluster picks it (internal/embeddedpg: /usr/lib/postgresql/*/bin).
major=${PG_MAJOR:-$(find /usr/lib/postgresql -mindepth 3 -maxdepth 3 -path '*/bin/postgres' 2>/dev/null |
	awk -F/ '{print $5}' | sort -n | tail -1)}
[[ -n $major ]] || die "no PostgreSQL server in /usr/lib/postgresql: apt-get install postgresql"
version=$(dpkg-query -W -f='${Version}' "postgresql-$major" 2>/dev/null) ||
	die "postgresql-$major is not installed from Debian's package; this build needs its exact version"
[[ $major =~ ^(15|16|17)$ ]] || die "Citus $CITUS_VERSION supports PostgreSQL 15 to 17, not $major"

if [[ -n ${XDG_CACHE_HOME:-} ]]; then
	cache=$XDG_CACHE_HOME/tally
elif ((EUID == 0)); then
	cache=/var/cache/tally
else
	cache=$HOME/.cache/tally
fi
prefix=$cache/citus-$CITUS_VERSION-pg$version
if [[ -f $prefix/.complete ]]; then
	echo "citus: $CITUS_VERSION for PostgreSQL $version is built in $prefix"
	exit 0
fi

tarball=${TALLY_CITUS_TARBALL:-$repo/../shared/vendor/citus-$CITUS_VERSION.tar.gz}
if [[ -z ${TALLY_CITUS_TARBALL:-} && ! -f $tarball ]]; then
	# A git worktree: beside the main checkout instead.
	common=$(git -C "$repo" rev-parse --path-format=absolute --git-common-dir 2>/dev/null || true)
	[[ -n $common ]] && tarball=$(dirname "$common")/../shared/vendor/citus-$CITUS_VERSION.tar.gz
fi
[[ -f $tarball ]] || die "no Citus source at $tarball: set TALLY_CITUS_TARBALL to citus-$CITUS_VERSION.tar.gz"
sum=$(sha256sum "$tarball" | awk '{print $1}')
[[ $sum == "$CITUS_SHA256" ]] || die "$tarball has sha256 $sum, not Citus $CITUS_VERSION's $CITUS_SHA256"

missing=()
for p in "${PACKAGES[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$' || missing+=("$p")
done
((${#missing[@]} == 0)) || die "missing packages: apt-get install -y --no-install-recommends ${missing[*]}"
for tool in gcc make apt-get dpkg-deb; do
	command -v "$tool" >/dev/null || die "$tool is needed"
done

mkdir -p "$cache"
work=$(mktemp -d "$cache/.citus-build.XXXXXX")
trap 'rm -rf "$work"' EXIT
log=$work/build.log
echo "citus: building $CITUS_VERSION for PostgreSQL $version into $prefix (a few minutes; log: $log)"

# The server headers of exactly the installed version, unpacked.
(cd "$work" && apt-get download -qq "postgresql-server-dev-$major=$version") >>"$log" 2>&1 ||
	die "apt-get download postgresql-server-dev-$major=$version failed (run apt-get update?): $(tail -3 "$log")"
dpkg-deb -x "$work"/postgresql-server-dev-"$major"_*.deb "$work/dev"

# The prefix, built beside its final place and renamed into it when done.
p=$work/prefix
mkdir -p "$p/lib/postgresql/$major/bin" "$p/lib/postgresql/$major/lib" "$p/share/postgresql" "$p/include/postgresql"
cp -a "$work/dev/usr/." "$p/"
cp -a "/usr/lib/postgresql/$major/bin/." "$p/lib/postgresql/$major/bin/"
cp -a "/usr/lib/postgresql/$major/lib/." "$p/lib/postgresql/$major/lib/"
cp -a "/usr/share/postgresql/$major" "$p/share/postgresql/"
cp /usr/include/postgresql/*.h "$p/include/postgresql/"
pg_config=$p/lib/postgresql/$major/bin/pg_config
[[ $("$pg_config" --pkglibdir) == "$p/lib/postgresql/$major/lib" ]] ||
	die "the copied pg_config does not report the prefix (is PostgreSQL relocatable here?)"

tar -xzf "$tarball" -C "$work"
src=$(find "$work" -mindepth 1 -maxdepth 1 -type d -name 'citus*' | head -1)
[[ -n $src ]] || die "$tarball holds no citus directory"
build() {
	(cd "$src" &&
		./configure PG_CONFIG="$pg_config" --without-libcurl &&
		make -j"$(nproc)" with_llvm=no &&
		make install with_llvm=no) >>"$log" 2>&1
}
if ! build; then
	cp "$log" "$cache/citus-build.log"
	die "the build failed; its log is $cache/citus-build.log; last lines:
$(tail -20 "$log")"
fi
[[ -f $p/share/postgresql/$major/extension/citus.control && -f $p/lib/postgresql/$major/lib/citus.so ]] ||
	die "the build installed no citus.control or citus.so into the prefix"

echo "citus $CITUS_VERSION $CITUS_SHA256" >"$p/.complete"
rm -rf "$prefix"
mv "$p" "$prefix"
echo "citus: built in $prefix"
