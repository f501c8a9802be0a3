// Memory history (memory_history.h) and the operators torch.cuda.memory's snapshot calls read.
#include "memory_history.h"
#include "unobserved_ops.h"

#include <torch/library.h>

#include <chrono>
#include <tuple>

namespace mirage {

MemoryHistory g_history;

std::shared_ptr<torch::CapturedTraceback> gather_stack() {
  if (!g_history.stacks.load(std::memory_order_relaxed)) return nullptr;
  return torch::CapturedTraceback::gather(/*python=*/true, /*script=*/false, /*cpp=*/false);
}

Observer history_observer(DeviceIndex dev, std::shared_ptr<torch::CapturedTraceback> frames) {
  return [dev, frames = std::move(frames)](TraceAction action, uint64_t address, size_t size, int64_t stream) {
    const int64_t now = std::chrono::duration_cast<std::chrono::microseconds>(
        std::chrono::system_clock::now().time_since_epoch()).count();
    std::lock_guard<std::mutex> g(g_history.mu);
    auto& trace = g_history.traces[dev];
    trace.push_back({action, address, size, stream, now, frames});
    while (trace.size() > g_history.max_entries) trace.pop_front();
    if (action == TraceAction::alloc) g_history.block_frames[dev][address] = frames;
    if (action == TraceAction::free_completed) g_history.block_frames[dev].erase(address);
  };
}

}  // namespace mirage

MIRAGE_LIBRARY(m) {
  m.def("record_memory_history(bool enabled, bool stacks, int max_entries, bool clear) -> ()",
        [](bool enabled, bool stacks, int64_t max_entries, bool clear) {
          std::lock_guard<std::mutex> g(mirage::g_history.mu);
          mirage::g_history.stacks = stacks;
          mirage::g_history.max_entries = static_cast<size_t>(std::max<int64_t>(max_entries, 0));  // 0: no trace
          mirage::g_history.enabled = enabled;
          if (clear || !enabled) {
            for (auto& trace : mirage::g_history.traces) trace.clear();
          }
          if (!enabled) {
            for (auto& frames : mirage::g_history.block_frames) frames.clear();
          }
        });
  // A device's recorded history: entries [action, address, size, stream, time_us, stack], live
  // blocks [address, stack], the stacks as lists of frame indices, and the frames (file, function,
  // line). A stack of -1: none was gathered.
  m.def("memory_history(int device) -> (int[][], int[][], int[][], str[], str[], int[])", [](int64_t device) {
    mirage::check_index(static_cast<c10::DeviceIndex>(device));
    std::vector<std::vector<int64_t>> entries, blocks;
    std::vector<torch::CapturedTraceback*> stacks;
    std::unordered_map<const torch::CapturedTraceback*, int64_t> index;
    auto stack_of = [&](const std::shared_ptr<torch::CapturedTraceback>& tb) -> int64_t {
      if (!tb) return -1;
      auto [it, fresh] = index.emplace(tb.get(), static_cast<int64_t>(stacks.size()));
      if (fresh) stacks.push_back(tb.get());
      return it->second;
    };
    std::lock_guard<std::mutex> g(mirage::g_history.mu);
    for (const auto& e : mirage::g_history.traces[device]) {
      entries.push_back({static_cast<int64_t>(e.action), static_cast<int64_t>(e.address), static_cast<int64_t>(e.size),
                         e.stream, e.time_us, stack_of(e.frames)});
    }
    for (const auto& [address, tb] : mirage::g_history.block_frames[device]) {
      blocks.push_back({static_cast<int64_t>(address), stack_of(tb)});
    }
    const torch::SymbolizedTracebacks symbolized = torch::symbolize(stacks);
    std::vector<std::vector<int64_t>> frame_lists;
    for (const auto& tb : symbolized.tracebacks) frame_lists.emplace_back(tb.begin(), tb.end());
    std::vector<std::string> files, names;
    std::vector<int64_t> lines;
    for (const auto& frame : symbolized.all_frames) {
      files.push_back(frame.filename);
      names.push_back(frame.funcname);
      lines.push_back(static_cast<int64_t>(frame.lineno));
    }
    return std::make_tuple(entries, blocks, frame_lists, files, names, lines);
  });
  m.def("memory_history_enabled() -> bool", []() { return mirage::g_history.enabled.load(); });
}
