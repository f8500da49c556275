// A link: one non-blocking stream socket carrying frames, with nothing allocated per frame.
//
// Sending: frames are queued (the header copied into the queue, the payload borrowed until sent) and `flush` hands
// as many as the socket takes to one sendmsg (up to kMaxIov buffers: several frames a system call, as gloo's pairs
// write a frame with one writev). Receiving: the link's `Decoder` (protocol/decoder.py's state machine, knowing no
// socket) reads until the socket is empty; a payload lands straight in the buffer its sink names for that header, and
// the same recvmsg reads ahead into the next header, so a frame in the steady state costs one system call. A sink
// that names no buffer (nullptr: no slot free) stops the reading with the header kept, and the next `receive` asks
// again: backpressure, never an unbounded buffer.
//
// Not thread-safe: one thread owns a link (the loop that polls its socket).
#pragma once

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "frames.hpp"

namespace gradwire {

// The peer broke the protocol (a header that does not validate, a frame the sink refuses): drop the connection.
struct ProtocolError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// The connection closed or failed.
struct LinkClosed : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// The frame decoder: bytes in, frames out (protocol/decoder.py is the reference; tests feed both the same bytes).
// A source is called as `source(iov, n)`: one receive into the n buffers in order, returning the bytes received, 0
// when none are there now, or -1 at the end of the stream (throwing LinkClosed when it fails). For each header,
// validated, `sink.destination(h)` checks it (throwing ProtocolError to refuse it) and names where its payload goes
// (nullptr: not now; for a frame with no payload on the stream any other pointer means go on); `sink.arrived(h,
// data)` follows once the payload is in. Between frames, reading stops once `sink.expecting()` is false (a peer that
// has sent all it owes may close: that end of file is no error).
class Decoder {
   public:
    explicit Decoder(uint64_t max_payload) : max_payload_(max_payload) {}

    // Whether a frame has begun and is not whole (a header waiting for its destination, a payload, bytes read ahead).
    bool mid_frame() const { return reading_ != Reading::kHeader || header_got_ > 0; }
    // The bytes of the payload under way still to come (0 where none is: a header is what comes next).
    uint64_t awaited() const { return reading_ == Reading::kPayload ? wire_length(header_) - payload_got_ : 0; }

    // Decode what `source` has now into `sink`'s frames. Throws ProtocolError or LinkClosed, and what they throw.
    template <typename Source, typename Sink>
    void receive(Source& source, Sink& sink);

   private:
    enum class Reading { kHeader, kDestination, kPayload };

    uint64_t max_payload_;
    Reading reading_ = Reading::kHeader;
    uint8_t header_bytes_[kHeaderSize];
    size_t header_got_ = 0;
    Header header_;
    uint8_t* destination_ = nullptr;
    uint64_t payload_got_ = 0;
};

class Link {
   public:
    static constexpr size_t kMaxIov = 64;

    // Takes the socket `fd` (not its ownership) and makes it non-blocking until the link is destroyed.
    Link(int fd, uint64_t max_payload, size_t queue_capacity = 64);
    ~Link();
    Link(const Link&) = delete;
    Link& operator=(const Link&) = delete;

    // Frames queued and not yet wholly sent.
    size_t queued() const { return tail_ - head_; }
    bool can_queue() const { return queued() < queue_.size(); }

    // Queue a frame; its payload on the wire (h.length bytes, none where it lies in shared memory: wire_length) is
    // `payload` and then `trailer_length` bytes of `trailer` (a server-side update's trailer after its data), both
    // valid until `flush` reports the frame sent.
    // Throws std::logic_error when the queue is full (callers check can_queue: their windows bound it).
    void queue(const Header& h, const uint8_t* payload, uint64_t tag, const uint8_t* trailer = nullptr,
               uint64_t trailer_length = 0);

    // Send what the socket takes; `sent(tag)` is called for each frame wholly sent, in order.
    // True when the queue is empty. Throws LinkClosed when the socket fails.
    template <typename Sent>
    bool flush(Sent&& sent);

    // Read what has arrived into `sink`'s frames (Decoder). Throws ProtocolError or LinkClosed. Where a payload is
    // under way, the socket is readable again only once more of it than kLowatMin is in (`await`).
    template <typename Sink>
    void receive(Sink& sink) {
        drained_ = false;
        decoder_.receive(*this, sink);
        if (tcp_) await(decoder_.awaited());
    }

    // One receive from the socket (a Decoder's source); bytes read ahead (`prepend`) first. After a receive that
    // filled less than it was given the socket was empty: the next returns 0 without asking it again (the poll is
    // level-triggered, so what arrives meanwhile wakes the loop), a third of the receives on a slow link.
    ssize_t operator()(iovec* iov, size_t n);

    // Bytes already read from the socket by someone else (a handshake's read-ahead): the next receives return them
    // before the socket's.
    void prepend(std::vector<uint8_t> bytes) {
        ahead_ = std::move(bytes);
        ahead_at_ = 0;
    }
    // Whether a frame has begun and is not whole.
    bool mid_frame() const { return decoder_.mid_frame(); }

   private:
    struct Outgoing {
        uint8_t header[kHeaderSize];
        const uint8_t* payload;
        uint64_t length;  // of the payload before the trailer
        const uint8_t* trailer;
        uint64_t trailer_length;
        uint64_t tag;
    };

    Outgoing& at(size_t i) { return queue_[i & (queue_.size() - 1)]; }
    [[noreturn]] void fail(const char* what, int err);
    // A slow link delivers a payload a TCP segment at a time, and the loop would wake for each (a 16 KiB partition at
    // 50 Mbit/s: a dozen passes); SO_RCVLOWAT makes the socket readable once `bytes` are in (at most kMaxLowat: the
    // kernel clamps the receive window to a larger mark it has to grow the buffer for), 1 again between payloads.
    void await(uint64_t bytes);
    static constexpr uint64_t kLowatMin = 4096, kMaxLowat = 16384;

    int fd_;
    int flags_;
    bool tcp_ = false;  // a TCP socket: SO_RCVLOWAT holds its readiness (`await`)
    int lowat_ = 1;
    bool drained_ = false;  // this `receive` found the socket empty
    std::vector<Outgoing> queue_;  // a ring: capacity a power of two, head_ and tail_ count up
    size_t head_ = 0, tail_ = 0;
    size_t head_sent_ = 0;  // bytes of the head frame (header and payload) already sent
    iovec iov_[kMaxIov];
    Decoder decoder_;
    std::vector<uint8_t> ahead_;
    size_t ahead_at_ = 0;
};

template <typename Sent>
bool Link::flush(Sent&& sent) {
    while (head_ != tail_) {
        size_t n = 0;
        for (size_t i = head_; i != tail_ && n + 3 <= kMaxIov; ++i) {
            Outgoing& o = at(i);
            const size_t skip = i == head_ ? head_sent_ : 0;  // only the head frame can be part-sent
            if (skip < kHeaderSize) iov_[n++] = {o.header + skip, kHeaderSize - skip};
            const size_t payload_skip = skip > kHeaderSize ? skip - kHeaderSize : 0;
            if (o.length > payload_skip)
                iov_[n++] = {const_cast<uint8_t*>(o.payload) + payload_skip, o.length - payload_skip};
            const size_t trailer_skip = payload_skip > o.length ? payload_skip - o.length : 0;
            if (o.trailer_length > trailer_skip)
                iov_[n++] = {const_cast<uint8_t*>(o.trailer) + trailer_skip, o.trailer_length - trailer_skip};
        }
        msghdr msg{};
        msg.msg_iov = iov_;
        msg.msg_iovlen = n;
        const ssize_t wrote = ::sendmsg(fd_, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (wrote < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) return false;
            if (errno == EINTR) continue;
            fail("send", errno);
        }
        size_t left = size_t(wrote) + head_sent_;
        while (head_ != tail_) {  // retire the frames wholly sent
            Outgoing& o = at(head_);
            const size_t whole = kHeaderSize + o.length + o.trailer_length;
            if (left < whole) break;
            left -= whole;
            ++head_;
            sent(o.tag);
        }
        head_sent_ = left;
    }
    return true;
}

template <typename Source, typename Sink>
void Decoder::receive(Source& source, Sink& sink) {
    for (;;) {
        if (reading_ == Reading::kHeader) {
            if (!sink.expecting()) return;
            if (header_got_ < kHeaderSize) {
                iovec iov{header_bytes_ + header_got_, kHeaderSize - header_got_};
                const ssize_t got = source(&iov, 1);
                if (got < 0)
                    throw LinkClosed(header_got_ ? "the peer closed the connection in the middle of a frame"
                                                 : "the peer closed the connection");
                if (got == 0) return;
                header_got_ += size_t(got);
                continue;
            }
            const HeaderError error = decode_header(header_bytes_, max_payload_, header_);
            if (error != HeaderError::kOk) throw ProtocolError(describe(error, header_bytes_, max_payload_));
            reading_ = Reading::kDestination;
            header_got_ = 0;
        }
        if (reading_ == Reading::kDestination) {
            // every frame is the sink's to check, an empty one too (its destination is then only a yes)
            destination_ = sink.destination(static_cast<const Header&>(header_));
            if (destination_ == nullptr) return;  // no room: asked again at the next receive
            reading_ = Reading::kPayload;
            payload_got_ = 0;
        }
        const uint64_t wire = wire_length(header_);
        if (payload_got_ < wire) {
            // the payload's rest straight into its destination, and the next header along with it
            iovec iov[2] = {{destination_ + payload_got_, wire - payload_got_}, {header_bytes_, kHeaderSize}};
            const ssize_t got = source(iov, 2);
            if (got < 0) throw LinkClosed("the peer closed the connection in the middle of a frame");
            if (got == 0) return;
            const uint64_t into_payload = std::min<uint64_t>(uint64_t(got), wire - payload_got_);
            payload_got_ += into_payload;
            header_got_ = size_t(uint64_t(got) - into_payload);  // read ahead: the next header's first bytes
            if (payload_got_ < wire) continue;
        }
        reading_ = Reading::kHeader;
        const Header done = header_;
        sink.arrived(done, destination_);
    }
}

}  // namespace gradwire
