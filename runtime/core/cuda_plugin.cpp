#include "core/cuda_plugin.hpp"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <string>

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
        if (dladdr(reinterpret_cast<void *>(&refuse_cuda_pool), &self) && self.dli_fname) {
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
    if (!p || p->abi != SG_CUDA_PLUGIN_ABI || p->struct_size < sizeof(sg_cuda_plugin_t)) {
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

}  // namespace

void refuse_cuda_pool(int32_t device) {
    const Loaded &l = plugin();
    if (!l.plugin) fail(SG_ERR_UNSUPPORTED, std::string("SG_MEM_CUDA needs the CUDA plugin ") + kPluginName + ": " + l.why);
    char msg[256] = {};
    const int devices = l.plugin->device_count(msg, sizeof msg);
    if (devices < 0) fail(SG_ERR_UNSUPPORTED, std::string("SG_MEM_CUDA: the CUDA plugin finds no usable driver: ") + msg);
    if (devices == 0) fail(SG_ERR_UNSUPPORTED, "SG_MEM_CUDA: the CUDA plugin finds no CUDA device");
    if (device < 0 || device >= devices)
        fail(SG_ERR_INVALID_LAYOUT, "device " + std::to_string(device) + " is not a CUDA device here (" +
                                        std::to_string(devices) + " found)");
    fail(SG_ERR_UNSUPPORTED, "SG_MEM_CUDA: the CUDA plugin and " + std::to_string(devices) +
                                 " device(s) are present, but transfers of device memory are not in this build yet");
}

}  // namespace sg::core
