// Fuzzer: metadata blobs (core::parse_metadata, what sg_session_from_metadata runs), and opening a
// session from a blob that passes.
//
// Input: byte 0 is the mode, the rest the blob.
//   bit 0: sign the blob with the tests' key first (append auth::blob_mac of the whole rest), as a
//          key holder would, so the Hello inside reaches the checks after the signature
//   bit 1: parse with a context that has no key (allow_unauthenticated) instead of a keyed one
// A blob that parses is opened as a session (fuzz::open_and_close: its endpoints go to the fabric's
// address vector; nothing is sent) and closed again. sg::Error is a clean refusal.
#include "fuzz_common.hpp"

#include <span>

namespace {

using namespace sg;

core::Context &keyed() {
    static core::Context *ctx = fuzz::make_context(true).release();
    return *ctx;
}

core::Context &keyless() {
    static core::Context *ctx = fuzz::make_context(false).release();
    return *ctx;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    const uint8_t mode = data[0];
    std::vector<uint8_t> blob(data + 1, data + size);
    if (mode & 1) {
        const core::auth::Mac mac = core::auth::blob_mac(fuzz::test_key(), blob);
        blob.insert(blob.end(), mac.begin(), mac.end());
    }
    core::Context &ctx = (mode & 2) ? keyless() : keyed();
    wire::Hello peer;
    try {
        peer = core::parse_metadata(ctx, blob);
    } catch (const Error &) {
        return 0;
    }
    fuzz::open_and_close(ctx, peer, false);
    return 0;
}
