// The emulated CUDA plugin's test hooks (emu_plugin.cpp's header comment says what each does),
// looked up in the library SG_CUDA_PLUGIN names: the one the runtime loads, so both see one
// emulated device. Every pointer is null when the variable is unset or the library lacks a hook.
#pragma once

#include <dlfcn.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>

namespace sg_cuda_emu {

struct Hooks {
    void *(*alloc)(size_t) = nullptr;
    void (*free_)(void *) = nullptr;
    void (*write)(void *, const void *, size_t) = nullptr;
    void (*read)(void *, const void *, size_t) = nullptr;
    void (*dma)(void *, const void *, size_t) = nullptr;
    void *(*stream)() = nullptr;
    void (*block)(void *, int) = nullptr;
    uint64_t (*staged)() = nullptr;
    uint64_t (*digested)() = nullptr;
};

inline Hooks load_from_env() {
    Hooks x;
    const char *path = std::getenv("SG_CUDA_PLUGIN");
    void *h = path ? dlopen(path, RTLD_NOW | RTLD_LOCAL) : nullptr;
    if (!h) return x;
    x.alloc = reinterpret_cast<void *(*)(size_t)>(dlsym(h, "sg_cuda_emu_alloc"));
    x.free_ = reinterpret_cast<void (*)(void *)>(dlsym(h, "sg_cuda_emu_free"));
    x.write = reinterpret_cast<void (*)(void *, const void *, size_t)>(dlsym(h, "sg_cuda_emu_write"));
    x.read = reinterpret_cast<void (*)(void *, const void *, size_t)>(dlsym(h, "sg_cuda_emu_read"));
    x.dma = reinterpret_cast<void (*)(void *, const void *, size_t)>(dlsym(h, "sg_cuda_emu_dma"));
    x.stream = reinterpret_cast<void *(*)()>(dlsym(h, "sg_cuda_emu_stream"));
    x.block = reinterpret_cast<void (*)(void *, int)>(dlsym(h, "sg_cuda_emu_block"));
    x.staged = reinterpret_cast<uint64_t (*)()>(dlsym(h, "sg_cuda_emu_staged_bytes"));
    x.digested = reinterpret_cast<uint64_t (*)()>(dlsym(h, "sg_cuda_emu_digested_blocks"));
    return x;
}

}  // namespace sg_cuda_emu
