// P8: each CUDA plugin kernel's achieved bandwidth ÷ the device-to-device copy bandwidth measured in
// the same run (docs/cuda.md; goal >= 0.8 for gather, scatter and digest, >= 0.7 for quantization).
// A Llama-3-8B-shaped layer (8 KV heads x 128, fp16, 16-token blocks: 32 KiB per plane), a pool of
// 8192 blocks and a scattered table of 4096 of them; each kernel's bytes are what it must read plus
// what it must write, as cudaMemcpy's are (read + write of the copy). Medians of --reps timed runs
// (CUDA events) after a warm-up. One JSON line per kernel with --json, else a table.
//   cuda_kernels_bench PLUGIN_PATH [--reps N] [--json]
// Exit 77 (skipped) without a device.
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "cuda/plugin_abi.h"
#include "kernels.hpp"

namespace {

void check_cuda(cudaError_t e, const char *what) {
    if (e != cudaSuccess) {
        std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
        std::exit(1);
    }
}

void check_plugin(int rc, const char *what, const char *msg) {
    if (rc != 0) {
        std::fprintf(stderr, "%s: %s\n", what, msg);
        std::exit(1);
    }
}

// Median seconds of `reps` runs of fn on the default stream, after one warm-up run.
double median_seconds(int reps, const std::function<void()> &fn) {
    cudaEvent_t start, stop;
    check_cuda(cudaEventCreate(&start), "cudaEventCreate");
    check_cuda(cudaEventCreate(&stop), "cudaEventCreate");
    fn();
    check_cuda(cudaDeviceSynchronize(), "warm-up");
    std::vector<double> s;
    for (int i = 0; i < reps; ++i) {
        check_cuda(cudaEventRecord(start), "cudaEventRecord");
        fn();
        check_cuda(cudaEventRecord(stop), "cudaEventRecord");
        check_cuda(cudaEventSynchronize(stop), "cudaEventSynchronize");
        float ms = 0;
        check_cuda(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
        s.push_back(ms / 1e3);
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    std::sort(s.begin(), s.end());
    return s[s.size() / 2];
}

}  // namespace

int main(int argc, char **argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: %s PLUGIN_PATH [--reps N] [--json]\n", argv[0]);
        return 2;
    }
    int reps = 20;
    bool json = false;
    for (int i = 2; i < argc; ++i) {
        if (!std::strcmp(argv[i], "--json")) json = true;
        else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::max(1, std::atoi(argv[++i]));
        else {
            std::fprintf(stderr, "unknown argument %s\n", argv[i]);
            return 2;
        }
    }
    void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    auto entry = h ? reinterpret_cast<const sg_cuda_plugin_t *(*)()>(dlsym(h, "sg_cuda_plugin_v1")) : nullptr;
    const sg_cuda_plugin_t *p = entry ? entry() : nullptr;
    if (!p) {
        std::fprintf(stderr, "%s: not a SmartGen CUDA plugin (%s)\n", argv[1], h ? "no sg_cuda_plugin_v1" : dlerror());
        return 1;
    }
    char msg[256] = {};
    if (p->device_count(msg, sizeof msg) <= 0) {
        std::printf("SKIP: no CUDA device: %s\n", msg[0] ? msg : "the driver reports none");
        return 77;
    }
    cudaDeviceProp prop{};
    check_cuda(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");

    const uint32_t heads = 8, dim = 128, tpb = 16, pool_blocks = 8192, listed = 4096;
    const uint64_t plane = uint64_t(tpb) * heads * dim * 2, packed_bytes = uint64_t(listed) * 2 * plane;
    // Scattered and distinct: an odd multiplier is a permutation modulo the power-of-two pool size.
    std::vector<uint32_t> table(listed);
    for (uint32_t i = 0; i < listed; ++i) table[i] = (i * 2654435761u) % pool_blocks;
    void *k = nullptr, *v = nullptr, *packed = nullptr, *copy = nullptr;
    uint32_t *blocks = nullptr;
    uint8_t *codes = nullptr;
    float *scales = nullptr, *digest = nullptr;
    check_cuda(cudaMalloc(&k, pool_blocks * plane), "cudaMalloc K");
    check_cuda(cudaMalloc(&v, pool_blocks * plane), "cudaMalloc V");
    check_cuda(cudaMalloc(&packed, packed_bytes), "cudaMalloc packed");
    check_cuda(cudaMalloc(&copy, packed_bytes), "cudaMalloc copy");
    check_cuda(cudaMalloc(&blocks, listed * sizeof(uint32_t)), "cudaMalloc blocks");
    check_cuda(cudaMalloc(&codes, uint64_t(listed) * plane / 2), "cudaMalloc codes");
    check_cuda(cudaMalloc(&scales, uint64_t(listed) * heads * sizeof(float)), "cudaMalloc scales");
    check_cuda(cudaMalloc(&digest, sg::kernels::digest_floats(listed, heads, dim) * sizeof(float)), "cudaMalloc digest");
    check_cuda(cudaMemset(k, 0x3c, pool_blocks * plane), "memset K");  // fp16 ~1.0: finite keys
    check_cuda(cudaMemset(v, 0x3c, pool_blocks * plane), "memset V");
    check_cuda(cudaMemcpy(blocks, table.data(), listed * sizeof(uint32_t), cudaMemcpyHostToDevice), "table");

    sg_cuda_pack_t pack{blocks, listed, plane, plane, 0, 0, k, v, packed};
    sg_cuda_digest_t dg{};
    dg.keys = k, dg.blocks = blocks, dg.num_blocks = listed, dg.tokens = uint64_t(listed) * tpb;
    dg.block_stride = plane, dg.dtype = uint32_t(sg::kernels::DType::fp16), dg.heads = heads, dg.dim = dim;
    dg.tokens_per_block = tpb, dg.out = digest;
    sg_cuda_quant_t q{};
    q.region = k, q.blocks = blocks, q.num_blocks = listed, q.tokens = uint64_t(listed) * tpb, q.block_stride = plane;
    q.dtype = uint32_t(sg::kernels::DType::fp16), q.heads = heads, q.dim = dim, q.tokens_per_block = tpb;
    q.code = uint32_t(sg::kernels::QuantCode::fp8_e4m3), q.codes = codes, q.scales = scales;

    // Bytes each moves: read + write, as a copy's.
    const uint64_t digest_out = sg::kernels::digest_floats(listed, heads, dim) * sizeof(float);
    const double copy_s = median_seconds(reps, [&] { check_cuda(cudaMemcpy(copy, packed, packed_bytes, cudaMemcpyDeviceToDevice), "d2d"); });
    const double copy_gbps = 2.0 * double(packed_bytes) / copy_s / 1e9;
    struct Row {
        const char *kernel;
        double bytes, seconds;
    };
    std::vector<Row> rows = {
        {"gather", 2.0 * packed_bytes, median_seconds(reps, [&] { check_plugin(p->gather(&pack, nullptr, msg, sizeof msg), "gather", msg); })},
        {"scatter", 2.0 * packed_bytes, median_seconds(reps, [&] { check_plugin(p->scatter(&pack, nullptr, msg, sizeof msg), "scatter", msg); })},
        {"digest", double(packed_bytes / 2 + digest_out), median_seconds(reps, [&] { check_plugin(p->digest(&dg, nullptr, msg, sizeof msg), "digest", msg); })},
        {"quantize_fp8", double(packed_bytes / 2 + packed_bytes / 4), median_seconds(reps, [&] { check_plugin(p->quantize(&q, nullptr, msg, sizeof msg), "quantize", msg); })},
        {"dequantize_fp8", double(packed_bytes / 4 + packed_bytes / 2), median_seconds(reps, [&] { check_plugin(p->dequantize(&q, nullptr, msg, sizeof msg), "dequantize", msg); })},
    };
    if (!json) std::printf("%s, %d runs each; device-to-device copy %.1f GB/s (read + write)\n", prop.name, reps, copy_gbps);
    for (const Row &r : rows) {
        const double gbps = r.bytes / r.seconds / 1e9;
        if (json)
            std::printf("{\"kernel\":\"%s\",\"device\":\"%s\",\"gbps\":%.2f,\"d2d_gbps\":%.2f,\"ratio\":%.3f,\"seconds\":%.6f}\n",
                        r.kernel, prop.name, gbps, copy_gbps, gbps / copy_gbps, r.seconds);
        else
            std::printf("  %-16s %8.1f GB/s  %.3f of the copy\n", r.kernel, gbps, gbps / copy_gbps);
    }
    return 0;
}
