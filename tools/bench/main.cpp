// smartgen-bench: one binary, three subcommands (docs/benchmarks.md), public header only: it links
// libsmartgen and nothing else. The micro-benchmarks of the runtime's internals (select: the
// selection kernels, P6; plan: the planner, P5) are in tests/bench (smartgen-microbench).
#include "bench.hpp"

const char *const sg::bench::kProgram = "smartgen-bench";

namespace {

using sg::bench::Subcommand;

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
     "  --no-figures      skip the P1/P2 rounds (raw TCP over 1, 2 and 4 streams, bulk, scattered 16 KiB\n"
     "                    auto/never/always, alternated in every round; at least 5 rounds; P1's\n"
     "                    baseline is the best of the three stream counts)\n"
     "  --staging POLICY  staging policy of the sweep points: auto (default), always, never\n"
     "  --max-ops-in-flight N  SG_PARAM_MAX_OPS_IN_FLIGHT of the posting side (default: the library's)\n"
     "  --lanes N         lanes each context stripes a session over, both sides (SG_LANES; default:\n"
     "                    the library's)\n"
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
     "  --p7-bytes N  --p7-reps N  --p7-gap-us N  --p7-session-inflight N  --p7-max-op N  --no-p7  --p7-only\n"
     "  --selective-args=\"ARGS\"  smartgen-disagg flags for the selective rows only (ablations)\n"},
    {"cold", sg::bench::run_cold,
     "connect + register + first 1 MiB transfer: fresh contexts (cold) against the same session (warm)",
     "  --provider NAME   tcp (default) or shm\n"
     "  --reps N          cold and warm samples each (default 7; --quick 3)\n"
     "  --bytes BYTES     size of the first transfer (default 1M)\n"},
};


}  // namespace

int main(int argc, char **argv) {
    return sg::bench::run_main(kSubcommands,
                               "The selection-kernel and planner micro-benchmarks (P6, P5) test the runtime's\n"
                               "internals: smartgen-microbench select|plan, built under tests/bench (not installed).\n",
                               argc, argv);
}
