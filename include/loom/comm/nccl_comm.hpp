#pragma once
// nccl_comm: NCCL collectives on a CUDA stream, one process per GPU, bootstrapped over MPI.
//
// Why it is written this way:
// - The bootstrap is MPI (rank 0 makes the ncclUniqueId and broadcasts it over an mpi_comm)
//   because loom's scale-out story is `mpirun` + NCCL; no launcher protocol of our own.
// - Spans hold device pointers, never dereferenced on the host. This header includes only
//   cuda_runtime_api.h and nccl.h, so host C++ code can use it (no kernels here).
// - Every collective is enqueued on the communicator's stream. The blocking form
//   synchronises the stream; the async form records a CUDA event and returns a `work` whose
//   test() queries it and wait() synchronises on it, so compute on other streams overlaps.
// - Checked mode agrees on each call through the bootstrap mpi_comm (host, before enqueueing),
//   with its timeout; waiting on an async collective in checked mode with a timeout polls the
//   event and aborts the NCCL communicator (ncclCommAbort) when the time is up, so a dead peer
//   cannot hang the job. NCCL's own asynchronous errors are checked when waiting.
// - Differences from thread_comm/mpi_comm, by NCCL's design: half and bfloat16 reduce in
//   their own type inside NCCL (no float accumulation; use float buffers when that matters);
//   point-to-point has no tags (messages between two ranks match in issue order, the tag is
//   only checked to be >= 0); 16-bit integers are not supported.

#include <loom/comm/checked.hpp>
#include <loom/comm/collective_api.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/comm/mpi_comm.hpp>
#include <loom/core/cuda/error.hpp>
#include <loom/core/cuda/nccl_error.hpp>
#include <loom/core/dtype.hpp>
#include <loom/core/error.hpp>

#include <cuda_runtime_api.h>
#include <mpi.h>
#include <nccl.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <thread>

namespace loom::comm {

namespace detail {

inline ncclDataType_t nccl_datatype(dtype t) {
  switch (t) {
    case dtype::f32: return ncclFloat32;
    case dtype::f64: return ncclFloat64;
    case dtype::f16: return ncclFloat16;
    case dtype::bf16: return ncclBfloat16;
    case dtype::i8: return ncclInt8;
    case dtype::u8: return ncclUint8;
    case dtype::i32: return ncclInt32;
    case dtype::u32: return ncclUint32;
    case dtype::i64: return ncclInt64;
    case dtype::u64: return ncclUint64;
    default: break;
  }
  LOOM_THROW("nccl_comm: NCCL has no element type ", dtype_name(t), " (16-bit integers are not supported)");
}

inline ncclRedOp_t nccl_reduce_op(reduce_op op) {
  switch (op) {
    case reduce_op::sum: return ncclSum;
    case reduce_op::avg: return ncclAvg;
    case reduce_op::max: return ncclMax;
    case reduce_op::min: return ncclMin;
  }
  LOOM_THROW("nccl_comm: unknown reduce_op ", static_cast<int>(op));
}

struct nccl_state {
  mpi_comm boot;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  bool own_stream = false;
  int device = 0;
  std::string broken;

  explicit nccl_state(mpi_comm b) : boot(std::move(b)) {}
  nccl_state(const nccl_state&) = delete;
  nccl_state& operator=(const nccl_state&) = delete;
  ~nccl_state() {
    if (comm) (void)(broken.empty() ? ncclCommDestroy(comm) : ncclCommAbort(comm));
    if (own_stream && stream) (void)cudaStreamDestroy(stream);
  }
  void check_usable(const std::string& what) const {
    if (!broken.empty()) throw error("nccl_comm: " + what + " on a broken communicator: " + broken);
  }
  void check_async_error() {
    ncclResult_t async_rc = ncclSuccess;
    LOOM_NCCL_CHECK(ncclCommGetAsyncError(comm, &async_rc));
    LOOM_NCCL_CHECK(async_rc);
  }
  /// Waits for `ev` (past the timeout: aborts NCCL and breaks the communicator).
  void wait_event(cudaEvent_t ev, const std::string& what) {
    const auto limit = timeout();
    const auto deadline = std::chrono::steady_clock::now() + limit;
    for (;;) {
      const cudaError_t q = cudaEventQuery(ev);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) LOOM_CUDA_CHECK(q);
      check_async_error();
      if (limit.count() > 0 && std::chrono::steady_clock::now() >= deadline) {
        broken = "rank " + std::to_string(boot.rank()) + " of a group of " + std::to_string(boot.size()) + " timed out after " +
                 std::to_string(limit.count()) + " ms waiting for " + what + ": a rank of the group failed, returned, " +
                 "stopped or waits in another call " + timeout_hint(limit);
        (void)ncclCommAbort(comm);
        comm = nullptr;
        throw error("nccl_comm: " + broken);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
};

/// An enqueued NCCL operation: complete when its event has fired.
struct nccl_work final : work_state {
  std::shared_ptr<nccl_state> state;
  cudaEvent_t event = nullptr;
  std::string what;
  ~nccl_work() override {
    if (event) (void)cudaEventDestroy(event);
  }
  void wait() override { state->wait_event(event, what); }
  bool test() override {
    const cudaError_t q = cudaEventQuery(event);
    if (q == cudaErrorNotReady) {
      state->check_async_error();
      return false;
    }
    LOOM_CUDA_CHECK(q);
    return true;
  }
};

}  // namespace detail

/// A group of GPUs, one per process. Copies share the NCCL communicator.
class nccl_comm : public collective_api<nccl_comm> {
 public:
  /// Collective over `boot`: every rank makes its nccl_comm with the same boot communicator.
  /// device < 0 picks (rank on this host) % (devices on this host); stream == nullptr makes
  /// a non-blocking stream owned by the communicator.
  explicit nccl_comm(const mpi_comm& boot, int device = -1, cudaStream_t stream = nullptr)
      : s_(std::make_shared<detail::nccl_state>(boot)) {
    const int n_dev = cuda_device_count();
    LOOM_CHECK(n_dev > 0, "nccl_comm: no CUDA device visible to rank ", boot.rank());
    if (device < 0) {
      MPI_Comm local = MPI_COMM_NULL;
      LOOM_MPI_CHECK(MPI_Comm_split_type(boot.native(), MPI_COMM_TYPE_SHARED, boot.rank(), MPI_INFO_NULL, &local));
      int local_rank = 0;
      LOOM_MPI_CHECK(MPI_Comm_rank(local, &local_rank));
      LOOM_MPI_CHECK(MPI_Comm_free(&local));
      device = local_rank % n_dev;
    }
    LOOM_CHECK(device < n_dev, "nccl_comm: device=", device, " but only ", n_dev, " CUDA devices are visible");
    s_->device = device;
    LOOM_CUDA_CHECK(cudaSetDevice(device));
    if (stream) {
      s_->stream = stream;
    } else {
      LOOM_CUDA_CHECK(cudaStreamCreateWithFlags(&s_->stream, cudaStreamNonBlocking));
      s_->own_stream = true;
    }
    ncclUniqueId id{};
    if (boot.rank() == 0) LOOM_NCCL_CHECK(ncclGetUniqueId(&id));
    s_->boot.broadcast(std::span<std::uint8_t>(reinterpret_cast<std::uint8_t*>(&id), sizeof(id)), 0);  // bounded by the timeout
    LOOM_NCCL_CHECK(ncclCommInitRank(&s_->comm, boot.size(), id, boot.rank()));
  }

  int rank() const { return s_->boot.rank(); }
  int size() const { return s_->boot.size(); }
  cudaStream_t stream() const noexcept { return s_->stream; }
  int device() const noexcept { return s_->device; }
  ncclComm_t native() const noexcept { return s_->comm; }
  mpi_comm& bootstrap() noexcept { return s_->boot; }

  /// Waits for everything enqueued on the stream, then for every rank.
  void barrier() {
    s_->check_usable("barrier");
    LOOM_CUDA_CHECK(cudaStreamSynchronize(s_->stream));
    s_->boot.barrier();
  }

  /// Ranks with the same color form a new group ordered by (key, rank), on the same device
  /// and a new stream.
  nccl_comm split(int color, int key) {
    s_->check_usable("split");
    return nccl_comm(s_->boot.split(color, key), s_->device);
  }

 private:
  friend class collective_api<nccl_comm>;

  /// Checked-mode agreement (collectives only: `d` is null for point-to-point), then
  /// `enqueue()`, then a stream sync (blocking) or an event for the returned `work`.
  template <class Enqueue>
  work run(const call_desc* d, const std::string& what, bool async, Enqueue enqueue) {
    s_->check_usable(what);
    if (d) s_->boot.agree(*d);
    LOOM_CUDA_CHECK(cudaSetDevice(s_->device));
    enqueue();
    if (!async) {
      auto w = make_work(what);
      w->wait();
      return {};
    }
    return work(make_work(what));
  }
  std::shared_ptr<detail::nccl_work> make_work(const std::string& what) {
    auto w = std::make_shared<detail::nccl_work>();
    w->state = s_;
    w->what = what;
    LOOM_CUDA_CHECK(cudaEventCreateWithFlags(&w->event, cudaEventDisableTiming));
    LOOM_CUDA_CHECK(cudaEventRecord(w->event, s_->stream));
    return w;
  }

  work start_all_gather(const void* in, void* out, std::size_t n, dtype t, bool async) {
    const auto d = call_desc::make(call_kind::all_gather, n, t);
    return run(&d, describe(d), async, [&] { LOOM_NCCL_CHECK(ncclAllGather(in, out, n, detail::nccl_datatype(t), s_->comm, s_->stream)); });
  }
  work start_reduce_scatter(const void* in, void* out, std::size_t n, dtype t, reduce_op op, bool async) {
    const auto d = call_desc::make(call_kind::reduce_scatter, n, t, op);
    return run(&d, describe(d), async, [&] {
      LOOM_NCCL_CHECK(ncclReduceScatter(in, out, n, detail::nccl_datatype(t), detail::nccl_reduce_op(op), s_->comm, s_->stream));
    });
  }
  work start_all_reduce(const void* in, void* out, std::size_t n, dtype t, reduce_op op, bool async) {
    const auto d = call_desc::make(call_kind::all_reduce, n, t, op);
    return run(&d, describe(d), async, [&] {
      LOOM_NCCL_CHECK(ncclAllReduce(in, out, n, detail::nccl_datatype(t), detail::nccl_reduce_op(op), s_->comm, s_->stream));
    });
  }
  work start_broadcast(void* buf, std::size_t n, dtype t, int root, bool async) {
    const auto d = call_desc::make(call_kind::broadcast, n, t, reduce_op::sum, root);
    return run(&d, describe(d), async, [&] { LOOM_NCCL_CHECK(ncclBroadcast(buf, buf, n, detail::nccl_datatype(t), root, s_->comm, s_->stream)); });
  }
  work start_send(const void* in, std::size_t n, dtype t, int peer, int tag, bool async) {
    return run(nullptr, describe(wait_site::p2p(wait_site::kind::send, n, t, peer, tag)), async, [&] { LOOM_NCCL_CHECK(ncclSend(in, n, detail::nccl_datatype(t), peer, s_->comm, s_->stream)); });
  }
  work start_recv(void* out, std::size_t n, dtype t, int peer, int tag, bool async) {
    return run(nullptr, describe(wait_site::p2p(wait_site::kind::recv, n, t, peer, tag)), async, [&] { LOOM_NCCL_CHECK(ncclRecv(out, n, detail::nccl_datatype(t), peer, s_->comm, s_->stream)); });
  }

  std::shared_ptr<detail::nccl_state> s_;
};

static_assert(communicator<nccl_comm>);

}  // namespace loom::comm
