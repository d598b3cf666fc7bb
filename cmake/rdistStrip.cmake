# Run by `cmake --install` (install(CODE) in CMakeLists.txt) after the files
# are copied: strips the installed librdist.so.<version> and rdistrun, and
# librdist.a's debug info. With _rdist_debug_info ON the library's debug
# info is first kept in <libdir>/.debug/librdist.so.<version>.debug and the
# stripped library points at it (.gnu_debuglink; gdb looks in .debug/ next
# to the library). Set by the caller: _rdist_objcopy, _rdist_strip,
# _rdist_debug_info, _rdist_libdir, _rdist_bindir, _rdist_realname.

function(_rdist_dest out dir)
  if(IS_ABSOLUTE "${dir}")
    set(${out} "$ENV{DESTDIR}${dir}" PARENT_SCOPE)
  else()
    set(${out} "$ENV{DESTDIR}${CMAKE_INSTALL_PREFIX}/${dir}" PARENT_SCOPE)
  endif()
endfunction()

function(_rdist_run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    string(REPLACE ";" " " cmd "${ARGN}")
    message(FATAL_ERROR "rdist: ${cmd} failed: ${err}")
  endif()
endfunction()

_rdist_dest(_lib "${_rdist_libdir}")
_rdist_dest(_bin "${_rdist_bindir}")
set(_so "${_lib}/${_rdist_realname}")

if(_rdist_debug_info)
  set(_debug "${_lib}/.debug/${_rdist_realname}.debug")
  file(MAKE_DIRECTORY "${_lib}/.debug")
  _rdist_run("${_rdist_objcopy}" --only-keep-debug "${_so}" "${_debug}")
  file(CHMOD "${_debug}" PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ)
  # --add-gnu-debuglink finds the file by this path and records its name.
  _rdist_run("${_rdist_objcopy}" --strip-unneeded "--add-gnu-debuglink=${_debug}" "${_so}")
  list(APPEND CMAKE_INSTALL_MANIFEST_FILES "${_debug}")
  message(STATUS "Stripped: ${_so} (debug info: ${_debug})")
else()
  _rdist_run("${_rdist_strip}" --strip-unneeded "${_so}")
  message(STATUS "Stripped: ${_so}")
endif()
_rdist_run("${_rdist_strip}" --strip-debug "${_lib}/librdist.a")
_rdist_run("${_rdist_strip}" --strip-unneeded "${_bin}/rdistrun")
