// The CUDA plugin's kernels on a device against the CPU twins (ctest label gpu): gather and scatter of
// scattered blocks (K and V separate and fused) byte-exact, page digests bit-exact against
// kernels::page_digest, int8 / fp8 E4M3 quantization and dequantization bit-exact against
// kernels::quantize_block / dequantize_block, Quest and SnapKV (cuBLASLt) scores within rounding, top-k
// exactly as kernels::top_k. Loads the plugin the way the runtime does (dlopen, sg_cuda_plugin_v1) and
// skips (exit 77) with the plugin's reason where there is no driver or device.
//   cuda_kernels_test PLUGIN_PATH
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/plugin_abi.h"
#include "kernels.hpp"

namespace {

int failures = 0;
#define EXPECT(cond, ...)                                   \
    do {                                                    \
        if (!(cond)) {                                      \
            std::printf("FAIL %s:%d: ", __FILE__, __LINE__); \
            std::printf(__VA_ARGS__);                       \
            std::printf("\n");                              \
            ++failures;                                     \
        }                                                   \
    } while (0)

void check_cuda(cudaError_t e, const char *what) {
    if (e != cudaSuccess) {
        std::printf("FAIL %s: %s\n", what, cudaGetErrorString(e));
        std::exit(1);
    }
}

template <typename T>
T *device_copy(const std::vector<T> &host) {
    T *d = nullptr;
    check_cuda(cudaMalloc(&d, host.size() * sizeof(T) + 16), "cudaMalloc");
    check_cuda(cudaMemcpy(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy H2D");
    return d;
}

template <typename T>
std::vector<T> host_copy(const T *d, size_t n) {
    std::vector<T> h(n);
    check_cuda(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
    return h;
}

void pack_round_trip(const sg_cuda_plugin_t *p, bool fused, uint64_t plane_bytes, std::mt19937_64 &rng) {
    const uint32_t pool_blocks = 64;
    const uint64_t stride = plane_bytes * (fused ? 2 : 1) + 64;
    std::vector<uint8_t> k(pool_blocks * stride), v(fused ? 0 : pool_blocks * stride);
    for (auto &b : k) b = uint8_t(rng());
    for (auto &b : v) b = uint8_t(rng());
    std::vector<uint32_t> blocks(40);
    for (size_t i = 0; i < blocks.size(); ++i) blocks[i] = uint32_t((i * 37 + 11) % pool_blocks);
    std::vector<uint8_t> want;
    for (uint32_t b : blocks) {
        const uint8_t *kb = &k[b * stride];
        const uint8_t *vb = fused ? kb + plane_bytes : &v[b * stride];
        want.insert(want.end(), kb, kb + plane_bytes);
        want.insert(want.end(), vb, vb + plane_bytes);
    }
    sg_cuda_pack_t pack{};
    pack.blocks = device_copy(blocks);
    pack.num_blocks = blocks.size();
    pack.plane_bytes = plane_bytes;
    pack.block_stride = stride;
    pack.fused = fused;
    pack.k_region = device_copy(k);
    pack.v_region = fused ? nullptr : device_copy(v);
    check_cuda(cudaMalloc(&pack.packed, want.size()), "cudaMalloc packed");
    char msg[256] = {};
    EXPECT(p->gather(&pack, nullptr, msg, sizeof msg) == 0, "gather: %s", msg);
    check_cuda(cudaDeviceSynchronize(), "gather");
    EXPECT(host_copy(static_cast<uint8_t *>(pack.packed), want.size()) == want, "gather of %s planes of %llu bytes",
           fused ? "fused" : "separate", (unsigned long long)plane_bytes);
    // Scatter into cleared regions: each listed block's planes come back.
    check_cuda(cudaMemset(pack.k_region, 0, k.size()), "memset");
    if (!fused) check_cuda(cudaMemset(pack.v_region, 0, v.size()), "memset");
    EXPECT(p->scatter(&pack, nullptr, msg, sizeof msg) == 0, "scatter: %s", msg);
    check_cuda(cudaDeviceSynchronize(), "scatter");
    const auto k_back = host_copy(static_cast<uint8_t *>(pack.k_region), k.size());
    for (uint32_t b : blocks)
        EXPECT(!std::memcmp(&k_back[b * stride], &k[b * stride], fused ? 2 * plane_bytes : plane_bytes),
               "scatter block %u", b);
    cudaFree(const_cast<uint32_t *>(pack.blocks));
    cudaFree(pack.k_region);
    cudaFree(pack.v_region);
    cudaFree(pack.packed);
}

void digest_matches(const sg_cuda_plugin_t *p, sg::kernels::DType dtype, bool head_major, std::mt19937_64 &rng) {
    const uint32_t heads = 8, dim = 128, tpb = 16, pool_blocks = 48;
    const uint64_t tokens = 16 * 30 + 5;
    const uint64_t n = sg::kernels::num_blocks(tokens, tpb);
    const size_t eb = sg::kernels::dtype_bytes(dtype);
    const uint64_t stride = uint64_t(tpb) * heads * dim * eb;
    std::vector<uint8_t> pool(pool_blocks * stride);
    std::normal_distribution<float> key(0.0f, 2.0f);
    for (uint64_t i = 0; i < pool.size() / eb; ++i) {
        const float f = key(rng);
        if (eb == 4) std::memcpy(&pool[i * 4], &f, 4);
        else {
            const uint16_t h = dtype == sg::kernels::DType::fp16 ? sg::kernels::float_to_fp16(f) : sg::kernels::float_to_bf16(f);
            std::memcpy(&pool[i * 2], &h, 2);
        }
    }
    std::vector<uint32_t> blocks(n);
    for (uint64_t i = 0; i < n; ++i) blocks[i] = uint32_t((i * 29 + 5) % pool_blocks);
    std::vector<float> want(sg::kernels::digest_floats(n, heads, dim));
    for (uint64_t i = 0; i < n; ++i) {
        const void *b = &pool[blocks[i] * stride];
        const uint64_t valid = std::min<uint64_t>(tpb, tokens - i * tpb);
        const auto v = head_major ? sg::kernels::head_major(b, dtype, tpb, heads, dim, tpb)
                                  : sg::kernels::token_major(b, dtype, tpb, heads, dim);
        sg::kernels::page_digest(sg::kernels::slice(v, 0, valid), tpb, &want[i * heads * 2 * dim]);
    }
    sg_cuda_digest_t d{};
    d.keys = device_copy(pool);
    d.blocks = device_copy(blocks);
    d.num_blocks = n;
    d.tokens = tokens;
    d.block_stride = stride;
    d.dtype = uint32_t(dtype);
    d.heads = heads;
    d.dim = dim;
    d.tokens_per_block = tpb;
    d.head_major = head_major;
    check_cuda(cudaMalloc(&d.out, want.size() * sizeof(float)), "cudaMalloc digest");
    char msg[256] = {};
    EXPECT(p->digest(&d, nullptr, msg, sizeof msg) == 0, "digest: %s", msg);
    check_cuda(cudaDeviceSynchronize(), "digest");
    const auto got = host_copy(d.out, want.size());
    EXPECT(!std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), "digest dtype %d %s differs from page_digest",
           int(dtype), head_major ? "head-major" : "token-major");
    // The runtime's call: the block list and the digests in host memory, on the plugin's stream.
    sg_cuda_digest_t h = d;
    h.blocks = blocks.data();
    std::vector<float> to_host(want.size(), -1.0f);
    h.out = to_host.data();
    EXPECT(p->digest_to_host(0, &h, msg, sizeof msg) == 0, "digest_to_host: %s", msg);
    EXPECT(!std::memcmp(to_host.data(), want.data(), want.size() * sizeof(float)),
           "digest_to_host dtype %d %s differs from page_digest", int(dtype), head_major ? "head-major" : "token-major");
    cudaFree(const_cast<void *>(d.keys));
    cudaFree(const_cast<uint32_t *>(d.blocks));
    cudaFree(d.out);
}

// Quantization of a scattered layer on the device against kernels::quantize_block / dequantize_block:
// codes, scales and the dequantized pool bit for bit.
void quantization_matches(const sg_cuda_plugin_t *p, sg::kernels::QuantCode code, sg::kernels::DType dtype,
                          bool head_major, std::mt19937_64 &rng) {
    const uint32_t heads = 8, dim = 128, tpb = 16, pool_blocks = 48;
    const uint64_t tokens = 16 * 20 + 9;
    const uint64_t n = sg::kernels::num_blocks(tokens, tpb);
    const size_t eb = sg::kernels::dtype_bytes(dtype);
    const uint64_t block_elems = uint64_t(tpb) * heads * dim, stride = block_elems * eb;
    std::vector<uint8_t> pool(pool_blocks * stride);
    std::normal_distribution<float> value(0.0f, 3.0f);
    for (uint64_t i = 0; i < pool.size() / eb; ++i) {
        const float f = value(rng);
        if (eb == 4) std::memcpy(&pool[i * 4], &f, 4);
        else {
            const uint16_t h = dtype == sg::kernels::DType::fp16 ? sg::kernels::float_to_fp16(f) : sg::kernels::float_to_bf16(f);
            std::memcpy(&pool[i * 2], &h, 2);
        }
    }
    std::vector<uint32_t> blocks(n);
    for (uint64_t i = 0; i < n; ++i) blocks[i] = uint32_t((i * 29 + 5) % pool_blocks);
    std::vector<uint8_t> want_codes(n * block_elems, 0);
    std::vector<float> want_scales(n * heads);
    std::vector<uint8_t> want_pool = pool;
    auto view_of = [&](void *base, uint64_t i) {
        void *b = static_cast<uint8_t *>(base) + uint64_t(blocks[i]) * stride;
        const uint64_t valid = std::min<uint64_t>(tpb, tokens - i * tpb);
        return head_major ? sg::kernels::head_major(b, dtype, valid, heads, dim, tpb)
                          : sg::kernels::token_major(b, dtype, valid, heads, dim);
    };
    for (uint64_t i = 0; i < n; ++i) {
        sg::kernels::quantize_block(view_of(pool.data(), i), code, &want_codes[i * block_elems], &want_scales[i * heads]);
        sg::kernels::dequantize_block(&want_codes[i * block_elems], &want_scales[i * heads], code, view_of(want_pool.data(), i));
    }
    sg_cuda_quant_t q{};
    q.region = device_copy(pool);
    q.blocks = device_copy(blocks);
    q.num_blocks = n;
    q.tokens = tokens;
    q.block_stride = stride;
    q.dtype = uint32_t(dtype);
    q.heads = heads;
    q.dim = dim;
    q.tokens_per_block = tpb;
    q.head_major = head_major;
    q.code = uint32_t(code);
    check_cuda(cudaMalloc(&q.codes, want_codes.size()), "cudaMalloc codes");
    check_cuda(cudaMemset(q.codes, 0, want_codes.size()), "memset codes");
    check_cuda(cudaMalloc(&q.scales, want_scales.size() * sizeof(float)), "cudaMalloc scales");
    char msg[256] = {};
    EXPECT(p->quantize(&q, nullptr, msg, sizeof msg) == 0, "quantize: %s", msg);
    check_cuda(cudaDeviceSynchronize(), "quantize");
    EXPECT(host_copy(q.codes, want_codes.size()) == want_codes, "quantize codes, code %d dtype %d %s", int(code),
           int(dtype), head_major ? "head-major" : "token-major");
    const auto scales = host_copy(q.scales, want_scales.size());
    EXPECT(!std::memcmp(scales.data(), want_scales.data(), scales.size() * sizeof(float)), "quantize scales");
    EXPECT(p->dequantize(&q, nullptr, msg, sizeof msg) == 0, "dequantize: %s", msg);
    check_cuda(cudaDeviceSynchronize(), "dequantize");
    EXPECT(host_copy(static_cast<uint8_t *>(q.region), pool.size()) == want_pool, "dequantized pool, code %d dtype %d",
           int(code), int(dtype));
    cudaFree(q.region);
    cudaFree(const_cast<uint32_t *>(q.blocks));
    cudaFree(q.codes);
    cudaFree(q.scales);
}

// Quest scores on the device against kernels::quest_scores, within float rounding of the sum.
void quest_matches(const sg_cuda_plugin_t *p, sg::kernels::Combine combine, std::mt19937_64 &rng) {
    const uint32_t kv_heads = 8, q_heads = 32, dim = 128;
    const uint64_t blocks = 300;
    std::normal_distribution<float> value(0.0f, 1.5f);
    std::vector<float> digest(sg::kernels::digest_floats(blocks, kv_heads, dim));
    for (uint64_t r = 0; r < blocks * kv_heads; ++r)
        for (uint32_t d = 0; d < dim; ++d) {
            const float x = value(rng), y = value(rng);
            digest[r * 2 * dim + d] = std::min(x, y);
            digest[r * 2 * dim + dim + d] = std::max(x, y);
        }
    std::vector<float> query(uint64_t(q_heads) * dim);
    for (auto &f : query) f = value(rng);
    const auto q = sg::kernels::token_major(query.data(), sg::kernels::DType::fp32, 1, q_heads, dim);
    std::vector<float> want(blocks * kv_heads);
    sg::kernels::quest_scores(digest.data(), blocks, kv_heads, q, combine, want.data());
    sg_cuda_quest_t k{};
    k.digest = device_copy(digest);
    k.num_blocks = blocks;
    k.query = device_copy(query);
    k.dtype = 0;
    k.q_heads = q_heads;
    k.kv_heads = kv_heads;
    k.dim = dim;
    k.combine = uint32_t(combine);
    check_cuda(cudaMalloc(&k.out, want.size() * sizeof(float)), "cudaMalloc quest");
    char msg[256] = {};
    EXPECT(p->quest(&k, nullptr, msg, sizeof msg) == 0, "quest: %s", msg);
    check_cuda(cudaDeviceSynchronize(), "quest");
    const auto got = host_copy(k.out, want.size());
    size_t off = 0;
    for (size_t i = 0; i < want.size(); ++i)
        if (std::fabs(got[i] - want[i]) > 1e-3f * (1.0f + std::fabs(want[i]))) ++off;
    EXPECT(off == 0, "quest scores (combine %d): %zu of %zu differ from the CPU's beyond rounding", int(combine), off,
           want.size());
    cudaFree(const_cast<float *>(k.digest));
    cudaFree(const_cast<void *>(k.query));
    cudaFree(k.out);
}

// Top-k per row on the device against kernels::top_k, exactly: ties, NaN and infinities included.
void topk_matches(const sg_cuda_plugin_t *p, std::mt19937_64 &rng) {
    const uint32_t rows = 8;
    for (uint64_t blocks : {1ull, 37ull, 2048ull, 20000ull}) {
        std::vector<float> scores(blocks * rows);
        for (auto &s : scores) {
            const uint64_t r = rng() % 50;
            s = r == 0 ? NAN : r == 1 ? INFINITY : r == 2 ? -INFINITY : float(int64_t(rng() % 1001) - 500) / 8.0f;
        }
        const uint32_t k = uint32_t(std::max<uint64_t>(1, blocks / 7));
        sg_cuda_topk_t t{};
        t.scores = device_copy(scores);
        t.num_blocks = blocks;
        t.rows = rows;
        t.k = k;
        check_cuda(cudaMalloc(&t.out, uint64_t(rows) * k * sizeof(uint32_t)), "cudaMalloc top-k");
        char msg[256] = {};
        EXPECT(p->topk(&t, nullptr, msg, sizeof msg) == 0, "topk: %s", msg);
        check_cuda(cudaDeviceSynchronize(), "top-k");
        const auto got = host_copy(t.out, uint64_t(rows) * k);
        for (uint32_t r = 0; r < rows; ++r) {
            std::vector<float> row(blocks);
            for (uint64_t b = 0; b < blocks; ++b) row[b] = scores[b * rows + r];
            const auto want = sg::kernels::top_k(row, k);
            EXPECT(std::equal(want.begin(), want.end(), got.begin() + uint64_t(r) * k),
                   "top-k of %llu blocks, row %u: the device's order differs from the CPU's", (unsigned long long)blocks, r);
        }
        cudaFree(const_cast<float *>(t.scores));
        cudaFree(t.out);
    }
}

// SnapKV's block scores on the device (paged fp16 keys, cuBLASLt for q.k) against
// kernels::snapkv_scores on the same keys gathered contiguously, within 1e-3 relative.
void snapkv_matches(const sg_cuda_plugin_t *p, sg::kernels::Combine combine, std::mt19937_64 &rng) {
    const uint32_t heads = 4, q_heads = 16, dim = 64, tpb = 16, window = 8, pool = 5;
    const uint64_t tokens = 1000, blocks = (tokens + tpb - 1) / tpb, pool_blocks = blocks + 9;
    const uint64_t stride = uint64_t(tpb) * heads * dim * 2;
    std::normal_distribution<float> value(0.0f, 1.0f);
    std::vector<uint16_t> region(pool_blocks * stride / 2);
    for (auto &h : region) h = sg::kernels::float_to_fp16(value(rng));
    std::vector<uint32_t> table(blocks);
    for (uint64_t i = 0; i < blocks; ++i) table[i] = uint32_t((i * 7) % pool_blocks);
    std::vector<uint16_t> contiguous(tokens * heads * dim);  // [token][head][dim]
    for (uint64_t t = 0; t < tokens; ++t)
        std::memcpy(&contiguous[t * heads * dim], &region[(table[t / tpb] * stride + (t % tpb) * heads * dim * 2) / 2],
                    heads * dim * 2);
    std::vector<float> queries(uint64_t(window) * q_heads * dim);
    for (auto &f : queries) f = value(rng);
    const auto keys = sg::kernels::token_major(contiguous.data(), sg::kernels::DType::fp16, tokens, heads, dim);
    const auto q = sg::kernels::token_major(queries.data(), sg::kernels::DType::fp32, window, q_heads, dim);
    std::vector<float> scratch(sg::kernels::snapkv_scratch_floats(keys, q)), want(blocks * heads);
    sg::kernels::snapkv_scores(keys, q, tokens - window, combine, tpb, pool, scratch, want.data());
    sg_cuda_snapkv_t s{};
    s.keys = device_copy(region);
    s.blocks = device_copy(table);
    s.num_blocks = blocks;
    s.tokens = tokens;
    s.block_stride = stride;
    s.dtype = 1;
    s.heads = heads;
    s.dim = dim;
    s.tokens_per_block = tpb;
    s.q_heads = q_heads;
    s.queries = device_copy(queries);
    s.num_queries = window;
    s.combine = uint32_t(combine);
    s.first_query_pos = tokens - window;
    s.pool = pool;
    check_cuda(cudaMalloc(&s.out, want.size() * sizeof(float)), "cudaMalloc snapkv");
    char msg[256] = {};
    EXPECT(p->snapkv(&s, nullptr, msg, sizeof msg) == 0, "snapkv: %s", msg);
    check_cuda(cudaDeviceSynchronize(), "snapkv");
    const auto got = host_copy(s.out, want.size());
    size_t off = 0;
    for (size_t i = 0; i < want.size(); ++i)
        if (std::fabs(got[i] - want[i]) > 1e-3f * (1e-3f + std::fabs(want[i]))) ++off;
    EXPECT(off == 0, "snapkv scores (combine %d): %zu of %zu differ from the CPU's beyond 1e-3", int(combine), off,
           want.size());
    cudaFree(const_cast<void *>(s.keys));
    cudaFree(const_cast<uint32_t *>(s.blocks));
    cudaFree(const_cast<float *>(s.queries));
    cudaFree(s.out);
}

}  // namespace

int main(int argc, char **argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: %s PLUGIN_PATH\n", argv[0]);
        return 2;
    }
    void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        std::printf("FAIL: dlopen %s: %s\n", argv[1], dlerror());
        return 1;
    }
    auto entry = reinterpret_cast<const sg_cuda_plugin_t *(*)()>(dlsym(h, "sg_cuda_plugin_v1"));
    const sg_cuda_plugin_t *p = entry ? entry() : nullptr;
    if (!p || p->abi != SG_CUDA_PLUGIN_ABI) {
        std::printf("FAIL: %s has no sg_cuda_plugin_v1 of interface %d\n", argv[1], SG_CUDA_PLUGIN_ABI);
        return 1;
    }
    char msg[256] = {};
    const int devices = p->device_count(msg, sizeof msg);
    if (devices <= 0) {
        std::printf("SKIP: no CUDA device: %s\n", devices < 0 ? msg : "the driver reports none");
        return 77;
    }
    std::mt19937_64 rng(3);
    for (bool fused : {false, true})
        for (uint64_t plane : {32768ull, 4104ull, 4095ull}) pack_round_trip(p, fused, plane, rng);
    for (auto dtype : {sg::kernels::DType::fp32, sg::kernels::DType::fp16, sg::kernels::DType::bf16})
        for (bool head_major : {false, true}) {
            digest_matches(p, dtype, head_major, rng);
            for (auto code : {sg::kernels::QuantCode::int8, sg::kernels::QuantCode::fp8_e4m3})
                quantization_matches(p, code, dtype, head_major, rng);
        }
    for (auto combine : {sg::kernels::Combine::max, sg::kernels::Combine::sum}) quest_matches(p, combine, rng);
    topk_matches(p, rng);
    for (auto combine : {sg::kernels::Combine::max, sg::kernels::Combine::sum}) snapkv_matches(p, combine, rng);
    std::printf("%s: %d failure(s) on %d device(s)\n", failures ? "FAIL" : "ok", failures, devices);
    return failures ? 1 : 0;
}
