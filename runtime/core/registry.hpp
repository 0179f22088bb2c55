// Handle registry: public handles are (kind, slot, generation) packed into an integer, so the library
// never dereferences a value it did not look up. Destroy-then-use, double destroy and made-up values
// all miss the lookup and are answered SG_ERR_INVALID_HANDLE.
//
// fork(): a handle belongs to the process that made it. In a child the parent's objects are not
// destroyed — their threads did not follow and their locks may have been held at the fork, so a
// destructor could abort (joining a thread that is not there) or hang (locking such a lock), in the
// child's exit as much as in a call — and not reachable: every registry forgets them in the child
// (their handles answer SG_ERR_INVALID_HANDLE there) and leaves their memory to the child's exit,
// as glibc-safe libraries do with state inherited across fork. Each registry's lock is taken around
// the fork (pthread_atfork), so the child finds it free and its slots consistent.
#pragma once

#include <pthread.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace sg::core {

// What the fork handlers need of a registry, whatever it holds.
class ForkAware {
  public:
    virtual void lock_for_fork() = 0;
    virtual void unlock_after_fork() = 0;
    virtual void forget_inherited() = 0;  // in the child, with the lock released

  protected:
    ~ForkAware() = default;
    static void enroll(ForkAware *r);
    static void withdraw(ForkAware *r);
    // The parent's objects in a child: held here and never destroyed (see the file comment). A
    // global's, so they stay reachable: LeakSanitizer calls unreachable memory a leak.
    static std::vector<std::shared_ptr<void>> &inherited() {
        static auto *v = new std::vector<std::shared_ptr<void>>;
        return *v;
    }

  private:
    struct List {
        std::mutex mu;
        std::vector<ForkAware *> all;
    };
    // Never destroyed: a fork during the host's exit still finds it.
    static List &list() {
        static List *l = new List;
        return *l;
    }
    static void prepare() {
        list().mu.lock();
        for (ForkAware *r : list().all) r->lock_for_fork();
    }
    static void parent() {
        for (auto it = list().all.rbegin(); it != list().all.rend(); ++it) (*it)->unlock_after_fork();
        list().mu.unlock();
    }
    static void child() {
        for (auto it = list().all.rbegin(); it != list().all.rend(); ++it) {
            (*it)->unlock_after_fork();
            (*it)->forget_inherited();
        }
        list().mu.unlock();
    }
};

inline void ForkAware::enroll(ForkAware *r) {
    static const int registered = pthread_atfork(&ForkAware::prepare, &ForkAware::parent, &ForkAware::child);
    (void)registered;
    std::lock_guard lock(list().mu);
    list().all.push_back(r);
}

inline void ForkAware::withdraw(ForkAware *r) {
    std::lock_guard lock(list().mu);
    for (size_t i = 0; i < list().all.size(); ++i)
        if (list().all[i] == r) {
            list().all.erase(list().all.begin() + ptrdiff_t(i));
            break;
        }
}

template <class T>
class Registry final : public ForkAware {
  public:
    explicit Registry(uint8_t kind) : kind_(kind) { enroll(this); }
    ~Registry() { withdraw(this); }
    Registry(const Registry &) = delete;
    Registry &operator=(const Registry &) = delete;

    void lock_for_fork() override { mu_.lock(); }
    void unlock_after_fork() override { mu_.unlock(); }
    // In a child: every object is the parent's. Each is kept alive for ever (never destroyed here)
    // and its slot freed with a new generation, so the parent's handles miss every lookup.
    void forget_inherited() override {
        for (size_t i = 0; i < slots_.size(); ++i) {
            Slot &s = slots_[i];
            if (!s.obj) continue;
            inherited().push_back(std::move(s.obj));
            s.obj.reset();
            s.generation = s.generation + 1 ? s.generation + 1 : 1;
            free_.push_back(uint32_t(i));
        }
    }

    uint64_t add(std::shared_ptr<T> obj) {
        std::lock_guard lock(mu_);
        uint32_t slot;
        if (!free_.empty()) {
            slot = free_.back();
            free_.pop_back();
        } else {
            slot = uint32_t(slots_.size());
            slots_.push_back({});
        }
        Slot &s = slots_[slot];
        s.obj = std::move(obj);
        return (uint64_t(s.generation) << 32) | (uint64_t(kind_) << 24) | (slot + 1);
    }

    std::shared_ptr<T> get(uint64_t handle) const {
        std::lock_guard lock(mu_);
        const Slot *s = find(handle);
        return s ? s->obj : nullptr;
    }

    // Removes and returns the object; nullptr if the handle is not live.
    std::shared_ptr<T> remove(uint64_t handle) {
        std::lock_guard lock(mu_);
        Slot *s = const_cast<Slot *>(find(handle));
        if (!s) return nullptr;
        std::shared_ptr<T> obj = std::move(s->obj);
        s->obj.reset();
        s->generation = s->generation + 1 ? s->generation + 1 : 1;  // never 0, so 0 is never live
        free_.push_back(uint32_t(s - slots_.data()));
        return obj;
    }

    // Removes every live object matching pred and returns them (for teardown of a context).
    template <class Pred>
    std::vector<std::shared_ptr<T>> remove_if(Pred pred) {
        std::lock_guard lock(mu_);
        std::vector<std::shared_ptr<T>> out;
        for (size_t i = 0; i < slots_.size(); ++i) {
            Slot &s = slots_[i];
            if (s.obj && pred(*s.obj)) {
                out.push_back(std::move(s.obj));
                s.obj.reset();
                s.generation = s.generation + 1 ? s.generation + 1 : 1;
                free_.push_back(uint32_t(i));
            }
        }
        return out;
    }

  private:
    struct Slot {
        uint32_t generation = 1;
        std::shared_ptr<T> obj;
    };

    const Slot *find(uint64_t handle) const {
        const uint32_t low = uint32_t(handle);
        if (((low >> 24) & 0xff) != kind_) return nullptr;
        const uint32_t index = (low & 0xffffff);
        if (index == 0 || index > slots_.size()) return nullptr;
        const Slot &s = slots_[index - 1];
        if (!s.obj || s.generation != uint32_t(handle >> 32)) return nullptr;
        return &s;
    }

    uint8_t kind_;
    mutable std::mutex mu_;
    std::vector<Slot> slots_;
    std::vector<uint32_t> free_;
};

}  // namespace sg::core
