// A real etcd cluster for the directory's tests: N members of Debian's etcd-server on loopback ports
// chosen free at start, data in a fresh temporary directory, fast elections (50 ms heartbeats) so a
// member's loss is survived in well under a second. Members are processes a test may kill and
// restart; the destructor stops them all and removes the data. Never a mock.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <string>
#include <thread>
#include <vector>

namespace sgtest {

class EtcdCluster {
  public:
    // The etcd binary (ETCD_BIN, or etcd on the PATH); "" when there is none.
    static std::string binary() {
        if (const char *e = std::getenv("ETCD_BIN"); e && *e) return e;
        for (const char *dir : {"/usr/bin", "/usr/local/bin", "/usr/sbin"}) {
            const std::string p = std::string(dir) + "/etcd";
            if (access(p.c_str(), X_OK) == 0) return p;
        }
        return "";
    }

    explicit EtcdCluster(int members = 3) {
        // In memory: each write waits for a quorum's fsync, and on a loaded CI disk those took
        // seconds (a cluster that did not answer for 80 s under the asan phase, issue 37). The
        // tests are about the client, not etcd's durability.
        char tmpl[] = "/dev/shm/smartgen-etcd-XXXXXX";
        if (!mkdtemp(tmpl)) return;
        dir_ = tmpl;
        for (int i = 0; i < members; ++i) members_.push_back({free_port(), free_port(), -1});
        std::string initial;
        for (int i = 0; i < members; ++i) {
            if (i) initial += ',';
            initial += name(i);
            initial += "=http://127.0.0.1:";
            initial += std::to_string(members_[size_t(i)].peer_port);
        }
        initial_cluster_ = initial;
        for (int i = 0; i < members; ++i) start(i);
    }

    ~EtcdCluster() {
        for (size_t i = 0; i < members_.size(); ++i) kill(int(i));
        if (!dir_.empty()) {
            const std::string cmd = "rm -rf '" + dir_ + "'";
            (void)!std::system(cmd.c_str());
        }
    }

    EtcdCluster(const EtcdCluster &) = delete;
    EtcdCluster &operator=(const EtcdCluster &) = delete;

    // "http://127.0.0.1:p0,http://127.0.0.1:p1,..."
    std::string endpoints() const {
        std::string e;
        for (size_t i = 0; i < members_.size(); ++i) {
            if (i) e += ',';
            e += endpoint(int(i));
        }
        return e;
    }
    std::string endpoint(int i) const { return "http://127.0.0.1:" + std::to_string(members_[size_t(i)].client_port); }
    size_t size() const { return members_.size(); }

    void kill(int i) {
        Member &m = members_[size_t(i)];
        if (m.pid <= 0) return;
        ::kill(m.pid, SIGKILL);
        waitpid(m.pid, nullptr, 0);
        m.pid = -1;
    }

    // Starts member i (again: it rejoins with its data).
    void start(int i) {
        Member &m = members_[size_t(i)];
        const std::string bin = binary();
        const std::string data = dir_ + "/" + name(i);
        const std::string log = dir_ + "/" + name(i) + ".log";
        const std::string client = "http://127.0.0.1:" + std::to_string(m.client_port);
        const std::string peer = "http://127.0.0.1:" + std::to_string(m.peer_port);
        const bool existing = access(data.c_str(), F_OK) == 0;
        const pid_t pid = fork();
        if (pid == 0) {
            // A test killed by its timeout must not leave members running (they would load every
            // later test): they die with the test process.
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            FILE *f = std::freopen(log.c_str(), "a", stderr);
            (void)f;
            (void)!dup2(2, 1);
            setpgid(0, 0);
            execl(bin.c_str(), bin.c_str(), "--name", name(i).c_str(), "--data-dir", data.c_str(),
                  "--listen-client-urls", client.c_str(), "--advertise-client-urls", client.c_str(),
                  "--listen-peer-urls", peer.c_str(), "--initial-advertise-peer-urls", peer.c_str(),
                  "--initial-cluster", initial_cluster_.c_str(), "--initial-cluster-state",
                  existing ? "existing" : "new", "--initial-cluster-token", dir_.c_str(), "--heartbeat-interval", "50",
                  "--election-timeout", "500", "--log-level", "error", "--logger", "zap", (char *)nullptr);
            _exit(127);
        }
        m.pid = pid;
    }

    // Until every live member answers its /health with "true" (a leader elected, the member caught
    // up), at most `timeout_ns`: a test's clocks start only after this. On a loaded host a cluster
    // can take many seconds to elect its first leader.
    bool wait_healthy(uint64_t timeout_ns) const {
        const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(timeout_ns);
        for (;;) {
            bool all = true;
            for (const Member &m : members_) {
                if (m.pid <= 0) continue;
                const std::string r = request(m, "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
                all = all && r.find(" 200 ") != std::string::npos && r.find("\"health\":\"true\"") != std::string::npos;
            }
            if (all) return true;
            if (std::chrono::steady_clock::now() > until) return false;
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
    }

    // Deletes a key as an operator would (etcdctl del), by a plain HTTP request to the first live
    // member's gateway: true when it answered 200.
    bool delete_key(const std::string &key) const {
        static const char t[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        std::string b64;
        for (size_t i = 0; i < key.size(); i += 3) {
            const uint32_t n = (uint32_t(uint8_t(key[i])) << 16) |
                               (i + 1 < key.size() ? uint32_t(uint8_t(key[i + 1])) << 8 : 0) |
                               (i + 2 < key.size() ? uint32_t(uint8_t(key[i + 2])) : 0);
            b64 += t[(n >> 18) & 63];
            b64 += t[(n >> 12) & 63];
            b64 += i + 1 < key.size() ? t[(n >> 6) & 63] : '=';
            b64 += i + 2 < key.size() ? t[n & 63] : '=';
        }
        const std::string body = "{\"key\":\"" + b64 + "\"}";
        for (const Member &m : members_) {
            if (m.pid <= 0) continue;
            const std::string req = "POST /v3/kv/deleterange HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                                    "application/json\r\nConnection: close\r\nContent-Length: " +
                                    std::to_string(body.size()) + "\r\n\r\n" + body;
            if (request(m, req).find(" 200 ") != std::string::npos) return true;
        }
        return false;
    }

    // The log of member i (for a failing test's message).
    std::string log(int i) const {
        std::string out;
        if (FILE *f = std::fopen((dir_ + "/" + name(i) + ".log").c_str(), "r")) {
            char buf[4096];
            size_t n;
            while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
            std::fclose(f);
        }
        return out.size() > 2000 ? out.substr(out.size() - 2000) : out;
    }

  private:
    struct Member {
        int client_port, peer_port;
        pid_t pid;
    };

    static std::string name(int i) { return "m" + std::to_string(i); }

    // One HTTP/1.1 request to a member's client port; the start of its answer, "" when it gave none
    // within two seconds.
    static std::string request(const Member &m, const std::string &req) {
        const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        timeval tv{2, 0};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        a.sin_port = htons(uint16_t(m.client_port));
        std::string out;
        if (connect(fd, reinterpret_cast<sockaddr *>(&a), sizeof a) == 0 &&
            ::send(fd, req.data(), req.size(), MSG_NOSIGNAL) == ssize_t(req.size())) {
            char buf[1024];
            for (ssize_t n; out.size() < 4096 && (n = recv(fd, buf, sizeof buf, 0)) > 0;) out.append(buf, size_t(n));
        }
        close(fd);
        return out;
    }

    // A port that binds now, below the kernel's ephemeral range (32768-60999): a port the kernel
    // handed out and took back could be handed to any other process's socket (a fabric endpoint of a
    // test running beside this one) before etcd binds it, and the member would never start.
    static int free_port() {
        static unsigned seed = unsigned(getpid()) * 2654435761u ^ unsigned(time(nullptr));
        for (int attempt = 0; attempt < 200; ++attempt) {
            const int port = 20000 + int(rand_r(&seed) % 12000);
            const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
            sockaddr_in a{};
            a.sin_family = AF_INET;
            a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            a.sin_port = htons(uint16_t(port));
            const bool free = bind(fd, reinterpret_cast<sockaddr *>(&a), sizeof a) == 0;
            close(fd);
            if (free) return port;
        }
        return 0;
    }

    std::string dir_, initial_cluster_;
    std::vector<Member> members_;
};

}  // namespace sgtest
