// See shm_lock_breaker.hpp for why this exists and when it may release a lock.
#include "transport/shm_lock_breaker.hpp"

#include <rdma/fabric.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <mutex>
#include <new>
#include <pthread.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <thread>
#include <unistd.h>
#include <unordered_map>

namespace sg::transport::shm {

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr auto kSamplePeriod = 5ms;
constexpr auto kPeerHeldFor = 50ms;
constexpr auto kOwnHeldFor = 1s;
constexpr auto kDeathMemory = 10s;

// The head of libfabric 1.17's struct smr_region (include/ofi_shm.h, SMR_VERSION 4), up to the
// lock. Only read through a mapping after version and pid matched.
struct RegionHead117 {
    uint8_t version;
    uint8_t resv;
    uint16_t flags;
    int32_t pid;
    uint8_t cma_cap_peer;
    uint8_t cma_cap_self;
    uint32_t max_sar_buf_per_peer;
    void *base_addr;
    pthread_spinlock_t lock;
};
static_assert(offsetof(RegionHead117, lock) == 24, "libfabric 1.17 keeps the region lock at byte 24 on LP64");
constexpr uint8_t kRegionVersion117 = 4;
constexpr size_t kMapBytes = 4096;

struct Region {
    bool own = false;
    int fd = -1;
    void *map = nullptr;
    int *lock_word = nullptr;
    Clock::time_point held_since{};
    Clock::time_point next_check{};
};

// region_owner_gone, leaving the flock as it was: the breaker only looks.
bool owner_gone(int fd) {
    if (!region_owner_gone(fd)) return false;
    flock(fd, LOCK_UN);
    return true;
}

// The pid in a SmartGen region name ("smartgen-<pid>-<16 hex>"), or -1.
long pid_of_name(const std::string &name) {
    const size_t dash = name.find('-');
    if (dash == std::string::npos) return -1;
    char *end = nullptr;
    const long pid = std::strtol(name.c_str() + dash + 1, &end, 10);
    return end && *end == '-' ? pid : -1;
}

void breaker_lock();
void breaker_unlock();
void breaker_forked();

class Breaker {
  public:
    Breaker() {
        // A child forked while the sampler held the registry's lock would find it held for good.
        pthread_atfork([] { breaker_lock(); }, [] { breaker_unlock(); }, [] { breaker_forked(); });
    }

    // In a forked child: no sampler runs, the parent's regions are not the child's to judge (its
    // own region would pass for the child's), and the condition variable may name the parent's
    // waiting sampler. The child starts afresh.
    void forget_parent() {
        for (auto &[token, r] : regions_) {
            munmap(r.map, kMapBytes);
            ::close(r.fd);
        }
        regions_.clear();
        last_death_ = {};
        // Not destroyed first: pthread_cond_destroy would wait for the parent's sampler.
        new (&cv_) std::condition_variable;
        mu_.unlock();
    }

    uint64_t watch(const std::string &name, bool own) {
        if (fi_version() != FI_VERSION(1, 17)) return 0;
        const long pid = pid_of_name(name);
        if (pid <= 0) return 0;
        const int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
        if (fd < 0) return 0;
        void *map = mmap(nullptr, kMapBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (map == MAP_FAILED) {
            ::close(fd);
            return 0;
        }
        auto *head = static_cast<RegionHead117 *>(map);
        if (__atomic_load_n(&head->version, __ATOMIC_ACQUIRE) != kRegionVersion117 ||
            __atomic_load_n(&head->pid, __ATOMIC_RELAXED) != pid) {
            munmap(map, kMapBytes);
            ::close(fd);
            return 0;
        }
        std::lock_guard lock(mu_);
        const uint64_t token = next_token_++;
        Region r;
        r.own = own;
        r.fd = fd;
        r.map = map;
        r.lock_word = const_cast<int *>(&head->lock);
        regions_[token] = r;
        // A forked child has the registry but not the thread.
        if (thread_pid_ != getpid()) {
            thread_pid_ = getpid();
            std::thread([this] { run(); }).detach();
        }
        cv_.notify_one();
        return token;
    }

    void unwatch(uint64_t token) {
        std::lock_guard lock(mu_);
        auto it = regions_.find(token);
        if (it == regions_.end()) return;
        // A peer that leaves dead still counts as a known death for a while: the lock it may have
        // left in our region outlives its watch.
        if (!it->second.own && owner_gone(it->second.fd)) last_death_ = Clock::now();
        munmap(it->second.map, kMapBytes);
        ::close(it->second.fd);
        regions_.erase(it);
    }

    uint64_t released() const { return released_.load(std::memory_order_relaxed); }

  private:
    void run() {
        std::unique_lock lock(mu_);
        const pid_t mine = getpid();
        while (thread_pid_ == mine) {
            if (regions_.empty())
                cv_.wait(lock);
            else
                cv_.wait_for(lock, kSamplePeriod);
            sample(Clock::now());
        }
    }

    void sample(Clock::time_point now) {
        for (auto &[token, r] : regions_) {
            if (__atomic_load_n(r.lock_word, __ATOMIC_ACQUIRE) == unlocked_word_) {
                r.held_since = {};
                continue;
            }
            if (r.held_since == Clock::time_point{}) {
                r.held_since = now;
                continue;
            }
            const auto held = now - r.held_since;
            if (now < r.next_check) continue;
            if (!r.own && held >= kPeerHeldFor) {
                r.next_check = now + kPeerHeldFor;
                if (owner_gone(r.fd)) {
                    last_death_ = now;
                    release(r);
                }
            } else if (r.own && held >= kOwnHeldFor) {
                r.next_check = now + kSamplePeriod * 10;
                if (peer_death_known(now)) release(r);
            }
        }
    }

    bool peer_death_known(Clock::time_point now) {
        for (auto &[token, r] : regions_)
            if (!r.own && owner_gone(r.fd)) last_death_ = now;
        return last_death_ != Clock::time_point{} && now - last_death_ <= kDeathMemory;
    }

    void release(Region &r) {
        // What pthread_spin_unlock stores, without the call: the lock was taken in another process,
        // and a sanitizer that intercepts the call reports an unlock of a lock it never saw taken.
        __atomic_store_n(r.lock_word, unlocked_word_, __ATOMIC_RELEASE);
        r.held_since = {};
        released_.fetch_add(1, std::memory_order_relaxed);
    }

  public:
    std::mutex mu_;

  private:
    std::condition_variable cv_;
    std::unordered_map<uint64_t, Region> regions_;
    uint64_t next_token_ = 1;
    pid_t thread_pid_ = 0;
    Clock::time_point last_death_{};
    std::atomic<uint64_t> released_{0};
    // What a free spin lock holds: 1 with glibc on x86-64 (its lock decrements), 0 elsewhere.
    const int unlocked_word_ = [] {
        pthread_spinlock_t probe;
        pthread_spin_init(&probe, PTHREAD_PROCESS_SHARED);
        const int word = const_cast<const int &>(probe);
        pthread_spin_destroy(&probe);
        return word;
    }();
};

// Never destroyed: transports close from static destructors and detached threads may still run.
Breaker &breaker() {
    static Breaker *b = new Breaker;
    return *b;
}
void breaker_lock() { breaker().mu_.lock(); }
void breaker_unlock() { breaker().mu_.unlock(); }
void breaker_forked() { breaker().forget_parent(); }

}  // namespace

uint64_t watch_region(const std::string &name, bool own) { return breaker().watch(name, own); }
void unwatch_region(uint64_t token) {
    if (token) breaker().unwatch(token);
}
uint64_t locks_released() { return breaker().released(); }
bool region_owner_gone(int fd) { return flock(fd, LOCK_EX | LOCK_NB) == 0; }

}  // namespace sg::transport::shm
