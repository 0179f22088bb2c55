// The lease's keep-alive thread (directory.hpp, KeepAlive).
#include "directory/directory.hpp"

namespace sg::directory {

KeepAlive::KeepAlive(std::chrono::milliseconds period, std::chrono::milliseconds round_budget, Round round)
    : period_(period), round_budget_(round_budget), round_(std::move(round)) {}

KeepAlive::~KeepAlive() { stop(); }

void KeepAlive::start() {
    std::lock_guard lock(mu_);
    if (thread_.joinable() || stopping_) return;
    thread_ = std::thread([this] { loop(); });
}

void KeepAlive::stop() {
    {
        std::lock_guard lock(mu_);
        stopping_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
}

void KeepAlive::loop() {
    std::unique_lock lock(mu_);
    while (!stopping_) {
        cv_.wait_for(lock, period_, [&] { return stopping_; });
        if (stopping_) break;
        lock.unlock();  // the round takes the client's lock: never both
        try {
            round_(now_ns() + uint64_t(round_budget_.count()) * 1000000);
            rounds_++;
        } catch (...) {
            // The barrier: an unreachable cluster (sg::Error), out of memory, or another library's
            // exception never leaves this thread, which would end the host process. The next
            // period tries again.
            failures_++;
        }
        lock.lock();
    }
}

}  // namespace sg::directory
