// Wire compatibility across versions, as a session sees it: a metadata blob from a newer minor
// release (with a field this release does not know) is accepted; another major is refused with
// SG_ERR_VERSION_MISMATCH, and garbage with SG_ERR_PROTOCOL. Also the blobs' signatures: a keyed
// context takes only blobs signed with its key.
#include "core/core.hpp"
#include "wire/wire.hpp"

#include <gtest/gtest.h>

#include <cstring>

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

sg_context_options_t options(const char *key) {
    sg_context_options_t o{};
    o.struct_size = sizeof o;
    o.provider = "tcp";
    o.log_level = SG_LOG_ERROR;
    if (key) {
        o.auth_key = key;
        o.auth_key_len = std::strlen(key);
    } else {
        o.allow_unauthenticated = true;
    }
    return o;
}

// No progress thread: only the bootstrap checks run here.
core::Context &open_context() {
    static core::Context ctx(options(nullptr));
    return ctx;
}

sg_status_t status_of(const std::vector<uint8_t> &blob, const core::Context &ctx = open_context()) {
    try {
        core::parse_metadata(ctx, blob);
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
    const wire::Hello got = core::parse_metadata(open_context(), blob);
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

TEST(Compat, BlobSignaturesAreCheckedAgainstTheKey) {
    const char *key = "compat-test-key-0123456789abcdef-0123";
    core::Context signer(options(key)), same(options(key)), other(options("another-key-of-at-least-32-bytes-0123"));
    const std::vector<uint8_t> blob = signer.metadata();
    EXPECT_EQ(status_of(blob, same), SG_OK);
    EXPECT_EQ(status_of(blob, other), SG_ERR_AUTH_FAILED);
    std::vector<uint8_t> tampered = blob;
    tampered[tampered.size() - 40] ^= 1;  // inside the Hello, covered by the signature
    EXPECT_EQ(status_of(tampered, same), SG_ERR_AUTH_FAILED);
    std::vector<uint8_t> unsigned_blob(blob.begin(), blob.end() - 32);
    EXPECT_EQ(status_of(unsigned_blob, same), SG_ERR_AUTH_FAILED);
    // A keyless context's blob is refused by a keyed one, and the other way round.
    EXPECT_EQ(status_of(open_context().metadata(), same), SG_ERR_AUTH_REQUIRED);
    EXPECT_EQ(status_of(blob, open_context()), SG_ERR_AUTH_REQUIRED);
}

TEST(Compat, KeysShorterThan32BytesAreRefused) {
    try {
        core::Context c(options("short-key"));
        FAIL() << "a 9-byte key was accepted";
    } catch (const Error &e) {
        EXPECT_EQ(e.status(), SG_ERR_INVALID_ARGUMENT);
        EXPECT_NE(e.message().find("32"), std::string::npos) << e.message();
    }
    sg_context_options_t none = options(nullptr);
    none.allow_unauthenticated = false;
    try {
        core::Context c(none);
        FAIL() << "a context without a key or allow_unauthenticated was created";
    } catch (const Error &e) {
        EXPECT_EQ(e.status(), SG_ERR_AUTH_REQUIRED);
    }
}

}  // namespace
