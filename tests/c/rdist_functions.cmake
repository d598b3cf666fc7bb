# rdist_header_functions(<header> <out-var>): the names of the functions a
# header declares, one per declaration `<type> rdist_name(` at the start of
# a line (doc comments that mention rdist_foo() do not count), sorted.
function(rdist_header_functions header out)
  file(STRINGS "${header}" lines REGEX "^[A-Za-z_][A-Za-z0-9_ ]*[ *]rdist_[a-z_]+\\(")
  set(names "")
  foreach(line IN LISTS lines)
    string(REGEX MATCH "rdist_[a-z_]+\\(" name "${line}")
    string(REGEX REPLACE "\\($" "" name "${name}")
    list(APPEND names "${name}")
  endforeach()
  list(REMOVE_DUPLICATES names)
  list(SORT names)
  set(${out} "${names}" PARENT_SCOPE)
endfunction()
