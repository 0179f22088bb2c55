// smartgen-bench: one binary, three subcommands (xfer, ttst, cold), public header only. This header is
// what they share: the command line every subcommand accepts, JSON lines, tables, progress, medians
// and plots. The internal micro-benchmarks (select, plan) share it too: tests/bench/main.cpp. Every figure is a ratio against a baseline measured in the same invocation (this machine is
// shared and noisy), alternated with the measured runs where the subcommand says so.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace sg::bench {

// Options common to every subcommand; each subcommand parses its own flags from `rest`.
struct Common {
    bool quick = false;          // --quick: the whole subcommand in <= 60 s (scripts/test.sh runs it)
    bool json = false;           // --json: JSON lines on stdout instead of the table
    std::string plot;            // --plot FILE.png: the sweep drawn with gnuplot
    std::vector<std::string> rest;  // flags not consumed here, in order
};

// One measured figure: a JSON line, and a row of the table. `figure` names a target ("P1".."P7") or
// is empty for a sweep point. Parameters that do not apply stay unset and are written as null.
struct Line {
    std::string bench;           // "xfer", "ttst", "select", "plan", "cold"
    std::string figure;          // "P1".."P7", or "" (null in JSON)
    double value = 0;
    std::string unit;            // "GB/s", "ms", ...
    std::string baseline_name;   // "raw TCP stream", "memcpy", "full streamed", ...
    double baseline_value = 0;
    double ratio = 0;            // value / baseline_value, or baseline / value where lower is better (the
                                 // subcommand says which; > 1 is always better for SmartGen)
    // Parameters (null when unset).
    std::optional<std::string> provider, op, pattern, link;
    std::optional<uint64_t> block_bytes, queue_depth, total_bytes;
    std::map<std::string, double> extra;  // more numeric fields, e.g. plan's "ms" and "p99_ms"
    std::map<std::string, std::string> extra_text;
    std::string note;            // one human sentence for the table (in JSON as "note" when not empty)
};

// The lines of one subcommand: printed as JSON lines (--json) or as a table at the end.
class Report {
  public:
    explicit Report(const Common &c) : common_(c) {}
    void add(Line line);  // prints the JSON line at once with --json (progress stays on stderr)
    void print_table() const;  // without --json: a fixed-width table of every line
    const std::vector<Line> &lines() const { return lines_; }
    // Draws the sweep (lines with an empty figure) with gnuplot into common.plot, x = x_of(line),
    // one curve per series_of(line). Fails with a message when gnuplot is missing.
    void plot(const std::string &title, const std::string &x_label, const std::string &y_label,
              const std::function<double(const Line &)> &x_of,
              const std::function<std::string(const Line &)> &series_of) const;

  private:
    const Common &common_;
    std::vector<Line> lines_;
};

// Progress on stderr: "smartgen-bench xfer: <text>", one line each, flushed.
void progress(const std::string &bench, const std::string &text);

// Statistics of repeated measurements.
double median(std::vector<double> v);
double percentile(std::vector<double> v, double p);  // p in [0, 100]

uint64_t now_ns();
// "4K", "64KiB", "16M", "1G", "1048576": bytes. Throws std::invalid_argument with the text.
uint64_t parse_bytes(const std::string &text);
std::string human_bytes(uint64_t bytes);  // "64 KiB", "16 MiB"

// The last-level cache size in bytes (sysfs), or 32 MiB when unknown: buffers of "8x the LLC".
uint64_t last_level_cache_bytes();

// Single-thread memcpy bandwidth (GB/s) over a buffer of `bytes` (>= 8x the LLC for a DRAM figure),
// median of `reps` passes.
double memcpy_gbps(uint64_t bytes, int reps);

// Subcommands: each returns the process exit status (0 ok, 2 bad flags with a message on stderr).
int run_xfer(const Common &c);
int run_ttst(const Common &c);
int run_cold(const Common &c);

// The program's name in messages ("smartgen-bench"; "smartgen-microbench" for the internal one),
// defined by each program's main.cpp.
extern const char *const kProgram;

struct Subcommand {
    const char *name;
    int (*run)(const Common &);
    const char *summary;
    const char *flags;  // the subcommand's own flags, for --help
};

// A whole program: parses the flags every subcommand shares (--quick, --json, --plot, --help) and
// runs the subcommand argv[1] names with the rest. `note` (may be null) follows the usage text.
int run_main(std::span<const Subcommand> subcommands, const char *note, int argc, char **argv);

// Flag helpers for the subcommands' own flags: `rest` is consumed left to right.
class Flags {
  public:
    Flags(std::string bench, std::vector<std::string> rest) : bench_(std::move(bench)), rest_(std::move(rest)) {}
    // Returns the value of --name (and removes both), or nullopt. Exits with status 2 and a message
    // naming the flag when the value is missing.
    std::optional<std::string> take(const std::string &name);
    bool take_switch(const std::string &name);  // --name present?
    // Exits with status 2 naming the first flag nobody took.
    void finish() const;

  private:
    std::string bench_;
    std::vector<std::string> rest_;
};


// ---- Two processes (xfer, cold) --------------------------------------------------------------
// The measured side (the parent, "prefill") and its peer (a forked child, "decode") talk over a
// control socket of fixed-size messages; `data` is one TCP connection on 127.0.0.1 for the raw
// stream baseline, `streams` that one and kBaselineStreams - 1 more for the striped baseline (the
// same bytes over N parallel streams: the ceiling a transport that stripes could reach). The fork
// happens before any SmartGen call: a context does not survive a fork.
struct Peer {
    bool is_child = false;
    int pid = -1;   // parent: the child's pid
    int ctl = -1;   // AF_UNIX stream socket to the other process
    int data = -1;  // TCP connection between the two processes (-1 unless asked for)
    std::vector<int> streams;  // data first, then the striped baseline's other connections
    std::vector<unsigned char> auth_key;  // 32 random bytes shared by both (made before the fork)
};
// Forks; returns in both processes (is_child tells which). Throws on failure.
Peer fork_peer(bool with_tcp);
// Without a fork (another host or network namespace): the peer runs `smartgen-bench <sub> --serve
// ADDR:PORT` and the measuring side connects with `--peer ADDR:PORT` (IPv4). Both read the session
// key from SG_AUTH_KEY_FILE (auth_key stays empty). serve_peer returns with is_child = true.
Peer serve_peer(const std::string &addr_port);
Peer connect_peer(const std::string &addr_port);
// The local and remote IPv4 address of a connected socket ("127.0.0.1").
std::string socket_local_address(int fd);
std::string socket_remote_address(int fd);
// Parent: waits for the child; returns its exit status (or 128+signal). Kills it after timeout_s.
int reap_peer(Peer &peer, int timeout_s);
// The end of a two-process run: reaps the peer (a short wait when this side already failed) and
// folds its status into rc, naming the failure on stderr. Returns the combined status.
int finish_peer(const std::string &bench, Peer &peer, int rc, int timeout_s);
// Whole-message control I/O; throws std::runtime_error on EOF, error or timeout.
void ctl_send(int fd, const void *msg, size_t len);
void ctl_recv(int fd, void *msg, size_t len, int timeout_ms = 120000);
// The raw TCP stream baseline: `bytes` from buf in `chunk`-sized send()s / recv()s, then a 1-byte ack.
void tcp_send_stream(int fd, const unsigned char *buf, uint64_t bytes, size_t chunk);
void tcp_recv_stream(int fd, unsigned char *buf, uint64_t bytes, size_t chunk);
// The same bytes striped over the first n of `fds`, one thread a stream, each its contiguous share
// of buf (as a transfer spread over lanes would take it), each with its own ack.
inline constexpr int kBaselineStreams = 4;
void tcp_send_striped(const std::vector<int> &fds, int n, const unsigned char *buf, uint64_t bytes, size_t chunk);
void tcp_recv_striped(const std::vector<int> &fds, int n, unsigned char *buf, uint64_t bytes, size_t chunk);
// One memcpy pass of `bytes` from src to dst (caller's buffers, already faulted in): GB/s.
double memcpy_gbps_on(void *dst, const void *src, uint64_t bytes);
// CPU seconds this process used so far (all threads: user + system).
double process_cpu_seconds();

}  // namespace sg::bench
