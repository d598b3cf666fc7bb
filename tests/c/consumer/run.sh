#!/usr/bin/env bash
# Drives the installed-package ctests (registered in tests/c/CMakeLists.txt,
# which sets the RDIST_TEST_* variables, CC and CXX):
#
#   run.sh install      BUILD_DIR PREFIX  install the build into PREFIX, check the layout
#   run.sh cmake        PREFIX WORK       build this project with find_package(rdist), run it
#   run.sh cmake-static PREFIX WORK       the same with RDIST_STATIC=ON (librdist.a)
#   run.sh subdirectory SOURCE WORK       build this project with add_subdirectory(SOURCE), run it
#   run.sh pkgconfig    PREFIX WORK       build consumer.c/.cpp with `pkg-config rdist` flags, run
#
# Programs run as 2-rank jobs through the installed rdistrun.
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
  "$cmake" -DLIB="$lib/librdist.so" -DHEADER="$prefix/include/rdist.h" -DNM="${RDIST_TEST_NM:-nm}" \
    -DREADELF="${RDIST_TEST_READELF:-readelf}" -DSONAME="$soname" \
    -P "$RDIST_TEST_SOURCE/tests/c/check_exports.cmake" 2>&1 | tail -1
  echo "installed into $prefix:"
  (cd "$prefix" && find . -mindepth 1 \( -type f -o -type l \) | sort | sed 's/^/  /')
  ;;
cmake | cmake-static | subdirectory)
  work="$3"
  how=(-DCMAKE_PREFIX_PATH="$2" -DCMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY=ON)
  [ "$mode" = subdirectory ] && how=(-DRDIST_SOURCE_DIR="$2")
  static=OFF
  [ "$mode" = cmake-static ] && static=ON
  rm -rf "$work"
  "$cmake" -S "$here" -B "$work" -G "${RDIST_TEST_GENERATOR:-Unix Makefiles}" -DCMAKE_BUILD_TYPE=Debug \
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
pkgconfig)
  prefix="$2" work="$3"
  rm -rf "$work" && mkdir -p "$work"
  export PKG_CONFIG_PATH="$prefix/$libdir/pkgconfig"
  [ "$(pkg-config --modversion rdist)" = "$version" ] || fail "pkg-config --modversion rdist"
  read -r -a cflags <<<"$(pkg-config --cflags rdist)"
  read -r -a libs <<<"$(pkg-config --libs rdist)"
  rpath="-Wl,-rpath,$(pkg-config --variable=libdir rdist)"
  echo "pkg-config rdist: ${cflags[*]} ${libs[*]}"
  "${CC:-cc}" -std=c11 -Wall -Wextra -Wpedantic -Werror "${cflags[@]}" "$here/consumer.c" -o "$work/consumer_c" \
    "${libs[@]}" "$rpath"
  "${CXX:-c++}" -std=c++17 -Wall -Wextra -Wpedantic -Werror "${cflags[@]}" "$here/consumer.cpp" \
    -o "$work/consumer_cpp" "${libs[@]}" "$rpath"
  for p in consumer_c consumer_cpp; do run_job "$prefix/bin/rdistrun" "$work/$p"; done
  ;;
*)
  fail "unknown mode $mode"
  ;;
esac
