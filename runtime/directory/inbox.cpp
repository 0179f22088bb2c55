// The inbox thread of a published name (directory.hpp, Inbox).
#include "directory/directory.hpp"

#include <chrono>

namespace sg::directory {

Inbox::Inbox(Take take, std::function<void()> interrupt, Answer answer)
    : take_(std::move(take)), interrupt_(std::move(interrupt)), answer_(std::move(answer)) {}

Inbox::~Inbox() { stop(); }

bool Inbox::serve(const std::string &name) {
    std::lock_guard lock(mu_);
    if (!name_.empty() || stopping_) return false;
    name_ = name;
    thread_ = std::thread([this] { loop(); });
    return true;
}

bool Inbox::serving() const {
    std::lock_guard lock(mu_);
    return !name_.empty() && !stopping_;
}

void Inbox::stop() {
    {
        std::lock_guard lock(mu_);
        stopping_ = true;
    }
    cv_.notify_all();
    if (interrupt_) interrupt_();  // ends the thread's watch now
    if (thread_.joinable()) thread_.join();
}

void Inbox::loop() {
    std::unique_lock lock(mu_);
    while (!stopping_) {
        const std::string name = name_;
        lock.unlock();
        bool failed = false;
        try {
            // One watch stream an inbox, idle until a request comes (stop interrupts it).
            if (auto req = take_(name, now_ns() + 30 * 1000000000ull)) answer_(*req);
        } catch (...) {
            // The barrier: an unreachable cluster (sg::Error), out of memory, or another library's
            // exception never leaves this thread, which would end the host process.
            failed = true;
            failures_++;
        }
        lock.lock();
        if (failed) cv_.wait_for(lock, std::chrono::milliseconds(500), [&] { return stopping_; });
    }
}

}  // namespace sg::directory
