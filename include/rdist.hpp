/*
 * rdist.hpp: header-only C++17 wrapper over the C API in rdist.h.
 *
 *   auto comm = rdist::Comm::init();             // env://, as under rdistrun
 *   std::vector<float> grad(n);
 *   comm.allreduce(grad, RDIST_AVG);             // in place
 *
 * - Handles are move-only RAII objects over std::unique_ptr: rdist::Comm,
 *   rdist::Request, rdist::Options. capi() reaches the C handle, release()
 *   gives up ownership.
 * - Every failure throws rdist::Error, carrying the rdist_result_t code()
 *   and the rdist_last_error() text as what(). Destructors never throw.
 * - Element types are deduced: float, double, int8_t, uint8_t, int32_t,
 *   uint32_t, int64_t, uint64_t, rdist::float16 and rdist::bfloat16.
 *   Buffers are given as pointer + count, rdist::span<T> or std::vector<T>;
 *   vector outputs are resized where every rank knows the size, span
 *   outputs are checked.
 * - Non-blocking calls (i*) return an rdist::Request; its destructor waits,
 *   so keep buffers alive until the Request is gone.
 *
 * Link with librdist (CMake: target_link_libraries(app rdist::rdist)).
 */
#ifndef RDIST_HPP
#define RDIST_HPP

#include "rdist.h"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace rdist {

/// Thrown by every failing call: the result code and the detail text.
class Error : public std::runtime_error {
 public:
  /// An error with `code` and message `what`.
  Error(rdist_result_t code, const std::string& what) : std::runtime_error(what), code_(code) {}

  /// The C result code (never RDIST_SUCCESS).
  rdist_result_t code() const noexcept { return code_; }

  /// The code's short static description (rdist_result_string).
  const char* code_string() const noexcept { return rdist_result_string(code_); }

 private:
  rdist_result_t code_;
};

namespace detail {

/// Throws rdist::Error for a failed C call, with rdist_last_error()'s text.
inline void check(rdist_result_t rc) {
  if (rc != RDIST_SUCCESS) {
    const char* text = rdist_last_error();
    throw Error(rc, (text != nullptr && *text != '\0') ? std::string(text)
                                                       : std::string(rdist_result_string(rc)));
  }
}

/// Throws RDIST_ERR_INVALID_ARGUMENT for a wrapper-side check.
[[noreturn]] inline void invalid(const std::string& what) {
  throw Error(RDIST_ERR_INVALID_ARGUMENT, "rdist::Comm::" + what);
}

template <class T>
struct type_identity {
  using type = T;
};
/// Keeps a parameter out of template argument deduction.
template <class T>
using no_deduce = typename type_identity<T>::type;

template <class>
inline constexpr bool always_false = false;

inline std::uint32_t f32_bits(float f) noexcept {
  std::uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  return x;
}

inline float bits_f32(std::uint32_t x) noexcept {
  float f;
  std::memcpy(&f, &x, sizeof f);
  return f;
}

/// float -> IEEE binary16, rounding to nearest even.
inline std::uint16_t f32_to_f16(float f) noexcept {
  const std::uint32_t x = f32_bits(f);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t exp = (x >> 23) & 0xffu;
  std::uint32_t man = x & 0x7fffffu;
  if (exp == 0xffu) {  // inf, or NaN (kept quiet)
    return static_cast<std::uint16_t>(sign | 0x7c00u | (man != 0 ? 0x200u | (man >> 13) : 0u));
  }
  const int e = static_cast<int>(exp) - 127 + 15;
  if (e >= 0x1f) return static_cast<std::uint16_t>(sign | 0x7c00u);  // overflow: inf
  if (e <= 0) {                                                       // subnormal or zero
    if (e < -10) return static_cast<std::uint16_t>(sign);
    man |= 0x800000u;
    const int shift = 14 - e;
    std::uint32_t h = man >> shift;
    const std::uint32_t rem = man & ((1u << shift) - 1u);
    const std::uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1u) != 0)) ++h;
    return static_cast<std::uint16_t>(sign | h);
  }
  std::uint32_t h = sign | (static_cast<std::uint32_t>(e) << 10) | (man >> 13);
  const std::uint32_t rem = man & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u) != 0)) ++h;  // may carry into inf: right
  return static_cast<std::uint16_t>(h);
}

/// IEEE binary16 -> float (exact).
inline float f16_to_f32(std::uint16_t h) noexcept {
  const std::uint32_t sign = (h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t man = h & 0x3ffu;
  if (exp == 0x1fu) return bits_f32(sign | 0x7f800000u | (man << 13));
  if (exp != 0) return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
  if (man == 0) return bits_f32(sign);
  std::uint32_t e = 113;  // subnormal: normalise
  while ((man & 0x400u) == 0) {
    man <<= 1;
    --e;
  }
  return bits_f32(sign | (e << 23) | ((man & 0x3ffu) << 13));
}

/// float -> bfloat16, rounding to nearest even.
inline std::uint16_t f32_to_bf16(float f) noexcept {
  std::uint32_t x = f32_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<std::uint16_t>(x >> 16);
}

/// bfloat16 -> float (exact).
inline float bf16_to_f32(std::uint16_t b) noexcept { return bits_f32(static_cast<std::uint32_t>(b) << 16); }

}  // namespace detail

/// IEEE 754 binary16 storage (RDIST_FLOAT16). From float explicitly
/// (rounds to nearest even), to float implicitly (exact).
struct float16 {
  /// The raw bits.
  std::uint16_t bits;

  /// Uninitialised, like float; float16{} is +0.
  float16() = default;
  /// Rounds `f` to the nearest binary16 (ties to even).
  explicit float16(float f) noexcept : bits(detail::f32_to_f16(f)) {}
  /// The exact float value.
  operator float() const noexcept { return detail::f16_to_f32(bits); }
  /// A value from raw bits.
  static float16 from_bits(std::uint16_t b) noexcept {
    float16 h;
    h.bits = b;
    return h;
  }
};

/// bfloat16 storage (RDIST_BFLOAT16): the upper half of a float. From
/// float explicitly (rounds to nearest even), to float implicitly (exact).
struct bfloat16 {
  /// The raw bits.
  std::uint16_t bits;

  /// Uninitialised, like float; bfloat16{} is +0.
  bfloat16() = default;
  /// Rounds `f` to the nearest bfloat16 (ties to even).
  explicit bfloat16(float f) noexcept : bits(detail::f32_to_bf16(f)) {}
  /// The exact float value.
  operator float() const noexcept { return detail::bf16_to_f32(bits); }
  /// A value from raw bits.
  static bfloat16 from_bits(std::uint16_t b) noexcept {
    bfloat16 h;
    h.bits = b;
    return h;
  }
};

static_assert(sizeof(float16) == 2 && std::is_trivially_copyable_v<float16>, "float16 is 2 bytes");
static_assert(sizeof(bfloat16) == 2 && std::is_trivially_copyable_v<bfloat16>, "bfloat16 is 2 bytes");

/// The rdist_dtype_t of element type T (cv-qualifiers ignored).
template <class T>
struct dtype_of {
  static_assert(detail::always_false<T>,
                "rdist: the element type must be float, double, int8_t, uint8_t, int32_t, uint32_t, "
                "int64_t, uint64_t, rdist::float16 or rdist::bfloat16");
};
/// \cond specialisations
template <class T>
struct dtype_of<const T> : dtype_of<T> {};
template <class T>
struct dtype_of<volatile T> : dtype_of<T> {};
template <class T>
struct dtype_of<const volatile T> : dtype_of<T> {};
template <>
struct dtype_of<std::int8_t> : std::integral_constant<rdist_dtype_t, RDIST_INT8> {};
template <>
struct dtype_of<std::uint8_t> : std::integral_constant<rdist_dtype_t, RDIST_UINT8> {};
template <>
struct dtype_of<std::int32_t> : std::integral_constant<rdist_dtype_t, RDIST_INT32> {};
template <>
struct dtype_of<std::uint32_t> : std::integral_constant<rdist_dtype_t, RDIST_UINT32> {};
template <>
struct dtype_of<std::int64_t> : std::integral_constant<rdist_dtype_t, RDIST_INT64> {};
template <>
struct dtype_of<std::uint64_t> : std::integral_constant<rdist_dtype_t, RDIST_UINT64> {};
template <>
struct dtype_of<float16> : std::integral_constant<rdist_dtype_t, RDIST_FLOAT16> {};
template <>
struct dtype_of<float> : std::integral_constant<rdist_dtype_t, RDIST_FLOAT32> {};
template <>
struct dtype_of<double> : std::integral_constant<rdist_dtype_t, RDIST_FLOAT64> {};
template <>
struct dtype_of<bfloat16> : std::integral_constant<rdist_dtype_t, RDIST_BFLOAT16> {};
template <>
struct dtype_of<std::int16_t> : std::integral_constant<rdist_dtype_t, RDIST_INT16> {};
template <>
struct dtype_of<std::uint16_t> : std::integral_constant<rdist_dtype_t, RDIST_UINT16> {};
// bool is one byte on every platform rdist supports (checked below).
template <>
struct dtype_of<bool> : std::integral_constant<rdist_dtype_t, RDIST_BOOL> {};
static_assert(sizeof(bool) == 1, "rdist::dtype_v<bool> needs a one-byte bool");
/// \endcond

/// The rdist_dtype_t of element type T, e.g. dtype_v<float> == RDIST_FLOAT32.
template <class T>
inline constexpr rdist_dtype_t dtype_v = dtype_of<T>::value;

/// A non-owning view of `size()` contiguous T (C++17 has no std::span).
/// Converts from T* + size, arrays, std::vector, std::array and spans of
/// convertible element type (span<T> -> span<const T>).
template <class T>
class span {
  template <class C>
  using elem_of = std::remove_pointer_t<decltype(std::declval<C&>().data())>;
  template <class U>
  static constexpr bool compatible = std::is_convertible_v<U (*)[], T (*)[]>;

 public:
  /// Standard container member types.
  using element_type = T;
  using value_type = std::remove_cv_t<T>;
  using size_type = std::size_t;
  using pointer = T*;
  using iterator = T*;

  /// An empty view.
  constexpr span() noexcept = default;
  /// `size` elements starting at `data`.
  constexpr span(T* data, std::size_t size) noexcept : data_(data), size_(size) {}
  /// A whole array.
  template <std::size_t N>
  constexpr span(T (&array)[N]) noexcept : data_(array), size_(N) {}
  /// A span of convertible elements.
  template <class U, class = std::enable_if_t<compatible<U>>>
  constexpr span(const span<U>& other) noexcept : data_(other.data()), size_(other.size()) {}
  /// A contiguous container with data() and size() (rvalues only for const T).
  template <class C, class D = std::remove_cv_t<std::remove_reference_t<C>>,
            class = std::enable_if_t<!std::is_array_v<D> && compatible<elem_of<C>> &&
                                     (std::is_lvalue_reference_v<C> || std::is_const_v<T>)>>
  constexpr span(C&& c) noexcept : data_(c.data()), size_(c.size()) {}

  /// First element (may be nullptr when empty).
  constexpr T* data() const noexcept { return data_; }
  /// Number of elements.
  constexpr std::size_t size() const noexcept { return size_; }
  /// Number of bytes.
  constexpr std::size_t size_bytes() const noexcept { return size_ * sizeof(T); }
  /// Whether size() == 0.
  constexpr bool empty() const noexcept { return size_ == 0; }
  /// Iterators.
  constexpr T* begin() const noexcept { return data_; }
  /// \copydoc begin
  constexpr T* end() const noexcept { return data_ + size_; }
  /// Element i (unchecked).
  constexpr T& operator[](std::size_t i) const noexcept { return data_[i]; }
  /// `count` elements from `offset` (unchecked).
  constexpr span subspan(std::size_t offset, std::size_t count) const noexcept {
    return span(data_ + offset, count);
  }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

/// \cond deduction guides
template <class T, std::size_t N>
span(T (&)[N]) -> span<T>;
template <class C>
span(C&&) -> span<std::remove_pointer_t<decltype(std::declval<C&>().data())>>;
/// \endcond

/// A set of key/value settings (rdist_options_t); see rdist_options_set for
/// the keys. set() chains: Options().set("timeout_ms", 30000).set("debug", "INFO").
class Options {
 public:
  /// An empty set: every key at its default / environment value.
  Options() {
    rdist_options_t* raw = nullptr;
    detail::check(rdist_options_create(&raw));
    ptr_.reset(raw);
  }

  /// Sets `key` to `value`; throws rdist::Error for unknown keys or bad values.
  Options& set(const std::string& key, const std::string& value) & {
    detail::check(rdist_options_set(ptr_.get(), key.c_str(), value.c_str()));
    return *this;
  }
  /// \copydoc set
  Options&& set(const std::string& key, const std::string& value) && { return std::move(set(key, value)); }
  /// Sets `key` to an integer value (timeout_ms, local_rank, device).
  template <class N, class = std::enable_if_t<std::is_integral_v<N> && !std::is_same_v<N, bool>>>
  Options& set(const std::string& key, N value) & {
    return set(key, std::to_string(value));
  }
  /// \copydoc set
  template <class N, class = std::enable_if_t<std::is_integral_v<N> && !std::is_same_v<N, bool>>>
  Options&& set(const std::string& key, N value) && {
    return std::move(set(key, std::to_string(value)));
  }

  /// The C handle (still owned by this object; NULL once moved from).
  rdist_options_t* capi() const noexcept { return ptr_.get(); }
  /// Gives up ownership: the caller must rdist_options_destroy() the result.
  rdist_options_t* release() noexcept { return ptr_.release(); }

 private:
  struct Deleter {
    void operator()(rdist_options_t* p) const noexcept { rdist_options_destroy(p); }
  };
  std::unique_ptr<rdist_options_t, Deleter> ptr_;
};

/// An operation in flight (rdist_request_t), from a Comm::i* call. The
/// destructor frees it, waiting first if it is still running.
class [[nodiscard]] Request {
 public:
  /// An empty request (nothing in flight).
  Request() noexcept = default;
  /// Takes ownership of a C request handle.
  explicit Request(rdist_request_t* raw) noexcept : ptr_(raw) {}

  /// Blocks until the operation completes; throws rdist::Error if it failed.
  /// Waiting on an empty request returns at once.
  void wait() {
    if (ptr_) detail::check(rdist_wait(ptr_.get()));
  }
  /// Never blocks: true once the operation completed (throws rdist::Error if
  /// it failed). An empty request is complete.
  bool test() {
    if (!ptr_) return true;
    int done = 0;
    detail::check(rdist_test(ptr_.get(), &done));
    return done != 0;
  }

  /// Who sent what, once a point-to-point receive (or send) on host
  /// memory completed; throws rdist::Error otherwise.
  rdist_status_t status() const {
    rdist_status_t s{};
    detail::check(rdist_request_status(ptr_.get(), &s));
    return s;
  }

  /// Whether this holds a request.
  explicit operator bool() const noexcept { return static_cast<bool>(ptr_); }
  /// The C handle (still owned by this object).
  rdist_request_t* capi() const noexcept { return ptr_.get(); }
  /// Gives up ownership: the caller must rdist_request_free() the result.
  rdist_request_t* release() noexcept { return ptr_.release(); }

 private:
  struct Deleter {
    void operator()(rdist_request_t* p) const noexcept { rdist_request_free(p); }
  };
  std::unique_ptr<rdist_request_t, Deleter> ptr_;
};

/// Waits for every request in order; throws the first failure (the others
/// still complete when they are destroyed).
inline void wait_all(std::vector<Request>& requests) {
  for (Request& r : requests) r.wait();
}

/// RAII group (rdist_group_start/end): calls made while it lives only
/// queue, then run together, so a rank can send to and receive from the
/// same peer. Call end() to run them and see errors; otherwise the
/// destructor ends the group and ignores errors. Declare the buffers before
/// the Group, so they outlive it.
class Group {
 public:
  /// Starts a group on this thread (groups nest).
  Group() { detail::check(rdist_group_start()); }
  /// Ends the group if end() was not called, ignoring errors.
  ~Group() {
    if (!ended_) (void)rdist_group_end();
  }
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  /// Ends the group: the outermost end runs every queued call; throws
  /// rdist::Error with the first failure.
  void end() {
    if (ended_) throw Error(RDIST_ERR_INVALID_USAGE, "rdist::Group::end: the group has already ended");
    ended_ = true;
    detail::check(rdist_group_end());
  }

 private:
  bool ended_ = false;
};

/// Pass as color to Comm::split() to take no part in any new communicator.
inline constexpr int no_color = RDIST_SPLIT_NOCOLOR;

/// The library's version, major*10000 + minor*100 + patch (rdist_version).
inline int version() noexcept { return rdist_version(); }

/// NCCL-style bootstrap, step 1 (rdist_get_unique_id): this process hosts
/// the rendezvous; ship the id's bytes to every rank, then Comm::init_rank.
inline rdist_unique_id_t unique_id() {
  rdist_unique_id_t id;
  detail::check(rdist_get_unique_id(&id));
  return id;
}

/// A communicator (rdist_comm_t): move-only, destroyed with its object. An
/// empty Comm (default-constructed, moved from, or split with no_color) is
/// false; calls on it throw rdist::Error (RDIST_ERR_INVALID_ARGUMENT).
///
/// Collectives take pointer + count, rdist::span<T> or std::vector<T>
/// buffers; the element type gives the dtype. Every rank of the
/// communicator makes the same calls in the same order.
class Comm {
 public:
  /// An empty communicator.
  Comm() noexcept = default;
  /// Takes ownership of a C communicator handle.
  explicit Comm(rdist_comm_t* raw) noexcept : ptr_(raw) {}

  /// torch.distributed-style creation (rdist_init): `method` is "env://",
  /// "tcp://HOST:PORT" or "file:///path"; rank/size -1 read RANK / WORLD_SIZE.
  static Comm init(const std::string& method = "env://", int rank = -1, int size = -1,
                   const Options& opts = Options()) {
    rdist_comm_t* raw = nullptr;
    detail::check(rdist_init(&raw, method.c_str(), rank, size, opts.capi()));
    return Comm(raw);
  }

  /// NCCL-style creation (rdist_comm_init_rank) from an id made by rdist::unique_id().
  static Comm init_rank(int size, const rdist_unique_id_t& id, int rank, const Options& opts = Options()) {
    rdist_comm_t* raw = nullptr;
    detail::check(rdist_comm_init_rank(&raw, size, id, rank, opts.capi()));
    return Comm(raw);
  }

  /// This process's rank.
  int rank() const {
    int r = -1;
    detail::check(rdist_comm_rank(ptr_.get(), &r));
    return r;
  }
  /// The number of ranks.
  int size() const {
    int s = -1;
    detail::check(rdist_comm_size(ptr_.get(), &s));
    return s;
  }
  /// This process's rank among the ranks on the same host.
  int local_rank() const {
    int r = -1;
    detail::check(rdist_comm_local_rank(ptr_.get(), &r));
    return r;
  }
  /// The backend in use (never RDIST_BACKEND_AUTO).
  rdist_backend_t backend() const {
    rdist_backend_t b = RDIST_BACKEND_AUTO;
    detail::check(rdist_comm_backend(ptr_.get(), &b));
    return b;
  }

  /// Collective: ranks with equal `color` form a new communicator, ordered
  /// by (key, rank). Returns an empty Comm for color rdist::no_color.
  Comm split(int color, int key = 0) {
    rdist_comm_t* raw = nullptr;
    detail::check(rdist_comm_split(ptr_.get(), color, key, &raw));
    return Comm(raw);
  }

  /// A new communicator of this one's ranks but `exclude` and those that
  /// failed (see rdist_comm_shrink): every rank that stays calls it. With no
  /// list the survivors agree which ranks failed. `flags`:
  /// RDIST_SHRINK_DEFAULT or RDIST_SHRINK_ABORT.
  Comm shrink(const std::vector<int>& exclude = {}, int flags = RDIST_SHRINK_DEFAULT,
              const rdist_options_t* opts = nullptr) {
    rdist_comm_t* raw = nullptr;
    detail::check(rdist_comm_shrink(ptr_.get(), exclude.empty() ? nullptr : exclude.data(),
                                    static_cast<int>(exclude.size()), &raw, opts, flags));
    return Comm(raw);
  }

  /// Makes pending and future operations on this communicator fail with
  /// RDIST_ERR_ABORTED, on every rank that can be reached. Any thread may
  /// call it while another is blocked in the communicator.
  void abort() { detail::check(rdist_comm_abort(ptr_.get())); }

  /// The ranks this rank knows to have failed (their connection broke), in
  /// ascending order. Any thread may call it, also after a call failed.
  std::vector<int> failed_ranks() const {
    int count = 0;
    detail::check(rdist_comm_failed_ranks(ptr_.get(), nullptr, 0, &count));
    std::vector<int> ranks(static_cast<size_t>(count));
    while (true) {
      int now = 0;
      detail::check(rdist_comm_failed_ranks(ptr_.get(), ranks.data(), static_cast<int>(ranks.size()), &now));
      if (static_cast<size_t>(now) <= ranks.size()) {
        ranks.resize(static_cast<size_t>(now));
        return ranks;
      }
      ranks.resize(static_cast<size_t>(now));
    }
  }

  /// Destroys the communicator now, throwing on failure (the destructor
  /// does the same but ignores errors). The Comm is empty afterwards.
  void destroy() { detail::check(rdist_comm_destroy(ptr_.release())); }

  /// Whether this holds a communicator.
  explicit operator bool() const noexcept { return static_cast<bool>(ptr_); }
  /// The C handle (still owned by this object).
  rdist_comm_t* capi() const noexcept { return ptr_.get(); }
  /// Gives up ownership: the caller must rdist_comm_destroy() the result.
  rdist_comm_t* release() noexcept { return ptr_.release(); }

  // ---- allreduce: recv = op over every rank's send ------------------------

  /// Out of place: `count` elements.
  template <class T>
  void allreduce(const T* send, T* recv, std::size_t count, rdist_op_t op = RDIST_SUM) {
    detail::check(rdist_allreduce(send, recv, count, dtype_v<T>, op, c(), nullptr));
  }
  /// In place.
  template <class T>
  void allreduce(T* data, std::size_t count, rdist_op_t op = RDIST_SUM) {
    allreduce(data, data, count, op);
  }
  /// Out of place; the spans have equal sizes.
  template <class T>
  void allreduce(span<const detail::no_deduce<T>> send, span<T> recv, rdist_op_t op = RDIST_SUM) {
    same_size("allreduce", send.size(), recv.size());
    allreduce(send.data(), recv.data(), recv.size(), op);
  }
  /// In place.
  template <class T>
  void allreduce(span<T> data, rdist_op_t op = RDIST_SUM) {
    allreduce(data.data(), data.data(), data.size(), op);
  }
  /// Out of place; recv is resized to send.size().
  template <class T>
  void allreduce(const std::vector<T>& send, std::vector<T>& recv, rdist_op_t op = RDIST_SUM) {
    recv.resize(send.size());
    allreduce(send.data(), recv.data(), send.size(), op);
  }
  /// In place.
  template <class T>
  void allreduce(std::vector<T>& data, rdist_op_t op = RDIST_SUM) {
    allreduce(data.data(), data.data(), data.size(), op);
  }

  /// Non-blocking allreduce, out of place.
  template <class T>
  Request iallreduce(const T* send, T* recv, std::size_t count, rdist_op_t op = RDIST_SUM) {
    rdist_request_t* r = nullptr;
    detail::check(rdist_iallreduce(send, recv, count, dtype_v<T>, op, c(), &r));
    return Request(r);
  }
  /// Non-blocking allreduce, in place.
  template <class T>
  Request iallreduce(T* data, std::size_t count, rdist_op_t op = RDIST_SUM) {
    return iallreduce(data, data, count, op);
  }
  /// Non-blocking allreduce, out of place; equal sizes.
  template <class T>
  Request iallreduce(span<const detail::no_deduce<T>> send, span<T> recv, rdist_op_t op = RDIST_SUM) {
    same_size("iallreduce", send.size(), recv.size());
    return iallreduce(send.data(), recv.data(), recv.size(), op);
  }
  /// Non-blocking allreduce, in place.
  template <class T>
  Request iallreduce(span<T> data, rdist_op_t op = RDIST_SUM) {
    return iallreduce(data.data(), data.data(), data.size(), op);
  }
  /// Non-blocking allreduce, out of place; recv is resized first.
  template <class T>
  Request iallreduce(const std::vector<T>& send, std::vector<T>& recv, rdist_op_t op = RDIST_SUM) {
    recv.resize(send.size());
    return iallreduce(send.data(), recv.data(), send.size(), op);
  }
  /// Non-blocking allreduce, in place.
  template <class T>
  Request iallreduce(std::vector<T>& data, rdist_op_t op = RDIST_SUM) {
    return iallreduce(data.data(), data.data(), data.size(), op);
  }

  // ---- broadcast: recv = root's send ---------------------------------------

  /// Out of place: send is read on `root` only (may be nullptr elsewhere).
  template <class T>
  void broadcast(const T* send, T* recv, std::size_t count, int root) {
    detail::check(rdist_broadcast(send, recv, count, dtype_v<T>, root, c(), nullptr));
  }
  /// In place.
  template <class T>
  void broadcast(T* data, std::size_t count, int root) {
    broadcast(data, data, count, root);
  }
  /// Out of place: recv.size() elements (send may be empty off the root).
  template <class T>
  void broadcast(span<const detail::no_deduce<T>> send, span<T> recv, int root) {
    if (rank() == root) same_size("broadcast", send.size(), recv.size());
    broadcast(send.data(), recv.data(), recv.size(), root);
  }
  /// In place.
  template <class T>
  void broadcast(span<T> data, int root) {
    broadcast(data.data(), data.data(), data.size(), root);
  }
  /// In place: every rank's vector already has the broadcast's size.
  template <class T>
  void broadcast(std::vector<T>& data, int root) {
    broadcast(data.data(), data.data(), data.size(), root);
  }

  /// Non-blocking broadcast, out of place.
  template <class T>
  Request ibroadcast(const T* send, T* recv, std::size_t count, int root) {
    rdist_request_t* r = nullptr;
    detail::check(rdist_ibroadcast(send, recv, count, dtype_v<T>, root, c(), &r));
    return Request(r);
  }
  /// Non-blocking broadcast, in place.
  template <class T>
  Request ibroadcast(T* data, std::size_t count, int root) {
    return ibroadcast(data, data, count, root);
  }
  /// Non-blocking broadcast, out of place.
  template <class T>
  Request ibroadcast(span<const detail::no_deduce<T>> send, span<T> recv, int root) {
    if (rank() == root) same_size("ibroadcast", send.size(), recv.size());
    return ibroadcast(send.data(), recv.data(), recv.size(), root);
  }
  /// Non-blocking broadcast, in place.
  template <class T>
  Request ibroadcast(span<T> data, int root) {
    return ibroadcast(data.data(), data.data(), data.size(), root);
  }
  /// Non-blocking broadcast, in place.
  template <class T>
  Request ibroadcast(std::vector<T>& data, int root) {
    return ibroadcast(data.data(), data.data(), data.size(), root);
  }

  // ---- reduce: recv on root = op over every rank's send --------------------

  /// Out of place: recv is written on `root` only (may be nullptr elsewhere).
  template <class T>
  void reduce(const T* send, T* recv, std::size_t count, rdist_op_t op, int root) {
    detail::check(rdist_reduce(send, recv, count, dtype_v<T>, op, root, c(), nullptr));
  }
  /// In place: data holds the result on `root`, is unchanged elsewhere.
  template <class T>
  void reduce(T* data, std::size_t count, rdist_op_t op, int root) {
    reduce(data, data, count, op, root);
  }
  /// Out of place: on `root`, recv has send's size (elsewhere it may be empty).
  template <class T>
  void reduce(span<const detail::no_deduce<T>> send, span<T> recv, rdist_op_t op, int root) {
    if (rank() == root) same_size("reduce", send.size(), recv.size());
    reduce(send.data(), recv.data(), send.size(), op, root);
  }
  /// In place.
  template <class T>
  void reduce(span<T> data, rdist_op_t op, int root) {
    reduce(data.data(), data.data(), data.size(), op, root);
  }
  /// Out of place: recv is resized to send.size() on `root`, untouched elsewhere.
  template <class T>
  void reduce(const std::vector<T>& send, std::vector<T>& recv, rdist_op_t op, int root) {
    const bool at_root = rank() == root;
    if (at_root) recv.resize(send.size());
    reduce(send.data(), at_root ? recv.data() : nullptr, send.size(), op, root);
  }
  /// In place.
  template <class T>
  void reduce(std::vector<T>& data, rdist_op_t op, int root) {
    reduce(data.data(), data.data(), data.size(), op, root);
  }

  /// Non-blocking reduce, out of place.
  template <class T>
  Request ireduce(const T* send, T* recv, std::size_t count, rdist_op_t op, int root) {
    rdist_request_t* r = nullptr;
    detail::check(rdist_ireduce(send, recv, count, dtype_v<T>, op, root, c(), &r));
    return Request(r);
  }
  /// Non-blocking reduce, in place.
  template <class T>
  Request ireduce(T* data, std::size_t count, rdist_op_t op, int root) {
    return ireduce(data, data, count, op, root);
  }
  /// Non-blocking reduce, out of place.
  template <class T>
  Request ireduce(span<const detail::no_deduce<T>> send, span<T> recv, rdist_op_t op, int root) {
    if (rank() == root) same_size("ireduce", send.size(), recv.size());
    return ireduce(send.data(), recv.data(), send.size(), op, root);
  }
  /// Non-blocking reduce, in place.
  template <class T>
  Request ireduce(span<T> data, rdist_op_t op, int root) {
    return ireduce(data.data(), data.data(), data.size(), op, root);
  }
  /// Non-blocking reduce, out of place; recv is resized on `root` first.
  template <class T>
  Request ireduce(const std::vector<T>& send, std::vector<T>& recv, rdist_op_t op, int root) {
    const bool at_root = rank() == root;
    if (at_root) recv.resize(send.size());
    return ireduce(send.data(), at_root ? recv.data() : nullptr, send.size(), op, root);
  }
  /// Non-blocking reduce, in place.
  template <class T>
  Request ireduce(std::vector<T>& data, rdist_op_t op, int root) {
    return ireduce(data.data(), data.data(), data.size(), op, root);
  }

  // ---- allgather: recv = every rank's send, rank-major ---------------------

  /// Out of place: send has `count` elements, recv size()*count.
  template <class T>
  void allgather(const T* send, T* recv, std::size_t count) {
    detail::check(rdist_allgather(send, recv, count, dtype_v<T>, c(), nullptr));
  }
  /// In place: data holds size()*count elements, this rank's at block rank().
  template <class T>
  void allgather(T* data, std::size_t count) {
    allgather(data + static_cast<std::size_t>(rank()) * count, data, count);
  }
  /// Out of place: recv.size() == size() * send.size().
  template <class T>
  void allgather(span<const detail::no_deduce<T>> send, span<T> recv) {
    same_size("allgather", blocks(send.size()), recv.size());
    allgather(send.data(), recv.data(), send.size());
  }
  /// In place: data holds size() blocks, this rank's at block rank().
  template <class T>
  void allgather(span<T> data) {
    allgather(data.data(), block("allgather", data.size()));
  }
  /// Out of place: recv is resized to size() * send.size().
  template <class T>
  void allgather(const std::vector<T>& send, std::vector<T>& recv) {
    recv.resize(blocks(send.size()));
    allgather(send.data(), recv.data(), send.size());
  }
  /// In place: data holds size() blocks, this rank's at block rank().
  template <class T>
  void allgather(std::vector<T>& data) {
    allgather(data.data(), block("allgather", data.size()));
  }

  /// Non-blocking allgather, out of place.
  template <class T>
  Request iallgather(const T* send, T* recv, std::size_t count) {
    rdist_request_t* r = nullptr;
    detail::check(rdist_iallgather(send, recv, count, dtype_v<T>, c(), &r));
    return Request(r);
  }
  /// Non-blocking allgather, in place (this rank's block at rank()).
  template <class T>
  Request iallgather(T* data, std::size_t count) {
    return iallgather(data + static_cast<std::size_t>(rank()) * count, data, count);
  }
  /// Non-blocking allgather, out of place.
  template <class T>
  Request iallgather(span<const detail::no_deduce<T>> send, span<T> recv) {
    same_size("iallgather", blocks(send.size()), recv.size());
    return iallgather(send.data(), recv.data(), send.size());
  }
  /// Non-blocking allgather, in place.
  template <class T>
  Request iallgather(span<T> data) {
    return iallgather(data.data(), block("iallgather", data.size()));
  }
  /// Non-blocking allgather, out of place; recv is resized first.
  template <class T>
  Request iallgather(const std::vector<T>& send, std::vector<T>& recv) {
    recv.resize(blocks(send.size()));
    return iallgather(send.data(), recv.data(), send.size());
  }
  /// Non-blocking allgather, in place.
  template <class T>
  Request iallgather(std::vector<T>& data) {
    return iallgather(data.data(), block("iallgather", data.size()));
  }

  // ---- reduce_scatter: recv = block rank() of op over every rank's send ----

  /// send holds size()*count elements, recv `count`.
  template <class T>
  void reduce_scatter(const T* send, T* recv, std::size_t count, rdist_op_t op = RDIST_SUM) {
    detail::check(rdist_reduce_scatter(send, recv, count, dtype_v<T>, op, c(), nullptr));
  }
  /// send.size() == size() * recv.size().
  template <class T>
  void reduce_scatter(span<const detail::no_deduce<T>> send, span<T> recv, rdist_op_t op = RDIST_SUM) {
    same_size("reduce_scatter", send.size(), blocks(recv.size()));
    reduce_scatter(send.data(), recv.data(), recv.size(), op);
  }
  /// recv is resized to send.size() / size().
  template <class T>
  void reduce_scatter(const std::vector<T>& send, std::vector<T>& recv, rdist_op_t op = RDIST_SUM) {
    recv.resize(block("reduce_scatter", send.size()));
    reduce_scatter(send.data(), recv.data(), recv.size(), op);
  }

  /// Non-blocking reduce_scatter.
  template <class T>
  Request ireduce_scatter(const T* send, T* recv, std::size_t count, rdist_op_t op = RDIST_SUM) {
    rdist_request_t* r = nullptr;
    detail::check(rdist_ireduce_scatter(send, recv, count, dtype_v<T>, op, c(), &r));
    return Request(r);
  }
  /// Non-blocking reduce_scatter.
  template <class T>
  Request ireduce_scatter(span<const detail::no_deduce<T>> send, span<T> recv, rdist_op_t op = RDIST_SUM) {
    same_size("ireduce_scatter", send.size(), blocks(recv.size()));
    return ireduce_scatter(send.data(), recv.data(), recv.size(), op);
  }
  /// Non-blocking reduce_scatter; recv is resized first.
  template <class T>
  Request ireduce_scatter(const std::vector<T>& send, std::vector<T>& recv, rdist_op_t op = RDIST_SUM) {
    recv.resize(block("ireduce_scatter", send.size()));
    return ireduce_scatter(send.data(), recv.data(), recv.size(), op);
  }

  // ---- gather: recv on root = every rank's send, rank-major ----------------

  /// recv (size()*count elements) is written on `root` only (may be nullptr elsewhere).
  template <class T>
  void gather(const T* send, T* recv, std::size_t count, int root) {
    detail::check(rdist_gather(send, recv, count, dtype_v<T>, root, c(), nullptr));
  }
  /// On `root`, recv.size() == size() * send.size() (elsewhere it may be empty).
  template <class T>
  void gather(span<const detail::no_deduce<T>> send, span<T> recv, int root) {
    if (rank() == root) same_size("gather", blocks(send.size()), recv.size());
    gather(send.data(), recv.data(), send.size(), root);
  }
  /// recv is resized to size() * send.size() on `root`, untouched elsewhere.
  template <class T>
  void gather(const std::vector<T>& send, std::vector<T>& recv, int root) {
    const bool at_root = rank() == root;
    if (at_root) recv.resize(blocks(send.size()));
    gather(send.data(), at_root ? recv.data() : nullptr, send.size(), root);
  }

  /// Non-blocking gather.
  template <class T>
  Request igather(const T* send, T* recv, std::size_t count, int root) {
    rdist_request_t* r = nullptr;
    detail::check(rdist_igather(send, recv, count, dtype_v<T>, root, c(), &r));
    return Request(r);
  }
  /// Non-blocking gather.
  template <class T>
  Request igather(span<const detail::no_deduce<T>> send, span<T> recv, int root) {
    if (rank() == root) same_size("igather", blocks(send.size()), recv.size());
    return igather(send.data(), recv.data(), send.size(), root);
  }
  /// Non-blocking gather; recv is resized on `root` first.
  template <class T>
  Request igather(const std::vector<T>& send, std::vector<T>& recv, int root) {
    const bool at_root = rank() == root;
    if (at_root) recv.resize(blocks(send.size()));
    return igather(send.data(), at_root ? recv.data() : nullptr, send.size(), root);
  }

  // ---- scatter: recv = block rank() of root's send -------------------------

  /// send (size()*count elements) is read on `root` only (may be nullptr elsewhere).
  template <class T>
  void scatter(const T* send, T* recv, std::size_t count, int root) {
    detail::check(rdist_scatter(send, recv, count, dtype_v<T>, root, c(), nullptr));
  }
  /// recv.size() elements each; on `root`, send.size() == size() * recv.size().
  template <class T>
  void scatter(span<const detail::no_deduce<T>> send, span<T> recv, int root) {
    if (rank() == root) same_size("scatter", send.size(), blocks(recv.size()));
    scatter(send.data(), recv.data(), recv.size(), root);
  }
  /// As the span form: recv's size (known on every rank) is the count.
  template <class T>
  void scatter(const std::vector<T>& send, std::vector<T>& recv, int root) {
    scatter(span<const T>(send), span<T>(recv), root);
  }

  /// Non-blocking scatter.
  template <class T>
  Request iscatter(const T* send, T* recv, std::size_t count, int root) {
    rdist_request_t* r = nullptr;
    detail::check(rdist_iscatter(send, recv, count, dtype_v<T>, root, c(), &r));
    return Request(r);
  }
  /// Non-blocking scatter.
  template <class T>
  Request iscatter(span<const detail::no_deduce<T>> send, span<T> recv, int root) {
    if (rank() == root) same_size("iscatter", send.size(), blocks(recv.size()));
    return iscatter(send.data(), recv.data(), recv.size(), root);
  }
  /// Non-blocking scatter.
  template <class T>
  Request iscatter(const std::vector<T>& send, std::vector<T>& recv, int root) {
    return iscatter(span<const T>(send), span<T>(recv), root);
  }

  // ---- alltoall: block j of send goes to rank j ----------------------------

  /// send and recv hold size()*count elements.
  template <class T>
  void alltoall(const T* send, T* recv, std::size_t count) {
    detail::check(rdist_alltoall(send, recv, count, dtype_v<T>, c(), nullptr));
  }
  /// Equal sizes, a multiple of size().
  template <class T>
  void alltoall(span<const detail::no_deduce<T>> send, span<T> recv) {
    same_size("alltoall", send.size(), recv.size());
    alltoall(send.data(), recv.data(), block("alltoall", recv.size()));
  }
  /// recv is resized to send.size() (a multiple of size()).
  template <class T>
  void alltoall(const std::vector<T>& send, std::vector<T>& recv) {
    const std::size_t count = block("alltoall", send.size());
    recv.resize(send.size());
    alltoall(send.data(), recv.data(), count);
  }

  /// Non-blocking alltoall.
  template <class T>
  Request ialltoall(const T* send, T* recv, std::size_t count) {
    rdist_request_t* r = nullptr;
    detail::check(rdist_ialltoall(send, recv, count, dtype_v<T>, c(), &r));
    return Request(r);
  }
  /// Non-blocking alltoall.
  template <class T>
  Request ialltoall(span<const detail::no_deduce<T>> send, span<T> recv) {
    same_size("ialltoall", send.size(), recv.size());
    return ialltoall(send.data(), recv.data(), block("ialltoall", recv.size()));
  }
  /// Non-blocking alltoall; recv is resized first.
  template <class T>
  Request ialltoall(const std::vector<T>& send, std::vector<T>& recv) {
    const std::size_t count = block("ialltoall", send.size());
    recv.resize(send.size());
    return ialltoall(send.data(), recv.data(), count);
  }

  // ---- barrier -------------------------------------------------------------

  /// Returns when every rank has entered the barrier.
  void barrier() { detail::check(rdist_barrier(c())); }
  /// Non-blocking barrier.
  Request ibarrier() {
    rdist_request_t* r = nullptr;
    detail::check(rdist_ibarrier(c(), &r));
    return Request(r);
  }

  // ---- point to point ------------------------------------------------------

  /// Sends `count` elements to `peer`; the matching recv has the same count and type.
  template <class T>
  void send(const T* buf, std::size_t count, int peer) {
    detail::check(rdist_send(buf, count, dtype_v<T>, peer, c(), nullptr));
  }
  /// Sends the whole span.
  template <class T>
  void send(span<T> buf, int peer) {
    send(static_cast<const T*>(buf.data()), buf.size(), peer);
  }
  /// Sends the whole vector.
  template <class T>
  void send(const std::vector<T>& buf, int peer) {
    send(buf.data(), buf.size(), peer);
  }
  /// Receives `count` elements from `peer`.
  template <class T>
  void recv(T* buf, std::size_t count, int peer) {
    detail::check(rdist_recv(buf, count, dtype_v<T>, peer, c(), nullptr));
  }
  /// Receives buf.size() elements.
  template <class T>
  void recv(span<T> buf, int peer) {
    recv(buf.data(), buf.size(), peer);
  }
  /// Receives buf.size() elements (size the vector first).
  template <class T>
  void recv(std::vector<T>& buf, int peer) {
    recv(buf.data(), buf.size(), peer);
  }

  /// Non-blocking send.
  template <class T>
  Request isend(const T* buf, std::size_t count, int peer) {
    rdist_request_t* r = nullptr;
    detail::check(rdist_isend(buf, count, dtype_v<T>, peer, c(), &r));
    return Request(r);
  }
  /// Non-blocking send of the whole span.
  template <class T>
  Request isend(span<T> buf, int peer) {
    return isend(static_cast<const T*>(buf.data()), buf.size(), peer);
  }
  /// Non-blocking send of the whole vector.
  template <class T>
  Request isend(const std::vector<T>& buf, int peer) {
    return isend(buf.data(), buf.size(), peer);
  }
  /// Non-blocking receive.
  template <class T>
  Request irecv(T* buf, std::size_t count, int peer) {
    rdist_request_t* r = nullptr;
    detail::check(rdist_irecv(buf, count, dtype_v<T>, peer, c(), &r));
    return Request(r);
  }
  /// Non-blocking receive of buf.size() elements.
  template <class T>
  Request irecv(span<T> buf, int peer) {
    return irecv(buf.data(), buf.size(), peer);
  }
  /// Non-blocking receive of buf.size() elements.
  template <class T>
  Request irecv(std::vector<T>& buf, int peer) {
    return irecv(buf.data(), buf.size(), peer);
  }

  // ---- tagged point-to-point (MPI matching: source, tag, order) ----------
  /// Sends `count` elements to `peer` with `tag` (>= 0).
  template <class T>
  void send_tagged(const T* buf, std::size_t count, int peer, int tag) {
    detail::check(rdist_send_tagged(buf, count, dtype_v<T>, peer, tag, c(), nullptr));
  }
  /// Sends the whole vector with `tag`.
  template <class T>
  void send_tagged(const std::vector<T>& buf, int peer, int tag) {
    send_tagged(buf.data(), buf.size(), peer, tag);
  }
  /// Receives into room for `count` elements the oldest message from `peer`
  /// (RDIST_ANY_SOURCE: any rank) with `tag` (RDIST_ANY_TAG: any tag);
  /// returns who sent how many.
  template <class T>
  rdist_status_t recv_tagged(T* buf, std::size_t count, int peer = RDIST_ANY_SOURCE, int tag = RDIST_ANY_TAG) {
    rdist_status_t s{};
    detail::check(rdist_recv_tagged(buf, count, dtype_v<T>, peer, tag, c(), nullptr, &s));
    return s;
  }
  /// Receives into the vector (size it first to the largest message).
  template <class T>
  rdist_status_t recv_tagged(std::vector<T>& buf, int peer = RDIST_ANY_SOURCE, int tag = RDIST_ANY_TAG) {
    return recv_tagged(buf.data(), buf.size(), peer, tag);
  }
  /// Non-blocking send_tagged: it starts at once.
  template <class T>
  Request isend_tagged(const T* buf, std::size_t count, int peer, int tag) {
    rdist_request_t* r = nullptr;
    detail::check(rdist_isend_tagged(buf, count, dtype_v<T>, peer, tag, c(), &r));
    return Request(r);
  }
  /// Non-blocking recv_tagged: posted at once; Request::status() says who
  /// sent how many once it completed.
  template <class T>
  Request irecv_tagged(T* buf, std::size_t count, int peer = RDIST_ANY_SOURCE, int tag = RDIST_ANY_TAG) {
    rdist_request_t* r = nullptr;
    detail::check(rdist_irecv_tagged(buf, count, dtype_v<T>, peer, tag, c(), &r));
    return Request(r);
  }

 private:
  struct Deleter {
    void operator()(rdist_comm_t* p) const noexcept { (void)rdist_comm_destroy(p); }
  };

  rdist_comm_t* c() const noexcept { return ptr_.get(); }

  static void same_size(const char* what, std::size_t expected, std::size_t got) {
    if (expected != got) {
      detail::invalid(std::string(what) + ": buffer sizes do not match (" + std::to_string(expected) +
                      " vs " + std::to_string(got) + " elements)");
    }
  }
  /// size() blocks of `count` elements.
  std::size_t blocks(std::size_t count) const { return count * static_cast<std::size_t>(size()); }
  /// One block of a buffer of `total` elements split over size() ranks.
  std::size_t block(const char* what, std::size_t total) const {
    const auto n = static_cast<std::size_t>(size());
    if (total % n != 0) {
      detail::invalid(std::string(what) + ": " + std::to_string(total) +
                      " elements do not split into " + std::to_string(n) + " equal blocks");
    }
    return total / n;
  }

  std::unique_ptr<rdist_comm_t, Deleter> ptr_;
};

}  // namespace rdist

#endif  // RDIST_HPP
