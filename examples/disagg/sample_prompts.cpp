// smartgen-sample-prompts: samples prompts (token ids) from a llama2.c checkpoint with the disagg
// engine, for measuring selection quality on text the model itself finds natural. Depends only on
// engine.hpp.
//
// Prompt i (0-based) of --count:
//   - seed      = --seed-base + i
//   - length    = min + round(i * (max - min) / (count - 1)) tokens, so lengths spread evenly over
//                 [min, max] (count 1: min)
//   - tokens[0] = BOS (1); every later token is drawn at temperature 1 from the engine's logits for
//                 the tokens before it (full attention, fp32 pool, decode_step one position at a time).
//                 A drawn BOS is kept like any other token.
// Sampling is written out so that it is the same on every platform:
//   - RNG: SplitMix64 (Steele, Lea, Flood 2014) seeded with `seed`; one 64-bit draw per token.
//   - u = (draw >> 11) * 2^-53, uniform in [0, 1).
//   - Inverse CDF: w_i = exp(double(logit_i) - double(max logit)) in double; total = sum of w_i in
//     index order; the token is the first i whose running sum (index order) exceeds u * total (the
//     last token with w_i > 0 if rounding leaves none).
// The engine's logits are bit-reproducible (see engine.hpp), so the only platform dependence left is
// the C library's double exp(), which IEEE-conforming libms agree on to well below the resolution
// that could change a draw except at a measure-zero boundary.
//
// Output: a JSON array, one prompt per line: [{"seed": 1, "tokens": [1, ...]}, ...].
//
// Usage: smartgen-sample-prompts [--model PATH] [--count N] [--min T] [--max T] [--seed-base S] [--out FILE]
// Defaults: --model $SMARTGEN_MODEL_DIR/stories260K.bin (else the repository's examples/models), --count 12,
// --min 128, --max 480, --seed-base 1, output to stdout.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "engine.hpp"

#include "model_files.hpp"

namespace {

using namespace sg::disagg;

struct SplitMix64 {
    uint64_t state;
    uint64_t next() {
        uint64_t z = (state += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    }
    double uniform() { return double(next() >> 11) * 0x1.0p-53; }
};

int sample(std::span<const float> logits, double u) {
    float mx = logits[0];
    for (float l : logits) mx = l > mx ? l : mx;
    std::vector<double> w(logits.size());
    double total = 0.0;
    for (size_t i = 0; i < logits.size(); ++i) total += (w[i] = std::exp(double(logits[i]) - double(mx)));
    const double target = u * total;
    double cum = 0.0;
    int last_positive = 0;
    for (size_t i = 0; i < w.size(); ++i) {
        if (w[i] > 0.0) last_positive = int(i);
        cum += w[i];
        if (cum > target) return int(i);
    }
    return last_positive;
}

std::vector<int> sample_prompt(const Model& model, const KvPool& pool, BlockTable table, RunState& state, uint64_t seed,
                               int length) {
    SplitMix64 rng{seed};
    std::vector<int> tokens{1};
    for (int pos = 0; int(tokens.size()) < length; ++pos) {
        const auto logits = decode_step(model, pool, table, pos, tokens.back(), state);
        tokens.push_back(sample(logits, rng.uniform()));
    }
    return tokens;
}

[[noreturn]] void usage(const char* msg) {
    std::fprintf(stderr,
                 "smartgen-sample-prompts: %s\n"
                 "usage: smartgen-sample-prompts [--model PATH] [--count N] [--min T] [--max T] [--seed-base S] "
                 "[--out FILE]\n",
                 msg);
    std::exit(2);
}

long parse_int(const char* flag, const char* v) {
    char* end = nullptr;
    const long x = std::strtol(v, &end, 10);
    if (!*v || *end) usage((std::string(flag) + " takes an integer, got '" + v + "'").c_str());
    return x;
}

}  // namespace

int main(int argc, char** argv) {
    std::string model_path = sg::disagg::model_files::path("stories260K.bin");
    std::string out_path;
    long count = 12, min_len = 128, max_len = 480, seed_base = 1;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--help" || a == "-h") usage("samples prompts from a llama2.c checkpoint");
        if (i + 1 >= argc) usage((a + " needs a value").c_str());
        const char* v = argv[++i];
        if (a == "--model")
            model_path = v;
        else if (a == "--out")
            out_path = v;
        else if (a == "--count")
            count = parse_int("--count", v);
        else if (a == "--min")
            min_len = parse_int("--min", v);
        else if (a == "--max")
            max_len = parse_int("--max", v);
        else if (a == "--seed-base")
            seed_base = parse_int("--seed-base", v);
        else
            usage(("unknown option " + a).c_str());
    }
    if (count < 1 || min_len < 1 || max_len < min_len) usage("need --count >= 1 and 1 <= --min <= --max");
    try {
        const Model model = Model::load(model_path);
        const Config& c = model.config();
        if (max_len > c.seq_len) usage(("--max exceeds the model's context of " + std::to_string(c.seq_len)).c_str());
        constexpr int kBlock = 16;
        KvPoolStorage storage(c, kBlock, blocks_for(c.seq_len, kBlock));
        const auto table = identity_table(blocks_for(c.seq_len, kBlock));
        RunState state(c);
        std::ostringstream os;
        os << "[\n";
        for (long i = 0; i < count; ++i) {
            const long len =
                count == 1 ? min_len : min_len + std::lround(double(i) * double(max_len - min_len) / double(count - 1));
            const uint64_t seed = uint64_t(seed_base + i);
            const auto tokens = sample_prompt(model, storage.view(), table, state, seed, int(len));
            os << "{\"seed\": " << seed << ", \"tokens\": [";
            for (size_t t = 0; t < tokens.size(); ++t) os << (t ? ", " : "") << tokens[t];
            os << "]}" << (i + 1 < count ? ",\n" : "\n");
            std::fprintf(stderr, "prompt %ld: seed %llu, %zu tokens\n", i, (unsigned long long)seed, tokens.size());
        }
        os << "]\n";
        if (out_path.empty()) {
            std::cout << os.str();
        } else {
            std::ofstream f(out_path, std::ios::binary);
            f << os.str();
            if (!f.flush()) throw EngineError("cannot write " + out_path);
        }
    } catch (const std::exception& e) {
        std::fprintf(stderr, "smartgen-sample-prompts: %s\n", e.what());
        return 1;
    }
    return 0;
}
