#include "floor.hpp"

#include <sys/epoll.h>
#include <unistd.h>

#include <cerrno>
#include <memory>
#include <stdexcept>
#include <string>
#include <system_error>

#include "link.hpp"
#include "poll.hpp"
#include "sums.hpp"

namespace gradwire::floor {
namespace {

constexpr int kStallMilliseconds = 60000;  // a floor that waits this long for its peers has failed, not slowed

int stalled(int events) {
    if (events == 0) throw std::runtime_error("the floor's peers sent nothing for 60 s");
    return events;
}


void check(const Shape& s) {
    if (s.partition == 0 || s.partition % 4 || s.parts == 0 || s.size % 4 || s.window == 0)
        throw std::invalid_argument("the floor moves whole float32 elements, a partition or more a frame");
}

uint64_t frame_bytes(const Shape& s) { return s.partition * s.parts; }
uint64_t frame_count(const Shape& s) { return (s.size + frame_bytes(s) - 1) / frame_bytes(s); }
uint64_t frame_length(const Shape& s, uint64_t f) { return std::min(frame_bytes(s), s.size - f * frame_bytes(s)); }

// A server's ring slot: one key of one round, from its first contribution until its sum has left for every worker.
struct Slot {
    std::unique_ptr<float[]> acc;
    uint64_t sequence = ~uint64_t(0);  // which (round, key) it holds; ~0 while free
    uint32_t landed = 0;               // contributions whose payload was given a place
    uint32_t summed = 0;               // contributions added in
    uint32_t sending = 0;              // answers queued and not yet wholly sent
    bool first_in = false;             // the contribution that lands in the accumulator has wholly arrived
    std::vector<size_t> waiting;       // links whose scratch arrived before it: added once it has
};

class Server {
   public:
    Server(const std::vector<int>& fds, const Shape& shape, uint64_t index, uint64_t servers)
        : shape_(shape), index_(index), servers_(servers), poll_(fds) {
        check(shape);
        if (servers == 0 || index >= servers) throw std::invalid_argument("a server index outside 0..servers-1");
        const uint64_t count = frame_count(shape);
        mine_ = count / servers + (index < count % servers ? 1 : 0);
        slots_.resize(2 * shape.window);  // keys in flight span one window; their answers may still be leaving
        for (Slot& s : slots_) {
            s.acc.reset(new float[frame_bytes(shape) / 4]);
            s.waiting.reserve(fds.size());  // never grows past one entry a link: nothing allocated per message
        }
        zeros_.assign(shape.partition / 4, 0.0f);
        for (int fd : fds) {
            links_.push_back(std::make_unique<Link>(fd, frame_bytes(shape), slots_.size()));
            sinks_.push_back(Sink{this, links_.size() - 1, std::unique_ptr<float[]>(new float[frame_bytes(shape) / 4])});
        }
        blocked_.assign(fds.size(), false);
        held_.assign(fds.size(), false);
    }

    void run(uint64_t repeats) {
        total_ = mine_ * repeats;
        std::vector<epoll_event> ready(links_.size());
        while (answered_ < total_ || sending()) {
            // no reading past the last key: a worker's next call must stay in the socket for the next `serve`
            for (size_t i = 0; i < links_.size(); ++i) {
                if (answered_ == total_ && links_[i]->queued() == 0)
                    poll_.remove(i);  // done with this worker until the next call
                else
                    poll_.want(i, answered_ < total_ && !blocked_[i], links_[i]->queued() > 0);
            }
            const int n = stalled(poll_.wait(ready.data(), int(ready.size()), kStallMilliseconds));
            for (int e = 0; e < n; ++e) {
                const size_t i = ready[e].data.u64;
                if (ready[e].events & kInput) links_[i]->receive(sinks_[i]);
                flush(i);
            }
        }
    }

   private:
    struct Sink {
        Server* server;
        size_t link;
        std::unique_ptr<float[]> scratch;
        Slot* slot = nullptr;
        bool expecting() const { return server->answered_ < server->total_; }
        uint8_t* destination(const Header& h) { return server->destination(*this, h); }
        void arrived(const Header& h, uint8_t* data) { server->arrived(*this, h, data); }
    };

    uint8_t* destination(Sink& sink, const Header& h) {
        if (h.type != kPushPull || h.dtype != kFloat32 || h.key % servers_ != index_ ||
            h.length != frame_length(shape_, h.key))
            throw ProtocolError("a push this server does not hold (type " + std::to_string(h.type) + ", key " +
                                std::to_string(h.key) + ")");
        if (held_[sink.link]) return nullptr;  // its scratch still holds a contribution (a header read ahead)
        const uint64_t sequence = uint64_t(h.round) * mine_ + h.key / servers_;
        Slot& slot = slots_[sequence % slots_.size()];
        if (slot.sequence != sequence) {
            if (slot.sequence != ~uint64_t(0)) {  // still answering an older key: read this link again later
                blocked_[sink.link] = true;
                return nullptr;
            }
            slot.sequence = sequence;
        }
        sink.slot = &slot;
        // the first contribution lands in the accumulator itself; the rest in the link's scratch, added on arrival
        return reinterpret_cast<uint8_t*>(slot.landed++ == 0 ? slot.acc.get() : sink.scratch.get());
    }

    void arrived(Sink& sink, const Header& h, uint8_t* data) {
        Slot& slot = *sink.slot;
        const bool in_place = reinterpret_cast<float*>(data) == slot.acc.get();  // the key's first contribution
        if (!in_place && !slot.first_in) {
            // the accumulator's own contribution is still arriving: hold this one (and its link's reading) until then
            slot.waiting.push_back(sink.link);
            held_[sink.link] = blocked_[sink.link] = true;
            return;
        }
        if (in_place) {
            slot.first_in = true;
            // the first contribution is in place; a server of one worker adds zeros to it, as the Python floor's
            // does, so that the sum's pass is in the figure
            if (links_.size() == 1) sum(slot, zeros_.data(), 0, h.length);
            ++slot.summed;
            for (size_t link : slot.waiting) {
                sum(slot, sinks_[link].scratch.get(), 1, h.length);
                held_[link] = blocked_[link] = false;
                ++slot.summed;
            }
            slot.waiting.clear();
        } else {
            sum(slot, sink.scratch.get(), 1, h.length);
            ++slot.summed;
        }
        if (slot.summed < links_.size()) return;
        Header reply = h;
        reply.type = kResult;
        reply.sender = uint32_t(index_);
        slot.sending = uint32_t(links_.size());
        const float* acc = slot.acc.get();
        for (auto& link : links_) link->queue(reply, reinterpret_cast<const uint8_t*>(acc), &slot - slots_.data());
        ++answered_;
    }

    // acc += addend, partition by partition as an engine sums each key apart (`step` 0: the same zeros each time)
    void sum(Slot& slot, const float* addend, int step, uint64_t length) {
        for (uint64_t at = 0; at < length; at += shape_.partition) {
            const uint64_t n = std::min(shape_.partition, length - at) / 4;
            add_into(kFloat32, slot.acc.get() + at / 4, addend + step * at / 4, n);
        }
    }

    void flush(size_t i) {
        links_[i]->flush([this](uint64_t tag) {
            Slot& slot = slots_[tag];
            if (--slot.sending) return;
            slot.sequence = ~uint64_t(0);
            slot.landed = slot.summed = 0;
            slot.first_in = false;
            for (size_t link = 0; link < blocked_.size(); ++link)  // a slot is free: every link not held may read
                blocked_[link] = held_[link];
        });
    }

    bool sending() const {
        for (const auto& link : links_)
            if (link->queued()) return true;
        return false;
    }

    Shape shape_;
    uint64_t index_, servers_, mine_ = 0, answered_ = 0, total_ = 0;
    Poll poll_;
    std::vector<Slot> slots_;
    std::vector<float> zeros_;
    std::vector<std::unique_ptr<Link>> links_;
    std::vector<Sink> sinks_;
    std::vector<bool> blocked_;  // a link not read for now: no free slot for its next push, or held
    std::vector<bool> held_;     // a link whose scratch waits for its key's first contribution
};

}  // namespace

void serve(const std::vector<int>& fds, const Shape& shape, uint64_t index, uint64_t servers, uint64_t repeats) {
    if (fds.empty()) throw std::invalid_argument("a server of no workers");
    Server(fds, shape, index, servers).run(repeats);
}

void push_pull(const std::vector<int>& fds, const Shape& shape, const uint8_t* data, uint8_t* out, uint32_t round) {
    check(shape);
    const uint64_t servers = fds.size(), count = frame_count(shape), frame = frame_bytes(shape);
    if (servers == 0) throw std::invalid_argument("a push_pull through no servers");
    std::vector<std::unique_ptr<Link>> links;
    for (int fd : fds) links.push_back(std::make_unique<Link>(fd, frame, shape.window));
    Poll poll(fds);

    struct Sink {
        const Shape& shape;
        uint8_t* out;
        uint64_t server, servers, count;
        uint32_t round;
        uint64_t answered = 0, pushed = 0;
        bool expecting() const { return answered < pushed; }
        uint8_t* destination(const Header& h) {
            if (h.type != kResult || h.key >= count || h.key % servers != server || h.round != round ||
                h.length != frame_length(shape, h.key))
                throw ProtocolError("an answer that matches no frame pushed (type " + std::to_string(h.type) +
                                    ", key " + std::to_string(h.key) + ", round " + std::to_string(h.round) + ")");
            return out + h.key * frame_bytes(shape);  // the sum lands in its place in the output
        }
        void arrived(const Header&, uint8_t*) { ++answered; }
    };
    std::vector<Sink> sinks;
    std::vector<uint64_t> next(servers);  // each server's next frame: server, server + k, ...
    for (uint64_t s = 0; s < servers; ++s) {
        sinks.push_back(Sink{shape, out, s, servers, count, round});
        next[s] = s;
    }
    uint64_t answered = 0;
    const auto sent = [](uint64_t) {};
    std::vector<epoll_event> ready(servers);
    while (answered < count) {
        for (uint64_t s = 0; s < servers; ++s) {
            Link& link = *links[s];
            while (next[s] < count && sinks[s].pushed - sinks[s].answered < shape.window) {
                Header h;
                h.type = kPushPull;
                h.dtype = kFloat32;
                h.key = next[s];
                h.round = round;
                h.length = frame_length(shape, next[s]);
                link.queue(h, data + next[s] * frame, next[s]);
                next[s] += servers;
                ++sinks[s].pushed;
            }
            link.flush(sent);
            // read a server's link only while it owes answers: a server that has answered everything may close it
            if (next[s] >= count && !sinks[s].expecting() && link.queued() == 0)
                poll.remove(s);  // every answer of this server is in
            else
                poll.want(s, sinks[s].expecting(), link.queued() > 0);
        }
        const int n = stalled(poll.wait(ready.data(), int(ready.size()), kStallMilliseconds));
        for (int e = 0; e < n; ++e) {
            const size_t s = ready[e].data.u64;
            const uint64_t before = sinks[s].answered;
            if (ready[e].events & kInput) links[s]->receive(sinks[s]);
            answered += sinks[s].answered - before;
        }
    }
}

}  // namespace gradwire::floor
