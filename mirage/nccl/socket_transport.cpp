// The socket transport of the emulated NCCL backend: TCP between every pair of ranks, as NCCL's
// net transport (NCCL_NET=Socket) carries traffic that shared memory and P2P cannot.
//
// Set-up, collective over the group's store: every rank listens on an ephemeral port of its
// interface's address (socket_interface) and publishes both; each rank connects to every lower rank, twice (channel 0 for point-to-point
// operations, channel 1 for collectives, so a pending send cannot block a collective's bytes)
// and says who it is; a rank's own channel is a socketpair. All data moves through transfer(),
// one non-blocking engine over poll(): every pending send and receive progresses together.
// Collectives are built from transfers, each opened by an exchange of the ranks' calls (the
// desync check). Reductions receive every peer's chunk and reduce in rank order, so every rank
// gets the same bits, as over shared memory.

#include "transport.h"

#include <c10/util/Exception.h>

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
#include <cerrno>
#include <cstring>
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
  SocketCommunicator(int rank, int size, std::string instance, std::vector<int> fds)
      : Communicator(rank, size, std::move(instance)), fds_(std::move(fds)) {}
  ~SocketCommunicator() override {
    if (interrupt_ >= 0) close(interrupt_);
    for (int fd : fds_) {
      if (fd >= 0) close(fd);
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
    for (int fd : fds_) {
      if (fd >= 0) ::shutdown(fd, SHUT_RDWR);
    }
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
      busy.assign(static_cast<size_t>(2 * size_), 0);
      waits.clear();
      for (size_t i = 0; i < transfers.size(); ++i) {
        Transfer& t = transfers[i];
        if (t.finished()) continue;
        char& blocked = busy[static_cast<size_t>(t.send ? 0 : size_) + t.peer];
        if (blocked) continue;
        blocked = 1;
        const int fd = socket_of(t.peer, channel, t.send);
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
      // New work (poll_more) wakes the wait through interrupt_; at most 200 ms in any case.
      if (poll_more && interrupt_ >= 0) waits.push_back(pollfd{interrupt_, POLLIN, 0});
      const auto wait = std::min<Clock::duration>(deadline - now, std::chrono::milliseconds(200));
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
  int socket_of(int peer, int channel, bool sending) const {
    if (peer == rank_) return self_[channel][sending ? 0 : 1];
    return fds_[static_cast<size_t>(channel) * size_ + peer];
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

  std::vector<int> fds_;
  int self_[kChannels][2] = {{-1, -1}, {-1, -1}};
  int interrupt_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);  // see interrupt_transfer

  friend std::unique_ptr<Communicator> connect_sockets(const c10::intrusive_ptr<c10d::Store>&, int, int,
                                                       std::chrono::milliseconds);
};

std::unique_ptr<Communicator> connect_sockets(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                              std::chrono::milliseconds timeout) {
  int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  if (listener < 0) fail_setup("socket()");
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr = chosen_interface().second;
  socklen_t length = sizeof(address);
  if (::bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 || ::listen(listener, 4 * size) != 0 ||
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
  std::vector<int> fds(static_cast<size_t>(kChannels) * size, -1);
  // Connect to every lower rank, once per channel, greeting with (rank, channel).
  for (int peer = 0; peer < rank; ++peer) {
    auto wire = store->get("mirage/port/" + std::to_string(peer));
    std::stringstream peer_where(std::string(wire.begin(), wire.end()));
    std::string peer_host;
    int peer_port = 0;
    peer_where >> peer_host >> peer_port;
    sockaddr_in to{};
    to.sin_family = AF_INET;
    inet_pton(AF_INET, peer_host.c_str(), &to.sin_addr);
    to.sin_port = htons(static_cast<uint16_t>(peer_port));
    for (int channel = 0; channel < kChannels; ++channel) {
      int fd = ::socket(AF_INET, SOCK_STREAM, 0);
      if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)) != 0) {
        const bool lost_loopback = peer_host.rfind("127.", 0) == 0 && std::getenv("MIRAGE_ISOLATED_NODES");
        fail_setup("connecting to group rank " + std::to_string(peer) + " at " + peer_host + ":" +
                   std::to_string(peer_port) + (lost_loopback ? " (mirage: that rank listens on loopback, which "
                   "other nodes cannot reach, as on a cluster: NCCL_SOCKET_IFNAME=lo? emulated nodes reach each "
                   "other on eth0)" : ""));
      }
      int32_t greeting[2] = {rank, channel};
      write_all(fd, greeting, sizeof(greeting));
      fds[static_cast<size_t>(channel) * size + peer] = fd;
    }
  }
  // Accept every higher rank's connections.
  const auto deadline = Clock::now() + timeout;
  for (int pending = kChannels * (size - 1 - rank); pending > 0; --pending) {
    pollfd ready{listener, POLLIN, 0};
    while (::poll(&ready, 1, 200) == 0) {
      TORCH_CHECK_WITH(DistBackendError, Clock::now() < deadline, "emulated NCCL (socket transport): group rank ",
                       rank, " waited ", timeout.count(), " ms for its peers to connect");
    }
    int fd = ::accept(listener, nullptr, nullptr);
    if (fd < 0) fail_setup("accepting a peer");
    int32_t greeting[2];
    read_all(fd, greeting, sizeof(greeting));
    fds[static_cast<size_t>(greeting[1]) * size + greeting[0]] = fd;
  }
  close(listener);
  for (int fd : fds) {
    if (fd >= 0) tune(fd);
  }
  auto comm = std::make_unique<SocketCommunicator>(rank, size, instance, std::move(fds));
  for (auto& pair : comm->self_) {
    if (::socketpair(AF_UNIX, SOCK_STREAM, 0, pair) != 0) fail_setup("socketpair()");
    tune(pair[0]);
    tune(pair[1]);
  }
  return comm;
}

}  // namespace mirage::nccl
