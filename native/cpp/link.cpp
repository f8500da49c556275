#include "link.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <system_error>

namespace gradwire {

namespace {
size_t power_of_two_at_least(size_t n) {
    size_t p = 1;
    while (p < n) p <<= 1;
    return p;
}
}  // namespace

Link::Link(int fd, uint64_t max_payload, size_t queue_capacity)
    : fd_(fd), max_payload_(max_payload), queue_(power_of_two_at_least(queue_capacity)) {
    flags_ = ::fcntl(fd_, F_GETFL);
    if (flags_ < 0 || ::fcntl(fd_, F_SETFL, flags_ | O_NONBLOCK) < 0)
        throw std::system_error(errno, std::generic_category(), "fcntl on the link's socket");
}

Link::~Link() { ::fcntl(fd_, F_SETFL, flags_); }  // the caller's socket as it was

void Link::queue(const Header& h, const uint8_t* payload, uint64_t tag) {
    if (!can_queue()) throw std::logic_error("a link's send queue is full: the caller's window should bound it");
    Outgoing& o = at(tail_++);
    encode_header(h, o.header);
    o.payload = payload;
    o.length = h.length;
    o.tag = tag;
}

bool Link::header_in() {
    if (header_got_ < kHeaderSize) return false;
    const HeaderError error = decode_header(header_bytes_, max_payload_, header_);
    if (error != HeaderError::kOk) throw ProtocolError(describe(error, header_bytes_, max_payload_));
    reading_ = Reading::kDestination;
    header_got_ = 0;
    return true;
}

void Link::fail(const char* what, int err) {
    throw LinkClosed(std::string("the link's ") + what + " failed: " + std::strerror(err));
}

}  // namespace gradwire
