// Attaching to the session's shared table (session_table.h) and claiming this process's slot.
#include "session_table.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace mirage {

SharedTable g_shared;

// Claims a free slot (pid 0 -> ours). Also run in a forked child, which must not share its
// parent's slot.
static void claim_slot() {
  if (!g_shared.words) return;
  int64_t pid = static_cast<int64_t>(getpid());
  g_shared.slot = nullptr;
  for (int64_t i = 0; i < g_shared.max_slots; ++i) {
    int64_t* candidate = g_shared.slot_at(i);
    int64_t expected = 0;
    if (SharedTable::at(candidate).compare_exchange_strong(expected, pid)) {
      for (int64_t d = 0; d < g_shared.gpus_per_node; ++d) SharedTable::at(candidate + SharedTable::kSlotHead + d).store(0);
      candidate[1] = g_shared.node;
      const char* rank = std::getenv("RANK");
      candidate[2] = rank ? std::atoll(rank) : -1;
      auto high_water = SharedTable::at(g_shared.words + SharedTable::kHighWater);
      int64_t seen = high_water.load();
      while (i + 1 > seen && !high_water.compare_exchange_weak(seen, i + 1)) {
      }
      g_shared.slot = candidate;
      return;
    }
  }
}

static void attach_shared_table() {
  const char* path = std::getenv("MIRAGE_SHM");
  if (!path || !*path) return;
  int fd = open(path, O_RDWR);
  if (fd < 0) return;  // the run process is gone: keep private counters
  struct stat st {};
  fstat(fd, &st);
  void* base = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) return;
  auto* words = static_cast<int64_t*>(base);
  if (words[0] != SharedTable::kMagic) return;
  g_shared.words = words;
  g_shared.gpus_per_node = words[3];
  g_shared.max_slots = words[4];
  const char* node = std::getenv("MIRAGE_NODE_RANK");
  g_shared.node = node ? std::atoll(node) : 0;
  claim_slot();
  pthread_atfork(nullptr, nullptr, &claim_slot);
}

static const int g_attached = (attach_shared_table(), 0);

}  // namespace mirage

// The fork server (mirage/forkserver) loads the shim without MIRAGE_SHM, before it knows which
// process each child will be; a child attaches here once it has taken over its process's
// environment (its node and rank).
extern "C" void mirage_attach_session_table() {
  if (!mirage::g_shared.words) mirage::attach_shared_table();
}
