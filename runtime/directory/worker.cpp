// The directory's threads (directory.hpp, Worker): one loop behind one barrier, for the lease's
// keep-alive and a published name's inbox.
#include "directory/directory.hpp"

namespace sg::directory {

Worker::Worker(std::chrono::milliseconds pause, std::chrono::milliseconds back_off, Round round,
               std::function<void()> interrupt)
    : pause_(pause), back_off_(back_off), round_(std::move(round)), interrupt_(std::move(interrupt)) {}

Worker::~Worker() { stop(); }

bool Worker::start() {
    std::lock_guard lock(mu_);
    if (started_ || stopping_) return false;
    started_ = true;
    thread_ = std::thread([this] { loop(); });
    return true;
}

bool Worker::running() const {
    std::lock_guard lock(mu_);
    return started_ && !stopping_;
}

void Worker::stop() {
    // One stop joins at a time; a second returns only once the thread is gone. After stopping_ is
    // set under mu_, start() no longer touches thread_, and running() never reads it.
    std::lock_guard join_lock(join_mu_);
    {
        std::lock_guard lock(mu_);
        stopping_ = true;
    }
    cv_.notify_all();
    if (interrupt_) interrupt_();  // ends a round blocked in the cluster now
    if (thread_.joinable()) thread_.join();
}

void Worker::loop() {
    std::unique_lock lock(mu_);
    while (!stopping_) {
        if (pause_.count()) cv_.wait_for(lock, pause_, [&] { return stopping_; });
        if (stopping_) break;
        lock.unlock();  // a round takes the client's lock: never both
        bool failed = false;
        try {
            round_();
            rounds_++;
        } catch (...) {
            // The barrier: an unreachable cluster (sg::Error), out of memory, or another library's
            // exception never leaves this thread, which would end the host process.
            failed = true;
            failures_++;
        }
        lock.lock();
        if (failed && back_off_.count()) cv_.wait_for(lock, back_off_, [&] { return stopping_; });
    }
}

KeepAlive::KeepAlive(std::chrono::milliseconds period, std::chrono::milliseconds round_budget, Round round)
    : worker_(period, std::chrono::milliseconds(0),
              [round = std::move(round), budget_ns = uint64_t(round_budget.count()) * 1000000] {
                  round(now_ns() + budget_ns);
              }) {}

Inbox::Inbox(Take take, std::function<void()> interrupt, Answer answer)
    : worker_(std::chrono::milliseconds(0), std::chrono::milliseconds(500),
              [this, take = std::move(take), answer = std::move(answer)] {
                  // One watch stream an inbox, idle until a request comes (stop interrupts it).
                  if (auto req = take(name(), now_ns() + 30 * 1000000000ull)) answer(*req);
              },
              std::move(interrupt)) {}

bool Inbox::serve(const std::string &name) {
    {
        std::lock_guard lock(mu_);
        if (!name_.empty()) return false;
        name_ = name;
    }
    if (worker_.start()) return true;
    std::lock_guard lock(mu_);  // stopped already: it serves nothing
    name_.clear();
    return false;
}

bool Inbox::serving() const { return worker_.running(); }

std::string Inbox::name() const {
    std::lock_guard lock(mu_);
    return name_;
}

}  // namespace sg::directory
