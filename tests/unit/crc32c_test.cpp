// CRC32C (runtime/common): the published check value, chaining, the instruction path against the
// table path every CPU runs, and the copy that computes it on the way.
#include "common/common.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

TEST(Crc32c, KnownValues) {
    const std::string check = "123456789";
    EXPECT_EQ(sg::crc32c(0, check.data(), check.size()), 0xE3069283u);
    EXPECT_EQ(sg::crc32c_portable(0, check.data(), check.size()), 0xE3069283u);
    EXPECT_EQ(sg::crc32c(0, nullptr, 0), 0u);
    // RFC 3720 B.4: 32 bytes of zeros, of ones.
    const std::vector<uint8_t> zeros(32, 0), ones(32, 0xff);
    EXPECT_EQ(sg::crc32c(0, zeros.data(), 32), 0x8A9136AAu);
    EXPECT_EQ(sg::crc32c(0, ones.data(), 32), 0x62A8AB43u);
}

// Lengths around a word and around the three-stream rounds (3 KiB), at every alignment, split
// anywhere: the fast path, the portable path and the copying path agree, and the copy is exact.
TEST(Crc32c, PathsAgreeAtEveryLengthAlignmentAndSplit) {
    std::mt19937_64 rng(7);
    std::vector<uint8_t> data(100003 + 16);
    for (auto &b : data) b = uint8_t(rng());
    for (size_t align = 0; align < 8; ++align)
        for (size_t len : {0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1000, 3071, 3072, 3073, 4096, 6151, 16384, 100003}) {
            const uint8_t *p = data.data() + align;
            const uint32_t want = sg::crc32c_portable(0, p, len);
            ASSERT_EQ(sg::crc32c(0, p, len), want) << len << " at +" << align;
            std::vector<uint8_t> out(len + 8, 0);
            ASSERT_EQ(sg::crc32c_copy(0, out.data() + (align ^ 3), p, len), want) << len << " at +" << align;
            ASSERT_EQ(std::memcmp(out.data() + (align ^ 3), p, len), 0);
            const size_t cut = len / 3;
            ASSERT_EQ(sg::crc32c(sg::crc32c(0, p, cut), p + cut, len - cut), want);
        }
}

TEST(Crc32c, OneFlippedBitChangesIt) {
    std::vector<uint8_t> data(1 << 16, 0x5a);
    const uint32_t clean = sg::crc32c(0, data.data(), data.size());
    for (size_t at : {size_t(0), size_t(12345), data.size() - 1}) {
        data[at] ^= 0x40;
        EXPECT_NE(sg::crc32c(0, data.data(), data.size()), clean) << at;
        data[at] ^= 0x40;
    }
}

}  // namespace
