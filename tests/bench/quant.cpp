// smartgen-microbench quant (internal: it links the runtime's core/ for its wire-quantization codec):
// how fast in-flight quantization (sg_transfer_options_t.wire_quant) codes and decodes, one thread,
// against memcpy of the same pool bytes measured in the same run, interleaved.
//
// The segment: 4 MiB of one region of a Llama-3-8B-shaped pool (8 KV heads x 128, 16-token blocks,
// token-major, K and V separate), normal-distributed keys (what a transfer meets; fp16 subnormals,
// which the CPU converts slowly, are rare in real keys). Per dtype (fp16, bf16, fp32) and code (int8,
// fp8 E4M3): encode (pool bytes -> scales and codes, the prefill side's progress thread) and decode
// (the decode side's), value = pool bytes per second (median of --reps), baseline = memcpy of the
// pool bytes, ratio = value / memcpy; once per vector path the CPU has (SSE2, AVX2 with F16C:
// decode is SSE2 on both). What the numbers mean for a link: a codec below the link's
// rate is the transfer's bottleneck (docs/benchmarks.md, "In-flight quantization").
//
// Flags: --bytes SIZE (4M), --reps N (15; --quick 5).
#include "quant/quant.hpp"

#include <smartgen/smartgen.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>

#include "bench.hpp"

namespace sg::bench {

namespace {

double gbps(uint64_t bytes, uint64_t ns) { return double(bytes) / double(std::max<uint64_t>(ns, 1)); }

}  // namespace

int run_quant(const Common &c) {
    Flags flags("quant", c.rest);
    uint64_t bytes = 4ull << 20;
    int reps = c.quick ? 5 : 15;
    try {
        if (auto v = flags.take("--bytes")) bytes = parse_bytes(*v);
        if (auto v = flags.take("--reps")) reps = std::stoi(*v);
    } catch (const std::exception &e) {
        std::fprintf(stderr, "smartgen-microbench quant: %s\n", e.what());
        return 2;
    }
    flags.finish();
    if (reps < 1 || bytes < (1u << 16)) {
        std::fprintf(stderr, "smartgen-microbench quant: need --reps >= 1 and --bytes >= 64K\n");
        return 2;
    }
    Report report(c);
    for (sg_dtype_t dtype : {SG_DTYPE_FP16, SG_DTYPE_BF16, SG_DTYPE_FP32}) {
        sg_kv_layout_t pub{};
        pub.struct_size = sizeof pub;
        pub.num_layers = 1;
        pub.num_kv_heads = 8;
        pub.head_dim = 128;
        pub.tokens_per_block = 16;
        pub.dtype = dtype;
        const uint64_t block = uint64_t(16) * 8 * 128 * kv::dtype_bytes(dtype);
        pub.num_blocks = std::max<uint64_t>(1, bytes / block);
        const kv::Layout L = kv::make_layout_shape(pub);
        const uint64_t len = L.region_bytes();
        std::vector<uint8_t> pool(len), back(len);
        std::mt19937 rng(7);
        std::normal_distribution<float> normal(0.0f, 1.0f);
        for (uint64_t i = 0; i < len; i += L.elem_bytes) {
            const float f = normal(rng);
            if (dtype == SG_DTYPE_FP32) {
                std::memcpy(&pool[i], &f, 4);
            } else {
                const uint16_t h = dtype == SG_DTYPE_FP16 ? kernels::float_to_fp16(f) : kernels::float_to_bf16(f);
                std::memcpy(&pool[i], &h, 2);
            }
        }
        quant::Shape shape;
        if (!quant::shape_of(L, 0, 0, len, shape)) throw std::logic_error("the segment has no shape");
        std::vector<uint8_t> wire(shape.wire_bytes());
        const std::pair<const uint8_t *, uint64_t> piece{pool.data(), len};
        const quant::Simd best = quant::simd_in_use();
        for (quant::Simd simd : {quant::Simd::sse2, quant::Simd::avx2}) {
        quant::use_simd(simd);
        if (quant::simd_in_use() != simd) continue;  // the CPU lacks it
        const char *simd_name = simd == quant::Simd::avx2 ? "avx2" : "sse2";
        for (kernels::QuantCode code : {kernels::QuantCode::int8, kernels::QuantCode::fp8_e4m3}) {
            const char *code_name = code == kernels::QuantCode::int8 ? "int8" : "fp8_e4m3";
            const char *dtype_name = dtype == SG_DTYPE_FP16 ? "fp16" : dtype == SG_DTYPE_BF16 ? "bf16" : "fp32";
            progress("quant", std::string(dtype_name) + " -> " + code_name + ", " + human_bytes(len) + " x " +
                                  std::to_string(reps));
            std::vector<double> enc, dec, copy;
            for (int r = 0; r < reps + 1; ++r) {  // the first round warms up and is not counted
                uint64_t t0 = now_ns();
                quant::encode(L, 0, 0, len, shape, std::span(&piece, 1), code, wire.data());
                uint64_t t1 = now_ns();
                quant::decode(L, 0, 0, len, shape, wire.data(), code, back.data());
                uint64_t t2 = now_ns();
                const double m = memcpy_gbps_on(back.data(), pool.data(), len);
                if (r == 0) continue;
                enc.push_back(gbps(len, t1 - t0));
                dec.push_back(gbps(len, t2 - t1));
                copy.push_back(m);
            }
            const double mc = median(copy);
            for (const bool encoding : {true, false}) {
                Line l;
                l.bench = "quant";
                l.value = median(encoding ? enc : dec);
                l.unit = "GB/s";
                l.baseline_name = "memcpy";
                l.baseline_value = mc;
                l.ratio = mc > 0 ? l.value / mc : 0;
                l.op = std::string(encoding ? "encode " : "decode ") + dtype_name + " -> " + code_name + " " + simd_name;
                l.pattern = "token-major, 8 heads x 128";
                l.total_bytes = len;
                l.block_bytes = block;
                l.extra["wire_over_pool"] = double(shape.wire_bytes()) / double(len);
                l.extra["reps"] = reps;
                l.note = std::string(encoding ? "encode" : "decode") + " " + dtype_name + "/" + code_name +
                         ": pool bytes per second, one thread; wire " +
                         std::to_string(double(shape.wire_bytes()) / double(len)).substr(0, 5) + " of the pool";
                report.add(l);
            }
        }
        }
        quant::use_simd(best);
    }
    if (!c.json) report.print_table();
    return 0;
}

}  // namespace sg::bench
