// The dispatch to transports (process_group.h): each collective's arguments checked and turned
// into the transport's calls (transport.h's Communicator), all through collective(), the one
// path every collective takes: sequence number, record, profiler event, watchdog, clock, Work.

#include "clock.h"
#include "races.h"
#include "process_group.h"

#include <algorithm>

namespace mirage::nccl {

using c10d::OpType;

// Runs one collective: checks, sequence number, recorder, profiler event, the transfer, the Work.
template <typename Fn>
c10::intrusive_ptr<c10d::Work> ProcessGroupNCCL::collective(OpType type, const char* profiling, const char* name,
                                                            const std::vector<at::Tensor>& ins, const std::vector<at::Tensor>& outs,
                                                            std::chrono::milliseconds asked_timeout, std::string reduce_op, Fn&& run) {
  std::lock_guard<std::mutex> serial(collective_mu_);  // the communicator's stream: one at a time
  const auto timeout = timeout_for(asked_timeout);
  Record r = make_record(type, profiling, name, ins, outs, timeout, std::move(reduce_op), false);
  auto work = c10::make_intrusive<EmulatedWork>(rank_, type, profiling, ins, outs, r.seq, describe_work(r),
                                                profiler_group(), size_);
  record_param_comms(r, ins, outs);
  if (measure_durations_) work->time_it();
  const auto& tensors = ins.empty() ? outs : ins;
  check_distinct_gpus(tensors);
  if (!tensors.empty()) barrier_device_ = tensors[0].device().index();
  if (shim_races().on && !tensors.empty() && tensors[0].is_cuda()) {  // --check-races (races.h)
    work->set_race_order(barrier_device_, comm_stream(),
                         shim_races().issue(barrier_device_, comm_stream(),
                                            "the NCCL stream of process group '" + group_name() + "'", ins, outs,
                                            profiling));
  }
  timing_ = Timing{Clock::now() + timeout, timeout, describe_work(r), r.seq};
  r.started_ns = wall_ns();
  r.state = "started";
  keep_trace(r);
  record(r, true);
  std::exception_ptr error;
  const auto finished = [&] {
    r.completed_ns = wall_ns();
    r.state = "completed";
    finish_trace(r);
    record(r, false);
  };
  const bool clocked = clock_collective_start();
  const bool profiled = barrier_device_ >= 0 && shim_clock().profiling_host_times();  // torch.profiler, host times
  const int64_t began = profiled ? shim_clock().profiler_wall_ns() : 0;
  try {
    inject_fault(r);
    comm_->check_usable(timing_.what);
    run();
  } catch (const c10::DistBackendError& e) {
    error = on_failure(r, e, timed_out(e));
  } catch (...) {  // an argument refused on the way: the operation ends here, with the error
    finished();
    throw;
  }
  finished();
  const int dtype = tensors.empty() ? -1 : static_cast<int>(tensors[0].scalar_type());
  if (clocked && !error) clock_collective_end(*work, r, profiling, dtype);
  if (profiled && !error) {
    shim_clock().profiler_collective(barrier_device_, comm_stream(), began, shim_clock().profiler_wall_ns(), profiling,
                                     r.bytes, dtype);
  }
  work->complete(error);
  std::lock_guard<std::mutex> g(mu_);
  if (coalescing_) coalesced_.push_back(work);
  return work;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNCCL::broadcast(std::vector<at::Tensor>& tensors,
                                                           const c10d::BroadcastOptions& opts) {
  const at::Tensor& t = single(tensors);
  const int root = static_cast<int>(opts.rootRank);
  check_root(root);
  return collective(OpType::BROADCAST, "nccl:broadcast", "broadcast", tensors, tensors, opts.timeout, "", [&] {
    at::Tensor r = as_real(t);
    collectives().broadcast(data(r), r.numel(), r.scalar_type(), root, timing_);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNCCL::allreduce(std::vector<at::Tensor>& tensors,
                                                           const c10d::AllreduceOptions& opts) {
  const at::Tensor& t = single(tensors);
  TORCH_CHECK(!opts.sparseIndices.has_value(), "the emulated ", library(), " has no sparse all_reduce");
  const Reduction reduction = reduction_of(opts.reduceOp, t);
  return collective(OpType::ALLREDUCE, "nccl:all_reduce", "all_reduce", tensors, tensors, opts.timeout,
                    op_name(opts.reduceOp), [&] {
    at::Tensor r = as_real(t);
    collectives().all_reduce(data(r), r.numel(), r.scalar_type(), reduction, timing_);
  });
}

// A sparse tensor's all_reduce (c10d's SparseCUDA kernel calls this): NCCL has none outside
// Meta's NCCLX, and ProcessGroupNCCL refuses it with these words, which PyTorch's own tests match.
c10::intrusive_ptr<c10d::Work> ProcessGroupNCCL::allreduce_sparse(std::vector<at::Tensor>&, const c10d::AllreduceOptions&) {
  C10_THROW_ERROR(Error, "NCCL does not support all_reduce with sparse tensors. Please use dense tensors instead.");
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNCCL::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                     const c10d::AllreduceCoalescedOptions& opts) {
  for (const auto& t : tensors) check_tensor(t);
  return collective(OpType::COALESCED, "nccl:allreduce_coalesced", "all_reduce_coalesced", tensors, tensors,
                    opts.timeout, op_name(opts.reduceOp), [&] {
    for (const auto& t : tensors) {
      at::Tensor r = as_real(t);
      collectives().all_reduce(data(r), r.numel(), r.scalar_type(), reduction_of(opts.reduceOp, t), timing_);
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNCCL::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  const at::Tensor& t = single(tensors);
  const int root = static_cast<int>(opts.rootRank);
  check_root(root);
  const Reduction reduction = reduction_of(opts.reduceOp, t);
  return collective(OpType::REDUCE, "nccl:reduce", "reduce", tensors, tensors, opts.timeout, op_name(opts.reduceOp),
                    [&] {
    at::Tensor r = as_real(t);
    collectives().reduce(data(r), r.numel(), r.scalar_type(), reduction, root, timing_);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNCCL::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                           std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  const at::Tensor& in = single(inputs);
  TORCH_CHECK_VALUE(outputs.size() == 1, "Expecting one output list, got ", outputs.size());
  auto& outs = outputs[0];
  check_list(outs, in, "output");
  bool even = std::all_of(outs.begin(), outs.end(), [&](const at::Tensor& o) { return o.numel() == in.numel(); });
  return collective(OpType::ALLGATHER, "nccl:all_gather", "all_gather", inputs, outs, opts.timeout, "", [&] {
    at::Tensor r = as_real(in);
    if (even) {
      std::vector<char*> to;
      for (const auto& o : outs) to.push_back(data(as_real(o)));
      collectives().all_gather(to, data(r), r.numel(), r.scalar_type(), timing_);
      return;
    }
    // Uneven sizes: a broadcast from each rank in turn, as ProcessGroupNCCL does them.
    as_real(outs[rank_]).copy_(r);
    for (int root = 0; root < size_; ++root) {
      at::Tensor o = as_real(outs[root]);
      collectives().broadcast(data(o), o.numel(), o.scalar_type(), root, timing_);
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNCCL::_allgather_base(at::Tensor& out, at::Tensor& in,
                                                                 const c10d::AllgatherOptions& opts) {
  check_tensor(out);
  check_tensor(in);
  TORCH_CHECK_VALUE(in.dtype() == out.dtype(), "output tensor must have the same type as input tensor");
  TORCH_CHECK_VALUE(in.numel() * size_ == out.numel(),
                    "output tensor size must be equal to world_size times input tensor size");
  std::vector<at::Tensor> ins{in}, outs{out};
  return collective(OpType::_ALLGATHER_BASE, "nccl:_all_gather_base", "all_gather_into_tensor", ins, outs,
                    opts.timeout, "", [&] { gather_flat(out, in); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNCCL::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                                     std::vector<at::Tensor>& inputs,
                                                                     const c10d::AllgatherOptions& opts) {
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "allgather_coalesced: one output list per input");
  std::vector<at::Tensor> flat_outputs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_tensor(inputs[i]);
    check_list(outputs[i], inputs[i], "output");
    for (const auto& o : outputs[i]) flat_outputs.push_back(o);
  }
  return collective(OpType::ALLGATHER_COALESCED, "nccl:all_gather_coalesced", "all_gather_coalesced", inputs,
                    flat_outputs, opts.timeout, "", [&] {
    for (size_t i = 0; i < inputs.size(); ++i) {
      std::vector<char*> to;
      for (const auto& o : outputs[i]) to.push_back(data(as_real(o)));
      at::Tensor r = as_real(inputs[i]);
      collectives().all_gather(to, data(r), r.numel(), r.scalar_type(), timing_);
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNCCL::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                                 std::vector<at::Tensor>& inputs,
                                                                                 const c10d::AllgatherOptions& opts) {
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "one output tensor per input tensor");
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_tensor(inputs[i]);
    check_tensor(outputs[i]);
    TORCH_CHECK_VALUE(inputs[i].numel() * size_ == outputs[i].numel(),
                      "output tensor size must be equal to world_size times input tensor size");
  }
  return collective(OpType::COALESCED, "nccl:allgather_into_tensor_coalesced", "all_gather_into_tensor_coalesced",
                    inputs, outputs, opts.timeout, "", [&] {
    for (size_t i = 0; i < inputs.size(); ++i) gather_flat(outputs[i], inputs[i]);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNCCL::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                                const c10d::ReduceScatterOptions& opts) {
  const at::Tensor& out = single(outputs);
  TORCH_CHECK_VALUE(inputs.size() == 1, "Expecting one input list, got ", inputs.size());
  auto& ins = inputs[0];
  check_list(ins, out, "input");
  const Reduction reduction = reduction_of(opts.reduceOp, out);
  bool even = std::all_of(ins.begin(), ins.end(), [&](const at::Tensor& i) { return i.numel() == out.numel(); });
  return collective(OpType::REDUCE_SCATTER, "nccl:reduce_scatter", "reduce_scatter", ins, outputs, opts.timeout,
                    op_name(opts.reduceOp), [&] {
    if (even) {
      at::Tensor flat = at::empty({size_ * as_real(out).numel()}, as_real(out).options().device(at::kCPU));
      for (int r = 0; r < size_; ++r) {
        flat.narrow(0, r * as_real(out).numel(), as_real(out).numel()).copy_(as_real(ins[r]).reshape(-1));
      }
      at::Tensor o = as_real(out);
      collectives().reduce_scatter(data(o), static_cast<char*>(flat.data_ptr()), o.numel(), o.scalar_type(), reduction,
                            timing_);
      return;
    }
    // Uneven sizes: a reduce to each rank in turn, on copies (reduce writes its buffer).
    for (int root = 0; root < size_; ++root) {
      at::Tensor buffer = as_real(ins[root]).to(at::kCPU, /*non_blocking=*/false, /*copy=*/true);
      collectives().reduce(static_cast<char*>(buffer.data_ptr()), buffer.numel(), buffer.scalar_type(), reduction, root,
                    timing_);
      if (root == rank_) as_real(out).copy_(buffer.view(as_real(out).sizes()));
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNCCL::_reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                                      const c10d::ReduceScatterOptions& opts) {
  check_tensor(out);
  check_tensor(in);
  TORCH_CHECK_VALUE(in.dtype() == out.dtype(), "input tensor must be the same type as the output tensor.");
  TORCH_CHECK_VALUE(in.numel() == out.numel() * size_,
                    "input tensor must be the same size as output size times world size");
  const Reduction reduction = reduction_of(opts.reduceOp, out);
  std::vector<at::Tensor> ins{in}, outs{out};
  return collective(OpType::_REDUCE_SCATTER_BASE, "nccl:_reduce_scatter_base", "reduce_scatter_tensor", ins, outs,
                    opts.timeout, op_name(opts.reduceOp), [&] { scatter_flat(out, in, reduction); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNCCL::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                                 std::vector<at::Tensor>& inputs,
                                                                                 const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "one output tensor per input tensor");
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_tensor(inputs[i]);
    check_tensor(outputs[i]);
    TORCH_CHECK_VALUE(inputs[i].numel() == outputs[i].numel() * size_,
                      "input tensor must be the same size as output size times world size");
  }
  return collective(OpType::COALESCED, "nccl:reduce_scatter_tensor_coalesced", "reduce_scatter_tensor_coalesced",
                    inputs, outputs, opts.timeout, op_name(opts.reduceOp), [&] {
    for (size_t i = 0; i < inputs.size(); ++i) scatter_flat(outputs[i], inputs[i], reduction_of(opts.reduceOp, outputs[i]));
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNCCL::alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                                                               std::vector<int64_t>& in_splits,
                                                               const c10d::AllToAllOptions& opts) {
  check_tensor(out);
  check_tensor(in);
  TORCH_CHECK_VALUE(in.dtype() == out.dtype(), "alltoall: input and output must have the same dtype");
  const auto pieces = [&](const at::Tensor& t, const std::vector<int64_t>& splits) {
    std::vector<std::pair<char*, size_t>> parts;
    const int64_t rows = t.dim() ? t.size(0) : 1;
    const size_t row_bytes = rows ? static_cast<size_t>(nbytes(t) / rows) : 0;
    if (splits.empty()) {
      TORCH_CHECK_VALUE(rows % size_ == 0, "Tensor's dim 0 does not divide equally across group size");
    } else {
      TORCH_CHECK_VALUE(static_cast<int>(splits.size()) == size_, "Number of tensor splits not equal to group size");
      int64_t sum = 0;
      for (int64_t s : splits) sum += s;
      TORCH_CHECK_VALUE(sum == rows, "Split sizes doesn't match total dim 0 size");
    }
    char* p = data(t);
    for (int r = 0; r < size_; ++r) {
      const size_t n = row_bytes * static_cast<size_t>(splits.empty() ? rows / size_ : splits[r]);
      parts.emplace_back(p, n);
      p += n;
    }
    return parts;
  };
  auto send = pieces(in, in_splits), recv = pieces(out, out_splits);
  std::vector<at::Tensor> ins{in}, outs{out};
  return collective(OpType::ALLTOALL_BASE, "nccl:all_to_all", "all_to_all_single", ins, outs, opts.timeout, "",
                    [&] { exchange_pieces(Kind::kAllToAll, -1, in.scalar_type(), send, recv); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNCCL::alltoall(std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins,
                                                          const c10d::AllToAllOptions& opts) {
  TORCH_CHECK_VALUE(static_cast<int>(outs.size()) == size_ && static_cast<int>(ins.size()) == size_,
                    "alltoall: one input and one output tensor per rank");
  std::vector<std::pair<char*, size_t>> send, recv;
  for (int r = 0; r < size_; ++r) {
    check_tensor(ins[r]);
    check_tensor(outs[r]);
    TORCH_CHECK_VALUE(ins[r].dtype() == outs[r].dtype(), "alltoall: input and output must have the same dtype");
    send.emplace_back(data(ins[r]), static_cast<size_t>(nbytes(ins[r])));
    recv.emplace_back(data(outs[r]), static_cast<size_t>(nbytes(outs[r])));
  }
  return collective(OpType::ALLTOALL, "nccl:all_to_all", "all_to_all", ins, outs, opts.timeout, "",
                    [&] { exchange_pieces(Kind::kAllToAll, -1, ins[0].scalar_type(), send, recv); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNCCL::gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                                        const c10d::GatherOptions& opts) {
  const at::Tensor& in = single(inputs);
  const int root = static_cast<int>(opts.rootRank);
  check_root(root);
  std::vector<std::pair<char*, size_t>> send(size_, {nullptr, 0}), recv(size_, {nullptr, 0});
  std::vector<at::Tensor> outs;
  if (rank_ == root) {
    TORCH_CHECK_VALUE(outputs.size() == 1, "gather: requires a single-element output list");
    check_list(outputs[0], in, "output");
    for (int r = 0; r < size_; ++r) recv[r] = {data(outputs[0][r]), static_cast<size_t>(nbytes(outputs[0][r]))};
    outs = outputs[0];
  } else {
    TORCH_CHECK_VALUE(outputs.empty() || outputs[0].empty(), "gather: requires empty output on non-root");
  }
  send[root] = {data(in), static_cast<size_t>(nbytes(in))};
  return collective(OpType::GATHER, "nccl:gather", "gather", inputs, outs, opts.timeout, "",
                    [&] { exchange_pieces(Kind::kGather, root, in.scalar_type(), send, recv); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNCCL::scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                                         const c10d::ScatterOptions& opts) {
  const at::Tensor& out = single(outputs);
  const int root = static_cast<int>(opts.rootRank);
  check_root(root);
  std::vector<std::pair<char*, size_t>> send(size_, {nullptr, 0}), recv(size_, {nullptr, 0});
  std::vector<at::Tensor> ins;
  if (rank_ == root) {
    TORCH_CHECK_VALUE(inputs.size() == 1, "scatter: requires a single-element input list");
    check_list(inputs[0], out, "input");
    for (int r = 0; r < size_; ++r) send[r] = {data(inputs[0][r]), static_cast<size_t>(nbytes(inputs[0][r]))};
    ins = inputs[0];
  } else {
    TORCH_CHECK_VALUE(inputs.empty() || inputs[0].empty(), "scatter: requires empty input on non-root");
  }
  recv[root] = {data(out), static_cast<size_t>(nbytes(out))};
  return collective(OpType::SCATTER, "nccl:scatter", "scatter", ins, outputs, opts.timeout, "",
                    [&] { exchange_pieces(Kind::kScatter, root, out.scalar_type(), send, recv); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupNCCL::barrier(const c10d::BarrierOptions& opts) {
  // ProcessGroupNCCL's barrier runs on the group's device: the one given, else the one this
  // process used last, else (guessDeviceId) the global rank modulo the GPUs it sees.
  if (opts.device) {
    barrier_device_ = opts.device->index();
  } else if (!opts.device_ids.empty()) {
    barrier_device_ = static_cast<int>(opts.device_ids[0]);
  } else if (barrier_device_ < 0) {
    barrier_device_ = my_global_rank() % std::max<int>(1, static_cast<int>(c10::impl::getDeviceGuardImpl(
                                                              c10::DeviceType::CUDA)->deviceCount()));
  }
  std::vector<at::Tensor> none;
  return collective(OpType::BARRIER, "nccl:all_reduce_barrier", "barrier", none, none, opts.timeout, "", [&] {
    comm_->agree(Call{Kind::kBarrier, 0, 0, 0, 0}, timing_);
  });
}

void ProcessGroupNCCL::gather_flat(const at::Tensor& out, const at::Tensor& in) {
  at::Tensor r = as_real(in), o = as_real(out);
  std::vector<char*> to;
  for (int k = 0; k < size_; ++k) to.push_back(data(o) + k * nbytes(r));
  collectives().all_gather(to, data(r), r.numel(), r.scalar_type(), timing_);
}

void ProcessGroupNCCL::scatter_flat(const at::Tensor& out, const at::Tensor& in, const Reduction& reduction) {
  at::Tensor r = as_real(in), o = as_real(out);
  collectives().reduce_scatter(data(o), data(r), o.numel(), o.scalar_type(), reduction, timing_);
}

// gather, scatter, all_to_all: send[r] goes to rank r, recv[r] comes from it.
void ProcessGroupNCCL::exchange_pieces(Kind kind, int root, at::ScalarType dtype, const std::vector<std::pair<char*, size_t>>& send,
                                       const std::vector<std::pair<char*, size_t>>& recv) {
  collectives().exchange_pieces(Call{kind, static_cast<int32_t>(dtype), root, 0, -1}, send, recv, timing_);
}

}  // namespace mirage::nccl
