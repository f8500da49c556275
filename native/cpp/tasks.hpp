// Work handed to a loop's thread by other threads, each call waiting for its task's result (a loop's state is its
// thread's alone). Once the loop has ended (`end`), a task runs on its caller's thread instead, one at a time.
#pragma once

#include <functional>
#include <future>
#include <mutex>
#include <utility>
#include <vector>

namespace gradwire {

class Tasks {
   public:
    // Run `task` on the loop's thread, woken by `wake()`, and return its result (once the loop has ended: here).
    template <typename F, typename Wake>
    auto run(F&& task, Wake&& wake) {
        std::packaged_task<decltype(task())()> job(std::forward<F>(task));
        auto result = job.get_future();
        bool here = false;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            if (ended_)
                here = true;  // the thread has ended: nothing else touches the loop's state
            else
                pending_.emplace_back([&job] { job(); });
        }
        if (here) {
            std::lock_guard<std::mutex> alone(alone_);
            job();
        } else {
            wake();
        }
        return result.get();
    }

    // The loop's thread: run what was handed to it.
    void run_pending() {
        std::vector<std::function<void()>> tasks;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            tasks.swap(pending_);
        }
        for (auto& task : tasks) task();
    }

    // The loop's thread has ended: what was handed to it as it ended runs here, later tasks on their callers' threads.
    void end() {
        std::vector<std::function<void()>> tasks;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            ended_ = true;
            tasks.swap(pending_);
        }
        std::lock_guard<std::mutex> alone(alone_);
        for (auto& task : tasks) task();
    }

   private:
    std::mutex mutex_;
    std::mutex alone_;  // tasks run on callers' threads take turns
    std::vector<std::function<void()>> pending_;
    bool ended_ = false;
};

}  // namespace gradwire
