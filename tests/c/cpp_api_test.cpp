// Every collective through the C++ wrapper (rdist.hpp), as a multi-rank
// job under rdistrun (any world size >= 2; ctest runs 3): pointer, span and
// vector forms, in place and out of place, every dtype including float16 /
// bfloat16, non-blocking Requests, a Group swap, split, init_rank, abort and
// rdist::Error. Built with -Wall -Wextra -Wpedantic -Werror.
#include "rdist.hpp"

#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <string>
#include <vector>

namespace {

int g_rank = -1;

[[noreturn]] void fail(const char* file, int line, const char* cond, const std::string& detail) {
  std::fprintf(stderr, "rank %d: %s:%d: check failed: %s: %s\n", g_rank, file, line, cond, detail.c_str());
  std::exit(2);
}
#define EXPECT(cond, detail)                          \
  do {                                                \
    if (!(cond)) fail(__FILE__, __LINE__, #cond, detail); \
  } while (0)

// What rank r contributes at index i: 1..5 times (r + 1).
double val(int r, std::size_t i) { return static_cast<double>((r + 1) * static_cast<int>(i % 5 + 1)); }

template <class T>
T as(double v) {
  if constexpr (std::is_same_v<T, rdist::float16> || std::is_same_v<T, rdist::bfloat16>) {
    return T(static_cast<float>(v));
  } else {
    return static_cast<T>(v);
  }
}

template <class T>
double num(T v) {
  if constexpr (std::is_same_v<T, rdist::float16> || std::is_same_v<T, rdist::bfloat16>) {
    return static_cast<double>(static_cast<float>(v));
  } else {
    return static_cast<double>(v);
  }
}

// allreduce SUM of every form on one element type.
template <class T>
void allreduce_forms(rdist::Comm& comm) {
  const int size = comm.size(), rank = comm.rank();
  const std::size_t n = 13;
  auto sum = [&](std::size_t i) {
    double s = 0;
    for (int r = 0; r < size; r++) s += val(r, i);
    return s;
  };
  std::vector<T> send(n), recv;
  for (std::size_t i = 0; i < n; i++) send[i] = as<T>(val(rank, i));
  comm.allreduce(send, recv);  // vector, out of place: recv is resized
  EXPECT(recv.size() == n, "vector recv not resized");
  for (std::size_t i = 0; i < n; i++) EXPECT(num(recv[i]) == sum(i), "vector allreduce " + std::to_string(i));

  std::vector<T> in_place = send;
  comm.allreduce(in_place);  // vector, in place
  std::vector<T> by_ptr(n);
  comm.allreduce(send.data(), by_ptr.data(), n);  // pointer, out of place
  std::vector<T> by_span(n);
  comm.allreduce(rdist::span<const T>(send), rdist::span<T>(by_span));  // span, out of place
  std::vector<T> span_in_place = send;
  comm.allreduce(rdist::span(span_in_place));  // span (deduced), in place
  std::vector<T> ptr_in_place = send;
  comm.allreduce(ptr_in_place.data(), n);  // pointer, in place
  for (std::size_t i = 0; i < n; i++) {
    for (const auto* v : {&in_place, &by_ptr, &by_span, &span_in_place, &ptr_in_place})
      EXPECT(num((*v)[i]) == sum(i), "allreduce form at " + std::to_string(i));
  }
}

void test_allreduce(rdist::Comm& comm) {
  allreduce_forms<std::int8_t>(comm);
  allreduce_forms<std::uint8_t>(comm);
  allreduce_forms<std::int32_t>(comm);
  allreduce_forms<std::uint32_t>(comm);
  allreduce_forms<std::int64_t>(comm);
  allreduce_forms<std::uint64_t>(comm);
  allreduce_forms<rdist::float16>(comm);
  allreduce_forms<float>(comm);
  allreduce_forms<double>(comm);
  allreduce_forms<rdist::bfloat16>(comm);

  // ops on a C array through the pointer form
  const int size = comm.size(), rank = comm.rank();
  float a[4] = {1.0f * static_cast<float>(rank + 1), -1, 0.5f, 2};
  comm.allreduce(a, 4, RDIST_MAX);
  EXPECT(a[0] == static_cast<float>(size) && a[1] == -1, "max");
  std::vector<double> avg(3, static_cast<double>(rank));
  comm.allreduce(avg, RDIST_AVG);
  EXPECT(avg[2] == (size - 1) / 2.0, "avg " + std::to_string(avg[2]));
}

void test_rooted(rdist::Comm& comm) {
  const int size = comm.size(), rank = comm.rank(), last = size - 1;
  const std::size_t n = 8;
  // broadcast: vector in place, span out of place
  std::vector<std::int32_t> b(n, rank == 1 ? 7 : 0);
  comm.broadcast(b, 1);
  EXPECT(b == std::vector<std::int32_t>(n, 7), "broadcast vector");
  std::vector<double> src(rank == last ? n : 0, 2.5), dst(n, 0);
  comm.broadcast(rdist::span<const double>(src), rdist::span<double>(dst), last);
  EXPECT(dst == std::vector<double>(n, 2.5), "broadcast span");

  // reduce: vector out of place (recv resized on the root only), in place
  std::vector<std::int64_t> mine(n, rank + 1), total;
  comm.reduce(mine, total, RDIST_SUM, last);
  if (rank == last) EXPECT(total == std::vector<std::int64_t>(n, size * (size + 1) / 2), "reduce");
  else EXPECT(total.empty(), "reduce resized a non-root's recv");
  comm.reduce(mine, RDIST_PROD, 0);
  std::int64_t fact = 1;
  for (int r = 1; r <= size; r++) fact *= r;
  EXPECT(mine[0] == (rank == 0 ? fact : rank + 1), "reduce in place");

  // gather to 1, scatter from 0
  std::vector<float> g(3, static_cast<float>(rank)), gathered;
  comm.gather(g, gathered, 1);
  if (rank == 1) {
    EXPECT(gathered.size() == 3 * static_cast<std::size_t>(size), "gather size");
    for (std::size_t k = 0; k < gathered.size(); k++) EXPECT(gathered[k] == static_cast<float>(k / 3), "gather");
  }
  std::vector<std::uint8_t> all(rank == 0 ? 2 * static_cast<std::size_t>(size) : 0);
  std::iota(all.begin(), all.end(), std::uint8_t{100});
  std::vector<std::uint8_t> scattered(2);  // its size is the count, known on every rank
  comm.scatter(all, scattered, 0);
  EXPECT(scattered[0] == 100 + 2 * rank && scattered[1] == 101 + 2 * rank, "scatter");
}

void test_all_to_all(rdist::Comm& comm) {
  const int size = comm.size(), rank = comm.rank();
  const auto ssize = static_cast<std::size_t>(size);
  // allgather: vector out of place, vector in place (own block at rank)
  std::vector<std::uint32_t> mine{static_cast<std::uint32_t>(rank), 10u + static_cast<std::uint32_t>(rank)}, all;
  comm.allgather(mine, all);
  for (std::size_t k = 0; k < all.size(); k++) EXPECT(all[k] == (k % 2) * 10 + k / 2, "allgather");
  std::vector<std::uint32_t> in_place(2 * ssize, 0);
  in_place[2 * static_cast<std::size_t>(rank)] = mine[0];
  in_place[2 * static_cast<std::size_t>(rank) + 1] = mine[1];
  comm.allgather(in_place);
  EXPECT(in_place == all, "allgather in place");

  // reduce_scatter: vector, recv resized to one block
  std::vector<double> blocks(3 * ssize);
  for (std::size_t k = 0; k < blocks.size(); k++) blocks[k] = static_cast<double>(k) * (rank + 1);
  std::vector<double> mine_sum;
  comm.reduce_scatter(blocks, mine_sum, RDIST_SUM);
  EXPECT(mine_sum.size() == 3, "reduce_scatter size");
  for (std::size_t i = 0; i < 3; i++)
    EXPECT(mine_sum[i] == static_cast<double>(3 * static_cast<std::size_t>(rank) + i) * size * (size + 1) / 2,
           "reduce_scatter");

  // alltoall: spans
  std::vector<std::int8_t> out(ssize), in(ssize);
  for (std::size_t j = 0; j < ssize; j++) out[j] = static_cast<std::int8_t>(rank * 10 + static_cast<int>(j));
  comm.alltoall(rdist::span<const std::int8_t>(out), rdist::span<std::int8_t>(in));
  for (std::size_t j = 0; j < ssize; j++) EXPECT(in[j] == static_cast<int>(j) * 10 + rank, "alltoall");

  // a size the wrapper can check fails locally with INVALID_ARGUMENT
  try {
    std::vector<std::int8_t> odd(ssize + 1);
    comm.alltoall(odd, in);
    EXPECT(false, "alltoall of an odd size did not throw");
  } catch (const rdist::Error& e) {
    EXPECT(e.code() == RDIST_ERR_INVALID_ARGUMENT, e.what());
  }
}

void test_p2p_and_group(rdist::Comm& comm) {
  const int size = comm.size(), rank = comm.rank(), last = size - 1;
  // blocking 0 -> last, non-blocking last -> 0
  std::vector<double> msg(5, 0);
  if (rank == 0) {
    comm.send(std::vector<double>{1, 2, 3, 4, 5}, last);
    rdist::Request r = comm.irecv(msg, last);
    r.wait();
    EXPECT(msg == std::vector<double>({5, 4, 3, 2, 1}), "irecv");
  } else if (rank == last) {
    comm.recv(msg, 0);
    EXPECT(msg == std::vector<double>({1, 2, 3, 4, 5}), "recv");
    const std::vector<double> back{5, 4, 3, 2, 1};
    rdist::Request r = comm.isend(back, 0);
    while (!r.test()) {
    }
  }
  // tagged: every rank sends rank 0 `rank` elements with tag 7; rank 0
  // takes them from any source (tag 7 only: a later message of this test,
  // tag 0, may already be on its way), and the status says from whom
  constexpr int kTag = 7;
  if (rank != 0) {
    comm.send_tagged(std::vector<std::int64_t>(static_cast<std::size_t>(rank), rank), 0, kTag);
  } else {
    int seen = 0;
    for (int k = 1; k < size; k++) {
      std::vector<std::int64_t> in(64, -1);
      rdist::Request r = comm.irecv_tagged(in.data(), in.size(), RDIST_ANY_SOURCE, kTag);
      r.wait();
      const rdist_status_t s = r.status();
      EXPECT(s.source >= 1 && s.tag == kTag && s.count == static_cast<std::size_t>(s.source) &&
                 in[0] == s.source,
             "tagged status");
      seen |= 1 << s.source;
    }
    EXPECT(seen == (1 << size) - 2, "every sender once");
  }
  // group: ring shift (send right, receive from the left)
  std::array<std::int32_t, 3> right{rank, rank * 2, rank * 3}, left{};
  const int to = (rank + 1) % size, from = (rank + size - 1) % size;
  {
    rdist::Group group;
    comm.send(rdist::span<const std::int32_t>(right), to);
    comm.recv(rdist::span<std::int32_t>(left), from);
    group.end();
  }
  EXPECT(left[0] == from && left[2] == from * 3, "group ring");
  // a group ended by its destructor
  std::int32_t x = rank, y = -1;
  {
    rdist::Group group;
    comm.send(&x, 1, rank);  // to itself
    comm.recv(&y, 1, rank);
  }
  EXPECT(y == rank, "group to self");
}

void test_nonblocking(rdist::Comm& comm) {
  const int size = comm.size(), rank = comm.rank(), root = size - 1;
  const auto ssize = static_cast<std::size_t>(size);
  std::vector<float> ar(4, 1.0f), bc(4, static_cast<float>(rank)), rd(4, 2.0f), rd_out;
  std::vector<float> ag{static_cast<float>(rank)}, ag_out, rs(2 * ssize, 1.0f), rs_out;
  std::vector<float> ga{static_cast<float>(rank)}, ga_out, sc(ssize), sc_out(1), aa(ssize), aa_out;
  std::iota(sc.begin(), sc.end(), 0.0f);
  std::fill(aa.begin(), aa.end(), static_cast<float>(rank));
  std::vector<rdist::Request> reqs;
  reqs.push_back(comm.iallreduce(ar));
  reqs.push_back(comm.ibroadcast(bc, root));
  reqs.push_back(comm.ireduce(rd, rd_out, RDIST_SUM, root));
  reqs.push_back(comm.iallgather(ag, ag_out));
  reqs.push_back(comm.ireduce_scatter(rs, rs_out));
  reqs.push_back(comm.igather(ga, ga_out, 0));
  reqs.push_back(comm.iscatter(sc, sc_out, root));
  reqs.push_back(comm.ialltoall(aa, aa_out));
  reqs.push_back(comm.ibarrier());
  rdist::wait_all(reqs);
  reqs.clear();
  EXPECT(ar == std::vector<float>(4, static_cast<float>(size)), "iallreduce");
  EXPECT(bc == std::vector<float>(4, static_cast<float>(root)), "ibroadcast");
  if (rank == root) EXPECT(rd_out == std::vector<float>(4, 2.0f * static_cast<float>(size)), "ireduce");
  for (std::size_t k = 0; k < ssize; k++) {
    EXPECT(ag_out[k] == static_cast<float>(k), "iallgather");
    if (rank == 0) EXPECT(ga_out[k] == static_cast<float>(k), "igather");
    EXPECT(aa_out[k] == static_cast<float>(k), "ialltoall");
  }
  EXPECT(rs_out == std::vector<float>(2, static_cast<float>(size)), "ireduce_scatter");
  EXPECT(sc_out[0] == static_cast<float>(rank), "iscatter");
}

void test_comms(rdist::Comm& comm) {
  const int size = comm.size(), rank = comm.rank(), last = size - 1;
  // split: the last rank opts out and gets an empty Comm
  rdist::Comm sub = comm.split(rank == last ? rdist::no_color : 0, rank);
  if (rank == last) {
    EXPECT(!sub, "no_color gave a communicator");
    try {
      (void)sub.rank();
      EXPECT(false, "an empty Comm did not throw");
    } catch (const rdist::Error& e) {
      EXPECT(e.code() == RDIST_ERR_INVALID_ARGUMENT, e.what());
    }
  } else {
    EXPECT(sub && sub.size() == last && sub.rank() == rank, "split");
    std::int32_t one = 1;
    sub.allreduce(&one, 1);
    EXPECT(one == last, "allreduce in split");
  }
  // move semantics: the moved-from Comm is empty
  rdist::Comm moved = std::move(sub);
  EXPECT(!sub && static_cast<bool>(moved) == (rank != last), "move");

  // init_rank: rank 0 makes the id, the world ships its bytes
  rdist_unique_id_t id{};
  if (rank == 0) id = rdist::unique_id();
  comm.broadcast(reinterpret_cast<std::uint8_t*>(&id), sizeof id, 0);
  rdist::Comm boot = rdist::Comm::init_rank(size, id, rank, rdist::Options().set("timeout_ms", 60000));
  EXPECT(boot.rank() == rank && boot.size() == size, "init_rank");
  boot.barrier();
  boot.destroy();
  EXPECT(!boot, "destroy leaves the Comm empty");

  // abort: a communicator of one refuses work afterwards with ABORTED
  rdist::Comm alone = comm.split(rank);
  alone.abort();
  try {
    alone.barrier();
    EXPECT(false, "barrier on an aborted comm did not throw");
  } catch (const rdist::Error& e) {
    EXPECT(e.code() == RDIST_ERR_ABORTED, e.what());
    EXPECT(std::string(e.what()).find("rdist_barrier") != std::string::npos, e.what());
  }

  // errors from the library carry the code and rdist_last_error()
  try {
    std::vector<float> v(2);
    comm.broadcast(v, size);  // root out of range
    EXPECT(false, "bad root did not throw");
  } catch (const rdist::Error& e) {
    EXPECT(e.code() == RDIST_ERR_INVALID_ARGUMENT, e.what());
    EXPECT(std::string(e.what()).find("rdist_broadcast") != std::string::npos, e.what());
  }
  try {
    rdist::Options().set("no_such_key", "1");
    EXPECT(false, "unknown option did not throw");
  } catch (const rdist::Error& e) {
    EXPECT(e.code() == RDIST_ERR_INVALID_ARGUMENT && std::string(e.code_string()).size() > 0, e.what());
  }
}

}  // namespace

int main() {
  try {
    rdist::Comm comm = rdist::Comm::init("env://", -1, -1, rdist::Options().set("timeout_ms", 60000));
    g_rank = comm.rank();
    EXPECT(comm.size() >= 2 && comm.local_rank() == comm.rank(), "world");
    EXPECT(comm.backend() != RDIST_BACKEND_AUTO, "backend");
    EXPECT(rdist::version() == RDIST_VERSION_MAJOR * 10000 + RDIST_VERSION_MINOR * 100 + RDIST_VERSION_PATCH,
           "version");
    test_allreduce(comm);
    test_rooted(comm);
    test_all_to_all(comm);
    test_p2p_and_group(comm);
    test_nonblocking(comm);
    test_comms(comm);
    comm.barrier();
    std::printf("rank %d of %d: C++ API ok\n", comm.rank(), comm.size());
  } catch (const rdist::Error& e) {
    std::fprintf(stderr, "rank %d: rdist::Error %d (%s): %s\n", g_rank, static_cast<int>(e.code()), e.code_string(),
                 e.what());
    return 1;
  }
  return 0;
}
