#include "server.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <future>
#include <system_error>

#include "sums.hpp"

namespace gradwire::server {
namespace {

constexpr uint8_t kJoinEvent = 0x80;  // ring.py's: never a wire flag a worker may send

std::string hex_key(uint64_t key) {
    char text[17];
    std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(key));
    return text;
}

// Python's repr of a str without quotes or backslashes in it (what the messages quote a tensor's name as)
std::string quoted(const std::string& name) { return "'" + name + "'"; }

std::string ranks_text(uint64_t mask, const char* separator) {
    std::string text;
    for (uint32_t rank = 0; rank < 64; ++rank) {
        if (!(mask >> rank & 1)) continue;
        if (!text.empty()) text += separator;
        text += std::to_string(rank);
    }
    return text;
}

// A JSON string's body (the ERROR frame's message).
std::string json_string(const std::string& text) {
    std::string out = "\"";
    for (const char c : text) {
        if (c == '"' || c == '\\') {
            out += '\\', out += c;
        } else if (static_cast<unsigned char>(c) < 0x20) {
            char escaped[8];
            std::snprintf(escaped, sizeof escaped, "\\u%04x", c);
            out += escaped;
        } else {
            out += c;
        }
    }
    return out + "\"";
}

int popcount(uint64_t mask) { return __builtin_popcountll(mask); }

// protocol/dtypes.py's name of a wire dtype code (decode_header checked it).
const char* dtype_name(uint8_t code) {
    static const char* const names[] = {"?",     "float16", "float32", "float64", "int32", "int64",
                                        "bfloat16", "uint8", "int8",    "int16",   "bool"};
    return code < sizeof names / sizeof *names ? names[code] : "?";
}

}  // namespace

// A worker's contribution could not go in: an ERROR for its key to it (engine.py's `_fail`).
struct TensorError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

struct Loop::Receiver {  // the decoder's sink for one link
    Loop& loop;
    Side& side;
    bool expecting() const { return !side.ended; }
    uint8_t* destination(const Header& h) { return loop.destination(side, h); }
    void arrived(const Header& h, uint8_t*) { loop.arrived(side, h); }
};

Loop::Loop(const Settings& settings)
    : settings_(settings), wake_fd_(make_eventfd()), poll_(std::vector<int>{wake_fd_}) {
    thread_ = std::thread([this] { run(); });
}

Loop::~Loop() {
    stop();
    *alive_ = false;  // lent buffers let go from here on are freed, not given back
    keys_.clear();
    ::close(wake_fd_);
}

void Loop::wake() {
    const uint64_t one = 1;
    (void)!::write(wake_fd_, &one, sizeof one);
}

template <typename F>
auto Loop::on_loop(F&& task) {
    return tasks_.run(std::forward<F>(task), [this] { wake(); });
}

void Loop::stop() {
    std::lock_guard<std::mutex> alone(stopping_lock_);  // one caller joins the thread; others wait for it
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stopping_ = true;
    }
    wake();
    if (thread_.joinable()) thread_.join();
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stopped_ = true;
        posted_.notify_all();
    }
    tasks_.end();
}

void Loop::post(Event event) {
    std::lock_guard<std::mutex> lock(mutex_);
    events_.push_back(std::move(event));
    posted_.notify_all();
}

std::vector<Event> Loop::events(double timeout) {
    std::unique_lock<std::mutex> lock(mutex_);
    posted_.wait_for(lock, std::chrono::duration<double>(timeout), [this] { return !events_.empty() || stopped_; });
    std::vector<Event> out;
    out.swap(events_);
    return out;
}

Counts Loop::take_counts() {
    return on_loop([&] {
        Counts taken = counts_;
        counts_ = Counts{};
        return taken;
    });
}

// -- what callers ask -----------------------------------------------------------------------------------------------

void Loop::add(uint32_t worker, int fd, std::vector<uint8_t> ahead) {
    on_loop([&] {
        auto side = std::make_unique<Side>();
        side->worker = worker;
        side->link = std::make_unique<Link>(fd, settings_.max_payload);
        side->link->prepend(std::move(ahead));
        const size_t at = side->poll = poll_.add(fd);
        if (sides_.size() <= at) sides_.resize(at + 1);
        sides_[at] = std::move(side);
        receive(*sides_[at], monotonic());  // what the handshake read ahead
    });
}

void Loop::attach(uint32_t worker, Arena arena) {
    on_loop([&] {
        if (Side* side = side_of(worker)) side->arena = arena;
    });
}

void Loop::close(uint32_t worker) {
    on_loop([&] {
        if (Side* side = side_of(worker)) end(*side, "", true);
    });
}

void Loop::send(uint32_t worker, std::vector<uint8_t> frames) {
    // checked whole before any goes: a header that does not decode, or a cut frame, is the caller's bug
    std::vector<std::pair<Header, size_t>> found;  // each frame's header and where its payload starts
    for (size_t at = 0; at < frames.size();) {
        Header h;
        if (frames.size() - at < kHeaderSize || decode_header(frames.data() + at, UINT64_MAX, h) != HeaderError::kOk ||
            frames.size() - at - kHeaderSize < wire_length(h))
            throw std::invalid_argument("send: not whole frames");
        found.emplace_back(h, at + kHeaderSize);
        at += kHeaderSize + wire_length(h);
    }
    auto chunk = std::make_shared<std::vector<uint8_t>>(std::move(frames));
    on_loop([&] {
        Side* side = side_of(worker);
        if (side == nullptr) return;
        for (const auto& [header, at] : found) {
            Outgoing out;
            out.header = header;
            out.hold = chunk;
            out.payload = chunk->data() + at;
            queue(*side, std::move(out));
        }
        flush(*side);
    });
}

void Loop::declare(uint64_t id, uint8_t dtype, uint64_t length, std::string name, std::vector<uint32_t> members,
                   bool native) {
    if (itemsize(dtype) == 0 || accumulator_itemsize(dtype) == 0 || length % itemsize(dtype))
        throw std::invalid_argument("declare: a bad dtype or length");
    on_loop([&] {
        if (keys_.count(id)) return;
        Key& key = keys_[id];
        key.native = native;
        fresh_key(key, dtype, length, std::move(name), std::move(members));
    });
}

void Loop::fresh_key(Key& key, uint8_t dtype, uint64_t length, std::string name, std::vector<uint32_t> members) {
    const uint32_t workers = settings_.workers;
    key.dtype = dtype, key.length = length, key.name = std::move(name);
    key.narrow = accumulator_itemsize(dtype) != itemsize(dtype);
    key.landable = false;
    if (members.empty())
        for (uint32_t rank = 0; rank < workers; ++rank) members.push_back(rank);
    std::sort(members.begin(), members.end());
    key.members = members;
    key.need = uint32_t(members.size());
    key.everyone = 0;
    for (uint32_t rank : members) key.everyone |= uint64_t(1) << rank;
    key.first = members.empty() ? 0 : members[0];
    key.nexts.assign(workers + 1, workers);
    for (size_t i = 0; i + 1 < members.size(); ++i) key.nexts[members[i]] = members[i + 1];
    for (Round& r : key.rounds) {
        r = Round{};
        r.turn = key.first;
        r.stage.assign(workers, nullptr);
        r.pulls.assign(workers, kNoSlot);
    }
}

void Loop::set_joined(uint64_t mask) {
    on_loop([&] {
        joined_ = mask;
        if (!mask) return;
        for (auto& [id, key] : keys_) {
            if (!key.native) continue;
            for (Round& r : key.rounds) {
                if (!key.unfinished(r) || r.seeded) continue;
                join_in(key, r);
                if (r.count == key.need) complete(key, id, r);
            }
        }
        for (auto& side : sides_)
            if (side) flush(*side);
    });
}

void Loop::set_departed(uint64_t mask) {
    on_loop([&] {
        departed_ = mask;
        for (auto& [id, key] : keys_) {
            if (!key.native) continue;
            for (Round& r : key.rounds)
                if (key.unfinished(r) && !r.seeded) fail_departed(key, id, r);
        }
        for (auto& side : sides_)
            if (side) flush(*side);
    });
}

void Loop::reset(uint32_t workers, bool forget) {
    on_loop([&] {
        const bool same = workers == settings_.workers;  // else a process set's ranks mean nothing any more
        settings_.workers = workers;
        joined_ = departed_ = 0;
        if (forget) {
            keys_.clear();
            return;
        }
        for (auto& [id, key] : keys_) {
            std::vector<uint32_t> members = same ? key.members : std::vector<uint32_t>{};
            std::string name = key.name;
            fresh_key(key, key.dtype, key.length, std::move(name), std::move(members));
        }
    });
}

void Loop::set_identity(uint32_t rank, uint32_t epoch) {
    on_loop([&] { settings_.rank = rank, settings_.epoch = epoch; });
}

std::vector<std::tuple<uint64_t, int64_t, double, std::vector<uint32_t>>> Loop::stalled(double now,
                                                                                       double threshold) {
    return on_loop([&] {
        std::vector<std::tuple<uint64_t, int64_t, double, std::vector<uint32_t>>> found;
        for (const auto& [id, key] : keys_) {
            if (!key.native) continue;
            for (const Round& r : key.rounds) {
                if (!key.unfinished(r) || now - r.started <= threshold) continue;
                std::vector<uint32_t> missing;
                for (uint32_t rank : key.members)
                    if (!(r.pushed >> rank & 1)) missing.push_back(rank);
                found.emplace_back(id, r.number, now - r.started, std::move(missing));
            }
        }
        return found;
    });
}

std::pair<size_t, uint64_t> Loop::sizes() {
    return on_loop([&] {
        size_t native = 0;
        for (const auto& [id, key] : keys_) native += key.native;
        return std::make_pair(native, allocated_);
    });
}

// -- the loop -------------------------------------------------------------------------------------------------------

void Loop::run() {
    std::vector<epoll_event> ready(64);
    try {
        for (;;) {
            {
                std::lock_guard<std::mutex> lock(mutex_);
                if (stopping_) break;
            }
            retire();  // links that ended last pass (nothing refers to them any more)
            tasks_.run_pending();
            retire();  // and those Python closed just now
            double now = monotonic();
            double wake_at = 0;
            for (auto& side : sides_) {
                if (!side || side->ended || side->deadline == 0) continue;
                if (now >= side->deadline) {
                    char text[96];
                    std::snprintf(text, sizeof text, "a frame begun has not gone on arriving for %gs",
                                  settings_.frame_timeout);
                    end(*side, text, false);
                } else if (wake_at == 0 || side->deadline < wake_at) {
                    wake_at = side->deadline;
                }
            }
            const int timeout = wake_at ? int(std::max(1.0, (wake_at - now) * 1000 + 1)) : 1000;
            const int n = poll_.wait(ready.data(), int(ready.size()), timeout);
            now = monotonic();
            for (int e = 0; e < n; ++e) {
                const size_t i = ready[e].data.u64;
                if (i == 0) {
                    uint64_t drained;
                    (void)!::read(wake_fd_, &drained, sizeof drained);
                    continue;
                }
                Side* side = i < sides_.size() ? sides_[i].get() : nullptr;
                if (side == nullptr || side->ended) continue;
                if (ready[e].events & kInput) receive(*side, now);
                if (!side->ended && (ready[e].events & EPOLLOUT)) flush(*side);
            }
            for (auto& side : sides_)  // this pass's replies: its acknowledgements one ACKS frame a link
                if (side && !side->ended && (!side->acks.empty() || !side->backlog.empty())) flush(*side);
        }
    } catch (const std::exception& error) {  // a bug: every link ends with it, Python hears of each
        for (auto& side : sides_)
            if (side && !side->ended) end(*side, std::string("the native server failed: ") + error.what(), false);
    }
    for (auto& side : sides_)
        if (side && !side->ended) end(*side, "", true);
    retire();
}

Loop::Side* Loop::side_of(uint32_t worker) {
    for (auto& side : sides_)
        if (side && !side->ended && side->worker == worker) return side.get();
    return nullptr;
}

void Loop::receive(Side& side, double now) {
    try {
        Receiver receiver{*this, side};
        side.link->receive(receiver);
        if (!side.ended) side.deadline = side.link->mid_frame() ? now + settings_.frame_timeout : 0;
    } catch (const ProtocolError& error) {
        end(side, error.what(), false);
    } catch (const LinkClosed& error) {
        end(side, error.what(), true);
    }
    if (!side.ended) flush(side);
}

void Loop::end(Side& side, const std::string& why, bool routine) {
    if (side.ended) return;
    side.ended = true;
    side.why = why, side.routine = routine;
    poll_.remove(side.poll);
    side.sending.clear(), side.backlog.clear(), side.acks.clear();  // never sent: their buffers back
}

void Loop::retire() {
    for (auto& side : sides_) {
        if (!side || !side->ended) continue;
        side->link.reset();  // the socket's flags as they were, before Python closes it (told below)
        Event event;
        event.kind = Event::kClosed;
        event.worker = side->worker;
        event.why = side->why;
        event.routine = side->routine;
        post(std::move(event));
        side.reset();
    }
}

// -- receiving ------------------------------------------------------------------------------------------------------

uint8_t* Loop::destination(Side& side, const Header& h) {
    uint8_t* into = frame_destination(side, h);
    // a frame with nothing on the stream: any pointer but nullptr goes on (an empty buffer's may be nullptr); the
    // loop never answers "not now" (its buffers are lent by a pool that grows)
    return wire_length(h) == 0 ? reinterpret_cast<uint8_t*>(&side) : into;
}

uint8_t* Loop::frame_destination(Side& side, const Header& h) {
    side.into = Side::Into::kNone;
    const uint64_t wire = wire_length(h);
    if (h.type == kPushPull && !(h.flags & (kReplica | kJoinEvent))) {
        if (h.sender != side.worker || h.epoch != settings_.epoch)
            throw ProtocolError("frame claims sender " + std::to_string(h.sender) + " epoch " +
                                std::to_string(h.epoch) + "; connection is worker " + std::to_string(side.worker) +
                                " in epoch " + std::to_string(settings_.epoch));
        return push_destination(side, h);
    }
    if (h.type == kBye || h.type == kShmAttach || h.type == kReceived) {
        side.into = Side::Into::kPython;
        side.python = std::make_shared<std::vector<uint8_t>>(wire);
        return wire ? side.python->data() : reinterpret_cast<uint8_t*>(&side);  // nothing to read: any pointer
    }
    char flags[8];
    std::snprintf(flags, sizeof flags, "%#x", h.flags);
    throw ProtocolError(std::string("unexpected ") + type_name(h.type) + " frame (flags " + flags + ")");
}

uint8_t* Loop::push_destination(Side& side, const Header& h) {
    const bool shared = h.flags & kShmPayload;
    uint8_t* nowhere = reinterpret_cast<uint8_t*>(&side);  // a frame with nothing on the stream: any pointer goes on
    auto found = keys_.find(h.key);
    std::string problem;
    if (found == keys_.end()) {
        problem = "key " + hex_key(h.key) + " is not declared on this server";
    } else if (!found->second.native) {  // Python's key: its payload to Python, which checks it
        side.into = Side::Into::kPython;
        side.python = std::make_shared<std::vector<uint8_t>>(wire_length(h));
        return shared ? nowhere : side.python->data();
    } else if (found->second.dtype != h.dtype || found->second.length != h.length) {
        const Key& key = found->second;
        problem = std::to_string(h.length) + " bytes of " + dtype_name(h.dtype) + " pushed, but the key is " +
                  std::to_string(key.length) + " bytes of " + dtype_name(key.dtype);
    }
    if (!problem.empty()) {  // the tensor's error, not the link's: refused, the stream kept in sync
        error_to(side.worker, h.key, problem);
        side.into = Side::Into::kDrop;
        if (shared) return nowhere;
        if (scratch_.size() < h.length) scratch_.resize(h.length);
        return scratch_.data();
    }
    Key& key = found->second;
    if (shared) {
        const uint16_t push = uint16_t(h.status & 0xFFFF), pull = uint16_t(h.status >> 16);
        const Arena& arena = side.arena;
        if (!arena.base || push >= arena.push || h.length > arena.slot_bytes)
            throw ProtocolError("bad shared push slot " + std::to_string(push) + " for " + std::to_string(h.length) +
                                " bytes");
        if (pull != kNoSlot && pull >= arena.pull) throw ProtocolError("bad shared pull slot " + std::to_string(pull));
        side.into = Side::Into::kRound;
        side.data = side.push_slot(push);
        return nowhere;
    }
    side.landing.reset();
    uint8_t* into = (h.flags & (kSeed | kReplay)) ? nullptr : landing(key, h.sender, h.round, side.landing);
    if (into != nullptr) {
        side.into = side.landing ? Side::Into::kStage : Side::Into::kRound;
    } else {  // a seed, a replay, or a round that cannot take it now: a staging buffer of its own
        side.landing = take(h.length);
        side.into = Side::Into::kStage;
        into = side.landing->data();
    }
    side.data = into;
    return into;
}

// Where `sender`'s contribution to round `round` may be received directly (engine.py's `landing`): its staging
// buffer, or for the first rank the round's accumulator; nullptr where neither may take it now.
uint8_t* Loop::landing(Key& key, uint32_t sender, uint32_t round, Buffer& lent) {
    if (!(key.everyone >> sender & 1)) return nullptr;
    Round& r = key.rounds[round & 1];
    if (sender != key.first) {
        Buffer& stage = r.stage[sender];
        if (!stage) stage = take(key.length);
        lent = stage;
        return stage->data();
    }
    if (key.narrow || !key.landable || r.seeded) return nullptr;
    const bool current = r.number == int64_t(round);
    if (current && ((r.pushed >> sender & 1) || r.count >= key.need)) return nullptr;
    if (!current && key.unfinished(r)) return nullptr;
    if (!r.acc) r.acc = take(key.acc_bytes());
    return r.acc->data();
}

void Loop::arrived(Side& side, const Header& h) {
    const Side::Into into = side.into;
    side.into = Side::Into::kNone;
    if (into == Side::Into::kPython) {
        Event event;
        event.kind = Event::kFrame;
        event.worker = side.worker;
        event.header = h;
        event.body = std::move(side.python);
        if (h.type == kBye)
            end(side, "", true);
        else
            post(std::move(event));
        return;
    }
    if (into == Side::Into::kDrop || into == Side::Into::kNone) return;
    counts_.pushed += h.length;
    auto found = keys_.find(h.key);
    if (found == keys_.end()) return;  // dropped by a reset meanwhile
    const bool shared = h.flags & kShmPayload;
    const uint16_t pull = shared ? uint16_t(h.status >> 16) : kNoSlot;
    Buffer landing = std::move(side.landing);
    try {
        // received off the socket into its landing (contribute tells the accumulator and a staging buffer apart)
        const bool landed = !shared && !(h.flags & (kSeed | kReplay));
        on_push(found->second, h.key, h, side.data, landed, pull);
    } catch (const TensorError& error) {
        error_to(side.worker, h.key, std::string("server failed to sum key ") + hex_key(h.key) + ": " + error.what());
    }
}

// -- the rounds -----------------------------------------------------------------------------------------------------

void Loop::begin(Key& key, Round& r, int64_t number) {
    if (key.unfinished(r))
        throw TensorError("round " + std::to_string(number) + " arrived while round " + std::to_string(r.number) +
                          " is unfinished");
    r.number = number, r.count = 0, r.pushed = 0, r.turn = key.first, r.staged = 0;
    r.seeded = false, r.held = false;
}

void Loop::on_push(Key& key, uint64_t id, const Header& h, const uint8_t* data, bool landed, uint16_t pull) {
    Round& r = key.rounds[h.round & 1];
    if (h.flags & kSeed) {
        take_seed(key, id, r, h, data);
        return;
    }
    const uint64_t bit = uint64_t(1) << h.sender;
    if (!(key.everyone & bit)) {
        std::string members;
        for (uint32_t rank : key.members) members += (members.empty() ? "" : ", ") + std::to_string(rank);
        throw TensorError("worker " + std::to_string(h.sender) + " is not among the ranks [" + members + "] of " +
                          quoted(key.name));
    }
    const bool replay = h.flags & kReplay;
    if (replay) {  // not needed: its round is complete here already, or past, or its contribution is in
        const bool stale = r.number != int64_t(h.round) ? r.number > int64_t(h.round)
                                                        : r.count == key.need || (r.pushed & bit);
        if (stale) return;
    }
    if (r.number != int64_t(h.round)) begin(key, r, h.round);
    r.pulls[h.sender] = pull;
    if (h.flags & kHeld) r.held = true;
    if (r.seeded && r.count == key.need) {  // a worker the dead server never answered: answered alone
        ++counts_.seeded_answers;
        answer(key, id, r, bit);
        return;
    }
    if (r.pushed & bit)
        throw TensorError("worker " + std::to_string(h.sender) + " pushed round " + std::to_string(h.round) + " twice");
    if (r.count == 0) r.virtual_ = 0;
    contribute(key, r, h.sender, data, landed);
    if (replay) r.virtual_ |= bit;  // its sender had its slice from the dead server: no answer, no acknowledgement
    if (joined_ && r.count < key.need) join_in(key, r);
    if (departed_ && r.count < key.need && fail_departed(key, id, r)) return;
    if (r.count < key.need) {
        if (!replay) {
            if (Side* side = side_of(h.sender)) side->acks.emplace_back(id, h.round);
        }
    } else {
        complete(key, id, r);
    }
}

void Loop::contribute(Key& key, Round& r, uint32_t sender, const uint8_t* data, bool landed) {
    if (r.count == 0) r.started = monotonic();
    if (sender == r.turn) {
        if (!(landed && sender == key.first && !key.narrow && r.acc && data == r.acc->data()))
            add(key, r, data, sender == key.first);
        if (r.stage[sender] && data == r.stage[sender]->data()) r.stage[sender].reset();  // back to the pool
        drain(key, r);
    } else {  // early: it waits in its staging buffer (copied there unless it landed there), acknowledged now
        Buffer& stage = r.stage[sender];
        if (!stage) stage = take(key.length);
        if (data != stage->data()) std::memcpy(stage->data(), data, key.length);
        r.staged |= uint64_t(1) << sender;
    }
    ++r.count;
    r.pushed |= uint64_t(1) << sender;
}

void Loop::add(Key& key, Round& r, const uint8_t* data, bool first) {
    if (!r.acc) r.acc = take(key.acc_bytes());
    const size_t n = key.elements();
    const bool ok = first ? widen(key.dtype, data, r.acc->data(), n) : add_into(key.dtype, r.acc->data(), data, n);
    if (!ok) throw TensorError("no sum for dtype code " + std::to_string(key.dtype));
}

void Loop::drain(Key& key, Round& r) {
    r.turn = key.nexts[r.turn];
    while (r.turn < 64 && (r.staged >> r.turn & 1)) {
        const uint32_t rank = r.turn;
        add(key, r, r.stage[rank]->data(), rank == key.first);
        r.stage[rank].reset();
        r.staged &= ~(uint64_t(1) << rank);
        r.turn = key.nexts[rank];
    }
}

void Loop::complete(Key& key, uint64_t id, Round& r) {
    key.landable = true;
    if (key.narrow) {
        if (!r.out) r.out = take(key.length);
        narrow(key.dtype, r.acc->data(), r.out->data(), key.elements());
    }
    answer(key, id, r, key.everyone & ~r.virtual_);
    if (!r.seeded) r.acc.reset(), r.out.reset();  // the replies hold them until sent, then back to the pool
}

void Loop::answer(Key& key, uint64_t id, Round& r, uint64_t ranks) {
    if (r.held) {  // Python's receipts wait for their RECEIVED frames (they come after this event)
        Event event;
        event.kind = Event::kHeld;
        event.header.key = id, event.header.round = uint32_t(r.number);
        event.ranks = ranks;
        post(std::move(event));
    }
    if (ranks == (settings_.workers >= 64 ? ~uint64_t(0) : (uint64_t(1) << settings_.workers) - 1)) ++counts_.rounds;
    const Buffer& result = key.narrow ? r.out : r.acc;
    const uint8_t flags = r.seeded && r.averaged ? kAveraged : 0;
    for (uint32_t rank = 0; rank < settings_.workers && rank < 64; ++rank) {
        if (!(ranks >> rank & 1)) continue;
        Side* side = side_of(rank);
        if (side == nullptr) continue;
        Outgoing out;
        Header& h = out.header;
        h.type = kResult, h.flags = flags, h.dtype = key.dtype, h.epoch = settings_.epoch, h.sender = settings_.rank;
        h.key = id, h.round = uint32_t(r.number), h.length = key.length;
        const uint16_t pull = r.pulls[rank];
        if (pull != kNoSlot && side->arena.base && pull < side->arena.pull) {
            std::memcpy(side->pull_slot(pull), result->data(), key.length);  // one copy here, none through the kernel
            h.flags |= kShmPayload, h.status = pull;
        } else {
            out.hold = result;
            out.payload = result->data();
        }
        counts_.pulled += key.length;
        queue(*side, std::move(out));
    }
}

void Loop::take_seed(Key& key, uint64_t id, Round& r, const Header& h, const uint8_t* data) {
    // stale: the buffer holds a later round, or this one is complete already (any sum of a round is the same bytes)
    if (r.number > int64_t(h.round) || (r.number == int64_t(h.round) && r.count == key.need)) return;
    const uint64_t waiting = r.number == int64_t(h.round) ? r.pushed : 0;
    Buffer& result = key.narrow ? r.out : r.acc;
    if (!result) result = take(key.narrow ? key.length : key.acc_bytes());
    std::memcpy(result->data(), data, key.length);
    if (key.narrow && !r.acc) r.acc = take(key.acc_bytes());
    r.number = h.round, r.count = key.need, r.pushed = key.everyone;
    r.turn = settings_.workers, r.staged = 0, r.seeded = true;
    r.averaged = h.flags & kAveraged;  // answered as it is: its workers do not divide it again
    if (waiting) {
        counts_.seeded_answers += uint64_t(popcount(waiting));
        answer(key, id, r, waiting);
    }
}

void Loop::join_in(Key& key, Round& r) {
    const uint64_t missing = joined_ & key.everyone & ~r.pushed;
    if (!missing) return;
    std::vector<uint8_t>& zeros = zeros_[key.length];
    if (zeros.size() != key.length) zeros.assign(key.length, 0);  // one per size, never written
    for (uint32_t rank : key.members) {
        if (!(missing >> rank & 1)) continue;
        contribute(key, r, rank, zeros.data(), false);
        r.virtual_ |= uint64_t(1) << rank;
    }
}

bool Loop::fail_departed(Key& key, uint64_t id, Round& r) {
    const uint64_t missing = departed_ & key.everyone & ~r.pushed & ~joined_;
    if (!missing) return false;
    const std::string message = "worker " + ranks_text(missing, ", ") +
                                " left the job (shutdown(), or its process ended) before pushing round " +
                                std::to_string(r.number) + " of " + quoted(key.name) +
                                ", which can never complete: every worker must make the same calls before it shuts "
                                "down";
    const uint64_t pushers = r.pushed & ~r.virtual_;
    r.count = 0, r.pushed = 0, r.staged = 0, r.turn = key.first;
    for (uint32_t rank : key.members)
        if (pushers >> rank & 1) error_to(rank, id, message);
    return true;
}

// -- sending --------------------------------------------------------------------------------------------------------

void Loop::error_to(uint32_t worker, uint64_t key, const std::string& message) {
    Side* side = side_of(worker);
    if (side == nullptr) return;
    const std::string body = "{\"message\": " + json_string(message) + "}";
    Outgoing out;
    out.header.type = kError, out.header.key = key, out.header.epoch = settings_.epoch;
    out.header.sender = settings_.rank, out.header.length = body.size();
    out.own.assign(body.begin(), body.end());
    out.payload = out.own.data();
    queue(*side, std::move(out));
}

void Loop::queue_acks(Side& side) {
    if (side.acks.empty()) return;
    Outgoing out;
    out.own.resize(side.acks.size() * kAckEntrySize);
    uint8_t* at = out.own.data();
    for (const auto& [key, round] : side.acks) {
        std::memcpy(at, &key, 8);
        std::memcpy(at + 8, &round, 4);
        at += kAckEntrySize;
    }
    side.acks.clear();
    out.header.type = kAcks, out.header.epoch = settings_.epoch, out.header.sender = settings_.rank;
    out.header.length = out.own.size();
    out.payload = out.own.data();
    side.backlog.push_back(std::move(out));
}

void Loop::queue(Side& side, Outgoing frame) {
    queue_acks(side);  // the acknowledgements made before it go before it
    side.backlog.push_back(std::move(frame));
}

void Loop::flush(Side& side) {
    if (side.ended) return;
    queue_acks(side);
    try {
        for (;;) {
            while (!side.backlog.empty() && side.link->can_queue()) {
                side.sending.push_back(std::move(side.backlog.front()));
                side.backlog.pop_front();
                const Outgoing& out = side.sending.back();
                side.link->queue(out.header, out.payload, 0);
            }
            const bool empty = side.link->flush([&](uint64_t) { side.sending.pop_front(); });
            if (!empty || side.backlog.empty()) {
                poll_.want(side.poll, true, !empty);
                return;
            }
        }
    } catch (const LinkClosed& error) {
        end(side, error.what(), true);
    }
}

Loop::Buffer Loop::take(uint64_t bytes) {
    std::vector<uint8_t>* raw;
    auto& free = free_[bytes];
    if (!free.empty()) {
        raw = free.back().release();
        free.pop_back();
    } else {
        raw = new std::vector<uint8_t>(bytes);
        allocated_ += bytes;
    }
    std::shared_ptr<bool> alive = alive_;
    return Buffer(raw, [this, alive](std::vector<uint8_t>* v) {
        if (*alive)
            free_[v->size()].emplace_back(v);
        else
            delete v;
    });
}

}  // namespace gradwire::server
