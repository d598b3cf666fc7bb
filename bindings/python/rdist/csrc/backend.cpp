// RdistBackend: each torch.distributed call translated to rdist's C API.
// Calls torch waits for at once (async_op=False) run as rdist's blocking
// calls on the calling thread; others as its non-blocking ones. CUDA
// tensors run as blocking calls on the tensors' current stream (enqueued
// there on an NCCL communicator, as torch's own nccl backend orders them).
#include <algorithm>
#include <cstring>
#include <numeric>
#include <sstream>
#include <type_traits>
#include <utility>

#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include "backend.hpp"

namespace rdist_torch {

// ---------------------------------------------------------------------------
// The waiter thread
// ---------------------------------------------------------------------------

class Waiter {
 public:
  Waiter() : thread_([this] { loop(); }) {}
  ~Waiter() {
    stop();
  }

  void push(c10::intrusive_ptr<RdistWork> work) {
    {
      std::lock_guard<std::mutex> guard(mutex_);
      if (!stopping_) {
        queue_.push_back(std::move(work));
        changed_.notify_one();
        return;
      }
    }
    work->complete();  // after shutdown: at once, on the caller's thread
  }

  // Frees requests a caller gave up on (rdist_request_free waits for them,
  // bounded by the communicator's timeout), off the caller's thread.
  // `buffers`: what they write into or read from, kept until then.
  void reap(
      const Api& api,
      std::vector<rdist_request_t*> requests,
      std::shared_ptr<void> buffers) {
    if (requests.empty()) {
      return;
    }
    {
      std::lock_guard<std::mutex> guard(mutex_);
      if (!stopping_) {
        reaps_.push_back(Reap{&api, std::move(requests), std::move(buffers)});
        changed_.notify_one();
        return;
      }
    }
    for (auto* request : requests) {
      api.rdist_request_free(request);
    }
  }

  // Completes what is queued, then ends the thread. Callers on several
  // threads all return once it has ended (the destructor among them, so
  // that the thread is never destroyed while joinable).
  void stop() {
    {
      std::lock_guard<std::mutex> guard(mutex_);
      stopping_ = true;
      changed_.notify_one();
    }
    std::lock_guard<std::mutex> joining(joining_);
    if (thread_.joinable()) {
      if (thread_.get_id() == std::this_thread::get_id()) {
        thread_.detach();
      } else {
        thread_.join();
      }
    }
  }

 private:
  void loop() {
    markWaiterThread();
    for (;;) {
      c10::intrusive_ptr<RdistWork> work;
      Reap reap;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        changed_.wait(lock, [this] {
          return stopping_ || !queue_.empty() || !reaps_.empty();
        });
        if (!reaps_.empty()) {
          reap = std::move(reaps_.front());
          reaps_.pop_front();
        } else if (!queue_.empty()) {
          work = std::move(queue_.front());
          queue_.pop_front();
        } else {
          return;
        }
      }
      for (auto* request : reap.requests) {
        reap.api->rdist_request_free(request);
      }
      if (work) {
        try {
          work->complete();
        } catch (...) {
          // complete() reports through the work and its future
        }
      }
    }
  }

  std::mutex mutex_;
  std::mutex joining_;
  std::condition_variable changed_;
  std::deque<c10::intrusive_ptr<RdistWork>> queue_;
  struct Reap {
    const Api* api = nullptr;
    std::vector<rdist_request_t*> requests;
    std::shared_ptr<void> buffers;
  };
  std::deque<Reap> reaps_;
  bool stopping_ = false;
  std::thread thread_;
};

// ---------------------------------------------------------------------------
// Translating tensors, types and options
// ---------------------------------------------------------------------------

namespace {

// monitored_barrier's messages: a tag per call (cycling over 4096), so
// that a late message of an earlier call that failed never passes for one
// of a later call.
constexpr int kMonitoredBarrierTag = 0x7fff0000;

// torch >= 2.7 says in the options whether the caller waits at once.
template <typename T, typename = void>
struct HasAsyncOp : std::false_type {};
template <typename T>
struct HasAsyncOp<T, std::void_t<decltype(std::declval<const T&>().asyncOp)>>
    : std::true_type {};

template <typename T>
bool callerWaits(const T& opts) {
  if constexpr (HasAsyncOp<T>::value) {
    return !opts.asyncOp;
  } else {
    return false;
  }
}

struct Typed {
  rdist_dtype_t dtype;
  int64_t perElement;  // rdist elements per tensor element (complex: 2)
};

// rdist's type for a tensor's. Types rdist has no reduction for move as
// bytes when the call only moves data.
Typed typeOf(const at::Tensor& t, bool movingOnly) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return {RDIST_FLOAT32, 1};
    case at::kDouble:
      return {RDIST_FLOAT64, 1};
    case at::kHalf:
      return {RDIST_FLOAT16, 1};
    case at::kBFloat16:
      return {RDIST_BFLOAT16, 1};
    case at::kInt:
      return {RDIST_INT32, 1};
    case at::kLong:
      return {RDIST_INT64, 1};
    case at::kChar:
      return {RDIST_INT8, 1};
    case at::kByte:
      return {RDIST_UINT8, 1};
    case at::kBool:
      return {RDIST_BOOL, 1};
    case at::kShort:
      return {RDIST_INT16, 1};
    case at::kComplexFloat:
      return {RDIST_FLOAT32, 2};
    case at::kComplexDouble:
      return {RDIST_FLOAT64, 2};
    case at::kComplexHalf:
      return {RDIST_FLOAT16, 2};
    default:
      break;
  }
  // Unsigned 16/32/64 (torch >= 2.3) and anything newer, by name: the
  // enumerators do not exist on every torch.
  const std::string name = c10::toString(t.scalar_type());
  if (name == "UInt16") {
    return {RDIST_UINT16, 1};
  }
  if (name == "UInt32") {
    return {RDIST_UINT32, 1};
  }
  if (name == "UInt64") {
    return {RDIST_UINT64, 1};
  }
  TORCH_CHECK(
      movingOnly, "rdist has no reduction for ", t.scalar_type(), " tensors");
  return {RDIST_UINT8, static_cast<int64_t>(t.element_size())};
}

size_t countOf(const at::Tensor& t, const Typed& typed) {
  return static_cast<size_t>(t.numel() * typed.perElement);
}

void checkTensor(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.defined(), "rdist: ", what, " is undefined");
  TORCH_CHECK(
      t.layout() == at::kStrided,
      "rdist: ",
      what,
      " is ",
      t.layout(),
      "; only dense tensors (sparse: all_reduce)");
  TORCH_CHECK(
      t.is_contiguous(),
      "rdist: ",
      what,
      " (shape ",
      t.sizes(),
      ", strides ",
      t.strides(),
      ") is not contiguous; pass .contiguous() and copy the result back");
  TORCH_CHECK(
      t.device().is_cpu() || t.device().is_cuda(),
      "rdist: ",
      what,
      " is on ",
      t.device(),
      "; CPU and CUDA only");
}

void checkSingle(const std::vector<at::Tensor>& tensors, const char* what) {
  TORCH_CHECK(
      tensors.size() == 1,
      "rdist: ",
      what,
      " takes one tensor per call (got ",
      tensors.size(),
      ")");
}

void checkLike(const at::Tensor& t, const at::Tensor& like, const char* what) {
  TORCH_CHECK(
      t.scalar_type() == like.scalar_type() && t.device() == like.device(),
      "rdist: ",
      what,
      " is ",
      t.scalar_type(),
      " on ",
      t.device(),
      ", the input ",
      like.scalar_type(),
      " on ",
      like.device());
}

// (rdist op, PREMUL_SUM's factor or undefined) for torch's ReduceOp.
std::pair<rdist_op_t, c10::optional<at::Tensor>> opOf(
    const c10d::ReduceOp& op,
    const at::Tensor& like) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      return {RDIST_SUM, c10::nullopt};
    case c10d::ReduceOp::AVG:
      return {RDIST_AVG, c10::nullopt};
    case c10d::ReduceOp::PRODUCT:
      return {RDIST_PROD, c10::nullopt};
    case c10d::ReduceOp::MIN:
      return {RDIST_MIN, c10::nullopt};
    case c10d::ReduceOp::MAX:
      return {RDIST_MAX, c10::nullopt};
    case c10d::ReduceOp::BAND:
      return {RDIST_BAND, c10::nullopt};
    case c10d::ReduceOp::BOR:
      return {RDIST_BOR, c10::nullopt};
    case c10d::ReduceOp::BXOR:
      return {RDIST_BXOR, c10::nullopt};
    case c10d::ReduceOp::PREMUL_SUM: {
      auto* factor =
          dynamic_cast<c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
      TORCH_CHECK(factor != nullptr, "rdist: PREMUL_SUM without its factor");
      at::Tensor scale = factor->tensor_factor.defined()
          ? factor->tensor_factor.to(like.device(), like.scalar_type())
          : at::scalar_tensor(
                factor->double_factor,
                at::TensorOptions().dtype(like.scalar_type()).device(
                    like.device()));
      return {RDIST_SUM, scale};
    }
    default:
      break;
  }
  TORCH_CHECK(false, "rdist: unsupported reduction ", static_cast<int>(op.op_));
}

template <typename S, typename = void>
struct HasNativeHandle : std::false_type {};
template <typename S>
struct HasNativeHandle<
    S,
    std::void_t<decltype(std::declval<const S&>().native_handle())>>
    : std::true_type {};

// A torch whose c10::Stream cannot say its native handle (before 2.5)
// gets the legacy default stream, once the current one has drained.
template <typename S>
void* nativeHandle(S& stream) {
  if constexpr (HasNativeHandle<S>::value) {
    return stream.native_handle();
  } else {
    stream.synchronize();
    return nullptr;
  }
}

// A tensor's current CUDA stream, as the native handle rdist takes.
void* streamOf(const at::Tensor& t) {
  if (!t.is_cuda()) {
    return nullptr;
  }
  const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  c10::Stream stream = impl->getStream(t.device());
  return nativeHandle(stream);
}

bool anyCuda(const std::vector<at::Tensor>& tensors) {
  return std::any_of(tensors.begin(), tensors.end(), [](const at::Tensor& t) {
    return t.defined() && t.is_cuda();
  });
}

std::vector<c10::Device> devicesOf(const std::vector<at::Tensor>& tensors) {
  std::vector<c10::Device> devices;
  for (const auto& t : tensors) {
    if (t.defined() && t.is_cuda() &&
        std::find(devices.begin(), devices.end(), t.device()) ==
            devices.end()) {
      devices.push_back(t.device());
    }
  }
  return devices;
}

// Where `outputs` (one tensor per rank, each like `input`) are written:
// one tensor over them when they lie back to back in one storage, else a
// temporary and a copy out (the post step).
std::pair<at::Tensor, std::function<void()>> gatherTarget(
    const std::vector<at::Tensor>& outputs,
    const at::Tensor& input,
    int size,
    const char* what) {
  TORCH_CHECK(
      static_cast<int>(outputs.size()) == size,
      "rdist ",
      what,
      ": ",
      outputs.size(),
      " output tensors for ",
      size,
      " ranks");
  for (const auto& o : outputs) {
    TORCH_CHECK(
        o.numel() == input.numel(),
        "rdist ",
        what,
        ": every output must have the input's ",
        input.numel(),
        " elements (one has ",
        o.numel(),
        ")");
    checkLike(o, input, "an output");
  }
  const at::Tensor& first = outputs[0];
  const int64_t step = first.numel() * first.element_size();
  // Views of one storage, back to back (adjacent allocations are not).
  bool consecutive = first.numel() > 0 &&
      first.storage_offset() * first.element_size() + size * step <=
          static_cast<int64_t>(first.storage().nbytes());
  for (size_t i = 0; consecutive && i < outputs.size(); ++i) {
    const auto& o = outputs[i];
    consecutive = o.is_contiguous() && o.storage().is_alias_of(first.storage()) &&
        static_cast<char*>(o.data_ptr()) ==
            static_cast<char*>(first.data_ptr()) + i * step;
  }
  if (consecutive) {
    at::Tensor base =
        first.view(-1).as_strided({size * first.numel()}, {1});
    return {base, nullptr};
  }
  std::vector<int64_t> shape{size};
  shape.insert(shape.end(), input.sizes().begin(), input.sizes().end());
  at::Tensor temp = at::empty(shape, input.options());
  auto copies = outputs;
  return {temp, [temp, copies]() mutable {
            for (size_t i = 0; i < copies.size(); ++i) {
              copies[i].copy_(temp[i].view_as(copies[i]));
            }
          }};
}

at::Tensor flatCat(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> flat;
  flat.reserve(tensors.size());
  for (const auto& t : tensors) {
    flat.push_back(t.reshape({-1}));
  }
  return at::cat(flat);
}

}  // namespace

// ---------------------------------------------------------------------------
// Lifecycle
// ---------------------------------------------------------------------------

RdistBackend::RdistBackend(
    const std::string& libraryPath,
    rdist_comm_t* comm,
    std::chrono::milliseconds timeout)
    : c10d::Backend(
          [&] {
            int rank = -1;
            const Api& api = Api::load(libraryPath);
            TORCH_CHECK(
                api.rdist_comm_rank(comm, &rank) == RDIST_SUCCESS,
                api.lastError());
            return rank;
          }(),
          [&] {
            int size = -1;
            const Api& api = Api::load(libraryPath);
            TORCH_CHECK(
                api.rdist_comm_size(comm, &size) == RDIST_SUCCESS,
                api.lastError());
            return size;
          }()),
      api_(Api::load(libraryPath)),
      libraryPath_(libraryPath),
      comm_(comm),
      timeout_(timeout),
      waiter_(std::make_shared<Waiter>()),
      hooks_(std::make_shared<Hooks>()) {}

#ifdef C10D_BACKEND_HAS_HOOKS
void RdistBackend::registerCompletionHook(int64_t id, c10d::CompletionHook hook) {
  hooks_->addCompletion(id, [hook = std::move(hook)](uint64_t key, float ms) {
    c10d::CompletionHookArgs args;
    args.completionKey = key;
    args.duration_ms = ms;
    hook(args);
  });
}
#endif

RdistBackend::~RdistBackend() {
  try {
    shutdown();
  } catch (...) {
  }
}

void RdistBackend::shutdown() {
  if (waiter_) {
    waiter_->stop();
  }
  rdist_comm_t* comm = comm_.exchange(nullptr);
  if (comm != nullptr) {
    api_.rdist_comm_destroy(comm);
  }
}

void RdistBackend::abort() {
  rdist_comm_t* comm = comm_.load();
  if (comm != nullptr) {
    api_.rdist_comm_abort(comm);
  }
}

std::vector<int> RdistBackend::failedRanks() const {
  rdist_comm_t* comm = live("failed_ranks");
  TORCH_CHECK(
      api_.rdist_comm_failed_ranks != nullptr,
      "rdist: failed_ranks needs librdist 0.2");
  int count = 0;
  check(api_.rdist_comm_failed_ranks(comm, nullptr, 0, &count));
  // More may fail between the calls: ask again until they fit.
  for (;;) {
    std::vector<int> ranks(std::max(count, 0));
    int got = 0;
    check(api_.rdist_comm_failed_ranks(comm, ranks.data(), count, &got));
    if (got <= count) {
      ranks.resize(got);
      return ranks;
    }
    count = got;
  }
}

c10::intrusive_ptr<c10d::Backend> RdistBackend::shrink(
    const std::vector<int64_t>& ranksToExclude,
    int shrinkFlags,
    const c10::intrusive_ptr<c10d::Backend::Options>& optsOverride) {
  int64_t timeoutMs = 0;
  if (optsOverride) {
    timeoutMs = optsOverride->timeout.count();
  }
  return shrinkTo(ranksToExclude, shrinkFlags, timeoutMs);
}

c10::intrusive_ptr<RdistBackend> RdistBackend::shrinkTo(
    const std::vector<int64_t>& ranksToExclude,
    int shrinkFlags,
    int64_t timeoutMs) {
  rdist_comm_t* comm = live("shrink");
  TORCH_CHECK(
      api_.rdist_comm_shrink != nullptr, "rdist: shrink needs librdist 0.2");
  std::vector<int> excluded(ranksToExclude.begin(), ranksToExclude.end());
  rdist_options_t* options = nullptr;
  if (timeoutMs > 0) {
    check(api_.rdist_options_create(&options));
    std::string value = std::to_string(timeoutMs);
    rdist_result_t code =
        api_.rdist_options_set(options, "timeout_ms", value.c_str());
    if (code != RDIST_SUCCESS) {
      std::string detail = api_.lastError();
      api_.rdist_options_destroy(options);
      std::rethrow_exception(failure(code, detail));
    }
  }
  rdist_comm_t* child = nullptr;
  rdist_result_t code = api_.rdist_comm_shrink(
      comm,
      excluded.data(),
      static_cast<int>(excluded.size()),
      &child,
      options,
      shrinkFlags);
  std::string detail = code == RDIST_SUCCESS ? "" : api_.lastError();
  if (options != nullptr) {
    api_.rdist_options_destroy(options);
  }
  if (code != RDIST_SUCCESS) {
    std::rethrow_exception(failure(code, detail));
  }
  int childSize = 0;
  api_.rdist_comm_size(child, &childSize);
  if (childSize != size_ - static_cast<int>(excluded.size())) {
    // torch numbers the new group from ranks_to_exclude alone: a rank that
    // also failed would leave its numbering wrong.
    api_.rdist_comm_destroy(child);
    std::ostringstream list;
    for (size_t i = 0; i < excluded.size(); ++i) {
      list << (i ? ", " : "") << excluded[i];
    }
    std::rethrow_exception(failure(
        RDIST_ERR_PEER_LOST,
        c10::str(
            "rdist: shrink_group left out more ranks than ranks_to_exclude [",
            list.str(),
            "] (the survivors found ",
            size_ - childSize,
            " failed): pass every failed rank, e.g. the backend's "
            "failed_ranks() after a call that failed")));
  }
  auto timeout = timeoutMs > 0 ? std::chrono::milliseconds(timeoutMs) : timeout_;
  return c10::make_intrusive<RdistBackend>(libraryPath_, child, timeout);
}

// ---------------------------------------------------------------------------
// Issuing
// ---------------------------------------------------------------------------

rdist_comm_t* RdistBackend::live(const char* what) const {
  rdist_comm_t* comm = comm_.load();
  TORCH_CHECK(
      comm != nullptr,
      "rdist: ",
      what,
      " on a backend that was shut down (destroy_process_group)");
  return comm;
}

void RdistBackend::check(rdist_result_t code) const {
  if (code != RDIST_SUCCESS) {
    std::rethrow_exception(failure(code, api_.lastError()));
  }
}

std::exception_ptr RdistBackend::failure(
    rdist_result_t code,
    const std::string& detail) const {
  hooks_->failed(code);
  return errorFor(code, detail);
}

c10::intrusive_ptr<RdistWork> RdistBackend::newWork(
    c10d::OpType opType,
    const char* title,
    const std::vector<at::Tensor>& inputs,
    std::vector<at::Tensor> outputs) {
  if (opType != c10d::OpType::SEND && opType != c10d::OpType::RECV) {
    ++collectives_;
  }
  std::vector<at::Tensor> all = inputs;
  all.insert(all.end(), outputs.begin(), outputs.end());
  auto devices = devicesOf(all);
  auto work = c10::make_intrusive<RdistWork>(
      api_, rank_, opType, title, inputs, std::move(outputs), devices, hooks_);
  std::weak_ptr<Waiter> waiter = waiter_;
  work->watch = [waiter](c10::intrusive_ptr<RdistWork> w) {
    if (auto alive = waiter.lock()) {
      alive->push(std::move(w));
    } else {
      w->complete();
    }
  };
  return work;
}

c10::intrusive_ptr<c10d::Work> RdistBackend::run(
    c10d::OpType opType,
    const char* title,
    bool waits,
    const std::vector<at::Tensor>& inputs,
    std::vector<at::Tensor> outputs,
    std::vector<at::Tensor> keep,
    const Blocking& blocking,
    const NonBlocking& nonBlocking,
    std::function<void()> post) {
  live(title);
  auto work = newWork(opType, title, inputs, std::move(outputs));
  const bool cuda = anyCuda(inputs) || anyCuda(keep);
  void* stream = nullptr;
  if (cuda) {
    for (const auto& t : keep) {
      if (t.defined() && t.is_cuda()) {
        stream = streamOf(t);
        break;
      }
    }
  }
  if (coalescing_ > 0) {
    // Recorded: endCoalescing runs the calls as one rdist group.
    work->defer();
    coalesced_.push_back(
        Coalesced{{[blocking, stream]() { return blocking(stream); }},
                  std::move(keep),
                  std::move(post),
                  work});
    return work;
  }
  if (cuda || waits) {
    check(blocking(stream));
    work->attach({}, {}, std::move(post));
    work->completeNow();
    return work;
  }
  rdist_request_t* request = nullptr;
  check(nonBlocking(&request));
  work->attach({request}, std::move(keep), std::move(post));
  return work;
}

c10::intrusive_ptr<c10d::Work> RdistBackend::runGrouped(
    c10d::OpType opType,
    const char* title,
    const std::vector<at::Tensor>& inputs,
    std::vector<at::Tensor> outputs,
    const std::vector<Blocking>& calls,
    std::function<void()> post) {
  live(title);
  auto work = newWork(opType, title, inputs, std::move(outputs));
  void* stream = nullptr;
  for (const auto& t : inputs) {
    if (t.is_cuda()) {
      stream = streamOf(t);
      break;
    }
  }
  if (coalescing_ > 0) {
    work->defer();
    Coalesced recorded{{}, inputs, std::move(post), work};
    for (const auto& call : calls) {
      recorded.calls.push_back([call, stream]() { return call(stream); });
    }
    coalesced_.push_back(std::move(recorded));
    return work;
  }
  check(api_.rdist_group_start());
  rdist_result_t failed = RDIST_SUCCESS;
  std::string detail;
  for (const auto& call : calls) {
    rdist_result_t code = call(stream);
    if (code != RDIST_SUCCESS) {
      failed = code;
      detail = api_.lastError();
      break;
    }
  }
  rdist_result_t ended = api_.rdist_group_end();
  if (failed == RDIST_SUCCESS && ended != RDIST_SUCCESS) {
    failed = ended;
    detail = api_.lastError();
  }
  if (failed != RDIST_SUCCESS) {
    std::rethrow_exception(failure(failed, detail));
  }
  work->attach({}, {}, std::move(post));
  work->completeNow();
  return work;
}

void RdistBackend::startCoalescing() {
  live("start_coalescing");
  // What a coalescing torch abandoned (an exception in its block) is
  // dropped: nothing of it was issued.
  if (coalescing_ == 0) {
    coalesced_.clear();
  }
  ++coalescing_;
}

// Runs the recorded calls as one rdist group (a group is only ever open
// here, never while torch's block runs other code).
c10::intrusive_ptr<c10d::Work> RdistBackend::endCoalescing() {
  TORCH_CHECK(
      coalescing_ > 0, "rdist: end_coalescing without start_coalescing");
  if (--coalescing_ > 0) {
    // Nested: the outermost end runs them all.
    auto work = newWork(c10d::OpType::COALESCED, "rdist:coalesced", {}, {});
    work->defer();
    return work;
  }
  auto recorded = std::move(coalesced_);
  coalesced_.clear();
  std::exception_ptr error;
  if (!recorded.empty()) {
    rdist_result_t code = api_.rdist_group_start();
    std::string detail;
    if (code != RDIST_SUCCESS) {
      detail = api_.lastError();
    } else {
      for (auto& entry : recorded) {
        for (auto& call : entry.calls) {
          code = call();
          if (code != RDIST_SUCCESS) {
            detail = api_.lastError();
            break;
          }
        }
        if (code != RDIST_SUCCESS) {
          break;
        }
      }
      rdist_result_t ended = api_.rdist_group_end();
      if (code == RDIST_SUCCESS && ended != RDIST_SUCCESS) {
        code = ended;
        detail = api_.lastError();
      }
    }
    if (code != RDIST_SUCCESS) {
      error = failure(code, detail);
    }
  }
  std::vector<at::Tensor> outputs;
  for (auto& entry : recorded) {
    entry.work->attach({}, {}, error ? nullptr : std::move(entry.post));
    entry.work->completeNow(error);
    auto r = entry.work->result();
    outputs.insert(outputs.end(), r.begin(), r.end());
  }
  auto work = newWork(c10d::OpType::COALESCED, "rdist:coalesced", {}, outputs);
  work->completeNow(error);
  if (error) {
    std::rethrow_exception(error);
  }
  return work;
}

// ---------------------------------------------------------------------------
// Collectives
// ---------------------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> RdistBackend::broadcast(
    std::vector<at::Tensor>& tensors,
    const c10d::BroadcastOptions& opts) {
  checkSingle(tensors, "broadcast");
  at::Tensor t = tensors[0];
  checkTensor(t, "tensor");
  Typed ty = typeOf(t, true);
  void* p = t.data_ptr();
  size_t n = countOf(t, ty);
  int root = static_cast<int>(opts.rootRank);
  rdist_comm_t* c = live("broadcast");
  const Api& a = api_;
  return run(
      c10d::OpType::BROADCAST,
      "rdist:broadcast",
      callerWaits(opts),
      tensors,
      tensors,
      {t},
      [=, &a](void* s) { return a.rdist_broadcast(p, p, n, ty.dtype, root, c, s); },
      [=, &a](rdist_request_t** r) {
        return a.rdist_ibroadcast(p, p, n, ty.dtype, root, c, r);
      });
}

c10::intrusive_ptr<c10d::Work> RdistBackend::allreduce(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  if (tensors.size() == 1 && tensors[0].defined() &&
      tensors[0].layout() == at::kSparse) {
    return allreduce_sparse(tensors, opts);
  }
  if (tensors.size() != 1) {
    c10d::AllreduceCoalescedOptions coalesced;
    coalesced.reduceOp = opts.reduceOp;
    coalesced.timeout = opts.timeout;
    return allreduce_coalesced(tensors, coalesced);
  }
  at::Tensor t = tensors[0];
  checkTensor(t, "tensor");
  auto [op, factor] = opOf(opts.reduceOp, t);
  if (factor) {
    t.mul_(*factor);
  }
  Typed ty = typeOf(t, false);
  void* p = t.data_ptr();
  size_t n = countOf(t, ty);
  rdist_comm_t* c = live("all_reduce");
  const Api& a = api_;
  return run(
      c10d::OpType::ALLREDUCE,
      "rdist:all_reduce",
      callerWaits(opts),
      tensors,
      tensors,
      {t},
      [=, &a](void* s) { return a.rdist_allreduce(p, p, n, ty.dtype, op, c, s); },
      [=, &a](rdist_request_t** r) {
        return a.rdist_iallreduce(p, p, n, ty.dtype, op, c, r);
      });
}

c10::intrusive_ptr<c10d::Work> RdistBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceCoalescedOptions& opts) {
  TORCH_CHECK(!tensors.empty(), "rdist: all_reduce_coalesced of no tensors");
  std::vector<Blocking> calls;
  rdist_comm_t* c = live("all_reduce_coalesced");
  const Api& a = api_;
  for (auto& t : tensors) {
    checkTensor(t, "tensor");
    auto [op, factor] = opOf(opts.reduceOp, t);
    if (factor) {
      t.mul_(*factor);
    }
    Typed ty = typeOf(t, false);
    void* p = t.data_ptr();
    size_t n = countOf(t, ty);
    calls.push_back([=, &a](void* s) {
      return a.rdist_allreduce(p, p, n, ty.dtype, op, c, s);
    });
  }
  return runGrouped(
      c10d::OpType::ALLREDUCE_COALESCED,
      "rdist:all_reduce_coalesced",
      tensors,
      tensors,
      calls);
}

// Sparse tensors as gloo sums them: every rank's (indices, values) are
// gathered and added up, so every rank ends with the same coalesced sum.
c10::intrusive_ptr<c10d::Work> RdistBackend::allreduce_sparse(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  checkSingle(tensors, "sparse all_reduce");
  TORCH_CHECK(coalescing_ == 0, "rdist: a sparse all_reduce cannot be coalesced");
  TORCH_CHECK(
      opts.reduceOp.op_ == c10d::ReduceOp::SUM,
      "rdist: sparse all_reduce sums only (as gloo)");
  TORCH_CHECK(
      tensors[0].layout() == at::kSparse && tensors[0].is_cpu(),
      "rdist: sparse all_reduce takes a sparse COO CPU tensor");
  TORCH_CHECK(
      api_.rdist_allgatherv != nullptr,
      "rdist: sparse all_reduce needs librdist 0.2 (rdist_allgatherv)");
  rdist_comm_t* c = live("sparse all_reduce");
  auto work = newWork(
      c10d::OpType::ALLREDUCE, "rdist:all_reduce_sparse", tensors, tensors);
  at::Tensor input = tensors[0].coalesce();
  at::Tensor indices = input._indices().contiguous();
  at::Tensor values = input._values().contiguous();
  const int64_t sparseDims = indices.size(0);
  // Elements per nonzero (the product of the dense dimensions): the same
  // on every rank, also on one that holds no nonzeros.
  int64_t rowElements = 1;
  for (int64_t d = 1; d < values.dim(); ++d) {
    rowElements *= values.size(d);
  }
  // Each rank's count of nonzeros.
  at::Tensor counts = at::empty({size_}, at::kLong);
  int64_t nnz = indices.size(1);
  check(api_.rdist_allgather(
      &nnz, counts.data_ptr(), 1, RDIST_INT64, c, nullptr));
  std::vector<size_t> indexCounts(size_), valueCounts(size_),
      indexDispls(size_), valueDispls(size_);
  size_t indexTotal = 0, valueTotal = 0;
  for (int r = 0; r < size_; ++r) {
    int64_t k = counts[r].item<int64_t>();
    indexCounts[r] = static_cast<size_t>(k * sparseDims);
    valueCounts[r] = static_cast<size_t>(k * rowElements);
    indexDispls[r] = indexTotal;
    valueDispls[r] = valueTotal;
    indexTotal += indexCounts[r];
    valueTotal += valueCounts[r];
  }
  // Indices are gathered per rank as [sparseDims, k] blocks.
  at::Tensor allIndices = at::empty({static_cast<int64_t>(indexTotal)}, at::kLong);
  Typed vty = typeOf(values, false);
  std::vector<int64_t> valueShape{0};
  for (int64_t d = 1; d < values.dim(); ++d) {
    valueShape.push_back(values.size(d));
  }
  at::Tensor allValues =
      at::empty({static_cast<int64_t>(valueTotal)}, values.options());
  std::vector<size_t> vCounts = valueCounts, vDispls = valueDispls;
  for (int r = 0; r < size_; ++r) {
    vCounts[r] *= vty.perElement;
    vDispls[r] *= vty.perElement;
  }
  rdist_result_t code = api_.rdist_allgatherv(
      indices.data_ptr(),
      indexCounts[rank_],
      allIndices.data_ptr(),
      indexCounts.data(),
      indexDispls.data(),
      RDIST_INT64,
      c,
      nullptr);
  std::string detail = code == RDIST_SUCCESS ? "" : api_.lastError();
  if (code == RDIST_SUCCESS) {
    code = api_.rdist_allgatherv(
        values.data_ptr(),
        vCounts[rank_],
        allValues.data_ptr(),
        vCounts.data(),
        vDispls.data(),
        vty.dtype,
        c,
        nullptr);
    detail = code == RDIST_SUCCESS ? "" : api_.lastError();
  }
  if (code != RDIST_SUCCESS) {
    std::rethrow_exception(failure(code, detail));
  }
  std::vector<at::Tensor> indexBlocks, valueBlocks;
  for (int r = 0; r < size_; ++r) {
    int64_t k = counts[r].item<int64_t>();
    indexBlocks.push_back(
        allIndices.narrow(0, indexDispls[r], indexCounts[r]).view({sparseDims, k}));
    std::vector<int64_t> shape = valueShape;
    shape[0] = k;
    valueBlocks.push_back(
        allValues.narrow(0, valueDispls[r], valueCounts[r]).view(shape));
  }
  at::Tensor sum = at::sparse_coo_tensor(
                       at::cat(indexBlocks, 1),
                       at::cat(valueBlocks, 0),
                       input.sizes(),
                       input.options())
                       .coalesce();
  // In place, as gloo: the caller's tensor becomes the sum.
  tensors[0].copy_(sum);
  work->completeNow();
  return work;
}

c10::intrusive_ptr<c10d::Work> RdistBackend::reduce(
    std::vector<at::Tensor>& tensors,
    const c10d::ReduceOptions& opts) {
  checkSingle(tensors, "reduce");
  at::Tensor t = tensors[0];
  checkTensor(t, "tensor");
  auto [op, factor] = opOf(opts.reduceOp, t);
  if (factor) {
    t.mul_(*factor);
  }
  Typed ty = typeOf(t, false);
  void* p = t.data_ptr();
  size_t n = countOf(t, ty);
  int root = static_cast<int>(opts.rootRank);
  rdist_comm_t* c = live("reduce");
  const Api& a = api_;
  return run(
      c10d::OpType::REDUCE,
      "rdist:reduce",
      callerWaits(opts),
      tensors,
      tensors,
      {t},
      [=, &a](void* s) { return a.rdist_reduce(p, p, n, ty.dtype, op, root, c, s); },
      [=, &a](rdist_request_t** r) {
        return a.rdist_ireduce(p, p, n, ty.dtype, op, root, c, r);
      });
}

c10::intrusive_ptr<c10d::Work> RdistBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  if (inputs.size() != 1) {
    return allgather_coalesced(outputs, inputs, opts);
  }
  TORCH_CHECK(outputs.size() == 1, "rdist: all_gather takes one output list");
  at::Tensor in = inputs[0];
  checkTensor(in, "input");
  auto [out, post] = gatherTarget(outputs[0], in, size_, "all_gather");
  Typed ty = typeOf(in, true);
  void* sp = in.data_ptr();
  void* rp = out.data_ptr();
  size_t n = countOf(in, ty);
  rdist_comm_t* c = live("all_gather");
  const Api& a = api_;
  return run(
      c10d::OpType::ALLGATHER,
      "rdist:all_gather",
      callerWaits(opts),
      inputs,
      outputs[0],
      {in, out},
      [=, &a](void* s) { return a.rdist_allgather(sp, rp, n, ty.dtype, c, s); },
      [=, &a](rdist_request_t** r) {
        return a.rdist_iallgather(sp, rp, n, ty.dtype, c, r);
      },
      post);
}

c10::intrusive_ptr<c10d::Work> RdistBackend::_allgather_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::AllgatherOptions& opts) {
  checkTensor(input, "input");
  checkTensor(output, "output");
  checkLike(output, input, "the output");
  TORCH_CHECK(
      output.numel() == input.numel() * size_,
      "rdist all_gather_into_tensor: output has ",
      output.numel(),
      " elements, needs ",
      size_,
      " x ",
      input.numel());
  Typed ty = typeOf(input, true);
  void* sp = input.data_ptr();
  void* rp = output.data_ptr();
  size_t n = countOf(input, ty);
  rdist_comm_t* c = live("all_gather_into_tensor");
  const Api& a = api_;
  return run(
      c10d::OpType::_ALLGATHER_BASE,
      "rdist:all_gather_into_tensor",
      callerWaits(opts),
      {input},
      {output},
      {input, output},
      [=, &a](void* s) { return a.rdist_allgather(sp, rp, n, ty.dtype, c, s); },
      [=, &a](rdist_request_t** r) {
        return a.rdist_iallgather(sp, rp, n, ty.dtype, c, r);
      });
}

// outputLists is [rank][tensor], as torch passes it: outputLists[r][j]
// receives rank r's inputs[j]. All inputs go as one all_gather of their
// concatenation.
c10::intrusive_ptr<c10d::Work> RdistBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputLists,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  TORCH_CHECK(!inputs.empty(), "rdist: all_gather_coalesced of no tensors");
  TORCH_CHECK(
      static_cast<int>(outputLists.size()) == size_,
      "rdist all_gather_coalesced: ",
      outputLists.size(),
      " output lists for ",
      size_,
      " ranks (one list per rank)");
  for (const auto& in : inputs) {
    TORCH_CHECK(in.defined(), "rdist: an input is undefined");
    checkLike(in, inputs[0], "an input");
  }
  for (const auto& list : outputLists) {
    TORCH_CHECK(
        list.size() == inputs.size(),
        "rdist all_gather_coalesced: each rank's output list needs ",
        inputs.size(),
        " tensors (one per input), one has ",
        list.size());
    for (size_t j = 0; j < list.size(); ++j) {
      TORCH_CHECK(
          list[j].numel() == inputs[j].numel(),
          "rdist all_gather_coalesced: output for input ",
          j,
          " has ",
          list[j].numel(),
          " elements, the input ",
          inputs[j].numel());
      checkLike(list[j], inputs[j], "an output");
    }
  }
  at::Tensor flat = flatCat(inputs);
  if (flat.is_complex()) {
    flat = at::view_as_real(flat);
  }
  std::vector<int64_t> shape{size_};
  shape.insert(shape.end(), flat.sizes().begin(), flat.sizes().end());
  at::Tensor gathered = at::empty(shape, flat.options());
  std::vector<at::Tensor> flatOutputs;
  for (const auto& list : outputLists) {
    flatOutputs.insert(flatOutputs.end(), list.begin(), list.end());
  }
  auto lists = outputLists;
  auto post = [gathered, lists]() {
    for (size_t r = 0; r < lists.size(); ++r) {
      at::Tensor row = gathered[r];
      if (lists[r][0].is_complex()) {
        row = at::view_as_complex(row);
      }
      int64_t offset = 0;
      for (const auto& out : lists[r]) {
        out.copy_(row.narrow(0, offset, out.numel()).view_as(out));
        offset += out.numel();
      }
    }
  };
  Typed ty = typeOf(flat, true);
  void* sp = flat.data_ptr();
  void* rp = gathered.data_ptr();
  size_t n = countOf(flat, ty);
  rdist_comm_t* c = live("all_gather_coalesced");
  const Api& a = api_;
  return run(
      c10d::OpType::ALLGATHER_COALESCED,
      "rdist:all_gather_coalesced",
      callerWaits(opts),
      inputs,
      flatOutputs,
      {flat, gathered},
      [=, &a](void* s) { return a.rdist_allgather(sp, rp, n, ty.dtype, c, s); },
      [=, &a](rdist_request_t** r) {
        return a.rdist_iallgather(sp, rp, n, ty.dtype, c, r);
      },
      post);
}

c10::intrusive_ptr<c10d::Work> RdistBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& /*opts*/) {
  TORCH_CHECK(
      outputs.size() == inputs.size(),
      "rdist: all_gather_into_tensor_coalesced needs one output per input");
  std::vector<Blocking> calls;
  rdist_comm_t* c = live("all_gather_into_tensor_coalesced");
  const Api& a = api_;
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkTensor(inputs[i], "input");
    checkTensor(outputs[i], "output");
    checkLike(outputs[i], inputs[i], "an output");
    TORCH_CHECK(
        outputs[i].numel() == inputs[i].numel() * size_,
        "rdist all_gather_into_tensor_coalesced: output ",
        i,
        " has ",
        outputs[i].numel(),
        " elements, needs ",
        size_,
        " x ",
        inputs[i].numel());
    Typed ty = typeOf(inputs[i], true);
    void* sp = inputs[i].data_ptr();
    void* rp = outputs[i].data_ptr();
    size_t n = countOf(inputs[i], ty);
    calls.push_back(
        [=, &a](void* s) { return a.rdist_allgather(sp, rp, n, ty.dtype, c, s); });
  }
  return runGrouped(
      c10d::OpType::COALESCED,
      "rdist:all_gather_into_tensor_coalesced",
      inputs,
      outputs,
      calls);
}

c10::intrusive_ptr<c10d::Work> RdistBackend::gather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  checkSingle(inputs, "gather");
  at::Tensor in = inputs[0];
  checkTensor(in, "input");
  const int root = static_cast<int>(opts.rootRank);
  at::Tensor out;
  std::function<void()> post;
  std::vector<at::Tensor> result;
  if (rank_ == root) {
    TORCH_CHECK(outputs.size() == 1, "rdist: gather takes one output list at the root");
    std::tie(out, post) = gatherTarget(outputs[0], in, size_, "gather");
    result = outputs[0];
  } else {
    TORCH_CHECK(
        outputs.empty() || outputs[0].empty(),
        "rdist: gather's outputs are given at the root only");
  }
  Typed ty = typeOf(in, true);
  void* sp = in.data_ptr();
  void* rp = out.defined() ? out.data_ptr() : nullptr;
  size_t n = countOf(in, ty);
  rdist_comm_t* c = live("gather");
  const Api& a = api_;
  return run(
      c10d::OpType::GATHER,
      "rdist:gather",
      callerWaits(opts),
      inputs,
      result,
      {in, out},
      [=, &a](void* s) { return a.rdist_gather(sp, rp, n, ty.dtype, root, c, s); },
      [=, &a](rdist_request_t** r) {
        return a.rdist_igather(sp, rp, n, ty.dtype, root, c, r);
      },
      post);
}

c10::intrusive_ptr<c10d::Work> RdistBackend::scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  checkSingle(outputs, "scatter");
  at::Tensor out = outputs[0];
  checkTensor(out, "output");
  const int root = static_cast<int>(opts.rootRank);
  at::Tensor send;
  if (rank_ == root) {
    TORCH_CHECK(inputs.size() == 1, "rdist: scatter takes one input list at the root");
    TORCH_CHECK(
        static_cast<int>(inputs[0].size()) == size_,
        "rdist scatter: ",
        inputs[0].size(),
        " inputs for ",
        size_,
        " ranks");
    for (const auto& t : inputs[0]) {
      checkLike(t, out, "an input");
      TORCH_CHECK(
          t.numel() == out.numel(),
          "rdist scatter: every input needs the output's ",
          out.numel(),
          " elements");
    }
    send = flatCat(inputs[0]);
  }
  Typed ty = typeOf(out, true);
  void* sp = send.defined() ? send.data_ptr() : nullptr;
  void* rp = out.data_ptr();
  size_t n = countOf(out, ty);
  rdist_comm_t* c = live("scatter");
  const Api& a = api_;
  std::vector<at::Tensor> in = send.defined() ? std::vector<at::Tensor>{send}
                                              : std::vector<at::Tensor>{};
  return run(
      c10d::OpType::SCATTER,
      "rdist:scatter",
      callerWaits(opts),
      in,
      outputs,
      {send, out},
      [=, &a](void* s) { return a.rdist_scatter(sp, rp, n, ty.dtype, root, c, s); },
      [=, &a](rdist_request_t** r) {
        return a.rdist_iscatter(sp, rp, n, ty.dtype, root, c, r);
      });
}

c10::intrusive_ptr<c10d::Work> RdistBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  checkSingle(outputs, "reduce_scatter");
  TORCH_CHECK(inputs.size() == 1, "rdist: reduce_scatter takes one input list");
  at::Tensor out = outputs[0];
  checkTensor(out, "output");
  TORCH_CHECK(
      static_cast<int>(inputs[0].size()) == size_,
      "rdist reduce_scatter: ",
      inputs[0].size(),
      " inputs for ",
      size_,
      " ranks");
  for (const auto& t : inputs[0]) {
    checkLike(t, out, "an input");
    TORCH_CHECK(
        t.numel() == out.numel(),
        "rdist reduce_scatter: every input needs the output's ",
        out.numel(),
        " elements");
  }
  at::Tensor send = flatCat(inputs[0]);
  at::Tensor flatSend = send;
  return _reduce_scatter_base(out, flatSend, opts);
}

c10::intrusive_ptr<c10d::Work> RdistBackend::_reduce_scatter_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::ReduceScatterOptions& opts) {
  checkTensor(input, "input");
  checkTensor(output, "output");
  checkLike(output, input, "the output");
  TORCH_CHECK(
      input.numel() == output.numel() * size_,
      "rdist reduce_scatter_tensor: input has ",
      input.numel(),
      " elements, needs ",
      size_,
      " x ",
      output.numel());
  auto [op, factor] = opOf(opts.reduceOp, output);
  at::Tensor send = factor ? input * *factor : input;
  Typed ty = typeOf(output, false);
  void* sp = send.data_ptr();
  void* rp = output.data_ptr();
  size_t n = countOf(output, ty);
  rdist_comm_t* c = live("reduce_scatter");
  const Api& a = api_;
  return run(
      c10d::OpType::_REDUCE_SCATTER_BASE,
      "rdist:reduce_scatter",
      callerWaits(opts),
      {input},
      {output},
      {send, output},
      [=, &a](void* s) {
        return a.rdist_reduce_scatter(sp, rp, n, ty.dtype, op, c, s);
      },
      [=, &a](rdist_request_t** r) {
        return a.rdist_ireduce_scatter(sp, rp, n, ty.dtype, op, c, r);
      });
}

c10::intrusive_ptr<c10d::Work> RdistBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK(
      outputs.size() == inputs.size(),
      "rdist: reduce_scatter_tensor_coalesced needs one output per input");
  std::vector<Blocking> calls;
  std::vector<at::Tensor> keep;
  rdist_comm_t* c = live("reduce_scatter_tensor_coalesced");
  const Api& a = api_;
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkTensor(inputs[i], "input");
    checkTensor(outputs[i], "output");
    checkLike(outputs[i], inputs[i], "an output");
    TORCH_CHECK(
        inputs[i].numel() == outputs[i].numel() * size_,
        "rdist reduce_scatter_tensor_coalesced: input ",
        i,
        " has ",
        inputs[i].numel(),
        " elements, needs ",
        size_,
        " x ",
        outputs[i].numel());
    auto [op, factor] = opOf(opts.reduceOp, outputs[i]);
    at::Tensor send = factor ? inputs[i] * *factor : inputs[i];
    keep.push_back(send);
    Typed ty = typeOf(outputs[i], false);
    void* sp = send.data_ptr();
    void* rp = outputs[i].data_ptr();
    size_t n = countOf(outputs[i], ty);
    calls.push_back([=, &a](void* s) {
      return a.rdist_reduce_scatter(sp, rp, n, ty.dtype, op, c, s);
    });
  }
  auto held = keep;
  return runGrouped(
      c10d::OpType::COALESCED,
      "rdist:reduce_scatter_tensor_coalesced",
      inputs,
      outputs,
      calls,
      [held]() {});
}

c10::intrusive_ptr<c10d::Work> RdistBackend::alltoall_base(
    at::Tensor& output,
    at::Tensor& input,
    std::vector<int64_t>& outputSplitSizes,
    std::vector<int64_t>& inputSplitSizes,
    const c10d::AllToAllOptions& opts) {
  checkTensor(input, "input");
  checkTensor(output, "output");
  checkLike(output, input, "the output");
  Typed ty = typeOf(input, true);
  rdist_comm_t* c = live("all_to_all_single");
  const Api& a = api_;
  void* sp = input.data_ptr();
  void* rp = output.data_ptr();
  if (outputSplitSizes.empty() && inputSplitSizes.empty()) {
    TORCH_CHECK(
        input.numel() % size_ == 0 && output.numel() == input.numel(),
        "rdist all_to_all_single: ",
        input.numel(),
        " input / ",
        output.numel(),
        " output elements do not split evenly over ",
        size_,
        " ranks");
    size_t n = countOf(input, ty) / size_;
    return run(
        c10d::OpType::ALLTOALL_BASE,
        "rdist:all_to_all",
        callerWaits(opts),
        {input},
        {output},
        {input, output},
        [=, &a](void* s) { return a.rdist_alltoall(sp, rp, n, ty.dtype, c, s); },
        [=, &a](rdist_request_t** r) {
          return a.rdist_ialltoall(sp, rp, n, ty.dtype, c, r);
        });
  }
  TORCH_CHECK(
      a.rdist_alltoallv != nullptr,
      "rdist: uneven all_to_all needs librdist 0.2 (rdist_alltoallv)");
  const int64_t rowIn =
      input.dim() && input.size(0) ? input.numel() / input.size(0) : 1;
  const int64_t rowOut =
      output.dim() && output.size(0) ? output.numel() / output.size(0) : 1;
  auto splits = [&](const std::vector<int64_t>& given, const at::Tensor& t) {
    std::vector<int64_t> s = given;
    if (s.empty()) {
      s.assign(size_, t.dim() ? t.size(0) / size_ : 0);
    }
    TORCH_CHECK(
        static_cast<int>(s.size()) == size_,
        "rdist all_to_all_single: ",
        s.size(),
        " split sizes for ",
        size_,
        " ranks");
    return s;
  };
  auto inSplits = splits(inputSplitSizes, input);
  auto outSplits = splits(outputSplitSizes, output);
  auto sc = std::make_shared<std::vector<size_t>>(size_);
  auto sd = std::make_shared<std::vector<size_t>>(size_);
  auto rc = std::make_shared<std::vector<size_t>>(size_);
  auto rd = std::make_shared<std::vector<size_t>>(size_);
  size_t sendTotal = 0, recvTotal = 0;
  for (int r = 0; r < size_; ++r) {
    (*sc)[r] = static_cast<size_t>(inSplits[r] * rowIn * ty.perElement);
    (*rc)[r] = static_cast<size_t>(outSplits[r] * rowOut * ty.perElement);
    (*sd)[r] = sendTotal;
    (*rd)[r] = recvTotal;
    sendTotal += (*sc)[r];
    recvTotal += (*rc)[r];
  }
  TORCH_CHECK(
      sendTotal <= countOf(input, ty) && recvTotal <= countOf(output, ty),
      "rdist all_to_all_single: the split sizes ask for more elements than "
      "the tensors hold");
  // The blocking call reads the counts during the call, the non-blocking
  // one copies them (docs/api.md).
  return run(
      c10d::OpType::ALLTOALL_BASE,
      "rdist:all_to_all",
      callerWaits(opts),
      {input},
      {output},
      {input, output},
      [=, &a](void* s) {
        return a.rdist_alltoallv(
            sp, sc->data(), sd->data(), rp, rc->data(), rd->data(), ty.dtype, c, s);
      },
      [=, &a](rdist_request_t** r) {
        return a.rdist_ialltoallv(
            sp, sc->data(), sd->data(), rp, rc->data(), rd->data(), ty.dtype, c, r);
      });
}

c10::intrusive_ptr<c10d::Work> RdistBackend::alltoall(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllToAllOptions& opts) {
  TORCH_CHECK(
      static_cast<int>(inputs.size()) == size_ &&
          static_cast<int>(outputs.size()) == size_,
      "rdist all_to_all: needs ",
      size_,
      " inputs and outputs (one per rank)");
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkLike(inputs[i], inputs[0], "an input");
    checkLike(outputs[i], inputs[0], "an output");
  }
  at::Tensor send = flatCat(inputs);
  int64_t outTotal = 0;
  for (const auto& o : outputs) {
    outTotal += o.numel();
  }
  at::Tensor recv = at::empty({outTotal}, send.options());
  Typed ty = typeOf(send, true);
  // Counts in rdist's elements; always the v-form, so that every rank
  // makes the same call whatever its own sizes look like.
  auto sc = std::make_shared<std::vector<size_t>>(size_);
  auto sd = std::make_shared<std::vector<size_t>>(size_);
  auto rc = std::make_shared<std::vector<size_t>>(size_);
  auto rd = std::make_shared<std::vector<size_t>>(size_);
  size_t sent = 0, received = 0;
  for (int r = 0; r < size_; ++r) {
    (*sc)[r] = countOf(inputs[r], ty);
    (*rc)[r] = countOf(outputs[r], ty);
    (*sd)[r] = sent;
    (*rd)[r] = received;
    sent += (*sc)[r];
    received += (*rc)[r];
  }
  auto outs = outputs;
  auto copyOut = [recv, outs]() {
    int64_t offset = 0;
    for (const auto& o : outs) {
      o.copy_(recv.narrow(0, offset, o.numel()).view_as(o));
      offset += o.numel();
    }
  };
  void* sp = send.data_ptr();
  void* rp = recv.data_ptr();
  rdist_comm_t* c = live("all_to_all");
  const Api& a = api_;
  if (a.rdist_alltoallv == nullptr) {
    // A 0.1 library: even splits only (every rank must pass even ones).
    for (int r = 0; r < size_; ++r) {
      TORCH_CHECK(
          (*sc)[r] == (*sc)[0] && (*rc)[r] == (*sc)[0],
          "rdist: uneven all_to_all needs librdist 0.2 (rdist_alltoallv)");
    }
    size_t n = (*sc)[0];
    return run(
        c10d::OpType::ALLTOALL,
        "rdist:all_to_all",
        callerWaits(opts),
        inputs,
        outputs,
        {send, recv},
        [=, &a](void* s) { return a.rdist_alltoall(sp, rp, n, ty.dtype, c, s); },
        [=, &a](rdist_request_t** r) {
          return a.rdist_ialltoall(sp, rp, n, ty.dtype, c, r);
        },
        copyOut);
  }
  return run(
      c10d::OpType::ALLTOALL,
      "rdist:all_to_all",
      callerWaits(opts),
      inputs,
      outputs,
      {send, recv},
      [=, &a](void* s) {
        return a.rdist_alltoallv(
            sp, sc->data(), sd->data(), rp, rc->data(), rd->data(), ty.dtype, c, s);
      },
      [=, &a](rdist_request_t** r) {
        return a.rdist_ialltoallv(
            sp, sc->data(), sd->data(), rp, rc->data(), rd->data(), ty.dtype, c, r);
      },
      copyOut);
}

c10::intrusive_ptr<c10d::Work> RdistBackend::barrier(
    const c10d::BarrierOptions& opts) {
  rdist_comm_t* c = live("barrier");
  const Api& a = api_;
  return run(
      c10d::OpType::BARRIER,
      "rdist:barrier",
      callerWaits(opts),
      {},
      {},
      {},
      [=, &a](void*) { return a.rdist_barrier(c); },
      [=, &a](rdist_request_t** r) { return a.rdist_ibarrier(c, r); });
}

// As gloo's: rank 0 waits for every other rank for the call's timeout and
// names the ranks that did not arrive (the first, or all of them with
// wait_all_ranks); the others wait for rank 0's answer as long.
void RdistBackend::monitoredBarrier(
    const c10d::BarrierOptions& opts,
    bool waitAllRanks) {
  rdist_comm_t* c = live("monitored_barrier");
  TORCH_CHECK(coalescing_ == 0, "rdist: monitored_barrier cannot be coalesced");
  if (api_.rdist_isend_tagged == nullptr) {
    check(api_.rdist_barrier(c));
    return;
  }
  // The call's own timeout when given (0 included, as gloo), else the group's.
  const auto timeout = opts.timeout.count() >= 0 ? opts.timeout : timeout_;
  const int tag = kMonitoredBarrierTag + static_cast<int>(monitoredCalls_++ % 4096);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  // [0]: the token sent, [1]: the answer, [2 + r]: rank r's token at rank
  // 0. On the heap: requests given up on still use them.
  auto buffers = std::make_shared<std::vector<uint8_t>>(size_ + 2, 1);
  uint8_t& token = (*buffers)[0];
  auto pollUntilDeadline = [&](std::vector<rdist_request_t*>& pending,
                               std::vector<int>& peers,
                               bool stopAtFirst) {
    // Returns the peers whose request did not finish in time.
    std::vector<int> late;
    std::vector<bool> done(pending.size(), false);
    size_t left = pending.size();
    while (left > 0) {
      for (size_t i = 0; i < pending.size(); ++i) {
        if (done[i]) {
          continue;
        }
        int finished = 0;
        rdist_result_t code = api_.rdist_test(pending[i], &finished);
        if (code != RDIST_SUCCESS) {
          std::string detail = api_.lastError();
          waiter_->reap(api_, pending, buffers);
          std::rethrow_exception(failure(code, detail));
        }
        if (finished) {
          done[i] = true;
          --left;
        }
      }
      if (left == 0 || std::chrono::steady_clock::now() >= deadline) {
        break;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    std::vector<rdist_request_t*> abandoned;
    for (size_t i = 0; i < pending.size(); ++i) {
      if (done[i]) {
        api_.rdist_request_free(pending[i]);
        continue;
      }
      abandoned.push_back(pending[i]);
      if (late.empty() || !stopAtFirst) {
        late.push_back(peers[i]);
      }
    }
    // Freeing waits for them: the waiter thread does, so that this call
    // returns at its deadline (they end when the late rank arrives, or at
    // the communicator's timeout).
    waiter_->reap(api_, std::move(abandoned), buffers);
    return late;
  };
  if (rank_ == 0 && timeout.count() == 0 && size_ > 1) {
    C10_THROW_ERROR(
        DistBackendError,
        "Rank 0 timed out in monitoredBarrier after 0 ms (rdist: a zero "
        "timeout leaves no time to wait for the other ranks)");
  }
  if (rank_ == 0) {
    std::vector<rdist_request_t*> pending;
    std::vector<int> peers;
    for (int r = 1; r < size_; ++r) {
      rdist_request_t* request = nullptr;
      rdist_result_t code = api_.rdist_irecv_tagged(
          &(*buffers)[2 + r], 1, RDIST_UINT8, r, tag, c, &request);
      if (code != RDIST_SUCCESS) {
        // The receives posted so far still write into the buffers.
        std::string detail = api_.lastError();
        waiter_->reap(api_, pending, buffers);
        std::rethrow_exception(failure(code, detail));
      }
      pending.push_back(request);
      peers.push_back(r);
    }
    auto late = pollUntilDeadline(pending, peers, !waitAllRanks);
    if (!late.empty()) {
      std::ostringstream text;
      text << (late.size() == 1 ? "Rank " : "Ranks ");
      for (size_t i = 0; i < late.size(); ++i) {
        text << (i ? ", " : "") << late[i];
      }
      text << " failed to pass monitoredBarrier in " << timeout.count()
           << " ms (rdist: rank 0 waited for them)";
      hooks_->failed(RDIST_ERR_TIMEOUT);
      C10_THROW_ERROR(DistBackendError, text.str());
    }
    std::vector<rdist_request_t*> acks;
    for (int r = 1; r < size_; ++r) {
      rdist_request_t* request = nullptr;
      check(api_.rdist_isend_tagged(
          &token, 1, RDIST_UINT8, r, tag, c, &request));
      acks.push_back(request);
    }
    for (auto* request : acks) {
      rdist_result_t code = api_.rdist_wait(request);
      std::string detail = code == RDIST_SUCCESS ? "" : api_.lastError();
      api_.rdist_request_free(request);
      if (code != RDIST_SUCCESS) {
        std::rethrow_exception(failure(code, detail));
      }
    }
    return;
  }
  rdist_request_t* sent = nullptr;
  check(api_.rdist_isend_tagged(
      &token, 1, RDIST_UINT8, 0, tag, c, &sent));
  uint8_t& answer = (*buffers)[1];
  rdist_request_t* answered = nullptr;
  rdist_result_t code = api_.rdist_irecv_tagged(
      &answer, 1, RDIST_UINT8, 0, tag, c, &answered);
  if (code != RDIST_SUCCESS) {
    std::string detail = api_.lastError();
    api_.rdist_request_free(sent);
    std::rethrow_exception(failure(code, detail));
  }
  std::vector<rdist_request_t*> pending{sent, answered};
  std::vector<int> peers{0, 0};
  // In gloo's words, whatever went wrong (programs and tests match them),
  // with rdist's own account after.
  const std::string told = c10::str(
      "Rank ",
      rank_,
      " successfully reached monitoredBarrier, but received errors while "
      "waiting for send/recv from rank 0. Please check rank 0 logs for "
      "faulty rank. (rdist: ");
  std::vector<int> late;
  try {
    late = pollUntilDeadline(pending, peers, true);
  } catch (const c10::Error& e) {
    C10_THROW_ERROR(
        DistBackendError, c10::str(told, e.what_without_backtrace(), ")"));
  }
  if (!late.empty()) {
    hooks_->failed(RDIST_ERR_TIMEOUT);
    C10_THROW_ERROR(
        DistBackendError,
        c10::str(
            told,
            "rank 0 did not answer within ",
            timeout.count(),
            " ms; it reports which ranks failed to pass it)"));
  }
}

// ---------------------------------------------------------------------------
// Point to point
// ---------------------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> RdistBackend::p2p(
    std::vector<at::Tensor>& tensors,
    int peer,
    int tag,
    bool receiving) {
  checkSingle(tensors, receiving ? "recv" : "send");
  at::Tensor t = tensors[0];
  checkTensor(t, "tensor");
  Typed ty = typeOf(t, true);
  size_t n = countOf(t, ty);
  rdist_comm_t* c = live(receiving ? "recv" : "send");
  auto work = newWork(
      receiving ? c10d::OpType::RECV : c10d::OpType::SEND,
      receiving ? "rdist:recv" : "rdist:send",
      tensors,
      tensors);
  if (coalescing_ > 0) {
    // Inside torch's coalescing (batch_isend_irecv): recorded as the
    // blocking calls, which endCoalescing's rdist group only queues.
    TORCH_CHECK(
        peer >= 0, "rdist: a receive from any source cannot be coalesced");
    TORCH_CHECK(
        api_.rdist_send_tagged != nullptr || tag == 0,
        "rdist: tags need librdist 0.2");
    void* p = t.data_ptr();
    void* stream = streamOf(t);
    const Api& a = api_;
    std::function<rdist_result_t()> call = [=, &a]() {
      if (a.rdist_send_tagged != nullptr) {
        return receiving
            ? a.rdist_recv_tagged(p, n, ty.dtype, peer, tag, c, stream, nullptr)
            : a.rdist_send_tagged(p, n, ty.dtype, peer, tag, c, stream);
      }
      return receiving ? a.rdist_recv(p, n, ty.dtype, peer, c, stream)
                       : a.rdist_send(p, n, ty.dtype, peer, c, stream);
    };
    if (receiving) {
      work->setSource(peer);
    }
    work->defer();
    coalesced_.push_back(Coalesced{{call}, {t}, nullptr, work});
    return work;
  }
  if (t.is_cuda()) {
    // rdist's non-blocking calls run on its own stream: let what the
    // current stream produces or reads finish first.
    c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)
        ->getStream(t.device())
        .synchronize();
  }
  rdist_request_t* request = nullptr;
  if (api_.rdist_isend_tagged != nullptr) {
    check(
        receiving
            ? api_.rdist_irecv_tagged(t.data_ptr(), n, ty.dtype, peer, tag, c, &request)
            : api_.rdist_isend_tagged(t.data_ptr(), n, ty.dtype, peer, tag, c, &request));
  } else {
    TORCH_CHECK(
        tag == 0 && peer >= 0,
        "rdist: tagged send/recv and receiving from any source need librdist 0.2");
    check(
        receiving ? api_.rdist_irecv(t.data_ptr(), n, ty.dtype, peer, c, &request)
                  : api_.rdist_isend(t.data_ptr(), n, ty.dtype, peer, c, &request));
  }
  if (receiving) {
    if (peer >= 0) {
      work->setSource(peer);
    } else {
      work->setStatusOf(request);
    }
  }
  work->attach({request}, {t}, nullptr);
  return work;
}

c10::intrusive_ptr<c10d::Work> RdistBackend::send(
    std::vector<at::Tensor>& tensors,
    int dstRank,
    int tag) {
  return p2p(tensors, dstRank, tag, false);
}

c10::intrusive_ptr<c10d::Work> RdistBackend::recv(
    std::vector<at::Tensor>& tensors,
    int srcRank,
    int tag) {
  return p2p(tensors, srcRank, tag, true);
}

c10::intrusive_ptr<c10d::Work> RdistBackend::recvAnysource(
    std::vector<at::Tensor>& tensors,
    int tag) {
  return p2p(tensors, RDIST_ANY_SOURCE, tag, true);
}

}  // namespace rdist_torch
