// A worker's push_pull in native code, over links a Python worker connected and authenticated (the boundary: Python
// keeps connect, handshake and declaration; native code moves the bytes). The whole per-partition rule is
// worker/pushes.py's and worker/answers.py's: flow control per link and credit over all of them (flow.hpp), several
// pushes to one sendmsg (batches of at most `batch_bytes` and `batch_frames`, as SEND_BATCH_BYTES and
// SEND_BATCH_FRAMES), an ACKS frame's acknowledgements freeing window places and credit, each RESULT received
// straight into its partition's output (link.hpp's Decoder). The real servers answer it: the protocol is the job's.
// The rule runs on loop.hpp's Loop (a thread owning the links); `push_pull` here is one call on it, waited for.
//
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace gradwire::worker {

struct Part {
    uint64_t key = 0;
    uint32_t round = 0;
    uint8_t dtype = 0;
    size_t link = 0;  // which of the call's links: its server's index (errors name it as the server)
    int64_t priority = 0;
    std::string tensor;  // the job-wide order's (round, -priority, tensor, index)
    int64_t index = 0;
    const uint8_t* send = nullptr;
    uint64_t push_bytes = 0;        // the frame's payload: `send`, then the trailer
    const uint8_t* extra = nullptr;  // a trailer after the data (a server-side update's), `extra_bytes` long
    uint64_t extra_bytes = 0;
    uint8_t* out = nullptr;
    uint64_t nbytes = 0;
    // server failover (docs/faults.md; loop.hpp keeps each key's seed): the answer is received into the key's seed
    // and copied out (`keep_sum`), or, in a sliced round, what this worker pushed is kept as its seed once answered
    // (`keep_contribution`)
    bool keep_sum = false, keep_contribution = false;
    // a held key's (worker/holding.py): pushed flagged HELD, its sum received into the output (through a buffer where
    // the output is the input too) and held there, the part unanswered, until the server says every worker has it
    // (EVERYONE); meanwhile the output is the key's seed
    bool held = false;
    // a seed pushed to a dead server's successor (flags SEED or REPLAY): its own bytes, sent past the window and the
    // credit, never answered; it is done once sent (or once its link is lost)
    bool seed = false;
    uint8_t flags = 0;
    std::vector<uint8_t> own;
};

// A link's shared-memory slots (transport/shm.py's Arena, mapped by Python): `push` slots, then `pull` slots, each
// `slot_bytes` long. A push is copied into a free push slot, which the server sums from until it acknowledges it; a
// sum is copied out of the pull slot the push offered (none free: it comes over the socket).
struct Arena {
    uint8_t* base = nullptr;  // nullptr: the link is a socket only
    uint32_t push = 0, pull = 0;
    uint64_t slot_bytes = 0;
};

constexpr uint16_t kNoSlot = 0xFFFF;

struct Settings {
    uint32_t rank = 0, epoch = 0;
    int64_t window = 4, cap = 0, credit = 0;  // credit: bytes in flight over all links (0: no limit)
    // pacing (worker/credit.py): each link's share of the bytes (0: not paced) and the lead a link may have over the
    // most behind one, in bytes (0: no pacing); a paced push waits at most `pace_give_up` seconds for its turn
    std::vector<double> shares;
    int64_t lead = 0;
    double pace_give_up = 0.2;
    // the stage histogram's bucket bounds in seconds (admin/metrics.py's BUCKETS; none: no histogram)
    std::vector<double> buckets;
    std::vector<Arena> arenas;  // by link (none, or fewer: sockets only)
    uint64_t max_payload = 0;
    uint64_t batch_bytes = 256 << 10, batch_frames = 64;
    double timeout = 60;  // seconds a blocking call (push_pull) may take
    // server failover: a link whose server closes it keeps its parts (and takes later ones) until the worker moves
    // them (loop.hpp's `reroute`, `replace`); the loss comes back as a completion of call 0, "server S: why"
    bool failover = false;
};

// Each answered partition's four stages (queued, push, wait, pull: admin/metrics.py's STAGES), as a histogram over
// Settings::buckets, since the last time they were taken: per stage, partitions per bucket (and past the last), and
// the seconds in all.
struct Stages {
    std::vector<std::vector<uint64_t>> counts;
    std::vector<double> seconds;
};

// One answered partition's four stages for the timeline (Loop::trace): queued (submitted until let go), push (until
// wholly sent), wait (until its answer began), pull (until it was all in); seconds of CLOCK_MONOTONIC, Python's
// time.monotonic(). `link`: the side its server's link is; `credit_used`: the bytes in flight as it was answered.
struct Traced {
    std::string tensor;
    uint64_t key = 0;
    uint32_t round = 0;
    uint64_t nbytes = 0;
    size_t link = 0;
    double queued = 0, sent = 0, pushed = 0, result = 0, done = 0;
    int64_t credit_used = 0;
};

// What one call did: for the caller's metrics and the benchmarks.
struct Counts {
    uint64_t pushes = 0, batches = 0, acks = 0;  // frames pushed, the batches they went in, ACKS frames received
    // the links' use, for the scheduler's drift check (worker/credit.py's busy, worker/flow.py's full_seconds): seconds
    // some push was unacknowledged, bytes acknowledged, and seconds work waited on a full window (all links' sum)
    double busy_seconds = 0, full_seconds = 0;
    int64_t busy_bytes = 0;
    int64_t cap_escapes = 0;  // pushes the liveness rule let past a full cap (worker/flow.py's), all links
    int64_t credit_used = 0;  // bytes pushed and not yet acknowledged, all links
};

// Push every part over `fds` (fds[p.link]) by the rule, each sum into its output; returns once every sum is in (one
// call on loop.hpp's Loop, waited for here). Throws std::runtime_error with what failed the call: a server's refusal
// (naming the worker, the server, the tensor and the key), a link's end or protocol error, or `timeout` passing.
Counts push_pull(const std::vector<int>& fds, const Settings& settings, const std::vector<Part>& parts);

}  // namespace gradwire::worker
