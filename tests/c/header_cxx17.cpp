// rdist.h compiles on its own as C++17 (nothing included before it), with
// C linkage and the contract's constants. Needs no library.
#include "rdist.h"

#include <type_traits>

static_assert(sizeof(rdist_unique_id_t) == RDIST_UNIQUE_ID_BYTES, "unique id size");
static_assert(std::is_trivially_copyable_v<rdist_unique_id_t>, "unique id is plain bytes");
static_assert(RDIST_SUCCESS == 0 && RDIST_ERR_INTERNAL == 11, "result codes");
static_assert(RDIST_FLOAT16 == 6 && RDIST_FLOAT32 == 7 && RDIST_BFLOAT16 == 9, "NCCL dtype values");
static_assert(RDIST_SUM == 0 && RDIST_AVG == 4, "NCCL op values");
static_assert(std::is_same_v<decltype(&rdist_allreduce),
                             rdist_result_t (*)(const void*, void*, size_t, rdist_dtype_t, rdist_op_t,
                                                rdist_comm_t*, void*)>,
              "rdist_allreduce signature");
static_assert(std::is_same_v<decltype(&rdist_last_error), const char* (*)()>, "rdist_last_error signature");

int main() {
  rdist_unique_id_t id{};
  return id.internal[0];
}
