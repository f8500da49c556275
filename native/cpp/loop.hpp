// The native worker as a loop of its own: a thread that owns a worker's links (after Python's connect and handshake)
// and moves every call's partitions by the worker's rule, while callers submit more (the boundary of docs/native.md:
// a call submits its plan and waits on a completion); calls overlap, as a training step's tensors do. worker.hpp's
// push_pull is one call on it, waited for on the caller's thread.
//
// Thread-safety: `submit`, `completions`, `set_limits` and `stop` may be called from any thread; everything else is
// the loop thread's. A call's buffers must stay valid until its completion is taken.
#pragma once

#include <sys/eventfd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
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

    Counts counts() const;
    // The stage histogram of the partitions answered since the last call (then empty again).
    Stages take_stages();

   private:
    struct InFlight {  // a part the loop holds: queued or pushed, not answered
        Part part;
        uint64_t call = 0;
        bool credited = false;  // holds credit (given back on its acknowledgement)
        bool acked = false;
        double queued = 0, sent = 0, pushed = 0, result = 0;  // when: submitted, let go, wholly sent, answer began
        uint16_t push_slot = kNoSlot, pull_slot = kNoSlot;     // shared-memory slots in use
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
        int64_t fitting(int64_t window) const {  // a window within its push slots (one per window place)
            return arena.base ? std::min<int64_t>(window, arena.push) : window;
        }
        uint8_t* push_slot(uint16_t i) const { return arena.base + uint64_t(i) * arena.slot_bytes; }
        uint8_t* pull_slot(uint16_t i) const { return arena.base + (uint64_t(arena.push) + i) * arena.slot_bytes; }
    };
    struct Receiver;

    void run();
    void take_submissions();
    void pump(size_t s, double now);
    int wait_ms(double now) const;
    uint8_t* destination(size_t s, const Header& h);
    void arrived(size_t s, const Header& h);
    void answer(int64_t slot, const std::string& error);  // a part is done (its sum in, or refused)
    void fail_link(size_t s, const std::string& why);     // every part on it fails; the link is out
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
    Counts counts_;

    // shared with callers, under mutex_
    mutable std::mutex mutex_;
    std::condition_variable done_;
    std::vector<std::pair<uint64_t, std::vector<Part>>> inbox_;
    std::vector<std::pair<uint64_t, std::string>> outbox_;
    std::optional<std::tuple<int64_t, int64_t, int64_t>> limits_;
    std::string stopping_;  // "" while it runs
    bool stopped_ = false;
    Counts shared_counts_;
    Stages stages_;  // under mutex_

    std::thread thread_;
};

}  // namespace gradwire::worker
