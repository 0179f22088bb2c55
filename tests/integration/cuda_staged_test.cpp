// SG_MEM_CUDA pools through the staging path, on the emulated plugin (tests/cuda_emu): two processes
// over tcp, pools of "device" memory that the runtime can only reach through the plugin's calls (it is
// PROT_NONE otherwise, so a direct read or write faults), every byte checked on the decode side:
// device to device, host to device and back, the selective paths, quantized on the wire, and the
// engine's stream in sg_transfer_layer_written. Each test is its own process (ctest), and ctest sets
// SG_CUDA_PLUGIN to the emulation, which the test opens too for its hooks.
#include "support/pair_harness.hpp"
#include "support/test_time.hpp"

#include "cuda_emu/emu_hooks.hpp"
#include "kernels.hpp"

#include <dlfcn.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

namespace {

using sgtest::kSecond;

using Emu = sg_cuda_emu::Hooks;

// The emulation's hooks, or, with SG_CUDA_TEST_DEVICE=1 (scripts/gpu-check.sh, on a machine with a
// GPU and the real plugin in SG_CUDA_PLUGIN), the same operations through the CUDA runtime.
const Emu &emu() {
    static Emu e = [] {
        Emu x;
        const char *real = std::getenv("SG_CUDA_TEST_DEVICE");
        if (real && *real == '1') {
            void *rt = dlopen("libcudart.so", RTLD_NOW | RTLD_LOCAL);
            if (!rt) rt = dlopen("libcudart.so.13", RTLD_NOW | RTLD_LOCAL);
            if (!rt) return x;
            static int (*malloc_)(void **, size_t) = reinterpret_cast<int (*)(void **, size_t)>(dlsym(rt, "cudaMalloc"));
            static int (*free_)(void *) = reinterpret_cast<int (*)(void *)>(dlsym(rt, "cudaFree"));
            static int (*memcpy_)(void *, const void *, size_t, int) =
                reinterpret_cast<int (*)(void *, const void *, size_t, int)>(dlsym(rt, "cudaMemcpy"));
            x.alloc = [](size_t n) -> void * {
                void *p = nullptr;
                return malloc_(&p, n) == 0 ? p : nullptr;
            };
            x.free_ = [](void *p) { free_(p); };
            x.write = [](void *d, const void *h, size_t n) { memcpy_(d, h, n, 1); };  // cudaMemcpyHostToDevice
            x.read = [](void *h, const void *d, size_t n) { memcpy_(h, d, n, 2); };   // cudaMemcpyDeviceToHost
            return x;
        }
        return sg_cuda_emu::load_from_env();
    }();
    return e;
}

// fp16, 4 layers, 2 KV heads of 32, 8-token blocks, K and V separate; host or emulated device memory.
constexpr uint32_t kLayers = 4, kHeads = 2, kDim = 32, kTpb = 8, kBlocks = 48;
constexpr uint64_t kTokens = 300;  // 38 blocks, the last one partial
constexpr size_t kPlaneElems = size_t(kTpb) * kHeads * kDim;
constexpr size_t kRegionBytes = kBlocks * kPlaneElems * 2;

struct Pool {
    bool device;
    std::vector<void *> k, v;
    std::vector<std::vector<uint16_t>> host;  // host pools' storage
    sg_kv_layout_t layout{};
    explicit Pool(bool on_device) : device(on_device) {
        for (uint32_t l = 0; l < 2 * kLayers; ++l) {
            void *p;
            if (device) {
                p = emu().alloc(kRegionBytes);
            } else {
                host.emplace_back(kRegionBytes / 2);
                p = host.back().data();
            }
            (l < kLayers ? k : v).push_back(p);
        }
        sg_kv_layout_init(&layout);
        layout.num_layers = kLayers;
        layout.num_kv_heads = kHeads;
        layout.head_dim = kDim;
        layout.tokens_per_block = kTpb;
        layout.num_blocks = kBlocks;
        layout.dtype = SG_DTYPE_FP16;
        layout.mem_kind = device ? SG_MEM_CUDA : SG_MEM_HOST;
        layout.layer_k_base = k.data();
        layout.layer_v_base = v.data();
        layout.layer_base_count = kLayers;
    }
    ~Pool() {
        if (device)
            for (auto *regions : {&k, &v})
                for (void *p : *regions) emu().free_(p);
    }
    void *region(uint32_t l, int plane) const { return (plane ? v : k)[l]; }
    std::vector<uint16_t> read(uint32_t l, int plane) const {
        std::vector<uint16_t> out(kRegionBytes / 2);
        if (device)
            emu().read(out.data(), region(l, plane), kRegionBytes);
        else
            std::memcpy(out.data(), region(l, plane), kRegionBytes);
        return out;
    }
    // Values exactly representable in fp16 (multiples of 1/64 up to 16), different per layer and plane.
    void fill(uint64_t seed) {
        for (uint32_t l = 0; l < kLayers; ++l)
            for (int plane = 0; plane < 2; ++plane) {
                std::vector<uint16_t> vals(kRegionBytes / 2);
                for (size_t i = 0; i < vals.size(); ++i) {
                    const uint64_t x = (i + 1) * 0x9e3779b97f4a7c15ull ^ (seed + l * 131 + uint64_t(plane) * 7);
                    vals[i] = sg::kernels::float_to_fp16(float(int64_t(x >> 40) % 2001 - 1000) / 64.0f);
                }
                if (device)
                    emu().write(region(l, plane), vals.data(), kRegionBytes);
                else
                    std::memcpy(region(l, plane), vals.data(), kRegionBytes);
            }
    }
};

std::vector<uint32_t> table(bool reversed) {
    const size_t n = (kTokens + kTpb - 1) / kTpb;
    std::vector<uint32_t> t(n);
    for (size_t i = 0; i < n; ++i) t[i] = reversed ? uint32_t(i * 7 % kBlocks) : uint32_t(i);  // 7: coprime with 48, scattered
    return t;
}

// Every valid token of every block, K and V, decode pool against prefill pool; int8 on the wire:
// within half a step of the largest magnitude (an upper bound on every block's own step).
std::string compare(const Pool &src, const Pool &dst, uint32_t wire_quant) {
    const auto st = table(false), dt = table(true);
    for (uint32_t l = 0; l < kLayers; ++l)
        for (int plane = 0; plane < 2; ++plane) {
            const auto s = src.read(l, plane), d = dst.read(l, plane);
            for (size_t i = 0; i < st.size(); ++i) {
                const size_t tokens = std::min<uint64_t>(kTpb, kTokens - i * kTpb);
                const uint16_t *a = s.data() + st[i] * kPlaneElems, *b = d.data() + dt[i] * kPlaneElems;
                const size_t n = tokens * kHeads * kDim;
                if (!wire_quant) {
                    if (std::memcmp(a, b, n * 2) != 0)
                        return "layer " + std::to_string(l) + " plane " + std::to_string(plane) + " block " +
                               std::to_string(i) + " differs";
                    continue;
                }
                for (size_t e = 0; e < n; ++e) {
                    const float x = sg::kernels::fp16_to_float(a[e]), y = sg::kernels::fp16_to_float(b[e]);
                    if (std::fabs(x - y) > 15.625f / 127 / 2 * 1.01f + std::fabs(x) / 1024)
                        return "layer " + std::to_string(l) + " element " + std::to_string(e) + ": " +
                               std::to_string(x) + " arrived as " + std::to_string(y);
                }
            }
        }
    return "";
}

// The prefill process's side: a context, its session to the decode process, its pool exported.
struct Prefill {
    sg_context_t ctx = nullptr;
    sg_session_t s = nullptr;
    sg_kv_handle_t kv = nullptr;
    Prefill(uint16_t port, const Pool &src) {
        ctx = sgtest::make_context("tcp;ofi_rxm");
        CHILD_CHECK(ctx, "context");
        CHILD_CHECK(sg_session_connect(ctx, "127.0.0.1", port, nullptr, sgtest::wait_ns(10 * kSecond), &s, nullptr) == SG_OK, "connect");
        CHILD_CHECK(sg_kv_register(ctx, &src.layout, &kv, nullptr) == SG_OK, "register");
        CHILD_CHECK(sg_session_export_kv(s, kv) == SG_OK, "export");
    }
    // Waits for the transfer, then ends as a host does: release, close, destroy.
    int finish(sg_transfer_t x) {
        const sg_status_t w = sg_transfer_wait(x, sgtest::wait_ns(60 * kSecond));
        CHILD_CHECK(w == SG_OK, "prefill wait: %s", sg_status_str(w));
        sg_transfer_release(x);
        sg_session_close(s, 5 * kSecond);
        sg_session_destroy(s);
        sg_kv_deregister(kv);
        sg_context_destroy(ctx);
        return 0;
    }
};

// The decode process's listener (this process, the parent of run_pair).
void listen_on(sg_context_t &ctx, sg_listener_t &lis, uint16_t *port) {
    ctx = sgtest::make_context("tcp;ofi_rxm");
    ASSERT_TRUE(ctx);
    ASSERT_EQ(sg_listener_create(ctx, "127.0.0.1", 0, &lis, nullptr), SG_OK);
    ASSERT_EQ(sg_listener_port(lis, port), SG_OK);
}

struct Case {
    bool src_device, dst_device;
    uint32_t paths;
    uint32_t wire_quant;
    const char *name;
};

class CudaStaged : public ::testing::TestWithParam<Case> {};

TEST_P(CudaStaged, EveryByteArrivesThroughThePlugin) {
    const Case c = GetParam();
    ASSERT_TRUE(emu().alloc) << "SG_CUDA_PLUGIN does not name the emulated plugin (tests/cuda_emu)";
    sg_context_t ctx = nullptr;
    sg_listener_t lis = nullptr;
    const int child = sgtest::run_pair(
        [&](uint16_t port) {  // prefill
            Pool src(c.src_device);
            src.fill(7);
            Prefill p(port, src);
            sg_transfer_options_t o;
            sg_transfer_options_init(&o);
            o.paths = c.paths;
            o.wire_quant = c.wire_quant;
            o.flags = SG_TRANSFER_ALL_LAYERS_WRITTEN;
            const auto st = table(false);
            sg_transfer_t x = nullptr;
            CHILD_CHECK(sg_transfer_post(p.s, "r", p.kv, st.data(), st.size(), kTokens, &o, &x, nullptr) == SG_OK, "post");
            const int rc = p.finish(x);
            if (c.src_device && emu().staged) CHILD_CHECK(emu().staged() > 0, "nothing went through stage_out");
            return rc;
        },
        [&](uint16_t *port) { listen_on(ctx, lis, port); },
        [&] {  // decode
            Pool src(false), dst(c.dst_device);
            src.fill(7);  // the same values the prefill side sends, to compare with
            sg_session_t s = nullptr;
            ASSERT_EQ(sg_session_accept(lis, nullptr, sgtest::wait_ns(30 * kSecond), &s, nullptr), SG_OK) << sg_last_error_message();
            sg_kv_handle_t kv = nullptr;
            sg_error_info_t err;
            sg_error_info_init(&err);
            ASSERT_EQ(sg_kv_register(ctx, &dst.layout, &kv, &err), SG_OK) << err.message;
            ASSERT_EQ(sg_session_export_kv(s, kv), SG_OK);
            sg_transfer_options_t o;
            sg_transfer_options_init(&o);
            o.wire_quant = c.wire_quant;
            const auto dt = table(true);
            sg_transfer_t x = nullptr;
            ASSERT_EQ(sg_transfer_expect(s, "r", kv, dt.data(), dt.size(), kTokens, &o, &x, nullptr), SG_OK);
            ASSERT_EQ(sg_transfer_wait(x, sgtest::wait_ns(60 * kSecond)), SG_OK) << sg_last_error_message();
            sg_transfer_stats_t stats;
            sg_transfer_stats_init(&stats);
            ASSERT_EQ(sg_transfer_stats(x, &stats), SG_OK);
            EXPECT_EQ(stats.layers_ready, kLayers);
            if (c.wire_quant) {
                EXPECT_GT(stats.quantized_bytes, 0u);
            }
            EXPECT_EQ(compare(src, dst, c.wire_quant), "");
            if (c.dst_device && emu().staged) {
                EXPECT_GT(emu().staged(), 0u) << "nothing went through stage_in";
            }
            sg_transfer_release(x);
            sg_session_close(s, 5 * kSecond);
            sg_session_destroy(s);
            sg_kv_deregister(kv);
        });
    EXPECT_EQ(child, 0);
    sg_listener_destroy(lis);
    sg_context_destroy(ctx);
}

constexpr uint32_t kSelective = SG_PATH_PROACTIVE | SG_PATH_ON_DEMAND | SG_PATH_SPECULATIVE;

INSTANTIATE_TEST_SUITE_P(
    Pools, CudaStaged,
    ::testing::Values(Case{true, true, SG_PATH_FULL, 0, "DeviceToDevice"}, Case{false, true, SG_PATH_FULL, 0, "HostToDevice"},
                      Case{true, false, SG_PATH_FULL, 0, "DeviceToHost"},
                      Case{true, true, kSelective, 0, "DeviceToDeviceSelective"},
                      Case{true, true, SG_PATH_FULL, SG_WIRE_QUANT_INT8, "DeviceToDeviceInt8"}),
    [](const auto &info) { return std::string(info.param.name); });

// The engine's kernels may still be writing a layer when it is marked written with their stream:
// nothing of it moves until the stream has passed the event, and the call does not wait for it.
TEST(CudaStream, ALayerMarkedWithABusyStreamMovesOnlyOnceTheStreamPassesIt) {
    if (!emu().block) GTEST_SKIP() << "needs the emulated plugin's streams (tests/cuda_emu)";
    sg_context_t ctx = nullptr;
    sg_listener_t lis = nullptr;
    const int child = sgtest::run_pair(
        [&](uint16_t port) {
            Pool src(true);
            src.fill(9);
            Prefill p(port, src);
            sg_session_t s = p.s;
            const auto st = table(false);
            sg_transfer_t x = nullptr;
            CHILD_CHECK(sg_transfer_post(s, "r", p.kv, st.data(), st.size(), kTokens, nullptr, &x, nullptr) == SG_OK, "post");
            void *stream = emu().stream();
            emu().block(stream, 1);
            for (uint32_t l = 0; l < kLayers; ++l)
                CHILD_CHECK(sg_transfer_layer_written(x, l, stream) == SG_OK, "layer_written %u", l);
            CHILD_CHECK(sg_session_notify(s, "marked", 6) == SG_OK, "notify");
            char buf[16];
            size_t len = 0;
            sg_status_t n;
            while ((n = sg_session_next_notification(s, buf, sizeof buf, &len)) == SG_ERR_AGAIN) usleep(1000);
            CHILD_CHECK(n == SG_OK && len == 2 && std::memcmp(buf, "go", 2) == 0, "go: %s", sg_status_str(n));
            emu().block(stream, 0);
            return p.finish(x);
        },
        [&](uint16_t *port) { listen_on(ctx, lis, port); },
        [&] {
            Pool src(false), dst(true);
            src.fill(9);
            sg_session_t s = nullptr;
            ASSERT_EQ(sg_session_accept(lis, nullptr, sgtest::wait_ns(30 * kSecond), &s, nullptr), SG_OK);
            sg_kv_handle_t kv = nullptr;
            ASSERT_EQ(sg_kv_register(ctx, &dst.layout, &kv, nullptr), SG_OK);
            ASSERT_EQ(sg_session_export_kv(s, kv), SG_OK);
            const auto dt = table(true);
            sg_transfer_t x = nullptr;
            ASSERT_EQ(sg_transfer_expect(s, "r", kv, dt.data(), dt.size(), kTokens, nullptr, &x, nullptr), SG_OK);
            char buf[16];
            size_t len = 0;
            sg_status_t n;
            while ((n = sg_session_next_notification(s, buf, sizeof buf, &len)) == SG_ERR_AGAIN) usleep(1000);
            ASSERT_EQ(n, SG_OK);
            // Every layer is marked written, on a stream that has not passed its events: none moves.
            EXPECT_EQ(sg_transfer_wait_layer(x, 0, 300000000ull), SG_ERR_TIMEOUT);
            ASSERT_EQ(sg_session_notify(s, "go", 2), SG_OK);
            ASSERT_EQ(sg_transfer_wait(x, sgtest::wait_ns(60 * kSecond)), SG_OK) << sg_last_error_message();
            EXPECT_EQ(compare(src, dst, 0), "");
            sg_transfer_release(x);
            sg_session_close(s, 5 * kSecond);
            sg_session_destroy(s);
            sg_kv_deregister(kv);
        });
    EXPECT_EQ(child, 0);
    sg_listener_destroy(lis);
    sg_context_destroy(ctx);
}

// A device engine's layer-written call: Quest selection on the prefill side reads queries that live
// in device memory (staged out once the stream passed the layer), and the arguments are checked.
TEST(CudaStream, DeviceQueriesFeedTheProactiveSelection) {
    if (!emu().block) GTEST_SKIP() << "needs the emulated plugin's streams (tests/cuda_emu)";
    sg_context_t ctx = nullptr;
    sg_listener_t lis = nullptr;
    constexpr uint32_t kQueries = 2, kQHeads = 4;
    const int child = sgtest::run_pair(
        [&](uint16_t port) {
            Pool src(true);
            src.fill(11);
            std::vector<float> q(size_t(kQueries) * kQHeads * kDim);
            for (size_t i = 0; i < q.size(); ++i) q[i] = float(int(i % 17) - 8) / 8.0f;
            void *devq = emu().alloc(q.size() * sizeof(float));
            emu().write(devq, q.data(), q.size() * sizeof(float));
            Prefill p(port, src);
            const std::string json =
                "{\"version\": 1, \"model\": \"t\", \"num_layers\": 4, \"num_kv_heads\": 2, \"block_tokens\": 8, "
                "\"defaults\": {\"policy\": \"quest\", \"budget\": {\"fraction\": 0.25}, \"sinks\": 8, \"recent\": 8}}";
            sg_profile_t profile = nullptr;
            CHILD_CHECK(sg_profile_parse(json.data(), json.size(), &profile, nullptr) == SG_OK, "profile");
            sg_transfer_options_t o;
            sg_transfer_options_init(&o);
            o.paths = kSelective;
            o.profile = profile;
            const auto st = table(false);
            sg_transfer_t x = nullptr;
            CHILD_CHECK(sg_transfer_post(p.s, "r", p.kv, st.data(), st.size(), kTokens, &o, &x, nullptr) == SG_OK, "post");
            sg_profile_destroy(profile);
            void *stream = emu().stream();
            sg_layer_written_t a;
            sg_layer_written_init(&a);
            a.queries = static_cast<const float *>(devq);
            a.num_queries = kQueries;
            a.num_q_heads = kQHeads;
            a.queries_mem_kind = SG_MEM_CUDA;
            CHILD_CHECK(sg_transfer_layer_written_ex(x, 0, &a) == SG_ERR_INVALID_ARGUMENT, "device queries without a stream");
            a.cuda_stream = stream;
            a.reserved = 1;
            CHILD_CHECK(sg_transfer_layer_written_ex(x, 0, &a) == SG_ERR_INVALID_ARGUMENT, "reserved");
            a.reserved = 0;
            CHILD_CHECK(sg_transfer_layer_written_ex(x, 0, nullptr) == SG_ERR_INVALID_ARGUMENT, "NULL args");
            for (uint32_t l = 0; l < kLayers; ++l)
                CHILD_CHECK(sg_transfer_layer_written_ex(x, l, &a) == SG_OK, "layer_written_ex %u: %s", l,
                            sg_last_error_message());
            const int rc = p.finish(x);
            emu().free_(devq);
            return rc;
        },
        [&](uint16_t *port) { listen_on(ctx, lis, port); },
        [&] {
            Pool src(false), dst(true);
            src.fill(11);
            sg_session_t s = nullptr;
            ASSERT_EQ(sg_session_accept(lis, nullptr, sgtest::wait_ns(30 * kSecond), &s, nullptr), SG_OK);
            sg_kv_handle_t kv = nullptr;
            ASSERT_EQ(sg_kv_register(ctx, &dst.layout, &kv, nullptr), SG_OK);
            ASSERT_EQ(sg_session_export_kv(s, kv), SG_OK);
            const auto dt = table(true);
            sg_transfer_t x = nullptr;
            ASSERT_EQ(sg_transfer_expect(s, "r", kv, dt.data(), dt.size(), kTokens, nullptr, &x, nullptr), SG_OK);
            for (uint32_t l = 0; l < kLayers; ++l)
                ASSERT_EQ(sg_transfer_wait_layer_state(x, l, SG_LAYER_ESSENTIAL, 60 * kSecond), SG_OK) << "layer " << l;
            ASSERT_EQ(sg_transfer_wait(x, sgtest::wait_ns(60 * kSecond)), SG_OK) << sg_last_error_message();
            EXPECT_EQ(compare(src, dst, 0), "");
            sg_transfer_release(x);
            sg_session_close(s, 5 * kSecond);
            sg_session_destroy(s);
            sg_kv_deregister(kv);
        });
    EXPECT_EQ(child, 0);
    sg_listener_destroy(lis);
    sg_context_destroy(ctx);
}

// The public selector digests a device pool on the device (the plugin's digest_to_host; the
// emulation runs the CPU twin there, a GPU the digest kernel): its digests equal those of a host
// pool holding the same keys, and no key is copied off the device for them.
TEST(CudaSelector, DigestsOfADevicePoolAreTheHostPools) {
    if (!emu().alloc) GTEST_SKIP() << "needs SG_CUDA_PLUGIN (tests/cuda_emu)";
    Pool host(false), dev(true);
    host.fill(5);
    dev.fill(5);
    const std::string json =
        "{\"version\": 1, \"model\": \"t\", \"num_layers\": 4, \"num_kv_heads\": 2, \"block_tokens\": 8, "
        "\"defaults\": {\"policy\": \"quest\", \"budget\": {\"fraction\": 0.25}}}";
    sg_profile_t profile = nullptr;
    ASSERT_EQ(sg_profile_parse(json.data(), json.size(), &profile, nullptr), SG_OK);
    sg_selector_t sel = nullptr;
    ASSERT_EQ(sg_selector_create(profile, &host.layout, kTokens, &sel, nullptr), SG_OK) << sg_last_error_message();
    size_t floats = 0;
    ASSERT_EQ(sg_selector_digest_floats(sel, &floats), SG_OK);
    const auto t = table(true);
    const uint64_t staged_before = emu().staged ? emu().staged() : 0;
    const uint64_t digested_before = emu().digested ? emu().digested() : 0;
    for (uint32_t l = 0; l < kLayers; ++l) {
        std::vector<float> a(floats), b(floats);
        ASSERT_EQ(sg_selector_digest(sel, &host.layout, l, t.data(), t.size(), a.data(), a.size()), SG_OK);
        ASSERT_EQ(sg_selector_digest(sel, &dev.layout, l, t.data(), t.size(), b.data(), b.size()), SG_OK)
            << sg_last_error_message();
        EXPECT_EQ(a, b) << "layer " << l;
    }
    if (emu().digested) {
        EXPECT_EQ(emu().digested() - digested_before, uint64_t(kLayers) * t.size());
        EXPECT_EQ(emu().staged() - staged_before, 0u) << "keys were copied off the device";
    }
    sg_selector_destroy(sel);
    sg_profile_destroy(profile);
}

// The emulation's guard itself: its "device" memory faults when read directly, so the tests above
// would catch a runtime that touched a device pool without the plugin.
TEST(CudaEmulation, DeviceMemoryFaultsWhenTheRuntimeReadsItDirectly) {
    if (!emu().staged) GTEST_SKIP() << "needs the emulated plugin (tests/cuda_emu)";
    auto *p = static_cast<volatile uint8_t *>(emu().alloc(4096));
    ASSERT_TRUE(p);
    const pid_t pid = fork();
    if (pid == 0) {
        signal(SIGSEGV, SIG_DFL);
        _exit(p[100] == 0 ? 0 : 1);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGSEGV) << "status " << status;
    emu().free_(const_cast<uint8_t *>(p));
}

TEST(CudaStream, IsRefusedForAHostPoolAndAHostPointerIsNotADevicePool) {
    ASSERT_TRUE(emu().alloc);
    sg_context_options_t o;
    sg_context_options_init(&o);
    o.allow_unauthenticated = 1;
    sg_context_t ctx = nullptr;
    ASSERT_EQ(sg_context_create(&o, &ctx, nullptr), SG_OK);
    Pool host(false);
    host.layout.mem_kind = SG_MEM_CUDA;  // host pointers claimed as device memory
    sg_kv_handle_t kv = nullptr;
    sg_error_info_t err;
    sg_error_info_init(&err);
    EXPECT_EQ(sg_kv_register(ctx, &host.layout, &kv, &err), SG_ERR_INVALID_LAYOUT);
    EXPECT_NE(std::string(err.message).find("not device memory"), std::string::npos) << err.message;
    EXPECT_EQ(sg_context_destroy(ctx), SG_OK);
}

}  // namespace
