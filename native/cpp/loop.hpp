// The native worker as a loop of its own: a thread that owns a worker's links (after Python's connect and handshake)
// and moves every call's partitions by the worker's rule, while callers submit more (the boundary of docs/native.md:
// a call submits its plan and waits on a completion); calls overlap, as a training step's tensors do. worker.hpp's
// push_pull is one call on it, waited for on the caller's thread.
//
// Thread-safety: `submit`, `completions`, `set_limits`, `stop` and the failover's calls may be called from any
// thread; everything else is the loop thread's. A call's buffers must stay valid until its completion is taken.
#pragma once

#include <sys/eventfd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "flow.hpp"
#include "link.hpp"
#include "poll.hpp"
#include "tasks.hpp"
#include "worker.hpp"

namespace gradwire::worker {

class Loop {
   public:
    // Starts the loop's thread over the sockets `fds` (fds[i]: server i), made non-blocking until the loop stops.
    Loop(const std::vector<int>& fds, const Settings& settings);
    ~Loop();
    Loop(const Loop&) = delete;
    Loop& operator=(const Loop&) = delete;

    // Queue call `call`'s parts (its partitions); returns at once. A call of no parts completes at once.
    void submit(uint64_t call, std::vector<Part> parts);
    // The calls finished since the last time, each with "" or what failed it; waits up to `timeout` seconds for one.
    // What failed a call: a server's refusal ("worker R: server S refused T (key K): {json}"), a link's end ("server
    // S: why", "server S: protocol error: why"), a server's abort of the job ("server S ended the job: {json}"), or
    // the reason `stop` was given.
    std::vector<std::pair<uint64_t, std::string>> completions(double timeout);
    // A new window and cap for every link, and pacing's lead, from the next decision on.
    void set_limits(int64_t window, int64_t cap, int64_t lead);
    // End the thread; every call not finished completes with `why`. The sockets stay open (the caller's), with the
    // flags they had before the loop took them.
    void stop(const std::string& why = "the native worker stopped");

    // Server failover (Settings::failover; docs/faults.md, worker/failover.py runs it). Each runs on the loop thread
    // and returns once done there (at once where the loop has stopped).
    // Of `keys`, those with a seed: (key, its round, whether it is this worker's contribution rather than a sum).
    std::vector<std::tuple<uint64_t, int64_t, bool>> seeds(const std::vector<uint64_t>& keys);
    // What lost link `s` holds, unanswered: (key, round) of each part.
    std::vector<std::pair<uint64_t, uint32_t>> orphans(size_t s);
    // Of `keys`, those in flight here (queued, pushed or orphaned): (key, round).
    std::vector<std::pair<uint64_t, uint32_t>> unanswered(const std::vector<uint64_t>& keys);
    // Lost link `s`'s parts, and any submitted to it from now on, go to the link `owners` names for their key (a
    // part whose key it does not name fails).
    void reroute(size_t s, std::unordered_map<uint64_t, size_t> owners);
    // A new socket (a standby's, connected in worker epoch `epoch`) in lost link `s`'s place, with its shared memory
    // (base nullptr: none); `reroute` then moves the parts onto it. The socket is the caller's, as the others.
    void replace(size_t s, int fd, Arena arena, uint32_t epoch);
    // Push `key`'s seed of `round` to link `s`, flagged REPLAY where it is a contribution, else SEED (and `flags`);
    // false where it holds none of that round.
    bool push_seed(uint64_t key, uint32_t round, size_t s, uint8_t flags);
    // The parts lost link `s` held (their sums in their outputs): done now, the failover over (none fail).
    void finish_held(size_t s);
    // The bytes of every key's seed: what this worker keeps for a failover (held outputs not counted).
    uint64_t seed_bytes();

    // Where `tensor`'s parts are: the links with parts of it queued, pushed or waiting for a lost server's
    // successor, and the links whose sums of it are held (for a timeout's message).
    std::pair<std::vector<size_t>, std::vector<size_t>> where(const std::string& tensor);

    Counts counts() const;
    // The stage histogram of the partitions answered since the last call (then empty again).
    Stages take_stages();
    // Keep each answered partition's stages for the timeline (`take_traced`), or stop keeping them (and drop those
    // kept and not taken).
    void trace(bool on);
    // The partitions answered since the last call while tracing (at most kMaxTraced; then empty again), and how many
    // past that bound were dropped.
    std::pair<std::vector<Traced>, uint64_t> take_traced();
    static constexpr size_t kMaxTraced = size_t(1) << 18;

   private:
    struct InFlight {  // a part the loop holds: queued or pushed, not answered
        Part part;
        uint64_t call = 0;
        bool credited = false;  // holds credit (given back on its acknowledgement)
        bool acked = false;
        double queued = 0, sent = 0, pushed = 0, result = 0;  // when: submitted, let go, wholly sent, answer began
        uint16_t push_slot = kNoSlot, pull_slot = kNoSlot;     // shared-memory slots in use
        bool holding = false;  // a held key's: its sum is in the output, until EVERYONE
        bool bounced = false;  // its sum came into the link's bounce buffer (the output is the input too)
    };
    struct CallState {
        size_t left = 0;
        std::string error;
    };
    struct Side {  // one link's state on the loop
        flow::Flow flow;
        std::unique_ptr<Link> link;
        std::optional<int64_t> waiting;  // let go by the flow, short of credit or waiting for its pacing turn
        std::optional<double> turn_since;  // since when `waiting` has waited for its pacing turn
        std::vector<uint8_t> body;       // an ACKS or ERROR frame's body
        uint64_t owed = 0;               // parts queued or pushed and not answered
        std::string broken;              // why the link failed ("" while it works)
        Arena arena;                     // its shared memory (base nullptr: none)
        std::vector<uint16_t> free_push, free_pull;
        // failover: its server closed it; its parts wait in `orphans` until `reroute` (then `owners` redirects any
        // later part) or `replace`
        uint32_t epoch = 0;  // the worker's epoch when the link was made (the server checks every frame's)
        bool lost = false;
        std::vector<int64_t> orphans;
        std::optional<std::unordered_map<uint64_t, size_t>> owners;
        // held keys: the (key, round)s whose sums came in, to say so (RECEIVED) ahead of the next pushes, and the
        // frame's body while it is sent; a buffer for a sum whose output is its input too; and, once its server is
        // lost, the parts it held, until the failover is over (`finish_held`)
        std::vector<std::pair<uint64_t, uint32_t>> receipts;
        std::vector<uint8_t> receipts_body, bounce;
        std::vector<int64_t> held_lost;
        int64_t fitting(int64_t window) const {  // a window within its push slots (one per window place)
            return arena.base ? std::min<int64_t>(window, arena.push) : window;
        }
        bool network() const { return !arena.base; }  // its bytes cross a socket (the drift check counts them)
        uint8_t* push_slot(uint16_t i) const { return arena.base + uint64_t(i) * arena.slot_bytes; }
        uint8_t* pull_slot(uint16_t i) const { return arena.base + (uint64_t(arena.push) + i) * arena.slot_bytes; }
    };
    struct Receiver;
    static constexpr uint64_t kNotAPart = UINT64_MAX;  // a queued frame's tag that is no part's (RECEIVED)
    struct Seed {  // a key's last answered round, kept for a failover
        std::vector<uint8_t> data;
        const uint8_t* held = nullptr;  // a held key's: the sum lies in this output instead, `held_bytes` long
        uint64_t held_bytes = 0;
        int64_t round = -1;
        uint8_t dtype = 0;
        bool contribution = false;  // `data` is what this worker pushed (a sliced round), not the round's sum
    };

    void run();
    void take_submissions();
    void pump(size_t s, double now);
    int wait_ms(double now) const;
    uint8_t* destination(size_t s, const Header& h);
    void arrived(size_t s, const Header& h);
    void answer(int64_t slot, const std::string& error);  // a part is done (its sum in, or refused)
    std::vector<int64_t> take_parts(size_t s, const std::string& why);  // the link is broken: its parts off it
    void fail_link(size_t s, const std::string& why);     // every part on it fails; the link is out
    void lose_link(size_t s, const std::string& why, bool report);  // (failover) its parts wait as orphans
    void closed(size_t s, const std::string& why);  // its server closed it: lost (failover) or failed
    void place(uint64_t call, Part part, double now);  // a part submitted: on its link's queue (or answered)
    void landed(const InFlight& held, bool shared);   // its answer is in: the key's seed kept (failover)
    void hold(size_t s, int64_t slot);                // a held key's sum is in its output: held until EVERYONE
    void release(int64_t slot);                        // a held part is done holding: its seed goes
    std::vector<int64_t> held_on(size_t s) const;      // the parts holding sums link s answered
    void requeue(int64_t slot, size_t s);                 // a part (again) on link s's queue
    void set_arena(Side& side, const Arena& arena);
    template <typename F>
    auto on_loop(F&& task);  // run `task` on the loop thread and return its result
    void finish(uint64_t call, const std::string& error);
    bool credit_for(size_t s, const Part& p, double now);  // credit and the pacing turn for a push on link s
    void acked(size_t s, InFlight& held);                    // the server has it: its push slot is free
    Counts with_use(double now) const;  // counts_ with the links' use as of `now`
    void record(const InFlight& held, double done);  // an answered part's stages into the histogram
    InFlight& part_of(size_t s, uint64_t key, const char* what);
    std::string server(size_t s) const { return "server " + std::to_string(s); }

    Settings settings_;
    std::vector<Side> sides_;
    flow::Credit credit_;
    int wake_fd_;  // an eventfd: submissions and stop wake the loop (before poll_, which watches it)
    Poll poll_;

    // the loop thread's
    std::vector<InFlight> parts_;
    std::vector<int64_t> free_slots_;
    std::unordered_map<uint64_t, int64_t> by_key_;  // key -> slot, while in flight
    std::unordered_map<uint64_t, CallState> calls_;
    std::vector<int64_t> freed_;
    std::unordered_map<uint64_t, Seed> seeds_;  // failover: each key's seed
    std::map<std::pair<uint64_t, uint32_t>, int64_t> held_;  // held keys: (key, round) -> the part holding its sum
    uint64_t seeding_calls_ = UINT64_MAX;       // the calls of seeds pushed (push_seed), numbered down
    bool ended_ = false;                        // the thread has left its loop
    Counts counts_;

    // shared with callers, under mutex_
    mutable std::mutex mutex_;
    std::condition_variable done_;
    std::vector<std::pair<uint64_t, std::vector<Part>>> inbox_;
    std::vector<std::pair<uint64_t, std::string>> outbox_;
    std::optional<std::tuple<int64_t, int64_t, int64_t>> limits_;
    Tasks tasks_;  // on_loop's
    std::mutex stopping_lock_;  // `stop`'s: several threads may call it at once
    std::string stopping_;  // "" while it runs
    bool stopped_ = false;
    Counts shared_counts_;
    Stages stages_;  // under mutex_
    std::atomic<bool> tracing_{false};
    std::vector<Traced> traced_;  // under mutex_
    uint64_t untraced_ = 0;       // under mutex_: dropped past kMaxTraced

    std::thread thread_;
};

}  // namespace gradwire::worker
