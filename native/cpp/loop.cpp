#include "loop.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <set>
#include <system_error>
#include <tuple>

namespace gradwire::worker {
namespace {

// Each (key, round) entry of an ACKS, RECEIVED or EVERYONE body (`length` a multiple of kAckEntrySize: the decoder
// checked it), to `f`.
template <typename F>
void for_each_entry(const uint8_t* body, uint64_t length, F&& f) {
    for (uint64_t at = 0; at < length; at += kAckEntrySize) {
        uint64_t key;
        uint32_t round;
        std::memcpy(&key, body + at, 8);
        std::memcpy(&round, body + at + 8, 4);
        f(key, round);
    }
}

// `entries` as such a body, into `body`.
void encode_entries(const std::vector<std::pair<uint64_t, uint32_t>>& entries, std::vector<uint8_t>& body) {
    body.resize(entries.size() * kAckEntrySize);
    uint8_t* at = body.data();
    for (const auto& [key, round] : entries) {
        std::memcpy(at, &key, 8);
        std::memcpy(at + 8, &round, 4);
        at += kAckEntrySize;
    }
}

std::vector<int> with(std::vector<int> fds, int extra) {
    fds.push_back(extra);
    return fds;
}

}  // namespace

struct Loop::Receiver {  // the decoder's sink for one link
    Loop& loop;
    size_t s;
    bool expecting() const { return loop.sides_[s].owed > 0 && loop.sides_[s].broken.empty(); }
    uint8_t* destination(const Header& h) { return loop.destination(s, h); }
    void arrived(const Header& h, uint8_t*) { loop.arrived(s, h); }
};

Loop::Loop(const std::vector<int>& fds, const Settings& settings)
    : settings_(settings),
      credit_(settings.credit > 0 ? settings.credit : INT64_MAX, settings.lead),
      wake_fd_(make_eventfd()),
      poll_(with(fds, wake_fd_)) {
    for (size_t s = 0; s < fds.size(); ++s) {
        Side side{flow::Flow(settings.window, settings.cap)};
        side.epoch = settings.epoch;
        if (s < settings.arenas.size()) set_arena(side, settings.arenas[s]);
        side.link = std::make_unique<Link>(fds[s], settings.max_payload, settings.batch_frames + 1);
        sides_.push_back(std::move(side));
        if (s < settings.shares.size()) credit_.pace(int64_t(s), settings.shares[s]);
    }
    thread_ = std::thread([this] { run(); });
}

void Loop::set_arena(Side& side, const Arena& arena) {
    side.arena = arena;
    side.free_push.clear(), side.free_pull.clear();
    if (!arena.base) return;
    for (uint32_t i = arena.push; i-- > 0;) side.free_push.push_back(uint16_t(i));
    for (uint32_t i = arena.pull; i-- > 0;) side.free_pull.push_back(uint16_t(i));
    side.flow.set_limits(side.fitting(settings_.window), side.flow.cap());
}

Loop::~Loop() {
    stop();
    ::close(wake_fd_);
}

void Loop::submit(uint64_t call, std::vector<Part> parts) {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!stopping_.empty()) {
            outbox_.emplace_back(call, stopping_);
            done_.notify_all();
            return;
        }
        inbox_.emplace_back(call, std::move(parts));
    }
    const uint64_t one = 1;
    (void)!::write(wake_fd_, &one, sizeof one);
}

std::vector<std::pair<uint64_t, std::string>> Loop::completions(double timeout) {
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait_for(lock, std::chrono::duration<double>(timeout), [this] { return !outbox_.empty() || stopped_; });
    std::vector<std::pair<uint64_t, std::string>> out;
    out.swap(outbox_);
    return out;
}

void Loop::set_limits(int64_t window, int64_t cap, int64_t lead) {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        limits_ = std::make_tuple(window, cap, lead);
    }
    const uint64_t one = 1;
    (void)!::write(wake_fd_, &one, sizeof one);
}

void Loop::stop(const std::string& why) {
    std::lock_guard<std::mutex> alone(stopping_lock_);  // one caller joins the thread; others wait for it
    {
        std::lock_guard<std::mutex> lock(mutex_);
        if (stopping_.empty()) stopping_ = why.empty() ? "stopped" : why;
    }
    const uint64_t one = 1;
    (void)!::write(wake_fd_, &one, sizeof one);
    if (thread_.joinable()) thread_.join();
    // the sockets as they were, now, while they are still the caller's to close: a Link destroyed later would set
    // the flags of whatever socket has the same number by then
    for (Side& side : sides_) side.link.reset();
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stopped_ = true;
        done_.notify_all();
    }
    tasks_.end();  // asked for as it stopped: they run here, on what the loop left
}

template <typename F>
auto Loop::on_loop(F&& task) {
    return tasks_.run(std::forward<F>(task), [this] {
        const uint64_t one = 1;
        (void)!::write(wake_fd_, &one, sizeof one);
    });
}

void Loop::finish_held(size_t s) {
    on_loop([&] {
        if (s >= sides_.size()) return;
        std::vector<int64_t> held;
        held.swap(sides_[s].held_lost);
        for (int64_t slot : held) {
            release(slot);
            answer(slot, "");
        }
    });
}

std::vector<std::tuple<uint64_t, int64_t, bool>> Loop::seeds(const std::vector<uint64_t>& keys) {
    return on_loop([&] {
        std::vector<std::tuple<uint64_t, int64_t, bool>> found;
        for (uint64_t key : keys) {
            auto seed = seeds_.find(key);
            if (seed != seeds_.end() && seed->second.round >= 0)
                found.emplace_back(key, seed->second.round, seed->second.contribution);
        }
        return found;
    });
}

std::vector<std::pair<uint64_t, uint32_t>> Loop::unanswered(const std::vector<uint64_t>& keys) {
    return on_loop([&] {
        std::vector<std::pair<uint64_t, uint32_t>> found;
        for (uint64_t key : keys) {
            auto slot = by_key_.find(key);
            if (slot != by_key_.end()) found.emplace_back(key, parts_[size_t(slot->second)].part.round);
        }
        return found;
    });
}

std::vector<std::pair<uint64_t, uint32_t>> Loop::orphans(size_t s) {
    return on_loop([&] {
        std::vector<std::pair<uint64_t, uint32_t>> found;
        if (s >= sides_.size()) return found;
        if (!sides_[s].lost && sides_[s].broken.empty())  // the scheduler saw the death first
            lose_link(s, server(s) + " was declared lost by the scheduler", false);
        for (int64_t slot : sides_[s].orphans) found.emplace_back(parts_[size_t(slot)].part.key, parts_[size_t(slot)].part.round);
        return found;
    });
}

void Loop::reroute(size_t s, std::unordered_map<uint64_t, size_t> owners) {
    on_loop([&] {
        if (s >= sides_.size()) return;
        Side& side = sides_[s];
        std::vector<int64_t> orphans;
        orphans.swap(side.orphans);
        for (int64_t slot : orphans) {
            auto owner = owners.find(parts_[size_t(slot)].part.key);
            if (owner == owners.end() || owner->second >= sides_.size()) {
                answer(slot, server(s) + "'s key " + std::to_string(parts_[size_t(slot)].part.key) +
                                 " has no new server");
                continue;
            }
            --side.owed, ++sides_[owner->second].owed;
            requeue(slot, owner->second);
        }
        if (side.lost) side.owners = std::move(owners);  // parts submitted to it from now on go where their key went
    });
}

void Loop::replace(size_t s, int fd, Arena arena, uint32_t epoch) {
    on_loop([&] {
        if (ended_ || s >= sides_.size() || !sides_[s].lost) throw std::logic_error("no lost link to replace");
        Side& side = sides_[s];
        side.link = std::make_unique<Link>(fd, settings_.max_payload, settings_.batch_frames + 1);
        set_arena(side, arena);
        side.lost = false, side.broken.clear(), side.owners.reset();
        side.epoch = epoch;
        poll_.replace(s, fd);
        if (s < settings_.shares.size()) credit_.pace(int64_t(s), settings_.shares[s]);
    });
}

std::pair<std::vector<size_t>, std::vector<size_t>> Loop::where(const std::string& tensor) {
    return on_loop([&] {
        std::set<size_t> out, held;
        for (const InFlight& part : parts_) {
            if (part.call == 0 || part.part.tensor != tensor) continue;  // a free slot, or another tensor's
            (part.holding ? held : out).insert(part.part.link);
        }
        for (const Side& side : sides_)
            for (int64_t slot : side.held_lost) held.insert(parts_[size_t(slot)].part.link);
        return std::make_pair(std::vector<size_t>(out.begin(), out.end()), std::vector<size_t>(held.begin(), held.end()));
    });
}

uint64_t Loop::seed_bytes() {
    return on_loop([&] {
        uint64_t bytes = 0;
        for (const auto& [key, seed] : seeds_) bytes += seed.data.size();
        return bytes;
    });
}

bool Loop::push_seed(uint64_t key, uint32_t round, size_t s, uint8_t flags) {
    return on_loop([&] {
        auto found = seeds_.find(key);
        if (ended_ || found == seeds_.end() || found->second.round != int64_t(round) || s >= sides_.size()) return false;
        const Seed& seed = found->second;
        Part part;
        part.key = key, part.round = round, part.dtype = seed.dtype, part.link = s;
        part.priority = int64_t(1) << 62;  // ahead of everything (worker/failover.py's SEED_PRIORITY)
        part.seed = true, part.flags = uint8_t(flags | (seed.contribution ? kReplay : kSeed));
        // its own copy: the key's next answer may land in the seed (or a held output be handed back) before it is sent
        part.own = seed.held ? std::vector<uint8_t>(seed.held, seed.held + seed.held_bytes) : seed.data;
        part.send = part.own.data(), part.push_bytes = part.own.size();
        const uint64_t call = seeding_calls_--;  // completions nobody waits for
        calls_[call] = CallState{1, ""};
        place(call, std::move(part), monotonic());
        return true;
    });
}

Counts Loop::counts() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return shared_counts_;
}

void Loop::run() {
    std::vector<epoll_event> ready(sides_.size() + 1);
    std::string why;
    try {
        for (;;) {
            {
                std::lock_guard<std::mutex> lock(mutex_);
                if (!stopping_.empty()) {
                    why = stopping_;
                    break;
                }
                if (limits_) {
                    const auto [window, cap, lead] = *limits_;
                    for (Side& side : sides_) side.flow.set_limits(side.fitting(window), cap);
                    credit_.set_lead(lead);
                    limits_.reset();
                }
                shared_counts_ = with_use(monotonic());
            }
            tasks_.run_pending();
            take_submissions();
            const double now = monotonic();
            for (size_t s = 0; s < sides_.size(); ++s)
                if (sides_[s].broken.empty()) pump(s, now);
            const int n = poll_.wait(ready.data(), int(ready.size()), wait_ms(now));
            for (int e = 0; e < n; ++e) {
                const size_t s = ready[e].data.u64;
                if (s == sides_.size()) {
                    uint64_t drained;
                    (void)!::read(wake_fd_, &drained, sizeof drained);
                    continue;
                }
                if (!(ready[e].events & kInput) || !sides_[s].broken.empty()) continue;
                try {
                    Receiver receiver{*this, s};
                    sides_[s].link->receive(receiver);
                } catch (const ProtocolError& error) {
                    fail_link(s, server(s) + ": protocol error: " + error.what());
                } catch (const LinkClosed& error) {
                    closed(s, server(s) + ": " + error.what());
                }
            }
        }
    } catch (const std::exception& error) {  // a bug: every call fails with it, none waits forever
        why = std::string("the native worker failed: ") + error.what();
    }
    try {  // nothing may escape the thread (that would end the process)
        for (size_t s = 0; s < sides_.size(); ++s) {
            if (sides_[s].broken.empty()) fail_link(s, why);
            std::vector<int64_t> orphans;
            orphans.swap(sides_[s].orphans);
            const std::vector<int64_t>& held = sides_[s].held_lost;  // (their sums need no failover any more)
            orphans.insert(orphans.end(), held.begin(), held.end());
            sides_[s].held_lost.clear();
            for (int64_t slot : orphans) answer(slot, why);
            sides_[s].lost = false;  // nothing waits for its server any more
        }
        ended_ = true;
        take_submissions();  // submitted as it stopped: they fail too (their links are out)
    } catch (const std::exception&) {
        ended_ = true;  // a bug: every call still open fails below all the same
    }
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [call, state] : calls_) outbox_.emplace_back(call, state.error.empty() ? why : state.error);
    calls_.clear();
    shared_counts_ = with_use(monotonic());
}

void Loop::record(const InFlight& held, double done) {
    const std::vector<double>& bounds = settings_.buckets;
    const bool tracing = tracing_.load(std::memory_order_relaxed);
    if (bounds.empty() && !tracing) return;
    const double pushed = held.pushed ? held.pushed : held.result;  // an answer before the socket took it all
    const double stages[4] = {held.sent - held.queued, pushed - held.sent, held.result - pushed, done - held.result};
    std::lock_guard<std::mutex> lock(mutex_);
    if (tracing && traced_.size() < kMaxTraced) {
        const Part& p = held.part;
        traced_.push_back(
            {p.tensor, p.key, p.round, p.nbytes, p.link, held.queued, held.sent, pushed, held.result, done, credit_.used});
    } else if (tracing) {
        ++untraced_;
    }
    if (bounds.empty()) return;
    if (stages_.counts.empty()) {
        stages_.counts.assign(4, std::vector<uint64_t>(bounds.size() + 1, 0));
        stages_.seconds.assign(4, 0.0);
    }
    for (size_t i = 0; i < 4; ++i) {  // as bisect_left: the first bound not below the value
        const double value = std::max(0.0, stages[i]);
        ++stages_.counts[i][size_t(std::lower_bound(bounds.begin(), bounds.end(), value) - bounds.begin())];
        stages_.seconds[i] += value;
    }
}

Stages Loop::take_stages() {
    std::lock_guard<std::mutex> lock(mutex_);
    Stages taken;
    std::swap(taken, stages_);
    return taken;
}

void Loop::trace(bool on) {
    tracing_.store(on, std::memory_order_relaxed);
    if (on) return;
    std::lock_guard<std::mutex> lock(mutex_);  // no timeline takes them any more
    traced_.clear();
    untraced_ = 0;
}

std::pair<std::vector<Traced>, uint64_t> Loop::take_traced() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::pair<std::vector<Traced>, uint64_t> taken{std::move(traced_), untraced_};
    traced_.clear();
    untraced_ = 0;
    return taken;
}

Counts Loop::with_use(double now) const {
    Counts counts = counts_;
    std::tie(counts.busy_seconds, counts.busy_bytes) = credit_.busy(now);
    counts.credit_used = credit_.used;
    for (const Side& side : sides_) {
        counts.full_seconds += side.flow.full_seconds;
        counts.cap_escapes += side.flow.cap_escapes;
    }
    return counts;
}

void Loop::take_submissions() {
    std::vector<std::pair<uint64_t, std::vector<Part>>> inbox;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        inbox.swap(inbox_);
    }
    const double now = monotonic();
    for (auto& [call, parts] : inbox) {
        if (parts.empty()) {
            finish(call, "");
            continue;
        }
        calls_[call] = CallState{parts.size(), ""};
        for (Part& part : parts) place(call, std::move(part), now);
    }
}

void Loop::place(uint64_t call, Part part, double now) {
    int64_t slot;
    if (free_slots_.empty()) {
        slot = int64_t(parts_.size());
        parts_.push_back({});
    } else {
        slot = free_slots_.back();
        free_slots_.pop_back();
    }
    InFlight& held = parts_[size_t(slot)];
    held = InFlight{std::move(part), call, false, false, now, 0, 0, 0};
    Part& p = held.part;
    if (p.link < sides_.size() && sides_[p.link].owners) {  // a lost server's key, moved: where it went
        auto owner = sides_[p.link].owners->find(p.key);
        if (owner != sides_[p.link].owners->end()) p.link = owner->second;
    }
    if (p.link >= sides_.size()) {
        answer(slot, "a part for server " + std::to_string(p.link) + ", which the worker has no link to");
        return;
    }
    Side& side = sides_[p.link];
    ++side.owed;
    if (side.lost) {  // its server died: it waits for the key's new one (a seed for the dead one is dropped)
        if (p.seed || !by_key_.emplace(p.key, slot).second)
            answer(slot, p.seed ? "" : "key " + std::to_string(p.key) + " of " + p.tensor + " is already in flight");
        else
            side.orphans.push_back(slot);
        return;
    }
    if (!side.broken.empty()) {
        answer(slot, side.broken);
        return;
    }
    if (!p.seed && !by_key_.emplace(p.key, slot).second) {  // a seed is never answered: not found by its key
        answer(slot, "key " + std::to_string(p.key) + " of " + p.tensor + " is already in flight");
        return;
    }
    requeue(slot, p.link);
}

void Loop::requeue(int64_t slot, size_t s) {
    InFlight& held = parts_[size_t(slot)];
    Part& p = held.part;
    p.link = s;
    held.credited = held.acked = false;
    held.push_slot = held.pull_slot = kNoSlot;
    if (!p.seed) credit_.queue(int64_t(s), int64_t(p.push_bytes));  // pacing counts what waits to be sent
    flow::Part fp;
    fp.id = slot, fp.key = p.key, fp.seed = p.seed;
    fp.order.round = p.round, fp.order.tensor = p.tensor, fp.order.index = p.index;
    sides_[s].flow.push(std::move(fp), p.priority);
}

void Loop::pump(size_t s, double now) {
    Side& side = sides_[s];
    Link& link = *side.link;
    try {
        if (link.queued() == 0) {
            if (!side.receipts.empty()) {  // held keys: the sums that came in, said ahead of the next pushes
                encode_entries(side.receipts, side.receipts_body);
                side.receipts.clear();
                Header h;
                h.type = kReceived, h.epoch = side.epoch, h.sender = settings_.rank;
                h.length = side.receipts_body.size();
                link.queue(h, side.receipts_body.data(), kNotAPart);
            }
            uint64_t bytes = 0, frames = 0;
            while (frames < settings_.batch_frames) {
                std::optional<int64_t> slot = side.waiting ? side.waiting : side.flow.next(now);
                side.waiting.reset();
                if (!slot) break;
                InFlight& held = parts_[size_t(*slot)];
                const Part& p = held.part;
                if (frames > 0 && bytes + p.push_bytes > settings_.batch_bytes) {
                    side.waiting = slot;  // the head of the next batch
                    break;
                }
                if (!p.seed && !credit_for(s, p, now)) {
                    side.waiting = slot;  // an acknowledgement gives credit back, or its pacing turn comes
                    break;
                }
                held.credited = !p.seed;
                held.sent = now;
                Header h;
                h.type = kPushPull;
                h.dtype = p.dtype;
                h.epoch = side.epoch;
                h.sender = settings_.rank;
                h.key = p.key;
                h.round = p.round;
                h.length = p.push_bytes;
                h.flags = p.flags | (p.held ? kHeld : 0);
                if (side.arena.base && !p.seed) {  // copied into a push slot: the frame is its header (transport/shm.py)
                    if (side.free_push.empty() || p.push_bytes > side.arena.slot_bytes)
                        throw std::logic_error("a push with no free shared slot to hold it");
                    held.push_slot = side.free_push.back();
                    side.free_push.pop_back();
                    if (!side.free_pull.empty() && p.nbytes <= side.arena.slot_bytes) {
                        held.pull_slot = side.free_pull.back();
                        side.free_pull.pop_back();
                    }
                    uint8_t* into = side.push_slot(held.push_slot);
                    const uint64_t data = p.push_bytes - p.extra_bytes;
                    if (data) std::memcpy(into, p.send, data);
                    if (p.extra_bytes) std::memcpy(into + data, p.extra, p.extra_bytes);
                    h.flags |= kShmPayload;
                    h.status = uint32_t(held.push_slot) | uint32_t(held.pull_slot) << 16;
                    link.queue(h, nullptr, uint64_t(*slot));
                } else {
                    link.queue(h, p.send, uint64_t(*slot), p.extra, p.extra_bytes);
                }
                bytes += p.push_bytes;
                ++frames;
            }
            counts_.pushes += frames;
            counts_.batches += frames > 0;
        }
        link.flush([this](uint64_t slot) {
            if (slot == kNotAPart) return;  // a RECEIVED frame
            if (parts_[size_t(slot)].part.seed)
                answer(int64_t(slot), "");  // a seed is done once sent
            else
                parts_[size_t(slot)].pushed = monotonic();
        });
    } catch (const LinkClosed& error) {
        closed(s, server(s) + ": " + error.what());
        return;
    }
    poll_.want(s, side.owed > 0, link.queued() > 0);
}

void Loop::acked(size_t s, InFlight& held) {
    held.acked = true;
    if (held.push_slot != kNoSlot) {  // the server has summed it out of the slot: the slot may take the next push
        sides_[s].free_push.push_back(held.push_slot);
        held.push_slot = kNoSlot;
    }
}

bool Loop::credit_for(size_t s, const Part& p, double now) {
    // as worker/pushes.py's _credit_for: a push that has waited pace_give_up for its turn goes unpaced
    Side& side = sides_[s];
    const bool waited = side.turn_since && now - *side.turn_since >= settings_.pace_give_up;
    if (!credit_.take(int64_t(p.push_bytes), int64_t(s), side.network(), !waited, now)) {
        if (waited || credit_.may_send(int64_t(s)))
            side.turn_since.reset();  // short of credit, not of a turn
        else if (!side.turn_since)
            side.turn_since = now;
        return false;
    }
    side.turn_since.reset();
    return true;
}

int Loop::wait_ms(double now) const {
    double until = now + 1.0;
    for (const Side& side : sides_) {
        if (side.waiting) {
            if (side.turn_since) until = std::min(until, *side.turn_since + settings_.pace_give_up);
            continue;  // an acknowledgement gives its credit back: the poll wakes for it
        }
        if (auto at = side.flow.wake_at()) until = std::min(until, *at);
    }
    return int(std::max(0.0, std::ceil((until - now) * 1000)));
}

Loop::InFlight& Loop::part_of(size_t s, uint64_t key, const char* what) {
    auto found = by_key_.find(key);
    if (found == by_key_.end() || parts_[size_t(found->second)].part.link != s)
        throw ProtocolError(server(s) + " " + what + " key " + std::to_string(key) + ", which is not in flight");
    return parts_[size_t(found->second)];
}

uint8_t* Loop::destination(size_t s, const Header& h) {
    if (h.type == kResult) {
        InFlight& held = part_of(s, h.key, "answered");
        const Part& p = held.part;
        const bool shared = h.flags == kShmPayload && held.pull_slot != kNoSlot && h.status == held.pull_slot;
        if (h.flags & kAveraged)  // a held key's seed sent averaged: only a worker on the Python data path sends one
            throw ProtocolError(server(s) + " answered " + p.tensor + " with an averaged sum (seeded by a worker on the "
                                "Python data path: run every worker of a job on one data path)");
        if (h.round != p.round || h.length != p.nbytes || (h.flags && !shared))
            throw ProtocolError(server(s) + " answered " + p.tensor + " round " + std::to_string(h.round) + " with " +
                                std::to_string(h.length) + " bytes (flags " + std::to_string(h.flags) +
                                "); expected round " + std::to_string(p.round) + " with " + std::to_string(p.nbytes));
        held.result = monotonic();
        static uint8_t nothing;  // any pointer but nullptr: nothing to read (none, or it lies in the pull slot)
        if (!p.nbytes || shared) return &nothing;
        if (p.held) {  // into the output; where it is the input too, through the bounce buffer (a sum cut off
                       // mid-frame must not overwrite the contribution that is pushed again)
            const bool overlaps = p.out < p.send + p.push_bytes && p.send < p.out + p.nbytes;
            held.bounced = overlaps;
            if (!overlaps) return p.out;
            sides_[s].bounce.resize(std::max<size_t>(sides_[s].bounce.size(), p.nbytes));
            return sides_[s].bounce.data();
        }
        if (!p.keep_sum) return p.out;
        // received into the key's seed, then copied out: a sum cut off mid-frame by a dying server never half
        // overwrites an input that is the output too (it is pushed again whole), and the seed is the last sum's
        std::vector<uint8_t>& seed = seeds_[p.key].data;
        seed.resize(p.nbytes);
        return seed.data();
    }
    if (h.type == kAcks || h.type == kError || h.type == kEveryone) {
        sides_[s].body.resize(std::max<uint64_t>(h.length, 1));
        return sides_[s].body.data();
    }
    const char* name = type_name(h.type);
    throw ProtocolError(server(s) + " sent an unexpected " + (*name ? std::string(name) : std::to_string(h.type)));
}

void Loop::arrived(size_t s, const Header& h) {
    Side& side = sides_[s];
    const double now = monotonic();
    if (h.type == kAcks) {
        ++counts_.acks;
        freed_.clear();
        for_each_entry(side.body.data(), h.length, [&](uint64_t key, uint32_t round) {
            InFlight& held = part_of(s, key, "acknowledged");
            if (round != held.part.round)
                throw ProtocolError(server(s) + " acknowledged round " + std::to_string(round) + " of " +
                                    held.part.tensor + ", expected " + std::to_string(held.part.round));
            auto taken = side.flow.on_ack(key);
            if (!taken) throw ProtocolError(server(s) + " acknowledged key " + std::to_string(key) + " before its push");
            if (taken->second) {
                acked(s, held);
                freed_.push_back(int64_t(held.part.push_bytes));
            }
        });
        if (!freed_.empty()) credit_.release_all(freed_, side.network(), true, now);
        return;
    }
    if (h.type == kEveryone) {  // every worker has these rounds' sums: the parts holding them are done
        for_each_entry(side.body.data(), h.length, [&](uint64_t key, uint32_t round) {
            auto found = held_.find({key, round});
            if (found == held_.end() || parts_[size_t(found->second)].part.link != s)
                throw ProtocolError(server(s) + " says every worker has round " + std::to_string(round) + " of key " +
                                    std::to_string(key) + ", which this worker does not hold");
            const int64_t slot = found->second;
            release(slot);
            answer(slot, "");
        });
        return;
    }
    std::string error;
    if (h.type == kError) {  // a refusal of one tensor (its key in flight here), or the job's abort
        const std::string body(reinterpret_cast<const char*>(side.body.data()), h.length);
        auto found = by_key_.find(h.key);
        if (found == by_key_.end() || parts_[size_t(found->second)].part.link != s) {
            for (size_t other = 0; other < sides_.size(); ++other)
                if (sides_[other].broken.empty()) fail_link(other, server(s) + " ended the job: " + body);
            return;
        }
        error = "worker " + std::to_string(settings_.rank) + ": " + server(s) + " refused " +
                parts_[size_t(found->second)].part.tensor + " (key " + std::to_string(h.key) + "): " + body;
    }
    auto taken = side.flow.on_answer(h.key, now);
    if (!taken) throw ProtocolError(server(s) + " answered key " + std::to_string(h.key) + " before its push");
    InFlight& held = parts_[size_t(taken->first)];
    if (taken->second) {
        acked(s, held);
        credit_.release_all({int64_t(held.part.push_bytes)}, side.network(), true, now);
    }
    const bool shared = h.type == kResult && (h.flags & kShmPayload);
    if (held.pull_slot != kNoSlot) {  // the sum lies in the pull slot the push offered, or came over the socket
        if (shared && held.part.nbytes) std::memcpy(held.part.out, side.pull_slot(held.pull_slot), held.part.nbytes);
        side.free_pull.push_back(held.pull_slot);
        held.pull_slot = kNoSlot;
    }
    if (error.empty()) {
        landed(held, shared);
        record(held, now);
        if (held.part.held) {
            hold(s, taken->first);
            return;
        }
    }
    answer(taken->first, error);
}

void Loop::landed(const InFlight& held, bool shared) {
    const Part& p = held.part;
    if (p.keep_sum) {  // the seed holds the sum (received into it, or copied from the output it was copied into)
        Seed& seed = seeds_[p.key];
        if (shared)
            seed.data.assign(p.out, p.out + p.nbytes);
        else if (p.nbytes)
            std::memcpy(p.out, seed.data.data(), p.nbytes);
        seed.round = p.round, seed.dtype = p.dtype, seed.contribution = false;
    } else if (p.keep_contribution) {  // a sliced round: what this worker pushed, for its replay
        Seed& seed = seeds_[p.key];
        seed.data.assign(p.send, p.send + (p.push_bytes - p.extra_bytes));
        seed.round = p.round, seed.dtype = p.dtype, seed.contribution = true;
    }
}

void Loop::hold(size_t s, int64_t slot) {
    InFlight& held = parts_[size_t(slot)];
    const Part& p = held.part;
    if (held.bounced) std::memcpy(p.out, sides_[s].bounce.data(), p.nbytes);
    held.holding = true;
    held_[{p.key, p.round}] = slot;
    auto key = by_key_.find(p.key);
    if (key != by_key_.end() && key->second == slot) by_key_.erase(key);  // answered: the key's next round may come
    Seed& seed = seeds_[p.key];  // the output is the key's seed (the sum: the caller divides an average at the end)
    seed.data.clear(), seed.data.shrink_to_fit();
    seed.held = p.out, seed.held_bytes = p.nbytes;
    seed.round = p.round, seed.dtype = p.dtype, seed.contribution = false;
    sides_[s].receipts.emplace_back(p.key, p.round);
}

void Loop::release(int64_t slot) {
    InFlight& held = parts_[size_t(slot)];
    const Part& p = held.part;
    held_.erase({p.key, p.round});
    auto seed = seeds_.find(p.key);
    if (seed != seeds_.end() && seed->second.held == p.out && seed->second.round == int64_t(p.round))
        seeds_.erase(seed);  // the output is the caller's again
    held.holding = false;
}

void Loop::answer(int64_t slot, const std::string& error) {
    InFlight& held = parts_[size_t(slot)];
    auto key = by_key_.find(held.part.key);
    if (key != by_key_.end() && key->second == slot) by_key_.erase(key);
    if (held.part.link < sides_.size()) --sides_[held.part.link].owed;
    const uint64_t call = held.call;
    held = InFlight{};
    free_slots_.push_back(slot);
    auto found = calls_.find(call);
    if (found == calls_.end()) return;
    CallState& state = found->second;
    if (!error.empty() && state.error.empty()) state.error = error;
    if (--state.left == 0) {
        const std::string outcome = state.error;
        calls_.erase(found);
        finish(call, outcome);
    }
}

std::vector<int64_t> Loop::take_parts(size_t s, const std::string& why) {
    Side& side = sides_[s];
    side.broken = why.empty() ? "the link failed" : why;
    std::vector<int64_t> slots = side.flow.take_all();
    // (a part waiting for credit or its turn was taken off the queue: it is among those in flight already)
    side.waiting.reset();
    side.turn_since.reset();
    credit_.unpace(int64_t(s));
    const double now = monotonic();
    for (int64_t slot : slots) {
        InFlight& held = parts_[size_t(slot)];
        if (held.credited && !held.acked)
            credit_.release_all({int64_t(held.part.push_bytes)}, side.network(), false, now);
        held.credited = held.acked = false;
    }
    side.receipts.clear();
    return slots;
}

void Loop::fail_link(size_t s, const std::string& why) {
    Side& side = sides_[s];
    if (!side.broken.empty()) return;
    for (int64_t slot : take_parts(s, why)) answer(slot, side.broken);
    for (int64_t slot : held_on(s)) {  // held sums: no EVERYONE is coming
        release(slot);
        answer(slot, side.broken);
    }
    poll_.remove(s);
}

std::vector<int64_t> Loop::held_on(size_t s) const {
    std::vector<int64_t> slots;
    for (const auto& [round, slot] : held_)
        if (parts_[size_t(slot)].part.link == s) slots.push_back(slot);
    return slots;
}

void Loop::closed(size_t s, const std::string& why) {
    if (settings_.failover)
        lose_link(s, why, true);
    else
        fail_link(s, why);
}

void Loop::lose_link(size_t s, const std::string& why, bool report) {
    Side& side = sides_[s];
    if (!side.broken.empty()) return;
    side.lost = true;
    for (int64_t slot : take_parts(s, why)) {
        InFlight& held = parts_[size_t(slot)];
        if (held.part.seed) {  // a seed for the dead server: dropped
            answer(slot, "");
            continue;
        }
        held.push_slot = held.pull_slot = kNoSlot;  // the dead link's shared slots are gone with it
        side.orphans.push_back(slot);
    }
    for (int64_t slot : held_on(s)) {  // held sums: held on until the failover is over (`finish_held`)
        held_.erase({parts_[size_t(slot)].part.key, parts_[size_t(slot)].part.round});
        side.held_lost.push_back(slot);
    }
    set_arena(side, Arena{});
    poll_.remove(s);
    side.link.reset();  // the socket's flags as they were, before the caller closes it
    if (report) finish(0, why);
}

void Loop::finish(uint64_t call, const std::string& error) {
    std::lock_guard<std::mutex> lock(mutex_);
    outbox_.emplace_back(call, error);
    done_.notify_all();
}

}  // namespace gradwire::worker
