// Fuzzer: the bootstrap handshake (core::bootstrap_exchange, what sg_session_accept and
// sg_session_connect run on their TCP connection), against a peer that sends anything.
//
// Each input runs one handshake over a socketpair(AF_UNIX, SOCK_STREAM): the harness plays the
// peer on one end, the target context runs bootstrap_exchange on the other with a short timeout.
// Input: byte 0 is the mode, the rest is what the peer sends.
//   bit 0: the target's role (0 acceptor, 1 connector)
//   bit 1: the target has no key (allow_unauthenticated) instead of the tests' key
//   bits 2-3: how far the peer plays by the rules before the fuzzer's bytes take over:
//     0  nothing: the rest is the whole byte stream (Hello, AuthProof, AuthResult or junk)
//     1  a valid Hello of a keyed peer context, then the rest (its proof and verdict)
//     2  that Hello and the valid proof for this handshake (computed from the target's own Hello
//        as it arrives), then the rest (the verdict)
//     3  Hello and proof as in 2; the rest is a FuzzedDataProvider that may build the Hello's
//        fields (endpoints, boot id, auth mode, nonce) and the verdict's MAC, valid or not
// The peer's stream ends with shutdown(SHUT_WR), so a short stream fails at once instead of
// waiting for the timeout. A handshake that succeeds opens a session with the Hello it returned
// and closes it (fuzz::open_and_close, nothing sent). sg::Error is a clean refusal.
#include "fuzz_common.hpp"

#include <fuzzer/FuzzedDataProvider.h>

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <thread>

namespace {

using namespace sg;
using core::auth::Role;

constexpr uint64_t kTimeoutNs = 100000000;  // 100 ms: every stream here is complete or shut

core::Context &keyed() {
    static core::Context *ctx = fuzz::make_context(true).release();
    return *ctx;
}
core::Context &keyless() {
    static core::Context *ctx = fuzz::make_context(false).release();
    return *ctx;
}
// The context whose Hello the rule-abiding peer sends (its id and endpoints are real).
core::Context &peer_ctx() {
    static core::Context *ctx = fuzz::make_context(true).release();
    return *ctx;
}

void send_all(int fd, std::span<const uint8_t> bytes) {
    while (!bytes.empty()) {
        const ssize_t k = ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
        if (k <= 0) return;  // the target gave up and closed: the rest does not matter
        bytes = bytes.subspan(size_t(k));
    }
}

// Reads one frame the target sent (header, then body_len bytes); empty when it sent none in time.
std::vector<uint8_t> recv_frame(int fd) {
    std::vector<uint8_t> in;
    auto read_n = [&](size_t n) {
        while (n) {
            pollfd p{fd, POLLIN, 0};
            if (::poll(&p, 1, 1000) <= 0) return false;
            uint8_t buf[4096];
            const ssize_t k = ::recv(fd, buf, std::min(n, sizeof buf), 0);
            if (k <= 0) return false;
            in.insert(in.end(), buf, buf + k);
            n -= size_t(k);
        }
        return true;
    };
    if (!read_n(wire::kFrameHeaderBytes)) return {};
    const uint32_t body = uint32_t(in[20]) | uint32_t(in[21]) << 8 | uint32_t(in[22]) << 16 | uint32_t(in[23]) << 24;
    if (body > wire::kMaxFrameBytes || !read_n(body)) return {};
    return in;
}

wire::Hello fuzzed_hello(FuzzedDataProvider &p, core::Context &from) {
    wire::Hello h = from.hello();
    if (p.ConsumeBool()) h.boot_id = p.ConsumeRandomLengthString(300);
    if (p.ConsumeBool()) h.netns_inode = p.ConsumeIntegral<uint64_t>();
    if (p.ConsumeBool()) {
        h.endpoints.resize(p.ConsumeIntegralInRange<size_t>(0, 4));
        for (auto &e : h.endpoints) {
            e.provider = p.ConsumeBool() ? std::string("tcp;ofi_rxm") : p.ConsumeRandomLengthString(16);
            e.address = p.ConsumeBytes<uint8_t>(p.ConsumeIntegralInRange<size_t>(0, 40));
        }
    }
    if (p.ConsumeBool()) h.auth = static_cast<wire::AuthMode>(p.ConsumeIntegralInRange<uint32_t>(0, 2));
    if (p.ConsumeBool()) h.nonce = p.ConsumeBytes<uint8_t>(p.ConsumeIntegralInRange<size_t>(0, 40));
    if (p.ConsumeBool()) h.proto_minor = p.ConsumeIntegral<uint16_t>();
    return h;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    const uint8_t mode = data[0];
    const Role role = (mode & 1) ? Role::Connector : Role::Acceptor;
    core::Context &ctx = (mode & 2) ? keyless() : keyed();
    const int rules = (mode >> 2) & 3;
    std::span<const uint8_t> rest(data + 1, size - 1);

    int sv[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv)) return 0;
    const int mine = sv[0], theirs = sv[1];

    wire::Hello got;
    bool ok = false;
    auto run_target = [&] {
        try {
            got = core::bootstrap_exchange(mine, ctx, kTimeoutNs, role);
            ok = true;
        } catch (const Error &) {
        }
    };

    if (rules == 0) {
        send_all(theirs, rest);
        ::shutdown(theirs, SHUT_WR);
        run_target();
    } else {
        // The target sends its Hello first and then waits for ours; the peer runs beside it.
        std::thread target(run_target);
        FuzzedDataProvider p(rest.data(), rest.size());
        core::Context &peer = peer_ctx();
        const wire::Hello hello = rules == 3 ? fuzzed_hello(p, peer) : peer.hello();
        std::vector<uint8_t> peer_hello;
        wire::encode(peer_hello, peer.id, hello);
        send_all(theirs, peer_hello);
        if (rules >= 2) {
            const std::vector<uint8_t> target_hello = recv_frame(theirs);
            std::vector<uint8_t> proof;
            wire::encode(proof, peer.id,
                         wire::AuthProof{core::auth::bootstrap_proof(fuzz::test_key(), core::auth::other(role), peer_hello,
                                                                     target_hello)});
            send_all(theirs, proof);
            if (rules == 3) {
                wire::AuthResult verdict;
                verdict.accepted = p.ConsumeIntegralInRange<uint32_t>(0, 2);
                if (p.ConsumeBool())
                    verdict.mac = core::auth::bootstrap_verdict(fuzz::test_key(), core::auth::other(role), peer_hello,
                                                                target_hello);
                else
                    verdict.mac = p.ConsumeBytes<uint8_t>(p.ConsumeIntegralInRange<size_t>(0, 40));
                std::vector<uint8_t> frame;
                wire::encode(frame, peer.id, verdict);
                send_all(theirs, frame);
            }
        }
        if (rules != 3) send_all(theirs, rest);
        else send_all(theirs, p.ConsumeRemainingBytes<uint8_t>());
        ::shutdown(theirs, SHUT_WR);
        target.join();
    }
    ::close(mine);
    ::close(theirs);
    if (ok) fuzz::open_and_close(ctx, got, true);
    return 0;
}
