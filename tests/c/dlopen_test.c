/* Loads librdist.so at run time (argv[1]), resolves every function that
 * rdist.h declares (the list is generated from the header at configure
 * time: rdist_functions.h) and runs a 2-rank allreduce through the
 * pointers. Not linked with librdist. */
#include "rdist.h"
#include "rdist_functions.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Pointer types, checked against the header's declarations (unevaluated,
 * so nothing is linked). */
typedef rdist_result_t (*init_fn)(rdist_comm_t**, const char*, int, int, const rdist_options_t*);
typedef rdist_result_t (*query_fn)(const rdist_comm_t*, int*);
typedef rdist_result_t (*allreduce_fn)(const void*, void*, size_t, rdist_dtype_t, rdist_op_t, rdist_comm_t*, void*);
typedef rdist_result_t (*destroy_fn)(rdist_comm_t*);
typedef const char* (*last_error_fn)(void);
_Static_assert(_Generic(&rdist_init, init_fn: 1, default: 0), "rdist_init");
_Static_assert(_Generic(&rdist_comm_rank, query_fn: 1, default: 0), "rdist_comm_rank");
_Static_assert(_Generic(&rdist_comm_size, query_fn: 1, default: 0), "rdist_comm_size");
_Static_assert(_Generic(&rdist_allreduce, allreduce_fn: 1, default: 0), "rdist_allreduce");
_Static_assert(_Generic(&rdist_comm_destroy, destroy_fn: 1, default: 0), "rdist_comm_destroy");
_Static_assert(_Generic(&rdist_last_error, last_error_fn: 1, default: 0), "rdist_last_error");

static void* pointers[RDIST_FUNCTION_COUNT];

/* Where the resolved address of `name` is stored; it is copied into a
 * typed pointer with memcpy (ISO C has no object-to-function pointer cast). */
static const void* fn_slot(const char* name) {
  for (int i = 0; i < RDIST_FUNCTION_COUNT; i++)
    if (strcmp(rdist_function_names[i], name) == 0) return &pointers[i];
  fprintf(stderr, "%s is not declared in rdist.h\n", name);
  exit(1);
}

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s path/to/librdist.so\n", argv[0]);
    return 2;
  }
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    fprintf(stderr, "dlopen: %s\n", dlerror());
    return 1;
  }
  int missing = 0;
  for (int i = 0; i < RDIST_FUNCTION_COUNT; i++) {
    void* p = dlsym(lib, rdist_function_names[i]);
    if (p == NULL) {
      fprintf(stderr, "dlsym(%s): %s\n", rdist_function_names[i], dlerror());
      missing++;
    }
    pointers[i] = p;
  }
  if (missing != 0) return 1;
  _Static_assert(sizeof(void*) == sizeof(init_fn), "function pointers are pointer-sized");

  init_fn init;
  query_fn comm_rank, comm_size;
  allreduce_fn allreduce;
  destroy_fn destroy;
  last_error_fn last_error;
  memcpy(&init, fn_slot("rdist_init"), sizeof init);
  memcpy(&comm_rank, fn_slot("rdist_comm_rank"), sizeof comm_rank);
  memcpy(&comm_size, fn_slot("rdist_comm_size"), sizeof comm_size);
  memcpy(&allreduce, fn_slot("rdist_allreduce"), sizeof allreduce);
  memcpy(&destroy, fn_slot("rdist_comm_destroy"), sizeof destroy);
  memcpy(&last_error, fn_slot("rdist_last_error"), sizeof last_error);

  rdist_comm_t* comm = NULL;
  int rank = -1, size = -1;
  if (init(&comm, "env://", -1, -1, NULL) != RDIST_SUCCESS || comm_rank(comm, &rank) != RDIST_SUCCESS ||
      comm_size(comm, &size) != RDIST_SUCCESS) {
    fprintf(stderr, "init: %s\n", last_error());
    return 1;
  }
  double x[3] = {rank, 1.0, -rank};
  if (allreduce(x, x, 3, RDIST_FLOAT64, RDIST_SUM, comm, NULL) != RDIST_SUCCESS) {
    fprintf(stderr, "allreduce: %s\n", last_error());
    return 1;
  }
  const double ranks = size * (size - 1) / 2.0;
  if (x[0] != ranks || x[1] != size || x[2] != -ranks) {
    fprintf(stderr, "allreduce gave %g %g %g\n", x[0], x[1], x[2]);
    return 1;
  }
  if (destroy(comm) != RDIST_SUCCESS) return 1;
  dlclose(lib);
  printf("rank %d: resolved all %d functions of rdist.h; allreduce ok\n", rank, RDIST_FUNCTION_COUNT);
  return 0;
}
