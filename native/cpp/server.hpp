// A server's data path in native code: a thread that owns the server's worker links (after Python's accept and
// handshake) and sums the rounds of its plain keys (an elementwise sum over every worker or a process set, no slices,
// no replica) by server/engine.py's rule: double-buffered rounds, contributions added in rank order whatever order
// they arrive in (an early one waits in a staging buffer), the first rank's received straight into the accumulator,
// float16 and bfloat16 accumulated in float32 and narrowed once (sums.hpp: numpy's bytes), every contribution
// acknowledged once it is in and the round's last answered with its result, one buffer sent to every worker (the same
// bytes for all), each reply straight from it. What a failover brings is its too: seeds (SEED, AVERAGED) and replays,
// held rounds (HELD: whom it answered goes to Python's receipts), joined and departed workers.
//
// Everything else is Python's, through one queue of events (`events`): frames of the keys it keeps (other operations,
// sliced, compressed, a server-side optimizer's, a replica's), control frames (BYE, SHM_ATTACH, RECEIVED), a link's
// end, and a held round answered. Python's replies go back through `send`, in order with the loop's own on the link.
//
// Thread-safety: every public call may come from any thread; the state is the loop thread's (calls that change it run
// there, `on_loop`). Buffers are lent by one pool, per size: a round holds its accumulator from its first contribution
// until its result is sent (a seeded round keeps it), a staging buffer until its contribution is added.
#pragma once

#include <sys/eventfd.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "link.hpp"
#include "poll.hpp"
#include "sums.hpp"
#include "tasks.hpp"
#include "worker.hpp"

namespace gradwire::server {

using worker::Arena;
using worker::kNoSlot;

struct Settings {
    uint32_t rank = 0, epoch = 0, workers = 1;
    uint64_t max_payload = 0;
    double frame_timeout = 60;  // a frame begun must go on arriving within it (GRADWIRE_FRAME_TIMEOUT)
};

// What the loop hands Python.
struct Event {
    enum Kind : uint8_t {
        kFrame = 0,   // a frame for Python: a push of a key it keeps, or a control frame; its payload in `body`
        kClosed = 1,  // a link ended (`why`; "" for a BYE or Python's own `close`); its socket is Python's to close
        kHeld = 2,    // a held round of `header.key`, `header.round` answered to the workers in the bitmask `ranks`
    };
    Kind kind = kFrame;
    uint32_t worker = 0;
    Header header;
    std::shared_ptr<std::vector<uint8_t>> body;
    std::string why;
    bool routine = false;  // a closed link: the worker went away, not a protocol error
    uint64_t ranks = 0;
};

// The data path's counters since the last `take_counts` (admin/metrics.py's, and engine.py's seeded answers).
struct Counts {
    uint64_t pushed = 0, pulled = 0, rounds = 0, seeded_answers = 0;
};

class Loop {
   public:
    explicit Loop(const Settings& settings);
    ~Loop();
    Loop(const Loop&) = delete;
    Loop& operator=(const Loop&) = delete;

    // Worker `worker`'s socket, after its handshake (its bytes read ahead: `ahead`); the socket stays the caller's.
    void add(uint32_t worker, int fd, std::vector<uint8_t> ahead);
    // Its shared-memory slots (Python mapped them on its SHM_ATTACH).
    void attach(uint32_t worker, Arena arena);
    // The link leaves the loop (Python closes it): a kClosed event follows once it has.
    void close(uint32_t worker);
    // Frames of Python's (its replies, in order with the loop's own), whole: each header and its payload.
    void send(uint32_t worker, std::vector<uint8_t> frames);
    // A key: summed here (`native`), or its frames handed to Python. `members`: the ranks that contribute, in order
    // (none: every worker). Redeclaring a key changes nothing.
    void declare(uint64_t key, uint8_t dtype, uint64_t length, std::string name, std::vector<uint32_t> members,
                 bool native);
    // Workers that joined (hvd.join: zeros stand in) or left (their rounds fail at once), as bitmasks.
    void set_joined(uint64_t mask);
    void set_departed(uint64_t mask);
    // Elastic: every key starts afresh for `workers` workers (`forget`: every key is dropped). Only with no link.
    void reset(uint32_t workers, bool forget);
    // The server's rank and epoch (a standby's promotion, a reset): frames of another epoch are refused.
    void set_identity(uint32_t rank, uint32_t epoch);

    // What happened since the last call; waits up to `timeout` seconds for something.
    std::vector<Event> events(double timeout);
    Counts take_counts();
    // Rounds begun more than `threshold` seconds before `now` (the steady clock's seconds: Python's time.monotonic)
    // and still missing workers: (key, round, seconds, missing ranks).
    std::vector<std::tuple<uint64_t, int64_t, double, std::vector<uint32_t>>> stalled(double now, double threshold);
    // Keys summed here, and the bytes of the buffers the pool has made.
    std::pair<size_t, uint64_t> sizes();
    // End the thread: every link leaves (the sockets are the caller's, with the flags they had).
    void stop();

   private:
    using Buffer = std::shared_ptr<std::vector<uint8_t>>;  // lent by the pool: back in it when the last user lets go
    struct Round {
        int64_t number = -1;
        uint32_t count = 0;
        uint64_t pushed = 0, staged = 0, virtual_ = 0;  // bitmasks of ranks
        uint32_t turn = 0;
        bool seeded = false, averaged = false, held = false;
        double started = 0;
        Buffer acc, out;  // out: the narrowed result (float16, bfloat16); else the accumulator is the result
        std::vector<Buffer> stage;       // by rank: a staging buffer (kept for the next round once lent)
        std::vector<uint16_t> pulls;     // by rank: its shared pull slot
    };
    struct Key {
        uint8_t dtype = 0;
        uint64_t length = 0;  // bytes of each push (the wire's)
        std::string name;
        bool native = false, narrow = false, landable = false;
        std::vector<uint32_t> members;  // in rank order
        std::vector<uint32_t> nexts;    // the member after each rank (workers: past the last)
        uint64_t everyone = 0;
        uint32_t first = 0, need = 0;
        Round rounds[2];
        uint64_t elements() const { return length / itemsize(dtype); }
        uint64_t acc_bytes() const { return elements() * accumulator_itemsize(dtype); }
        bool unfinished(const Round& r) const { return r.count > 0 && r.count < need; }
    };
    struct Outgoing {  // a frame queued on a link, its payload kept alive until it is sent
        Header header;
        const uint8_t* payload = nullptr;
        Buffer hold;
        std::vector<uint8_t> own;
    };
    struct Side {  // one worker's link
        uint32_t worker = 0;
        size_t poll = 0;  // its index in the poll
        std::unique_ptr<Link> link;
        Arena arena;
        std::deque<Outgoing> sending;  // handed to the link, in order
        std::deque<Outgoing> backlog;  // waiting for room in the link's queue
        std::vector<std::pair<uint64_t, uint32_t>> acks;  // this pass's, sent as one ACKS frame
        // the frame being received: where its payload goes and what follows
        enum class Into { kNone, kRound, kStage, kPython, kDrop } into = Into::kNone;
        uint8_t* data = nullptr;  // a push's payload (its landing, or its shared slot)
        Buffer landing;           // the staging buffer it lands in
        std::shared_ptr<std::vector<uint8_t>> python;  // a frame for Python
        std::vector<uint8_t> ahead;  // bytes the handshake read ahead
        double deadline = 0;  // a frame begun must go on arriving by then (0: none begun)
        bool ended = false;   // out of the poll; retired (its link let go, Python told) at the next pass
        std::string why;      // why it ended ("": a BYE, or Python's close)
        bool routine = true;
        uint8_t* push_slot(uint16_t i) const { return arena.base + uint64_t(i) * arena.slot_bytes; }
        uint8_t* pull_slot(uint16_t i) const { return arena.base + (uint64_t(arena.push) + i) * arena.slot_bytes; }
    };
    struct Receiver;

    void run();
    template <typename F>
    auto on_loop(F&& task);
    void wake();
    void receive(Side& side, double now);
    uint8_t* destination(Side& side, const Header& h);
    uint8_t* frame_destination(Side& side, const Header& h);
    uint8_t* push_destination(Side& side, const Header& h);
    void arrived(Side& side, const Header& h);
    void end(Side& side, const std::string& why, bool routine);
    void retire();
    void flush(Side& side);
    void queue(Side& side, Outgoing frame);
    void queue_acks(Side& side);
    void error_to(uint32_t worker, uint64_t key, const std::string& message);
    Side* side_of(uint32_t worker);
    void post(Event event);

    // the rounds (engine.py's rule)
    void on_push(Key& key, uint64_t id, const Header& h, const uint8_t* data, bool landed, uint16_t pull);
    void take_seed(Key& key, uint64_t id, Round& r, const Header& h, const uint8_t* data);
    void contribute(Key& key, Round& r, uint32_t sender, const uint8_t* data, bool landed);
    void add(Key& key, Round& r, const uint8_t* data, bool first);
    void drain(Key& key, Round& r);
    void complete(Key& key, uint64_t id, Round& r);
    void answer(Key& key, uint64_t id, Round& r, uint64_t ranks);
    void join_in(Key& key, Round& r);
    bool fail_departed(Key& key, uint64_t id, Round& r);
    void begin(Key& key, Round& r, int64_t number);
    uint8_t* landing(Key& key, uint32_t sender, uint32_t round, Buffer& lent);
    Buffer take(uint64_t bytes);
    void fresh_key(Key& key, uint8_t dtype, uint64_t length, std::string name, std::vector<uint32_t> members);

    Settings settings_;
    int wake_fd_;
    Poll poll_;
    std::vector<std::unique_ptr<Side>> sides_;  // by poll index - 1 (0 is the wake fd); nullptr once gone
    std::unordered_map<uint64_t, Key> keys_;
    uint64_t joined_ = 0, departed_ = 0;
    std::unordered_map<uint64_t, std::vector<std::unique_ptr<std::vector<uint8_t>>>> free_;  // the pool, by size
    std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);  // a lent buffer's way home (the pool still is)
    uint64_t allocated_ = 0;
    std::unordered_map<uint64_t, std::vector<uint8_t>> zeros_;  // a joined worker's stand-in, by bytes
    std::vector<uint8_t> scratch_;                               // a refused payload's
    Counts counts_;

    std::mutex mutex_;  // what callers share with the loop
    std::condition_variable posted_;
    std::vector<Event> events_;
    Tasks tasks_;  // on_loop's
    bool stopping_ = false, stopped_ = false;
    std::mutex stopping_lock_;  // `stop`'s, which several threads may call at once (the server's, its control's)
    std::thread thread_;
};

}  // namespace gradwire::server
