// Lanes as a host sets and reads them: options.lanes and local_addr lists checked at creation,
// the default per provider, SG_LANES, and the count in the statistics and the metrics text.
#include <smartgen/smartgen.h>

#include "../test_key.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

sg_status_t create(const char *provider, uint32_t lanes, const char *local_addr, sg_context_t *out) {
    sg_context_options_t o;
    sg_context_options_init(&o);
    o.provider = provider;
    o.lanes = lanes;
    o.local_addr = local_addr;
    o.log_level = SG_LOG_OFF;
    SG_TEST_USE_KEY(o);
    *out = nullptr;
    return sg_context_create(&o, out, nullptr);
}

// Resident set of this process, in bytes.
uint64_t resident_bytes() {
    FILE *f = std::fopen("/proc/self/statm", "r");
    if (!f) return 0;
    unsigned long pages = 0, resident = 0;
    const int n = std::fscanf(f, "%lu %lu", &pages, &resident);
    std::fclose(f);
    return n == 2 ? uint64_t(resident) * 4096 : 0;
}

uint64_t lanes_of(sg_context_t c) {
    sg_context_stats_t s;
    sg_context_stats_init(&s);
    EXPECT_EQ(sg_context_stats(c, &s), SG_OK);
    return s.lanes;
}

TEST(LaneOptions, TheDefaultIsTwoOnTcpAndOneOnShm) {
    sg_context_t c = nullptr;
    ASSERT_EQ(create("tcp", 0, nullptr, &c), SG_OK) << sg_last_error_message();
    EXPECT_EQ(lanes_of(c), 2u);
    std::string text(4096, '\0');
    size_t len = 0;
    ASSERT_EQ(sg_context_metrics_text(c, text.data(), text.size(), &len), SG_OK);
    EXPECT_NE(text.find("smartgen_lanes 2\n"), std::string::npos) << text;
    EXPECT_NE(text.find("smartgen_lane_failovers_total 0\n"), std::string::npos);
    sg_context_destroy(c);
    ASSERT_EQ(create("shm", 0, nullptr, &c), SG_OK) << sg_last_error_message();
    EXPECT_EQ(lanes_of(c), 1u);
    sg_context_destroy(c);
}

TEST(LaneOptions, ACountAndAnAddressListAreHonoured) {
    sg_context_t c = nullptr;
    ASSERT_EQ(create("tcp", 3, nullptr, &c), SG_OK) << sg_last_error_message();
    EXPECT_EQ(lanes_of(c), 3u);
    sg_context_destroy(c);
    ASSERT_EQ(create("tcp", 1, nullptr, &c), SG_OK);
    EXPECT_EQ(lanes_of(c), 1u);
    sg_context_destroy(c);
    // Three rails (here all loopback addresses): a lane on each.
    ASSERT_EQ(create("tcp", 0, "127.0.0.1,127.0.0.2,127.0.0.3", &c), SG_OK) << sg_last_error_message();
    EXPECT_EQ(lanes_of(c), 3u);
    sg_context_destroy(c);
    ::setenv("SG_LANES", "4", 1);
    ASSERT_EQ(create("tcp", 2, nullptr, &c), SG_OK);
    EXPECT_EQ(lanes_of(c), 4u) << "SG_LANES overrides options.lanes";
    sg_context_destroy(c);
    ::unsetenv("SG_LANES");
}

TEST(LaneOptions, BadCountsAndAddressesAreRefusedWithTheReason) {
    sg_context_t c = nullptr;
    EXPECT_EQ(create("tcp", 17, nullptr, &c), SG_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(sg_last_error_message()).find("options.lanes"), std::string::npos) << sg_last_error_message();
    EXPECT_EQ(c, nullptr);
    for (const char *bad : {"127.0.0.1,localhost", "127.0.0.1,", ",127.0.0.1", "127.0.0.1,,127.0.0.2"}) {
        EXPECT_EQ(create("tcp", 0, bad, &c), SG_ERR_INVALID_ARGUMENT) << bad;
        EXPECT_NE(std::string(sg_last_error_message()).find("options.local_addr"), std::string::npos) << bad;
    }
    ::setenv("SG_LANES", "lots", 1);
    EXPECT_EQ(create("tcp", 0, nullptr, &c), SG_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(sg_last_error_message()).find("SG_LANES"), std::string::npos) << sg_last_error_message();
    ::unsetenv("SG_LANES");
}

// A context pays for its endpoints on first use: enabling a tcp;ofi_rxm endpoint is where the
// provider allocates and touches its bounce-buffer pools (~70 MB a lane), which a context that
// holds no session does not need. Three lanes cost ~230 MB at creation before 0.5.
TEST(LaneOptions, AContextWithoutASessionIsSmallAndOpensItsEndpointsOnFirstUse) {
    sg_context_t c = nullptr;
    // Once first, so that what libfabric loads and keeps per process is not counted.
    ASSERT_EQ(create("tcp", 3, nullptr, &c), SG_OK) << sg_last_error_message();
    sg_context_destroy(c);
    const uint64_t before = resident_bytes();
    ASSERT_GT(before, 0u);
    ASSERT_EQ(create("tcp", 3, nullptr, &c), SG_OK) << sg_last_error_message();
    const uint64_t idle = resident_bytes();
    EXPECT_LT(idle - before, uint64_t(24) << 20) << "a context with no session grew the process by "
                                                 << (idle - before) / 1024 << " KiB";
    // The metadata names every lane's endpoint, so producing it opens them.
    size_t len = 0;
    (void)sg_context_get_metadata(c, nullptr, 0, &len);
    ASSERT_GT(len, 0u);
    std::vector<uint8_t> blob(len);
    ASSERT_EQ(sg_context_get_metadata(c, blob.data(), blob.size(), &len), SG_OK) << sg_last_error_message();
    EXPECT_EQ(lanes_of(c), 3u);
    sg_context_destroy(c);
}

}  // namespace
