#include "flow.hpp"

#include <algorithm>

namespace gradwire::flow {

int64_t Flow::store(Part part) {
    if (free_.empty()) {
        parts_.push_back(std::move(part));
        return int64_t(parts_.size()) - 1;
    }
    const int64_t slot = free_.back();
    free_.pop_back();
    parts_[size_t(slot)] = std::move(part);
    return slot;
}

Part Flow::release(int64_t slot) {
    free_.push_back(slot);
    return std::move(parts_[size_t(slot)]);
}

void Flow::push(Part part, int64_t priority) {
    part.order.neg_priority = -priority;  // the job-wide order's (round, -priority, tensor, index)
    queue_.emplace(-priority, arrivals_++, store(std::move(part)));
}

std::optional<int64_t> Flow::next(double now) {
    end_full(now);
    if (queue_.empty()) {
        end_capped(now);
        return std::nullopt;
    }
    const Part& top = parts_[size_t(std::get<2>(*queue_.begin()))];
    if (!(top.seed || in_flight_ < window_)) {
        end_capped(now);  // the window holds it now, not the cap
        full_since_ = now;
        return std::nullopt;
    }
    std::optional<int64_t> slot = allowed();
    if (!slot) {
        if (!capped_since_) capped_since_ = now;
        if (now - std::max(*capped_since_, last_answer) <= liveness_) return std::nullopt;
        ++cap_escapes;
        slot = std::get<2>(*queue_.begin());
        queue_.erase(queue_.begin());
    }
    end_capped(now);
    Part& part = parts_[size_t(*slot)];
    const int64_t id = part.id;
    if (part.seed) {
        release(*slot);
        return id;
    }
    ++in_flight_;
    auto found = pending_.find(part.key);
    if (found == pending_.end()) {
        pending_.emplace(part.key, Pending{taken_++, *slot});
    } else {  // a key taken again: its place in the taking order stays, as a Python dict's does
        release(found->second.slot);
        found->second.slot = *slot;
    }
    return id;
}

std::optional<int64_t> Flow::allowed() {
    const int64_t top = std::get<2>(*queue_.begin());
    if (parts_[size_t(top)].seed || cap_ == 0 || int64_t(pending_.size()) < cap_) {
        queue_.erase(queue_.begin());
        return top;
    }
    const Order* latest = nullptr;
    for (const auto& [key, pending] : pending_) {
        const Order& order = parts_[size_t(pending.slot)].order;
        if (latest == nullptr || *latest < order) latest = &order;
    }
    for (auto it = queue_.begin(); it != queue_.end(); ++it) {  // the queue's order: the first that may go is best
        const int64_t slot = std::get<2>(*it);
        if (parts_[size_t(slot)].order < *latest) {
            queue_.erase(it);
            ++capped_sends;
            return slot;
        }
    }
    return std::nullopt;
}

std::optional<double> Flow::wake_at() const {
    if (!capped_since_) return std::nullopt;
    return std::max(*capped_since_, last_answer) + liveness_;
}

bool Flow::acked(Part& part) {
    if (part.acked) return false;
    part.acked = true;
    --in_flight_;
    return true;
}

std::optional<std::pair<int64_t, bool>> Flow::on_ack(uint64_t key) {
    auto found = pending_.find(key);
    if (found == pending_.end()) return std::nullopt;
    Part& part = parts_[size_t(found->second.slot)];
    return std::make_pair(part.id, acked(part));
}

std::optional<std::pair<int64_t, bool>> Flow::on_answer(uint64_t key, double now) {
    auto found = pending_.find(key);
    if (found == pending_.end()) return std::nullopt;
    const int64_t slot = found->second.slot;
    pending_.erase(found);
    last_answer = now;
    const bool newly = acked(parts_[size_t(slot)]);
    return std::make_pair(release(slot).id, newly);
}

std::vector<int64_t> Flow::take_queued() {
    std::vector<int64_t> ids;
    ids.reserve(queue_.size());
    for (const Entry& entry : queue_) ids.push_back(release(std::get<2>(entry)).id);
    queue_.clear();
    return ids;
}

std::vector<int64_t> Flow::take_all() {
    std::vector<std::pair<int64_t, int64_t>> taken;  // (taken, slot)
    taken.reserve(pending_.size());
    for (const auto& [key, pending] : pending_) taken.emplace_back(pending.taken, pending.slot);
    std::sort(taken.begin(), taken.end());
    std::vector<int64_t> ids;
    for (const auto& [when, slot] : taken) ids.push_back(release(slot).id);
    pending_.clear();
    in_flight_ = 0;
    for (int64_t id : take_queued()) ids.push_back(id);
    return ids;
}

void Flow::end_full(double now) {
    if (full_since_) {
        full_seconds += now - *full_since_;
        full_since_.reset();
    }
}

void Flow::end_capped(double now) {
    if (capped_since_) {
        capped_seconds += now - *capped_since_;
        capped_since_.reset();
    }
}

void Credit::pace(int64_t server, double share) {
    if (lead <= 0 || share <= 0) return;
    shares_[server] = share;
    queued_.emplace(server, 0);
}

void Credit::unpace(int64_t server) {
    shares_.erase(server);
    queued_.erase(server);
}

void Credit::queue(int64_t server, int64_t n) {
    if (shares_.count(server) == 0) return;
    auto found = queued_.find(server);
    if (found != queued_.end()) found->second += n;
}

bool Credit::may_send(int64_t server) const {
    auto share = shares_.find(server);
    if (share == shares_.end()) return true;
    // its bytes still to send over its share, within `lead` of the most behind link's (worker/credit.py)
    const double mine = double(queued_.at(server)) / share->second + double(lead);
    for (const auto& [other, theirs] : shares_)
        if (double(queued_.at(other)) / theirs > mine) return false;
    return true;
}

bool Credit::take(int64_t n, int64_t server, bool network, bool paced, double now) {
    if (paced && !may_send(server)) return false;
    if (!(used == 0 || used + n <= limit)) return false;
    used += n;
    if (network) {
        if (net_used_ == 0) busy_since_ = now;
        net_used_ += std::max<int64_t>(n, 1);  // a push of 0 bytes counts 1
    }
    auto found = queued_.find(server);
    if (found != queued_.end()) found->second = std::max<int64_t>(0, found->second - n);
    return true;
}

void Credit::release_all(const std::vector<int64_t>& sizes, bool network, bool acked, double now) {
    int64_t total = 0, empty = 0;
    for (int64_t n : sizes) total += n, empty += n == 0;
    used -= total;
    if (network) {
        net_used_ -= total + empty;
        if (acked) busy_bytes += total;
        if (net_used_ == 0) busy_seconds += now - busy_since_;
    }
}

std::pair<double, int64_t> Credit::busy(double now) const {
    return {busy_seconds + (net_used_ ? now - busy_since_ : 0.0), busy_bytes};
}

}  // namespace gradwire::flow
