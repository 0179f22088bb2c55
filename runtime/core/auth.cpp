#include "core/auth.hpp"

#include "common/common.hpp"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace sg::core::auth {

namespace {

void put_u64(std::vector<uint8_t> &out, uint64_t v) {
    for (int i = 0; i < 8; ++i) out.push_back(uint8_t(v >> (8 * i)));
}

void put_part(std::vector<uint8_t> &out, std::span<const uint8_t> part) {
    // Length-prefixed, so the concatenation of parts is unambiguous.
    put_u64(out, part.size());
    out.insert(out.end(), part.begin(), part.end());
}

Mac hmac(const Key &k, const std::vector<uint8_t> &msg) {
    if (k.empty()) fail(SG_ERR_INTERNAL, "HMAC without a key");
    Mac out(EVP_MAX_MD_SIZE);
    unsigned int len = 0;
    if (!HMAC(EVP_sha256(), k.bytes().data(), int(k.bytes().size()), msg.data(), msg.size(), out.data(), &len))
        fail(SG_ERR_INTERNAL, "HMAC-SHA256 failed in libcrypto");
    out.resize(len);
    return out;
}

std::vector<uint8_t> labelled(const char *label) {
    std::vector<uint8_t> msg;
    put_part(msg, std::span(reinterpret_cast<const uint8_t *>(label), std::strlen(label)));
    return msg;
}

}  // namespace

Key::Key(std::span<const uint8_t> bytes) : bytes_(bytes.begin(), bytes.end()) {}
Key::Key(Key &&o) noexcept : bytes_(std::move(o.bytes_)) {}
Key &Key::operator=(Key &&o) noexcept {
    if (this != &o) {
        if (!bytes_.empty()) OPENSSL_cleanse(bytes_.data(), bytes_.size());
        bytes_ = std::move(o.bytes_);
    }
    return *this;
}
Key::~Key() {
    if (!bytes_.empty()) OPENSSL_cleanse(bytes_.data(), bytes_.size());
}

Key load_key(const void *option_key, size_t option_len, std::string &warning) {
    if (option_key || option_len) {
        if (!option_key) fail(SG_ERR_INVALID_ARGUMENT, "auth_key is NULL but auth_key_len is not 0");
        if (option_len < kMinKeyBytes || option_len > kMaxKeyBytes)
            fail(SG_ERR_INVALID_ARGUMENT, "auth_key_len is " + std::to_string(option_len) + "; a key holds " +
                                              std::to_string(kMinKeyBytes) + " to " + std::to_string(kMaxKeyBytes) +
                                              " bytes");
        return Key(std::span(static_cast<const uint8_t *>(option_key), option_len));
    }
    const char *path = std::getenv("SG_AUTH_KEY_FILE");
    if (!path || !*path) return Key();
    int fd = ::open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail(SG_ERR_INVALID_ARGUMENT, std::string("SG_AUTH_KEY_FILE '") + path + "': " + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) == 0 && (st.st_mode & (S_IRWXG | S_IRWXO)))
        warning = std::string("SG_AUTH_KEY_FILE '") + path + "' is accessible to group or others (chmod 600 it)";
    std::vector<uint8_t> bytes(kMaxKeyBytes + 1);
    size_t n = 0;
    for (;;) {
        ssize_t k = ::read(fd, bytes.data() + n, bytes.size() - n);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) {
            const int err = errno;
            ::close(fd);
            fail(SG_ERR_INVALID_ARGUMENT, std::string("SG_AUTH_KEY_FILE '") + path + "': " + std::strerror(err));
        }
        if (k == 0 || (n += size_t(k)) == bytes.size()) break;
    }
    ::close(fd);
    // A key written with echo or an editor ends in a newline that is not part of it.
    while (n && (bytes[n - 1] == '\n' || bytes[n - 1] == '\r')) --n;
    Key key(std::span<const uint8_t>(bytes.data(), n));
    OPENSSL_cleanse(bytes.data(), bytes.size());
    if (n < kMinKeyBytes || n > kMaxKeyBytes)
        fail(SG_ERR_INVALID_ARGUMENT, std::string("SG_AUTH_KEY_FILE '") + path + "' holds " + std::to_string(n) +
                                          " bytes; a key holds " + std::to_string(kMinKeyBytes) + " to " +
                                          std::to_string(kMaxKeyBytes));
    return key;
}

std::vector<uint8_t> random_nonce() {
    std::vector<uint8_t> n(kNonceBytes);
    if (RAND_bytes(n.data(), int(n.size())) != 1) fail(SG_ERR_INTERNAL, "RAND_bytes failed in libcrypto");
    return n;
}

Mac bootstrap_proof(const Key &k, Role prover, std::span<const uint8_t> prover_hello,
                    std::span<const uint8_t> verifier_hello) {
    std::vector<uint8_t> msg = labelled("smartgen bootstrap proof v2");
    put_u64(msg, uint64_t(prover));
    put_part(msg, prover_hello);
    put_part(msg, verifier_hello);
    return hmac(k, msg);
}

Mac bootstrap_verdict(const Key &k, Role sender, std::span<const uint8_t> sender_hello,
                      std::span<const uint8_t> receiver_hello) {
    std::vector<uint8_t> msg = labelled("smartgen bootstrap verdict v2");
    put_u64(msg, uint64_t(sender));
    put_part(msg, sender_hello);
    put_part(msg, receiver_hello);
    return hmac(k, msg);
}

Mac blob_mac(const Key &k, std::span<const uint8_t> hello_frame) {
    std::vector<uint8_t> msg = labelled("smartgen metadata blob v1");
    put_part(msg, hello_frame);
    return hmac(k, msg);
}

Mac fabric_proof(const Key &k, uint64_t prover_ctx, uint64_t verifier_ctx, std::span<const uint8_t> verifier_nonce) {
    std::vector<uint8_t> msg = labelled("smartgen fabric proof v1");
    put_u64(msg, prover_ctx);
    put_u64(msg, verifier_ctx);
    put_part(msg, verifier_nonce);
    return hmac(k, msg);
}

bool mac_equal(std::span<const uint8_t> a, std::span<const uint8_t> b) {
    return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace sg::core::auth
