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

// Owns a socket.
struct Fd {
    int fd = -1;
    Fd() = default;
    Fd(const Fd &) = delete;
    Fd &operator=(const Fd &) = delete;
    ~Fd() {
        if (fd >= 0) ::close(fd);
    }
};

namespace {

// A listener holds at most this many unfinished handshakes; past that, the oldest connection that
// has not sent a byte makes room. A real peer finishes in a round trip or two, so a flood of silent
// sockets cannot keep it out.
constexpr size_t kMaxPendingHandshakes = 64;
// The outcome exchange after a handshake gets at least this long, even when the handshake finished
// just before its deadline: both sides have committed by then, and must not disagree over a few ms.
constexpr uint64_t kOutcomeGraceNs = 1000000000ull;
// A handshake that has not finished after this many peer timeouts is dropped, however steadily it
// drips bytes.
constexpr uint64_t kHandshakeLimitFactor = 10;
// A handshake may make no progress for this many peer timeouts before the listener drops it: on a
// busy host a live connector can be off the CPU for seconds between its connect and its Hello, or
// between two steps. Connections that never speak (scans) cannot hold the listener up meanwhile:
// past kMaxPendingHandshakes the oldest of them makes room.
constexpr uint64_t kHandshakeStallFactor = 4;

std::string errno_text(const char *what) { return std::string(what) + ": " + std::strerror(errno); }


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

template <class M> M decode_message(std::span<const uint8_t> frame, wire::MsgType type, const char *what) {
    wire::FrameHeader h;
    std::span<const uint8_t> body;
    M m;
    if (wire::decode_header(frame, h, body) != wire::DecodeError::None || h.type != type ||
        wire::decode(body, m) != wire::DecodeError::None)
        fail(SG_ERR_PROTOCOL, std::string("bad ") + what + " during bootstrap");
    return m;
}

}  // namespace

// One Hello each way, then (both sides keyed) one proof each way over the prover's role and both
// Hellos, then one verdict each way (a MAC over the sender's role and both Hellos), so that a refusal
// is reported with the same status on both sides and a keyless relay can neither reflect a proof
// nor forge an acceptance. Non-blocking: advance() moves as far as the socket allows, so a listener
// runs many handshakes at once and a silent peer holds up nobody but itself.
class Handshake {
  public:
    Handshake(int fd, const Context &ctx, auth::Role role) : fd_(fd), ctx_(ctx), role_(role) {
        wire::encode(mine_, ctx.id, ctx.hello());
        out_ = mine_;
    }

    // True once the handshake succeeded; throws its failure.
    bool advance() {
        for (;;) {
            switch (step_) {
                case Step::SendHello:
                    if (!flush()) return false;
                    step_ = Step::RecvHello;
                    break;
                case Step::RecvHello:
                    if (!fill()) return false;
                    on_hello();
                    break;
                case Step::SendProof:
                    if (!flush()) return false;
                    step_ = Step::RecvProof;
                    break;
                case Step::RecvProof:
                    if (!fill()) return false;
                    on_proof();
                    break;
                case Step::SendVerdict:
                    if (!flush()) return false;
                    if (!accepted_)
                        fail(SG_ERR_AUTH_FAILED, "the peer's key proof does not match this context's key (the two sides "
                                                 "hold different keys, or a third party relayed the handshake)");
                    step_ = Step::RecvVerdict;
                    break;
                case Step::RecvVerdict:
                    if (!fill()) return false;
                    on_verdict();
                    break;
                case Step::Done: return true;
            }
        }
    }
    short events() const { return step_ == Step::SendHello || step_ == Step::SendProof || step_ == Step::SendVerdict ? POLLOUT : POLLIN; }
    bool heard_from_peer() const { return heard_; }
    const wire::Hello &peer() const { return peer_; }

  private:
    enum class Step { SendHello, RecvHello, SendProof, RecvProof, SendVerdict, RecvVerdict, Done };

    bool flush() {
        while (sent_ < out_.size()) {
            const ssize_t k = ::send(fd_, out_.data() + sent_, out_.size() - sent_, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (k > 0) {
                sent_ += size_t(k);
            } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
                return false;
            } else if (k < 0 && errno == EINTR) {
                continue;
            } else {
                closed_by_peer(errno_text("bootstrap send"));
            }
        }
        out_.clear();
        sent_ = 0;
        return true;
    }

    // Reads one whole frame into in_; false while more bytes are to come.
    bool fill() {
        for (;;) {
            size_t want = wire::kFrameHeaderBytes;
            if (in_.size() >= want) {
                const uint32_t body_len =
                    uint32_t(in_[20]) | uint32_t(in_[21]) << 8 | uint32_t(in_[22]) << 16 | uint32_t(in_[23]) << 24;
                if (body_len > wire::kMaxFrameBytes - wire::kFrameHeaderBytes) fail(SG_ERR_PROTOCOL, "bootstrap frame too large");
                want += body_len;
                if (in_.size() == want) {
                    throw_if_refusal();
                    return true;
                }
            }
            const size_t old = in_.size();
            in_.resize(want);
            const ssize_t k = ::recv(fd_, in_.data() + old, want - old, MSG_DONTWAIT);
            if (k > 0) {
                heard_ = true;
                in_.resize(old + size_t(k));
                continue;
            }
            in_.resize(old);
            if (k == 0) closed_by_peer("peer closed the bootstrap connection");
            if (errno == EAGAIN || errno == EWOULDBLOCK) return false;
            if (errno != EINTR) closed_by_peer(errno_text("bootstrap recv"));
        }
    }

    // A listener that gives up a handshake says why in an Opened frame before it closes (refuse()):
    // the connector reports that cause, not the broken pipe that follows.
    void throw_if_refusal() const {
        wire::FrameHeader h;
        std::span<const uint8_t> body;
        if (wire::decode_header(in_, h, body) != wire::DecodeError::None || h.type != wire::MsgType::Opened) return;
        wire::Opened why;
        if (wire::decode(body, why) != wire::DecodeError::None || why.status == SG_OK)
            fail(SG_ERR_PROTOCOL, "bad Opened during bootstrap");
        fail(peer_error_status(why.status), "the peer gave up the bootstrap handshake: " + why.message);
    }

    // The connection broke: if the peer's reason is already in our receive queue, that is the
    // cause; otherwise the peer closed without one (it crashed, was closed, or is an older peer).
    [[noreturn]] void closed_by_peer(const std::string &what) {
        if (!closing_) {
            closing_ = true;
            for (int i = 0; i < 2; ++i) {
                try {
                    if (!fill()) break;
                } catch (const Error &e) {
                    if (e.status() != SG_ERR_PEER_LOST) throw;
                    break;
                }
                in_.clear();
            }
        }
        fail(SG_ERR_PEER_LOST, "the peer closed the connection during the bootstrap handshake (" + what +
                                   "); a listener drops a handshake that stalls past its peer timeout or fails its checks, "
                                   "and says why to peers of this version");
    }

    std::vector<uint8_t> take_frame() {
        std::vector<uint8_t> f;
        f.swap(in_);
        return f;
    }

    void on_hello() {
        theirs_ = take_frame();
        peer_ = decode_hello_frame(theirs_);
        check_auth_policy(ctx_, peer_);
        if (ctx_.key().empty()) {
            step_ = Step::Done;
            return;
        }
        if (peer_.proto_minor < 1)
            fail(SG_ERR_VERSION_MISMATCH, "the peer speaks wire protocol 1." + std::to_string(peer_.proto_minor) +
                                              ", whose key proofs do not name their sender's role; 1.1 or newer is required");
        wire::encode(out_, ctx_.id, wire::AuthProof{auth::bootstrap_proof(ctx_.key(), role_, mine_, theirs_)});
        step_ = Step::SendProof;
    }

    void on_proof() {
        const auto proof = decode_message<wire::AuthProof>(take_frame(), wire::MsgType::AuthProof, "AuthProof");
        accepted_ = auth::mac_equal(proof.mac, auth::bootstrap_proof(ctx_.key(), auth::other(role_), theirs_, mine_));
        wire::AuthResult verdict;
        verdict.accepted = accepted_ ? 1u : 0u;
        if (accepted_) verdict.mac = auth::bootstrap_verdict(ctx_.key(), role_, mine_, theirs_);
        wire::encode(out_, ctx_.id, verdict);
        step_ = Step::SendVerdict;
    }

    void on_verdict() {
        const auto verdict = decode_message<wire::AuthResult>(take_frame(), wire::MsgType::AuthResult, "AuthResult");
        if (!verdict.accepted)
            fail(SG_ERR_AUTH_FAILED, "the peer rejected this context's key proof (the two sides hold different keys)");
        if (!auth::mac_equal(verdict.mac, auth::bootstrap_verdict(ctx_.key(), auth::other(role_), theirs_, mine_)))
            fail(SG_ERR_AUTH_FAILED, "the peer's verdict does not carry a valid MAC (a third party relayed the handshake)");
        step_ = Step::Done;
    }

    int fd_;
    const Context &ctx_;
    auth::Role role_;
    Step step_ = Step::SendHello;
    std::vector<uint8_t> mine_, theirs_;  // both Hello frames, as sent
    std::vector<uint8_t> out_, in_;
    size_t sent_ = 0;
    bool heard_ = false;
    bool accepted_ = false;
    bool closing_ = false;
    wire::Hello peer_;
};

namespace {

wire::Hello run_handshake(int fd, const Context &ctx, uint64_t deadline, auth::Role role) {
    Handshake hs(fd, ctx, role);
    while (!hs.advance()) wait_fd(fd, hs.events(), deadline, "during the bootstrap handshake");
    return hs.peer();
}

void send_frame(int fd, const std::vector<uint8_t> &frame, uint64_t deadline) {
    size_t sent = 0;
    while (sent < frame.size()) {
        const ssize_t k = ::send(fd, frame.data() + sent, frame.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k > 0) {
            sent += size_t(k);
        } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            wait_fd(fd, POLLOUT, deadline, "sending the bootstrap outcome");
        } else if (k < 0 && errno != EINTR) {
            fail(SG_ERR_PEER_LOST, errno_text("bootstrap send"));
        }
    }
}

wire::Opened recv_opened(int fd, uint64_t deadline) {
    std::vector<uint8_t> in(wire::kFrameHeaderBytes);
    size_t got = 0;
    for (bool header = true;;) {
        while (got < in.size()) {
            wait_fd(fd, POLLIN, deadline, "waiting for the peer's bootstrap outcome");
            const ssize_t k = ::recv(fd, in.data() + got, in.size() - got, MSG_DONTWAIT);
            if (k > 0) {
                got += size_t(k);
            } else if (k == 0) {
                fail(SG_ERR_PEER_LOST, "peer closed the bootstrap connection before saying whether it opened the session");
            } else if (errno != EAGAIN && errno != EINTR) {
                fail(SG_ERR_PEER_LOST, errno_text("bootstrap recv"));
            }
        }
        if (!header) break;
        header = false;
        const uint32_t body_len = uint32_t(in[20]) | uint32_t(in[21]) << 8 | uint32_t(in[22]) << 16 | uint32_t(in[23]) << 24;
        if (body_len > wire::kMaxFrameBytes - wire::kFrameHeaderBytes) fail(SG_ERR_PROTOCOL, "bootstrap frame too large");
        in.resize(in.size() + body_len);
    }
    return decode_message<wire::Opened>(in, wire::MsgType::Opened, "Opened");
}

// After the handshake: open the session here, then tell the peer whether that worked and hear the
// same from it (peers of 1.1 and newer), so that a session exists on both sides or on neither.
std::shared_ptr<Session> open_agreed(int fd, Context &ctx, const wire::Hello &peer, const sg_session_options_t &opt,
                                     uint64_t deadline) {
    std::shared_ptr<Session> s;
    wire::Opened mine;
    try {
        s = ctx.open_session(peer, opt, true);
    } catch (const Error &e) {
        mine.status = e.status();
        mine.message = e.message();
    }
    if (peer.proto_minor < 1) {
        if (!s) fail(sg_status_t(mine.status), mine.message);
        return s;
    }
    try {
        std::vector<uint8_t> frame;
        wire::encode(frame, ctx.id, mine);
        send_frame(fd, frame, deadline);
        if (!s) fail(sg_status_t(mine.status), mine.message);
        const wire::Opened theirs = recv_opened(fd, deadline);
        if (theirs.status != SG_OK) {
            const sg_status_t st = peer_error_status(theirs.status);
            fail(st, "the peer could not open its side of the session: " + theirs.message);
        }
    } catch (...) {
        if (s) s->discard();
        throw;
    }
    return s;
}

}  // namespace

wire::Hello bootstrap_exchange(int fd, const Context &ctx, uint64_t timeout_ns, auth::Role role) {
    return run_handshake(fd, ctx, now_ns() + std::min<uint64_t>(timeout_ns, uint64_t(1) << 62), role);
}

// A connection the listener accepted whose handshake is under way. It is dropped when the peer
// stays silent for the context's peer_timeout_ms, or has not finished after kHandshakeLimitFactor
// times that (a peer that drips a byte at a time); never because an accept call's own timeout ran
// out, which only ends that call: the handshake goes on in the next.
struct PendingHandshake {
    Fd fd;
    std::unique_ptr<Handshake> hs;
    uint64_t arrived_ns = 0, last_progress_ns = 0;
    uint64_t deadline(uint64_t peer_timeout_ns) const {
        return std::min(last_progress_ns + kHandshakeStallFactor * peer_timeout_ns,
                        arrived_ns + kHandshakeLimitFactor * peer_timeout_ns);
    }

    // Tells the peer why its handshake ends here (best effort: one non-blocking send), then closes
    // so that what the peer sent is read first and the close is a FIN, not a reset that could
    // discard the reason before the peer reads it.
    void refuse(const Context &ctx, sg_status_t status, const std::string &why) {
        wire::Opened m;
        m.status = status;
        m.message = why;
        std::vector<uint8_t> frame;
        wire::encode(frame, ctx.id, m);
        (void)::send(fd.fd, frame.data(), frame.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        ::shutdown(fd.fd, SHUT_WR);
        uint8_t sink[4096];
        while (::recv(fd.fd, sink, sizeof sink, MSG_DONTWAIT) > 0) {
        }
    }
};


Listener::~Listener() {
    if (fd >= 0) ::close(fd);
}

std::unique_ptr<Listener> listen_on(Context *ctx, const char *addr, uint16_t port) {
    socklen_t len;
    sockaddr_storage ss = make_addr(addr, port, len);
    Fd s;
    // Non-blocking: the listener accepts every queued connection at once and never waits in accept.
    s.fd = ::socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (s.fd < 0) fail(SG_ERR_CONNECT, errno_text("socket"));
    int one = 1;
    ::setsockopt(s.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(s.fd, reinterpret_cast<sockaddr *>(&ss), len))
        fail(SG_ERR_CONNECT, errno_text((std::string("bind ") + addr + ":" + std::to_string(port)).c_str()));
    if (::listen(s.fd, SOMAXCONN)) fail(SG_ERR_CONNECT, errno_text("listen"));
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

std::shared_ptr<Session> accept_session(Listener &l, Context &ctx, const sg_session_options_t &opt, uint64_t timeout_ns) {
    std::lock_guard lock(l.mu);
    const uint64_t deadline = now_ns() + std::min<uint64_t>(timeout_ns, uint64_t(1) << 62);
    const uint64_t peer_timeout = ctx.peer_timeout_ns();
    auto &pending = l.pending;
    for (;;) {
        // Advance every handshake the sockets allow; the first that succeeds is this call's.
        for (size_t i = 0; i < pending.size();) {
            PendingHandshake &p = *pending[i];
            bool done = false;
            try {
                done = p.hs->advance();
            } catch (const Error &e) {
                const bool from_a_peer = p.hs->heard_from_peer();
                pending.erase(pending.begin() + ptrdiff_t(i));
                // A connection that never sent a byte (a port scan, a health check) is nobody's
                // failed bootstrap; one that spoke is a peer, and its failure is reported.
                if (from_a_peer) throw;
                ctx.log.log(SG_LOG_DEBUG, "bootstrap connection closed before its Hello: " + e.message());
                continue;
            }
            if (!done) {
                ++i;
                continue;
            }
            auto finished = std::move(pending[i]);
            pending.erase(pending.begin() + ptrdiff_t(i));
            return open_agreed(finished->fd.fd, ctx, finished->hs->peer(), opt,
                               std::max(deadline, now_ns() + kOutcomeGraceNs));
        }
        const uint64_t now = now_ns();
        for (size_t i = 0; i < pending.size();) {
            PendingHandshake &p = *pending[i];
            if (now < p.deadline(peer_timeout)) {
                ++i;
                continue;
            }
            const std::string why = "the handshake did not finish: " + std::to_string((now - p.arrived_ns) / 1000000) +
                                    " ms since the connection, " + std::to_string((now - p.last_progress_ns) / 1000000) +
                                    " ms without progress (peer_timeout_ms " + std::to_string(peer_timeout / 1000000) + ")";
            // Whoever it is hears why (a live connector that wakes up reports SG_ERR_TIMEOUT).
            p.refuse(ctx, SG_ERR_TIMEOUT, "the listener dropped it: " + why);
            if (!p.hs->heard_from_peer()) {
                // Never spoke: a scan or a health check, nobody's failed bootstrap.
                ctx.log.log(SG_LOG_INFO, "dropped a bootstrap connection that sent nothing: " + why);
                pending.erase(pending.begin() + ptrdiff_t(i));
                continue;
            }
            // A peer that spoke and stalled: this accept call hears of it too, as it would of a
            // peer whose key check failed.
            fail(SG_ERR_TIMEOUT, "a peer's bootstrap handshake stalled and was dropped: " + why);
        }
        if (now >= deadline) fail(SG_ERR_TIMEOUT, "timed out waiting for a peer to connect");
        uint64_t wake_at = deadline;
        std::vector<pollfd> fds{{l.fd, POLLIN, 0}};
        for (auto &p : pending) {
            fds.push_back({p->fd.fd, p->hs->events(), 0});
            wake_at = std::min(wake_at, p->deadline(peer_timeout));
        }
        const int rc = ::poll(fds.data(), fds.size(), remaining_ms(wake_at));
        if (rc < 0 && errno != EINTR) fail(SG_ERR_CONNECT, errno_text("poll"));
        const uint64_t polled = now_ns();
        for (size_t i = 1; i < fds.size(); ++i)
            if (fds[i].revents) pending[i - 1]->last_progress_ns = polled;
        if (rc <= 0 || !(fds[0].revents & POLLIN)) continue;
        for (;;) {
            Fd c;
            c.fd = ::accept4(l.fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
            if (c.fd < 0) {
                if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED) break;
                fail(SG_ERR_CONNECT, errno_text("accept"));
            }
            int one = 1;
            ::setsockopt(c.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
            if (pending.size() >= kMaxPendingHandshakes) {
                // Full: the oldest connection that has not sent a byte makes room (a peer that is
                // really bootstrapping finishes in a round trip or two), else the oldest of all.
                size_t victim = 0;
                for (size_t i = 0; i < pending.size(); ++i)
                    if (!pending[i]->hs->heard_from_peer()) {
                        victim = i;
                        break;
                    }
                pending[victim]->refuse(ctx, SG_ERR_TIMEOUT,
                                        "the listener dropped it to make room: " + std::to_string(kMaxPendingHandshakes) +
                                            " handshakes were pending");
                pending.erase(pending.begin() + ptrdiff_t(victim));
            }
            auto p = std::make_unique<PendingHandshake>();
            p->fd.fd = c.fd;
            c.fd = -1;
            p->hs = std::make_unique<Handshake>(p->fd.fd, ctx, auth::Role::Acceptor);
            p->arrived_ns = p->last_progress_ns = now_ns();
            pending.push_back(std::move(p));
        }
    }
}

std::shared_ptr<Session> connect_session(const char *addr, uint16_t port, Context &ctx, const sg_session_options_t &opt,
                                         uint64_t timeout_ns) {
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
    const wire::Hello peer = run_handshake(c.fd, ctx, deadline, auth::Role::Connector);
    return open_agreed(c.fd, ctx, peer, opt, std::max(deadline, now_ns() + kOutcomeGraceNs));
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
