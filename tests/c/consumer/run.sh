#!/usr/bin/env bash
# Drives the installed-package ctests (registered in tests/c/CMakeLists.txt,
# which sets the RDIST_TEST_* variables, CC and CXX):
#
#   run.sh install      BUILD_DIR PREFIX  install the build into PREFIX, check the layout
#   run.sh cmake        PREFIX WORK       build this project with find_package(rdist), run it
#   run.sh cmake-static PREFIX WORK       the same with RDIST_STATIC=ON (librdist.a)
#   run.sh subdirectory SOURCE WORK       build this project with add_subdirectory(SOURCE), run it
#   run.sh pkgconfig    PREFIX WORK       build consumer.c/.cpp with `pkg-config rdist` flags, run
#   run.sh pkgconfig-build DIR WORK       the same against the uninstalled cargo build in DIR
#                                         (target/<profile>: DIR/pkgconfig/rdist.pc from build.rs)
#
# Programs run as 2-rank jobs through the installed rdistrun (DIR/rdistrun
# for pkgconfig-build). The pkg-config programs are built with nothing but
# `pkg-config --cflags --libs rdist` and run with LD_LIBRARY_PATH unset: the
# rpath in the .pc's Libs must find the library.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
mode="$1"
cmake="${RDIST_TEST_CMAKE:-cmake}"
libdir="${RDIST_TEST_LIBDIR:-lib}"
version="${RDIST_TEST_VERSION:?}"
soname="${RDIST_TEST_SONAME:?}"

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

# Runs PROGRAM as a 2-rank job through RDISTRUN and checks both ranks said ok.
run_job() {
  local rdistrun="$1" program="$2" out
  out="$("$rdistrun" --nproc-per-node 2 "$program" 2>&1)" || fail "$program: $out"
  echo "$out"
  [ "$(grep -c ': ok' <<<"$out")" -eq 2 ] || fail "$program: expected two ok lines"
}

case "$mode" in
install)
  build="$2" prefix="$3"
  rm -rf "$prefix"
  "$cmake" --install "$build" --prefix "$prefix" >/dev/null
  lib="$prefix/$libdir"
  for f in "$lib/librdist.so.$version" "$lib/librdist.a" "$prefix/include/rdist.h" \
    "$prefix/include/rdist.hpp" "$lib/cmake/rdist/rdistConfig.cmake" \
    "$lib/cmake/rdist/rdistConfigVersion.cmake" "$lib/cmake/rdist/rdistTargets.cmake" \
    "$lib/pkgconfig/rdist.pc" "$prefix/bin/rdistrun"; do
    [ -f "$f" ] && [ ! -L "$f" ] || fail "$f is missing or not a regular file"
  done
  [ -x "$prefix/bin/rdistrun" ] && [ -x "$lib/librdist.so.$version" ] || fail "not executable"
  [ "$(readlink "$lib/$soname")" = "librdist.so.$version" ] || fail "$soname -> $(readlink "$lib/$soname")"
  [ "$(readlink "$lib/librdist.so")" = "$soname" ] || fail "librdist.so -> $(readlink "$lib/librdist.so")"
  # Installed stripped: no debug info, no symbol table (only .dynsym).
  for f in "$lib/librdist.so.$version" "$prefix/bin/rdistrun"; do
    sections="$("${RDIST_TEST_READELF:-readelf}" -S -W "$f")"
    ! grep -q -E ' \.(debug_info|symtab) ' <<<"$sections" || fail "$f is not stripped"
  done
  echo "librdist.so.$version: $(stat -c %s "$lib/librdist.so.$version") bytes (stripped)"
  "$cmake" -DLIB="$lib/librdist.so" -DHEADER="$prefix/include/rdist.h" -DNM="${RDIST_TEST_NM:-nm}" \
    -DREADELF="${RDIST_TEST_READELF:-readelf}" -DSONAME="$soname" \
    -P "$RDIST_TEST_SOURCE/tests/c/check_exports.cmake" 2>&1 | tail -1
  echo "installed into $prefix:"
  (cd "$prefix" && find . -mindepth 1 \( -type f -o -type l \) | sort | sed 's/^/  /')
  ;;
cmake | cmake-static | subdirectory)
  work="$3"
  how=(-DCMAKE_PREFIX_PATH="$2" -DCMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY=ON -DCMAKE_BUILD_TYPE=Debug)
  if [ "$mode" = subdirectory ]; then
    # The outer build's cargo target directory and build type: nothing to compile again.
    how=(-DRDIST_SOURCE_DIR="$2" -DCMAKE_BUILD_TYPE="${RDIST_TEST_BUILD_TYPE:-Release}")
    [ -z "${RDIST_TEST_CARGO_TARGET_DIR:-}" ] || how+=(-DRDIST_CARGO_TARGET_DIR="$RDIST_TEST_CARGO_TARGET_DIR")
  fi
  static=OFF
  [ "$mode" = cmake-static ] && static=ON
  rm -rf "$work"
  "$cmake" -S "$here" -B "$work" -G "${RDIST_TEST_GENERATOR:-Unix Makefiles}" \
    "${how[@]}" -DRDIST_STATIC="$static" -DCMAKE_C_COMPILER="${CC:-cc}" -DCMAKE_CXX_COMPILER="${CXX:-c++}" >/dev/null
  "$cmake" --build "$work" -j2 >/dev/null || "$cmake" --build "$work" -j1
  rdistrun="$(cat "$work/rdistrun-path.txt")"
  if [ "$mode" != subdirectory ]; then
    [ "$rdistrun" = "$2/bin/rdistrun" ] || fail "rdist::rdistrun is $rdistrun, not the installed one"
  fi
  needs_rdist=$( ("${RDIST_TEST_READELF:-readelf}" -d "$work/consumer_c" | grep -c "NEEDED.*$soname") || true)
  if [ "$static" = ON ]; then
    [ "$needs_rdist" -eq 0 ] || fail "RDIST_STATIC=ON but consumer_c needs $soname"
  else
    [ "$needs_rdist" -eq 1 ] || fail "consumer_c does not need $soname"
  fi
  for p in consumer_c consumer_cpp; do run_job "$rdistrun" "$work/$p"; done
  ;;
pkgconfig | pkgconfig-build)
  work="$3"
  rm -rf "$work" && mkdir -p "$work"
  if [ "$mode" = pkgconfig ]; then
    export PKG_CONFIG_PATH="$2/$libdir/pkgconfig"
    rdistrun="$2/bin/rdistrun"
  else
    export PKG_CONFIG_PATH="$2/pkgconfig"
    rdistrun="$2/rdistrun"
    [ "$(pkg-config --variable=libdir rdist)" = "$2" ] || fail "rdist.pc's libdir is not $2"
  fi
  [ -f "$PKG_CONFIG_PATH/rdist.pc" ] || fail "$PKG_CONFIG_PATH/rdist.pc is missing"
  [ "$(pkg-config --modversion rdist)" = "$version" ] || fail "pkg-config --modversion rdist"
  read -r -a flags <<<"$(pkg-config --cflags --libs rdist)"
  echo "pkg-config --cflags --libs rdist: ${flags[*]}"
  "${CC:-cc}" -std=c11 -Wall -Wextra -Wpedantic -Werror "$here/consumer.c" -o "$work/consumer_c" "${flags[@]}"
  "${CXX:-c++}" -std=c++17 -Wall -Wextra -Wpedantic -Werror "$here/consumer.cpp" -o "$work/consumer_cpp" \
    "${flags[@]}"
  unset LD_LIBRARY_PATH
  for p in consumer_c consumer_cpp; do run_job "$rdistrun" "$work/$p"; done
  ;;
*)
  fail "unknown mode $mode"
  ;;
esac
