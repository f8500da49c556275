// The native floor: benchmarks/floor.py's workers and summation servers, in C++ on one thread each.
//
// The shape of the Python floor's one-thread and batched workers (frames of one partition, or of several up to
// 256 KiB; a window of frames in flight per server), with gradwire's own 40-byte header validated on every frame, an
// epoll loop over non-blocking sockets, several frames a sendmsg, answers received straight into the output, pushes
// into a slot of the server's ring (the first of a key's contributions into its accumulator, the rest into the link's
// scratch, added there by the server's kernel, sums.hpp), and each sum answered from its accumulator to every worker.
// No flow control beyond the window, no metrics, no failover: what a native data path can reach on a machine.
//
// A job of n workers and k servers: frame f of a call goes to server f % k, which answers it once all n workers have
// pushed it. Every connection is one socket, connected before these run.
#pragma once

#include <cstdint>
#include <vector>

namespace gradwire::floor {

struct Shape {
    uint64_t size;       // bytes a call moves (whole float32 elements)
    uint64_t partition;  // bytes a partition holds
    uint64_t parts;      // partitions a frame carries at most
    uint64_t window;     // frames a worker has unanswered on each server at most
};

// Server `index` of `servers`: answer `repeats` calls from the workers on `fds` (one socket each).
// Blocks; throws on a closed link, a protocol error, or 60 s without progress.
void serve(const std::vector<int>& fds, const Shape& shape, uint64_t index, uint64_t servers, uint64_t repeats);

// One push_pull of `data` into `out` (shape.size bytes each) through the servers on `fds` (fds[i] is server i).
// `round` numbers the call (checked on each answer). Blocks; throws as `serve` does.
void push_pull(const std::vector<int>& fds, const Shape& shape, const uint8_t* data, uint8_t* out, uint32_t round);

}  // namespace gradwire::floor
