// Wire compatibility across versions, as a session sees it: a metadata blob from a newer minor
// release (with a field this release does not know) is accepted; another major is refused with
// SG_ERR_VERSION_MISMATCH, and garbage with SG_ERR_PROTOCOL.
#include "core/core.hpp"
#include "wire/wire.hpp"

#include <gtest/gtest.h>

namespace {

using namespace sg;

wire::Hello sample(uint64_t ctx) {
    wire::Hello h;
    h.ctx_id = ctx;
    h.boot_id = "boot";
    h.netns_inode = 7;
    h.endpoints.push_back({"tcp;ofi_rxm", {1, 2, 3, 4}});
    return h;
}

sg_status_t status_of(const std::vector<uint8_t> &blob) {
    try {
        core::parse_metadata(blob);
        return SG_OK;
    } catch (const Error &e) {
        return e.status();
    }
}

TEST(Compat, NewerMinorWithUnknownOptionalFieldIsAccepted) {
    wire::Hello h = sample(42);
    h.proto_minor = wire::kProtoMinor + 1;
    std::vector<uint8_t> blob;
    wire::encode(blob, 42, h);
    blob[6] = uint8_t(wire::kProtoMinor + 1);  // the frame header's minor, as a newer peer sends it
    const uint8_t extra[] = {9, 9, 9};
    wire::append_raw_field(blob, 0, 0x8000 | 77, extra);
    EXPECT_EQ(status_of(blob), SG_OK);
    const wire::Hello got = core::parse_metadata(blob);
    EXPECT_EQ(got.ctx_id, 42u);
    ASSERT_EQ(got.endpoints.size(), 1u);
    EXPECT_EQ(got.endpoints[0].provider, "tcp;ofi_rxm");
}

TEST(Compat, AnotherMajorIsRefusedWithItsOwnStatus) {
    std::vector<uint8_t> blob;
    wire::encode(blob, 42, sample(42));
    blob[4] = uint8_t(wire::kProtoMajor + 1);
    EXPECT_EQ(status_of(blob), SG_ERR_VERSION_MISMATCH);
}

TEST(Compat, UnknownRequiredFieldOrGarbageIsAProtocolError) {
    std::vector<uint8_t> blob;
    wire::encode(blob, 42, sample(42));
    const uint8_t extra[] = {1};
    wire::append_raw_field(blob, 0, 77, extra);  // required (no optional bit): cannot be skipped
    EXPECT_EQ(status_of(blob), SG_ERR_PROTOCOL);
    EXPECT_EQ(status_of({1, 2, 3}), SG_ERR_PROTOCOL);
    std::vector<uint8_t> other;
    wire::encode(other, 43, sample(42));  // the frame names another context than the Hello
    EXPECT_EQ(status_of(other), SG_ERR_PROTOCOL);
}

}  // namespace
