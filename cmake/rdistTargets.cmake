# Defines rdist's imported targets. Included by the top-level CMakeLists.txt
# (build tree, add_subdirectory) and by rdistConfig.cmake (install tree,
# find_package), so both ways give the same targets:
#
#   rdist::rdist         librdist.a when RDIST_STATIC is ON, else librdist.so
#   rdist::rdist_shared  librdist.so (SONAME librdist.so.<major>)
#   rdist::rdist_static  librdist.a, plus the system libraries Rust's std needs
#   rdist::rdistrun      the launcher (rdistrun --nproc-per-node N prog)
#
# Every library target carries the include directory (rdist.h, rdist.hpp;
# rdist.hpp needs C++17).

# What `rustc --print native-static-libs` lists for librdist.a on Linux.
set(RDIST_STATIC_SYSTEM_LIBS gcc_s util rt pthread m dl)

function(rdist_define_targets)
  cmake_parse_arguments(ARG "GLOBAL" "SHARED;SONAME;STATIC;INCLUDE_DIR;RDISTRUN" "" ${ARGN})
  set(scope "")
  if(ARG_GLOBAL)
    set(scope GLOBAL)
  endif()
  if(RDIST_STATIC)
    set(default_kind STATIC)
  else()
    set(default_kind SHARED)
  endif()
  foreach(target rdist_shared:SHARED rdist_static:STATIC rdist:${default_kind})
    string(REPLACE ":" ";" parts "${target}")
    list(GET parts 0 name)
    list(GET parts 1 kind)
    add_library(rdist::${name} ${kind} IMPORTED ${scope})
    set_target_properties(rdist::${name} PROPERTIES
      INTERFACE_INCLUDE_DIRECTORIES "${ARG_INCLUDE_DIR}"
      IMPORTED_LINK_INTERFACE_LANGUAGES C)
    if(kind STREQUAL "SHARED")
      set_target_properties(rdist::${name} PROPERTIES
        IMPORTED_LOCATION "${ARG_SHARED}"
        IMPORTED_SONAME "${ARG_SONAME}")
    else()
      set_target_properties(rdist::${name} PROPERTIES
        IMPORTED_LOCATION "${ARG_STATIC}"
        INTERFACE_LINK_LIBRARIES "${RDIST_STATIC_SYSTEM_LIBS}")
    endif()
  endforeach()
  add_executable(rdist::rdistrun IMPORTED ${scope})
  set_target_properties(rdist::rdistrun PROPERTIES IMPORTED_LOCATION "${ARG_RDISTRUN}")
endfunction()
