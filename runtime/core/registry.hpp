// Handle registry: public handles are (kind, slot, generation) packed into an integer, so the library
// never dereferences a value it did not look up. Destroy-then-use, double destroy and made-up values
// all miss the lookup and are answered SG_ERR_INVALID_HANDLE.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace sg::core {

template <class T>
class Registry {
  public:
    explicit Registry(uint8_t kind) : kind_(kind) {}

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
