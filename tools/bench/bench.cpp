// smartgen-bench and smartgen-microbench: the pieces every subcommand shares (bench.hpp): the command
// line, JSON lines, tables, progress, statistics, byte parsing, the LLC size, memcpy bandwidth, plots
// and flag helpers.
#include "bench.hpp"

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

namespace sg::bench {
namespace {

std::string json_string(const std::string &s) {
    std::string out = "\"";
    for (unsigned char ch : s) {
        switch (ch) {
        case '"': out += "\\\""; break;
        case '\\': out += "\\\\"; break;
        case '\n': out += "\\n"; break;
        case '\r': out += "\\r"; break;
        case '\t': out += "\\t"; break;
        default:
            if (ch < 0x20) {
                char buf[8];
                std::snprintf(buf, sizeof buf, "\\u%04x", ch);
                out += buf;
            } else {
                out += static_cast<char>(ch);
            }
        }
    }
    return out + "\"";
}

std::string json_number(double v) {
    if (!std::isfinite(v)) return "null";
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.6g", v);
    return buf;
}

std::string json_opt(const std::optional<std::string> &v) { return v ? json_string(*v) : "null"; }
std::string json_opt(const std::optional<uint64_t> &v) { return v ? std::to_string(*v) : "null"; }

std::string to_json(const Line &l) {
    std::ostringstream o;
    o << "{\"bench\":" << json_string(l.bench) << ",\"figure\":" << (l.figure.empty() ? "null" : json_string(l.figure))
      << ",\"value\":" << json_number(l.value) << ",\"unit\":" << json_string(l.unit)
      << ",\"baseline_name\":" << (l.baseline_name.empty() ? "null" : json_string(l.baseline_name))
      << ",\"baseline_value\":" << (l.baseline_name.empty() ? "null" : json_number(l.baseline_value))
      << ",\"ratio\":" << (l.baseline_name.empty() ? "null" : json_number(l.ratio))
      << ",\"provider\":" << json_opt(l.provider) << ",\"op\":" << json_opt(l.op)
      << ",\"pattern\":" << json_opt(l.pattern) << ",\"block_bytes\":" << json_opt(l.block_bytes)
      << ",\"queue_depth\":" << json_opt(l.queue_depth) << ",\"total_bytes\":" << json_opt(l.total_bytes)
      << ",\"link\":" << json_opt(l.link);
    for (const auto &[k, v] : l.extra) o << "," << json_string(k) << ":" << json_number(v);
    for (const auto &[k, v] : l.extra_text) o << "," << json_string(k) << ":" << json_string(v);
    if (!l.note.empty()) o << ",\"note\":" << json_string(l.note);
    o << "}";
    return o.str();
}

std::string fmt_value(double v) {
    char buf[32];
    if (!std::isfinite(v)) return "-";
    double a = std::fabs(v);
    if (a != 0 && (a < 0.01 || a >= 1e6))
        std::snprintf(buf, sizeof buf, "%.3g", v);
    else if (a < 10)
        std::snprintf(buf, sizeof buf, "%.3f", v);
    else
        std::snprintf(buf, sizeof buf, "%.1f", v);
    return buf;
}

}  // namespace

void Report::add(Line line) {
    if (line.ratio == 0 && line.baseline_value != 0 && !line.baseline_name.empty())
        line.ratio = line.value / line.baseline_value;
    if (common_.json) {
        std::string s = to_json(line);
        std::fprintf(stdout, "%s\n", s.c_str());
        std::fflush(stdout);
    }
    lines_.push_back(std::move(line));
}

void Report::print_table() const {
    if (common_.json || lines_.empty()) return;
    struct Col {
        std::string head;
        std::function<std::string(const Line &)> get;
        bool left;
    };
    std::vector<Col> cols = {
        {"figure", [](const Line &l) { return l.figure.empty() ? std::string("-") : l.figure; }, true},
        {"provider", [](const Line &l) { return l.provider.value_or("-"); }, true},
        {"op", [](const Line &l) { return l.op.value_or("-"); }, true},
        {"pattern", [](const Line &l) { return l.pattern.value_or("-"); }, true},
        {"block", [](const Line &l) { return l.block_bytes ? human_bytes(*l.block_bytes) : std::string("-"); }, false},
        {"qd", [](const Line &l) { return l.queue_depth ? std::to_string(*l.queue_depth) : std::string("-"); }, false},
        {"total", [](const Line &l) { return l.total_bytes ? human_bytes(*l.total_bytes) : std::string("-"); }, false},
        {"value", [](const Line &l) { return fmt_value(l.value) + " " + l.unit; }, false},
        {"baseline", [](const Line &l) { return l.baseline_name.empty() ? std::string("-") : l.baseline_name; }, true},
        {"base value", [](const Line &l) { return l.baseline_name.empty() ? std::string("-") : fmt_value(l.baseline_value); }, false},
        {"ratio", [](const Line &l) { return l.baseline_name.empty() ? std::string("-") : fmt_value(l.ratio); }, false},
    };
    // Descriptive strings (extra_text) get one column, named after their keys.
    std::vector<std::string> text_keys;
    for (const auto &l : lines_)
        for (const auto &[k, v] : l.extra_text)
            if (std::find(text_keys.begin(), text_keys.end(), k) == text_keys.end()) text_keys.push_back(k);
    if (!text_keys.empty()) {
        std::string head;
        for (const auto &k : text_keys) head += (head.empty() ? "" : "/") + k;
        cols.insert(cols.begin() + 1, Col{head,
                                          [text_keys](const Line &l) {
                                              std::string cell;
                                              for (const auto &k : text_keys) {
                                                  auto it = l.extra_text.find(k);
                                                  if (it == l.extra_text.end()) continue;
                                                  if (!cell.empty()) cell.push_back(' ');
                                                  cell.append(it->second);
                                              }
                                              return cell.empty() ? std::string("-") : cell;
                                          },
                                          true});
    }
    bool any_link = std::any_of(lines_.begin(), lines_.end(), [](const Line &l) { return l.link.has_value(); });
    if (any_link)
        cols.insert(cols.begin() + (text_keys.empty() ? 2 : 3), Col{"link", [](const Line &l) { return l.link.value_or("-"); }, true});
    // Columns that are "-" on every line are dropped.
    std::vector<Col> used;
    for (auto &c : cols) {
        bool any = c.head == "value" || c.head == "figure";
        for (const auto &l : lines_)
            if (c.get(l) != "-") any = true;
        if (any) used.push_back(std::move(c));
    }
    std::vector<size_t> width(used.size());
    for (size_t i = 0; i < used.size(); ++i) {
        width[i] = used[i].head.size();
        for (const auto &l : lines_) width[i] = std::max(width[i], used[i].get(l).size());
    }
    auto row = [&](const std::function<std::string(size_t)> &cell) {
        std::string s;
        for (size_t i = 0; i < used.size(); ++i) {
            std::string c = cell(i);
            std::string pad(width[i] - std::min(width[i], c.size()), ' ');
            s += (used[i].left ? c + pad : pad + c);
            s += i + 1 < used.size() ? "  " : "";
        }
        while (!s.empty() && s.back() == ' ') s.pop_back();
        std::printf("%s\n", s.c_str());
    };
    row([&](size_t i) { return used[i].head; });
    row([&](size_t i) { return std::string(width[i], '-'); });
    for (const auto &l : lines_) row([&](size_t i) { return used[i].get(l); });
    bool notes = false;
    for (const auto &l : lines_) notes |= !l.note.empty() || !l.extra.empty();
    if (notes) {
        std::printf("\n");
        size_t n = 0;
        for (const auto &l : lines_) {
            ++n;
            if (l.note.empty() && l.extra.empty()) continue;
            std::string s = "  [" + std::to_string(n) + "] " + (l.figure.empty() ? "" : l.figure + ": ");
            bool first = true;
            for (const auto &[k, v] : l.extra) {
                if (!first) s.push_back(' ');
                first = false;
                s.append(k).push_back('=');
                s.append(fmt_value(v));
            }
            if (!l.note.empty()) {
                if (!first) s.append(" - ");
                s.append(l.note);
            }
            std::printf("%s\n", s.c_str());
        }
    }
    std::fflush(stdout);
}

void Report::plot(const std::string &title, const std::string &x_label, const std::string &y_label,
                  const std::function<double(const Line &)> &x_of,
                  const std::function<std::string(const Line &)> &series_of) const {
    if (common_.plot.empty()) return;
    if (std::system("command -v gnuplot >/dev/null 2>&1") != 0)
        throw std::runtime_error("--plot needs gnuplot, which is not installed (apt-get install gnuplot-nox; "
                                 "scripts/bench.sh installs it)");
    std::map<std::string, std::vector<std::pair<double, double>>> series;
    for (const auto &l : lines_)
        if (l.figure.empty() && std::isfinite(x_of(l))) series[series_of(l)].push_back({x_of(l), l.value});
    if (series.empty()) throw std::runtime_error("--plot: no sweep points to draw");
    char dir_tmpl[] = "/tmp/smartgen-bench-plot-XXXXXX";
    if (!mkdtemp(dir_tmpl)) throw std::runtime_error(std::string("--plot: mkdtemp: ") + std::strerror(errno));
    std::string dir = dir_tmpl;
    std::string script = dir + "/plot.gp";
    std::ofstream gp(script);
    auto quote = [](std::string s) {
        std::string o = "'";
        for (char ch : s) o += ch == '\'' ? std::string("''") : std::string(1, ch);
        return o + "'";
    };
    bool logx = true;
    for (const auto &[name, pts] : series)
        for (const auto &p : pts) logx &= p.first > 0;
    gp << "set terminal pngcairo size 1000,640 noenhanced\n"
       << "set output " << quote(common_.plot) << "\n"
       << "set title " << quote(title) << "\n"
       << "set xlabel " << quote(x_label) << "\nset ylabel " << quote(y_label) << "\n"
       << "set grid\nset key outside right\n"
       << (logx ? "set logscale x 2\n" : "")
       // Byte axes read as 16 KiB, 1 MiB rather than 16384, 1.04858e+06.
       << (logx && x_label.find("bytes") != std::string::npos ? "set format x '%.0b %BB'\n" : "");
    int i = 0;
    std::string plot_cmd = "plot ";
    for (auto &[name, pts] : series) {
        std::sort(pts.begin(), pts.end());
        std::string data = dir + "/s" + std::to_string(i) + ".dat";
        std::ofstream d(data);
        for (const auto &p : pts) d << p.first << " " << p.second << "\n";
        plot_cmd += (i ? ", " : "") + quote(data) + " using 1:2 with linespoints title " + quote(name);
        ++i;
    }
    gp << plot_cmd << "\n";
    gp.close();
    std::string cmd = "gnuplot " + script + " 2>&1";
    int rc = std::system(cmd.c_str());
    std::error_code ignored;  // a leftover temporary directory is not worth failing the report
    std::filesystem::remove_all(dir, ignored);
    if (rc != 0) throw std::runtime_error("--plot: gnuplot failed (exit " + std::to_string(rc) + ")");
}

void progress(const std::string &bench, const std::string &text) {
    std::fprintf(stderr, "%s %s: %s\n", kProgram, bench.c_str(), text.c_str());
    std::fflush(stderr);
}

double median(std::vector<double> v) {
    if (v.empty()) return std::nan("");
    std::sort(v.begin(), v.end());
    size_t n = v.size();
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

double percentile(std::vector<double> v, double p) {
    if (v.empty()) return std::nan("");
    std::sort(v.begin(), v.end());
    p = std::clamp(p, 0.0, 100.0);
    double pos = p / 100.0 * static_cast<double>(v.size() - 1);
    size_t lo = static_cast<size_t>(std::floor(pos)), hi = static_cast<size_t>(std::ceil(pos));
    return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
}

uint64_t now_ns() {
    return static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
}

uint64_t parse_bytes(const std::string &text) {
    std::string t = text;
    if (t.empty()) throw std::invalid_argument(text);
    size_t pos = 0;
    unsigned long long n;
    try {
        n = std::stoull(t, &pos, 10);
    } catch (...) {
        throw std::invalid_argument(text);
    }
    if (t[0] == '-' || t[0] == '+') throw std::invalid_argument(text);
    std::string suf = t.substr(pos);
    for (auto &ch : suf) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
    if (!suf.empty() && suf.back() == 'B') suf.pop_back();
    if (!suf.empty() && suf.back() == 'I') suf.pop_back();
    uint64_t mul = 1;
    if (suf.empty()) mul = 1;
    else if (suf == "K") mul = 1ull << 10;
    else if (suf == "M") mul = 1ull << 20;
    else if (suf == "G") mul = 1ull << 30;
    else if (suf == "T") mul = 1ull << 40;
    else throw std::invalid_argument(text);
    if (n != 0 && mul > UINT64_MAX / n) throw std::invalid_argument(text);
    return n * mul;
}

std::string human_bytes(uint64_t bytes) {
    static const char *units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int u = 0;
    double v = static_cast<double>(bytes);
    while (u < 4 && bytes >= 1024 && bytes % 1024 == 0) bytes /= 1024, ++u;
    if (bytes < 1024 || u == 4) return std::to_string(bytes) + " " + units[u];
    // Not a whole number of the next unit: one decimal.
    u = 0;
    while (u < 4 && v >= 1024) v /= 1024, ++u;
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1f %s", v, units[u]);
    return buf;
}

uint64_t last_level_cache_bytes() {
    uint64_t best = 0;
    int best_level = -1;
    for (int i = 0; i < 16; ++i) {
        std::string base = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/";
        std::ifstream lf(base + "level"), sf(base + "size"), tf(base + "type");
        if (!lf || !sf) continue;
        int level = 0;
        std::string size, type;
        lf >> level;
        sf >> size;
        tf >> type;
        if (type == "Instruction") continue;
        uint64_t bytes = 0;
        try {
            bytes = parse_bytes(size);
        } catch (...) {
            continue;
        }
        if (level > best_level || (level == best_level && bytes > best)) best_level = level, best = bytes;
    }
    return best ? best : 32ull << 20;
}

double memcpy_gbps(uint64_t bytes, int reps) {
    if (bytes == 0 || reps <= 0) return 0;
    std::unique_ptr<char[]> src(new char[bytes]), dst(new char[bytes]);
    std::memset(src.get(), 1, bytes);  // fault the pages in before timing
    std::memset(dst.get(), 2, bytes);
    std::vector<double> gbps;
    for (int r = 0; r < reps; ++r) {
        uint64_t t0 = now_ns();
        std::memcpy(dst.get(), src.get(), bytes);
        uint64_t t1 = now_ns();
        asm volatile("" : : "r"(dst.get()) : "memory");
        gbps.push_back(static_cast<double>(bytes) / static_cast<double>(std::max<uint64_t>(t1 - t0, 1)));
    }
    return median(gbps);
}

std::optional<std::string> Flags::take(const std::string &name) {
    for (size_t i = 0; i < rest_.size(); ++i) {
        const std::string &a = rest_[i];
        if (a == name) {
            if (i + 1 >= rest_.size() || (rest_[i + 1].rfind("--", 0) == 0 && rest_[i + 1].size() > 2)) {
                std::fprintf(stderr, "%s %s: %s needs a value\n", kProgram, bench_.c_str(), name.c_str());
                std::exit(2);
            }
            std::string v = rest_[i + 1];
            rest_.erase(rest_.begin() + static_cast<long>(i), rest_.begin() + static_cast<long>(i) + 2);
            return v;
        }
        if (a.rfind(name + "=", 0) == 0) {
            std::string v = a.substr(name.size() + 1);
            rest_.erase(rest_.begin() + static_cast<long>(i));
            return v;
        }
    }
    return std::nullopt;
}

bool Flags::take_switch(const std::string &name) {
    auto it = std::find(rest_.begin(), rest_.end(), name);
    if (it == rest_.end()) return false;
    rest_.erase(it);
    return true;
}

void Flags::finish() const {
    if (rest_.empty()) return;
    std::fprintf(stderr, "%s %s: unknown flag %s (see %s %s --help)\n", kProgram, bench_.c_str(),
                 rest_.front().c_str(), kProgram, bench_.c_str());
    std::exit(2);
}

namespace {
[[noreturn]] void sys_fail(const std::string &what) { throw std::runtime_error(what + ": " + std::strerror(errno)); }
}  // namespace

Peer fork_peer(bool with_tcp) {
    Peer p;
    p.auth_key.resize(32);
    {
        std::ifstream ur("/dev/urandom", std::ios::binary);
        ur.read(reinterpret_cast<char *>(p.auth_key.data()), 32);
        if (!ur) throw std::runtime_error("cannot read /dev/urandom for the session key");
    }
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) sys_fail("socketpair");
    int lfd = -1;
    sockaddr_in sa{};
    if (with_tcp) {
        lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (lfd < 0) sys_fail("socket");
        sa.sin_family = AF_INET;
        sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        socklen_t len = sizeof sa;
        if (bind(lfd, reinterpret_cast<sockaddr *>(&sa), sizeof sa) != 0 || listen(lfd, kBaselineStreams) != 0 ||
            getsockname(lfd, reinterpret_cast<sockaddr *>(&sa), &len) != 0)
            sys_fail("baseline listener on 127.0.0.1");
    }
    std::signal(SIGPIPE, SIG_IGN);
    std::fflush(nullptr);
    pid_t pid = fork();
    if (pid < 0) sys_fail("fork");
    if (pid == 0) {
        p.is_child = true;
        close(sv[0]);
        p.ctl = sv[1];
        if (with_tcp) {
            close(lfd);
            for (int i = 0; i < kBaselineStreams; ++i) {
                const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
                if (fd < 0 || connect(fd, reinterpret_cast<sockaddr *>(&sa), sizeof sa) != 0)
                    sys_fail("baseline connect to 127.0.0.1");
                p.streams.push_back(fd);
            }
            p.data = p.streams[0];
        }
        return p;
    }
    p.pid = pid;
    close(sv[1]);
    p.ctl = sv[0];
    if (with_tcp) {
        // The child connects its streams one after another: they are accepted in that order.
        for (int i = 0; i < kBaselineStreams; ++i) {
            pollfd pfd{lfd, POLLIN, 0};
            int r;
            do r = poll(&pfd, 1, 30000);
            while (r < 0 && errno == EINTR);
            if (r <= 0) throw std::runtime_error("baseline: the peer process did not connect");
            const int fd = accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
            if (fd < 0) sys_fail("baseline accept");
            p.streams.push_back(fd);
        }
        p.data = p.streams[0];
        close(lfd);
    }
    return p;
}

namespace {
sockaddr_in parse_addr_port(const std::string &ap) {
    auto colon = ap.rfind(':');
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    char *end = nullptr;
    unsigned long port = colon == std::string::npos ? 0 : std::strtoul(ap.c_str() + colon + 1, &end, 10);
    if (colon == std::string::npos || !end || *end || port > 65535 ||
        inet_pton(AF_INET, ap.substr(0, colon).c_str(), &sa.sin_addr) != 1)
        throw std::invalid_argument("expected IPV4:PORT, got '" + ap + "'");
    sa.sin_port = htons(static_cast<uint16_t>(port));
    return sa;
}
std::string addr_string(const sockaddr_in &sa) {
    char buf[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &sa.sin_addr, buf, sizeof buf);
    return buf;
}
}  // namespace

Peer serve_peer(const std::string &addr_port) {
    sockaddr_in sa = parse_addr_port(addr_port);
    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    if (lfd < 0) sys_fail("socket");
    setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(lfd, reinterpret_cast<sockaddr *>(&sa), sizeof sa) != 0 || listen(lfd, 1 + kBaselineStreams) != 0)
        sys_fail("listen on " + addr_port);
    std::signal(SIGPIPE, SIG_IGN);
    Peer p;
    p.is_child = true;
    p.ctl = accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
    if (p.ctl < 0) sys_fail("accept (control)");
    for (int i = 0; i < kBaselineStreams; ++i) {
        const int fd = accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd < 0) sys_fail("accept (baseline stream)");
        p.streams.push_back(fd);
    }
    p.data = p.streams[0];
    close(lfd);
    setsockopt(p.ctl, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return p;
}

Peer connect_peer(const std::string &addr_port) {
    sockaddr_in sa = parse_addr_port(addr_port);
    std::signal(SIGPIPE, SIG_IGN);
    Peer p;
    int one = 1;
    for (int i = 0; i <= kBaselineStreams; ++i) {
        const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0 || connect(fd, reinterpret_cast<sockaddr *>(&sa), sizeof sa) != 0)
            sys_fail("connect to the peer at " + addr_port + " (is `smartgen-bench ... --serve` running there?)");
        if (i == 0)
            p.ctl = fd;
        else
            p.streams.push_back(fd);
    }
    p.data = p.streams[0];
    setsockopt(p.ctl, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return p;
}

std::string socket_local_address(int fd) {
    sockaddr_in sa{};
    socklen_t len = sizeof sa;
    if (getsockname(fd, reinterpret_cast<sockaddr *>(&sa), &len) != 0) sys_fail("getsockname");
    return addr_string(sa);
}

std::string socket_remote_address(int fd) {
    sockaddr_in sa{};
    socklen_t len = sizeof sa;
    if (getpeername(fd, reinterpret_cast<sockaddr *>(&sa), &len) != 0) sys_fail("getpeername");
    return addr_string(sa);
}

int reap_peer(Peer &peer, int timeout_s) {
    if (peer.ctl >= 0) close(peer.ctl), peer.ctl = -1;
    for (int fd : peer.streams) close(fd);
    if (peer.streams.empty() && peer.data >= 0) close(peer.data);
    peer.streams.clear();
    peer.data = -1;
    if (peer.is_child || peer.pid <= 0) return 0;
    int status = 0;
    uint64_t deadline = now_ns() + static_cast<uint64_t>(timeout_s) * 1000000000ull;
    for (;;) {
        pid_t w = waitpid(peer.pid, &status, WNOHANG);
        if (w == peer.pid) break;
        if (w < 0 && errno != EINTR) return 1;
        if (now_ns() > deadline) {
            kill(peer.pid, SIGKILL);
            waitpid(peer.pid, &status, 0);
            break;
        }
        usleep(10000);
    }
    peer.pid = -1;
    if (WIFEXITED(status)) return WEXITSTATUS(status);
    return 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

int finish_peer(const std::string &bench, Peer &peer, int rc, int timeout_s) {
    const int prc = reap_peer(peer, rc ? 5 : timeout_s);
    if (prc != 0 && rc == 0) {
        std::fprintf(stderr, "%s %s: the peer process failed (status %d)\n", kProgram, bench.c_str(), prc);
        return 1;
    }
    return rc;
}

void ctl_send(int fd, const void *msg, size_t len) {
    const char *p = static_cast<const char *>(msg);
    while (len > 0) {
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) sys_fail("control channel write (the other process is gone?)");
        p += n;
        len -= static_cast<size_t>(n);
    }
}

void ctl_recv(int fd, void *msg, size_t len, int timeout_ms) {
    char *p = static_cast<char *>(msg);
    while (len > 0) {
        pollfd pfd{fd, POLLIN, 0};
        int r = poll(&pfd, 1, timeout_ms);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) sys_fail("control channel poll");
        if (r == 0) throw std::runtime_error("control channel: no message from the other process in time");
        ssize_t n = recv(fd, p, len, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) sys_fail("control channel read");
        if (n == 0) throw std::runtime_error("control channel closed: the other process failed (see above)");
        p += n;
        len -= static_cast<size_t>(n);
    }
}

void tcp_send_stream(int fd, const unsigned char *buf, uint64_t bytes, size_t chunk) {
    uint64_t off = 0;
    while (off < bytes) {
        size_t n = static_cast<size_t>(std::min<uint64_t>(bytes - off, chunk));
        ssize_t w = send(fd, buf + off, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) sys_fail("baseline send()");
        off += static_cast<uint64_t>(w);
    }
    unsigned char ack = 0;
    for (;;) {
        ssize_t r = recv(fd, &ack, 1, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) sys_fail("baseline ack recv()");
        if (r == 0) throw std::runtime_error("baseline connection closed by the peer");
        break;
    }
}

void tcp_recv_stream(int fd, unsigned char *buf, uint64_t bytes, size_t chunk) {
    uint64_t off = 0;
    while (off < bytes) {
        size_t n = static_cast<size_t>(std::min<uint64_t>(bytes - off, chunk));
        ssize_t r = recv(fd, buf + off, n, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) sys_fail("baseline recv()");
        if (r == 0) throw std::runtime_error("baseline connection closed by the peer");
        off += static_cast<uint64_t>(r);
    }
    unsigned char ack = 1;
    for (;;) {
        ssize_t w = send(fd, &ack, 1, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) sys_fail("baseline ack send()");
        break;
    }
}

namespace {
// Runs body(i) for i in [0, n) on n threads (the calling thread takes i = 0); the first failure is
// rethrown once all are done.
void on_threads(int n, const std::function<void(int)> &body) {
    std::vector<std::exception_ptr> errors(size_t(std::max(n, 1)));
    std::vector<std::thread> threads;
    for (int i = 1; i < n; ++i)
        threads.emplace_back([&, i] {
            try {
                body(i);
            } catch (...) {
                errors[size_t(i)] = std::current_exception();
            }
        });
    try {
        body(0);
    } catch (...) {
        errors[0] = std::current_exception();
    }
    for (auto &t : threads) t.join();
    for (auto &e : errors)
        if (e) std::rethrow_exception(e);
}
}  // namespace

void tcp_send_striped(const std::vector<int> &fds, int n, const unsigned char *buf, uint64_t bytes, size_t chunk) {
    if (n < 1 || size_t(n) > fds.size()) throw std::invalid_argument("striped baseline: no such stream count");
    on_threads(n, [&](int i) {
        const uint64_t first = bytes * uint64_t(i) / uint64_t(n), last = bytes * uint64_t(i + 1) / uint64_t(n);
        tcp_send_stream(fds[size_t(i)], buf + first, last - first, chunk);
    });
}

void tcp_recv_striped(const std::vector<int> &fds, int n, unsigned char *buf, uint64_t bytes, size_t chunk) {
    if (n < 1 || size_t(n) > fds.size()) throw std::invalid_argument("striped baseline: no such stream count");
    on_threads(n, [&](int i) {
        const uint64_t first = bytes * uint64_t(i) / uint64_t(n), last = bytes * uint64_t(i + 1) / uint64_t(n);
        tcp_recv_stream(fds[size_t(i)], buf + first, last - first, chunk);
    });
}

double memcpy_gbps_on(void *dst, const void *src, uint64_t bytes) {
    uint64_t t0 = now_ns();
    std::memcpy(dst, src, bytes);
    uint64_t t1 = now_ns();
    asm volatile("" : : "r"(dst) : "memory");
    return static_cast<double>(bytes) / static_cast<double>(std::max<uint64_t>(t1 - t0, 1));
}

double process_cpu_seconds() {
    rusage ru{};
    getrusage(RUSAGE_SELF, &ru);
    return static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
           static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

// ---- The command line (run_main) -----------------------------------------------------------------

namespace {

const char kCommonHelp[] =
    "  --quick          the whole subcommand in <= 60 s (fewer sizes and repetitions)\n"
    "  --json           JSON lines on stdout instead of the table (progress stays on stderr)\n"
    "  --plot FILE.png  draw the sweep with gnuplot (gnuplot must be installed)\n"
    "  --help           this text\n";

void usage(FILE *to, std::span<const Subcommand> subs, const char *note) {
    std::fprintf(to,
                 "usage: %s <subcommand> [--quick] [--json] [--plot FILE.png] [flags]\n"
                 "       %s <subcommand> --help\n\nsubcommands:\n",
                 kProgram, kProgram);
    for (const auto &s : subs) std::fprintf(to, "  %-7s %s\n", s.name, s.summary);
    std::fprintf(to, "\nflags every subcommand accepts:\n%s", kCommonHelp);
    if (note) std::fprintf(to, "\n%s", note);
}

void subcommand_help(const Subcommand &s) {
    std::printf("usage: %s %s [--quick] [--json] [--plot FILE.png] [flags]\n\n%s\n\n", kProgram, s.name, s.summary);
    std::printf("flags:\n%s", kCommonHelp);
    if (s.flags)
        std::printf("%s", s.flags);
    else
        std::printf("  (this subcommand's own flags: see docs/benchmarks.md; an unknown flag exits 2 naming it)\n");
    std::printf("\nEvery JSON line has bench, figure, value, unit, baseline_name, baseline_value, ratio,\n"
                "provider, op, pattern, block_bytes, queue_depth, total_bytes and link (null when n/a).\n");
}

}  // namespace

int run_main(std::span<const Subcommand> subs, const char *note, int argc, char **argv) {
    if (argc < 2) {
        usage(stderr, subs, note);
        return 2;
    }
    std::string cmd = argv[1];
    if (cmd == "--help" || cmd == "-h" || cmd == "help") {
        usage(stdout, subs, note);
        return 0;
    }
    const Subcommand *sub = nullptr;
    for (const auto &s : subs)
        if (cmd == s.name) sub = &s;
    if (!sub) {
        std::fprintf(stderr, "%s: unknown subcommand %s\n", kProgram, cmd.c_str());
        usage(stderr, subs, note);
        return 2;
    }
    Common c;
    for (int i = 2; i < argc; ++i) {
        std::string a = argv[i];
        if (a == "--help" || a == "-h") {
            subcommand_help(*sub);
            return 0;
        }
        if (a == "--quick") {
            c.quick = true;
        } else if (a == "--json") {
            c.json = true;
        } else if (a == "--plot" || a.rfind("--plot=", 0) == 0) {
            if (a == "--plot") {
                if (i + 1 >= argc || argv[i + 1][0] == '\0') {
                    std::fprintf(stderr, "%s %s: --plot needs a file name\n", kProgram, sub->name);
                    return 2;
                }
                c.plot = argv[++i];
            } else {
                c.plot = a.substr(7);
                if (c.plot.empty()) {
                    std::fprintf(stderr, "%s %s: --plot needs a file name\n", kProgram, sub->name);
                    return 2;
                }
            }
        } else {
            c.rest.push_back(std::move(a));
        }
    }
    try {
        return sub->run(c);
    } catch (const std::exception &e) {
        std::fprintf(stderr, "%s %s: %s\n", kProgram, sub->name, e.what());
        return 1;
    }
}

}  // namespace sg::bench
