// A CUDA pool and the plugin it needs (docs/cuda.md): each test is its own process under ctest, and
// the plugin is looked for once per process, so SG_CUDA_PLUGIN set here is the one the runtime reads.
// Whatever is missing, the pool is refused with SG_ERR_UNSUPPORTED and a message that names it.
#include <gtest/gtest.h>
#include <smartgen/smartgen.h>

#include <cstdlib>
#include <string>
#include <vector>

namespace {

std::string register_cuda_pool() {
    sg_context_options_t o;
    sg_context_options_init(&o);
    o.allow_unauthenticated = 1;  // no session is made
    sg_context_t ctx = nullptr;
    EXPECT_EQ(sg_context_create(&o, &ctx, nullptr), SG_OK) << sg_last_error_message();
    std::vector<uint8_t> k(4096), v(4096);
    void *kb[1] = {k.data()}, *vb[1] = {v.data()};
    sg_kv_layout_t layout;
    sg_kv_layout_init(&layout);
    layout.num_layers = 1;
    layout.num_kv_heads = 1;
    layout.head_dim = 64;
    layout.tokens_per_block = 16;
    layout.num_blocks = 2;
    layout.mem_kind = SG_MEM_CUDA;
    layout.layer_k_base = kb;
    layout.layer_v_base = vb;
    layout.layer_base_count = 1;
    sg_error_info_t err;
    sg_error_info_init(&err);
    sg_kv_handle_t kv = nullptr;
    EXPECT_EQ(sg_kv_register(ctx, &layout, &kv, &err), SG_ERR_UNSUPPORTED);
    EXPECT_EQ(kv, nullptr);
    EXPECT_EQ(sg_context_destroy(ctx), SG_OK);
    return err.message;
}

TEST(CudaPlugin, AMissingPluginIsNamedWithTheLoadersReason) {
    ::setenv("SG_CUDA_PLUGIN", "/nonexistent/libsmartgen-cuda.so.0", 1);
    const std::string msg = register_cuda_pool();
    EXPECT_NE(msg.find("needs the CUDA plugin"), std::string::npos) << msg;
    EXPECT_NE(msg.find("SG_CUDA_PLUGIN=/nonexistent/libsmartgen-cuda.so.0"), std::string::npos) << msg;
    EXPECT_NE(msg.find("No such file"), std::string::npos) << msg;
}

TEST(CudaPlugin, ALibraryThatIsNotThePluginIsRefused) {
    ::setenv("SG_CUDA_PLUGIN", "libm.so.6", 1);
    const std::string msg = register_cuda_pool();
    EXPECT_NE(msg.find("is not a SmartGen CUDA plugin"), std::string::npos) << msg;
}

TEST(CudaPlugin, TheDefaultSearchNamesWhatIsMissing) {
    ::unsetenv("SG_CUDA_PLUGIN");
    const std::string msg = register_cuda_pool();
    // Built with nvcc, the plugin sits beside libsmartgen and then names the driver or the device it
    // lacks (or says device transfers are not in this build); built without, the plugin is missing.
    EXPECT_NE(msg.find("CUDA plugin"), std::string::npos) << msg;
    std::printf("SG_MEM_CUDA on this machine: %s\n", msg.c_str());
}

}  // namespace
