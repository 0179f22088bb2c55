// examples/disagg/cli: the command line of smartgen-disagg (flags, their checks, --help) and the small
// JSON reader for --prompt-tokens. Nothing here touches SmartGen or the engine.
#pragma once

#include <cstdint>
#include <cstdio>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace sg::disagg {

// A bad flag or flag value; the message names the flag. main() prints it with a hint and exits 2.
class UsageError : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

enum class Mode { kColocated, kFull, kSelective };
enum class Role { kBoth, kPrefill, kDecode };  // kBoth: fork the decode side (the default)
// What P is at a sparse step of selective decode (--attend). kBudget: the proactive selection itself
// (the profile's choice, within its budget), whatever else is resident; kResident: every block resident
// when the layer's essential blocks were in place (the proactive set plus whatever the speculative path
// had delivered by then).
enum class Attend { kBudget, kResident };

struct Budget {
    bool is_fraction = true;
    double fraction = 0.25;
    uint64_t tokens = 0;
};

struct Options {
    Mode mode = Mode::kColocated;
    Role role = Role::kBoth;
    std::string listen = "127.0.0.1:0";  // prefill role
    bool listen_set = false;
    std::string peer;        // decode role: ADDR:PORT of the prefill listener
    std::string provider;    // sg_context_options_t.provider; empty = automatic
    std::string local_addr;  // data endpoint address; empty = the library's default

    std::string model;        // resolved later (resolve_model_path)
    std::string prompt_file;  // empty = the built-in prompt
    int max_new_tokens = 64;
    uint32_t kv_dtype = 0;  // sg_dtype_t / KvDtype value: 0 fp32, 1 fp16, 2 bf16
    bool kv_dtype_set = false;
    int block_tokens = 16;
    bool full_stream = true;

    // selective
    std::string profile_file;
    Budget budget;
    bool budget_set = false;
    // The prefill side's policy for P when the profiles come from --budget: snapkv (the last --window
    // prompt queries' attention over the keys) or quest; the decode side's S_t is quest (digests only).
    // Empty: snapkv with a model, quest with --emulate (proactive_policy_for).
    std::string proactive_policy;
    bool proactive_policy_set = false;
    bool on_demand = true;
    bool speculative = true;
    // Decode side, issue 12: a layer whose blocks are all here (or will be sooner than its selection
    // would take) is attended whole (seamless); fetched blocks are attended while they travel and the
    // parts merged (parallel); each sparse step first fetches every layer's likely misses, predicted
    // with the layer's previous query under --prefetch-scale times the budget (prefetch).
    uint32_t wire_quant = 0;  // --wire-quant: SG_WIRE_QUANT_* on both sides' transfer options
    bool seamless = true;
    bool parallel = true;
    bool prefetch = false;  // measured: costs more than it saves with the CPU selector (README)
    double prefetch_scale = 1.5;  // the predictor's budget over the selection's
    Attend attend = Attend::kBudget;
    int sparse_steps = -1;  // -1: until the transfer completes (sg_transfer_test == SG_OK)
    int window = 8;         // prompt queries passed to sg_transfer_layer_written_q

    // emulation
    std::string emulate;  // "", llama3-8b, qwen3-8b, llama3-70b
    uint64_t emulate_tokens = 8192;
    double prefill_tflops = 400.0;  // effective TFLOP/s of the stated accelerator for prefill
    double decode_tbps = 4.8;       // TB/s of memory bandwidth for decode
    double mass = 0.9;              // attention mass in the top 1/8 of blocks (synthetic keys)
    double overlap = 0.7;           // decode's hot blocks that are prefill's too
    uint64_t seed = 1;

    bool json = false;
    bool quiet = false;
    int timeout_s = 120;  // every wait on the peer
    int make_prompt = 0;  // > 0: print a sampled prompt of this many tokens and exit
};

// Parses argv. Throws UsageError naming the bad flag. Returns std::nullopt after printing --help.
std::optional<Options> parse_args(int argc, char** argv);

void print_usage(FILE* out);

// Reads a JSON array of non-negative integers ("[1, 42, 7]"); throws UsageError naming `flag` and the
// position of the first problem.
std::vector<int> read_token_file(const std::string& path, const char* flag);

const char* mode_name(Mode m);
const char* attend_name(Attend a);  // "budget", "resident"
// P's policy with --budget: --proactive-policy when given, else snapkv with a model and quest with
// --emulate (SnapKV scores every key on the host: at 8192 tokens and 32 layers that outlasts prefill).
std::string proactive_policy_for(const Options& o);
const char* dtype_label(uint32_t dtype);  // "fp32", "fp16", "bf16"

// "ADDR:PORT" (IPv6 as "[ADDR]:PORT") into its parts; throws UsageError naming flag.
void split_host_port(const std::string& s, const char* flag, std::string& host, uint16_t& port);

}  // namespace sg::disagg
