// SG_MEM_CUDA pools written by RMA where the provider reaches device memory (FI_HMEM, GPUDirect RDMA
// on verbs/EFA): the fake fabric plays such a provider (Knobs::hmem), and the emulated CUDA plugin
// (tests/cuda_emu, from SG_CUDA_PLUGIN, which ctest sets) plays the device, whose memory faults outside
// the plugin's calls, so the fabric moves it through the emulation's DMA hook as a NIC would. What
// these tests show: device pools register with the provider, travel as plain writes (nothing through
// the staging slots or the plugin's copies), every byte lands, and without FI_HMEM the same transfer
// is staged instead. The libfabric side (fi_mr_regattr with FI_HMEM_CUDA) needs a provider built with
// CUDA and a NIC, and runs only on such a machine.
#include "fake_pair.hpp"

#include "cuda_emu/emu_hooks.hpp"

#include <string>

namespace sg::testing {
namespace {

const sg_cuda_emu::Hooks &emu() {
    static const sg_cuda_emu::Hooks hooks = sg_cuda_emu::load_from_env();
    return hooks;
}

bool emu_ok() {
    return emu().alloc && emu().free_ && emu().write && emu().read && emu().dma && emu().staged && emu().digested;
}

// A HostPool's contents, optionally mirrored in emulated device memory: the layout then names the
// device planes, and download() brings them back for the byte checks.
struct Pool {
    HostPool host;
    bool device;
    std::vector<void *> kd, vd;
    sg_kv_layout_t layout;
    Pool(uint32_t layers, uint32_t blocks, bool on_device) : host(layers, blocks), device(on_device) {
        layout = host.layout;
        if (!device) return;
        const size_t bytes = host.k[0].size() * 2;
        for (uint32_t l = 0; l < layers; ++l) {
            kd.push_back(emu().alloc(bytes));
            vd.push_back(emu().alloc(bytes));
        }
        layout.mem_kind = SG_MEM_CUDA;
        layout.device = 0;
        layout.layer_k_base = kd.data();
        layout.layer_v_base = vd.data();
    }
    ~Pool() {
        for (void *p : kd) emu().free_(p);
        for (void *p : vd) emu().free_(p);
    }
    void upload() {
        for (size_t l = 0; device && l < kd.size(); ++l) {
            emu().write(kd[l], host.k[l].data(), host.k[l].size() * 2);
            emu().write(vd[l], host.v[l].data(), host.v[l].size() * 2);
        }
    }
    void download() {
        for (size_t l = 0; device && l < kd.size(); ++l) {
            emu().read(host.k[l].data(), kd[l], host.k[l].size() * 2);
            emu().read(host.v[l].data(), vd[l], host.v[l].size() * 2);
        }
    }
    bool holds(uint64_t addr) const {
        const uint64_t bytes = host.k[0].size() * 2;
        for (auto *planes : {&kd, &vd})
            for (void *p : *planes)
                if (addr >= reinterpret_cast<uint64_t>(p) && addr < reinterpret_cast<uint64_t>(p) + bytes) return true;
        return false;
    }
};

PairConfig hmem_config(bool hmem) {
    PairConfig cfg;
    cfg.knobs.hmem = hmem;
    cfg.knobs.needs_local_desc = false;  // device buffers must still pass theirs (FI_MR_HMEM)
    cfg.knobs.device_copy = [](void *dst, const void *src, uint64_t n) { emu().dma(dst, src, size_t(n)); };
    return cfg;
}

struct Case {
    bool src_device, dst_device, hmem;
    uint32_t paths;
};

std::string case_name(const ::testing::TestParamInfo<Case> &info) {
    const Case &c = info.param;
    return std::string(c.src_device ? "Device" : "Host") + "To" + (c.dst_device ? "Device" : "Host") +
           (c.hmem ? "ByRma" : "Staged") + (c.paths == SG_PATH_FULL ? "Full" : "Selective");
}

class DeviceRma : public ::testing::TestWithParam<Case> {
  protected:
    void SetUp() override {
        if (!emu_ok()) GTEST_SKIP() << "needs SG_CUDA_PLUGIN naming the emulated plugin (ctest sets it)";
    }
};

TEST_P(DeviceRma, EveryByteLandsAndOnlyAProviderWithoutHmemStages) {
    const Case c = GetParam();
    FakePair p(21, hmem_config(c.hmem));
    // The staging policy may pack small scattered writes of any pool into a slot; this test is about
    // what RMA reaches, so plain writes wherever the provider allows them.
    p.prefill->set_param(SG_PARAM_STAGING_POLICY, SG_STAGING_NEVER);
    Pool src(3, 64, c.src_device), dst(3, 64, c.dst_device);
    src.host.fill(0xd1ec7);
    src.upload();
    dst.upload();  // zeros
    auto src_kv = std::make_shared<core::KvPool>(p.prefill.get(), src.layout);
    auto dst_kv = std::make_shared<core::KvPool>(p.decode.get(), dst.layout);
    p.at_prefill->export_kv(*src_kv);
    p.at_decode->export_kv(*dst_kv);
    const uint64_t tokens = 250;
    const std::vector<uint32_t> st = iota_table(63);
    std::vector<uint32_t> dt(63);
    for (size_t i = 0; i < dt.size(); ++i) dt[i] = uint32_t(62 - i);
    const uint64_t staged_before = emu().staged(), digested_before = emu().digested();

    sg_transfer_options_t o = transfer_options(c.paths);
    auto expect = p.decode->expect(p.at_decode, "req", dst_kv, dt, tokens, o);
    o.flags |= SG_TRANSFER_ALL_LAYERS_WRITTEN;
    auto post = p.prefill->post(p.at_prefill, "req", src_kv, st, tokens, o, nullptr);
    if (c.paths & SG_PATH_ON_DEMAND) {
        ASSERT_TRUE(p.run_until([&] { return expect->paths() != 0; }));
        const uint32_t want[] = {7, 50};
        expect->fetch(2, want);
    }
    ASSERT_TRUE(p.run_until([&] { return quiesced(*p.prefill, *post) && quiesced(*p.decode, *expect); }))
        << "prefill " << post->status << " " << post->error << ", decode " << expect->status << " " << expect->error;
    ASSERT_EQ(post->status, SG_OK) << post->error;
    ASSERT_EQ(expect->status, SG_OK) << expect->error;

    dst.download();
    for (uint32_t l = 0; l < 3; ++l)
        for (size_t i = 0; i < st.size(); ++i)
            ASSERT_TRUE(same_tokens(src.host, st, dst.host, dt, tokens, l, i)) << "layer " << l << " block " << i;

    if (c.paths != SG_PATH_FULL && c.src_device)
        EXPECT_GE(emu().digested() - digested_before, 3u * 63) << "every layer's digests, on the device";
    const bool rma = c.hmem || (!c.src_device && !c.dst_device);
    if (rma) {
        EXPECT_EQ(post->stats.staged_bytes, 0u) << "a pool the provider reaches is written, not staged";
        // Selection's digests are computed on the device: not even the keys are copied off it.
        EXPECT_EQ(emu().staged() - staged_before, 0u) << "nothing went through the plugin's copies";
        EXPECT_GT(post->stats.rma_ops, 0u);
        // The writes land in the decode side's device planes themselves.
        uint64_t into_device = 0;
        for (const auto &w : p.fabric.writes()) into_device += dst.holds(w.target_addr) ? w.len : 0;
        if (c.dst_device) EXPECT_GE(into_device, uint64_t(tokens) * 64 * 2 * 2 * 3);
    } else {
        EXPECT_GE(post->stats.staged_bytes, uint64_t(tokens) * 64 * 2 * 2 * 3);
        EXPECT_GT(emu().staged() - staged_before, 0u);
    }
    post->release();
    expect->release();
    post.reset();
    expect.reset();
    src_kv.reset();
    dst_kv.reset();
    p.close();
    EXPECT_EQ(p.prefill->stats().registrations, 0u);
    EXPECT_EQ(p.decode->stats().registrations, 0u);
}

constexpr uint32_t kSelective = SG_PATH_PROACTIVE | SG_PATH_ON_DEMAND | SG_PATH_SPECULATIVE;

INSTANTIATE_TEST_SUITE_P(Pools, DeviceRma,
                         ::testing::Values(Case{true, true, true, SG_PATH_FULL}, Case{false, true, true, SG_PATH_FULL},
                                           Case{true, false, true, SG_PATH_FULL}, Case{true, true, true, kSelective},
                                           Case{true, true, false, SG_PATH_FULL},
                                           Case{true, true, false, kSelective}),
                         case_name);

// The provider has FI_HMEM but refuses to register the decode side's device pool (as fi_mr_regattr
// may, for memory the NIC cannot pin): that pool is exported without keys, and the transfer moves
// every byte through the slots instead, whole.
TEST(DeviceRmaMixed, APoolTheProviderRefusesIsStagedAndStillLandsWhole) {
    if (!emu_ok()) GTEST_SKIP() << "needs SG_CUDA_PLUGIN naming the emulated plugin (ctest sets it)";
    FakePair p(22, hmem_config(true));
    Pool src(2, 16, true), dst(2, 16, true);
    src.host.fill(0xabc);
    src.upload();
    dst.upload();
    auto src_kv = std::make_shared<core::KvPool>(p.prefill.get(), src.layout);
    auto dst_kv = std::make_shared<core::KvPool>(p.decode.get(), dst.layout);
    p.at_prefill->export_kv(*src_kv);
    PairConfig refusing = hmem_config(true);
    refusing.knobs.refuse_device_memory = true;
    p.fabric.set_knobs(refusing.knobs);
    p.at_decode->export_kv(*dst_kv);
    EXPECT_EQ(p.decode->stats().registrations, 0u) << "the refused registration left nothing behind";
    const std::vector<uint32_t> table = iota_table(16);
    auto expect = p.decode->expect(p.at_decode, "req", dst_kv, table, 64, transfer_options());
    sg_transfer_options_t o = transfer_options();
    o.flags |= SG_TRANSFER_ALL_LAYERS_WRITTEN;
    auto post = p.prefill->post(p.at_prefill, "req", src_kv, table, 64, o, nullptr);
    ASSERT_TRUE(p.run_until([&] { return quiesced(*p.prefill, *post) && quiesced(*p.decode, *expect); }));
    ASSERT_EQ(post->status, SG_OK) << post->error;
    ASSERT_EQ(expect->status, SG_OK) << expect->error;
    dst.download();
    for (uint32_t l = 0; l < 2; ++l)
        for (size_t i = 0; i < table.size(); ++i) ASSERT_TRUE(same_tokens(src.host, table, dst.host, table, 64, l, i));
    EXPECT_EQ(post->stats.staged_bytes, uint64_t(64) * 64 * 2 * 2 * 2);
    post->release();
    expect->release();
    post.reset();
    expect.reset();
    p.close();
}

}  // namespace
}  // namespace sg::testing
