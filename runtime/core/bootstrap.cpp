// Bootstrap: a TCP listener and connector that exchange one Hello frame each way and, when the
// contexts have keys, prove them to each other (auth.hpp), all within the caller's deadline.
// Sockets are close-on-exec and every send uses MSG_NOSIGNAL, so a vanished peer never raises
// SIGPIPE in the host process.
#include "core/core.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

namespace sg::core {

namespace {

std::string errno_text(const char *what) { return std::string(what) + ": " + std::strerror(errno); }

struct Fd {
    int fd = -1;
    ~Fd() {
        if (fd >= 0) ::close(fd);
    }
};

// Resolves an IPv4/IPv6 literal; names are refused so nothing is looked up behind the caller's back.
sockaddr_storage make_addr(const char *addr, uint16_t port, socklen_t &len) {
    if (!addr || !*addr) fail(SG_ERR_INVALID_ARGUMENT, "address is empty");
    sockaddr_storage ss{};
    auto *v4 = reinterpret_cast<sockaddr_in *>(&ss);
    auto *v6 = reinterpret_cast<sockaddr_in6 *>(&ss);
    if (inet_pton(AF_INET, addr, &v4->sin_addr) == 1) {
        v4->sin_family = AF_INET;
        v4->sin_port = htons(port);
        len = sizeof(sockaddr_in);
    } else if (inet_pton(AF_INET6, addr, &v6->sin6_addr) == 1) {
        v6->sin6_family = AF_INET6;
        v6->sin6_port = htons(port);
        len = sizeof(sockaddr_in6);
    } else {
        fail(SG_ERR_INVALID_ARGUMENT, std::string("'") + addr + "' is not an IPv4 or IPv6 address literal");
    }
    return ss;
}

int remaining_ms(uint64_t deadline) {
    const uint64_t now = now_ns();
    return now >= deadline ? 0 : int((deadline - now + 999999) / 1000000);
}

void wait_fd(int fd, short events, uint64_t deadline, const char *what) {
    for (;;) {
        pollfd p{fd, events, 0};
        int rc = ::poll(&p, 1, remaining_ms(deadline));
        if (rc > 0) return;
        if (rc == 0) fail(SG_ERR_TIMEOUT, std::string("timed out ") + what);
        if (errno != EINTR) fail(SG_ERR_CONNECT, errno_text("poll"));
    }
}

void send_all(int fd, const uint8_t *p, size_t n, uint64_t deadline) {
    while (n) {
        ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k > 0) {
            p += k;
            n -= size_t(k);
        } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            wait_fd(fd, POLLOUT, deadline, "sending the bootstrap message");
        } else if (k < 0 && errno == EINTR) {
            continue;
        } else {
            fail(SG_ERR_PEER_LOST, errno_text("bootstrap send"));
        }
    }
}

void recv_all(int fd, uint8_t *p, size_t n, uint64_t deadline) {
    while (n) {
        wait_fd(fd, POLLIN, deadline, "waiting for the peer's bootstrap message");
        ssize_t k = ::recv(fd, p, n, MSG_DONTWAIT);
        if (k > 0) {
            p += k;
            n -= size_t(k);
        } else if (k == 0) {
            fail(SG_ERR_PEER_LOST, "peer closed the bootstrap connection");
        } else if (errno != EAGAIN && errno != EINTR) {
            fail(SG_ERR_PEER_LOST, errno_text("bootstrap recv"));
        }
    }
}

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

std::vector<uint8_t> recv_frame(int fd, uint64_t deadline) {
    std::vector<uint8_t> in(wire::kFrameHeaderBytes);
    recv_all(fd, in.data(), in.size(), deadline);
    const uint32_t body_len = uint32_t(in[20]) | uint32_t(in[21]) << 8 | uint32_t(in[22]) << 16 | uint32_t(in[23]) << 24;
    if (body_len > wire::kMaxFrameBytes) fail(SG_ERR_PROTOCOL, "bootstrap frame too large");
    in.resize(in.size() + body_len);
    recv_all(fd, in.data() + wire::kFrameHeaderBytes, body_len, deadline);
    return in;
}

template <class M> M recv_message(int fd, uint64_t deadline, wire::MsgType type, const char *what) {
    std::vector<uint8_t> in = recv_frame(fd, deadline);
    wire::FrameHeader h;
    std::span<const uint8_t> body;
    M m;
    if (wire::decode_header(in, h, body) != wire::DecodeError::None || h.type != type ||
        wire::decode(body, m) != wire::DecodeError::None)
        fail(SG_ERR_PROTOCOL, std::string("bad ") + what + " during bootstrap");
    return m;
}

// One Hello each way, then (both sides keyed) one proof each way over the prover's role and both
// Hellos, then one verdict each way (a MAC over the sender's role and both Hellos), so that a refusal
// is reported with the same status on both sides and a keyless relay can neither reflect a proof
// nor forge an acceptance.
wire::Hello exchange(int fd, const Context &ctx, uint64_t deadline, auth::Role role) {
    std::vector<uint8_t> out;
    wire::encode(out, ctx.id, ctx.hello());
    send_all(fd, out.data(), out.size(), deadline);
    const std::vector<uint8_t> in = recv_frame(fd, deadline);
    wire::Hello peer = decode_hello_frame(in);
    check_auth_policy(ctx, peer);
    if (ctx.key().empty()) return peer;
    if (peer.proto_minor < 1)
        fail(SG_ERR_VERSION_MISMATCH, "the peer speaks wire protocol 1." + std::to_string(peer.proto_minor) +
                                          ", whose key proofs do not name their sender's role; 1.1 or newer is required");
    std::vector<uint8_t> frame;
    wire::encode(frame, ctx.id, wire::AuthProof{auth::bootstrap_proof(ctx.key(), role, out, in)});
    send_all(fd, frame.data(), frame.size(), deadline);
    const auto proof = recv_message<wire::AuthProof>(fd, deadline, wire::MsgType::AuthProof, "AuthProof");
    const bool ok = auth::mac_equal(proof.mac, auth::bootstrap_proof(ctx.key(), auth::other(role), in, out));
    wire::AuthResult mine;
    mine.accepted = ok ? 1u : 0u;
    if (ok) mine.mac = auth::bootstrap_verdict(ctx.key(), role, out, in);
    frame.clear();
    wire::encode(frame, ctx.id, mine);
    send_all(fd, frame.data(), frame.size(), deadline);
    if (!ok) fail(SG_ERR_AUTH_FAILED, "the peer's key proof does not match this context's key (the two sides hold different "
                                      "keys, or a third party relayed the handshake)");
    const auto verdict = recv_message<wire::AuthResult>(fd, deadline, wire::MsgType::AuthResult, "AuthResult");
    if (!verdict.accepted) fail(SG_ERR_AUTH_FAILED, "the peer rejected this context's key proof (the two sides hold different keys)");
    if (!auth::mac_equal(verdict.mac, auth::bootstrap_verdict(ctx.key(), auth::other(role), in, out)))
        fail(SG_ERR_AUTH_FAILED, "the peer's verdict does not carry a valid MAC (a third party relayed the handshake)");
    return peer;
}

}  // namespace

wire::Hello bootstrap_exchange(int fd, const Context &ctx, uint64_t timeout_ns, auth::Role role) {
    return exchange(fd, ctx, now_ns() + std::min<uint64_t>(timeout_ns, uint64_t(1) << 62), role);
}

Listener::~Listener() {
    if (fd >= 0) ::close(fd);
}

std::unique_ptr<Listener> listen_on(Context *ctx, const char *addr, uint16_t port) {
    socklen_t len;
    sockaddr_storage ss = make_addr(addr, port, len);
    Fd s;
    s.fd = ::socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s.fd < 0) fail(SG_ERR_CONNECT, errno_text("socket"));
    int one = 1;
    ::setsockopt(s.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(s.fd, reinterpret_cast<sockaddr *>(&ss), len))
        fail(SG_ERR_CONNECT, errno_text((std::string("bind ") + addr + ":" + std::to_string(port)).c_str()));
    if (::listen(s.fd, 64)) fail(SG_ERR_CONNECT, errno_text("listen"));
    sockaddr_storage bound{};
    socklen_t blen = sizeof bound;
    ::getsockname(s.fd, reinterpret_cast<sockaddr *>(&bound), &blen);
    auto l = std::make_unique<Listener>();
    l->ctx = ctx;
    l->port = ntohs(bound.ss_family == AF_INET ? reinterpret_cast<sockaddr_in *>(&bound)->sin_port
                                               : reinterpret_cast<sockaddr_in6 *>(&bound)->sin6_port);
    l->fd = s.fd;
    s.fd = -1;
    return l;
}

wire::Hello accept_hello(Listener &l, const Context &ctx, uint64_t timeout_ns) {
    const uint64_t deadline = now_ns() + std::min<uint64_t>(timeout_ns, uint64_t(1) << 62);
    wait_fd(l.fd, POLLIN, deadline, "waiting for a peer to connect");
    Fd c;
    c.fd = ::accept4(l.fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (c.fd < 0) fail(SG_ERR_CONNECT, errno_text("accept"));
    return exchange(c.fd, ctx, deadline, auth::Role::Acceptor);
}

wire::Hello connect_hello(const char *addr, uint16_t port, const Context &ctx, uint64_t timeout_ns) {
    const uint64_t deadline = now_ns() + std::min<uint64_t>(timeout_ns, uint64_t(1) << 62);
    socklen_t len;
    sockaddr_storage ss = make_addr(addr, port, len);
    Fd c;
    c.fd = ::socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (c.fd < 0) fail(SG_ERR_CONNECT, errno_text("socket"));
    int one = 1;
    ::setsockopt(c.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (::connect(c.fd, reinterpret_cast<sockaddr *>(&ss), len) && errno != EINPROGRESS)
        fail(SG_ERR_CONNECT, errno_text((std::string("connect to ") + addr + ":" + std::to_string(port)).c_str()));
    wait_fd(c.fd, POLLOUT, deadline, "connecting");
    int err = 0;
    socklen_t elen = sizeof err;
    ::getsockopt(c.fd, SOL_SOCKET, SO_ERROR, &err, &elen);
    if (err)
        fail(SG_ERR_CONNECT, std::string("connect to ") + addr + ":" + std::to_string(port) + ": " + std::strerror(err));
    return exchange(c.fd, ctx, deadline, auth::Role::Connector);
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
    if (blob.size() != frame_len + wire::kMacBytes)
        fail(SG_ERR_AUTH_FAILED, "the metadata blob carries no signature");
    if (!auth::mac_equal(blob.subspan(frame_len), auth::blob_mac(ctx.key(), blob.first(frame_len))))
        fail(SG_ERR_AUTH_FAILED, "the metadata blob is not signed with this context's key");
    return peer;
}

std::string read_boot_id() {
    std::ifstream f("/proc/sys/kernel/random/boot_id");
    std::string id;
    std::getline(f, id);
    return id;
}

uint64_t read_netns_inode() {
    struct stat st{};
    if (::stat("/proc/self/ns/net", &st)) return 0;
    return uint64_t(st.st_ino);
}

uint64_t random_u64() {
    uint64_t v = 0;
    while (v == 0) {
        if (getrandom(&v, sizeof v, 0) != sizeof v) fail(SG_ERR_INTERNAL, errno_text("getrandom"));
    }
    return v;
}

}  // namespace sg::core
