#include "worker.hpp"

#include <algorithm>
#include <chrono>

#include "loop.hpp"

namespace gradwire::worker {

// One call on the native worker's loop (loop.hpp), waited for on the caller's thread: the loop is the rule's one home.
Counts push_pull(const std::vector<int>& fds, const Settings& settings, const std::vector<Part>& parts) {
    if (parts.empty()) return {};
    Loop loop(fds, settings);
    loop.submit(1, parts);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(settings.timeout);
    for (;;) {
        const double left = std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count();
        if (left <= 0) {
            loop.stop("the call took too long");
            throw std::runtime_error("worker " + std::to_string(settings.rank) + ": " + std::to_string(parts.size()) +
                                     " partitions not all answered within " + std::to_string(settings.timeout) + " s");
        }
        const auto done = loop.completions(std::min(left, 1.0));
        if (done.empty()) continue;
        loop.stop();
        if (!done.front().second.empty()) throw std::runtime_error(done.front().second);
        return loop.counts();
    }
}

}  // namespace gradwire::worker
