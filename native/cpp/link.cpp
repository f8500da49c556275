#include "link.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
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
    : fd_(fd), queue_(power_of_two_at_least(queue_capacity)), decoder_(max_payload) {
    flags_ = ::fcntl(fd_, F_GETFL);
    if (flags_ < 0 || ::fcntl(fd_, F_SETFL, flags_ | O_NONBLOCK) < 0)
        throw std::system_error(errno, std::generic_category(), "fcntl on the link's socket");
    int domain = 0, type = 0, lowat = 0;
    socklen_t size = sizeof(int);
    tcp_ = ::getsockopt(fd_, SOL_SOCKET, SO_DOMAIN, &domain, &size) == 0 && (domain == AF_INET || domain == AF_INET6) &&
           ::getsockopt(fd_, SOL_SOCKET, SO_TYPE, &type, &size) == 0 && type == SOCK_STREAM &&
           ::getsockopt(fd_, SOL_SOCKET, SO_RCVLOWAT, &lowat, &size) == 0 && lowat == 1;
}

Link::~Link() {  // the caller's socket as it was: a blocking receive would wait for the mark
    if (lowat_ != 1) await(0);
    ::fcntl(fd_, F_SETFL, flags_);
}

void Link::await(uint64_t bytes) {
    const int mark = bytes > kLowatMin ? int(std::min(bytes, kMaxLowat)) : 1;
    if (mark == lowat_) return;
    if (::setsockopt(fd_, SOL_SOCKET, SO_RCVLOWAT, &mark, sizeof mark) == 0)
        lowat_ = mark;
    else
        tcp_ = false;  // not this socket's: readiness stays the kernel's default
}

void Link::queue(const Header& h, const uint8_t* payload, uint64_t tag, const uint8_t* trailer,
                 uint64_t trailer_length) {
    if (!can_queue()) throw std::logic_error("a link's send queue is full: the caller's window should bound it");
    const uint64_t wire = wire_length(h);  // none for a payload in shared memory
    if (trailer_length > wire) throw std::logic_error("a frame's trailer is longer than its payload on the wire");
    Outgoing& o = at(tail_++);
    encode_header(h, o.header);
    o.payload = payload;
    o.length = wire - trailer_length;
    o.trailer = trailer;
    o.trailer_length = trailer_length;
    o.tag = tag;
}

ssize_t Link::operator()(iovec* iov, size_t n) {
    if (ahead_at_ < ahead_.size()) {
        size_t got = 0;
        for (size_t i = 0; i < n && ahead_at_ < ahead_.size(); ++i) {
            const size_t take = std::min(iov[i].iov_len, ahead_.size() - ahead_at_);
            std::memcpy(iov[i].iov_base, ahead_.data() + ahead_at_, take);
            ahead_at_ += take, got += take;
        }
        if (ahead_at_ == ahead_.size()) ahead_.clear(), ahead_at_ = 0;
        return ssize_t(got);
    }
    if (drained_) return 0;
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = n;
    for (;;) {
        const ssize_t got = ::recvmsg(fd_, &msg, MSG_DONTWAIT);
        if (got > 0) {
            size_t asked = 0;
            for (size_t i = 0; i < n; ++i) asked += iov[i].iov_len;
            drained_ = size_t(got) < asked;
            return got;
        }
        if (got == 0) return -1;  // the end of the stream
        if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
        if (errno != EINTR) fail("receive", errno);
    }
}

void Link::fail(const char* what, int err) {
    throw LinkClosed(std::string("the link's ") + what + " failed: " + std::strerror(err));
}

}  // namespace gradwire
