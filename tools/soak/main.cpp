// smartgen-soak: the orchestrator (and, with --worker, a worker: worker.cpp). It starts the prefill
// and decode workers, forwards the decode side's listener ports, kills a random worker with SIGKILL
// at points spread over the run and restarts it, collects every transfer's outcome from both sides,
// prints progress, and ends with a summary table and one JSON line (docs/soak.md).
#include "soak.hpp"

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <map>
#include <poll.h>
#include <set>
#include <sys/wait.h>
#include <unistd.h>
#include <unordered_map>

namespace soak {

namespace {

struct Worker {
    bool prefill = false;
    int index = 0, incarnation = 0;
    pid_t pid = -1;
    int in = -1, out = -1;
    std::string buf;
    bool running = false, killed = false, exited = false, has_base = false, has_end = false;
    int status = 0;
    Resources base, end;
    std::string name() const {
        return std::string(prefill ? "prefill" : "decode") + std::to_string(index) + "." + std::to_string(incarnation);
    }
};

struct Record {
    char pre = 0, dec = 0;  // o(k) c(anceled) l(ost) b(ad)
};

class Orchestrator {
public:
    Orchestrator(const Config &c, const char *self) : cfg_(c), self_(self) {}
    int run();

private:
    void spawn(bool prefill, int index, int incarnation);
    void handle(Worker &w, const std::string &line);
    void drain(Worker &w, bool block);
    void reap(Worker &w);
    void kill_one();
    void send(Worker &w, const std::string &line);
    void progress(bool final);
    void unexpected(const std::string &what);
    void baseline_failure(const std::string &what);
    Worker *current(bool prefill, int index);

    const Config &cfg_;
    const char *self_;
    std::vector<Worker> workers_;  // every incarnation, in start order
    std::map<int, std::pair<int, int>> ports_;  // session -> (port, decode incarnation)
    std::unordered_map<uint64_t, Record> records_;
    std::vector<int> allowed_losses_, losses_;
    uint64_t runtime_blocks_verified_ = 0, runtime_mismatches_ = 0;  // SG_TRANSFER_VERIFY (--verify)
    uint64_t bytes_verified_ = 0, unexpected_ = 0, kills_ = 0, reconnects_ = 0, done_sessions_ = 0;
    uint64_t warm_transfers_ = 0, baseline_failures_ = 0;
    uint64_t t0_ = 0, last_progress_ = 0, last_done_ = 0;
    std::vector<std::string> findings_;
    Rng rng_{0};
};

Worker *Orchestrator::current(bool prefill, int index) {
    for (auto it = workers_.rbegin(); it != workers_.rend(); ++it)
        if (it->prefill == prefill && it->index == index) return &*it;
    return nullptr;
}

void Orchestrator::unexpected(const std::string &what) {
    ++unexpected_;
    if (findings_.size() < 200) findings_.push_back(what);
    std::fprintf(stderr, "soak: UNEXPECTED: %s\n", what.c_str());
}

void Orchestrator::baseline_failure(const std::string &what) {
    ++baseline_failures_;
    if (findings_.size() < 200) findings_.push_back(what);
    std::fprintf(stderr, "soak: BASELINE: %s\n", what.c_str());
}

void Orchestrator::send(Worker &w, const std::string &line) {
    std::string l = line + "\n";
    if (w.in >= 0) (void)!::write(w.in, l.data(), l.size());
}

void Orchestrator::spawn(bool prefill, int index, int incarnation) {
    int to[2], from[2];
    if (pipe2(to, O_CLOEXEC) || pipe2(from, O_CLOEXEC)) {
        std::perror("pipe2");
        std::exit(2);
    }
    std::vector<std::string> args = worker_args(cfg_, prefill ? "prefill" : "decode", index, incarnation);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(to[0], 0);
        dup2(from[1], 1);
        signal(SIGPIPE, SIG_DFL);
        std::vector<char *> argv;
        argv.push_back(const_cast<char *>(self_));
        for (auto &a : args) argv.push_back(const_cast<char *>(a.c_str()));
        argv.push_back(nullptr);
        execv(self_, argv.data());
        _exit(127);
    }
    close(to[0]);
    close(from[1]);
    Worker w;
    w.prefill = prefill, w.index = index, w.incarnation = incarnation, w.pid = pid, w.in = to[1], w.out = from[0];
    workers_.push_back(w);
    if (prefill)  // the listeners it needs, as far as known (a decode restart sends the new ones later)
        for (auto &kv : ports_)
            if (prefill_proc_of(cfg_, kv.first) == index)
                send(workers_.back(), "PORT " + std::to_string(kv.first) + " " + std::to_string(kv.second.first) + " " +
                                          std::to_string(kv.second.second));
}

void Orchestrator::handle(Worker &w, const std::string &line) {
    char tag[8] = "";
    std::sscanf(line.c_str(), "%7s", tag);
    std::string t = tag;
    int s = 0;
    unsigned long long a = 0, b = 0, c = 0;
    if (t == "T") {
        char side[16], out[16];
        if (std::sscanf(line.c_str(), "T %d %llu %15s %15s %llu", &s, &a, side, out, &b) != 5) return;
        bool pre = side[0] == 'p';
        if (s < 0) {  // warm-up
            ++warm_transfers_;
            if (out[0] == 'b') ++unexpected_;  // its E line says what
            return;
        }
        Record &r = records_[(uint64_t(s) << 32) | a];
        (pre ? r.pre : r.dec) = out[0];
        if (!pre) bytes_verified_ += b;
        if (out[0] == 'b') {
            ++unexpected_;
        }
    } else if (t == "E" || t == "X") {
        if (t == "X") ++unexpected_;
        std::string what = w.name() + ": " + line;
        if (findings_.size() < 200) findings_.push_back(what);
        std::fprintf(stderr, "soak: UNEXPECTED: %s\n", what.c_str());
    } else if (t == "INFO") {
        std::fprintf(stderr, "soak: %s: %s\n", w.name().c_str(), line.c_str() + 5);
    } else if (t == "BASE" || t == "END") {
        unsigned long long kept = 0;
        if (std::sscanf(line.c_str(), "%*s %llu %llu %llu %llu", &a, &b, &c, &kept) != 4) return;
        Resources &r = t == "BASE" ? w.base : w.end;
        r.rss = a, r.fds = b, r.registrations = c, r.kept_fds_allowed = kept;
        (t == "BASE" ? w.has_base : w.has_end) = true;
    } else if (t == "VERIFY") {
        if (std::sscanf(line.c_str(), "VERIFY %llu %llu", &a, &b) != 2) return;
        runtime_blocks_verified_ += a;
        runtime_mismatches_ += b;
        if (b) unexpected(w.name() + ": the runtime's verification found " + std::to_string(b) + " blocks that differ");
    } else if (t == "PORT") {
        if (std::sscanf(line.c_str(), "PORT %d %llu", &s, &a) != 2) return;
        ports_[s] = {int(a), w.incarnation};
        if (Worker *p = current(true, prefill_proc_of(cfg_, s)))
            send(*p, "PORT " + std::to_string(s) + " " + std::to_string(a) + " " + std::to_string(w.incarnation));
    } else if (t == "UP") {
        if (std::sscanf(line.c_str(), "UP %d %llu", &s, &a) == 2 && (a > 0 || w.incarnation > 0)) ++reconnects_;
    } else if (t == "RUNNING") {
        w.running = true;
    } else if (t == "LOST") {
        if (std::sscanf(line.c_str(), "LOST %d", &s) != 1) return;
        if (++losses_[s] > allowed_losses_[s])
            unexpected(w.name() + ": session " + std::to_string(s) + " lost its peer, which was not killed (" +
                       std::to_string(losses_[s]) + " losses, " + std::to_string(allowed_losses_[s]) + " kills)");
    } else if (t == "DONE") {
        ++done_sessions_;
    }
}

void Orchestrator::drain(Worker &w, bool block) {
    char chunk[65536];
    for (;;) {
        if (!block) {
            pollfd p{w.out, POLLIN, 0};
            if (poll(&p, 1, 0) <= 0) return;
        }
        ssize_t r = ::read(w.out, chunk, sizeof chunk);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            reap(w);
            return;
        }
        w.buf.append(chunk, size_t(r));
        size_t nl;
        while ((nl = w.buf.find('\n')) != std::string::npos) {
            std::string line = w.buf.substr(0, nl);
            w.buf.erase(0, nl + 1);
            handle(w, line);
        }
        if (!block) return;
    }
}

void Orchestrator::reap(Worker &w) {
    close(w.out);
    close(w.in);
    w.out = w.in = -1;
    waitpid(w.pid, &w.status, 0);
    w.exited = true;
    if (w.killed) return;
    if (WIFSIGNALED(w.status))
        unexpected(w.name() + " died of signal " + std::to_string(WTERMSIG(w.status)) + " (" +
                   strsignal(WTERMSIG(w.status)) + ")");
    else if (WEXITSTATUS(w.status) != 0)
        unexpected(w.name() + " exited with status " + std::to_string(WEXITSTATUS(w.status)));
    else if (!w.has_end)
        unexpected(w.name() + " exited without its end sample");
}

void Orchestrator::kill_one() {
    const int nproc = cfg_.prefill_procs + cfg_.decode_procs;
    int v = int(rng_.below(uint64_t(nproc)));
    bool prefill = v < cfg_.prefill_procs;
    int index = prefill ? v : v - cfg_.prefill_procs;
    Worker *w = current(prefill, index);
    for (int s = 0; s < cfg_.sessions; ++s)
        if ((prefill ? prefill_proc_of(cfg_, s) : decode_proc_of(cfg_, s)) == index) ++allowed_losses_[s];
    if (!prefill) {  // its prefill peers must wait for the successor's ports, not reconnect to these
        for (int p = 0; p < cfg_.prefill_procs; ++p)
            if (Worker *pw = current(true, p))
                send(*pw, "DOOMED " + std::to_string(index) + " " + std::to_string(w->incarnation));
        usleep(200000);
    }
    uint64_t done_before = records_.size();
    w->killed = true;
    kill(w->pid, SIGKILL);
    std::printf("soak: [%6.1fs] kill #%llu: SIGKILL %s (pid %d) after %llu transfers; restarting\n",
                double(now_ns() - t0_) / 1e9, (unsigned long long)kills_ + 1, w->name().c_str(), int(w->pid),
                (unsigned long long)done_before);
    std::fflush(stdout);
    drain(*w, true);  // what it said before it died still counts
    ++kills_;
    int inc = w->incarnation + 1;
    spawn(prefill, index, inc);
}

void Orchestrator::progress(bool final) {
    uint64_t now = now_ns();
    uint64_t completed = 0, canceled = 0, lost = 0, bad = 0;
    for (auto &kv : records_) {
        const Record &r = kv.second;
        if (r.pre == 'b' || r.dec == 'b')
            ++bad;
        else if (r.pre == 'l' || r.dec == 'l')
            ++lost;
        else if (r.pre == 'c' || r.dec == 'c')
            ++canceled;
        else
            ++completed;
    }
    double el = double(now - t0_) / 1e9;
    double recent = double(records_.size() - last_done_) / (double(now - last_progress_) / 1e9);
    std::printf("soak: [%6.1fs] %s transfers %llu/%llu (%.0f/s, %.0f/s overall) completed %llu canceled %llu "
                "peer-lost %llu unexpected %llu kills %llu verified %.2f GiB\n",
                el, final ? "final" : "     ", (unsigned long long)records_.size(),
                (unsigned long long)cfg_.sessions * cfg_.transfers, final ? double(records_.size()) / el : recent,
                double(records_.size()) / el, (unsigned long long)completed, (unsigned long long)canceled,
                (unsigned long long)lost, (unsigned long long)unexpected_, (unsigned long long)kills_,
                double(bytes_verified_) / double(1ull << 30));
    std::fflush(stdout);
    last_progress_ = now;
    last_done_ = records_.size();
    (void)bad;
}

int Orchestrator::run() {
    signal(SIGPIPE, SIG_IGN);  // a worker killed between two writes must not take us down
    rng_ = Rng(mix(cfg_.seed, 0x4b494c4cull));
    allowed_losses_.assign(size_t(cfg_.sessions), 0);
    losses_.assign(size_t(cfg_.sessions), 0);
    std::printf("soak: seed %llu, %d sessions (%d prefill x %d decode processes), %d transfers each, window %d, "
                "%d kills, providers %s, cancels %s (rate %.2f)\n",
                (unsigned long long)cfg_.seed, cfg_.sessions, cfg_.prefill_procs, cfg_.decode_procs, cfg_.transfers,
                cfg_.window, cfg_.kills, cfg_.providers.c_str(), cfg_.cancel_modes.c_str(), cfg_.cancel_rate);
    std::fflush(stdout);
    t0_ = last_progress_ = now_ns();
    for (int d = 0; d < cfg_.decode_procs; ++d) spawn(false, d, 0);
    for (int p = 0; p < cfg_.prefill_procs; ++p) spawn(true, p, 0);

    const uint64_t total = uint64_t(cfg_.sessions) * uint64_t(cfg_.transfers);
    int next_kill = 0;
    bool timed_out = false, finish_sent = false;
    for (;;) {
        std::vector<pollfd> fds;
        std::vector<Worker *> who;
        for (auto &w : workers_)
            if (!w.exited) {
                fds.push_back({w.out, POLLIN, 0});
                who.push_back(&w);
            }
        if (fds.empty()) break;
        poll(fds.data(), fds.size(), 200);
        for (size_t i = 0; i < fds.size(); ++i)
            if (fds[i].revents) drain(*who[i], false);
        uint64_t now = now_ns();
        if (now - last_progress_ >= uint64_t(cfg_.progress_s) * kSecond) progress(false);
        if (now - t0_ > uint64_t(cfg_.timeout_s) * kSecond) {
            timed_out = true;
            break;
        }
        // Kill points spread over 5-70% of the run; only while every worker is up (so no session is
        // reconnecting) and no session has finished (its peer would have nobody to reconnect to).
        bool all_running = true;
        for (auto &w : workers_)
            if (!w.exited && !w.running) all_running = false;
        if (next_kill < cfg_.kills) {
            double at = 0.05 + 0.65 * (next_kill + 0.5) / cfg_.kills;
            if (records_.size() >= uint64_t(at * double(total)) && all_running) {
                kill_one();
                ++next_kill;
            }
        } else if (!finish_sent && all_running) {
            // The last kill is survived: sessions parked at their target may now close.
            finish_sent = true;
            for (auto &w : workers_)
                if (!w.exited) send(w, "FINISH");
        }
    }
    if (timed_out) {
        std::map<int, uint64_t> last;
        for (auto &kv : records_) {
            int s = int(kv.first >> 32);
            last[s] = std::max<uint64_t>(last[s], (kv.first & 0xffffffffu) + 1);
        }
        std::string stuck;
        for (int s = 0; s < cfg_.sessions; ++s)
            if (last[s] < uint64_t(cfg_.transfers)) stuck += " s" + std::to_string(s) + "@" + std::to_string(last[s]);
        unexpected("hang: the run did not end within --timeout " + std::to_string(cfg_.timeout_s) +
                   " s; sessions not finished (session@transfers reported):" + stuck);
        for (auto &w : workers_)
            if (!w.exited) {
                w.killed = true;
                kill(w.pid, SIGKILL);
                drain(w, true);
            }
    }
    progress(true);

    // ---- summary ----
    const double el = double(now_ns() - t0_) / 1e9;
    uint64_t completed = 0, canceled = 0, lost = 0, bad = 0;
    for (auto &kv : records_) {
        const Record &r = kv.second;
        if (r.pre == 'b' || r.dec == 'b')
            ++bad;
        else if (r.pre == 'l' || r.dec == 'l')
            ++lost;
        else if (r.pre == 'c' || r.dec == 'c')
            ++canceled;
        else
            ++completed;
    }
    if (kills_ < uint64_t(cfg_.kills))
        unexpected("only " + std::to_string(kills_) + " of " + std::to_string(cfg_.kills) +
                   " planned kills happened (a session finished before the schedule)");
    if (records_.size() < total && !timed_out)
        unexpected("only " + std::to_string(records_.size()) + " of " + std::to_string(total) + " transfers reported");
    const uint64_t bound = uint64_t(cfg_.rss_bound_mib * 1048576.0);
    std::printf("\n%-10s %4s %11s %11s %9s %7s %7s %8s %7s %7s  %s\n", "process", "inc", "rss_start", "rss_end",
                "rss_delta", "fd_st", "fd_end", "fd_allow", "reg_st", "reg_end", "verdict");
    std::string procs;
    bool resources_ok = true;
    for (auto &w : workers_) {
        std::string verdict = "killed (baseline only)";
        if (!w.killed) {
            // Known and bounded (docs/soak.md, finding 2): tcp;ofi_rxm keeps the connections of a
            // closed session open while both contexts live, one per lane, so each tcp context may
            // end with that many descriptors more than its baseline (the worker counts them); a leak
            // grows past that.
            bool ok = w.has_base && w.has_end && w.end.registrations == w.base.registrations &&
                      w.end.fds <= w.base.fds + w.end.kept_fds_allowed && w.end.rss <= w.base.rss + bound;
            verdict = ok ? "ok" : "FAIL";
            if (!ok) {
                resources_ok = false;
                char m[256];
                std::snprintf(m, sizeof m,
                              "%s not back to its baseline: registrations %llu -> %llu, fds %llu -> %llu (allowed "
                              "+%llu), rss %.1f -> %.1f MiB (bound +%.0f)",
                              w.name().c_str(), (unsigned long long)w.base.registrations,
                              (unsigned long long)w.end.registrations, (unsigned long long)w.base.fds,
                              (unsigned long long)w.end.fds, (unsigned long long)w.end.kept_fds_allowed,
                              w.base.rss / 1048576.0, w.end.rss / 1048576.0,
                              cfg_.rss_bound_mib);
                baseline_failure(m);
            }
        }
        std::printf("%-10s %4d %9.1fMi %9.1fMi %8.1fMi %7llu %7llu %8s %7llu %7llu  %s\n",
                    (std::string(w.prefill ? "prefill" : "decode") + std::to_string(w.index)).c_str(), w.incarnation,
                    w.base.rss / 1048576.0, w.has_end ? w.end.rss / 1048576.0 : 0.0,
                    w.has_end ? (double(w.end.rss) - double(w.base.rss)) / 1048576.0 : 0.0,
                    (unsigned long long)w.base.fds, (unsigned long long)w.end.fds,
                    w.has_end ? ("+" + std::to_string(w.end.kept_fds_allowed)).c_str() : "-",
                    (unsigned long long)w.base.registrations, (unsigned long long)w.end.registrations, verdict.c_str());
        char j[512];
        std::snprintf(j, sizeof j,
                      "%s{\"role\":\"%s\",\"index\":%d,\"incarnation\":%d,\"killed\":%s,\"rss_start\":%llu,"
                      "\"rss_end\":%llu,\"fds_start\":%llu,\"fds_end\":%llu,\"fds_allowed_over_start\":%llu,"
                      "\"registrations_start\":%llu,"
                      "\"registrations_end\":%llu}",
                      procs.empty() ? "" : ",", w.prefill ? "prefill" : "decode", w.index, w.incarnation,
                      w.killed ? "true" : "false", (unsigned long long)w.base.rss,
                      (unsigned long long)(w.has_end ? w.end.rss : 0), (unsigned long long)w.base.fds,
                      (unsigned long long)(w.has_end ? w.end.fds : 0),
                      (unsigned long long)(w.has_end ? w.end.kept_fds_allowed : 0),
                      (unsigned long long)w.base.registrations,
                      (unsigned long long)(w.has_end ? w.end.registrations : 0));
        procs += j;
    }
    const bool ok = unexpected_ == 0 && bad == 0 && resources_ok && baseline_failures_ == 0;
    std::printf("\n%-28s %llu\n%-28s %.1f s\n%-28s %.1f\n%-28s %llu\n%-28s %llu\n%-28s %llu\n%-28s %llu\n%-28s %.3f GiB\n"
                "%-28s %llu\n%-28s %llu\n%-28s %llu\n%-28s %llu\n%-28s %llu\n%-28s %llu\n%-28s %s\n",
                "transfers", (unsigned long long)records_.size(), "duration", el, "transfers/s",
                double(records_.size()) / el, "completed", (unsigned long long)completed, "canceled",
                (unsigned long long)canceled, "peer-lost", (unsigned long long)lost, "unexpected failures",
                (unsigned long long)unexpected_, "bytes verified", double(bytes_verified_) / double(1ull << 30),
                "kills", (unsigned long long)kills_, "reconnected sessions", (unsigned long long)reconnects_,
                "warm-up transfers", (unsigned long long)warm_transfers_, "blocks checked by runtime",
                (unsigned long long)runtime_blocks_verified_, "runtime CRC mismatches",
                (unsigned long long)runtime_mismatches_, "processes off baseline",
                (unsigned long long)baseline_failures_, "verdict", ok ? "PASS" : "FAIL");
    std::printf("{\"soak\":\"smartgen\",\"ok\":%s,\"seed\":%llu,\"sessions\":%d,\"transfers_per_session\":%d,"
                "\"transfers\":%llu,\"duration_s\":%.2f,\"transfers_per_s\":%.1f,\"completed\":%llu,\"canceled\":%llu,"
                "\"peer_lost\":%llu,\"unexpected_failures\":%llu,\"baseline_failures\":%llu,\"bytes_verified\":%llu,\"kills\":%llu,"
                "\"reconnects\":%llu,\"runtime_blocks_verified\":%llu,\"runtime_verify_mismatches\":%llu,"
                "\"rss_bound_bytes\":%llu,\"processes\":[%s]}\n",
                ok ? "true" : "false", (unsigned long long)cfg_.seed, cfg_.sessions, cfg_.transfers,
                (unsigned long long)records_.size(), el, double(records_.size()) / el, (unsigned long long)completed,
                (unsigned long long)canceled, (unsigned long long)lost, (unsigned long long)unexpected_,
                (unsigned long long)baseline_failures_, (unsigned long long)bytes_verified_, (unsigned long long)kills_,
                (unsigned long long)reconnects_, (unsigned long long)runtime_blocks_verified_,
                (unsigned long long)runtime_mismatches_, (unsigned long long)bound, procs.c_str());
    if (!findings_.empty()) {
        std::printf("\nunexpected (first %zu):\n", findings_.size());
        for (auto &f : findings_) std::printf("  %s\n", f.c_str());
    }
    std::fflush(stdout);
    return ok ? 0 : 1;
}

}  // namespace

int run_orchestrator(const Config &cfg, const char *self) {
    Orchestrator o(cfg, self);
    return o.run();
}

}  // namespace soak

int main(int argc, char **argv) {
    soak::Config cfg;
    bool help = false;
    if (!soak::parse_args(argc, argv, cfg, help)) return 2;
    if (help) {
        soak::usage();
        return 0;
    }
    if (!cfg.role.empty()) return soak::run_worker(cfg);
    // Read by every context at its creation; the workers inherit it.
    if (cfg.verify) ::setenv("SG_TRANSFER_VERIFY", "1", 1);
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) {
        std::perror("readlink /proc/self/exe");
        return 2;
    }
    self[n] = 0;
    return soak::run_orchestrator(cfg, self);
}
