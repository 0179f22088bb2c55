// smartgen-bench: one binary, five subcommands (docs/benchmarks.md). This file parses the flags every
// subcommand shares (--quick, --json, --plot) and hands the rest to the subcommand.
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "bench.hpp"

namespace {

using sg::bench::Common;

struct Subcommand {
    const char *name;
    int (*run)(const Common &);
    const char *summary;
    const char *flags;  // the subcommand's own flags, for --help
};

const char kCommonHelp[] =
    "  --quick          the whole subcommand in <= 60 s (fewer sizes and repetitions)\n"
    "  --json           JSON lines on stdout instead of the table (progress stays on stderr)\n"
    "  --plot FILE.png  draw the sweep with gnuplot (gnuplot must be installed)\n"
    "  --help           this text\n";

const Subcommand kSubcommands[] = {
    {"xfer", sg::bench::run_xfer,
     "transfer throughput between two processes against a raw TCP stream and memcpy (P1, P2)",
     "  --provider NAME   libfabric provider: tcp (tcp;ofi_rxm, default) or shm\n"
     "  --op LIST         write, fetch (on-demand small reads), or write,fetch (default write; --quick write)\n"
     "  --pattern LIST    contiguous, scattered, or both (default contiguous,scattered)\n"
     "  --sizes LIST      block sizes, e.g. 4K,64K,1M,16M,64M (default 4K..64M in powers of 4)\n"
     "  --qd LIST         queue depths (transfers in flight), default 1\n"
     "  --total BYTES     bytes per measured run (default 1G; --quick 256M; fetch at most 256M)\n"
     "  --reps N          measured runs per point, alternated with the baseline (default 5)\n"
     "  --no-baseline     skip the raw TCP stream (ratios and figures are then absent)\n"
     "  --no-figures      skip the P1/P2 rounds (raw TCP, bulk, scattered 16 KiB auto/never/always,\n"
     "                    alternated in every round; at least 5 rounds)\n"
     "  --staging POLICY  staging policy of the sweep points: auto (default), always, never\n"
     "  --max-ops-in-flight N  SG_PARAM_MAX_OPS_IN_FLIGHT of the posting side (default: the library's)\n"
     "  --fetch-blocks N  blocks per on-demand request with --op fetch (default 4)\n"
     "  --serve IP:PORT   run only the peer side, waiting for a measuring side started with --peer\n"
     "  --peer IP:PORT    do not fork: measure against a peer started with --serve there (both sides\n"
     "                    read the session key from SG_AUTH_KEY_FILE)\n"
     "  --link NAME       name of the link in the output (default loopback, or remote with --peer)\n"},
    {"ttst", sg::bench::run_ttst, "time to second token: selective vs full transfer (smartgen-disagg emulation), P4, P7",
     "  --link loopback|10gbit|5gbit|1gbit   shaped netns link (root) or loopback (default)\n"
     "  --models LIST      llama3-8b,qwen3-8b,llama3-70b   --tokens LIST   8192,16384,32768\n"
     "  --budgets LIST     1/4,1/8,1/16                     --runs N        medians over N runs\n"
     "  --provider NAME    --disagg PATH (smartgen-disagg)  --iperf-seconds S\n"
     "  --p7-bytes N  --p7-reps N  --p7-gap-us N  --p7-session-inflight N  --p7-max-op N  --no-p7  --p7-only\n"},
    {"select", sg::bench::run_select, "digest + scoring throughput per policy against memcpy, P6",
     "  --bytes SIZE   largest key buffer (>= 256 MiB for P6)  --reps N (>= 5)\n"
     "  --window N     SnapKV query window                     --policies LIST\n"},
    {"plan", sg::bench::run_plan, "block tables -> ready-to-post operations, Llama-3-8B layout, P5",
     "  --tokens N   --iters N (100)   --max-iov N   --layers N\n"},
    {"cold", sg::bench::run_cold,
     "connect + register + first 1 MiB transfer: fresh contexts (cold) against the same session (warm)",
     "  --provider NAME   tcp (default) or shm\n"
     "  --reps N          cold and warm samples each (default 7; --quick 3)\n"
     "  --bytes BYTES     size of the first transfer (default 1M)\n"},
};

void usage(FILE *to) {
    std::fprintf(to,
                 "usage: smartgen-bench <subcommand> [--quick] [--json] [--plot FILE.png] [flags]\n"
                 "       smartgen-bench <subcommand> --help\n\nsubcommands:\n");
    for (const auto &s : kSubcommands) std::fprintf(to, "  %-7s %s\n", s.name, s.summary);
    std::fprintf(to, "\nflags every subcommand accepts:\n%s", kCommonHelp);
}

void subcommand_help(const Subcommand &s) {
    std::printf("usage: smartgen-bench %s [--quick] [--json] [--plot FILE.png] [flags]\n\n%s\n\n", s.name, s.summary);
    std::printf("flags:\n%s", kCommonHelp);
    if (s.flags)
        std::printf("%s", s.flags);
    else
        std::printf("  (this subcommand's own flags: see docs/benchmarks.md; an unknown flag exits 2 naming it)\n");
    std::printf("\nEvery JSON line has bench, figure, value, unit, baseline_name, baseline_value, ratio,\n"
                "provider, op, pattern, block_bytes, queue_depth, total_bytes and link (null when n/a).\n");
}

}  // namespace

int main(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    std::string cmd = argv[1];
    if (cmd == "--help" || cmd == "-h" || cmd == "help") {
        usage(stdout);
        return 0;
    }
    const Subcommand *sub = nullptr;
    for (const auto &s : kSubcommands)
        if (cmd == s.name) sub = &s;
    if (!sub) {
        std::fprintf(stderr, "smartgen-bench: unknown subcommand %s\n", cmd.c_str());
        usage(stderr);
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
                    std::fprintf(stderr, "smartgen-bench %s: --plot needs a file name\n", sub->name);
                    return 2;
                }
                c.plot = argv[++i];
            } else {
                c.plot = a.substr(7);
                if (c.plot.empty()) {
                    std::fprintf(stderr, "smartgen-bench %s: --plot needs a file name\n", sub->name);
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
        std::fprintf(stderr, "smartgen-bench %s: %s\n", sub->name, e.what());
        return 1;
    }
}
