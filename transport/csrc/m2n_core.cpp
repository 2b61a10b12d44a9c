// The M2N core: shared-memory channels and whole rounds, off the GIL. A Round drives any
// channels that implement channels.h's interfaces: these shared-memory ones, and tcp's
// (tcp_channels.cpp, which has a progress thread of its own for the bytes a socket cannot take
// at once).
//
// transport/shm.py is the reference: same segment layout, same rules, same doorbells. This
// file does per round what the Python path does per message, in one call: a round posts one
// message to each of N peers (copy, header, release-store of the state word, one fence, a
// doorbell only to receivers that sleep) and collects one message from each of N peers
// (acquire-load of the state word, every header checked as transport/wire_rules.py checks
// it, in sequence), gathers the payloads into one buffer and releases the slots. It takes
// addresses and sizes; it links against nothing but libc and the C++ runtime (not torch, not
// libibverbs).
//
// Threading: every call comes from the endpoint's one data thread; the GIL is released for
// the copies and the waits. Memory model (x86-64 and aarch64): the sender writes payload and
// header, then stores FULL with release semantics; the receiver loads the state with acquire
// semantics before it reads the header; a side about to sleep stores its asleep word, fences,
// and looks again, and a side that made something ready fences before it reads the other's
// asleep word, so no wakeup is lost (the same protocol as shm.py, whose lock round trip is
// this file's atomic_thread_fence).
//
// A peer maps the segment it writes into, so nothing read from it is trusted: a header that
// breaks a rule is recorded as the channel's violation (a code and the raw fields) and the
// Python side raises ProtocolViolation with the same words the reference uses.

#include "channels.h"

#include <pybind11/pybind11.h>
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

using namespace m2n;

constexpr size_t kSlotsOffset = 64, kHeaderOffset = 64, kPayloadOffset = 96;
constexpr size_t kReceiverAsleep = 0, kSenderAsleep = 4;
constexpr uint32_t kFree = 0, kFull = 1;
constexpr uint8_t kDoorbellData = 1, kDoorbellFree = 2;

// A mapped segment, held through a buffer export of the Python object it came from
// (shm._Segment's memoryview) for as long as this object lives: the segment cannot be
// unmapped under the core (its close() then keeps the mapping, as for any consumer's view),
// even when the endpoint is closed from another thread while a round is copying or waiting.
// close() only marks it closed: every call checks that first, and a wait in progress sees
// it and returns (the memory it may still touch stays mapped until the export goes).
struct Mapping {
  std::unique_ptr<py::buffer_info> info;
  uint8_t* base = nullptr;
  std::atomic<bool> closed{false};

  void bind(py::buffer buffer, size_t need) {
    auto held = std::make_unique<py::buffer_info>(buffer.request(true));
    if (static_cast<size_t>(held->size * held->itemsize) < need)
      throw std::invalid_argument("segment mapping smaller than its slots");
    base = static_cast<uint8_t*>(held->ptr);
    info = std::move(held);
  }
  void close() { closed.store(true, std::memory_order_release); }
  bool is_closed() const { return closed.load(std::memory_order_acquire); }
  ~Mapping() {
    if (info) {
      py::gil_scoped_acquire gil;
      info.reset();
    }
  }
};

// Rings a peer's doorbell: a datagram to its abstract UNIX socket, never blocking (a full queue
// already guarantees it a wakeup; a vanished peer is caught by its control socket).
struct Bell {
  int fd = -1;  // the endpoint's outgoing datagram socket (shm.Doorbell._out)
  sockaddr_un addr{};
  socklen_t addr_len = 0;
  uint16_t channel = 0;

  void set(int out_fd, const std::string& name, uint16_t peer_channel) {
    fd = out_fd;
    channel = peer_channel;
    addr.sun_family = AF_UNIX;
    if (name.size() + 1 > sizeof(addr.sun_path)) throw std::invalid_argument("doorbell name too long");
    addr.sun_path[0] = '\0';  // abstract namespace
    std::memcpy(addr.sun_path + 1, name.data(), name.size());
    addr_len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  }
  void ring(uint8_t kind, uint16_t slot) const {
    uint8_t msg[8] = {kind, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(msg + 2, &channel, 2);
    std::memcpy(msg + 4, &slot, 2);
    sendto(fd, msg, sizeof msg, MSG_DONTWAIT, reinterpret_cast<const sockaddr*>(&addr), addr_len);
  }
};

// this endpoint -> peer: writes into the segment the peer made for it.
class OutChannel : public Outbound {
 public:
  OutChannel(py::buffer segment, size_t slot_bytes, size_t stride, uint32_t num_slots, uint16_t rank,
             int doorbell_fd, const std::string& peer_doorbell, uint16_t peer_channel)
      : slot_bytes_(slot_bytes), stride_(stride), num_slots_(num_slots), rank_(rank) {
    map_.bind(segment, kSlotsOffset + stride * num_slots);
    bell_.set(doorbell_fd, peer_doorbell, peer_channel);
  }

  // One message into the slot of `micro_batch`, stamped with this channel's next seq; false
  // (nothing written) while the peer still holds that slot. Does not fence or ring: the
  // caller does, once per round (finish()).
  bool write(uint32_t step, uint16_t layer, uint16_t micro_batch, uint16_t flags, uint32_t token_count,
             const uint8_t* payload, size_t n) override {
    if (map_.is_closed()) throw std::runtime_error("channel closed");
    if (n > slot_bytes_) throw std::length_error("payload larger than the peer's slot");
    uint8_t* slot = slot_base(micro_batch % num_slots_);
    if (load_acquire(slot) != kFree) return false;
    if (n) std::memcpy(slot + kPayloadOffset, payload, n);
    WireHeader h{kMagic, step, layer, micro_batch, rank_, flags, token_count, seq_, n};
    std::memcpy(slot + kHeaderOffset, &h, sizeof h);
    store_release(slot, kFull);
    seq_ += 1;
    return true;
  }
  // After write()s: a fence, then the receiver's doorbell if it sleeps.
  void finish(uint16_t micro_batch) {
    fence();
    after_round(micro_batch);
  }
  void after_round(uint16_t micro_batch) override {
    if (load_acquire(map_.base + kReceiverAsleep)) bell_.ring(kDoorbellData, micro_batch % num_slots_);
  }
  bool try_send(uint32_t step, uint16_t layer, uint16_t micro_batch, uint16_t flags, uint32_t token_count,
                py::buffer payload) {
    py::buffer_info info = payload.request();
    size_t n = static_cast<size_t>(info.size * info.itemsize);
    bool done;
    {
      py::gil_scoped_release nogil;
      done = write(step, layer, micro_batch, flags, token_count, static_cast<const uint8_t*>(info.ptr), n);
      if (done) finish(micro_batch);
    }
    return done;
  }
  bool slot_free(uint16_t micro_batch) const { return load_acquire(slot_base(micro_batch % num_slots_)) == kFree; }
  size_t slot_bytes() const override { return slot_bytes_; }
  uint32_t seq() const { return seq_; }
  bool is_closed() const override { return map_.is_closed(); }
  void close() { map_.close(); }

 private:
  uint8_t* slot_base(uint32_t slot) const { return map_.base + kSlotsOffset + slot * stride_; }
  Mapping map_;
  Bell bell_;
  size_t slot_bytes_, stride_;
  uint32_t num_slots_;
  uint16_t rank_;
  uint32_t seq_ = 0;
};

// peer -> this endpoint: reads the segment this endpoint made for the peer.
class InChannel : public SlottedInbound {
 public:
  InChannel(py::buffer segment, size_t slot_bytes, size_t stride, uint32_t num_slots, uint16_t sender,
            int doorbell_fd, const std::string& peer_doorbell, uint16_t peer_channel)
      : SlottedInbound(num_slots, sender), slot_bytes_(slot_bytes), stride_(stride) {
    map_.bind(segment, kSlotsOffset + stride * num_slots);
    bell_.set(doorbell_fd, peer_doorbell, peer_channel);
  }

  // Admits, in sequence, every full slot this side does not hold yet (as `queued`). A scan
  // may read a slot just before its message lands and a later slot just after its own did;
  // so where a gap shows, the slots are read once more after a fence, and then every message
  // up to the newest one the first look saw must be there (else one was skipped), as
  // shm.py's poll decides. Returns false once the channel broke a rule (see violation()).
  bool admit() override {
    if (violation_) return false;
    uint32_t first = next_seq_;
    uint32_t newest = 0;  // the newest seq the first look saw, as an offset from `first`
    bool gap = false;
    if (!admit_pass(first, &gap, &newest)) return false;
    if (!gap) return true;
    fence();
    bool again = false;
    uint32_t ignored = 0;
    if (!admit_pass(first, &again, &ignored)) return false;
    if (next_seq_ - first <= newest) return fail(kSkipped, first + newest, 0);
    return true;
  }

  // One look: admits the run of full slots that continues the sequence; notes a gap (a full
  // slot further on) and the furthest one, as an offset from `first`.
  bool admit_pass(uint32_t first, bool* gap, uint32_t* newest) {
    for (;;) {
      bool progressed = false;
      *gap = false;
      for (uint32_t s = 0; s < num_slots_; ++s) {
        if (state_[s] != kEmpty) continue;
        uint8_t* slot = slot_base(s);
        uint32_t st = load_acquire(slot);
        if (st == kFree) continue;
        if (st != kFull) return fail(kBadState, s, st);
        WireHeader h;
        std::memcpy(&h, slot + kHeaderOffset, sizeof h);
        uint32_t ahead = h.seq - next_seq_;
        if (h.magic != kMagic || h.sender != sender_ || h.byte_length > slot_bytes_ || ahead >= num_slots_)
          return fail_header(h);
        if (ahead) {  // a later message: the next one may be landing right now
          *gap = true;
          *newest = std::max(*newest, h.seq - first);
          continue;
        }
        if (h.micro_batch % num_slots_ != s) return fail(kWrongSlot, s, 0, &h);
        headers_[s] = h;
        held_seq_[s] = h.seq;
        state_[s] = kQueued;
        ++queued_;
        next_seq_ += 1;
        progressed = true;
      }
      if (!progressed) return true;
    }
  }

  // Frees a handed-out slot; false if the sender rewrote its header meanwhile (recorded).
  bool release_slot(uint32_t s) override {
    if (s >= num_slots_ || state_[s] == kEmpty) return true;
    if (state_[s] == kQueued) --queued_;
    state_[s] = kEmpty;
    uint8_t* slot = slot_base(s);
    WireHeader h;
    std::memcpy(&h, slot + kHeaderOffset, sizeof h);
    bool same = h.seq == held_seq_[s];
    if (!same && !violation_) fail(kRewritten, s, held_seq_[s]);
    store_release(slot, kFree);
    fence();
    if (load_acquire(map_.base + kSenderAsleep)) bell_.ring(kDoorbellFree, static_cast<uint16_t>(s));
    return same;
  }

  void set_asleep(bool asleep) override {
    if (map_.is_closed()) return;
    store_release(map_.base + kReceiverAsleep, asleep ? 1u : 0u);
    fence();
  }

  const uint8_t* payload(uint32_t s) const override { return slot_base(s) + kPayloadOffset; }
  bool is_closed() const override { return map_.is_closed(); }
  void close() { map_.close(); }

 private:
  uint8_t* slot_base(uint32_t s) const { return map_.base + kSlotsOffset + s * stride_; }
  bool fail_header(const WireHeader& h) { return fail(kBadHeader, next_seq_, 0, &h); }

  Mapping map_;
  Bell bell_;
  size_t slot_bytes_, stride_;
};

// A fixed set of peers exchanging whole rounds: N outbound and N inbound channels (either list
// may be empty), with per-peer results in arrays the Python side reads as numpy views.
class Round {
 public:
  // control_fds[i]: inbound peer i's control socket (-1: none), watched while it is awaited.
  Round(std::vector<Outbound*> out, std::vector<Inbound*> in, int doorbell_fd, std::vector<int> control_fds)
      : out_(std::move(out)), in_(std::move(in)), doorbell_fd_(doorbell_fd), control_fds_(std::move(control_fds)),
        pending_(out_.size(), 0), arrived_(in_.size(), 0), slot_(in_.size(), -1),
        fields_(in_.size() * kHeaderFields, 0), broken_(in_.size(), 0), given_up_(in_.size(), 0),
        readable_(in_.size(), 0) {
    if (control_fds_.size() != in_.size()) throw std::invalid_argument("one control socket (or -1) per inbound peer");
    // A channel's descriptor only ever goes (to -1, on a violation): a round that starts with
    // no socket channel never has one, and its scans skip looking for readable sockets.
    for (auto* ch : in_) has_sockets_ = has_sockets_ || ch->wait_fd() >= 0;
  }

  // Every channel still open, else an error (a closed endpoint's round is over).
  void check_open() const {
    if (any_closed_channel()) throw std::runtime_error("a channel of this round was closed (the endpoint closed)");
  }
  bool any_closed_channel() const {
    for (auto* o : out_)
      if (o->is_closed()) return true;
    for (auto* i : in_)
      if (i->is_closed()) return true;
    return false;
  }

  // Posts peer i's bytes [begins[i], ends[i]) of the buffer at `address` with token count
  // counts[i]. Peers whose slot is still held are left pending (see retry()); returns how many.
  // `device`: the buffer is GPU memory, which only channels whose adapter reads it may send
  // (rdma from a registered dma-buf); any other peer fails the post before a byte moves.
  int post(uint32_t step, uint16_t layer, uint16_t micro_batch, uint16_t flags, uintptr_t address, size_t nbytes,
           py::array_t<int64_t, py::array::c_style | py::array::forcecast> begins,
           py::array_t<int64_t, py::array::c_style | py::array::forcecast> ends,
           py::array_t<int64_t, py::array::c_style | py::array::forcecast> counts, bool device,
           std::optional<py::array_t<int64_t, py::array::c_style | py::array::forcecast>> targets, uint32_t mark) {
    check_open();
    size_t n = out_.size();
    if (static_cast<size_t>(begins.size()) != n || static_cast<size_t>(ends.size()) != n ||
        static_cast<size_t>(counts.size()) != n)
      throw std::invalid_argument("post: one begin, end and token count per peer");
    return post_ranges(step, layer, micro_batch, flags, address, nbytes, begins.data(), ends.data(), counts.data(),
                       device, target_offsets(targets), mark);
  }

  // post() where peer i's bytes are counts[i] rows of `row_bytes`, the peers' rows end to end
  // from the buffer's start (an expert node's answers; a dispatch's records in node order).
  int post_rows(uint32_t step, uint16_t layer, uint16_t micro_batch, uint16_t flags, uintptr_t address,
                size_t nbytes, py::array_t<int64_t, py::array::c_style | py::array::forcecast> counts,
                int64_t row_bytes, bool device,
                std::optional<py::array_t<int64_t, py::array::c_style | py::array::forcecast>> targets,
                uint32_t mark) {
    check_open();
    size_t n = out_.size();
    if (static_cast<size_t>(counts.size()) != n) throw std::invalid_argument("post_rows: one token count per peer");
    if (row_bytes < 0) throw std::invalid_argument("post_rows: row_bytes must be non-negative");
    const int64_t* c = counts.data();
    row_begins_.resize(n);
    row_ends_.resize(n);
    int64_t at = 0;
    for (size_t i = 0; i < n; ++i) {
      row_begins_[i] = at;
      at += c[i] * row_bytes;
      row_ends_[i] = at;
    }
    return post_ranges(step, layer, micro_batch, flags, address, nbytes, row_begins_.data(), row_ends_.data(), c,
                       device, target_offsets(targets), mark);
  }

  // The first peer whose message breaks the round's expectations, or -1: its step (step < 0:
  // the first peer's), its layer, byte_length = token_count * row_bytes (row_bytes < 0: not
  // checked), token_count = expected[i] (None: not checked). Arrived peers only.
  int check(int64_t step, int64_t layer, int64_t row_bytes,
            std::optional<py::array_t<int64_t, py::array::c_style | py::array::forcecast>> expected) const {
    const int64_t* want = nullptr;
    if (expected) {
      if (static_cast<size_t>(expected->size()) != in_.size()) throw std::invalid_argument("check: N counts");
      want = expected->data();
    }
    for (size_t i = 0; i < in_.size(); ++i) {
      if (!arrived_[i]) continue;
      const int64_t* f = &fields_[i * kHeaderFields];
      if (step < 0) step = f[1];
      if (f[1] != step || f[2] != layer || (row_bytes >= 0 && f[8] != f[6] * row_bytes) || (want && f[6] != want[i]))
        return static_cast<int>(i);
    }
    return -1;
  }

 private:
  int post_ranges(uint32_t step, uint16_t layer, uint16_t micro_batch, uint16_t flags, uintptr_t address,
                  size_t nbytes, const int64_t* b, const int64_t* e, const int64_t* c, bool device,
                  const int64_t* t, uint32_t mark) {
    if (mark && !t) throw std::invalid_argument("post: a mark goes with writes into regions (targets)");
    size_t n = out_.size();
    const uint8_t* base = reinterpret_cast<const uint8_t*>(address);
    for (size_t i = 0; i < n; ++i) {
      if (b[i] < 0 || e[i] < b[i] || static_cast<size_t>(e[i]) > nbytes)
        throw std::out_of_range("post: peer " + std::to_string(i) + "'s byte range [" + std::to_string(b[i]) + ", " +
                                std::to_string(e[i]) + ") lies outside the " + std::to_string(nbytes) + "-byte buffer");
      if (static_cast<size_t>(e[i] - b[i]) > out_[i]->slot_bytes())
        throw std::length_error("post: peer " + std::to_string(i) + "'s " + std::to_string(e[i] - b[i]) +
                                " bytes exceed its " + std::to_string(out_[i]->slot_bytes()) + "-byte slot");
      if (c[i] < 0 || c[i] > 0xFFFFFFFFLL) throw std::out_of_range("post: a token count outside 32 bits");
      if (t && t[i] >= 0) {
        if (!out_[i]->can_write_into(0, 0))
          throw py::type_error("post: peer " + std::to_string(i) + "'s channel has no region of the peer's to write "
                               "into (only rdma channels of the compiled core write into one, once aimed at it)");
        if (mark && e[i] > b[i] && static_cast<uint64_t>(t[i]) < kMarkLead)
          throw std::out_of_range("post: peer " + std::to_string(i) + "'s region offset " + std::to_string(t[i]) +
                                  " leaves no room for its mark before it");
        if (!out_[i]->can_write_into(static_cast<uint64_t>(t[i]), static_cast<size_t>(e[i] - b[i])))
          throw std::out_of_range("post: peer " + std::to_string(i) + "'s " + std::to_string(e[i] - b[i]) +
                                  " bytes at offset " + std::to_string(t[i]) + " lie past the region it exposed");
      }
      if (!out_[i]->can_send_from(base + b[i], static_cast<size_t>(e[i] - b[i]), device))
        throw py::type_error("post: peer " + std::to_string(i) + "'s channel cannot send from GPU memory "
                                    "(only rdma channels of the compiled core can, from a buffer given to "
                                    "Endpoint.register): stage it through host memory");
    }
    post_ = PostArgs{step, layer, micro_batch, flags, reinterpret_cast<const uint8_t*>(address), mark};
    begins_.assign(b, b + n);
    ends_.assign(e, e + n);
    counts_.assign(c, c + n);
    if (t)
      targets_.assign(t, t + n);
    else
      targets_.clear();
    std::fill(pending_.begin(), pending_.end(), 1);
    send_failures_ = 0;
    py::gil_scoped_release nogil;
    return write_pending();
  }

  // A post's region offsets (`targets`: peer i's payload goes to offset targets[i] of the
  // region it exposed, -1: into its slot as usual), or null where none was given.
  const int64_t* target_offsets(
      const std::optional<py::array_t<int64_t, py::array::c_style | py::array::forcecast>>& targets) const {
    if (!targets) return nullptr;
    if (static_cast<size_t>(targets->size()) != out_.size())
      throw std::invalid_argument("post: one region offset (or -1) per peer");
    return targets->data();
  }

 public:
  // Tries the pending peers of the last post() again; returns how many are still pending.
  int retry() {
    check_open();
    py::gil_scoped_release nogil;
    return write_pending();
  }

  // Waits up to `slice_s` for micro-batch `micro_batch`'s message from every inbound peer
  // not given up: spins for `spin_s`, then sleeps on the doorbell (and the awaited peers'
  // control sockets, whose activity means a peer went away: the Python side looks, and gives
  // it up). Returns how many are still awaited; a peer that broke a rule is not awaited
  // (broken()[i] = 1), nor one given up. Returns at once if the endpoint was closed meanwhile.
  int collect(uint16_t micro_batch, double spin_s, double slice_s) {
    check_open();
    py::gil_scoped_release nogil;
    double start = now_s();
    double spin_until = start + spin_s, until = start + slice_s;
    int missing = scan(micro_batch);
    unsigned spins = 0;
    while (missing) {
      double t = now_s();
      if (t >= until || any_closed_channel()) break;
      if (t < spin_until) {
        cpu_relax();
        if ((++spins & 3) == 0) sched_yield();  // a peer may share this core: let it run
        missing = scan(micro_batch);
        continue;
      }
      if (sleep_once(micro_batch, until - t)) break;  // a control socket spoke
      missing = scan(micro_batch);
    }
    return missing;
  }

  // Copies every arrived payload, peer order, end to end into the buffer at `address` and
  // writes their byte offsets [N + 1] into `offsets`; returns the bytes copied.
  size_t gather(uintptr_t address, size_t capacity,
                py::array_t<int64_t, py::array::c_style> offsets) {
    check_open();
    size_t n = in_.size();
    if (static_cast<size_t>(offsets.size()) != n + 1) throw std::invalid_argument("gather: N + 1 offsets");
    int64_t* off = offsets.mutable_data();
    size_t total = 0;
    for (size_t i = 0; i < n; ++i) total += arrived_[i] ? in_[i]->header(slot_[i]).byte_length : 0;
    if (total > capacity)
      throw std::length_error("gather: " + std::to_string(total) + " bytes arrived for a " +
                              std::to_string(capacity) + "-byte buffer");
    uint8_t* dst = reinterpret_cast<uint8_t*>(address);
    py::gil_scoped_release nogil;
    size_t at = 0;
    for (size_t i = 0; i < n; ++i) {
      off[i] = static_cast<int64_t>(at);
      if (!arrived_[i]) continue;
      size_t len = in_[i]->header(slot_[i]).byte_length;
      if (len) std::memcpy(dst + at, in_[i]->payload(slot_[i]), len);
      at += len;
    }
    off[n] = static_cast<int64_t>(at);
    return at;
  }

  // Frees every slot the last collect took; returns how many peers rewrote a held slot
  // (recorded as their violation).
  int release() {
    check_open();
    py::gil_scoped_release nogil;
    int rewritten = 0;
    for (size_t i = 0; i < in_.size(); ++i) {
      if (!arrived_[i]) continue;
      rewritten += !in_[i]->release_slot(static_cast<uint32_t>(slot_[i]));
      arrived_[i] = 0;
      slot_[i] = -1;
    }
    return rewritten;
  }

  // Each arrived peer's slot (-1: none), for the Python side's views of the payloads.
  py::array slot_view(py::object self) { return py::array_t<int>(slot_.size(), slot_.data(), self); }

  // Peers broken or given up since the last clear_failures().
  int failed_count() const { return failed_count_; }
  // Peer i (gone, the Python side found) is no longer awaited by this round.
  void give_up(size_t i) {
    if (i >= in_.size()) throw std::out_of_range("give_up: no such peer");
    if (arrived_[i] || broken_[i] || given_up_[i]) return;
    given_up_[i] = 1;
    ++failed_count_;
  }
  // After the Python side reported the round's failures: the next round awaits every peer again.
  void clear_failures() {
    std::fill(broken_.begin(), broken_.end(), 0);
    std::fill(given_up_.begin(), given_up_.end(), 0);
    failed_count_ = 0;
  }
  // Outbound channels found failed by the last post (and its retries).
  int send_failures() const { return send_failures_; }

  // numpy views of the per-peer arrays (their owner keeps this object alive).
  py::array fields_view(py::object self) {
    return py::array_t<int64_t>({static_cast<py::ssize_t>(in_.size()), static_cast<py::ssize_t>(kHeaderFields)},
                                fields_.data(), self);
  }
  py::array arrived_view(py::object self) { return py::array_t<uint8_t>(arrived_.size(), arrived_.data(), self); }
  py::array broken_view(py::object self) { return py::array_t<uint8_t>(broken_.size(), broken_.data(), self); }
  py::array pending_view(py::object self) { return py::array_t<uint8_t>(pending_.size(), pending_.data(), self); }

 private:
  struct PostArgs {
    uint32_t step;
    uint16_t layer, micro_batch, flags;
    const uint8_t* base;
    uint32_t mark;  // written before each region write's header (0: none)
  };

  // pending_[i]: 1 waiting for its slot, 2 written and not yet finished, 0 done; a channel that
  // failed (tcp's connection broke) is done and counted in send_failures_ (the Python side names it).
  int write_pending() {
    int still = 0, wrote = 0;
    for (size_t i = 0; i < out_.size(); ++i) {
      if (!pending_[i]) continue;
      const uint8_t* payload = post_.base + begins_[i];
      size_t n = static_cast<size_t>(ends_[i] - begins_[i]);
      uint32_t count = static_cast<uint32_t>(counts_[i]);
      bool into = !targets_.empty() && targets_[i] >= 0;
      if (into ? out_[i]->write_into(post_.step, post_.layer, post_.micro_batch, post_.flags, count, payload, n,
                                     static_cast<uint64_t>(targets_[i]), post_.mark)
               : out_[i]->write(post_.step, post_.layer, post_.micro_batch, post_.flags, count, payload, n)) {
        pending_[i] = 2;
        ++wrote;
      } else if (out_[i]->failed()) {
        pending_[i] = 0;
        ++send_failures_;
      } else {
        ++still;
      }
    }
    if (wrote) {
      fence();  // every FULL store before any asleep word is read
      for (size_t i = 0; i < out_.size(); ++i) {
        if (pending_[i] != 2) continue;
        pending_[i] = 0;
        out_[i]->after_round(post_.micro_batch);
      }
    }
    return still;
  }

  // Which awaited socket channels (tcp) have bytes waiting, by one poll: a scan then reads
  // only those, not every socket of the round (a recv per peer per look, most finding nothing).
  void look_at_sockets() {
    if (!has_sockets_) return;  // shm only: readable_ stays all zero, and no scan reads it
    ready_fds_.clear();
    ready_of_.clear();
    for (size_t i = 0; i < in_.size(); ++i) {
      readable_[i] = 0;
      if (awaited(i) && in_[i]->wait_fd() >= 0) {
        ready_fds_.push_back({in_[i]->wait_fd(), POLLIN, 0});
        ready_of_.push_back(i);
      }
    }
    if (ready_fds_.empty() || ::poll(ready_fds_.data(), ready_fds_.size(), 0) <= 0) return;
    for (size_t k = 0; k < ready_fds_.size(); ++k) readable_[ready_of_[k]] = ready_fds_[k].revents != 0;
  }

  int scan(uint16_t micro_batch) {
    int missing = 0;
    look_at_sockets();
    for (size_t i = 0; i < in_.size(); ++i) {
      if (arrived_[i] || broken_[i] || given_up_[i]) continue;
      Inbound* ch = in_[i];
      int s = ch->take(micro_batch);
      if (s < 0 && ch->wait_fd() >= 0 && !readable_[i]) {  // a socket with nothing waiting
        ++missing;
        continue;
      }
      if (s < 0) {
        bool ok = ch->admit();
        s = ch->take(micro_batch);  // what came before a failure is still this round's
        if (s < 0 && !ok) {
          broken_[i] = 1;
          ++failed_count_;
          continue;
        }
      }
      if (s < 0) {
        ++missing;
        continue;
      }
      const WireHeader& h = ch->header(s);
      int64_t* f = &fields_[i * kHeaderFields];
      f[0] = h.magic; f[1] = h.step; f[2] = h.layer; f[3] = h.micro_batch; f[4] = h.sender;
      f[5] = h.flags; f[6] = h.token_count; f[7] = h.seq; f[8] = static_cast<int64_t>(h.byte_length);
      slot_[i] = s;
      arrived_[i] = 1;
    }
    return missing;
  }

  bool awaited(size_t i) const { return !arrived_[i] && !broken_[i] && !given_up_[i]; }

  // Sleeps on the doorbell until a wakeup or `limit_s`; true if an awaited peer's control
  // socket spoke (the Python side looks at it).
  bool sleep_once(uint16_t micro_batch, double limit_s) {
    for (size_t i = 0; i < in_.size(); ++i)
      if (awaited(i)) in_[i]->set_asleep(true);
    bool spoke = false;
    if (scan(micro_batch)) {  // nothing landed between the last look and the asleep words
      // The doorbell (shm peers ring it), then the awaited tcp channels' sockets (data), then
      // the awaited peers' control sockets (which speak only when a peer goes).
      fds_.clear();
      fds_.push_back({doorbell_fd_, POLLIN, 0});
      for (size_t i = 0; i < in_.size(); ++i)
        if (awaited(i) && in_[i]->sleep_fd() >= 0) fds_.push_back({in_[i]->sleep_fd(), POLLIN, 0});
      size_t controls = fds_.size();
      for (size_t i = 0; i < in_.size(); ++i)
        if (awaited(i) && control_fds_[i] >= 0) fds_.push_back({control_fds_[i], POLLIN, 0});
      int ms = static_cast<int>(limit_s * 1e3) + 1;
      if (ms > 50) ms = 50;  // a lost wakeup costs at most this (the reference's MAX_SLEEP_S)
      int ready = ::poll(fds_.data(), fds_.size(), ms);
      if (ready > 0) {
        if (fds_[0].revents) {
          char buf[64];
          while (doorbell_fd_ >= 0 && recv(doorbell_fd_, buf, sizeof buf, MSG_DONTWAIT) > 0) {
          }
        }
        for (size_t k = controls; k < fds_.size(); ++k) spoke |= fds_[k].revents != 0;
      }
    }
    for (size_t i = 0; i < in_.size(); ++i) in_[i]->set_asleep(false);
    return spoke;
  }

  std::vector<Outbound*> out_;
  std::vector<Inbound*> in_;
  int doorbell_fd_;
  std::vector<int> control_fds_;
  std::vector<pollfd> fds_;  // sleep_once's
  std::vector<uint8_t> pending_;
  std::vector<uint8_t> arrived_;
  std::vector<int> slot_;
  std::vector<int64_t> fields_;
  std::vector<uint8_t> broken_;
  std::vector<uint8_t> given_up_;
  std::vector<uint8_t> readable_;  // look_at_sockets': an awaited socket with bytes waiting
  std::vector<pollfd> ready_fds_;
  std::vector<size_t> ready_of_;
  bool has_sockets_ = false;  // some inbound channel is a socket (tcp)
  int failed_count_ = 0;  // peers broken or given up, not yet cleared (clear_failures)
  int send_failures_ = 0;  // outbound channels found failed by the last post and its retries
  PostArgs post_{};
  std::vector<int64_t> begins_, ends_, counts_;
  std::vector<int64_t> targets_;  // the last post's region offsets per peer (-1: its slot); empty: none
  std::vector<int64_t> row_begins_, row_ends_;
};

// -- loopback peers for `megainfer bench host`: fast stand-ins, so the measured side's own cost
// is what the benchmark sees. Both run until a control socket closes (the measured side left).
bool any_closed(const std::vector<int>& control_fds) {
  std::vector<pollfd> fds;
  for (int fd : control_fds) fds.push_back({fd, POLLIN, 0});
  return ::poll(fds.data(), fds.size(), 0) > 0;
}

// Each pair (inbound i, outbound i) answers every message with token_count rows of
// `row_bytes` zero bytes, flag BUSY, same step, layer and micro-batch.
void echo(std::vector<Inbound*> in, std::vector<Outbound*> out, size_t row_bytes, std::vector<int> control_fds) {
  if (in.size() != out.size()) throw std::invalid_argument("echo: one outbound channel per inbound one");
  size_t most = 0;
  for (auto* o : out) most = std::max(most, o->slot_bytes());
  std::vector<uint8_t> zeros(most, 0);
  py::gil_scoped_release nogil;
  unsigned idle = 0;
  for (;;) {
    bool any = false;
    for (size_t i = 0; i < in.size(); ++i) {
      Inbound* ch = in[i];
      if (!ch->admit()) return;  // tcp: the measured side left
      for (int s; (s = ch->take_any()) >= 0;) {
        WireHeader h = ch->header(s);
        ch->release_slot(static_cast<uint32_t>(s));
        size_t n = std::min(zeros.size(), static_cast<size_t>(h.token_count) * row_bytes);
        while (!out[i]->write(h.step, h.layer, h.micro_batch, 1, h.token_count, zeros.data(), n)) {
          if (out[i]->failed()) return;
          cpu_relax();
        }
        fence();
        out[i]->after_round(h.micro_batch);
        any = true;
      }
    }
    if (any) {
      idle = 0;
    } else if ((++idle & 1023) == 0) {
      if (any_closed(control_fds)) return;
      sched_yield();
    }
  }
}

// Attention ranks in the ping-pong's steady state: each outbound channel has one message of
// `nbytes` (token count `tokens`, layer 0) in flight per micro-batch; as soon as micro-batch
// j's answers are in from every inbound channel, j's next message goes out (the step counting
// up once per pass over the micro-batches), as a runner's combine of j precedes its next
// dispatch of j.
void drive(std::vector<Inbound*> in, std::vector<Outbound*> out, size_t nbytes, uint32_t tokens,
           uint16_t micro_batches, std::vector<int> control_fds) {
  std::vector<uint8_t> payload(nbytes, 0);
  py::gil_scoped_release nogil;
  auto send_all = [&](uint32_t step, uint16_t j) {
    for (auto* o : out) {
      unsigned waits = 0;
      while (!o->write(step, 0, j, 0, tokens, payload.data(), nbytes)) {
        if (o->failed()) return false;  // tcp: the measured side left
        cpu_relax();
        if ((++waits & 4095) == 0 && any_closed(control_fds)) return false;
      }
      fence();
      o->after_round(j);
    }
    return true;
  };
  for (uint16_t j = 0; j < micro_batches; ++j)
    if (!send_all(0, j)) return;
  for (uint32_t step = 1;; ++step) {
    for (uint16_t j = 0; j < micro_batches; ++j) {
      for (auto* ch : in) {
        unsigned waits = 0;
        int s;
        while ((s = ch->take(j)) < 0) {
          if (!ch->admit()) return;
          if ((s = ch->take(j)) >= 0) break;
          cpu_relax();
          if ((++waits & 4095) == 0 && any_closed(control_fds)) return;
        }
        ch->release_slot(static_cast<uint32_t>(s));
      }
      if (!send_all(step, j)) return;
    }
  }
}

}  // namespace

PYBIND11_MODULE(_m2n_core, m) {
  m.doc() = "The M2N core: shm, tcp and rdma channels and whole rounds off the GIL (transport/core.py, core_tcp.py)";
  m.attr("HEADER_FIELDS") = kHeaderFields;
  m.attr("BAD_STATE") = static_cast<int>(kBadState);
  m.attr("BAD_HEADER") = static_cast<int>(kBadHeader);
  m.attr("WRONG_SLOT") = static_cast<int>(kWrongSlot);
  m.attr("SKIPPED") = static_cast<int>(kSkipped);
  m.attr("REWRITTEN") = static_cast<int>(kRewritten);

  py::class_<Outbound>(m, "Outbound").def_property_readonly("failed", &Outbound::failed);
  py::class_<Inbound>(m, "Inbound");

  py::class_<OutChannel, Outbound>(m, "OutChannel")
      .def(py::init<py::buffer, size_t, size_t, uint32_t, uint16_t, int, const std::string&, uint16_t>())
      .def("try_send", &OutChannel::try_send)
      .def("slot_free", &OutChannel::slot_free)
      .def_property_readonly("seq", &OutChannel::seq)
      .def("close", &OutChannel::close);

  py::class_<InChannel, Inbound> in_channel(m, "InChannel");
  bind_inbound(in_channel)
      .def(py::init<py::buffer, size_t, size_t, uint32_t, uint16_t, int, const std::string&, uint16_t>())
      .def("set_asleep", &InChannel::set_asleep);

  py::class_<Round>(m, "Round")
      .def(py::init<std::vector<Outbound*>, std::vector<Inbound*>, int, std::vector<int>>(),
           py::keep_alive<1, 2>(), py::keep_alive<1, 3>())
      .def("post", &Round::post, py::arg("step"), py::arg("layer"), py::arg("micro_batch"), py::arg("flags"),
           py::arg("address"), py::arg("nbytes"), py::arg("begins"), py::arg("ends"), py::arg("counts"),
           py::arg("device") = false, py::arg("targets") = py::none(), py::arg("mark") = 0)
      .def("post_rows", &Round::post_rows, py::arg("step"), py::arg("layer"), py::arg("micro_batch"),
           py::arg("flags"), py::arg("address"), py::arg("nbytes"), py::arg("counts"), py::arg("row_bytes"),
           py::arg("device") = false, py::arg("targets") = py::none(), py::arg("mark") = 0)
      .def("check", &Round::check)
      .def_property_readonly("failed_count", &Round::failed_count)
      .def_property_readonly("send_failures", &Round::send_failures)
      .def_property_readonly("closed", &Round::any_closed_channel)
      .def("give_up", &Round::give_up)
      .def("clear_failures", &Round::clear_failures)
      .def("retry", &Round::retry)
      .def("collect", &Round::collect)
      .def("gather", &Round::gather)
      .def("release", &Round::release)
      .def("slots", [](py::object self) { return self.cast<Round&>().slot_view(self); })
      .def("fields", [](py::object self) { return self.cast<Round&>().fields_view(self); })
      .def("arrived", [](py::object self) { return self.cast<Round&>().arrived_view(self); })
      .def("broken", [](py::object self) { return self.cast<Round&>().broken_view(self); })
      .def("pending", [](py::object self) { return self.cast<Round&>().pending_view(self); });

  m.attr("HELD_SLOT") = static_cast<int>(kHeldSlot);
  m.attr("TRUNCATED") = static_cast<int>(kTruncated);
  m.attr("BAD_CREDIT") = static_cast<int>(kBadCredit);
  m.attr("CLOSED") = static_cast<int>(kClosed);
  m.attr("DROPPED") = static_cast<int>(kDropped);
  register_tcp(m);
  register_verbs(m);

  m.def("echo", &echo, "loopback expert nodes for bench host (until a control socket closes)");
  m.def("drive", &drive, "loopback attention ranks for bench host (until a control socket closes)");
}
