// smartgen-calibrate: runs a llama2.c checkpoint over prompts and writes its attention statistics
// per layer and KV head (calibrate.hpp has the measurement and the JSON schema), the input of
// tools/smartgen-profile.
//
// Usage: smartgen-calibrate --model PATH --prompts FILE [--emit-stats FILE] [--name NAME]
//                           [--block-tokens B] [--steps S] [--window W] [--sinks T] [--recent T]
//                           [--limit N]
//   --emit-stats FILE  where to write the stats JSON (default stdout); a summary goes to stderr
//   --name NAME        model name in the stats (default: the checkpoint's file name without .bin)
//   --block-tokens B   16 by default;  --steps S: 16;  --window W: 16
//   --sinks T, --recent T  tokens the profile will always send per head (inside its budget); one
//                      block each by default. smartgen-profile uses the values recorded in the stats.
//   --limit N          use only the first N prompts
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>

#include "calibrate.hpp"

namespace {

[[noreturn]] void usage(const std::string& msg) {
    std::fprintf(stderr,
                 "smartgen-calibrate: %s\n"
                 "usage: smartgen-calibrate --model PATH --prompts FILE [--emit-stats FILE] [--name NAME]\n"
                 "                          [--block-tokens B] [--steps S] [--window W] [--sinks T]\n"
                 "                          [--recent T] [--limit N]\n",
                 msg.c_str());
    std::exit(2);
}

int parse_int(const std::string& flag, const char* v) {
    char* end = nullptr;
    const long x = std::strtol(v, &end, 10);
    if (!*v || *end || x < 0 || x > 1 << 24) usage(flag + " takes a non-negative integer, got '" + v + "'");
    return int(x);
}

}  // namespace

int main(int argc, char** argv) {
    std::string model_path, prompts_path, out_path, name;
    sg::disagg::CalibrationOptions opt;
    opt.sinks = opt.recent = -1;  // one block each unless given
    int limit = -1;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--help" || a == "-h") usage("writes attention statistics for smartgen-profile");
        if (i + 1 >= argc) usage(a + " needs a value");
        const char* v = argv[++i];
        if (a == "--model")
            model_path = v;
        else if (a == "--prompts")
            prompts_path = v;
        else if (a == "--emit-stats")
            out_path = v;
        else if (a == "--name")
            name = v;
        else if (a == "--block-tokens")
            opt.block_tokens = parse_int(a, v);
        else if (a == "--steps")
            opt.steps = parse_int(a, v);
        else if (a == "--window")
            opt.window = parse_int(a, v);
        else if (a == "--sinks")
            opt.sinks = parse_int(a, v);
        else if (a == "--recent")
            opt.recent = parse_int(a, v);
        else if (a == "--limit")
            limit = parse_int(a, v);
        else
            usage("unknown option " + a);
    }
    if (model_path.empty() || prompts_path.empty()) usage("--model and --prompts are required");
    if (opt.sinks < 0) opt.sinks = opt.block_tokens;
    if (opt.recent < 0) opt.recent = opt.block_tokens;
    if (name.empty()) name = std::filesystem::path(model_path).stem().string();
    try {
        const auto model = sg::disagg::Model::load(model_path);
        auto prompts = sg::disagg::load_prompts(prompts_path);
        if (limit >= 0 && size_t(limit) < prompts.size()) prompts.resize(size_t(limit));
        const auto st = sg::disagg::calibrate(model, name, prompts, opt);
        const std::string json = st.to_json();
        if (out_path.empty()) {
            std::cout << json;
        } else {
            std::ofstream f(out_path, std::ios::binary);
            f << json;
            if (!f.flush()) throw sg::disagg::EngineError("cannot write " + out_path);
        }
        std::fprintf(stderr,
                     "%s: %d prompts (%d..%d tokens), %llu decode rows, %llu window rows, blocks of %d, "
                     "sinks %d, recent %d\n",
                     name.c_str(), st.prompts, st.min_prompt_tokens, st.max_prompt_tokens,
                     (unsigned long long)st.decode_rows, (unsigned long long)st.window_rows, st.block_tokens, st.sinks,
                     st.recent);
        std::fprintf(stderr, "layer head  recall@1/16 @1/8  @1/4   entropy\n");
        auto at = [&](const sg::disagg::HeadCalibration& h, double f) {
            for (size_t i = 0; i < st.budgets.size(); ++i)
                if (st.budgets[i] >= f) return h.recall_mean[i];
            return 1.0;
        };
        for (const auto& h : st.heads)
            std::fprintf(stderr, "%5d %4d  %11.3f %5.3f %5.3f  %7.3f\n", h.layer, h.kv_head, at(h, 1.0 / 16),
                         at(h, 1.0 / 8), at(h, 1.0 / 4), h.entropy);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "smartgen-calibrate: %s\n", e.what());
        return 1;
    }
    return 0;
}
