// The library table and RdistWork: a call on rdist as torch sees it.
#include <dlfcn.h>

#include <map>
#include <memory>

#include <ATen/Parallel.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>

#include "backend.hpp"

namespace rdist_torch {

namespace {

thread_local bool waiterThread = false;

// Completion keys: unique in the process, so that a late completion can
// never be taken for another work's.
std::atomic<uint64_t> nextKey{1};

c10::SourceLocation here(const char* function, const char* file, uint32_t line) {
  return c10::SourceLocation{function, file, line};
}

}  // namespace

const Api& Api::load(const std::string& path) {
  static std::mutex mutex;
  static std::map<std::string, std::unique_ptr<Api>> loaded;
  std::lock_guard<std::mutex> guard(mutex);
  auto found = loaded.find(path);
  if (found != loaded.end()) {
    return *found->second;
  }
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  TORCH_CHECK(handle != nullptr, "rdist: cannot open ", path, ": ", dlerror());
  auto api = std::make_unique<Api>();
#define RDIST_TORCH_LOOKUP(name) \
  api->name = reinterpret_cast<decltype(&::name)>(dlsym(handle, #name));
  RDIST_TORCH_FUNCTIONS(RDIST_TORCH_LOOKUP)
#undef RDIST_TORCH_LOOKUP
  // What every librdist has; the 0.2 additions (tags, shrink, ...) may be
  // missing and are checked where used.
  TORCH_CHECK(
      api->rdist_last_error && api->rdist_allreduce && api->rdist_iallreduce &&
          api->rdist_wait && api->rdist_test && api->rdist_request_free &&
          api->rdist_group_start && api->rdist_group_end &&
          api->rdist_comm_destroy && api->rdist_isend && api->rdist_irecv,
      "rdist: ", path, " lacks functions of rdist's C API; is it librdist?");
  const Api& result = *api;
  loaded.emplace(path, std::move(api));
  return result;
}

std::string Api::lastError() const {
  const char* text = rdist_last_error ? rdist_last_error() : nullptr;
  return text && *text ? std::string(text) : std::string("rdist: no detail");
}

void markWaiterThread() {
  waiterThread = true;
}

bool onWaiterThread() {
  return waiterThread;
}

std::exception_ptr errorFor(rdist_result_t code, const std::string& message) {
  auto where = here(__func__, __FILE__, static_cast<uint32_t>(__LINE__));
  if (code == RDIST_ERR_PEER_LOST) {
    return std::make_exception_ptr(c10::DistNetworkError(where, message));
  }
  if (code == RDIST_ERR_TIMEOUT) {
    // torch's backends start so ("Timed out waiting ..."); code that
    // matches their wording matches rdist's too.
    return std::make_exception_ptr(c10::DistBackendError(
        where, "Timed out (the group's timeout ran out): " + message));
  }
  return std::make_exception_ptr(c10::DistBackendError(where, message));
}

bool groupFailure(rdist_result_t code) {
  // UNAVAILABLE is this rank's library lacking something (an NCCL without
  // shrink): not worth the recorder's one dump per process.
  return code != RDIST_SUCCESS && code != RDIST_ERR_INVALID_ARGUMENT &&
      code != RDIST_ERR_INVALID_USAGE && code != RDIST_ERR_UNAVAILABLE;
}

namespace {

template <typename Hook>
std::shared_ptr<const std::map<int64_t, Hook>> with(
    const std::shared_ptr<const std::map<int64_t, Hook>>& table,
    int64_t id,
    Hook* hook) {
  auto changed = std::make_shared<std::map<int64_t, Hook>>(*table);
  if (hook != nullptr) {
    (*changed)[id] = std::move(*hook);
  } else {
    changed->erase(id);
  }
  return changed;
}

}  // namespace

void Hooks::addCompletion(int64_t id, Completion hook) {
  std::lock_guard<std::mutex> guard(mutex_);
  completion_ = with(completion_, id, &hook);
  anyCompletion_ = true;
}

void Hooks::addAbort(int64_t id, Abort hook) {
  std::lock_guard<std::mutex> guard(mutex_);
  abort_ = with(abort_, id, &hook);
  anyAbort_ = true;
}

void Hooks::removeCompletion(int64_t id) {
  std::lock_guard<std::mutex> guard(mutex_);
  completion_ = with<Completion>(completion_, id, nullptr);
  anyCompletion_ = !completion_->empty();
}

void Hooks::removeAbort(int64_t id) {
  std::lock_guard<std::mutex> guard(mutex_);
  abort_ = with<Abort>(abort_, id, nullptr);
  anyAbort_ = !abort_->empty();
}

// Hooks run outside the lock: torch's recorder unregisters while holding
// its own lock, and a hook takes that lock. So a hook removed while
// another thread runs the table it copied may run once more (torch's
// hooks hold only a weak_ptr to their recorder, for that).
template <typename Hook, typename... Args>
void Hooks::runAll(const Table<Hook>& table, Args... args) {
  Table<Hook> now;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    now = table;
  }
  for (const auto& entry : *now) {
    try {
      entry.second(args...);
    } catch (...) {
    }
  }
}

void Hooks::completed(uint64_t key, float ms) {
  if (anyCompletion_.load(std::memory_order_relaxed)) {
    runAll(completion_, key, ms);
  }
}

void Hooks::failed(rdist_result_t code) {
  if (groupFailure(code) && anyAbort_.load(std::memory_order_relaxed)) {
    runAll(abort_);
  }
}

RdistWork::RdistWork(
    const Api& api,
    int rank,
    c10d::OpType opType,
    const char* profilingTitle,
    const std::vector<at::Tensor>& inputs,
    std::vector<at::Tensor> outputs,
    std::vector<c10::Device> devices,
    std::shared_ptr<Hooks> hooks)
    : c10d::Work(
          rank,
          opType,
          profilingTitle,
          std::optional<std::vector<at::Tensor>>(inputs)),
      api_(api),
      outputs_(std::move(outputs)),
      devices_(std::move(devices)),
      hooks_(std::move(hooks)),
      key_(nextKey.fetch_add(1, std::memory_order_relaxed)) {
  if (hooks_ && hooks_->timing()) {
    timed_ = true;
    made_ = std::chrono::steady_clock::now();
  }
}

RdistWork::~RdistWork() {
  // A work dropped unwaited still owns its requests: wait for them, so
  // that rdist never writes into buffers torch has freed.
  try {
    complete();
  } catch (...) {
  }
}

void RdistWork::attach(
    std::vector<rdist_request_t*> requests,
    std::vector<at::Tensor> keep,
    std::function<void()> post) {
  requests_ = std::move(requests);
  keep_ = std::move(keep);
  post_ = std::move(post);
  issued_ = true;
}

void RdistWork::completeNow(std::exception_ptr error) {
  issued_ = true;
  std::lock_guard<std::mutex> guard(completing_);
  if (done_.load()) {
    return;
  }
  deferred_ = false;
  postThenFinish(error);
}

// Runs the copy-out after success (its failure becomes the work's), then
// finishes. Called with completing_ held.
void RdistWork::postThenFinish(std::exception_ptr error) {
  if (!error && post_) {
    try {
      post_();
    } catch (...) {
      error = std::current_exception();
    }
  }
  post_ = nullptr;
  finishWith(error);
}

void RdistWork::complete() {
  // Before the lock: a future's callback may wait on its own work.
  if (done_.load() || deferred_.load()) {
    return;
  }
  std::lock_guard<std::mutex> guard(completing_);
  if (done_.load() || deferred_.load()) {
    return;
  }
  std::exception_ptr error;
  for (rdist_request_t* request : requests_) {
    rdist_result_t code = api_.rdist_wait(request);
    if (code != RDIST_SUCCESS && !error) {
      std::string detail = api_.lastError();
      // Before the error shows: a waiter on another thread may end the
      // process on it, and the recorder's dump must be written first.
      if (hooks_) {
        hooks_->failed(code);
      }
      error = errorFor(code, detail);
    }
  }
  if (!error && statusOf_ && api_.rdist_request_status) {
    rdist_status_t status{};
    if (api_.rdist_request_status(statusOf_, &status) == RDIST_SUCCESS) {
      source_ = status.source;
    }
  }
  for (rdist_request_t* request : requests_) {
    api_.rdist_request_free(request);
  }
  requests_.clear();
  statusOf_ = nullptr;
  keep_.clear();
  postThenFinish(error);
}

void RdistWork::finishWith(std::exception_ptr error) {
  float ms = -1.0f;
  if (timed_) {
    ms = std::chrono::duration<float, std::milli>(
             std::chrono::steady_clock::now() - made_)
             .count();
    ms_ = ms;
  }
  finish(error);
  c10::intrusive_ptr<c10::ivalue::Future> future;
  {
    std::lock_guard<std::mutex> guard(futureMutex_);
    done_ = true;
    future = future_;
  }
  // After done_: torch's recorder, missing a completion whose key it has
  // not registered yet, asks isCompleted() next and must hear yes. Only
  // for a call that was issued: one that failed before it (dropped after
  // its exception) did not complete.
  if (!error && timed_ && issued_.load()) {
    hooks_->completed(key_, ms);
  }
  if (!future) {
    return;
  }
  if (onWaiterThread()) {
    // Not on the waiter thread: torch runs the future's callbacks inline,
    // and one that waits for another call (as PowerSGD's hook does) would
    // wait for this very thread.
    auto error2 = exception();
    auto outputs = outputs_;
    at::launch([future, error2, outputs]() {
      if (error2) {
        future->setError(error2);
      } else {
        future->markCompleted(c10::IValue(outputs));
      }
    });
    return;
  }
  markFuture(future);
}

void RdistWork::markFuture(const c10::intrusive_ptr<c10::ivalue::Future>& future) {
  if (auto error = exception()) {
    future->setError(error);
  } else {
    future->markCompleted(c10::IValue(outputs_));
  }
}

bool RdistWork::isCompleted() {
  if (done_.load()) {
    return true;
  }
  if (deferred_.load()) {
    return false;
  }
  std::unique_lock<std::mutex> guard(completing_, std::try_to_lock);
  if (!guard.owns_lock() || done_.load()) {
    return done_.load();
  }
  for (rdist_request_t* request : requests_) {
    int finished = 0;
    if (api_.rdist_test(request, &finished) != RDIST_SUCCESS) {
      break;  // failed: complete() below reports how
    }
    if (!finished) {
      return false;
    }
  }
  guard.unlock();
  complete();
  return true;
}

float RdistWork::getDuration() const {
  float ms = ms_.load();
  TORCH_CHECK(
      ms >= 0.0f,
      "rdist: a work's duration is known once it completed, and only while "
      "torch's completion hooks (its flight recorder) are registered");
  return ms;
}

bool RdistWork::isSuccess() const {
  return done_.load() && !exception();
}

int RdistWork::sourceRank() const {
  int source = source_.load();
  TORCH_CHECK(
      source >= 0,
      "rdist: sourceRank() is known for a receive, once it completed");
  return source;
}

std::vector<at::Tensor> RdistWork::result() {
  return outputs_;
}

bool RdistWork::wait(std::chrono::milliseconds timeout) {
  if (deferred_.load() && !done_.load()) {
    return true;  // coalesced: it runs at endCoalescing, nothing to wait for yet
  }
  if (timeout == kWaitUnbounded || done_.load()) {
    complete();
  } else {
    // A bounded wait: let the waiter thread complete it and wait here no
    // longer than asked (rdist's own timeout bounds the call itself).
    if (!watched_.exchange(true) && watch) {
      watch(c10::intrusive_ptr<RdistWork>::reclaim_copy(this));
    }
    std::unique_lock<std::mutex> lock(mutex_);
    if (!cv_.wait_for(lock, timeout, [this] { return completed_; })) {
      C10_THROW_ERROR(
          DistBackendError,
          c10::str(
              "rdist: wait(timeout=",
              timeout.count(),
              " ms) ran out before the call completed"));
    }
  }
  if (exception()) {
    std::rethrow_exception(exception());
  }
  return true;
}

// Made when first asked for: most calls are waited for, never asked.
c10::intrusive_ptr<c10::ivalue::Future> RdistWork::getFuture() {
  static const c10::TypePtr kTensors =
      c10::ListType::create(c10::TensorType::get());
  c10::intrusive_ptr<c10::ivalue::Future> made;
  bool done = false;
  {
    std::lock_guard<std::mutex> guard(futureMutex_);
    if (future_) {
      return future_;
    }
    future_ = made = c10::make_intrusive<c10::ivalue::Future>(kTensors, devices_);
    done = done_.load();
  }
  if (done) {
    markFuture(made);
  } else if (!watched_.exchange(true) && watch) {
    watch(c10::intrusive_ptr<RdistWork>::reclaim_copy(this));
  }
  return made;
}

}  // namespace rdist_torch
