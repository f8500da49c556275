#include "worker.hpp"

#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <unordered_map>

#include "flow.hpp"
#include "frames.hpp"
#include "link.hpp"
#include "poll.hpp"

namespace gradwire::worker {
namespace {

double monotonic() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string type_of(uint8_t type) {
    const char* name = type_name(type);
    return *name ? name : std::to_string(type);
}

// One link's side of the call: its flow, the part let go by flow control and waiting for credit, and what the link's
// decoder asks of it (destination, arrived).
struct LinkSide {
    size_t index;
    flow::Flow flow;
    std::optional<int64_t> waiting;  // let go by the flow, short of credit
    std::vector<uint8_t> body;       // an ACKS or ERROR frame's body
    uint64_t owed = 0;               // parts pushed (or queued to be) and not answered
    bool done = false;               // every answer in and every frame sent: out of the poll
};

class Call {
   public:
    Call(const std::vector<int>& fds, const Settings& settings, const std::vector<Part>& parts)
        : settings_(settings), parts_(parts), credit_(settings.credit > 0 ? settings.credit : INT64_MAX), poll_(fds) {
        for (size_t i = 0; i < fds.size(); ++i) {
            links_.push_back(std::make_unique<Link>(fds[i], settings.max_payload, settings.batch_frames));
            sides_.push_back(LinkSide{i, flow::Flow(settings.window, settings.cap), std::nullopt, {}, 0, false});
        }
        for (size_t id = 0; id < parts.size(); ++id) {
            const Part& p = parts[id];
            if (p.link >= fds.size()) throw std::invalid_argument("a part for a link the call does not have");
            if (!by_key_.emplace(p.key, int64_t(id)).second)
                throw std::invalid_argument("a key twice in one call: " + std::to_string(p.key));
            flow::Part fp;
            fp.id = int64_t(id), fp.key = p.key;
            fp.order.round = p.round, fp.order.tensor = p.tensor, fp.order.index = p.index;
            sides_[p.link].flow.push(std::move(fp), p.priority);
            ++sides_[p.link].owed;
        }
    }

    Counts run() {
        std::vector<epoll_event> ready(links_.size());
        double heard = monotonic();
        while (answered_ < parts_.size()) {
            const double now = monotonic();
            for (LinkSide& side : sides_)
                if (!side.done) pump(side, now);
            const int n = poll_.wait(ready.data(), int(ready.size()), wait_ms(now));
            if (n == 0 && monotonic() - heard > settings_.timeout)
                throw std::runtime_error("worker " + std::to_string(settings_.rank) + ": no server answered for " +
                                         std::to_string(settings_.timeout) + " s with " +
                                         std::to_string(parts_.size() - answered_) + " partitions unanswered");
            if (n > 0) heard = monotonic();
            for (int e = 0; e < n; ++e) {
                const size_t s = ready[e].data.u64;
                if (ready[e].events & kInput) {
                    Receiver receiver{*this, sides_[s]};
                    links_[s]->receive(receiver);
                }
            }
        }
        return counts_;
    }

   private:
    struct Receiver {  // the decoder's sink for one link
        Call& call;
        LinkSide& side;
        bool expecting() const { return side.owed > 0; }
        uint8_t* destination(const Header& h) { return call.destination(side, h); }
        void arrived(const Header& h, uint8_t*) { call.arrived(side, h); }
    };

    // Queue what the flow lets go and credit allows, a batch at a time, and send what the socket takes.
    void pump(LinkSide& side, double now) {
        Link& link = *links_[side.index];
        if (link.queued() == 0) {
            uint64_t bytes = 0, frames = 0;
            while (frames < settings_.batch_frames) {
                std::optional<int64_t> id = side.waiting ? side.waiting : side.flow.next(now);
                side.waiting.reset();
                if (!id) break;
                const Part& p = parts_[size_t(*id)];
                if (frames > 0 && bytes + p.push_bytes > settings_.batch_bytes) {
                    side.waiting = id;  // the head of the next batch
                    break;
                }
                if (!credit_.take(int64_t(p.push_bytes), int64_t(side.index), true, false, now)) {
                    side.waiting = id;  // an acknowledgement gives credit back
                    break;
                }
                Header h;
                h.type = kPushPull;
                h.dtype = p.dtype;
                h.epoch = settings_.epoch;
                h.sender = settings_.rank;
                h.key = p.key;
                h.round = p.round;
                h.length = p.push_bytes;
                link.queue(h, p.send, uint64_t(*id));
                bytes += p.push_bytes;
                ++frames;
            }
            counts_.pushes += frames;
            counts_.batches += frames > 0;
        }
        link.flush([](uint64_t) {});
        if (side.owed == 0 && link.queued() == 0) {
            poll_.remove(side.index);  // every answer of this server is in: it may close the link now
            side.done = true;
        }
        else
            poll_.want(side.index, side.owed > 0, link.queued() > 0);
    }

    int wait_ms(double now) const {
        double until = now + 0.1;  // the timeout's check, at least every 100 ms
        for (const LinkSide& side : sides_)
            if (auto at = side.flow.wake_at()) until = std::min(until, *at);
        return int(std::max(0.0, std::ceil((until - now) * 1000)));
    }

    uint8_t* destination(LinkSide& side, const Header& h) {
        if (h.type == kResult) {
            const Part& p = part_of(side, h.key, "answered");
            if (h.round != p.round || h.length != p.nbytes || h.flags)
                throw ProtocolError(server(side) + " answered " + p.tensor + " round " + std::to_string(h.round) +
                                    " with " + std::to_string(h.length) + " bytes (flags " + std::to_string(h.flags) +
                                    "); expected round " + std::to_string(p.round) + " with " +
                                    std::to_string(p.nbytes));
            static uint8_t nothing;
            return p.nbytes ? p.out : &nothing;
        }
        if (h.type == kAcks || h.type == kError) {
            side.body.resize(std::max<uint64_t>(h.length, 1));
            return side.body.data();
        }
        throw ProtocolError(server(side) + " sent an unexpected " + type_of(h.type));
    }

    void arrived(LinkSide& side, const Header& h) {
        const double now = monotonic();
        if (h.type == kResult) {
            auto taken = side.flow.on_answer(h.key, now);
            if (!taken) throw ProtocolError(server(side) + " answered key " + std::to_string(h.key) + " twice");
            if (taken->second) credit_.release_all({int64_t(parts_[size_t(taken->first)].push_bytes)}, true, true, now);
            --side.owed;
            ++answered_;
        } else if (h.type == kAcks) {
            ++counts_.acks;
            freed_.clear();
            for (uint64_t at = 0; at < h.length; at += kAckEntrySize) {
                uint64_t key;
                uint32_t round;
                std::memcpy(&key, side.body.data() + at, 8);
                std::memcpy(&round, side.body.data() + at + 8, 4);
                const Part& p = part_of(side, key, "acknowledged");
                if (round != p.round)
                    throw ProtocolError(server(side) + " acknowledged round " + std::to_string(round) + " of " +
                                        p.tensor + ", expected " + std::to_string(p.round));
                auto taken = side.flow.on_ack(key);
                if (!taken) throw ProtocolError(server(side) + " acknowledged key " + std::to_string(key) +
                                                ", which is not in flight");
                if (taken->second) freed_.push_back(int64_t(p.push_bytes));
            }
            if (!freed_.empty()) credit_.release_all(freed_, true, true, now);
        } else {  // ERROR: the server refused a tensor, or the job aborts
            const std::string body(reinterpret_cast<const char*>(side.body.data()), h.length);
            auto found = by_key_.find(h.key);
            const std::string what = found == by_key_.end() ? "the job" : parts_[size_t(found->second)].tensor;
            throw Refused("worker " + std::to_string(settings_.rank) + ": " + server(side) + " refused " + what +
                          " (key " + std::to_string(h.key) + "): " + body);
        }
    }

    const Part& part_of(LinkSide& side, uint64_t key, const char* what) {
        auto found = by_key_.find(key);
        if (found == by_key_.end() || parts_[size_t(found->second)].link != side.index)
            throw ProtocolError(server(side) + " " + what + " key " + std::to_string(key) + ", which it was not sent");
        return parts_[size_t(found->second)];
    }

    std::string server(const LinkSide& side) const { return "server " + std::to_string(side.index); }

    const Settings& settings_;
    const std::vector<Part>& parts_;
    flow::Credit credit_;
    Poll poll_;
    std::vector<std::unique_ptr<Link>> links_;
    std::vector<LinkSide> sides_;
    std::unordered_map<uint64_t, int64_t> by_key_;
    std::vector<int64_t> freed_;
    size_t answered_ = 0;
    Counts counts_;
};

}  // namespace

Counts push_pull(const std::vector<int>& fds, const Settings& settings, const std::vector<Part>& parts) {
    if (parts.empty()) return {};
    return Call(fds, settings, parts).run();
}

}  // namespace gradwire::worker
