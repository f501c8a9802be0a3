// CUDA IPC between the session's processes (torch.multiprocessing with device tensors).
#include "device_memory.h"
#include "unobserved_ops.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <string>

namespace mirage {

// A device tensor sent to another process of the session (torch.multiprocessing) shares its
// memory, as CUDA IPC does. On first share, the storage's bytes move into a named shared-memory
// segment (/mirage-<uid>-<session>.ipc-<pid>-<n>) that replaces its memory in place, so every
// tensor on that storage keeps working; the receiver maps the segment. The sender's process
// owns (and is charged for) the memory; the segment's name goes when the sender frees it, and a
// receiver's mapping stays valid until it lets go, as CUDA IPC memory outlives neither.

struct SharedSegment {
  std::string name;
  void* base;
  size_t nbytes;
  DeviceIndex device;
  CachedBlock* block;  // the sending process's: it unlinks the name and holds the memory
};

static void release_segment(void* ctx) {
  auto* seg = static_cast<SharedSegment*>(ctx);
  munmap(seg->base, seg->nbytes);
  if (seg->block) {
    shm_unlink(seg->name.c_str());
    free_device_block(seg->device, seg->block);
  }
  delete seg;
}

static std::string ipc_prefix() {
  const char* session = std::getenv("MIRAGE_SESSION");
  return "/mirage-" + std::to_string(getuid()) + "-" + (session && *session ? session : "nosession") + ".ipc-" +
         std::to_string(getpid()) + "-";
}

static void* map_segment(const std::string& name, size_t nbytes, bool create) {
  const int fd = shm_open(name.c_str(), O_RDWR | (create ? O_CREAT | O_EXCL : 0), 0600);
  if (fd < 0) return nullptr;
  const bool sized = !create || posix_fallocate(fd, 0, static_cast<off_t>(nbytes)) == 0;
  void* base = sized ? mmap(nullptr, nbytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  close(fd);
  if (base == MAP_FAILED && create) shm_unlink(name.c_str());
  return base == MAP_FAILED ? nullptr : base;
}

// The segment name of `t`'s storage, moving the storage into a segment on first share.
static std::string share_storage(const at::Tensor& t) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  const c10::DataPtr& current = storage->data_ptr();
  if (current.get_deleter() == &release_segment) {
    return static_cast<SharedSegment*>(current.get_context())->name;
  }
  static std::atomic<int64_t> next{0};
  const size_t nbytes = storage->nbytes();
  const DeviceIndex dev = t.device().index();
  const std::string name = ipc_prefix() + std::to_string(next++);
  void* base = map_segment(name, nbytes, true);
  TORCH_CHECK_WITH(OutOfMemoryError, base, "mirage: could not place ", format_size(static_cast<int64_t>(nbytes)),
      " of shared GPU memory in /dev/shm for CUDA IPC (is it full? `df -h /dev/shm`)");
  std::memcpy(base, storage->data(), nbytes);
  CachedBlock* block = allocate_block(dev, nbytes);  // the old block is freed as it is released below
  auto* seg = new SharedSegment{name, base, nbytes, dev, block};
  storage->set_data_ptr_noswap(c10::DataPtr(base, seg, &release_segment, c10::Device(DeviceType::CUDA, dev)));
  return name;
}

// A device tensor (uint8, nbytes) over a segment another process of the session shared.
static at::Tensor open_shared(const std::string& name, int64_t nbytes, DeviceIndex dev) {
  check_index(dev);
  void* base = map_segment(name, static_cast<size_t>(nbytes), false);
  TORCH_CHECK(base, "mirage: the CUDA tensor's memory is gone: the sending process freed it (or exited) before "
      "this one received it. Keep a CUDA tensor alive in the sender until the receiver has it, as CUDA IPC requires.");
  auto* seg = new SharedSegment{name, base, static_cast<size_t>(nbytes), dev, nullptr};
  c10::Storage storage(c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), nbytes,
      c10::DataPtr(base, seg, &release_segment, c10::Device(DeviceType::CUDA, dev)), device_allocator(dev), false));
  auto impl = c10::make_intrusive<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CUDA),
      caffe2::TypeMeta::Make<uint8_t>());
  impl->set_sizes_contiguous({nbytes});
  return at::Tensor(std::move(impl));
}

}  // namespace mirage

MIRAGE_LIBRARY(m) {
  m.def("share_storage_memory(Tensor t) -> str", [](const at::Tensor& t) { return mirage::share_storage(t); });
  m.def("open_shared_storage(str name, int nbytes, int device) -> Tensor",
        [](const std::string& name, int64_t nbytes, int64_t device) {
          return mirage::open_shared(name, nbytes, static_cast<c10::DeviceIndex>(device));
        });
}
