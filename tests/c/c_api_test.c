/* Every collective through the C API, as a multi-rank job under rdistrun
 * (any world size >= 2; ctest runs 3): each dtype, each op, in-place
 * variants, every non-blocking twin, a group with a send/recv swap, split,
 * unique-id bootstrap and abort. Results are checked against references
 * computed here. Built with -Wall -Wextra -Wpedantic -Werror. */
#include "rdist.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int rank = -1, size = -1;

#define CHECK(call)                                                                     \
  do {                                                                                  \
    rdist_result_t rc_ = (call);                                                        \
    if (rc_ != RDIST_SUCCESS) {                                                         \
      fprintf(stderr, "rank %d: %s:%d: %s failed: %s: %s\n", rank, __FILE__, __LINE__, \
              #call, rdist_result_string(rc_), rdist_last_error());                     \
      exit(1);                                                                          \
    }                                                                                   \
  } while (0)

#define EXPECT(cond, ...)                                                              \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      fprintf(stderr, "rank %d: %s:%d: check failed: %s: ", rank, __FILE__, __LINE__, \
              #cond);                                                                  \
      fprintf(stderr, __VA_ARGS__);                                                    \
      fprintf(stderr, "\n");                                                           \
      exit(2);                                                                         \
    }                                                                                  \
  } while (0)

/* ---- element access for every dtype (values are small integers, exact in
 * every type, float16 and bfloat16 included) ---- */

static size_t dtype_size(rdist_dtype_t t) {
  switch (t) {
    case RDIST_INT8: case RDIST_UINT8: case RDIST_BOOL: return 1;
    case RDIST_FLOAT16: case RDIST_BFLOAT16: case RDIST_INT16: case RDIST_UINT16: return 2;
    case RDIST_INT32: case RDIST_UINT32: case RDIST_FLOAT32: return 4;
    default: return 8;
  }
}

static uint32_t float_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float bits_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* binary16 for values with at most 11 significant bits (exact). */
static uint16_t to_f16(float f) {
  uint32_t u = float_bits(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  int exp = (int)((u >> 23) & 0xff);
  if (exp == 0) return (uint16_t)sign;
  return (uint16_t)(sign | ((uint32_t)(exp - 127 + 15) << 10) | ((u >> 13) & 0x3ffu));
}
static float from_f16(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  if (exp == 0) return bits_float(sign);
  return bits_float(sign | ((exp - 15 + 127) << 23) | ((uint32_t)(h & 0x3ffu) << 13));
}

static void put(void* buf, rdist_dtype_t t, size_t i, double v) {
  switch (t) {
    case RDIST_INT8: ((int8_t*)buf)[i] = (int8_t)v; break;
    case RDIST_UINT8: ((uint8_t*)buf)[i] = (uint8_t)v; break;
    case RDIST_INT32: ((int32_t*)buf)[i] = (int32_t)v; break;
    case RDIST_UINT32: ((uint32_t*)buf)[i] = (uint32_t)v; break;
    case RDIST_INT64: ((int64_t*)buf)[i] = (int64_t)v; break;
    case RDIST_UINT64: ((uint64_t*)buf)[i] = (uint64_t)v; break;
    case RDIST_FLOAT16: ((uint16_t*)buf)[i] = to_f16((float)v); break;
    case RDIST_FLOAT32: ((float*)buf)[i] = (float)v; break;
    case RDIST_FLOAT64: ((double*)buf)[i] = v; break;
    case RDIST_BFLOAT16: ((uint16_t*)buf)[i] = (uint16_t)(float_bits((float)v) >> 16); break;
    case RDIST_INT16: ((int16_t*)buf)[i] = (int16_t)v; break;
    case RDIST_UINT16: ((uint16_t*)buf)[i] = (uint16_t)v; break;
    case RDIST_BOOL: ((uint8_t*)buf)[i] = v != 0 ? 5 : 0; break; /* any nonzero byte is true */
  }
}

static double get(const void* buf, rdist_dtype_t t, size_t i) {
  switch (t) {
    case RDIST_INT8: return ((const int8_t*)buf)[i];
    case RDIST_UINT8: return ((const uint8_t*)buf)[i];
    case RDIST_INT32: return ((const int32_t*)buf)[i];
    case RDIST_UINT32: return ((const uint32_t*)buf)[i];
    case RDIST_INT64: return (double)((const int64_t*)buf)[i];
    case RDIST_UINT64: return (double)((const uint64_t*)buf)[i];
    case RDIST_FLOAT16: return from_f16(((const uint16_t*)buf)[i]);
    case RDIST_FLOAT32: return ((const float*)buf)[i];
    case RDIST_FLOAT64: return ((const double*)buf)[i];
    case RDIST_BFLOAT16: return bits_float((uint32_t)((const uint16_t*)buf)[i] << 16);
    case RDIST_INT16: return ((const int16_t*)buf)[i];
    case RDIST_UINT16: return ((const uint16_t*)buf)[i];
    case RDIST_BOOL: return ((const uint8_t*)buf)[i];
  }
  return -1;
}

/* What rank r contributes at index i: 1..5 times (r + 1). */
static double val(int r, size_t i) { return (double)((r + 1) * (int)(i % 5 + 1)); }

static void* alloc(size_t n, rdist_dtype_t t) {
  void* p = calloc(n ? n : 1, dtype_size(t));
  EXPECT(p != NULL, "out of memory");
  return p;
}

static double sum_of_ranks(size_t i) {
  double s = 0;
  for (int r = 0; r < size; r++) s += val(r, i);
  return s;
}

/* The 0.2 types and bitwise reductions against references computed here. */
static void test_new_types_and_bitwise_ops(rdist_comm_t* comm) {
  enum { N = 100 };
  int16_t a[N], want16[N];
  uint8_t b[N], any[N], all[N];
  for (int i = 0; i < N; i++) {
    a[i] = (int16_t)((rank + 1) * (i + 1) * 37);
    b[i] = (uint8_t)((rank + i) % 3 == 0 ? 0 : 200); /* 200: true */
  }
  /* int16 sum, and bor on the same values */
  for (int i = 0; i < N; i++) {
    int s = 0;
    for (int r = 0; r < size; r++) s += (r + 1) * (i + 1) * 37;
    want16[i] = (int16_t)s;
  }
  int16_t got16[N];
  CHECK(rdist_allreduce(a, got16, N, RDIST_INT16, RDIST_SUM, comm, NULL));
  for (int i = 0; i < N; i++) EXPECT(got16[i] == want16[i], "int16 sum [%d] = %d", i, got16[i]);
  CHECK(rdist_allreduce(a, got16, N, RDIST_INT16, RDIST_BOR, comm, NULL));
  for (int i = 0; i < N; i++) {
    int o = 0;
    for (int r = 0; r < size; r++) o |= (int16_t)((r + 1) * (i + 1) * 37);
    EXPECT(got16[i] == (int16_t)o, "int16 bor [%d]", i);
  }
  /* bool: max is any, min is all; results are 0 or 1 */
  CHECK(rdist_allreduce(b, any, N, RDIST_BOOL, RDIST_MAX, comm, NULL));
  CHECK(rdist_allreduce(b, all, N, RDIST_BOOL, RDIST_MIN, comm, NULL));
  for (int i = 0; i < N; i++) {
    int t_any = 0, t_all = 1;
    for (int r = 0; r < size; r++) {
      int t = (r + i) % 3 != 0;
      t_any |= t;
      t_all &= t;
    }
    EXPECT(any[i] == t_any && all[i] == t_all, "bool [%d]: any %d all %d", i, any[i], all[i]);
  }
  /* refused: bitwise on floats, avg on bool */
  float f = 1;
  EXPECT(rdist_allreduce(&f, &f, 1, RDIST_FLOAT32, RDIST_BXOR, comm, NULL) == RDIST_ERR_INVALID_ARGUMENT,
         "bxor on float32");
  EXPECT(strstr(rdist_last_error(), "float32") != NULL, "message: %s", rdist_last_error());
  EXPECT(rdist_allreduce(b, b, N, RDIST_BOOL, RDIST_AVG, comm, NULL) == RDIST_ERR_INVALID_ARGUMENT,
         "avg on bool");
}

/* alltoallv: rank i sends (i + j) % 3 elements to rank j. */
static void test_alltoallv(rdist_comm_t* comm) {
  size_t sc[32], sd[32], rc[32], rd[32], at = 0, rt = 0;
  EXPECT(size <= 32, "size %d", size);
  for (int j = 0; j < size; j++) {
    sc[j] = (size_t)((rank + j) % 3);
    sd[j] = at;
    at += sc[j];
    rc[j] = (size_t)((j + rank) % 3);
    rd[j] = rt;
    rt += rc[j];
  }
  int64_t send[96], recv[96];
  for (int j = 0; j < size; j++)
    for (size_t k = 0; k < sc[j]; k++) send[sd[j] + k] = rank * 1000 + j * 10 + (int64_t)k;
  CHECK(rdist_alltoallv(send, sc, sd, recv, rc, rd, RDIST_INT64, comm, NULL));
  for (int i = 0; i < size; i++)
    for (size_t k = 0; k < rc[i]; k++)
      EXPECT(recv[rd[i] + k] == i * 1000 + rank * 10 + (int64_t)k, "alltoallv from %d [%zu]", i, k);
  EXPECT(rdist_alltoallv(send, NULL, sd, recv, rc, rd, RDIST_INT64, comm, NULL) == RDIST_ERR_INVALID_ARGUMENT,
         "NULL sendcounts");
}

static void test_allreduce(rdist_comm_t* comm) {
  /* every dtype, SUM, out of place, several counts (0 and odd included) */
  const size_t counts[] = {0, 1, 7, 1000};
  for (int t = RDIST_INT8; t <= RDIST_BFLOAT16; t++) {
    for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
      size_t n = counts[c];
      void* s = alloc(n, (rdist_dtype_t)t);
      void* r = alloc(n, (rdist_dtype_t)t);
      for (size_t i = 0; i < n; i++) put(s, (rdist_dtype_t)t, i, val(rank, i));
      CHECK(rdist_allreduce(s, r, n, (rdist_dtype_t)t, RDIST_SUM, comm, NULL));
      for (size_t i = 0; i < n; i++)
        EXPECT(get(r, (rdist_dtype_t)t, i) == sum_of_ranks(i), "dtype %d [%zu] = %g", t, i,
               get(r, (rdist_dtype_t)t, i));
      free(s);
      free(r);
    }
  }
  /* every op, in place, on int32 and float32 (AVG on ints truncates) */
  enum { N = 11 };
  for (int op = RDIST_SUM; op <= RDIST_AVG; op++) {
    int32_t a[N];
    float f[N];
    for (size_t i = 0; i < N; i++) a[i] = (int32_t)val(rank, i), f[i] = (float)val(rank, i);
    CHECK(rdist_allreduce(a, a, N, RDIST_INT32, (rdist_op_t)op, comm, NULL));
    CHECK(rdist_allreduce(f, f, N, RDIST_FLOAT32, (rdist_op_t)op, comm, NULL));
    for (size_t i = 0; i < N; i++) {
      double want = 0, prod = 1;
      for (int r = 0; r < size; r++) prod *= val(r, i);
      switch (op) {
        case RDIST_SUM: want = sum_of_ranks(i); break;
        case RDIST_PROD: want = prod; break;
        case RDIST_MAX: want = val(size - 1, i); break;
        case RDIST_MIN: want = val(0, i); break;
        case RDIST_AVG: want = sum_of_ranks(i) / size; break;
      }
      int32_t want_int = op == RDIST_AVG ? (int32_t)sum_of_ranks(i) / size : (int32_t)want;
      EXPECT(a[i] == want_int, "op %d int32[%zu] = %d, want %d", op, i, a[i], want_int);
      EXPECT(f[i] == (float)want, "op %d float[%zu] = %g, want %g", op, i, f[i], want);
    }
  }
}

static void test_rooted(rdist_comm_t* comm) {
  enum { N = 9 };
  const int root = 1, last = size - 1;
  /* broadcast: out of place (sendbuf NULL off the root), then in place */
  double in[N], out[N];
  for (size_t i = 0; i < N; i++) in[i] = val(rank, i), out[i] = -1;
  CHECK(rdist_broadcast(rank == root ? in : NULL, out, N, RDIST_FLOAT64, root, comm, NULL));
  for (size_t i = 0; i < N; i++) EXPECT(out[i] == val(root, i), "broadcast[%zu] = %g", i, out[i]);
  int64_t b[N];
  for (size_t i = 0; i < N; i++) b[i] = (int64_t)val(rank, i);
  CHECK(rdist_broadcast(b, b, N, RDIST_INT64, last, comm, NULL));
  for (size_t i = 0; i < N; i++) EXPECT(b[i] == (int64_t)val(last, i), "broadcast in place[%zu]", i);

  /* reduce: out of place (recvbuf NULL off the root), then in place */
  float s[N], r[N];
  for (size_t i = 0; i < N; i++) s[i] = (float)val(rank, i), r[i] = -1;
  CHECK(rdist_reduce(s, rank == last ? r : NULL, N, RDIST_FLOAT32, RDIST_SUM, last, comm, NULL));
  if (rank == last)
    for (size_t i = 0; i < N; i++) EXPECT(r[i] == (float)sum_of_ranks(i), "reduce[%zu] = %g", i, r[i]);
  uint32_t m[N];
  for (size_t i = 0; i < N; i++) m[i] = (uint32_t)val(rank, i);
  CHECK(rdist_reduce(m, m, N, RDIST_UINT32, RDIST_MAX, 0, comm, NULL));
  for (size_t i = 0; i < N; i++) {
    uint32_t want = (uint32_t)(rank == 0 ? val(size - 1, i) : val(rank, i)); /* others unchanged */
    EXPECT(m[i] == want, "reduce in place[%zu] = %u, want %u", i, m[i], want);
  }

  /* gather to root 1 (recvbuf NULL elsewhere) */
  int32_t mine[N], *all = calloc((size_t)size * N, sizeof(int32_t));
  for (size_t i = 0; i < N; i++) mine[i] = rank * 100 + (int32_t)i;
  CHECK(rdist_gather(mine, rank == root ? all : NULL, N, RDIST_INT32, root, comm, NULL));
  if (rank == root)
    for (size_t i = 0; i < (size_t)size * N; i++)
      EXPECT(all[i] == (int32_t)(i / N * 100 + i % N), "gather[%zu] = %d", i, all[i]);

  /* scatter from root 0: out of place (sendbuf NULL elsewhere), then in
   * place at the root (recvbuf = sendbuf + root*count) */
  for (size_t i = 0; i < (size_t)size * N; i++) all[i] = (int32_t)(i * 3);
  int32_t part[N];
  CHECK(rdist_scatter(rank == 0 ? all : NULL, part, N, RDIST_INT32, 0, comm, NULL));
  for (size_t i = 0; i < N; i++)
    EXPECT(part[i] == (int32_t)(((size_t)rank * N + i) * 3), "scatter[%zu] = %d", i, part[i]);
  int32_t* dst = rank == root ? all + (size_t)root * N : part;
  CHECK(rdist_scatter(all, dst, N, RDIST_INT32, root, comm, NULL));
  for (size_t i = 0; i < N; i++)
    EXPECT(dst[i] == (int32_t)(((size_t)rank * N + i) * 3), "scatter in place[%zu] = %d", i, dst[i]);
  free(all);
}

static void test_all_to_all(rdist_comm_t* comm) {
  enum { N = 5 };
  const size_t total = (size_t)size * N;
  uint8_t* send = calloc(total, 1);
  uint8_t* recv = calloc(total, 1);

  /* allgather: out of place, in place with own block at rank*N, and in
   * place with own data at the start (sendbuf == recvbuf) */
  for (size_t i = 0; i < N; i++) send[i] = (uint8_t)(rank * 10 + (int)i);
  CHECK(rdist_allgather(send, recv, N, RDIST_UINT8, comm, NULL));
  for (size_t i = 0; i < total; i++) EXPECT(recv[i] == i / N * 10 + i % N, "allgather[%zu] = %u", i, recv[i]);
  memset(recv, 0, total);
  for (size_t i = 0; i < N; i++) recv[(size_t)rank * N + i] = (uint8_t)(rank * 10 + (int)i);
  CHECK(rdist_allgather(recv + (size_t)rank * N, recv, N, RDIST_UINT8, comm, NULL));
  for (size_t i = 0; i < total; i++) EXPECT(recv[i] == i / N * 10 + i % N, "allgather in place[%zu] = %u", i, recv[i]);
  memset(recv, 0, total);
  for (size_t i = 0; i < N; i++) recv[i] = (uint8_t)(rank * 10 + (int)i);
  CHECK(rdist_allgather(recv, recv, N, RDIST_UINT8, comm, NULL));
  for (size_t i = 0; i < total; i++) EXPECT(recv[i] == i / N * 10 + i % N, "allgather sendbuf==recvbuf[%zu] = %u", i, recv[i]);

  /* reduce_scatter: out of place, then in place (recvbuf = sendbuf + rank*N) */
  for (size_t i = 0; i < total; i++) send[i] = (uint8_t)val(rank, i);
  uint8_t part[N];
  CHECK(rdist_reduce_scatter(send, part, N, RDIST_UINT8, RDIST_SUM, comm, NULL));
  for (size_t i = 0; i < N; i++)
    EXPECT(part[i] == sum_of_ranks((size_t)rank * N + i), "reduce_scatter[%zu] = %u", i, part[i]);
  uint8_t* own = send + (size_t)rank * N;
  CHECK(rdist_reduce_scatter(send, own, N, RDIST_UINT8, RDIST_MAX, comm, NULL));
  for (size_t i = 0; i < N; i++)
    EXPECT(own[i] == val(size - 1, (size_t)rank * N + i), "reduce_scatter in place[%zu] = %u", i, own[i]);

  /* alltoall: out of place, then in place (sendbuf == recvbuf) */
  for (size_t j = 0; j < (size_t)size; j++)
    for (size_t i = 0; i < N; i++) send[j * N + i] = (uint8_t)(rank * 16 + (int)j * 4 + (int)i);
  CHECK(rdist_alltoall(send, recv, N, RDIST_UINT8, comm, NULL));
  for (size_t j = 0; j < (size_t)size; j++)
    for (size_t i = 0; i < N; i++)
      EXPECT(recv[j * N + i] == j * 16 + (size_t)rank * 4 + i, "alltoall[%zu][%zu] = %u", j, i, recv[j * N + i]);
  CHECK(rdist_alltoall(send, send, N, RDIST_UINT8, comm, NULL));
  EXPECT(memcmp(send, recv, total) == 0, "alltoall in place differs");
  free(send);
  free(recv);
}

static void test_p2p(rdist_comm_t* comm) {
  enum { N = 1000 };
  const int last = size - 1;
  /* blocking 0 -> last and back */
  int64_t msg[N];
  if (rank == 0) {
    for (int i = 0; i < N; i++) msg[i] = i;
    CHECK(rdist_send(msg, N, RDIST_INT64, last, comm, NULL));
    CHECK(rdist_recv(msg, N, RDIST_INT64, last, comm, NULL));
    for (int i = 0; i < N; i++) EXPECT(msg[i] == 2 * i, "reply[%d] = %lld", i, (long long)msg[i]);
  } else if (rank == last) {
    CHECK(rdist_recv(msg, N, RDIST_INT64, 0, comm, NULL));
    for (int i = 0; i < N; i++) msg[i] *= 2;
    CHECK(rdist_send(msg, N, RDIST_INT64, 0, comm, NULL));
  }

  /* a group: every rank sends to its right neighbour and receives from its
   * left one (a ring shift, which deadlocks without the group), and ranks
   * 0 and 1 swap a second buffer with each other; the others with
   * themselves */
  int32_t right[N], left[N], mine[4], theirs[4];
  const int to = (rank + 1) % size, from = (rank + size - 1) % size;
  const int partner = rank < 2 ? 1 - rank : rank;
  for (int i = 0; i < N; i++) right[i] = rank * N + i;
  for (int i = 0; i < 4; i++) mine[i] = rank * 4 + i;
  CHECK(rdist_group_start());
  CHECK(rdist_send(right, N, RDIST_INT32, to, comm, NULL));
  CHECK(rdist_recv(left, N, RDIST_INT32, from, comm, NULL));
  CHECK(rdist_send(mine, 4, RDIST_INT32, partner, comm, NULL));
  CHECK(rdist_recv(theirs, 4, RDIST_INT32, partner, comm, NULL));
  CHECK(rdist_group_end());
  for (int i = 0; i < N; i++) EXPECT(left[i] == from * N + i, "ring[%d] = %d", i, left[i]);
  for (int i = 0; i < 4; i++) EXPECT(theirs[i] == partner * 4 + i, "swap[%d] = %d", i, theirs[i]);
}

static void test_nonblocking(rdist_comm_t* comm) {
  enum { N = 6, OPS = 11 };
  const size_t total = (size_t)size * N;
  const int root = size - 1;
  float ar[N], ar_out[N], bc[N], rd[N], rd_out[N], ag[N], *ag_out = calloc(total, sizeof(float));
  float *rs = calloc(total, sizeof(float)), rs_out[N], ga[N], *ga_out = calloc(total, sizeof(float));
  float *sc = calloc(total, sizeof(float)), sc_out[N], *aa = calloc(total, sizeof(float)),
        *aa_out = calloc(total, sizeof(float));
  double p2p[N];
  for (size_t i = 0; i < N; i++) {
    ar[i] = bc[i] = rd[i] = ag[i] = ga[i] = (float)val(rank, i);
    p2p[i] = rank == 0 ? (double)i / 4 : -1;
  }
  for (size_t i = 0; i < total; i++) rs[i] = sc[i] = aa[i] = (float)val(rank, i);
  rdist_request_t* req[OPS] = {NULL};
  /* issued back to back; they complete in issue order */
  CHECK(rdist_iallreduce(ar, ar_out, N, RDIST_FLOAT32, RDIST_SUM, comm, &req[0]));
  CHECK(rdist_ibroadcast(bc, bc, N, RDIST_FLOAT32, root, comm, &req[1]));
  CHECK(rdist_ireduce(rd, rd_out, N, RDIST_FLOAT32, RDIST_MIN, root, comm, &req[2]));
  CHECK(rdist_iallgather(ag, ag_out, N, RDIST_FLOAT32, comm, &req[3]));
  CHECK(rdist_ireduce_scatter(rs, rs_out, N, RDIST_FLOAT32, RDIST_SUM, comm, &req[4]));
  CHECK(rdist_igather(ga, ga_out, N, RDIST_FLOAT32, 0, comm, &req[5]));
  CHECK(rdist_iscatter(sc, sc_out, N, RDIST_FLOAT32, root, comm, &req[6]));
  CHECK(rdist_ialltoall(aa, aa_out, N, RDIST_FLOAT32, comm, &req[7]));
  CHECK(rdist_ibarrier(comm, &req[8]));
  if (rank == 0) CHECK(rdist_isend(p2p, N, RDIST_FLOAT64, 1, comm, &req[9]));
  if (rank == 1) CHECK(rdist_irecv(p2p, N, RDIST_FLOAT64, 0, comm, &req[10]));
  int done = 0;
  while (!done) CHECK(rdist_test(req[8], &done)); /* the barrier completes once the others have */
  for (int k = 0; k < OPS; k++) {
    if (req[k] != NULL) CHECK(rdist_wait(req[k]));
    rdist_request_free(req[k]);
  }
  for (size_t i = 0; i < N; i++) {
    EXPECT(ar_out[i] == (float)sum_of_ranks(i), "iallreduce[%zu] = %g", i, ar_out[i]);
    EXPECT(bc[i] == (float)val(root, i), "ibroadcast[%zu] = %g", i, bc[i]);
    if (rank == root) EXPECT(rd_out[i] == (float)val(0, i), "ireduce[%zu] = %g", i, rd_out[i]);
    EXPECT(rs_out[i] == (float)sum_of_ranks((size_t)rank * N + i), "ireduce_scatter[%zu] = %g", i, rs_out[i]);
    EXPECT(sc_out[i] == (float)val(root, (size_t)rank * N + i), "iscatter[%zu] = %g", i, sc_out[i]);
    if (rank == 1) EXPECT(p2p[i] == (double)i / 4, "irecv[%zu] = %g", i, p2p[i]);
  }
  for (size_t k = 0; k < total; k++) {
    size_t r = k / N, i = k % N;
    EXPECT(ag_out[k] == (float)val((int)r, i), "iallgather[%zu] = %g", k, ag_out[k]);
    if (rank == 0) EXPECT(ga_out[k] == (float)val((int)r, i), "igather[%zu] = %g", k, ga_out[k]);
    EXPECT(aa_out[k] == (float)val((int)r, (size_t)rank * N + i), "ialltoall[%zu] = %g", k, aa_out[k]);
  }
  free(ag_out), free(rs), free(ga_out), free(sc), free(aa), free(aa_out);
}

static void test_split_and_bootstrap(rdist_comm_t* comm) {
  /* parity groups, ordered by descending old rank; the last rank opts out */
  const int last = size - 1;
  rdist_comm_t* sub = NULL;
  CHECK(rdist_comm_split(comm, rank == last ? RDIST_SPLIT_NOCOLOR : rank % 2, -rank, &sub));
  if (rank == last) {
    EXPECT(sub == NULL, "no color gave a communicator");
  } else {
    int members = 0, higher = 0, sub_rank = -1, sub_size = -1;
    for (int r = 0; r < last; r++) members += r % 2 == rank % 2, higher += r % 2 == rank % 2 && r > rank;
    CHECK(rdist_comm_rank(sub, &sub_rank));
    CHECK(rdist_comm_size(sub, &sub_size));
    EXPECT(sub_size == members && sub_rank == higher, "split: rank %d of %d", sub_rank, sub_size);
    int64_t x = rank;
    CHECK(rdist_allreduce(&x, &x, 1, RDIST_INT64, RDIST_SUM, sub, NULL));
    int64_t want = 0;
    for (int r = 0; r < last; r++) want += r % 2 == rank % 2 ? r : 0;
    EXPECT(x == want, "allreduce in split = %lld, want %lld", (long long)x, (long long)want);
    CHECK(rdist_comm_destroy(sub));
  }

  /* NCCL-style bootstrap: rank 0 makes the id, the world ships it */
  rdist_unique_id_t id;
  memset(&id, 0, sizeof id);
  if (rank == 0) CHECK(rdist_get_unique_id(&id));
  CHECK(rdist_broadcast(&id, &id, sizeof id, RDIST_UINT8, 0, comm, NULL));
  rdist_comm_t* boot = NULL;
  CHECK(rdist_comm_init_rank(&boot, size, id, rank, NULL));
  int boot_rank = -1;
  CHECK(rdist_comm_rank(boot, &boot_rank));
  EXPECT(boot_rank == rank, "init_rank gave rank %d", boot_rank);
  double d = 1.5;
  CHECK(rdist_allreduce(&d, &d, 1, RDIST_FLOAT64, RDIST_SUM, boot, NULL));
  EXPECT(d == 1.5 * size, "allreduce after init_rank = %g", d);
  CHECK(rdist_comm_destroy(boot));

  /* abort: a communicator of one (color = rank), aborted, refuses work */
  rdist_comm_t* alone = NULL;
  CHECK(rdist_comm_split(comm, rank, 0, &alone));
  CHECK(rdist_comm_abort(alone));
  EXPECT(rdist_allreduce(&d, &d, 1, RDIST_FLOAT64, RDIST_SUM, alone, NULL) == RDIST_ERR_ABORTED,
         "allreduce on an aborted comm");
  EXPECT(strstr(rdist_last_error(), "rdist_allreduce") != NULL, "message: %s", rdist_last_error());
  CHECK(rdist_comm_destroy(alone));
}

int main(void) {
  rdist_options_t* opts = NULL;
  CHECK(rdist_options_create(&opts));
  CHECK(rdist_options_set(opts, "timeout_ms", "60000"));
  rdist_comm_t* comm = NULL;
  CHECK(rdist_init(&comm, "env://", -1, -1, opts));
  rdist_options_destroy(opts);
  CHECK(rdist_comm_rank(comm, &rank));
  CHECK(rdist_comm_size(comm, &size));
  int local = -1;
  rdist_backend_t backend = RDIST_BACKEND_AUTO;
  CHECK(rdist_comm_local_rank(comm, &local));
  CHECK(rdist_comm_backend(comm, &backend));
  EXPECT(size >= 2 && local == rank && backend != RDIST_BACKEND_AUTO, "size %d local %d backend %d", size,
         local, (int)backend);

  test_allreduce(comm);
  test_new_types_and_bitwise_ops(comm);
  test_alltoallv(comm);
  test_rooted(comm);
  test_all_to_all(comm);
  test_p2p(comm);
  test_nonblocking(comm);
  test_split_and_bootstrap(comm);

  /* local argument errors */
  float f = 0;
  EXPECT(rdist_allreduce(&f, &f, 1, (rdist_dtype_t)42, RDIST_SUM, comm, NULL) == RDIST_ERR_INVALID_ARGUMENT, "dtype 42");
  EXPECT(rdist_broadcast(&f, &f, 1, RDIST_FLOAT32, size, comm, NULL) == RDIST_ERR_INVALID_ARGUMENT, "root = size");
  EXPECT(strcmp(rdist_result_string(RDIST_SUCCESS), "") != 0, "empty result string");

  CHECK(rdist_barrier(comm));
  CHECK(rdist_comm_destroy(comm));
  printf("rank %d of %d: C API ok\n", rank, size);
  return 0;
}
