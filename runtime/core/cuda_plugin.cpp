#include "core/cuda_plugin.hpp"

#include <dlfcn.h>

#include <cstddef>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "common/common.hpp"
#include "cuda/plugin_abi.h"

namespace sg::core {

namespace {

constexpr const char *kPluginName = "libsmartgen-cuda.so.0";

struct Loaded {
    const sg_cuda_plugin_t *plugin = nullptr;
    std::string why;  // what went wrong when plugin is null
};

// Beside libsmartgen first (where the packages and the build tree put it), then the loader's own
// search path; SG_CUDA_PLUGIN names another file (read here, at the first CUDA pool of the process:
// the plugin is process-wide, unlike a context).
Loaded load() {
    Loaded r;
    std::string tried;
    void *handle = nullptr;
    if (const char *path = std::getenv("SG_CUDA_PLUGIN"); path && *path) {
        handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (!handle) r.why = std::string("SG_CUDA_PLUGIN=") + path + ": " + dlerror();
    } else {
        Dl_info self{};
        if (dladdr(reinterpret_cast<void *>(&check_cuda_pool), &self) && self.dli_fname) {
            std::string dir(self.dli_fname);
            dir = dir.find('/') == std::string::npos ? "." : dir.substr(0, dir.rfind('/'));
            handle = dlopen((dir + "/" + kPluginName).c_str(), RTLD_NOW | RTLD_LOCAL);
            if (!handle) tried = dlerror();
        }
        if (!handle) handle = dlopen(kPluginName, RTLD_NOW | RTLD_LOCAL);
        if (!handle) r.why = std::string(dlerror()) + (tried.empty() ? "" : "; beside libsmartgen: " + tried);
    }
    if (!handle) return r;
    using Entry = const sg_cuda_plugin_t *(*)();
    auto entry = reinterpret_cast<Entry>(dlsym(handle, "sg_cuda_plugin_v1"));
    const sg_cuda_plugin_t *p = entry ? entry() : nullptr;
    // The table only grows: members past interface 2's first table are used where struct_size covers them.
    if (!p || p->abi != SG_CUDA_PLUGIN_ABI || p->struct_size < offsetof(sg_cuda_plugin_t, digest_to_host)) {
        r.why = std::string(kPluginName) + " was loaded but is not a SmartGen CUDA plugin of interface " +
                std::to_string(SG_CUDA_PLUGIN_ABI);
        dlclose(handle);
        return r;
    }
    r.plugin = p;
    return r;
}

const Loaded &plugin() {
    static std::once_flag once;
    static Loaded loaded;
    std::call_once(once, [] { loaded = load(); });
    return loaded;
}

// The plugin, with a driver and `device` among its devices; otherwise what is missing.
const sg_cuda_plugin_t &usable(int32_t device) {
    const Loaded &l = plugin();
    if (!l.plugin) fail(SG_ERR_UNSUPPORTED, std::string("SG_MEM_CUDA needs the CUDA plugin ") + kPluginName + ": " + l.why);
    char msg[256] = {};
    const int devices = l.plugin->device_count(msg, sizeof msg);
    if (devices < 0) fail(SG_ERR_UNSUPPORTED, std::string("SG_MEM_CUDA: the CUDA plugin finds no usable driver: ") + msg);
    if (devices == 0) fail(SG_ERR_UNSUPPORTED, "SG_MEM_CUDA: the CUDA plugin finds no CUDA device");
    if (device < 0 || device >= devices)
        fail(SG_ERR_INVALID_LAYOUT, "device " + std::to_string(device) + " is not a CUDA device here (" +
                                        std::to_string(devices) + " found)");
    return *l.plugin;
}

// Loaded and checked by the pool that needs it first; later calls only read it.
const sg_cuda_plugin_t &loaded() {
    const Loaded &l = plugin();
    if (!l.plugin) fail(SG_ERR_INTERNAL, "the CUDA plugin is not loaded");
    return *l.plugin;
}

}  // namespace

void check_cuda_pool(int32_t device, std::span<uint8_t *const> bases) {
    const sg_cuda_plugin_t &p = usable(device);
    for (uint8_t *base : bases) {
        char msg[256] = {};
        int32_t on = -1;
        if (p.device_of(base, &on, msg, sizeof msg) != 0)
            fail(SG_ERR_INVALID_LAYOUT, std::string("a region of the SG_MEM_CUDA pool is not device memory: ") + msg);
        if (on != device)
            fail(SG_ERR_INVALID_LAYOUT, "a region of the SG_MEM_CUDA pool is on device " + std::to_string(on) +
                                            ", the layout says device " + std::to_string(device));
    }
}

namespace {

template <class Piece> std::vector<sg_cuda_piece_t> pieces_of(std::span<const Piece> pieces) {
    std::vector<sg_cuda_piece_t> out;
    out.reserve(pieces.size());
    for (const auto &[addr, bytes] : pieces) out.push_back({uint64_t(reinterpret_cast<uintptr_t>(addr)), bytes});
    return out;
}

}  // namespace

void cuda_stage_out(int32_t device, std::span<const std::pair<const uint8_t *, uint64_t>> pieces, uint8_t *host) {
    const auto list = pieces_of(pieces);
    char msg[256] = {};
    if (loaded().stage_out(device, list.data(), list.size(), host, msg, sizeof msg) != 0)
        fail(SG_ERR_INTERNAL, std::string("copying KV off device ") + std::to_string(device) + " failed: " + msg);
}

void cuda_stage_in(int32_t device, std::span<const std::pair<uint8_t *, uint64_t>> pieces, const uint8_t *host) {
    const auto list = pieces_of(pieces);
    char msg[256] = {};
    if (loaded().stage_in(device, list.data(), list.size(), host, msg, sizeof msg) != 0)
        fail(SG_ERR_INTERNAL, std::string("copying KV onto device ") + std::to_string(device) + " failed: " + msg);
}

bool cuda_digest_to_host(int32_t device, const sg_cuda_digest_t &digest) {
    const sg_cuda_plugin_t &p = loaded();
    if (p.struct_size < offsetof(sg_cuda_plugin_t, digest_to_host) + sizeof p.digest_to_host || !p.digest_to_host)
        return false;
    char msg[256] = {};
    if (p.digest_to_host(device, &digest, msg, sizeof msg) != 0)
        fail(SG_ERR_INTERNAL, std::string("page digests on device ") + std::to_string(device) + " failed: " + msg);
    return true;
}

StreamEvent::StreamEvent(int32_t device, void *stream) {
    const sg_cuda_plugin_t &p = usable(device);
    char msg[256] = {};
    if (p.event_record(device, stream, &event_, msg, sizeof msg) != 0)
        fail(SG_ERR_INVALID_ARGUMENT, std::string("cuda_stream: recording an event on it failed: ") + msg);
}

StreamEvent::~StreamEvent() {
    if (event_) loaded().event_destroy(event_);
}

bool StreamEvent::done() {
    char msg[256] = {};
    const int rc = loaded().event_query(event_, msg, sizeof msg);
    if (rc < 0) fail(SG_ERR_INTERNAL, std::string("the engine's stream failed: ") + msg);
    return rc == 0;
}

}  // namespace sg::core
