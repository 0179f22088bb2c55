// examples/disagg/cli.cpp: see cli.hpp.
#include "cli.hpp"

#include "pool_layout.hpp"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

namespace sg::disagg {

namespace {

[[noreturn]] void bad(const std::string& flag, const std::string& what) { throw UsageError(flag + ": " + what); }

long long parse_int(const std::string& flag, const std::string& v, long long lo, long long hi) {
    errno = 0;
    char* end = nullptr;
    const long long x = std::strtoll(v.c_str(), &end, 10);
    if (v.empty() || errno != 0 || end == v.c_str() || *end != '\0') bad(flag, "expected an integer, got '" + v + "'");
    if (x < lo || x > hi)
        bad(flag, std::to_string(x) + " is outside " + std::to_string(lo) + ".." + std::to_string(hi));
    return x;
}

double parse_double(const std::string& flag, const std::string& v, double lo, double hi, bool lo_open) {
    errno = 0;
    char* end = nullptr;
    const double x = std::strtod(v.c_str(), &end);
    if (v.empty() || errno != 0 || end == v.c_str() || *end != '\0' || !std::isfinite(x))
        bad(flag, "expected a number, got '" + v + "'");
    if ((lo_open ? x <= lo : x < lo) || x > hi) {
        std::ostringstream o;
        o << v << " is outside " << (lo_open ? "(" : "[") << lo << ", " << hi << "]";
        bad(flag, o.str());
    }
    return x;
}

bool parse_on_off(const std::string& flag, const std::string& v) {
    if (v == "on" || v == "true" || v == "1") return true;
    if (v == "off" || v == "false" || v == "0") return false;
    bad(flag, "expected on or off, got '" + v + "'");
}

}  // namespace

std::string proactive_policy_for(const Options& o) {
    if (!o.proactive_policy.empty()) return o.proactive_policy;
    return o.emulate.empty() ? "snapkv" : "quest";
}

const char* mode_name(Mode m) {
    switch (m) {
        case Mode::kColocated:
            return "colocated";
        case Mode::kFull:
            return "full";
        case Mode::kSelective:
            return "selective";
    }
    return "?";
}

const char* attend_name(Attend a) { return a == Attend::kBudget ? "budget" : "resident"; }

const char* dtype_label(uint32_t dtype) {
    switch (dtype) {
        case 0:
            return "fp32";
        case 1:
            return "fp16";
        case 2:
            return "bf16";
    }
    return "?";
}

void split_host_port(const std::string& s, const char* flag, std::string& host, uint16_t& port) {
    std::string h, p;
    if (!s.empty() && s[0] == '[') {
        const size_t close = s.find(']');
        if (close == std::string::npos || close + 1 >= s.size() || s[close + 1] != ':')
            bad(flag, "expected [ADDR]:PORT, got '" + s + "'");
        h = s.substr(1, close - 1);
        p = s.substr(close + 2);
    } else {
        const size_t colon = s.rfind(':');
        if (colon == std::string::npos || colon == 0) bad(flag, "expected ADDR:PORT, got '" + s + "'");
        h = s.substr(0, colon);
        p = s.substr(colon + 1);
    }
    host = h;
    port = uint16_t(parse_int(flag, p, 0, 65535));
}

void print_usage(FILE* out) {
    std::fputs(
        "usage: smartgen-disagg [--mode colocated|full|selective] [options]\n"
        "\n"
        "Disaggregated inference of a llama2.c model on this machine: a prefill process computes the\n"
        "prompt's KV cache and the first token, SmartGen moves the cache to a decode process (forked\n"
        "from this one), which generates the rest greedily. The parent prints the results.\n"
        "\n"
        "modes\n"
        "  --mode colocated        one process does prefill and decode, no transfer (reference tokens)\n"
        "  --mode full             the whole KV pool moves with SG_PATH_FULL\n"
        "  --mode selective        SG_PATH_PROACTIVE (+ on-demand, + speculative): decode starts on the\n"
        "                          essential blocks and attends to P u S_t u G (see below)\n"
        "model and request\n"
        "  --model PATH            llama2.c checkpoint (default: $SMARTGEN_MODEL, else\n"
        "                          $SMARTGEN_MODEL_DIR/stories260K.bin, else the source tree's\n"
        "                          examples/models/stories260K.bin, else examples/models/ from the\n"
        "                          working directory); exit status 77 when it does not exist (1 with\n"
        "                          SMARTGEN_REQUIRE_DATA=1). --emulate runs and a --role decode side\n"
        "                          whose prefill side emulates open no checkpoint\n"
        "  --prompt-tokens FILE    JSON array of token ids starting with BOS (1). Default: the built-in\n"
        "                          100-token prompt (BOS + 99 tokens that stories260K sampled from BOS at\n"
        "                          temperature 1 with seed 260: --make-prompt 100 --seed 260 prints it)\n"
        "  --max-new-tokens N      tokens to generate, the first from prefill (default 64)\n"
        "  --kv-dtype fp32|fp16|bf16   KV pool element type on both sides (default fp32)\n"
        "  --block-tokens B        tokens per KV block (default 16)\n"
        "full transfer\n"
        "  --full-stream on|off    on (default): each layer is marked written from the engine's\n"
        "                          layer hook during prefill; off: the transfer is posted after prefill\n"
        "                          with SG_TRANSFER_ALL_LAYERS_WRITTEN\n"
        "selective transfer\n"
        "  --profile FILE          selection profile (docs/profiles.md) of both sides; default: built\n"
        "                          from --budget. Decode selects with the digests: use quest,\n"
        "                          sinks_recent, dense\n"
        "  --budget X              tokens (integer) or fraction (e.g. 0.125) per layer and KV head\n"
        "                          (default 0.25), the same for two profiles: the prefill side's for P\n"
        "                          (--proactive-policy, sinks 1 block, recent 1 block) and the decode\n"
        "                          side's for S_t (quest on the digests, no sinks or recent: P has them)\n"
        "  --proactive-policy snapkv|quest   P's policy with --budget. Default: snapkv (the last\n"
        "                          --window prompt queries' attention over the keys; closer to the\n"
        "                          oracle, docs/quality.md) with a model, quest with --emulate (SnapKV\n"
        "                          scores every key on the host CPU, which outlasts a modelled prefill)\n"
        "  --on-demand on|off      fetch decode's selected blocks that are not resident (default on)\n"
        "  --speculative on|off    send the rest in the background (default on)\n"
        "  --seamless on|off       a layer whose blocks are all here, or will be before its selection and\n"
        "                          fetch would be done (measured receive rate), is attended whole: no\n"
        "                          selection, no fetch, exact (default on; applies with the speculative\n"
        "                          path on and no --sparse-steps, the runs that measure latency)\n"
        "  --parallel on|off       attend to the resident blocks while the missing ones are fetched,\n"
        "                          then merge the parts exactly (log-sum-exp; default on)\n"
        "  --wire-quant none|int8|fp8   in-flight quantization (full and selective modes): the KV\n"
        "                          crosses as one-byte codes with a scale per block, plane and KV head,\n"
        "                          and decode dequantizes into its pool (lossy; default none)\n"
        "  --prefetch on|off       each sparse step after the first fetches every layer's likely misses\n"
        "                          at once, predicted with that layer's previous query under a larger\n"
        "                          budget; the step then fetches only the true misses (default off:\n"
        "                          on 2 cores the prediction's CPU time and its extra bytes cost more\n"
        "                          than the round trips it saves; needs --budget, not --profile)\n"
        "  --prefetch-scale F      the predictor's budget over the selection's (default 1.5, > 1)\n"
        "  --sparse-steps K        decode steps that attend to P u S_t u G before attending to\n"
        "                          everything (waiting for what is missing); default: until the\n"
        "                          transfer completes (sg_transfer_test == SG_OK). With the speculative\n"
        "                          path on, a small cache on a fast link is usually complete before\n"
        "                          step 2: no sparse step (the run measures latency, not sparse\n"
        "                          decoding); with --speculative off it never completes: every step\n"
        "                          is sparse\n"
        "  --attend budget|resident   what P is (default budget): budget = the proactive selection\n"
        "                          itself (the prefill side makes the runtime's choice again with the\n"
        "                          selector API and sends it), so a sparse step attends to the budget\n"
        "                          whatever else has arrived; resident = every block resident when the\n"
        "                          layer's essential blocks were in place (with the speculative path\n"
        "                          on, most of the prompt on a fast link)\n"
        "  --window W              last prompt queries given to the proactive selector (default 8)\n"
        "emulation (real transfers of a big model's KV cache shape, compute time modelled)\n"
        "  --emulate llama3-8b|qwen3-8b|llama3-70b    fp16 KV, 8 KV heads, head_dim 128\n"
        "  --emulate-tokens N      prompt tokens (default 8192)\n"
        "  --prefill-tflops R      effective prefill rate, TFLOP/s (default 400)\n"
        "  --decode-tbps BW        decode memory bandwidth, TB/s (default 4.8)\n"
        "                          prefill layer time = (2*params_per_layer*N + 2*n_heads*head_dim*N^2)/R\n"
        "                          decode step time   = (2 bytes * (params of all layers + classifier)\n"
        "                                                + attended tokens * KV bytes per token) / BW\n"
        "                                               + the measured selector time\n"
        "  --mass M                synthetic keys: attention mass of prefill's query in the top 1/8 of\n"
        "                          blocks (default 0.9)\n"
        "  --overlap F             fraction of decode's top blocks that are prefill's too (default 0.7)\n"
        "  --seed S                seed of the synthetic keys and of --make-prompt (default 1)\n"
        "running one side by hand (the key then comes from SG_AUTH_KEY_FILE on both sides)\n"
        "  --role prefill --listen ADDR:PORT     listen for the decode side, print the results\n"
        "  --role decode --peer ADDR:PORT        connect to the prefill side; the run's parameters\n"
        "                          (mode, paths, profile, prompt length, emulation) come from it\n"
        "  --provider NAME         libfabric provider (tcp, shm, ...; default automatic)\n"
        "  --local-addr ADDR       address of this side's data endpoint (default 127.0.0.1)\n"
        "output\n"
        "  --json                  one JSON object on stdout\n"
        "  --quiet                 no progress on stderr\n"
        "  --timeout S             seconds any wait on the peer may take (default 120)\n"
        "  --make-prompt N         print N tokens sampled from BOS (--seed) as JSON and exit\n"
        "  --help\n"
        "\n"
        "Timing (CLOCK_MONOTONIC, shared by both processes): t0 = the prefill side holds the prompt with\n"
        "session and pools warm (context, session and registration are cold_start_ms); TTFT = t0 -> first\n"
        "token (prefill); TTST = t0 -> second token (decode); stall = TTST - TTFT;\n"
        "TPOT = (t_last - t_second) / (N - 2).\n"
        "Selective decode, sparse step t, layer l: P = the layer's proactive blocks (--attend budget) or\n"
        "the blocks resident when they were in place (--attend resident); S_t = the decode-side\n"
        "selector's blocks for this step's query (same budget, digests from the transfer), fetched on\n"
        "demand when not resident; G = the generated tokens.\n"
        "Exit status: 0 ok, 1 runtime failure, 2 bad flags, 77 model file absent.\n",
        out);
}

std::optional<Options> parse_args(int argc, char** argv) {
    Options o;
    bool saw_full_stream = false, saw_model = false;
    std::string saw_selective, saw_emulate_param;  // the first such flag given
    for (int i = 1; i < argc; ++i) {
        std::string flag = argv[i], value;
        bool has_inline = false;
        if (flag.rfind("--", 0) == 0) {
            const size_t eq = flag.find('=');
            if (eq != std::string::npos) {
                value = flag.substr(eq + 1);
                flag = flag.substr(0, eq);
                has_inline = true;
            }
        }
        auto take = [&]() -> std::string {
            if (has_inline) return value;
            if (i + 1 >= argc) bad(flag, "needs a value");
            return argv[++i];
        };
        auto no_value = [&] {
            if (has_inline) bad(flag, "takes no value");
        };
        if (flag == "--help" || flag == "-h") {
            print_usage(stdout);
            return std::nullopt;
        } else if (flag == "--mode") {
            const std::string v = take();
            if (v == "colocated")
                o.mode = Mode::kColocated;
            else if (v == "full")
                o.mode = Mode::kFull;
            else if (v == "selective")
                o.mode = Mode::kSelective;
            else
                bad(flag, "expected colocated, full or selective, got '" + v + "'");
        } else if (flag == "--role") {
            const std::string v = take();
            if (v == "prefill")
                o.role = Role::kPrefill;
            else if (v == "decode")
                o.role = Role::kDecode;
            else
                bad(flag, "expected prefill or decode, got '" + v + "'");
        } else if (flag == "--listen") {
            o.listen = take();
            o.listen_set = true;
            std::string h;
            uint16_t p;
            split_host_port(o.listen, "--listen", h, p);
        } else if (flag == "--peer") {
            o.peer = take();
            std::string h;
            uint16_t p;
            split_host_port(o.peer, "--peer", h, p);
            if (p == 0) bad(flag, "port 0: name the port the prefill side listens on");
        } else if (flag == "--provider") {
            o.provider = take();
        } else if (flag == "--local-addr") {
            o.local_addr = take();
        } else if (flag == "--model") {
            o.model = take();
            saw_model = true;
        } else if (flag == "--prompt-tokens") {
            o.prompt_file = take();
        } else if (flag == "--max-new-tokens") {
            o.max_new_tokens = int(parse_int(flag, take(), 1, 1 << 20));
        } else if (flag == "--kv-dtype") {
            const std::string v = take();
            if (v == "fp32")
                o.kv_dtype = 0;
            else if (v == "fp16")
                o.kv_dtype = 1;
            else if (v == "bf16")
                o.kv_dtype = 2;
            else
                bad(flag, "expected fp32, fp16 or bf16, got '" + v + "'");
            o.kv_dtype_set = true;
        } else if (flag == "--block-tokens") {
            o.block_tokens = int(parse_int(flag, take(), 1, 4096));
        } else if (flag == "--full-stream") {
            o.full_stream = parse_on_off(flag, take());
            saw_full_stream = true;
        } else if (flag == "--profile") {
            o.profile_file = take();
            if (saw_selective.empty()) saw_selective = flag;
        } else if (flag == "--budget") {
            const std::string v = take();
            if (v.find_first_of(".eE") != std::string::npos) {
                o.budget.is_fraction = true;
                o.budget.fraction = parse_double(flag, v, 0.0, 1.0, true);
            } else {
                o.budget.is_fraction = false;
                o.budget.tokens = uint64_t(parse_int(flag, v, 1, 1ll << 40));
            }
            o.budget_set = true;
            if (saw_selective.empty()) saw_selective = flag;
        } else if (flag == "--proactive-policy") {
            o.proactive_policy = take();
            if (o.proactive_policy != "snapkv" && o.proactive_policy != "quest")
                bad(flag, "expected snapkv or quest, got '" + o.proactive_policy + "'");
            o.proactive_policy_set = true;
            if (saw_selective.empty()) saw_selective = flag;
        } else if (flag == "--on-demand") {
            o.on_demand = parse_on_off(flag, take());
            if (saw_selective.empty()) saw_selective = flag;
        } else if (flag == "--speculative") {
            o.speculative = parse_on_off(flag, take());
            if (saw_selective.empty()) saw_selective = flag;
        } else if (flag == "--seamless") {
            o.seamless = parse_on_off(flag, take());
            if (saw_selective.empty()) saw_selective = flag;
        } else if (flag == "--parallel") {
            o.parallel = parse_on_off(flag, take());
            if (saw_selective.empty()) saw_selective = flag;
        } else if (flag == "--wire-quant") {
            const std::string v = take();
            if (!wire_quant_of(v, o.wire_quant)) bad(flag, "expected none, int8 or fp8, got '" + v + "'");
        } else if (flag == "--prefetch") {
            o.prefetch = parse_on_off(flag, take());
            if (saw_selective.empty()) saw_selective = flag;
        } else if (flag == "--prefetch-scale") {
            const std::string v = take();
            char* end = nullptr;
            o.prefetch_scale = std::strtod(v.c_str(), &end);
            if (v.empty() || *end || !(o.prefetch_scale > 1.0 && o.prefetch_scale <= 64.0))
                bad(flag, "expected a factor above 1 (e.g. 1.5), got '" + v + "'");
            if (saw_selective.empty()) saw_selective = flag;
        } else if (flag == "--attend") {
            const std::string v = take();
            if (v == "budget")
                o.attend = Attend::kBudget;
            else if (v == "resident")
                o.attend = Attend::kResident;
            else
                bad(flag, "expected budget or resident, got '" + v + "'");
            if (saw_selective.empty()) saw_selective = flag;
        } else if (flag == "--sparse-steps") {
            o.sparse_steps = int(parse_int(flag, take(), 0, 1 << 20));
            if (saw_selective.empty()) saw_selective = flag;
        } else if (flag == "--window") {
            o.window = int(parse_int(flag, take(), 1, 4096));
            if (saw_selective.empty()) saw_selective = flag;
        } else if (flag == "--emulate") {
            o.emulate = take();
            if (o.emulate != "llama3-8b" && o.emulate != "qwen3-8b" && o.emulate != "llama3-70b")
                bad(flag, "expected llama3-8b, qwen3-8b or llama3-70b, got '" + o.emulate + "'");
        } else if (flag == "--emulate-tokens") {
            o.emulate_tokens = uint64_t(parse_int(flag, take(), 1, 1ll << 24));
            if (saw_emulate_param.empty()) saw_emulate_param = flag;
        } else if (flag == "--prefill-tflops") {
            o.prefill_tflops = parse_double(flag, take(), 0.0, 1e6, true);
            if (saw_emulate_param.empty()) saw_emulate_param = flag;
        } else if (flag == "--decode-tbps") {
            o.decode_tbps = parse_double(flag, take(), 0.0, 1e4, true);
            if (saw_emulate_param.empty()) saw_emulate_param = flag;
        } else if (flag == "--mass") {
            o.mass = parse_double(flag, take(), 0.125, 0.9999, true);
            if (saw_emulate_param.empty()) saw_emulate_param = flag;
        } else if (flag == "--overlap") {
            o.overlap = parse_double(flag, take(), 0.0, 1.0, false);
            if (saw_emulate_param.empty()) saw_emulate_param = flag;
        } else if (flag == "--seed") {
            o.seed = uint64_t(parse_int(flag, take(), 0, (1ll << 62)));
        } else if (flag == "--json") {
            no_value();
            o.json = true;
        } else if (flag == "--quiet") {
            no_value();
            o.quiet = true;
        } else if (flag == "--timeout") {
            o.timeout_s = int(parse_int(flag, take(), 1, 86400));
        } else if (flag == "--make-prompt") {
            o.make_prompt = int(parse_int(flag, take(), 1, 1 << 20));
        } else {
            throw UsageError(flag + ": unknown flag (--help lists them)");
        }
    }

    // Combinations.
    if (o.make_prompt > 0) return o;
    if (saw_full_stream && o.mode != Mode::kFull && o.role != Role::kDecode)
        bad("--full-stream", "applies to --mode full only");
    if (!saw_selective.empty() && o.mode != Mode::kSelective && o.role != Role::kDecode)
        bad(saw_selective, "applies to --mode selective only");
    if (!o.profile_file.empty() && o.budget_set) bad("--budget", "give --profile or --budget, not both");
    if (!o.profile_file.empty() && o.proactive_policy_set)
        bad("--proactive-policy", "applies to the profiles --budget builds, not to --profile");
    if (o.mode == Mode::kSelective && o.sparse_steps >= 0 && !o.speculative && !o.on_demand)
        bad("--sparse-steps",
            "after the sparse steps decode waits for every block, which needs --speculative on "
            "or --on-demand on");
    if (o.role == Role::kPrefill && o.mode == Mode::kColocated)
        bad("--role", "needs --mode full or selective (colocated runs in one process)");
    if (o.role == Role::kDecode && o.peer.empty()) bad("--peer", "--role decode needs --peer ADDR:PORT");
    if (o.role == Role::kBoth && !o.peer.empty()) bad("--peer", "needs --role decode (or --role prefill)");
    if (o.role != Role::kPrefill && o.listen_set) bad("--listen", "needs --role prefill");
    if (!o.emulate.empty()) {
        if (o.mode == Mode::kColocated && o.role != Role::kDecode) bad("--emulate", "needs --mode full or selective");
        if (saw_model) bad("--model", "not used with --emulate");
        if (!o.prompt_file.empty()) bad("--prompt-tokens", "not used with --emulate (use --emulate-tokens)");
        if (o.kv_dtype_set && o.kv_dtype != 1) bad("--kv-dtype", "--emulate uses fp16");
        o.kv_dtype = 1;
    } else if (!saw_emulate_param.empty()) {
        bad(saw_emulate_param, "applies to --emulate only");
    }
    return o;
}

std::vector<int> read_token_file(const std::string& path, const char* flag) {
    std::ifstream in(path, std::ios::binary);
    if (!in) bad(flag, "cannot read '" + path + "': " + std::strerror(errno));
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string s = ss.str();
    size_t i = 0;
    auto ws = [&] {
        while (i < s.size() && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r')) ++i;
    };
    auto where = [&] { return path + " at byte " + std::to_string(i); };
    std::vector<int> out;
    ws();
    if (i >= s.size() || s[i] != '[') bad(flag, where() + ": expected '[' (a JSON array of token ids)");
    ++i;
    ws();
    if (i < s.size() && s[i] == ']') {
        ++i;
    } else {
        for (;;) {
            ws();
            const size_t start = i;
            while (i < s.size() && s[i] >= '0' && s[i] <= '9') ++i;
            if (i == start || i - start > 9) bad(flag, where() + ": expected a non-negative integer token id");
            out.push_back(std::atoi(s.substr(start, i - start).c_str()));
            ws();
            if (i < s.size() && s[i] == ',') {
                ++i;
                continue;
            }
            if (i < s.size() && s[i] == ']') {
                ++i;
                break;
            }
            bad(flag, where() + ": expected ',' or ']'");
        }
    }
    ws();
    if (i != s.size()) bad(flag, where() + ": unexpected text after the array");
    if (out.empty()) bad(flag, path + ": the prompt is empty");
    if (out[0] != 1) bad(flag, path + ": the prompt must start with BOS (1), it starts with " + std::to_string(out[0]));
    return out;
}

}  // namespace sg::disagg
