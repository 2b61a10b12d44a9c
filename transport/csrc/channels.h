// What the core's channels share: the wire header, the violation codes, the memory-order
// helpers, and the two interfaces a Round drives (an outbound and an inbound channel).
// Shared memory (m2n_core.cpp) and tcp (tcp_channels.cpp) implement them.

#pragma once

#include <pybind11/pybind11.h>

#include <time.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <vector>

namespace m2n {

constexpr uint32_t kMagic = 0x4D324E01;
constexpr uint32_t kCreditMagic = 0x43524454;  // transport/wire.py CREDIT_MAGIC ("CRDT")
constexpr int kHeaderFields = 9;  // magic, step, layer, micro_batch, sender, flags, token_count, seq, byte_length

// Violation codes (transport/core.py words them as the reference does). A channel that has one
// is not read again; the Python side drops its peer.
enum Violation : int {
  kNone = 0,
  kBadState = 1,     // shm: a state word neither free nor full (a = slot, b = the word)
  kBadHeader = 2,    // magic, sender, length or sequence (a = the seq that was due; fields hold the header)
  kWrongSlot = 3,    // shm: a message in a slot its micro-batch does not name (a = slot)
  kSkipped = 4,      // shm: a later message arrived where the next never did (a = the newest seq seen)
  kRewritten = 5,    // shm: a held slot's header changed before its release (a = slot, b = the seq held)
  kHeldSlot = 6,     // tcp: a message for a slot still held (a = slot, b = the seq it holds; fields: the header)
  kTruncated = 7,    // tcp: the connection closed inside a message (a = bytes that came, b = bytes due,
                     // fields[0] = 1 while the header was arriving, 0 inside the payload)
  kBadCredit = 8,    // tcp: a credit frame not for a slot in use (a = the frame's 8 bytes, b = busy or not)
  kClosed = 9,       // tcp: the peer closed its connection between messages (not a violation: it left)
  kDropped = 10,     // tcp: the connection failed (a = errno; not a violation)
};

constexpr uint64_t kMarkLead = 8;  // a region write's mark: the 4 bytes this far before its payload

struct WireHeader {  // transport/wire.py HEADER "<IIHHHHIIQ"
  uint32_t magic;
  uint32_t step;
  uint16_t layer;
  uint16_t micro_batch;
  uint16_t sender;
  uint16_t flags;
  uint32_t token_count;
  uint32_t seq;
  uint64_t byte_length;
};
static_assert(sizeof(WireHeader) == 32, "the wire header is 32 bytes");

struct CreditFrame {  // transport/wire.py CREDIT "<IHH"
  uint32_t magic;
  uint16_t slot;
  uint16_t reserved;
};
static_assert(sizeof(CreditFrame) == 8, "a credit frame is 8 bytes");

inline uint32_t load_acquire(const uint8_t* p) {
  return __atomic_load_n(reinterpret_cast<const uint32_t*>(p), __ATOMIC_ACQUIRE);
}
inline void store_release(uint8_t* p, uint32_t v) {
  __atomic_store_n(reinterpret_cast<uint32_t*>(p), v, __ATOMIC_RELEASE);
}
inline void fence() { std::atomic_thread_fence(std::memory_order_seq_cst); }

inline double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// this endpoint -> peer. Called from the endpoint's one data thread.
class Outbound {
 public:
  virtual ~Outbound() = default;
  // One message into the slot of `micro_batch`, stamped with this channel's next seq; false
  // (nothing sent) while the peer still holds that slot, or once the channel failed (failed()).
  virtual bool write(uint32_t step, uint16_t layer, uint16_t micro_batch, uint16_t flags, uint32_t token_count,
                     const uint8_t* payload, size_t n) = 0;
  // After a round's writes and one fence: wake the receiver if it needs waking (shm's doorbell).
  virtual void after_round(uint16_t micro_batch) = 0;
  virtual size_t slot_bytes() const = 0;
  // Whether write() may be given these bytes: `device` is GPU memory, which only a channel
  // whose adapter reads it (rdma, from a registered dma-buf) can send; host memory always, and
  // no bytes from anywhere (a device-slot peer's header, in a round posted from GPU memory).
  virtual bool can_send_from(const uint8_t*, size_t n, bool device) const { return !device || n == 0; }
  // write() with the payload written at `offset` of a region the peer exposed, not in its
  // slot (rdma only: a device-slot region across hosts); the header says 0 bytes. A `mark`
  // other than 0 is then written, after the payload and before the header, as the 4 bytes
  // kMarkLead before `offset` (transport/wire.py MARK_LEAD): a word the receiver's GPU stream
  // waits on (cuStreamWaitValue32) with no host in between.
  virtual bool can_write_into(uint64_t, size_t) const { return false; }
  virtual bool write_into(uint32_t, uint16_t, uint16_t, uint16_t, uint32_t, const uint8_t*, size_t, uint64_t,
                          uint32_t) {
    throw std::logic_error("this channel kind writes into no peer's region");
  }
  virtual bool is_closed() const = 0;
  virtual bool failed() const { return false; }  // the connection broke (tcp); the Python side says why

  // The single-message path (Endpoint.send): write() of a Python buffer, off the GIL.
  bool try_send(uint32_t step, uint16_t layer, uint16_t micro_batch, uint16_t flags, uint32_t token_count,
                pybind11::buffer payload) {
    pybind11::buffer_info info = payload.request();
    size_t n = static_cast<size_t>(info.size * info.itemsize);
    pybind11::gil_scoped_release nogil;
    return write(step, layer, micro_batch, flags, token_count, static_cast<const uint8_t*>(info.ptr), n);
  }
};

// peer -> this endpoint. Called from the endpoint's one data thread.
class Inbound {
 public:
  virtual ~Inbound() = default;
  // Takes in what has arrived, in sequence, as queued messages; false once the channel broke a
  // rule or its connection ended (violation() says which). Messages queued before stay takeable.
  virtual bool admit() = 0;
  // The queued message of `micro_batch`, handed out: its slot, or -1 if none is queued.
  virtual int take(uint32_t micro_batch) = 0;
  // Any queued message, handed out: its slot, or -1 (bench host's echoing peers).
  virtual int take_any() = 0;
  virtual const WireHeader& header(uint32_t slot) const = 0;
  virtual const uint8_t* payload(uint32_t slot) const = 0;
  // Frees a handed-out slot; false if the sender broke a rule meanwhile (recorded).
  virtual bool release_slot(uint32_t slot) = 0;
  virtual void set_asleep(bool asleep) = 0;
  // A socket whose readability means this channel has something to admit (tcp), or -1 (shm
  // rings the endpoint's doorbell instead).
  virtual int wait_fd() const { return -1; }
  // What a Round sleeping on this channel polls, beside the doorbell: the socket (tcp), the
  // completion channel its set_asleep(true) armed (rdma), or -1 (shm rings the doorbell).
  virtual int sleep_fd() const { return wait_fd(); }
  virtual int violation() const = 0;
  virtual bool is_closed() const = 0;
};

// An inbound channel's slots as this side sees them, and what every kind does alike with
// them: the hand-outs (to a round, to the single-message path), the counts, the first
// violation recorded. A kind admits messages into state_ and headers_ its own way.
class SlottedInbound : public Inbound {
 public:
  enum SlotState : uint8_t { kEmpty = 0, kArriving = 1, kQueued = 2, kHanded = 3 };

  SlottedInbound(uint32_t num_slots, uint16_t sender)
      : num_slots_(num_slots), sender_(sender), held_seq_(num_slots, 0), state_(num_slots, kEmpty),
        headers_(num_slots) {}

  int take(uint32_t micro_batch) override {
    uint32_t s = micro_batch % num_slots_;
    if (state_[s] != kQueued || headers_[s].micro_batch != micro_batch) return -1;
    state_[s] = kHanded;
    --queued_;
    return static_cast<int>(s);
  }
  int take_any() override {
    for (uint32_t s = 0; s < num_slots_; ++s)
      if (state_[s] == kQueued) return take(headers_[s].micro_batch);
    return -1;
  }
  const WireHeader& header(uint32_t s) const override { return headers_[s]; }
  int violation() const override { return violation_; }

  // The single-message path (Endpoint.recv): every queued message, handed out, oldest first.
  // (A round may have taken a later one already: the queued ones need not be the newest.) A
  // violation, if any, is read by the caller after these are handed out.
  pybind11::list poll() {
    admit();
    pybind11::list out;
    std::vector<uint32_t> slots;
    for (uint32_t s = 0; s < num_slots_; ++s)
      if (state_[s] == kQueued) slots.push_back(s);
    // every queued seq lies behind next_seq_: (seq - next_seq_) mod 2^32 orders them oldest first
    std::sort(slots.begin(), slots.end(),
              [&](uint32_t a, uint32_t b) { return headers_[a].seq - next_seq_ < headers_[b].seq - next_seq_; });
    for (uint32_t s : slots) {
      state_[s] = kHanded;
      --queued_;
      const WireHeader& h = headers_[s];
      out.append(pybind11::make_tuple(s, pybind11::make_tuple(h.step, h.layer, h.micro_batch, h.sender, h.flags,
                                                              h.token_count, h.seq, h.byte_length)));
    }
    return out;
  }
  pybind11::tuple violation_info() const {
    return pybind11::make_tuple(violation_, va_, vb_,
                                pybind11::make_tuple(vh_.magic, vh_.step, vh_.layer, vh_.micro_batch, vh_.sender,
                                                     vh_.flags, vh_.token_count, vh_.seq, vh_.byte_length));
  }
  uint32_t held() const {
    uint32_t n = 0;
    for (auto st : state_) n += st == kHanded;
    return n;
  }
  uint32_t queued() const { return queued_; }
  uint32_t next_seq() const { return next_seq_; }

 protected:
  // Records the channel's first violation; false, for `return fail(...)`.
  bool fail(int code, uint64_t a, uint64_t b, const WireHeader* h = nullptr) {
    if (violation_) return false;
    violation_ = code;
    va_ = a;
    vb_ = b;
    if (h) vh_ = *h;
    return false;
  }

  uint32_t num_slots_;
  uint16_t sender_;
  uint32_t next_seq_ = 0;
  uint32_t queued_ = 0;
  std::vector<uint32_t> held_seq_;
  std::vector<uint8_t> state_;
  std::vector<WireHeader> headers_;
  int violation_ = kNone;
  uint64_t va_ = 0, vb_ = 0;
  WireHeader vh_{};
};

// The Python face every inbound channel kind shares (a SlottedInbound with close()): the
// single-message path's poll and release, the counts, the violation; `admit` off the GIL.
template <typename Channel>
pybind11::class_<Channel, Inbound>& bind_inbound(pybind11::class_<Channel, Inbound>& cls) {
  return cls.def("admit", [](Channel& ch) {
               pybind11::gil_scoped_release nogil;
               return ch.admit();
             })
      .def("poll", &Channel::poll)
      .def("release", &Channel::release_slot)
      .def_property_readonly("violation", &Channel::violation)
      .def("violation_info", &Channel::violation_info)
      .def_property_readonly("held", &Channel::held)
      .def_property_readonly("queued", &Channel::queued)
      .def_property_readonly("next_seq", &Channel::next_seq)
      .def("close", &Channel::close);
}

void register_tcp(pybind11::module_& m);
void register_verbs(pybind11::module_& m);

}  // namespace m2n
