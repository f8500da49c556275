// Sockets under one epoll (a link loop's): level-triggered, each socket's interest changed only when its wants do.
#pragma once

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <chrono>

#include <cerrno>
#include <cstdint>
#include <stdexcept>
#include <system_error>
#include <vector>

namespace gradwire {

constexpr uint32_t kInput = EPOLLIN | EPOLLERR | EPOLLHUP;  // readable, or its end: a receive says which

// A loop's clock: the steady clock's seconds (Python's time.monotonic).
inline double monotonic() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// A loop's wake-up: an eventfd it polls beside its sockets, written by the threads that hand it work.
inline int make_eventfd() {
    const int fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (fd < 0) throw std::system_error(errno, std::generic_category(), "eventfd");
    return fd;
}

// Sockets under one epoll, level-triggered; a socket's interest changes only when its wants do.
class Poll {
   public:
    explicit Poll(const std::vector<int>& fds) : fds_(fds), events_(fds.size(), EPOLLIN) {
        epoll_ = ::epoll_create1(EPOLL_CLOEXEC);
        if (epoll_ < 0) throw std::system_error(errno, std::generic_category(), "epoll_create1");
        try {
            for (size_t i = 0; i < fds.size(); ++i) control(EPOLL_CTL_ADD, i, EPOLLIN);
        } catch (...) {
            ::close(epoll_);  // no destructor runs for a constructor that throws
            throw;
        }
    }
    ~Poll() { ::close(epoll_); }
    Poll(const Poll&) = delete;
    Poll& operator=(const Poll&) = delete;

    // Stop watching socket i (its peer may close it now: epoll reports a hang-up whatever the interest). A socket
    // closed already has left the epoll by itself: nothing to do.
    void remove(size_t i) {
        if (events_[i] == kRemoved) return;
        epoll_event e{};
        if (::epoll_ctl(epoll_, EPOLL_CTL_DEL, fds_[i], &e) < 0 && errno != EBADF && errno != ENOENT)
            throw std::system_error(errno, std::generic_category(), "epoll_ctl");
        events_[i] = kRemoved;
    }

    // Watch socket `fd` too, as the next index (returned).
    size_t add(int fd) {
        fds_.push_back(fd);
        events_.push_back(EPOLLIN);
        try {
            control(EPOLL_CTL_ADD, fds_.size() - 1, EPOLLIN);
        } catch (...) {
            fds_.pop_back(), events_.pop_back();  // an `add` that failed leaves nothing behind
            throw;
        }
        return fds_.size() - 1;
    }

    // Watch socket `fd` as socket i from now on (one removed before: a lost link's replacement).
    void replace(size_t i, int fd) {
        if (events_[i] != kRemoved) throw std::logic_error("a socket is replaced while still watched");
        epoll_event e{};
        e.events = EPOLLIN;
        e.data.u64 = i;
        if (::epoll_ctl(epoll_, EPOLL_CTL_ADD, fd, &e) < 0)
            throw std::system_error(errno, std::generic_category(), "epoll_ctl");
        fds_[i] = fd;
        events_[i] = EPOLLIN;
    }

    void want(size_t i, bool readable, bool writable) {
        if (events_[i] == kRemoved) throw std::logic_error("a socket removed from the poll is wanted again");
        const uint32_t events = (readable ? EPOLLIN : 0u) | (writable ? EPOLLOUT : 0u);
        if (events != events_[i]) control(EPOLL_CTL_MOD, i, events);
        events_[i] = events;
    }

    // Wait up to `timeout_ms` for events; `ready[0..n)` are (socket index, events); 0: none came in time.
    int wait(epoll_event* ready, int max, int timeout_ms) {
        for (;;) {
            const int n = ::epoll_wait(epoll_, ready, max, timeout_ms);
            if (n >= 0) return n;
            if (errno != EINTR) throw std::system_error(errno, std::generic_category(), "epoll_wait");
        }
    }

   private:
    static constexpr uint32_t kRemoved = ~0u;

    void control(int op, size_t i, uint32_t events) {
        epoll_event e{};
        e.events = events;
        e.data.u64 = i;
        if (::epoll_ctl(epoll_, op, fds_[i], &e) < 0)
            throw std::system_error(errno, std::generic_category(), "epoll_ctl");
    }

    std::vector<int> fds_;
    std::vector<uint32_t> events_;
    int epoll_;
};

}  // namespace gradwire
