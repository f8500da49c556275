// A worker's per-partition rule: flow control of one link to a server (`Flow`) and the credit and pacing over all of
// a worker's links (`Credit`), as state machines without I/O. worker/flow.py and worker/credit.py are the reference:
// the same events give the same decisions, counters and numbers (tests/native/test_flow.py feeds both the same
// sequences). The rule itself, and why, is worker/flow.py's module docstring; this is its native form for a link loop
// that never holds the GIL.
//
// A partition is a `Part` the caller numbers (`id`: its place in the caller's table); time comes in as `now`
// (seconds, any clock), nothing here sleeps or waits. Not thread-safe: the loop that owns the links calls them.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace gradwire::flow {

constexpr double kLivenessSeconds = 1.0;     // worker/flow.py's LIVENESS_SECONDS
constexpr double kPaceGiveUpSeconds = 0.2;   // worker/credit.py's PACE_GIVE_UP_SECONDS

// The job-wide order of a partition: (round, -priority, tensor name, partition index), the same on every worker. The
// name compares as UTF-8 bytes, which orders as Python orders its str (by code point).
struct Order {
    int64_t round = 0;
    int64_t neg_priority = 0;
    std::string tensor;
    int64_t index = 0;

    bool operator<(const Order& o) const {
        return std::tie(round, neg_priority, tensor, index) < std::tie(o.round, o.neg_priority, o.tensor, o.index);
    }
};

struct Part {
    int64_t id = 0;     // the caller's
    uint64_t key = 0;
    bool seed = false;  // resent after a failover: passes the window and the cap, never answered
    bool acked = false;
    Order order;
};

class Flow {
   public:
    Flow(int64_t window, int64_t cap = 0, double liveness = kLivenessSeconds)
        : window_(window), cap_(cap), liveness_(liveness) {}

    // Queue a partition: higher priority leaves first, equal priorities in the order queued.
    void push(Part part, int64_t priority);
    // The id of the partition that may be pushed now, taken off the queue (and counted in flight unless a seed); none
    // if none may (then wait for an event, or until `wake_at()`).
    std::optional<int64_t> next(double now);
    // When `next` would let the liveness rule push, if the cap holds everything now.
    std::optional<double> wake_at() const;
    // The server has `key`'s contribution: (its id, whether this freed its window place); none if not in flight.
    std::optional<std::pair<int64_t, bool>> on_ack(uint64_t key);
    // `key`'s sum is in: answered (and acknowledged, if no ACK came before). As `on_ack`.
    std::optional<std::pair<int64_t, bool>> on_answer(uint64_t key, double now);
    void set_limits(int64_t window, int64_t cap) { window_ = window, cap_ = cap; }
    // Everything queued, in the order it would have left; the queue is then empty.
    std::vector<int64_t> take_queued();
    // Everything in flight (in the order taken), then everything queued; nothing is left in either.
    std::vector<int64_t> take_all();

    int64_t window() const { return window_; }
    int64_t cap() const { return cap_; }
    int64_t in_flight() const { return in_flight_; }
    size_t queued() const { return queue_.size(); }
    size_t pending() const { return pending_.size(); }
    double full_seconds = 0, capped_seconds = 0;  // work queued and the window full; window room and the cap holding
    int64_t capped_sends = 0, cap_escapes = 0;     // pushes past a full cap by the job-wide order; by the liveness rule
    double last_answer = 0;                        // when a sum last came back

   private:
    using Entry = std::tuple<int64_t, int64_t, int64_t>;  // (-priority, arrival, slot in parts_): the queue's order
    struct Pending {
        int64_t taken;  // when it was taken, counting: the order take_all gives them back in
        int64_t slot;
    };

    std::optional<int64_t> allowed();  // the rule's third part: the cap and the job-wide order
    bool acked(Part& part);
    void end_full(double now);
    void end_capped(double now);
    int64_t store(Part part);
    Part release(int64_t slot);

    int64_t window_, cap_;
    double liveness_;
    std::set<Entry> queue_;
    std::unordered_map<uint64_t, Pending> pending_;  // taken and not yet answered, by key (seeds never are)
    int64_t in_flight_ = 0;                          // taken and not yet acknowledged
    int64_t arrivals_ = 0, taken_ = 0;
    std::optional<double> full_since_, capped_since_;
    std::vector<Part> parts_;    // queued and pending parts, by slot
    std::vector<int64_t> free_;  // slots free for reuse
};

class Credit {
   public:
    explicit Credit(int64_t limit, int64_t lead = 0) : limit(limit), lead(lead) {}

    void set_lead(int64_t value) { lead = value; }
    // Pace the link to `server` from now on with this share of the bytes (no-op without a lead or a share).
    void pace(int64_t server, double share);
    // The link is gone: nobody waits for it any more.
    void unpace(int64_t server);
    // `n` more bytes wait to be sent to `server`.
    void queue(int64_t server, int64_t n);
    // Whether the link to `server` has its turn now (pacing).
    bool may_send(int64_t server) const;
    // Take `n` bytes of credit for a push to `server`, if its turn has come (when `paced`) and the credit is there;
    // `network`: over a socket. False: not taken, ask again later.
    bool take(int64_t n, int64_t server, bool network, bool paced, double now);
    // Give back the credit of pushes of these sizes (`acked`: the server has them; else abandoned).
    void release_all(const std::vector<int64_t>& sizes, bool network, bool acked, double now);
    // (seconds some push over a network link was unacknowledged, bytes acknowledged on network links).
    std::pair<double, int64_t> busy(double now) const;

    int64_t limit, used = 0, lead;
    double busy_seconds = 0;
    int64_t busy_bytes = 0;

   private:
    std::map<int64_t, double> shares_;  // paced server -> its share
    std::map<int64_t, int64_t> queued_;  // paced server -> bytes submitted, not yet sent
    int64_t net_used_ = 0;
    double busy_since_ = 0;
};

}  // namespace gradwire::flow
