// The socket transport of the emulated NCCL backend: TCP between every pair of ranks, as NCCL's
// net transport (NCCL_NET=Socket) carries traffic that shared memory and P2P cannot.
//
// Set-up: every rank listens on an ephemeral port of its interface's address (socket_interface)
// and publishes both in the group's store. A connection joins a pair of ranks per channel
// (channel 0 for point-to-point operations, channel 1 for collectives, so a pending send cannot
// block a collective's bytes): the higher rank connects to the lower and says who it is; a
// rank's own channel is a socketpair. connect_sockets makes them all at once (collective: every
// rank must join), or, for a group most of whose pairs may never talk (the cross-node mesh of
// node_hierarchy.cpp), on a pair's first transfer, as NCCL connects point-to-point peers at
// their first operation: 64 ranks would otherwise make 4,032 connections and 2,000 store reads
// before their first collective. All data moves through transfer(),
// one non-blocking engine over poll(): every pending send and receive progresses together.
// Collectives are built from transfers, each opened by an exchange of the ranks' calls (the
// desync check). Reductions receive every peer's chunk and reduce in rank order, so every rank
// gets the same bits, as over shared memory.

#include "transport.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>

namespace mirage::nccl {
namespace {

constexpr size_t kChunkBytes = size_t{4} << 20;  // reductions: per peer and round
constexpr int kChannels = 2;

[[noreturn]] void fail_setup(const std::string& what) {
  TORCH_CHECK_WITH(DistBackendError, false, "emulated NCCL (socket transport): ", what, ": ", std::strerror(errno));
}

void write_all(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n) {
    ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) fail_setup("sending the connection's greeting");
    p += k;
    n -= static_cast<size_t>(k);
  }
}

void read_all(int fd, void* data, size_t n) {
  char* p = static_cast<char*>(data);
  while (n) {
    ssize_t k = ::recv(fd, p, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) fail_setup("reading a connection's greeting");
    p += k;
    n -= static_cast<size_t>(k);
  }
}

void tune(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
}

// NCCL_SOCKET_IFNAME's rule for interface names: a comma-separated list of prefixes, exact
// names when it starts with '=', and the names to avoid when it starts with '^'.
bool interface_wanted(const std::string& name, std::string spec) {
  const bool exclude = !spec.empty() && spec[0] == '^';
  if (exclude) spec.erase(0, 1);
  const bool exact = !spec.empty() && spec[0] == '=';
  if (exact) spec.erase(0, 1);
  std::stringstream items(spec);
  for (std::string item; std::getline(items, item, ',');) {
    if (!item.empty() && (exact ? name == item : name.compare(0, item.size(), item) == 0)) return !exclude;
  }
  return exclude;
}

// The interface (name, IPv4 address) peers reach this process on: NCCL_SOCKET_IFNAME's, else on
// isolated nodes NCCL's default (any interface but loopback and docker*), else loopback, where
// every emulated node shares this host.
std::pair<std::string, in_addr> chosen_interface() {
  const char* asked = std::getenv("NCCL_SOCKET_IFNAME");
  const bool isolated = std::getenv("MIRAGE_ISOLATED_NODES") != nullptr;
  if (!asked && !isolated) return {"lo", in_addr{htonl(INADDR_LOOPBACK)}};
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) fail_setup("listing the network interfaces");
  std::pair<std::string, in_addr> found{"", {}};
  std::string seen;
  for (ifaddrs* it = list; it; it = it->ifa_next) {
    if (!it->ifa_addr || it->ifa_addr->sa_family != AF_INET || !(it->ifa_flags & IFF_UP)) continue;
    seen += (seen.empty() ? "" : ", ") + std::string(it->ifa_name);
    const bool wanted = asked ? interface_wanted(it->ifa_name, asked) : interface_wanted(it->ifa_name, "^lo,docker");
    if (wanted && found.first.empty()) found = {it->ifa_name, reinterpret_cast<sockaddr_in*>(it->ifa_addr)->sin_addr};
  }
  freeifaddrs(list);
  TORCH_CHECK_WITH(DistBackendError, !found.first.empty(), "NCCL error: internal error (run with NCCL_DEBUG=INFO for "
                   "details)\nncclInternalError: Internal check failed.\nLast error:\nBootstrap : no socket interface "
                   "found", asked ? std::string(" matching NCCL_SOCKET_IFNAME=") + asked : std::string(),
                   " (mirage: this node's interfaces are ", seen, "; emulated nodes have eth0)");
  return found;
}

}  // namespace

std::string socket_interface() {
  const auto [name, address] = chosen_interface();
  char text[INET_ADDRSTRLEN] = "?";
  inet_ntop(AF_INET, &address, text, sizeof(text));
  return name + ":" + text;
}

class SocketCommunicator final : public Communicator {
 public:
  SocketCommunicator(int rank, int size, std::string instance, int listener, c10::intrusive_ptr<c10d::Store> store,
                     std::chrono::milliseconds timeout)
      : Communicator(rank, size, std::move(instance)),
        fds_(new std::atomic<int>[static_cast<size_t>(kChannels) * size]),
        listener_(listener),
        store_(std::move(store)),
        timeout_(timeout) {
    for (size_t i = 0; i < static_cast<size_t>(kChannels) * size; ++i) fds_[i] = -1;
  }
  ~SocketCommunicator() override {
    if (interrupt_ >= 0) close(interrupt_);
    if (listener_ >= 0) close(listener_);
    for (size_t i = 0; i < static_cast<size_t>(kChannels) * size_; ++i) {
      if (fds_[i] >= 0) close(fds_[i]);
    }
    for (auto& pair : self_) {
      for (int fd : pair) {
        if (fd >= 0) close(fd);
      }
    }
  }
  const char* transport() const override { return "sockets"; }
  std::string peer_path(int) const override { return "NET/Socket/0"; }
  void interrupt_transfer() override {
    const uint64_t one = 1;
    if (interrupt_ >= 0) (void)!::write(interrupt_, &one, sizeof(one));
  }
  // The connections are shut down (not closed: a call of another thread may still poll them), so
  // every peer's next read sees them closed, as NCCL's peers see an aborted rank's.
  void abort() override {
    Communicator::abort();
    for (size_t i = 0; i < static_cast<size_t>(kChannels) * size_; ++i) {
      if (fds_[i] >= 0) ::shutdown(fds_[i], SHUT_RDWR);
    }
    if (listener_ >= 0) ::shutdown(listener_, SHUT_RDWR);  // peers not yet connected are refused
    interrupt_transfer();
  }

  void agree(const Call& asked, const Timing& timing) override {
    std::vector<Call> calls(static_cast<size_t>(size_));
    calls[rank_] = asked;
    calls[rank_].ready_ns = timing.ready_ns;
    std::vector<Transfer> transfers;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      transfers.push_back(send(r, &calls[rank_], sizeof(Call), timing));
      transfers.push_back(recv(r, &calls[r], sizeof(Call), timing));
    }
    transfer(transfers, 1, timing.what, {}, {});
    check_calls_match(calls.data(), asked, timing.what);
  }

  void broadcast(char* data, int64_t numel, at::ScalarType dtype, int root, const Timing& timing) override {
    agree(Call{Kind::kBroadcast, static_cast<int32_t>(dtype), root, 0, numel}, timing);
    const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
    std::vector<Transfer> transfers;
    if (rank_ == root) {
      for (int r = 0; r < size_; ++r) {
        if (r != root) transfers.push_back(send(r, data, bytes, timing));
      }
    } else {
      transfers.push_back(recv(root, data, bytes, timing));
    }
    transfer(transfers, 1, timing.what, {}, {});
  }

  void all_gather(const std::vector<char*>& outs, const char* in, int64_t numel, at::ScalarType dtype,
                  const Timing& timing) override {
    agree(Call{Kind::kAllGather, static_cast<int32_t>(dtype), 0, 0, numel}, timing);
    const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
    std::vector<Transfer> transfers;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      transfers.push_back(send(r, const_cast<char*>(in), bytes, timing));
      transfers.push_back(recv(r, outs[r], bytes, timing));
    }
    transfer(transfers, 1, timing.what, {}, {});
    if (outs[rank_] != in) std::memmove(outs[rank_], in, bytes);
  }

  void all_reduce(char* data, int64_t numel, at::ScalarType dtype, const Reduction& reduction,
                  const Timing& timing) override {
    agree(Call{Kind::kAllReduce, static_cast<int32_t>(dtype), static_cast<int32_t>(reduction.op), 0, numel}, timing);
    reduce_rounds(data, numel, dtype, reduction, -1, timing);
  }

  void reduce(char* data, int64_t numel, at::ScalarType dtype, const Reduction& reduction, int root,
              const Timing& timing) override {
    agree(Call{Kind::kReduce, static_cast<int32_t>(dtype), (root << 8) | static_cast<int32_t>(reduction.op), 0, numel},
          timing);
    reduce_rounds(data, numel, dtype, reduction, root, timing);
  }

  void reduce_scatter(char* out, const char* in, int64_t numel, at::ScalarType dtype, const Reduction& reduction,
                      const Timing& timing) override {
    agree(Call{Kind::kReduceScatter, static_cast<int32_t>(dtype), static_cast<int32_t>(reduction.op), 0, numel},
          timing);
    const size_t item = c10::elementSize(dtype);
    const int64_t chunk = std::max<int64_t>(1, static_cast<int64_t>(kChunkBytes / item));
    std::vector<char> contributions(static_cast<size_t>(size_) * std::min(chunk, numel) * item + 1);
    for (int64_t offset = 0; offset < numel; offset += chunk) {
      const int64_t n = std::min(chunk, numel - offset);
      const size_t bytes = static_cast<size_t>(n) * item;
      std::vector<Transfer> transfers;
      std::vector<std::vector<char>> scaled;  // PREMUL_SUM: what this rank sends, scaled
      scaled.reserve(static_cast<size_t>(size_));
      for (int r = 0; r < size_; ++r) {
        const char* part = in + (static_cast<size_t>(r) * numel + offset) * item;
        char* slot = contributions.data() + static_cast<size_t>(rank_) * bytes;
        if (r == rank_) {
          std::memcpy(slot, part, bytes);
          if (reduction.op == c10d::ReduceOp::PREMUL_SUM) scale(dtype, slot, n, reduction, 0);
          continue;
        }
        if (reduction.op == c10d::ReduceOp::PREMUL_SUM) {
          scaled.emplace_back(part, part + bytes);
          scale(dtype, scaled.back().data(), n, reduction, 0);
          part = scaled.back().data();
        }
        transfers.push_back(send(r, const_cast<char*>(part), bytes, timing));
        transfers.push_back(recv(r, contributions.data() + static_cast<size_t>(r) * bytes, bytes, timing));
      }
      transfer(transfers, 1, timing.what, {}, {});
      combine(out + static_cast<size_t>(offset) * item, contributions.data(), bytes, n, dtype, reduction);
    }
  }

  void transfer(std::vector<Transfer>& transfers, int channel, const std::string& what,
                const std::function<void(std::vector<Transfer>&)>& poll_more,
                const std::function<void(size_t)>& finished) override {
    size_t done = 0;
    for (const Transfer& t : transfers) done += t.finished();
    std::vector<char> busy;
    std::vector<pollfd> waits;
    while (done < transfers.size()) {
      bool moved = false;
      bool connecting = false;
      busy.assign(static_cast<size_t>(2 * size_), 0);
      waits.clear();
      for (size_t i = 0; i < transfers.size(); ++i) {
        Transfer& t = transfers[i];
        if (t.finished()) continue;
        char& blocked = busy[static_cast<size_t>(t.send ? 0 : size_) + t.peer];
        if (blocked) continue;
        blocked = 1;
        const int fd = socket_of(t.peer, channel, t.send);
        if (fd < 0) {  // a higher rank not yet connected: its connection arrives on the listener
          waits.push_back(pollfd{listener_, POLLIN, 0});
          connecting = true;
          continue;
        }
        bool would_block = false;
        if (t.header_done < sizeof(t.header)) {
          if (t.send) t.header = {t.bytes, t.clock};
          char* header = reinterpret_cast<char*>(&t.header);
          const ssize_t n = t.send ? ::send(fd, header + t.header_done, sizeof(t.header) - t.header_done, MSG_NOSIGNAL)
                                   : ::recv(fd, header + t.header_done, sizeof(t.header) - t.header_done, 0);
          would_block = !account(n, t.header_done, t, what);
          moved |= n > 0;
          if (!t.send && t.header_done == sizeof(t.header) && t.header.length != t.bytes) fail_size(t, what);
        }
        if (!would_block && t.header_done == sizeof(t.header) && t.done < t.bytes) {
          const ssize_t n = t.send ? ::send(fd, t.data + t.done, t.bytes - t.done, MSG_NOSIGNAL)
                                   : ::recv(fd, t.data + t.done, t.bytes - t.done, 0);
          would_block = !account(n, t.done, t, what);
          moved |= n > 0;
        }
        if (t.finished()) {
          ++done;
          blocked = 0;
          if (finished) finished(i);
        } else if (would_block) {
          waits.push_back(pollfd{fd, static_cast<short>(t.send ? POLLOUT : POLLIN), 0});
        }
      }
      if (moved) continue;
      if (poll_more) {
        const size_t before = transfers.size();
        poll_more(transfers);
        if (transfers.size() != before) continue;
      }
      if (done == transfers.size()) break;
      Clock::time_point deadline = Clock::time_point::max();
      for (const Transfer& t : transfers) {
        if (!t.finished()) deadline = std::min(deadline, t.deadline);
      }
      const auto now = Clock::now();
      if (now >= deadline) {
        for (const Transfer& t : transfers) {
          if (!t.finished() && t.deadline <= now) {
            fail_timeout(Timing{t.deadline, t.timeout, what}, {t.peer},
                         t.send ? "received this send" : "sent to this receive");
          }
        }
      }
      // New work (poll_more) wakes the wait through interrupt_; at most 200 ms in any case, and
      // 10 ms while a connection is awaited (the other thread of this process, point-to-point
      // or collectives, may take it from the listener this one polls).
      if (poll_more && interrupt_ >= 0) waits.push_back(pollfd{interrupt_, POLLIN, 0});
      const auto wait = std::min<Clock::duration>(deadline - now, std::chrono::milliseconds(connecting ? 10 : 200));
      ::poll(waits.data(), waits.size(), static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(wait).count()) + 1);
      uint64_t interruptions;
      if (poll_more && interrupt_ >= 0) (void)!::read(interrupt_, &interruptions, sizeof(interruptions));
    }
  }

 private:
  static Transfer send(int peer, void* data, size_t bytes, const Timing& timing) {
    return Transfer{true, peer, static_cast<char*>(data), bytes, timing.deadline, timing.timeout};
  }
  static Transfer recv(int peer, void* data, size_t bytes, const Timing& timing) {
    return Transfer{false, peer, static_cast<char*>(data), bytes, timing.deadline, timing.timeout};
  }

  // fds_[channel * size + peer]; to oneself, the two ends of a socketpair (see connect_sockets).
  // A pair not connected yet is connected now when this rank is the higher (the peer's listener
  // takes it whatever the peer is doing); otherwise -1 until the peer's connection is accepted.
  int socket_of(int peer, int channel, bool sending) {
    if (peer == rank_) return self_[channel][sending ? 0 : 1];
    const size_t slot = static_cast<size_t>(channel) * size_ + peer;
    if (fds_[slot] < 0) {
      std::lock_guard<std::mutex> lock(connecting_);  // the point-to-point worker connects too
      if (fds_[slot] < 0 && peer < rank_) connect_to(peer, channel);
      if (fds_[slot] < 0) accept_pending(0);
    }
    return fds_[slot];
  }

  // Connects to a lower rank's listener (its address from the store) and says who this is.
  void connect_to(int peer, int channel) {
    auto wire = store_->get("mirage/port/" + std::to_string(peer));
    std::stringstream peer_where(std::string(wire.begin(), wire.end()));
    std::string peer_host;
    int peer_port = 0;
    peer_where >> peer_host >> peer_port;
    sockaddr_in to{};
    to.sin_family = AF_INET;
    inet_pton(AF_INET, peer_host.c_str(), &to.sin_addr);
    to.sin_port = htons(static_cast<uint16_t>(peer_port));
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)) != 0) {
      const int error = errno;
      const bool lost_loopback = peer_host.rfind("127.", 0) == 0 && std::getenv("MIRAGE_ISOLATED_NODES");
      if (fd >= 0) close(fd);
      check_not_aborted("connecting to group rank " + std::to_string(peer));
      errno = error;
      fail_setup("connecting to group rank " + std::to_string(peer) + " at " + peer_host + ":" +
                 std::to_string(peer_port) + (lost_loopback ? " (mirage: that rank listens on loopback, which "
                 "other nodes cannot reach, as on a cluster: NCCL_SOCKET_IFNAME=lo? emulated nodes reach each "
                 "other on eth0)" : ""));
    }
    int32_t greeting[2] = {rank_, channel};
    write_all(fd, greeting, sizeof(greeting));
    tune(fd);
    fds_[static_cast<size_t>(channel) * size_ + peer] = fd;
  }

  // Takes the connections higher ranks have made, waiting up to `wait_ms` for the first; each
  // says which rank and channel it is (it wrote that right after connecting).
  void accept_pending(int wait_ms) {
    for (pollfd ready{listener_, POLLIN, 0}; ::poll(&ready, 1, wait_ms) > 0; wait_ms = 0) {
      int fd = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
        check_not_aborted("accepting a peer");
        fail_setup("accepting a peer");
      }
      int32_t greeting[2];
      read_all(fd, greeting, sizeof(greeting));
      TORCH_CHECK_WITH(DistBackendError, greeting[0] > rank_ && greeting[0] < size_ && greeting[1] >= 0 &&
                       greeting[1] < kChannels, "emulated NCCL (socket transport): group rank ", rank_,
                       " was greeted as rank ", greeting[0], " channel ", greeting[1], " (another group's peer?)");
      tune(fd);
      fds_[static_cast<size_t>(greeting[1]) * size_ + greeting[0]] = fd;
    }
  }

  // Every connection of the group, as a collective set-up makes them: to each lower rank, then
  // each higher rank's, within the timeout.
  void connect_all() {
    std::lock_guard<std::mutex> lock(connecting_);
    for (int peer = 0; peer < rank_; ++peer) {
      for (int channel = 0; channel < kChannels; ++channel) connect_to(peer, channel);
    }
    const auto deadline = Clock::now() + timeout_;
    auto missing = [&] {
      for (int peer = rank_ + 1; peer < size_; ++peer) {
        for (int channel = 0; channel < kChannels; ++channel) {
          if (fds_[static_cast<size_t>(channel) * size_ + peer] < 0) return true;
        }
      }
      return false;
    };
    while (missing()) {
      TORCH_CHECK_WITH(DistBackendError, Clock::now() < deadline, "emulated NCCL (socket transport): group rank ",
                       rank_, " waited ", timeout_.count(), " ms for its peers to connect");
      accept_pending(200);
    }
  }

  // Counts what one send/recv moved; false when the socket would block. A closed or broken
  // connection is a dead peer.
  bool account(ssize_t n, size_t& counter, const Transfer& t, const std::string& what) {
    if (n > 0) {
      counter += static_cast<size_t>(n);
      return true;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return false;
    check_not_aborted(what);
    // A peer that died, aborted or destroyed its group: NCCL's net transport reports it so.
    fail_remote(std::string(t.send ? "socketProgress: " : "socketRecv: ") + "connection to group rank " +
                std::to_string(t.peer) + " closed by remote peer" +
                (n < 0 ? std::string(": ") + std::strerror(errno) : std::string()));
  }

  // all_reduce (root -1) and reduce: per chunk, every rank sends its contribution to every rank
  // that needs the result and reduces what it receives in rank order.
  void reduce_rounds(char* data, int64_t numel, at::ScalarType dtype, const Reduction& reduction, int root,
                     const Timing& timing) {
    const size_t item = c10::elementSize(dtype);
    const int64_t chunk = std::max<int64_t>(1, static_cast<int64_t>(kChunkBytes / item));
    const bool receiving = root < 0 || root == rank_;
    std::vector<char> contributions(receiving ? static_cast<size_t>(size_) * std::min(chunk, numel) * item + 1 : 0);
    std::vector<char> scaled;
    for (int64_t offset = 0; offset < numel; offset += chunk) {
      const int64_t n = std::min(chunk, numel - offset);
      const size_t bytes = static_cast<size_t>(n) * item;
      char* mine = data + static_cast<size_t>(offset) * item;
      const char* contribution = mine;
      if (reduction.op == c10d::ReduceOp::PREMUL_SUM) {
        scaled.assign(mine, mine + bytes);
        scale(dtype, scaled.data(), n, reduction, 0);
        contribution = scaled.data();
      }
      std::vector<Transfer> transfers;
      for (int r = 0; r < size_; ++r) {
        if (r == rank_) continue;
        if (root < 0 || r == root) transfers.push_back(send(r, const_cast<char*>(contribution), bytes, timing));
        if (receiving) transfers.push_back(recv(r, contributions.data() + static_cast<size_t>(r) * bytes, bytes, timing));
      }
      transfer(transfers, 1, timing.what, {}, {});
      if (!receiving) continue;
      std::memcpy(contributions.data() + static_cast<size_t>(rank_) * bytes, contribution, bytes);
      combine(mine, contributions.data(), bytes, n, dtype, reduction);
    }
  }

  // out = the reduction of the `size_` contributions laid end to end, in rank order.
  void combine(char* out, const char* contributions, size_t bytes, int64_t n, at::ScalarType dtype,
               const Reduction& reduction) const {
    std::memmove(out, contributions, bytes);
    for (int r = 1; r < size_; ++r) accumulate(dtype, out, contributions + static_cast<size_t>(r) * bytes, n, reduction.op);
    if (reduction.op == c10d::ReduceOp::AVG) scale(dtype, out, n, reduction, size_);
  }

  std::unique_ptr<std::atomic<int>[]> fds_;  // read without the lock; written once, under it
  int listener_;                             // non-blocking; open while any pair may connect
  c10::intrusive_ptr<c10d::Store> store_;    // where the lower ranks' addresses are
  std::chrono::milliseconds timeout_;
  std::mutex connecting_;
  int self_[kChannels][2] = {{-1, -1}, {-1, -1}};
  int interrupt_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);  // see interrupt_transfer

  friend std::unique_ptr<Communicator> connect_sockets(const c10::intrusive_ptr<c10d::Store>&, int, int,
                                                       std::chrono::milliseconds, bool);
};

std::unique_ptr<Communicator> connect_sockets(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                              std::chrono::milliseconds timeout, bool on_first_use) {
  int listener = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (listener < 0) fail_setup("socket()");
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr = chosen_interface().second;
  socklen_t length = sizeof(address);
  // The backlog holds every connection the higher ranks may make before this rank accepts.
  if (::bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      ::listen(listener, kChannels * size + 16) != 0 ||
      ::getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    close(listener);
    fail_setup("listening on " + socket_interface());
  }
  // "a.b.c.d port": where peers connect to this rank.
  char host[INET_ADDRSTRLEN] = "";
  inet_ntop(AF_INET, &address.sin_addr, host, sizeof(host));
  const std::string where = std::string(host) + " " + std::to_string(ntohs(address.sin_port));
  store->set("mirage/port/" + std::to_string(rank), std::vector<uint8_t>(where.begin(), where.end()));
  std::string instance;
  if (rank == 0) {
    std::random_device random;
    instance = std::to_string((uint64_t{random()} << 32) | random());
    store->set("mirage/instance", std::vector<uint8_t>(instance.begin(), instance.end()));
  } else {
    auto wire = store->get("mirage/instance");
    instance.assign(wire.begin(), wire.end());
  }
  auto comm = std::make_unique<SocketCommunicator>(rank, size, instance, listener, store, timeout);
  for (auto& pair : comm->self_) {
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) fail_setup("socketpair()");
    tune(pair[0]);
    tune(pair[1]);
  }
  if (!on_first_use) comm->connect_all();
  return comm;
}

}  // namespace mirage::nccl
