// smartgen-microbench: INTERNAL micro-benchmarks of the runtime's own code, not a tool. It links the
// runtime's folder targets (select/ with kernels/, plan/ with kv/), not libsmartgen, and is not
// installed; tools/ (smartgen-bench) may use only the public header (ARCHITECTURE.md §4), so what
// can only be measured from inside lives here:
//   select  the selection kernels' throughput against memcpy (P6)
//   plan    block tables -> ready-to-post operations (P5)
//   quant   in-flight quantization's codec (wire_quant) against memcpy
// Same command line, JSON lines and tables as smartgen-bench (tools/bench/bench.cpp, shared).
#include "bench.hpp"

const char *const sg::bench::kProgram = "smartgen-microbench";

namespace sg::bench {
int run_select(const Common &c);  // select.cpp
int run_plan(const Common &c);    // plan.cpp
int run_quant(const Common &c);   // quant.cpp
}  // namespace sg::bench

namespace {

using sg::bench::Subcommand;

const Subcommand kSubcommands[] = {
    {"select", sg::bench::run_select, "digest + scoring throughput per policy against memcpy, P6",
     "  --bytes SIZE   largest key buffer (>= 256 MiB for P6)  --reps N (>= 5)\n"
     "  --window N     SnapKV query window                     --policies LIST\n"},
    {"plan", sg::bench::run_plan, "block tables -> ready-to-post operations, Llama-3-8B layout, P5",
     "  --tokens N   --iters N (100)   --max-iov N   --layers N\n"},
    {"quant", sg::bench::run_quant, "wire quantization: encode and decode per dtype and code against memcpy",
     "  --bytes SIZE (4M)   --reps N (15)\n"},
};

}  // namespace

int main(int argc, char **argv) {
    return sg::bench::run_main(kSubcommands,
                               "Internal: measures the runtime's selection kernels and planner directly (tests/bench);\n"
                               "the public-API benchmarks are smartgen-bench xfer|ttst|cold.\n",
                               argc, argv);
}
