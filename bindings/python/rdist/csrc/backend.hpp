// rdist as a c10d::Backend: torch.distributed's calls on an rdist
// communicator, compiled against the user's torch (rdist/_extension.py
// builds it). The Python side rendezvouses (rdist.init_from_store) and
// hands the communicator over; from then on the backend owns it.
//
// Written against the c10d API every torch from 2.4 on has. Methods that
// newer torch added (supportsCoalescing, shrink, ...) are declared without
// `override`, so that on an older torch they are plain methods.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "api.hpp"

namespace rdist_torch {

class RdistBackend;
class Waiter;

// torch's Work::wait default (no bound of its own).
constexpr std::chrono::milliseconds kWaitUnbounded{0};

// An exception of torch's distributed types carrying rdist's message:
// DistNetworkError for a lost peer, DistBackendError otherwise.
std::exception_ptr errorFor(rdist_result_t code, const std::string& message);

// The waiter thread says so (futures are then completed elsewhere).
void markWaiterThread();
bool onWaiterThread();

// Whether a failure is the group's (a timeout, a lost or failed peer,
// ranks that called differently), not one call's bad arguments: the
// failures torch's abort hooks are for.
bool groupFailure(rdist_result_t code);

// The hooks torch registers on a backend (torch with
// C10D_BACKEND_HAS_HOOKS; elsewhere nothing registers and these cost an
// atomic load). Its flight recorder learns from the completion hooks
// which calls finished, so that a dump tells a finished call from a hung
// one, and writes its trace to disk from the abort hooks when a call
// fails. Shared by the backend and its works (a work can outlive it).
class Hooks {
 public:
  using Completion = std::function<void(uint64_t key, float ms)>;
  using Abort = std::function<void()>;

  void addCompletion(int64_t id, Completion hook);
  void addAbort(int64_t id, Abort hook);
  void removeCompletion(int64_t id);
  void removeAbort(int64_t id);
  // Whether completion hooks are registered (works are timed only then).
  bool timing() const {
    return anyCompletion_.load(std::memory_order_relaxed);
  }
  // A work finished successfully: `key` its completion key, `ms` its
  // duration.
  void completed(uint64_t key, float ms);
  // A call failed with `code`: runs the abort hooks if it is the group's.
  void failed(rdist_result_t code);

 private:
  // Replaced whole on each change, so that a call copies a pointer (not
  // the hooks) under the lock and runs them after it.
  template <typename Hook>
  using Table = std::shared_ptr<const std::map<int64_t, Hook>>;
  // Runs every hook of `table` (read under the lock) with `args`.
  template <typename Hook, typename... Args>
  void runAll(const Table<Hook>& table, Args... args);

  std::mutex mutex_;
  std::atomic<bool> anyCompletion_{false};
  std::atomic<bool> anyAbort_{false};
  Table<Completion> completion_ = std::make_shared<std::map<int64_t, Completion>>();
  Table<Abort> abort_ = std::make_shared<std::map<int64_t, Abort>>();
};

// A call on rdist, issued (non-blocking: its requests) or already done.
class RdistWork : public c10d::Work {
 public:
  RdistWork(
      const Api& api,
      int rank,
      c10d::OpType opType,
      const char* profilingTitle,
      const std::vector<at::Tensor>& inputs,
      std::vector<at::Tensor> outputs,
      std::vector<c10::Device> devices,
      std::shared_ptr<Hooks> hooks);
  ~RdistWork() override;

  // Requests to wait for, buffers to keep alive until then, and what to
  // run after success (copies out of a temporary). Like completeNow, says
  // that the call was issued: only such a work reports its completion to
  // torch's hooks (one refused before it is dropped after the exception).
  void attach(
      std::vector<rdist_request_t*> requests,
      std::vector<at::Tensor> keep,
      std::function<void()> post);
  // Completes now: the blocking call ran (error: how it failed).
  void completeNow(std::exception_ptr error = nullptr);
  // Issued at endCoalescing: until then waiting returns at once and the
  // work is not completed.
  void defer() {
    deferred_ = true;
  }
  // Waits for the requests (once, on whichever thread comes first).
  void complete();
  // The sender of a receive; set when known.
  void setSource(int source) {
    source_ = source;
  }
  void setStatusOf(rdist_request_t* request) {
    statusOf_ = request;
  }

  bool isCompleted() override;
  bool isSuccess() const override;
  int sourceRank() const override;
  std::vector<at::Tensor> result() override;
  bool wait(std::chrono::milliseconds timeout) override;
  void synchronize() override {}
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  // From issue to completion, in ms, once complete (timed while torch's
  // completion hooks are registered, as its flight recorder does).
  float getDuration() const override;
#ifdef C10D_BACKEND_HAS_HOOKS
  // Never reused in this process: torch's completion hooks key on it.
  // (torch 2.15 added the macro with the abort and completion hooks and
  // this key alike.)
  uint64_t getCompletionKey() const override {
    return key_;
  }
#endif

  // Set by the backend: getFuture() asks it to complete this work from
  // its waiter thread, so that the future completes without a wait().
  std::function<void(c10::intrusive_ptr<RdistWork>)> watch;

 private:
  void postThenFinish(std::exception_ptr error);
  void finishWith(std::exception_ptr error);
  void markFuture(const c10::intrusive_ptr<c10::ivalue::Future>& future);

  const Api& api_;
  std::mutex completing_;
  std::vector<rdist_request_t*> requests_;
  std::vector<at::Tensor> keep_;
  std::function<void()> post_;
  std::vector<at::Tensor> outputs_;
  std::vector<c10::Device> devices_;
  std::mutex futureMutex_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::atomic<bool> done_{false};
  std::atomic<bool> watched_{false};
  std::atomic<bool> deferred_{false};
  std::atomic<int> source_{-1};
  rdist_request_t* statusOf_ = nullptr;
  std::shared_ptr<Hooks> hooks_;
  uint64_t key_;
  // Timed (torch's completion hooks were registered when it was made).
  bool timed_ = false;
  std::chrono::steady_clock::time_point made_;
  // The call was issued or ran (attach, completeNow).
  std::atomic<bool> issued_{false};
  std::atomic<float> ms_{-1.0f};
};

class RdistBackend : public c10d::Backend {
 public:
  // Takes over `comm` (destroyed with the backend). `libraryPath`: the
  // librdist the binding loaded. `timeout`: the group's (monitored
  // barrier's default).
  RdistBackend(
      const std::string& libraryPath,
      rdist_comm_t* comm,
      std::chrono::milliseconds timeout);
  ~RdistBackend() override;

  const std::string getBackendName() const override {
    return "rdist";
  }
  bool supportsSplitting() const override {
    return false;
  }
  bool supportsCoalescing() const {
    return true;
  }
  bool supportsShrinking() const {
    return api_.rdist_comm_shrink != nullptr;
  }

  // The number of collectives issued on this group (torch's checking
  // wrapper under TORCH_DISTRIBUTED_DEBUG=DETAIL compares it across ranks).
  void setSequenceNumberForGroup() {}
  uint64_t getSequenceNumberForGroup() {
    return collectives_.load();
  }

  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors,
      const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(
      std::vector<at::Tensor>& tensors,
      const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputLists,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(
      at::Tensor& output,
      at::Tensor& input,
      std::vector<int64_t>& outputSplitSizes,
      std::vector<int64_t>& inputSplitSizes,
      const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(
      std::vector<at::Tensor>& tensors,
      int dstRank,
      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(
      std::vector<at::Tensor>& tensors,
      int srcRank,
      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(
      std::vector<at::Tensor>& tensors,
      int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(
      const c10d::BarrierOptions& opts) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks)
      override;

  // torch.distributed.shrink_group (newer torch): a backend on every rank
  // of this one but `ranksToExclude` and any other that failed.
  c10::intrusive_ptr<c10d::Backend> shrink(
      const std::vector<int64_t>& ranksToExclude,
      int shrinkFlags = 0,
      const c10::intrusive_ptr<c10d::Backend::Options>& optsOverride =
          nullptr);
  // The same, for Python on any torch: (flags, timeout in ms or <= 0).
  c10::intrusive_ptr<RdistBackend> shrinkTo(
      const std::vector<int64_t>& ranksToExclude,
      int shrinkFlags,
      int64_t timeoutMs);

  void abort();
  void shutdown();

#ifdef C10D_BACKEND_HAS_HOOKS
  bool supportsCompletionHooks() const override {
    return true;
  }
  void registerCompletionHook(int64_t id, c10d::CompletionHook hook) override;
  void unregisterCompletionHook(int64_t id) override {
    hooks_->removeCompletion(id);
  }
  bool supportsAbortHooks() const override {
    return true;
  }
  void registerAbortHook(int64_t id, c10d::AbortHook hook) override {
    hooks_->addAbort(id, std::move(hook));
  }
  void unregisterAbortHook(int64_t id) override {
    hooks_->removeAbort(id);
  }
#endif

  // The ranks this rank knows failed.
  std::vector<int> failedRanks() const;
  // The communicator, as an int for C code (0 after shutdown).
  uintptr_t commHandle() const {
    return reinterpret_cast<uintptr_t>(comm_.load());
  }

 private:
  // What one call needs: how to issue it blocking (on `stream`: the
  // tensors' current CUDA stream, or null) and non-blocking.
  using Blocking = std::function<rdist_result_t(void* stream)>;
  using NonBlocking = std::function<rdist_result_t(rdist_request_t** request)>;

  c10::intrusive_ptr<c10d::Work> run(
      c10d::OpType opType,
      const char* title,
      bool callerWaits,
      const std::vector<at::Tensor>& inputs,
      std::vector<at::Tensor> outputs,
      std::vector<at::Tensor> keep,
      const Blocking& blocking,
      const NonBlocking& nonBlocking,
      std::function<void()> post = nullptr);
  // Several calls as one rdist group, run on this thread.
  c10::intrusive_ptr<c10d::Work> runGrouped(
      c10d::OpType opType,
      const char* title,
      const std::vector<at::Tensor>& inputs,
      std::vector<at::Tensor> outputs,
      const std::vector<Blocking>& calls,
      std::function<void()> post = nullptr);
  c10::intrusive_ptr<RdistWork> newWork(
      c10d::OpType opType,
      const char* title,
      const std::vector<at::Tensor>& inputs,
      std::vector<at::Tensor> outputs);
  void check(rdist_result_t code) const;
  // The exception for a failed call (`detail`: rdist_last_error()), after
  // the abort hooks when the failure is the group's.
  std::exception_ptr failure(rdist_result_t code, const std::string& detail) const;
  rdist_comm_t* live(const char* what) const;
  c10::intrusive_ptr<c10d::Work> p2p(
      std::vector<at::Tensor>& tensors,
      int peer,
      int tag,
      bool receiving);

  const Api& api_;
  std::string libraryPath_;
  std::atomic<rdist_comm_t*> comm_;
  std::chrono::milliseconds timeout_;
  int coalescing_ = 0;
  uint64_t monitoredCalls_ = 0;
  std::atomic<uint64_t> collectives_{0};
  // The calls torch coalesces, recorded until endCoalescing.
  struct Coalesced {
    std::vector<std::function<rdist_result_t()>> calls;
    std::vector<at::Tensor> keep;
    std::function<void()> post;
    c10::intrusive_ptr<RdistWork> work;
  };
  std::vector<Coalesced> coalesced_;

  // Completes the works whose futures were asked for (getFuture), so
  // that those complete without a wait().
  std::shared_ptr<Waiter> waiter_;
  std::shared_ptr<Hooks> hooks_;
};

}  // namespace rdist_torch
