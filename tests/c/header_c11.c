/* rdist.h compiles on its own as C11 (nothing included before it) and its
 * constants are the contract's. Built with -std=c11 -Wall -Wextra
 * -Wpedantic -Werror; needs no library. */
#include "rdist.h"

_Static_assert(sizeof(rdist_unique_id_t) == RDIST_UNIQUE_ID_BYTES, "unique id size");
_Static_assert(RDIST_SUCCESS == 0 && RDIST_ERR_INTERNAL == 11, "result codes");
_Static_assert(RDIST_FLOAT16 == 6 && RDIST_FLOAT32 == 7 && RDIST_BFLOAT16 == 9, "NCCL dtype values");
_Static_assert(RDIST_SUM == 0 && RDIST_AVG == 4, "NCCL op values");
_Static_assert(RDIST_SPLIT_NOCOLOR == -1, "no color");
/* The declarations have the contract's types (unevaluated: no link needed). */
typedef rdist_result_t (*allreduce_fn)(const void*, void*, size_t, rdist_dtype_t, rdist_op_t, rdist_comm_t*, void*);
typedef rdist_result_t (*init_rank_fn)(rdist_comm_t**, int, rdist_unique_id_t, int, const rdist_options_t*);
_Static_assert(_Generic(&rdist_allreduce, allreduce_fn: 1, default: 0), "rdist_allreduce signature");
_Static_assert(_Generic(&rdist_comm_init_rank, init_rank_fn: 1, default: 0), "rdist_comm_init_rank signature");

int main(void) {
  rdist_unique_id_t id = {{0}};
  return id.internal[0] + (RDIST_VERSION_MAJOR * 10000 + RDIST_VERSION_MINOR * 100 + RDIST_VERSION_PATCH < 0);
}
