// A stand-in for libsmartgen-cuda.so.0 on machines without a GPU, for tests only (never installed):
// it implements the plugin table (kernels/cuda/plugin_abi.h) over host memory that plays device
// memory. That memory is mapped PROT_NONE except while one of the plugin's own calls runs, so a
// runtime that dereferenced a device pointer itself would fault instead of passing. Streams are
// emulated too: a test blocks one (its "kernels" still running) and releases it later, and events
// recorded meanwhile complete only then.
//
// Test hooks (C, found with dlsym on the same library the runtime loaded through SG_CUDA_PLUGIN):
//   void *sg_cuda_emu_alloc(size_t)          "device" memory on device 0 (or SG_CUDA_EMU_DEVICE)
//   void sg_cuda_emu_free(void *)
//   void sg_cuda_emu_write(void *dev, const void *host, size_t)   host -> "device"
//   void sg_cuda_emu_read(void *host, const void *dev, size_t)    "device" -> host
//   void sg_cuda_emu_dma(void *dst, const void *src, size_t)      any to any, as a GPUDirect NIC
//   void *sg_cuda_emu_stream(void)           a stream, not blocked
//   void sg_cuda_emu_block(void *stream, int blocked)
//   uint64_t sg_cuda_emu_staged_bytes(void)  bytes moved by stage_out + stage_in so far
//   uint64_t sg_cuda_emu_digested_blocks(void)  blocks digest_to_host has digested so far
#include "cuda/plugin_abi.h"
#include "kernels.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

namespace {

struct Allocation {
    size_t bytes;
    int32_t device;
};

std::mutex mu;  // one call at a time: memory is readable only inside a call
std::map<uintptr_t, Allocation> allocations;
uint64_t staged_bytes = 0;
uint64_t digested_blocks = 0;

struct Stream {
    bool blocked = false;
    uint64_t epoch = 1, completed = 0;
};
struct Event {
    Stream *stream;
    uint64_t needs;  // 0: complete at once
};

size_t page_round(size_t n) {
    const size_t page = 4096;
    return (n + page - 1) / page * page;
}

// Opens every allocation for the length of a call (the lock is held).
struct Open {
    Open() { protect(PROT_READ | PROT_WRITE); }
    ~Open() { protect(PROT_NONE); }
    static void protect(int prot) {
        for (auto &[base, a] : allocations) mprotect(reinterpret_cast<void *>(base), page_round(a.bytes), prot);
    }
};

int devices() {
    const char *env = std::getenv("SG_CUDA_EMU_DEVICES");
    return env ? std::atoi(env) : 1;
}

int refuse(const char *what, char *msg, size_t cap) {
    if (msg && cap) std::snprintf(msg, cap, "%s is not emulated", what);
    return -1;
}

// The allocation holding [p, p + n), or null.
const Allocation *find(uintptr_t p, uint64_t n) {
    auto it = allocations.upper_bound(p);
    if (it == allocations.begin()) return nullptr;
    --it;
    if (p < it->first || p + n > it->first + it->second.bytes) return nullptr;
    return &it->second;
}

int device_count(char *, size_t) { return devices(); }
int no_pack(const sg_cuda_pack_t *, void *, char *msg, size_t cap) { return refuse("gather/scatter", msg, cap); }
int no_digest(const sg_cuda_digest_t *, void *, char *msg, size_t cap) { return refuse("digest", msg, cap); }
int no_quant(const sg_cuda_quant_t *, void *, char *msg, size_t cap) { return refuse("quantize", msg, cap); }
int no_quest(const sg_cuda_quest_t *, void *, char *msg, size_t cap) { return refuse("quest", msg, cap); }
int no_topk(const sg_cuda_topk_t *, void *, char *msg, size_t cap) { return refuse("top-k", msg, cap); }
int no_snapkv(const sg_cuda_snapkv_t *, void *, char *msg, size_t cap) { return refuse("snapkv", msg, cap); }

int device_of(const void *ptr, int32_t *device, char *msg, size_t cap) {
    std::lock_guard lock(mu);
    const Allocation *a = find(reinterpret_cast<uintptr_t>(ptr), 1);
    if (!a) {
        if (msg && cap) std::snprintf(msg, cap, "%p is not (emulated) device memory", ptr);
        return -1;
    }
    *device = a->device;
    return 0;
}

template <bool Out>
int stage(int32_t device, const sg_cuda_piece_t *pieces, uint64_t count, uint8_t *host, char *msg, size_t cap) {
    std::lock_guard lock(mu);
    for (uint64_t i = 0; i < count; ++i) {
        const Allocation *a = find(uintptr_t(pieces[i].device_addr), pieces[i].bytes);
        if (!a || a->device != device) {
            if (msg && cap)
                std::snprintf(msg, cap, "piece %llu (%#llx, %llu bytes) is not memory of device %d",
                              (unsigned long long)i, (unsigned long long)pieces[i].device_addr,
                              (unsigned long long)pieces[i].bytes, int(device));
            return -1;
        }
    }
    Open open;
    for (uint64_t i = 0; i < count; ++i) {
        auto *dev = reinterpret_cast<uint8_t *>(uintptr_t(pieces[i].device_addr));
        if (Out)
            std::memcpy(host, dev, pieces[i].bytes);
        else
            std::memcpy(dev, host, pieces[i].bytes);
        host += pieces[i].bytes;
        staged_bytes += pieces[i].bytes;
    }
    return 0;
}

int stage_out(int32_t device, const sg_cuda_piece_t *pieces, uint64_t count, void *host, char *msg, size_t cap) {
    return stage<true>(device, pieces, count, static_cast<uint8_t *>(host), msg, cap);
}
int stage_in(int32_t device, const sg_cuda_piece_t *pieces, uint64_t count, const void *host, char *msg, size_t cap) {
    return stage<false>(device, pieces, count, static_cast<uint8_t *>(const_cast<void *>(host)), msg, cap);
}

// The digests as the CPU twin computes them, over the opened "device" region (the real plugin runs
// the digest kernel, checked against the same twin by gpu.cuda_kernels).
int digest_to_host(int32_t device, const sg_cuda_digest_t *d, char *msg, size_t cap) {
    std::lock_guard lock(mu);
    const auto dtype = static_cast<sg::kernels::DType>(d->dtype);
    for (uint64_t i = 0; i < d->num_blocks; ++i) {
        const uintptr_t block = reinterpret_cast<uintptr_t>(d->keys) + uint64_t(d->blocks[i]) * d->block_stride;
        const Allocation *a = find(block, 1);
        if (!a || a->device != device) {
            if (msg && cap) std::snprintf(msg, cap, "block %u of the digest is not memory of device %d", d->blocks[i], int(device));
            return -1;
        }
    }
    Open open;
    const uint64_t per_block = sg::kernels::digest_floats(1, d->heads, d->dim);
    for (uint64_t i = 0; i < d->num_blocks; ++i) {
        const void *block = static_cast<const uint8_t *>(d->keys) + uint64_t(d->blocks[i]) * d->block_stride;
        const uint64_t valid = std::min<uint64_t>(d->tokens_per_block, d->tokens - i * d->tokens_per_block);
        const sg::kernels::View keys =
            d->head_major ? sg::kernels::head_major(block, dtype, valid, d->heads, d->dim, d->tokens_per_block)
                          : sg::kernels::token_major(block, dtype, valid, d->heads, d->dim);
        sg::kernels::page_digest(keys, uint32_t(valid), d->out + i * per_block);
    }
    digested_blocks += d->num_blocks;
    return 0;
}

int event_record(int32_t, void *stream, void **event, char *msg, size_t cap) {
    std::lock_guard lock(mu);
    if (!stream) return refuse("the legacy default stream", msg, cap);
    auto *s = static_cast<Stream *>(stream);
    *event = new Event{s, s->blocked ? s->epoch : 0};
    return 0;
}

int event_query(void *event, char *, size_t) {
    std::lock_guard lock(mu);
    const auto *e = static_cast<Event *>(event);
    return e->needs == 0 || e->stream->completed >= e->needs ? 0 : 1;
}

void event_destroy(void *event) { delete static_cast<Event *>(event); }

const sg_cuda_plugin_t kPlugin = {sizeof(sg_cuda_plugin_t), SG_CUDA_PLUGIN_ABI, 0, device_count, no_pack, no_pack,
                                  no_digest, no_quant, no_quant, no_quest, device_of, stage_out, stage_in,
                                  event_record, event_query, event_destroy, no_topk, no_snapkv, digest_to_host};

}  // namespace

#define EXPORT extern "C" __attribute__((visibility("default")))

EXPORT const sg_cuda_plugin_t *sg_cuda_plugin_v1(void) { return &kPlugin; }

EXPORT void *sg_cuda_emu_alloc(size_t bytes) {
    std::lock_guard lock(mu);
    void *p = mmap(nullptr, page_round(bytes), PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    const char *dev = std::getenv("SG_CUDA_EMU_DEVICE");
    allocations[reinterpret_cast<uintptr_t>(p)] = {bytes, dev ? std::atoi(dev) : 0};
    return p;
}

EXPORT void sg_cuda_emu_free(void *p) {
    std::lock_guard lock(mu);
    auto it = allocations.find(reinterpret_cast<uintptr_t>(p));
    if (it == allocations.end()) return;
    munmap(p, page_round(it->second.bytes));
    allocations.erase(it);
}

EXPORT void sg_cuda_emu_write(void *dev, const void *host, size_t n) {
    std::lock_guard lock(mu);
    Open open;
    std::memcpy(dev, host, n);
}

EXPORT void sg_cuda_emu_read(void *host, const void *dev, size_t n) {
    std::lock_guard lock(mu);
    Open open;
    std::memcpy(host, dev, n);
}

EXPORT void sg_cuda_emu_dma(void *dst, const void *src, size_t n) {
    std::lock_guard lock(mu);
    Open open;
    std::memmove(dst, src, n);
}

EXPORT void *sg_cuda_emu_stream(void) { return new Stream; }

EXPORT void sg_cuda_emu_block(void *stream, int blocked) {
    std::lock_guard lock(mu);
    auto *s = static_cast<Stream *>(stream);
    if (blocked) {
        s->blocked = true;
    } else if (s->blocked) {
        s->completed = s->epoch++;
        s->blocked = false;
    }
}

EXPORT uint64_t sg_cuda_emu_digested_blocks(void) {
    std::lock_guard lock(mu);
    return digested_blocks;
}

EXPORT uint64_t sg_cuda_emu_staged_bytes(void) {
    std::lock_guard lock(mu);
    return staged_bytes;
}
