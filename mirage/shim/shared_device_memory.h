// Device memory other processes can map: what makes emulated GPUs peers.
//
// On a real box one GPU reads and writes another's memory directly (NVLink / xGMI P2P, CUDA IPC),
// and NCCL's P2P transport moves a message with one copy because of it. Host memory from malloc
// is private to its process, so the emulated NCCL would have to stage every byte through a
// shared buffer (a copy in, a copy out). Instead, large device blocks (from kShareableMinBytes)
// live in one memfd per process, the "arena", which a peer of the same user maps through
// /proc/<pid>/fd/<fd> (no names in /dev/shm, nothing left behind by a crash: the memory goes
// with the last process that maps it). Smaller blocks stay ordinary heap memory, where they are
// cheaper to allocate and no collective would gain from a direct copy.
//
// With --lazy-device-memory (MIRAGE_LAZY_DEVICE_MEMORY) the arena is private anonymous memory
// instead, which peers cannot map (mirage_shared_arena() says none): the host then holds only the
// pages of live blocks that were written, whatever the emulated GPUs hold.
//
// The C interface below is what the emulated NCCL backend (a separate module, mirage/nccl) reads
// through dlsym: the shim is loaded with RTLD_GLOBAL.
#pragma once

#include <cstddef>
#include <cstdint>

// Where the calling process's arena is; all zero while it has none. A pointer p lies in the
// arena when base <= p < base + capacity, at offset p - base in the memfd.
struct MirageSharedArena {
  int64_t pid;        // the owning process
  int32_t fd;         // its memfd, as /proc/<pid>/fd/<fd>
  int32_t padding;
  uint64_t id;        // random; also the arena's first 8 bytes, so a peer can tell a reused pid or fd
  uint64_t base;      // where the owner maps it
  uint64_t capacity;  // bytes (sparse: only pages in use are memory)
};

extern "C" MirageSharedArena mirage_shared_arena();

namespace mirage {

// From this many bytes a device block comes from the arena (the caching allocator's large-pool
// boundary, 1 MiB; the emulated NCCL copies straight from peers from the same size).
constexpr size_t kShareableMinBytes = size_t{1} << 20;

// Host memory for `bytes` of device memory: from the arena when large enough and the arena has
// room, else from the heap (c10::alloc_cpu). Raises c10::Error when the host cannot back it.
void* allocate_device_bytes(size_t bytes);
void free_device_bytes(void* p);

}  // namespace mirage
