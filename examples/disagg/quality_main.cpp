// smartgen-quality: how close selective decode's blocks (proactive P, on-demand S_t, generated G) come
// to the best blocks of the same size, on a real checkpoint (quality.hpp has the definitions).
// scripts/quality.sh runs it to make docs/quality.md.
//
// Usage: smartgen-quality [--model PATH] [--name NAME] [--prompts FILE] [--limit K] [--new-tokens N]
//                         [--budgets F,F,..] [--block-tokens B,B,..] [--window W]
//                         [--proactive-policy snapkv|quest] [--wire-quant none|int8|fp8]
//                         [--json | --markdown] [--quiet]
//   --model PATH       default: $SMARTGEN_MODEL, else $SMARTGEN_MODEL_DIR/stories260K.bin, else the
//                      repository's examples/models/stories260K.bin. Missing: a message and exit 77
//                      (exit 1 under SMARTGEN_REQUIRE_DATA=1).
//   --name NAME        model name in the output and the profile (default: the file name without .bin)
//   --prompts FILE     default: the committed data/prompts-tinystories.json
//   --limit K          only the first K prompts;  --new-tokens N: 64;  --window W: 8
//   --budgets          fractions of the prompt, "0.25" or "1/4"; default 1/2,1/4,1/8,1/16
//   --block-tokens     default 8,16
//   --proactive-policy P's policy, as smartgen-disagg's flag: snapkv (default) or quest; S_t is quest
//   --wire-quant       decode attends to the prompt's KV as a transfer with that in-flight
//                      quantization delivers it (default none)
//   --json             everything, per prompt too;  --markdown: the tables of docs/quality.md
// Progress goes to stderr (--quiet: none). Exit status: 0 done, 1 failed, 2 bad flags, 77 no model.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>

#include "calibrate.hpp"
#include "model_files.hpp"
#include "pool_layout.hpp"
#include "quality.hpp"

namespace {

[[noreturn]] void usage(const std::string& msg) {
    std::fprintf(stderr,
                 "smartgen-quality: %s\n"
                 "usage: smartgen-quality [--model PATH] [--name NAME] [--prompts FILE] [--limit K]\n"
                 "                        [--new-tokens N] [--budgets F,F,..] [--block-tokens B,B,..]\n"
                 "                        [--window W] [--proactive-policy snapkv|quest]\n"
                 "                        [--wire-quant none|int8|fp8]\n"
                 "                        [--json | --markdown] [--quiet]\n",
                 msg.c_str());
    std::exit(2);
}

int parse_int(const std::string& flag, const std::string& v, int min) {
    char* end = nullptr;
    const long x = std::strtol(v.c_str(), &end, 10);
    if (v.empty() || *end || x < min || x > 1 << 24)
        usage(flag + " takes an integer >= " + std::to_string(min) + ", got '" + v + "'");
    return int(x);
}

// "0.25" or "1/4".
double parse_fraction(const std::string& flag, const std::string& v) {
    char* end = nullptr;
    double x = std::strtod(v.c_str(), &end);
    if (!v.empty() && *end == '/') {
        const char* den = end + 1;
        const double d = std::strtod(den, &end);
        x = d != 0.0 ? x / d : 0.0;
        if (end == den) x = 0.0;
    }
    if (v.empty() || *end || !(x > 0.0 && x <= 1.0))
        usage(flag + " takes fractions in (0, 1] such as 0.25 or 1/4, got '" + v + "'");
    return x;
}

template <class T, class Parse>
std::vector<T> parse_list(const std::string& flag, const std::string& v, Parse parse) {
    std::vector<T> out;
    size_t from = 0;
    while (from <= v.size()) {
        const size_t comma = v.find(',', from);
        const size_t to = comma == std::string::npos ? v.size() : comma;
        out.push_back(parse(flag, v.substr(from, to - from)));
        from = to + 1;
    }
    return out;
}

std::string default_model() { return sg::disagg::model_files::stories(); }

}  // namespace

int main(int argc, char** argv) {
    std::string model_path = default_model(), prompts_path = SMARTGEN_DEFAULT_PROMPTS;
    bool named = false;
    sg::disagg::QualityOptions opt;
    int limit = -1;
    bool json = false, markdown = false, quiet = false;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--help" || a == "-h") usage("measures selection quality against the oracle");
        if (a == "--json") {
            json = true;
            continue;
        }
        if (a == "--markdown") {
            markdown = true;
            continue;
        }
        if (a == "--quiet") {
            quiet = true;
            continue;
        }
        if (i + 1 >= argc) usage(a + " needs a value");
        const std::string v = argv[++i];
        if (a == "--model")
            model_path = v;
        else if (a == "--prompts")
            prompts_path = v;
        else if (a == "--name") {
            opt.model_name = v;
            named = true;
        } else if (a == "--limit")
            limit = parse_int(a, v, 1);
        else if (a == "--new-tokens")
            opt.new_tokens = parse_int(a, v, 2);
        else if (a == "--window")
            opt.window = parse_int(a, v, 1);
        else if (a == "--proactive-policy") {
            if (v != "snapkv" && v != "quest") usage("--proactive-policy takes snapkv or quest, got '" + v + "'");
            opt.proactive_policy = v;
        } else if (a == "--wire-quant") {
            if (!sg::disagg::wire_quant_of(v, opt.wire_quant))
                usage("--wire-quant takes none, int8 or fp8, got '" + v + "'");
        } else if (a == "--budgets")
            opt.budgets = parse_list<double>(a, v, parse_fraction);
        else if (a == "--block-tokens")
            opt.block_tokens =
                parse_list<int>(a, v, [](const std::string& f, const std::string& s) { return parse_int(f, s, 1); });
        else
            usage("unknown option " + a);
    }
    if (json && markdown) usage("--json and --markdown exclude each other");
    if (!named) opt.model_name = std::filesystem::path(model_path).stem().string();
    if (!std::filesystem::exists(model_path)) {
        const int status = sg::disagg::model_files::missing_exit_status();
        std::fprintf(stderr, "smartgen-quality: %s: no checkpoint at %s (pass --model, or set SMARTGEN_MODEL or %s)\n",
                     status == 77 ? "skipped" : "failed (SMARTGEN_REQUIRE_DATA=1)", model_path.c_str(),
                     sg::disagg::model_files::how_to_point());
        return status;
    }
    if (!quiet)
        opt.progress = [](const std::string& line) { std::fprintf(stderr, "smartgen-quality: %s\n", line.c_str()); };
    try {
        const auto model = sg::disagg::Model::load(model_path);
        auto prompts = sg::disagg::load_prompts(prompts_path);
        if (limit > 0 && size_t(limit) < prompts.size()) prompts.resize(size_t(limit));
        const auto report = sg::disagg::measure_quality(model, prompts, opt);
        std::cout << (json ? report.to_json() : markdown ? report.to_markdown() : report.to_text());
        std::cout.flush();
        if (!std::cout) throw sg::disagg::EngineError("cannot write the output");
    } catch (const std::exception& e) {
        std::fprintf(stderr, "smartgen-quality: %s\n", e.what());
        return 1;
    }
    return 0;
}
