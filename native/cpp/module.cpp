// gradwire_native._core: the native parts of gradwire's data path, bound with nanobind.
//
// Every call that moves or sums bytes releases the GIL for its whole length. Buffers cross as nanobind ndarrays
// (numpy, DLPack: torch, JAX and TensorFlow tensors without a copy); a call checks their sizes before touching them.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unordered_map.h>
#include <nanobind/stl/vector.h>

#include "floor.hpp"
#include "flow.hpp"
#include "frames.hpp"
#include "link.hpp"
#include "sums.hpp"
#include "loop.hpp"
#include "server.hpp"
#include "worker.hpp"

#include <algorithm>
#include <cstring>

namespace nb = nanobind;
using namespace gradwire;

namespace {

using Bytes = nb::ndarray<nb::device::cpu, nb::c_contig>;  // any dtype: sized in bytes
using ReadBytes = nb::ndarray<nb::ro, nb::device::cpu, nb::c_contig>;  // the same, read-only ones too (what is sent)

nb::tuple decode(nb::bytes raw, uint64_t max_payload) {
    if (raw.size() != kHeaderSize)
        throw nb::value_error(("a header is " + std::to_string(kHeaderSize) + " bytes, not " +
                               std::to_string(raw.size())).c_str());
    const auto* bytes = reinterpret_cast<const uint8_t*>(raw.c_str());
    Header h;
    const HeaderError error = decode_header(bytes, max_payload, h);
    if (error != HeaderError::kOk) throw nb::value_error(describe(error, bytes, max_payload).c_str());
    return nb::make_tuple(h.type, h.flags, h.dtype, h.epoch, h.sender, h.key, h.round, h.status, h.length);
}

nb::bytes encode(uint8_t type, uint64_t length, uint8_t flags, uint8_t dtype, uint32_t epoch, uint32_t sender,
                 uint64_t key, uint32_t round, uint32_t status) {
    Header h;
    h.type = type;
    h.flags = flags;
    h.dtype = dtype;
    h.epoch = epoch;
    h.sender = sender;
    h.key = key;
    h.round = round;
    h.status = status;
    h.length = length;
    uint8_t out[kHeaderSize];
    encode_header(h, out);
    return nb::bytes(reinterpret_cast<const char*>(out), kHeaderSize);
}

// The element count of a wire buffer and an accumulator buffer of dtype code `dtype`, checked to agree.
size_t elements(uint8_t dtype, const Bytes& wire, const Bytes& acc) {
    const size_t wire_size = itemsize(dtype), acc_size = accumulator_itemsize(dtype);
    if (wire_size == 0 || acc_size == 0) throw nb::value_error(("unknown dtype code " + std::to_string(dtype)).c_str());
    if (wire.nbytes() % wire_size || acc.nbytes() != wire.nbytes() / wire_size * acc_size)
        throw nb::value_error(("a wire buffer of " + std::to_string(wire.nbytes()) + " bytes and an accumulator of " +
                               std::to_string(acc.nbytes()) + " bytes hold different numbers of dtype=" +
                               std::to_string(dtype) + " elements").c_str());
    return wire.nbytes() / wire_size;
}

nb::tuple header_tuple(const Header& h) {
    return nb::make_tuple(h.type, h.flags, h.dtype, h.epoch, h.sender, h.key, h.round, h.status, h.length);
}

// A Python sink for the Decoder (protocol/decoder.py's `Sink`): `expecting`, `destination(header)` naming a uint8
// array (None: not now), `arrived(header, array)`. Header tuples as `decode_header` returns them.
struct PythonSink {
    nb::handle sink;
    nb::object named;  // the destination being filled, kept alive until its frame has arrived

    bool expecting() const { return nb::cast<bool>(sink.attr("expecting")); }

    uint8_t* destination(const Header& h) {
        nb::object out = sink.attr("destination")(header_tuple(h));
        if (out.is_none()) return nullptr;
        auto array = nb::cast<nb::ndarray<uint8_t, nb::device::cpu, nb::c_contig>>(out);
        if (array.nbytes() < wire_length(h))
            throw nb::value_error(("a destination of " + std::to_string(array.nbytes()) + " bytes for a payload of " +
                                   std::to_string(wire_length(h))).c_str());
        named = out;
        static uint8_t nothing;  // any pointer but nullptr says go on
        return array.nbytes() ? array.data() : &nothing;
    }

    void arrived(const Header& h, uint8_t*) {
        nb::object out = std::move(named);
        named = nb::object();
        sink.attr("arrived")(header_tuple(h), out);
    }
};

// (key, link, send offset, send bytes, out offset, out bytes, partition index): a part pushes its bytes of the call's
// `send` and its answer lands in the call's `out`, each at its own offset (a gather pushes its segment and pulls all,
// a reduce-scatter pushes all and pulls its slice).
using Plan = std::vector<std::tuple<uint64_t, size_t, uint64_t, uint64_t, uint64_t, uint64_t, int64_t>>;

// One tensor's call as the native worker's parts: each part of `plan`, checked to lie within `send` and `out`.
std::vector<worker::Part> parts_of(const std::string& tensor, uint32_t round, int64_t priority, uint8_t dtype,
                                   const ReadBytes& send, const Bytes& out, const Plan& plan) {
    std::vector<worker::Part> parts(plan.size());
    for (size_t i = 0; i < plan.size(); ++i) {
        const auto& [key, link, send_at, send_bytes, out_at, out_bytes, index] = plan[i];
        if (send_at + send_bytes > send.nbytes() || out_at + out_bytes > out.nbytes())
            throw nb::value_error(("part " + std::to_string(i) + " lies past the buffers").c_str());
        worker::Part& p = parts[i];
        p.key = key, p.round = round, p.dtype = dtype, p.link = link, p.priority = priority;
        p.tensor = tensor, p.index = index;
        p.send = static_cast<const uint8_t*>(send.data()) + send_at, p.push_bytes = send_bytes;
        p.out = static_cast<uint8_t*>(out.data()) + out_at, p.nbytes = out_bytes;
    }
    return parts;
}

// A link's shared-memory slots as Python maps them (transport/shm.py's Arena): (its memory, push slots, pull slots,
// slot bytes).
using SharedSlots = std::tuple<Bytes, uint32_t, uint32_t, uint64_t>;

// A part whose buffers are its own (a compressed key's blocks, an update's trailer): (key, link, partition index,
// what it pushes, the trailer pushed after it or None, where its answer lands).
using BufferPart = std::tuple<uint64_t, size_t, int64_t, ReadBytes, std::optional<ReadBytes>, Bytes>;

std::vector<worker::Part> parts_of(const std::string& tensor, uint32_t round, int64_t priority, uint8_t dtype,
                                   const std::vector<BufferPart>& given) {
    std::vector<worker::Part> parts(given.size());
    for (size_t i = 0; i < given.size(); ++i) {
        const auto& [key, link, index, send, extra, out] = given[i];
        worker::Part& p = parts[i];
        p.key = key, p.round = round, p.dtype = dtype, p.link = link, p.priority = priority;
        p.tensor = tensor, p.index = index;
        p.send = static_cast<const uint8_t*>(send.data()), p.push_bytes = send.nbytes();
        if (extra) {
            p.extra = static_cast<const uint8_t*>(extra->data()), p.extra_bytes = extra->nbytes();
            p.push_bytes += p.extra_bytes;
        }
        p.out = static_cast<uint8_t*>(out.data()), p.nbytes = out.nbytes();
    }
    return parts;
}

// The shared slots Python mapped for a link, checked (none: a socket only).
worker::Arena arena_of(const std::optional<SharedSlots>& given) {
    worker::Arena arena;
    if (given) {
        auto& [memory, push, pull, slot_bytes] = *given;
        if (uint64_t(push + pull) * slot_bytes > memory.nbytes() || push + pull >= worker::kNoSlot)
            throw nb::value_error("shared slots past their memory");
        arena.base = static_cast<uint8_t*>(memory.data());
        arena.push = push, arena.pull = pull, arena.slot_bytes = slot_bytes;
    }
    return arena;
}

// What each part keeps of its answered round for a failover (`keep`: by part, 0 nothing, 1 the sum, 2 what it pushed,
// 3 its sum held in the output until every worker has it: a held key's).
void kept(std::vector<worker::Part>& parts, const std::vector<uint8_t>& keep) {
    if (keep.empty()) return;
    if (keep.size() != parts.size()) throw nb::value_error("`keep` names a different number of parts");
    for (size_t i = 0; i < parts.size(); ++i) {
        if (keep[i] > 3) throw nb::value_error("`keep` is 0, 1, 2 or 3");
        parts[i].keep_sum = keep[i] == 1, parts[i].keep_contribution = keep[i] == 2, parts[i].held = keep[i] == 3;
    }
}

worker::Settings settings_of(uint32_t rank, uint32_t epoch, int64_t window, int64_t cap, int64_t credit,
                             uint64_t max_payload, double timeout) {
    worker::Settings settings;
    settings.rank = rank, settings.epoch = epoch, settings.window = window, settings.cap = cap;
    settings.credit = credit, settings.max_payload = max_payload, settings.timeout = timeout;
    return settings;
}

// Bytes handed in by the caller, given out at most `chunk` at a time (tests cut a stream anywhere with it).
struct BytesSource {
    const uint8_t* data;
    size_t size, at = 0, chunk;
    bool end;  // past the bytes, the stream ends (else: nothing there now)

    ssize_t operator()(iovec* iov, size_t n) {
        if (at == size) return end ? -1 : 0;
        size_t got = 0;
        for (size_t i = 0; i < n && at < size && got < chunk; ++i) {
            const size_t take = std::min({iov[i].iov_len, size - at, chunk - got});
            std::memcpy(iov[i].iov_base, data + at, take);
            at += take;
            got += take;
            if (take < iov[i].iov_len) break;
        }
        return ssize_t(got);
    }
};


}  // namespace

NB_MODULE(_core, m) {
    m.doc() = "gradwire's native data path (C++17): frames, sums, and the native floor";
    // objects a Python program leaves alive at its exit (a worker in a global, a cycle) are not leaks of ours
    nb::set_leak_warnings(false);
    m.attr("HEADER_SIZE") = kHeaderSize;
    m.attr("MAX_CONTROL_BYTES") = kMaxControlBytes;

    m.def("decode_header", &decode, nb::arg("raw"), nb::arg("max_payload"),
          "Decode and validate a 40-byte header: (type, flags, dtype, epoch, sender, key, round, status, length). "
          "Raises ValueError with protocol/frames.py's message for the same bytes.");
    m.def("encode_header", &encode, nb::arg("type"), nb::arg("length"), nb::kw_only(), nb::arg("flags") = 0,
          nb::arg("dtype") = 0, nb::arg("epoch") = 0, nb::arg("sender") = 0, nb::arg("key") = 0, nb::arg("round") = 0,
          nb::arg("status") = 0, "A 40-byte header, packed as protocol/frames.py packs it.");

    m.def(
        "widen",
        [](uint8_t dtype, Bytes wire, Bytes acc) {
            const size_t n = elements(dtype, wire, acc);
            nb::gil_scoped_release released;
            widen(dtype, wire.data(), acc.data(), n);
        },
        nb::arg("dtype"), nb::arg("wire"), nb::arg("acc"), "acc = wire, widened to the accumulator's type.");
    m.def(
        "add_into",
        [](uint8_t dtype, Bytes acc, Bytes wire) {
            const size_t n = elements(dtype, wire, acc);
            nb::gil_scoped_release released;
            add_into(dtype, acc.data(), wire.data(), n);
        },
        nb::arg("dtype"), nb::arg("acc"), nb::arg("wire"), "acc += wire, in the accumulator's precision.");
    m.def(
        "narrow",
        [](uint8_t dtype, Bytes acc, Bytes out) {
            const size_t n = elements(dtype, out, acc);
            nb::gil_scoped_release released;
            narrow(dtype, acc.data(), out.data(), n);
        },
        nb::arg("dtype"), nb::arg("acc"), nb::arg("out"), "out = acc, narrowed to the wire type.");

    nb::class_<floor::Shape>(m, "FloorShape")
        .def(nb::init<uint64_t, uint64_t, uint64_t, uint64_t>(), nb::arg("size"), nb::arg("partition"),
             nb::arg("parts"), nb::arg("window"))
        .def_rw("size", &floor::Shape::size)
        .def_rw("partition", &floor::Shape::partition)
        .def_rw("parts", &floor::Shape::parts)
        .def_rw("window", &floor::Shape::window);
    m.def(
        "floor_serve",
        [](std::vector<int> fds, const floor::Shape& shape, uint64_t index, uint64_t servers, uint64_t repeats) {
            nb::gil_scoped_release released;
            floor::serve(fds, shape, index, servers, repeats);
        },
        nb::arg("fds"), nb::arg("shape"), nb::arg("index"), nb::arg("servers"), nb::arg("repeats"),
        "The native floor's server `index` of `servers`: answer `repeats` calls from the workers on the sockets `fds` "
        "(blocks, without the GIL).");
    m.def(
        "floor_push_pull",
        [](std::vector<int> fds, const floor::Shape& shape, Bytes data, Bytes out, uint32_t round) {
            if (data.nbytes() != shape.size || out.nbytes() != shape.size)
                throw nb::value_error("the floor's input and output must each hold shape.size bytes");
            nb::gil_scoped_release released;
            floor::push_pull(fds, shape, static_cast<const uint8_t*>(data.data()), static_cast<uint8_t*>(out.data()),
                             round);
        },
        nb::arg("fds"), nb::arg("shape"), nb::arg("data"), nb::arg("out"), nb::arg("round"),
        "The native floor's worker: one push_pull of data into out through the servers on `fds` (fds[i] is server i; "
        "blocks, without the GIL).");

    nb::class_<Decoder>(m, "FrameDecoder",
                        "The native frame decoder (link.hpp's Decoder), fed bytes from Python: for the tests that "
                        "feed it and protocol/decoder.py the same streams.")
        .def(nb::init<uint64_t>(), nb::arg("max_payload"))
        .def_prop_ro("mid_frame", &Decoder::mid_frame)
        .def(
            "feed",
            [](Decoder& decoder, nb::bytes data, nb::handle sink, size_t chunk, bool end) {
                if (chunk == 0) throw nb::value_error("chunk must be at least 1");
                BytesSource source{reinterpret_cast<const uint8_t*>(data.c_str()), data.size(), 0, chunk, end};
                PythonSink python{sink, nb::object()};
                decoder.receive(source, python);
                return source.at;
            },
            nb::arg("data"), nb::arg("sink"), nb::arg("chunk") = size_t(1) << 20, nb::arg("end") = false,
            "Decode `data` into `sink`'s frames, received at most `chunk` bytes at a time; returns the bytes taken "
            "(fewer where the sink said not now, or expects nothing more). `end`: the stream ends after `data`.");

    // The per-partition rule (flow.hpp), bound for the tests that feed it and worker/flow.py, worker/credit.py alike.
    nb::class_<flow::Flow>(m, "Flow", "A link's flow control (worker/flow.py's Flow), partitions named by id.")
        .def(nb::init<int64_t, int64_t, double>(), nb::arg("window"), nb::arg("cap") = 0,
             nb::arg("liveness") = flow::kLivenessSeconds)
        .def(
            "push",
            [](flow::Flow& f, int64_t id, uint64_t key, int64_t round, int64_t priority, const std::string& tensor,
               int64_t index, bool seed) {
                flow::Part part;
                part.id = id, part.key = key, part.seed = seed;
                part.order.round = round, part.order.tensor = tensor, part.order.index = index;
                f.push(std::move(part), priority);
            },
            nb::arg("id"), nb::arg("key"), nb::arg("round"), nb::arg("priority"), nb::arg("tensor"), nb::arg("index"),
            nb::arg("seed") = false)
        .def("next", &flow::Flow::next, nb::arg("now"))
        .def("wake_at", &flow::Flow::wake_at)
        .def("on_ack", &flow::Flow::on_ack, nb::arg("key"))
        .def("on_answer", &flow::Flow::on_answer, nb::arg("key"), nb::arg("now"))
        .def("set_limits", &flow::Flow::set_limits, nb::arg("window"), nb::arg("cap"))
        .def("take_queued", &flow::Flow::take_queued)
        .def("take_all", &flow::Flow::take_all)
        .def_prop_ro("window", &flow::Flow::window)
        .def_prop_ro("cap", &flow::Flow::cap)
        .def_prop_ro("in_flight", &flow::Flow::in_flight)
        .def_prop_ro("queued", &flow::Flow::queued)
        .def_prop_ro("pending", &flow::Flow::pending)
        .def_ro("full_seconds", &flow::Flow::full_seconds)
        .def_ro("capped_seconds", &flow::Flow::capped_seconds)
        .def_ro("capped_sends", &flow::Flow::capped_sends)
        .def_ro("cap_escapes", &flow::Flow::cap_escapes)
        .def_ro("last_answer", &flow::Flow::last_answer);
    nb::class_<flow::Credit>(m, "Credit", "A worker's credit and pacing (worker/credit.py's Credit), `now` passed in.")
        .def(nb::init<int64_t, int64_t>(), nb::arg("limit"), nb::arg("lead") = 0)
        .def("set_lead", &flow::Credit::set_lead, nb::arg("lead"))
        .def("pace", &flow::Credit::pace, nb::arg("server"), nb::arg("share"))
        .def("unpace", &flow::Credit::unpace, nb::arg("server"))
        .def("queue", &flow::Credit::queue, nb::arg("server"), nb::arg("n"))
        .def("may_send", &flow::Credit::may_send, nb::arg("server"))
        .def("take", &flow::Credit::take, nb::arg("n"), nb::arg("server"), nb::arg("network"), nb::arg("paced"),
             nb::arg("now"))
        .def("release_all", &flow::Credit::release_all, nb::arg("sizes"), nb::arg("network"), nb::arg("acked"),
             nb::arg("now"))
        .def("busy", &flow::Credit::busy, nb::arg("now"))
        .def_ro("limit", &flow::Credit::limit)
        .def_ro("used", &flow::Credit::used)
        .def_ro("lead", &flow::Credit::lead)
        .def_ro("busy_seconds", &flow::Credit::busy_seconds)
        .def_ro("busy_bytes", &flow::Credit::busy_bytes);

    m.def(
        "worker_push_pull",
        [](std::vector<int> fds, const std::string& tensor, uint32_t round, int64_t priority, uint8_t dtype,
           ReadBytes send, Bytes out, Plan plan, uint32_t rank, uint32_t epoch, int64_t window, int64_t cap, int64_t credit,
           uint64_t max_payload, double timeout) {
            std::vector<worker::Part> parts = parts_of(tensor, round, priority, dtype, send, out, plan);
            const worker::Settings settings = settings_of(rank, epoch, window, cap, credit, max_payload, timeout);
            worker::Counts counts;
            {
                nb::gil_scoped_release released;
                counts = worker::push_pull(fds, settings, parts);
            }
            return nb::make_tuple(counts.pushes, counts.batches, counts.acks);
        },
        nb::arg("fds"), nb::arg("tensor"), nb::arg("round"), nb::arg("priority"), nb::arg("dtype"), nb::arg("send"),
        nb::arg("out"), nb::arg("plan"), nb::kw_only(), nb::arg("rank"), nb::arg("epoch"), nb::arg("window"),
        nb::arg("cap"), nb::arg("credit"), nb::arg("max_payload"), nb::arg("timeout") = 60.0,
        "One tensor's push_pull by the worker's rule (worker.hpp) over the sockets `fds` of links a Python worker "
        "connected: `plan` is its partitions, (key, link, send offset, send bytes, out offset, out bytes, index); "
        "each sum lands in `out` at its offset. Blocks without the GIL; returns (pushes, batches, ACKS frames). Raises RuntimeError with what failed "
        "the call (a server's refusal names the worker, the server, the tensor and the key).");

    nb::class_<worker::Loop>(m, "WorkerLoop",
                             "The native worker as a loop thread of its own (loop.hpp): calls submitted from any "
                             "thread overlap; each completes with '' or what failed it.")
        .def(
            "__init__",
            [](worker::Loop* self, std::vector<int> fds, uint32_t rank, uint32_t epoch, int64_t window, int64_t cap,
               int64_t credit, uint64_t max_payload, std::vector<double> shares, int64_t lead, double pace_give_up,
               std::vector<double> buckets, std::vector<std::optional<SharedSlots>> arenas, bool failover) {
                worker::Settings settings = settings_of(rank, epoch, window, cap, credit, max_payload, 0);
                settings.shares = std::move(shares), settings.lead = lead, settings.pace_give_up = pace_give_up;
                settings.buckets = std::move(buckets);
                for (auto& given : arenas) settings.arenas.push_back(arena_of(given));
                settings.failover = failover;
                new (self) worker::Loop(fds, settings);
            },
            nb::arg("fds"), nb::kw_only(), nb::arg("rank"), nb::arg("epoch"), nb::arg("window"), nb::arg("cap"),
            nb::arg("credit"), nb::arg("max_payload"), nb::arg("shares") = std::vector<double>{}, nb::arg("lead") = 0,
            nb::arg("pace_give_up") = 0.2, nb::arg("buckets") = std::vector<double>{},
            nb::arg("arenas") = std::vector<std::optional<SharedSlots>>{}, nb::arg("failover") = false,
            "`shares`: each link's share of the bytes for pacing (0: not paced), `lead`: pacing's lead in bytes (0: "
            "no pacing), `pace_give_up`: the most seconds a push waits for its pacing turn (worker/credit.py); "
            "`buckets`: the stage histogram's bounds in seconds (none: no histogram); `arenas`: by link, None or "
            "its shared-memory slots (memory, push slots, pull slots, slot bytes), which must outlive the loop; "
            "`failover`: a link its server closes keeps its parts for the key's next server (completion (0, 'server S: "
            "why') says so), and each answered round is kept as its key's seed where `keep` asks.")
        .def(
            "submit",
            [](worker::Loop& loop, uint64_t call, const std::string& tensor, uint32_t round, int64_t priority,
               uint8_t dtype, ReadBytes send, Bytes out, Plan plan, std::vector<uint8_t> keep) {
                std::vector<worker::Part> parts = parts_of(tensor, round, priority, dtype, send, out, plan);
                kept(parts, keep);
                loop.submit(call, std::move(parts));
            },
            nb::arg("call"), nb::arg("tensor"), nb::arg("round"), nb::arg("priority"), nb::arg("dtype"),
            nb::arg("send"), nb::arg("out"), nb::arg("plan"), nb::arg("keep") = std::vector<uint8_t>{},
            "Queue one tensor's call (as worker_push_pull's arguments); `send` and `out` must stay alive until its "
            "completion is taken. `keep` (failover on; none: nothing kept): by part, what the loop keeps of its answered "
            "round as the key's seed: 0 nothing, 1 the sum, 2 what this worker pushed (a sliced round), 3 the sum held "
            "in the output until the server says every worker has it (a held key's: the call completes then).")
        .def(
            "submit_parts",
            [](worker::Loop& loop, uint64_t call, const std::string& tensor, uint32_t round, int64_t priority,
               uint8_t dtype, const std::vector<BufferPart>& given, std::vector<uint8_t> keep) {
                std::vector<worker::Part> parts = parts_of(tensor, round, priority, dtype, given);
                kept(parts, keep);
                loop.submit(call, std::move(parts));
            },
            nb::arg("call"), nb::arg("tensor"), nb::arg("round"), nb::arg("priority"), nb::arg("dtype"),
            nb::arg("parts"), nb::arg("keep") = std::vector<uint8_t>{},
            "Queue one tensor's call whose parts have buffers of their own: [(key, link, index, send, trailer or "
            "None, out)], each a uint8 array that must stay alive until the call's completion is taken.")
        .def("completions", &worker::Loop::completions, nb::arg("timeout"), nb::call_guard<nb::gil_scoped_release>(),
             "The calls finished since the last time: [(call, '' or what failed it)], waiting up to `timeout` s.")
        .def("set_limits", &worker::Loop::set_limits, nb::arg("window"), nb::arg("cap"), nb::arg("lead"),
             "Every link's window and cap, and pacing's lead, from the next decision on.")
        .def("seeds", &worker::Loop::seeds, nb::arg("keys"), nb::call_guard<nb::gil_scoped_release>(),
             "Failover: of `keys`, those whose last answered round the loop keeps: [(key, round, whether it is this "
             "worker's contribution rather than the sum)].")
        .def("unanswered", &worker::Loop::unanswered, nb::arg("keys"), nb::call_guard<nb::gil_scoped_release>(),
             "Of `keys`, those in flight (queued, pushed, or waiting for a lost server's successor): [(key, round)].")
        .def("orphans", &worker::Loop::orphans, nb::arg("link"), nb::call_guard<nb::gil_scoped_release>(),
             "Failover: what the lost link holds unanswered, [(key, round)] (a link not lost yet is lost now: the "
             "scheduler saw its server's death first).")
        .def("reroute", &worker::Loop::reroute, nb::arg("link"), nb::arg("owners"),
             nb::call_guard<nb::gil_scoped_release>(),
             "Failover: the lost link's parts, and any submitted to it later, go to the link `owners` names for their "
             "key ({key: link}).")
        .def(
            "replace",
            [](worker::Loop& loop, size_t link, int fd, std::optional<SharedSlots> slots, uint32_t epoch) {
                const worker::Arena arena = arena_of(slots);
                nb::gil_scoped_release released;
                loop.replace(link, fd, arena, epoch);
            },
            nb::arg("link"), nb::arg("fd"), nb::arg("arena").none(), nb::arg("epoch"),
            "Failover: a standby's socket (and its shared slots, or None), connected in the worker's epoch `epoch`, "
            "in the lost link's place; `reroute` then moves the parts onto it.")
        .def("where", &worker::Loop::where, nb::arg("tensor"), nb::call_guard<nb::gil_scoped_release>(),
             "([links with parts of `tensor` queued, pushed or orphaned], [links whose sums of it are held]).")
        .def("finish_held", &worker::Loop::finish_held, nb::arg("link"), nb::call_guard<nb::gil_scoped_release>(),
             "Failover: the parts the lost link held are done (the failover is over: no seed of theirs is needed).")
        .def("seed_bytes", &worker::Loop::seed_bytes, nb::call_guard<nb::gil_scoped_release>(),
             "Failover: the bytes of every key's kept round (what this worker keeps for a failover).")
        .def("push_seed", &worker::Loop::push_seed, nb::arg("key"), nb::arg("round"), nb::arg("link"),
             nb::arg("flags") = 0, nb::call_guard<nb::gil_scoped_release>(),
             "Failover: push the key's kept round to `link`, flagged REPLAY (a contribution) or SEED, and `flags`; "
             "False where the loop keeps no such round.")
        .def("stop", &worker::Loop::stop, nb::arg("why") = "the native worker stopped",
             nb::call_guard<nb::gil_scoped_release>())
        .def_prop_ro("counts", [](const worker::Loop& loop) {
            const worker::Counts c = loop.counts();
            return nb::make_tuple(c.pushes, c.batches, c.acks);
        })
        .def(
            "take_stages",
            [](worker::Loop& loop) {
                worker::Stages stages = loop.take_stages();
                return nb::make_tuple(stages.counts, stages.seconds);
            },
            "The stage histogram of the partitions answered since the last call, ([per stage: partitions per bucket, "
            "and past the last], [per stage: seconds in all]); empty lists when none was answered.")
        .def("trace", &worker::Loop::trace, nb::arg("on"),
             "Keep each answered partition's stages for the timeline (`take_traced`), or stop keeping them.")
        .def(
            "take_traced",
            [](worker::Loop& loop) {
                auto [traced, dropped] = loop.take_traced();
                nb::list rows;
                for (const worker::Traced& t : traced)
                    rows.append(nb::make_tuple(t.tensor, t.key, t.round, t.nbytes, t.link, t.queued, t.sent, t.pushed,
                                               t.result, t.done, t.credit_used));
                return nb::make_tuple(rows, dropped);
            },
            "The partitions answered since the last call while tracing: ([(tensor, key, round, bytes, link, queued, "
            "sent, pushed, result, done, credit used)], dropped past the bound), times as time.monotonic()'s.")
        .def_prop_ro(
            "cap_escapes", [](const worker::Loop& loop) { return loop.counts().cap_escapes; },
            "Pushes the liveness rule let past a full cap so far, all links (as of the loop's last pass).")
        .def_prop_ro(
            "credit_used", [](const worker::Loop& loop) { return loop.counts().credit_used; },
            "Bytes pushed and not yet acknowledged, all links (as of the loop's last pass).")
        .def_prop_ro(
            "link_use",
            [](const worker::Loop& loop) {
                const worker::Counts c = loop.counts();
                return nb::make_tuple(c.busy_seconds, c.busy_bytes, c.full_seconds);
            },
            "(seconds some push was unacknowledged, bytes acknowledged, seconds work waited on a full window), as of "
            "the loop's last pass (at most a second old): the links' use for the scheduler's drift check.");

    // A server's data path (server.hpp): Python hands it each worker's socket after the handshake and gets back
    // what it keeps (server/native_path.py).
    nb::class_<server::Loop>(m, "ServerLoop",
                             "A server's worker links and the rounds of its plain keys, on a thread of their own.")
        .def(
            "__init__",
            [](server::Loop* self, uint32_t rank, uint32_t epoch, uint32_t workers, uint64_t max_payload,
               double frame_timeout) {
                server::Settings settings;
                settings.rank = rank, settings.epoch = epoch, settings.workers = workers;
                settings.max_payload = max_payload, settings.frame_timeout = frame_timeout;
                new (self) server::Loop(settings);
            },
            nb::arg("rank"), nb::arg("epoch"), nb::arg("workers"), nb::arg("max_payload"),
            nb::arg("frame_timeout") = 60.0)
        .def(
            "add",
            [](server::Loop& loop, uint32_t worker, int fd, nb::bytes ahead) {
                std::vector<uint8_t> bytes(reinterpret_cast<const uint8_t*>(ahead.c_str()),
                                           reinterpret_cast<const uint8_t*>(ahead.c_str()) + ahead.size());
                nb::gil_scoped_release release;
                loop.add(worker, fd, std::move(bytes));
            },
            nb::arg("worker"), nb::arg("fd"), nb::arg("ahead") = nb::bytes(""),
            "Worker `worker`'s socket after its handshake, with the bytes the handshake read ahead.")
        .def(
            "attach",
            [](server::Loop& loop, uint32_t worker, const SharedSlots& slots) {
                const worker::Arena arena = arena_of(slots);
                nb::gil_scoped_release release;
                loop.attach(worker, arena);
            },
            nb::arg("worker"), nb::arg("slots"), "The worker's shared slots: (memory, push, pull, slot bytes).")
        .def("close", &server::Loop::close, nb::arg("worker"), nb::call_guard<nb::gil_scoped_release>(),
             "The worker's link leaves the loop (a closed event follows).")
        .def(
            "send",
            [](server::Loop& loop, uint32_t worker, nb::bytes frame) {
                std::vector<uint8_t> bytes(reinterpret_cast<const uint8_t*>(frame.c_str()),
                                           reinterpret_cast<const uint8_t*>(frame.c_str()) + frame.size());
                nb::gil_scoped_release release;
                loop.send(worker, std::move(bytes));
            },
            nb::arg("worker"), nb::arg("frame"), "One whole frame to the worker, in order with the loop's replies.")
        .def("declare", &server::Loop::declare, nb::arg("key"), nb::arg("dtype"), nb::arg("length"), nb::arg("name"),
             nb::arg("members"), nb::arg("native"), nb::call_guard<nb::gil_scoped_release>(),
             "A key: summed here (`native`) or handed to Python; `members`: its ranks (empty: every worker).")
        .def("set_joined", &server::Loop::set_joined, nb::arg("mask"), nb::call_guard<nb::gil_scoped_release>())
        .def("set_departed", &server::Loop::set_departed, nb::arg("mask"), nb::call_guard<nb::gil_scoped_release>())
        .def("reset", &server::Loop::reset, nb::arg("workers"), nb::arg("forget"),
             nb::call_guard<nb::gil_scoped_release>())
        .def("set_identity", &server::Loop::set_identity, nb::arg("rank"), nb::arg("epoch"),
             nb::call_guard<nb::gil_scoped_release>())
        .def(
            "events",
            [](server::Loop& loop, double timeout) {
                std::vector<server::Event> events;
                {
                    nb::gil_scoped_release release;
                    events = loop.events(timeout);
                }
                nb::list out;
                for (server::Event& e : events) {
                    nb::object body = nb::none();
                    if (e.body) {  // the payload as a uint8 array that owns it
                        auto* owned = new std::shared_ptr<std::vector<uint8_t>>(std::move(e.body));
                        nb::capsule keep(owned, [](void* p) noexcept {
                            delete static_cast<std::shared_ptr<std::vector<uint8_t>>*>(p);
                        });
                        const size_t shape[1] = {(*owned)->size()};
                        body = nb::cast(nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>((*owned)->data(), 1, shape, keep));
                    }
                    out.append(nb::make_tuple(int(e.kind), e.worker, header_tuple(e.header), body, e.why, e.routine,
                                              e.ranks));
                }
                return out;
            },
            nb::arg("timeout"),
            "What happened since the last call, waiting up to `timeout` seconds: (kind, worker, header tuple, payload "
            "or None, why, routine, ranks) each; kinds 0 a frame for Python, 1 a link ended, 2 a held round answered.")
        .def(
            "take_counts",
            [](server::Loop& loop) {
                const server::Counts c = loop.take_counts();
                return nb::make_tuple(c.pushed, c.pulled, c.rounds, c.seeded_answers);
            },
            "(bytes pushed, bytes pulled, rounds answered to every worker, seeded answers) since the last call.")
        .def("stalled", &server::Loop::stalled, nb::arg("now"), nb::arg("threshold"), nb::call_guard<nb::gil_scoped_release>())
        .def("sizes", &server::Loop::sizes, nb::call_guard<nb::gil_scoped_release>(),
             "(keys summed here, bytes of the buffers its pool has made).")
        .def("stop", &server::Loop::stop, nb::call_guard<nb::gil_scoped_release>());

    nb::register_exception_translator([](const std::exception_ptr& p, void*) {
        try {
            std::rethrow_exception(p);
        } catch (const ProtocolError& e) {
            PyErr_SetString(PyExc_ValueError, e.what());
        } catch (const LinkClosed& e) {
            PyErr_SetString(PyExc_ConnectionError, e.what());

        }
    });
}
