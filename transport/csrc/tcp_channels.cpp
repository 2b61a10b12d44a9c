// TCP channels in the core: transport/tcp.py is the reference (same wire, same credits, same
// rules), here driven by Rounds off the GIL.
//
// Sending: the data thread writes a message (header and payload, one sendmsg, never waiting)
// straight into the socket while nothing of the channel is queued; what the kernel does not
// take is copied into the channel's queue and written by the endpoint's progress thread
// (TcpProgress) as the socket drains. A send therefore returns once its bytes are in the
// kernel or in the queue: the caller may reuse its buffer, and two endpoints sending each
// other large messages at once never wait for a reader. The queue holds at most num_slots
// messages: a slot is written again only after its credit came back.
//
// Receiving: the data thread reads whatever has arrived (non-blocking), header first, every
// header checked as transport/wire_rules.py checks it before a payload byte lands in the slot
// its micro-batch selects; released slots go back to the sender as credit frames.
//
// Threads and memory: the progress thread touches only queued bytes and the socket's write
// side, under TcpProgress::mu_; the data thread writes directly only while queued_ reads 0
// (acquire), which the progress thread stores (release) once the queue is empty, so the two
// never write one socket at once. A channel reads and writes its own duplicate of the Python
// socket's descriptor (own_descriptor), closed only with the channel object, and its close()
// detaches it from the progress thread under mu_ and shuts the connection down: no thread ever
// reads or writes a descriptor number that was freed and reused by another connection.

#include "channels.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace py = pybind11;

namespace m2n {
namespace {

constexpr size_t kReadChunk = 1 << 20;  // a waiting endpoint wakes for a large payload per this much (tcp.py)
constexpr int kProgressSleepMs = 100;    // the progress thread's longest sleep (it is woken for new work)

bool would_block(int err) { return err == EAGAIN || err == EWOULDBLOCK || err == EINTR; }

// A channel reads and writes its own duplicate of the Python socket's descriptor, closed only
// when the channel object goes: an endpoint closed from another thread (a deployment re-wiring
// while its node waits in a round) cannot free the number under a read or a progress-thread
// write and have it reused by a new connection. close() shuts the connection down for both.
int own_descriptor(int fd) {
  int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (own < 0) throw std::runtime_error(std::string("dup of a tcp channel's socket: ") + std::strerror(errno));
  return own;
}

class TcpOutChannel;

// An endpoint's progress thread: writes the queued bytes of its tcp channels as their sockets
// drain. One per endpoint, started with it and stopped (joined) when it closes.
class TcpProgress {
 public:
  TcpProgress() {
    wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wake_fd_ < 0) throw std::runtime_error(std::string("eventfd: ") + std::strerror(errno));
    thread_ = std::thread([this] { run(); });
  }
  ~TcpProgress() { stop(); }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      stopping_ = true;
    }
    wake();
    if (thread_.joinable()) {
      py::gil_scoped_release nogil;  // the thread never takes the GIL; joining must not hold it
      thread_.join();
    }
    ::close(wake_fd_);
  }
  // `ch` has queued bytes (the caller holds mu_).
  void activate_locked(TcpOutChannel* ch) {
    if (std::find(active_.begin(), active_.end(), ch) == active_.end()) active_.push_back(ch);
    wake();
  }
  void detach_locked(TcpOutChannel* ch) { active_.erase(std::remove(active_.begin(), active_.end(), ch), active_.end()); }
  size_t active() {
    std::lock_guard<std::mutex> lock(mu_);
    return active_.size();
  }

  std::mutex mu_;

 private:
  void wake() {
    uint64_t one = 1;
    ssize_t ignored = ::write(wake_fd_, &one, sizeof one);
    (void)ignored;  // a full counter already means a wakeup is due
  }
  void run();

  int wake_fd_ = -1;
  bool stopping_ = false;
  std::vector<TcpOutChannel*> active_;  // channels with queued bytes
  std::thread thread_;
};

// this endpoint -> peer over tcp: stamps the sequence numbers, tracks the peer's slots by its
// credits, writes on the data thread and leaves the rest to the progress thread.
class TcpOutChannel : public Outbound {
 public:
  TcpOutChannel(int fd, size_t slot_bytes, uint32_t num_slots, uint16_t rank, std::shared_ptr<TcpProgress> progress)
      : fd_(own_descriptor(fd)), slot_bytes_(slot_bytes), num_slots_(num_slots), rank_(rank), busy_(num_slots, 0),
        progress_(std::move(progress)) {}
  ~TcpOutChannel() override {
    closed_ = true;
    {
      std::lock_guard<std::mutex> lock(progress_->mu_);
      progress_->detach_locked(this);
    }
    ::close(fd_);
  }

  bool write(uint32_t step, uint16_t layer, uint16_t micro_batch, uint16_t flags, uint32_t token_count,
             const uint8_t* payload, size_t n) override {
    if (closed_) throw std::runtime_error("channel closed");
    if (n > slot_bytes_) throw std::length_error("payload larger than the peer's slot");
    if (failed()) return false;
    uint32_t s = micro_batch % num_slots_;
    if (busy_[s]) {
      drain_credits();
      if (busy_[s] || failed()) return false;
    }
    busy_[s] = 1;
    WireHeader h{kMagic, step, layer, micro_batch, rank_, flags, token_count, seq_, n};
    seq_ += 1;
    send(h, payload, n);
    return true;
  }
  void after_round(uint16_t) override {}
  size_t slot_bytes() const override { return slot_bytes_; }
  bool is_closed() const override { return closed_; }
  bool failed() const override { return failed_.load(std::memory_order_acquire) != kNone; }


  // Takes the credit frames that have arrived: their slots are free again. False once the
  // channel failed (a frame for a slot not in use, or the connection ended; see failure()).
  bool drain_credits() {
    if (failed()) return false;
    for (;;) {
      ssize_t k = recv(fd_, credits_ + have_, sizeof credits_ - have_, MSG_DONTWAIT);
      if (k == 0) return fail(kClosed, 0, 0);
      if (k < 0) return would_block(errno) ? true : fail(kDropped, errno, 0);
      have_ += static_cast<size_t>(k);
      size_t whole = have_ - have_ % sizeof(CreditFrame);
      for (size_t off = 0; off < whole; off += sizeof(CreditFrame)) {
        CreditFrame c;
        std::memcpy(&c, credits_ + off, sizeof c);
        if (c.magic != kCreditMagic || c.reserved || c.slot >= num_slots_ || !busy_[c.slot]) {
          uint64_t raw;
          std::memcpy(&raw, credits_ + off, sizeof raw);
          return fail(kBadCredit, raw, c.slot < num_slots_ && busy_[c.slot]);
        }
        busy_[c.slot] = 0;
      }
      std::memmove(credits_, credits_ + whole, have_ - whole);
      have_ -= whole;
    }
  }
  uint32_t unreleased() {
    drain_credits();
    uint32_t n = 0;
    for (auto b : busy_) n += b;
    return n;
  }
  std::vector<uint8_t> busy() const { return busy_; }
  size_t queued() const { return queued_.load(std::memory_order_acquire); }
  py::tuple failure() const {
    return py::make_tuple(failed_.load(std::memory_order_acquire), fail_a_, fail_b_);
  }
  uint32_t seq() const { return seq_; }

  // Waits up to `linger_s` for the queued bytes to leave (the peer reading them, as the kernel
  // sends what a closed socket still holds), then no more writes, here or on the progress
  // thread (the Python side closes the socket next). Returns the bytes left unsent.
  size_t close(double linger_s) {
    if (closed_) return 0;
    {
      py::gil_scoped_release nogil;
      double until = now_s() + linger_s;
      while (queued_.load(std::memory_order_acquire) && !failed() && now_s() < until) usleep(1000);
    }
    closed_ = true;
    {
      std::lock_guard<std::mutex> lock(progress_->mu_);
      progress_->detach_locked(this);
    }
    shutdown(fd_, SHUT_RDWR);  // the peer sees the connection end now, though this descriptor lives on
    return queued_.load(std::memory_order_acquire);
  }

  // The progress thread, holding mu_: writes queued bytes; true once none are left or the
  // channel failed (it then stops watching this channel).
  bool flush_locked() {
    while (sent_ < queue_.size()) {
      ssize_t k = ::send(fd_, queue_.data() + sent_, queue_.size() - sent_, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (k < 0) {
        if (would_block(errno)) return false;
        fail(kDropped, errno, 0);
        break;
      }
      sent_ += static_cast<size_t>(k);
    }
    queue_.clear();
    sent_ = 0;
    queued_.store(0, std::memory_order_release);
    return true;
  }
  int fd() const { return fd_; }

 private:
  // One message out: straight into the socket while nothing is queued, the rest queued.
  void send(const WireHeader& h, const uint8_t* payload, size_t n) {
    size_t total = sizeof h + n, done = 0;
    if (queued_.load(std::memory_order_acquire) == 0) {
      iovec iov[2] = {{const_cast<WireHeader*>(&h), sizeof h}, {const_cast<uint8_t*>(payload), n}};
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = n ? 2 : 1;
      ssize_t k = sendmsg(fd_, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (k < 0 && !would_block(errno)) {
        fail(kDropped, errno, 0);
        return;
      }
      done = k > 0 ? static_cast<size_t>(k) : 0;
      if (done == total) return;
    }
    std::lock_guard<std::mutex> lock(progress_->mu_);
    const uint8_t* head = reinterpret_cast<const uint8_t*>(&h);
    if (done < sizeof h) queue_.insert(queue_.end(), head + done, head + sizeof h);
    size_t from = done > sizeof h ? done - sizeof h : 0;
    queue_.insert(queue_.end(), payload + from, payload + n);
    queued_.store(queue_.size() - sent_, std::memory_order_release);
    progress_->activate_locked(this);
  }
  bool fail(int code, uint64_t a, uint64_t b) {
    int none = kNone;
    if (failed_.compare_exchange_strong(none, code, std::memory_order_acq_rel)) {
      fail_a_ = a;
      fail_b_ = b;
    }
    return false;
  }

  int fd_;
  size_t slot_bytes_;
  uint32_t num_slots_;
  uint16_t rank_;
  uint32_t seq_ = 0;
  std::vector<uint8_t> busy_;  // slot written and not yet credited back
  uint8_t credits_[sizeof(CreditFrame) * 64];
  size_t have_ = 0;  // bytes of credits_ read, a partial frame last
  std::shared_ptr<TcpProgress> progress_;
  std::vector<uint8_t> queue_;  // bytes the kernel has not taken yet (under progress_->mu_)
  size_t sent_ = 0;             // of queue_, written (under progress_->mu_)
  std::atomic<size_t> queued_{0};
  std::atomic<int> failed_{kNone};
  uint64_t fail_a_ = 0, fail_b_ = 0;
  bool closed_ = false;
};

void TcpProgress::run() {
  std::vector<pollfd> fds;
  std::vector<TcpOutChannel*> watched;
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      fds.assign(1, pollfd{wake_fd_, POLLIN, 0});
      watched = active_;
      for (auto* ch : watched) fds.push_back({ch->fd(), POLLOUT, 0});
    }
    ::poll(fds.data(), fds.size(), kProgressSleepMs);
    uint64_t count;
    while (::read(wake_fd_, &count, sizeof count) > 0) {
    }
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t k = 0; k < watched.size(); ++k) {
      TcpOutChannel* ch = watched[k];
      if (!fds[k + 1].revents || std::find(active_.begin(), active_.end(), ch) == active_.end()) continue;
      if (ch->flush_locked()) detach_locked(ch);
    }
  }
}

// peer -> this endpoint over tcp: reads into the slots of a buffer the Python channel owns.
class TcpInChannel : public SlottedInbound {
 public:
  TcpInChannel(py::buffer slots, int fd, size_t slot_bytes, uint32_t num_slots, uint16_t sender)
      : SlottedInbound(num_slots, sender), fd_(own_descriptor(fd)), slot_bytes_(slot_bytes) {
    info_ = std::make_unique<py::buffer_info>(slots.request(true));
    if (static_cast<size_t>(info_->size * info_->itemsize) < slot_bytes * num_slots)
      throw std::invalid_argument("slot buffer smaller than its slots");
    base_ = static_cast<uint8_t*>(info_->ptr);
  }
  ~TcpInChannel() override {
    ::close(fd_);
    py::gil_scoped_acquire gil;
    info_.reset();
  }

  bool admit() override {
    if (violation_) return false;
    for (;;) {
      if (!arriving_) {
        ssize_t k = recv(fd_, header_ + got_, sizeof header_ - got_, MSG_DONTWAIT);
        if (k <= 0) return ended(k, true);
        got_ += static_cast<size_t>(k);
        if (got_ < sizeof header_) continue;
        if (!start_message()) return false;
      }
      const WireHeader& h = headers_[slot_];
      if (got_ < h.byte_length) {
        low_water(h.byte_length - got_);  // a poll reports the socket once the rest (or 1 MiB of it) is in
        ssize_t k = recv(fd_, base_ + slot_ * slot_bytes_ + got_, h.byte_length - got_, MSG_DONTWAIT);
        if (k <= 0) return ended(k, false);
        got_ += static_cast<size_t>(k);
        if (got_ < h.byte_length) continue;
      }
      state_[slot_] = kQueued;
      ++queued_;
      arriving_ = false;
      got_ = 0;
      low_water(1);
    }
  }
  const uint8_t* payload(uint32_t s) const override { return base_ + s * slot_bytes_; }
  bool release_slot(uint32_t s) override {
    if (s >= num_slots_ || (state_[s] != kQueued && state_[s] != kHanded)) return true;
    if (state_[s] == kQueued) --queued_;
    state_[s] = kEmpty;
    CreditFrame c{kCreditMagic, static_cast<uint16_t>(s), 0};
    send_all(reinterpret_cast<const uint8_t*>(&c), sizeof c);  // a gone peer: its own side reports it
    return true;
  }
  void set_asleep(bool) override {}
  int wait_fd() const override { return violation_ ? -1 : fd_; }
  bool is_closed() const override { return closed_; }
  void close() {
    closed_ = true;
    shutdown(fd_, SHUT_RDWR);  // the peer sees the connection end now, though this descriptor lives on
  }

 private:
  // A whole header came: checked as wire_rules.InboundRules.admit checks it, then its slot held.
  bool start_message() {
    WireHeader h;
    std::memcpy(&h, header_, sizeof h);
    if (h.magic != kMagic || h.sender != sender_ || h.byte_length > slot_bytes_ || h.seq != next_seq_)
      return fail(kBadHeader, next_seq_, 0, &h);
    uint32_t s = h.micro_batch % num_slots_;
    if (state_[s] != kEmpty) return fail(kHeldSlot, s, held_seq_[s], &h);
    slot_ = s;
    headers_[s] = h;
    held_seq_[s] = h.seq;
    state_[s] = kArriving;
    next_seq_ += 1;
    arriving_ = true;
    got_ = 0;
    return true;
  }
  // recv gave `k` <= 0: nothing yet (true), or the connection's end, in or between messages.
  bool ended(ssize_t k, bool in_header) {
    if (k < 0 && would_block(errno)) return true;
    int err = k < 0 ? errno : 0;
    if (!arriving_ && got_ == 0) return fail(err ? kDropped : kClosed, static_cast<uint64_t>(err), 0);
    WireHeader where{};
    where.magic = in_header ? 1 : 0;
    return fail(kTruncated, got_, in_header ? sizeof header_ : headers_[slot_].byte_length, &where);
  }
  // Wake a waiting endpoint only once a large payload's next chunk is in (SO_RCVLOWAT), as tcp.py.
  void low_water(uint64_t remaining) {
    int mark = static_cast<int>(std::min<uint64_t>(std::max<uint64_t>(remaining, 1), kReadChunk));
    if (mark != mark_) {
      setsockopt(fd_, SOL_SOCKET, SO_RCVLOWAT, &mark, sizeof mark);
      mark_ = mark;
    }
  }
  void send_all(const uint8_t* p, size_t n) {
    while (n) {
      ssize_t k = ::send(fd_, p, n, MSG_NOSIGNAL);
      if (k < 0) {
        if (errno == EINTR) continue;
        return;
      }
      p += k;
      n -= static_cast<size_t>(k);
    }
  }

  int fd_;
  std::unique_ptr<py::buffer_info> info_;
  uint8_t* base_ = nullptr;
  size_t slot_bytes_;
  uint8_t header_[sizeof(WireHeader)];
  bool arriving_ = false;  // a header came and its payload is arriving into slot_
  uint32_t slot_ = 0;
  size_t got_ = 0;  // bytes of the header (while !arriving_) or the payload
  int mark_ = 1;
  bool closed_ = false;
};

}  // namespace

void register_tcp(py::module_& m) {
  py::class_<TcpProgress, std::shared_ptr<TcpProgress>>(m, "TcpProgress")
      .def(py::init<>())
      .def("stop", &TcpProgress::stop)
      .def_property_readonly("active", &TcpProgress::active);

  py::class_<TcpOutChannel, Outbound>(m, "TcpOutChannel")
      .def(py::init<int, size_t, uint32_t, uint16_t, std::shared_ptr<TcpProgress>>())
      .def("try_send", &Outbound::try_send)
      .def("drain_credits", &TcpOutChannel::drain_credits)
      .def("unreleased", &TcpOutChannel::unreleased)
      .def_property_readonly("busy", &TcpOutChannel::busy)
      .def_property_readonly("queued", &TcpOutChannel::queued)
      .def("failure", &TcpOutChannel::failure)
      .def_property_readonly("seq", &TcpOutChannel::seq)
      .def("close", &TcpOutChannel::close, py::arg("linger_s"));

  py::class_<TcpInChannel, Inbound> in_channel(m, "TcpInChannel");
  bind_inbound(in_channel).def(py::init<py::buffer, int, size_t, uint32_t, uint16_t>());
}

}  // namespace m2n
