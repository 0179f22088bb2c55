// Session authentication, all of it that is not bootstrap's socket handshake: the policy (both
// sides keyed, or neither), signed metadata blobs, the fabric challenge-response that sessions made
// from blobs run before anything else, and counting what was refused. The MACs themselves are in
// auth.cpp; the handshake's proof steps (bootstrap.cpp) call the same policy check.
#include "core/core.hpp"

namespace sg::core {

wire::Hello decode_hello_frame(std::span<const uint8_t> frame) {
    wire::FrameHeader h;
    std::span<const uint8_t> body;
    wire::DecodeError e = wire::decode_header(frame, h, body);
    if (e == wire::DecodeError::VersionMismatch)
        fail(SG_ERR_VERSION_MISMATCH, "peer speaks SmartGen wire protocol major " + std::to_string(h.proto_major) +
                                          ", this library speaks " + std::to_string(wire::kProtoMajor));
    if (e != wire::DecodeError::None) fail(SG_ERR_PROTOCOL, std::string("bad bootstrap frame: ") + wire::decode_error_str(e));
    if (h.type != wire::MsgType::Hello) fail(SG_ERR_PROTOCOL, "bootstrap frame is not a Hello");
    wire::Hello hello;
    e = wire::decode(body, hello);
    if (e != wire::DecodeError::None) fail(SG_ERR_PROTOCOL, std::string("bad Hello: ") + wire::decode_error_str(e));
    if (hello.ctx_id != h.sender_ctx) fail(SG_ERR_PROTOCOL, "Hello names another context than its frame");
    if (hello.auth == wire::AuthMode::HmacSha256 && hello.nonce.size() != wire::kNonceBytes)
        fail(SG_ERR_PROTOCOL, "Hello asks for authentication but carries no nonce");
    return hello;
}

void check_auth_policy(const Context &ctx, const wire::Hello &peer) {
    const bool peer_keyed = peer.auth == wire::AuthMode::HmacSha256;
    if (!ctx.key().empty() && !peer_keyed)
        fail(SG_ERR_AUTH_REQUIRED, "the peer has no authentication key and this context requires one");
    if (ctx.key().empty() && peer_keyed)
        fail(SG_ERR_AUTH_REQUIRED, "the peer requires authentication and this context has no key "
                                   "(set auth_key or SG_AUTH_KEY_FILE)");
}

wire::Hello parse_metadata(const Context &ctx, std::span<const uint8_t> blob) {
    wire::Hello peer = decode_hello_frame(blob);
    check_auth_policy(ctx, peer);
    if (ctx.key().empty()) return peer;
    const size_t frame_len = wire::kFrameHeaderBytes + (size_t(blob[20]) | size_t(blob[21]) << 8 |
                                                        size_t(blob[22]) << 16 | size_t(blob[23]) << 24);
    if (blob.size() == frame_len) fail(SG_ERR_AUTH_FAILED, "the metadata blob carries no signature");
    // Anything but exactly one MAC after the frame is a malformed blob (cut or padded in transit or
    // storage), not a question of keys.
    if (blob.size() != frame_len + wire::kMacBytes)
        fail(SG_ERR_PROTOCOL, "the metadata blob has " + std::to_string(blob.size() - frame_len) +
                                  " bytes after its frame, where a signature has " + std::to_string(wire::kMacBytes) +
                                  (blob.size() > frame_len + wire::kMacBytes
                                       ? " (" + std::to_string(blob.size() - frame_len - wire::kMacBytes) + " trailing)"
                                       : std::string(" (cut short)")));
    if (!auth::mac_equal(blob.subspan(frame_len), auth::blob_mac(ctx.key(), blob.first(frame_len))))
        fail(SG_ERR_AUTH_FAILED, "the metadata blob is not signed with this context's key");
    return peer;
}

// Fabric challenge-response of sessions made from metadata blobs: each side challenges with a fresh
// nonce and answers the other's challenge; a side trusts the peer once the peer's answer checks.

void Session::on_auth_challenge(wire::AuthChallenge &m) {
    // Only sessions the host opened from a blob answer: a bootstrapped session proved itself
    // already, and answering anyone would make this context an oracle.
    if (auth_nonce.empty()) return;
    std::vector<uint8_t> out;
    wire::encode(out, ctx->id, wire::AuthProof{auth::fabric_proof(ctx->key_, ctx->id, peer_ctx_id, m.nonce)});
    send_auth(out);
}

void Session::on_auth_proof(wire::AuthProof &m) {
    if (proven || auth_nonce.empty()) return;
    const bool ok = auth::mac_equal(m.mac, auth::fabric_proof(ctx->key_, peer_ctx_id, ctx->id, auth_nonce));
    std::vector<uint8_t> out;
    wire::encode(out, ctx->id, wire::AuthResult{ok ? 1u : 0u});
    send_auth(out);
    if (!ok) {
        ctx->counters.auth_failures++;
        lose(SG_ERR_AUTH_FAILED,
                     "the peer's key proof does not match this context's key (the two sides hold different keys)");
        return;
    }
    proven = true;
    advance(SessionState::Open);
    ctx->log.log(SG_LOG_INFO, "session with peer " + std::to_string(peer_ctx_id) + " authenticated over the fabric");
    flush_outbox();
    auto held = std::move(held_frames);
    forget_held_frames();
    for (auto &f : held) ctx->on_message(f);
    ctx->cv.notify_all();
    ctx->signal_event();
}

void Session::on_auth_result(wire::AuthResult &m) {
    // Like a challenge, a verdict means something only on a session that runs the fabric
    // challenge (made from a blob); a bootstrapped session was proven by its handshake.
    if (auth_nonce.empty()) return;
    if (!m.accepted) {
        ctx->counters.auth_failures++;
        lose(SG_ERR_AUTH_FAILED,
                     "the peer rejected this context's key proof (the two sides hold different keys)");
    }
}

// A session bootstrap refused for authentication: counted (sg_context_stats().auth_failures) and
// logged once, here, where it is understood.
void Context::count_refused_session(const Error &e) {
    if (e.status() != SG_ERR_AUTH_FAILED && e.status() != SG_ERR_AUTH_REQUIRED) return;
    std::lock_guard lock(mu);
    counters.auth_failures++;
    log.log(SG_LOG_ERROR, "session refused: " + e.message());
}

}  // namespace sg::core
