// Session authentication: a pre-shared key and HMAC-SHA256 proofs (OpenSSL libcrypto).
//
// What it gives: a session exists only between two contexts holding the same key, and the peer
// learns no memory key (HandleExport) before it has proven that. What it does not give:
// confidentiality or integrity of the data and control traffic after that point.
//
// Every proof binds fresh randomness chosen by the verifier, so a recorded proof cannot be
// replayed, and names the direction (prover first), so a proof cannot be reflected back to the
// party that made it. Each use has its own label, so a MAC of one kind never passes as another.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace sg::core::auth {

inline constexpr size_t kMinKeyBytes = 32;
inline constexpr size_t kMaxKeyBytes = 4096;
inline constexpr size_t kMacBytes = 32;
inline constexpr size_t kNonceBytes = 32;

using Mac = std::vector<uint8_t>;

// The key, wiped from memory when destroyed.
class Key {
  public:
    Key() = default;
    explicit Key(std::span<const uint8_t> bytes);
    Key(const Key &) = delete;
    Key &operator=(const Key &) = delete;
    Key(Key &&o) noexcept;
    Key &operator=(Key &&o) noexcept;
    ~Key();
    bool empty() const { return bytes_.empty(); }
    std::span<const uint8_t> bytes() const { return bytes_; }

  private:
    std::vector<uint8_t> bytes_;
};

// The key from options (ptr + len) or, when none is given, from the file SG_AUTH_KEY_FILE names.
// An empty Key means none was configured. Throws SG_ERR_INVALID_ARGUMENT for a key shorter than
// kMinKeyBytes or an unreadable file. `warning` receives a note for a file others can read.
Key load_key(const void *option_key, size_t option_len, std::string &warning);

std::vector<uint8_t> random_nonce();

// Which end of the bootstrap connection a party is. Every bootstrap proof and verdict names the
// sender's role: without it, a keyless relay between two listeners holding the same key could hand
// each listener the other's proof (both prove "my Hello, then yours"), and both would accept.
enum class Role : uint8_t { Acceptor = 1, Connector = 2 };
inline Role other(Role r) { return r == Role::Acceptor ? Role::Connector : Role::Acceptor; }

// Bootstrap (TCP) proof: the prover's role and both Hello frames, the prover's first.
Mac bootstrap_proof(const Key &k, Role prover, std::span<const uint8_t> prover_hello,
                    std::span<const uint8_t> verifier_hello);
// Bootstrap verdict ("I accepted your proof"), bound to the sender's role and both Hellos, so a
// relay can neither forge an acceptance nor reflect one.
Mac bootstrap_verdict(const Key &k, Role sender, std::span<const uint8_t> sender_hello,
                      std::span<const uint8_t> receiver_hello);
// Metadata blob signature: over the blob's Hello frame.
Mac blob_mac(const Key &k, std::span<const uint8_t> hello_frame);
// Fabric proof for blob sessions: prover and verifier context ids and the verifier's challenge.
Mac fabric_proof(const Key &k, uint64_t prover_ctx, uint64_t verifier_ctx, std::span<const uint8_t> verifier_nonce);

// Constant-time comparison.
bool mac_equal(std::span<const uint8_t> a, std::span<const uint8_t> b);

}  // namespace sg::core::auth
