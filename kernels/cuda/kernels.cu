// The CUDA plugin, libsmartgen-cuda.so.0: gather and scatter of a layer's listed blocks between the
// paged regions and a packed staging buffer (the staged path), page digests, Quest scores, and in-flight
// quantization (int8 / fp8 E4M3 codes with a scale per block and KV head) on the device. Each
// thread's work is the shared per-element code of elements.hpp, which the host harness checks
// against the CPU twins on machines without a GPU. libsmartgen loads this library with dlopen the
// first time a CUDA pool is used (runtime/core/cuda_plugin.cpp); nothing else links it.
#include <cub/device/device_segmented_radix_sort.cuh>
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <cstdio>
#include <mutex>
#include <vector>

#include "cuda/elements.hpp"
#include "cuda/plugin_abi.h"

namespace {

using sg::kernels::DType;
using sg::kernels::View;
namespace elem = sg::kernels::cuda;

constexpr int kThreads = 256;

int fail_with(cudaError_t e, const char *what, char *msg, size_t cap) {
    if (msg && cap) std::snprintf(msg, cap, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
    return -int(e ? e : 1);
}

int launched(const char *what, char *msg, size_t cap) {
    const cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? 0 : fail_with(e, what, msg, cap);
}

// One thread per copy unit of the packed buffer; Unit is the unit's type (uint4, uint2, uint32_t,
// uint16_t, uint8_t), chosen by pack_unit so that every unit is aligned on both sides.
template <typename Unit, bool Gather>
__global__ void pack_kernel(sg_cuda_pack_t p, elem::PackGeometry g, uint64_t units) {
    const uint64_t u = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (u >= units) return;
    const uint64_t at = u * sizeof(Unit);
    const elem::PackSource s = elem::packed_source(g, p.blocks, at);
    auto *region = static_cast<uint8_t *>(s.plane == 0 || g.fused ? p.k_region : p.v_region);
    auto *packed = static_cast<uint8_t *>(p.packed);
    if (Gather)
        *reinterpret_cast<Unit *>(packed + at) = *reinterpret_cast<const Unit *>(region + s.region_offset);
    else
        *reinterpret_cast<Unit *>(region + s.region_offset) = *reinterpret_cast<const Unit *>(packed + at);
}

template <bool Gather>
int pack(const sg_cuda_pack_t *p, void *stream, char *msg, size_t cap) {
    const elem::PackGeometry g{p->plane_bytes, p->block_stride, 2, p->fused};
    const uint64_t bytes = p->num_blocks * 2 * p->plane_bytes;
    if (!bytes) return 0;
    uint64_t alignment = uint64_t(reinterpret_cast<uintptr_t>(p->packed)) | reinterpret_cast<uintptr_t>(p->k_region);
    if (!p->fused) alignment |= reinterpret_cast<uintptr_t>(p->v_region);
    const uint64_t base_alignment = alignment & ~(alignment - 1);  // the lowest set bit
    const uint32_t unit = elem::pack_unit(g, base_alignment ? base_alignment : 16);
    const uint64_t units = bytes / unit;
    const dim3 grid(unsigned((units + kThreads - 1) / kThreads));
    auto *s = static_cast<cudaStream_t>(stream);
    switch (unit) {
        case 16: pack_kernel<uint4, Gather><<<grid, kThreads, 0, s>>>(*p, g, units); break;
        case 8: pack_kernel<uint2, Gather><<<grid, kThreads, 0, s>>>(*p, g, units); break;
        case 4: pack_kernel<uint32_t, Gather><<<grid, kThreads, 0, s>>>(*p, g, units); break;
        case 2: pack_kernel<uint16_t, Gather><<<grid, kThreads, 0, s>>>(*p, g, units); break;
        default: pack_kernel<uint8_t, Gather><<<grid, kThreads, 0, s>>>(*p, g, units); break;
    }
    return launched(Gather ? "gather kernel" : "scatter kernel", msg, cap);
}

// One thread per (block, head, element) of the digest.
__global__ void digest_kernel(sg_cuda_digest_t d) {
    const uint64_t e = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    const uint64_t per_block = uint64_t(d.heads) * d.dim;
    if (e >= d.num_blocks * per_block) return;
    const uint64_t i = e / per_block;
    const uint32_t head = uint32_t((e % per_block) / d.dim);
    const uint32_t element = uint32_t(e % d.dim);
    const DType dtype = static_cast<DType>(d.dtype);
    const void *block = static_cast<const uint8_t *>(d.keys) + uint64_t(d.blocks[i]) * d.block_stride;
    const View keys = d.head_major
                          ? sg::kernels::head_major(block, dtype, d.tokens_per_block, d.heads, d.dim, d.tokens_per_block)
                          : sg::kernels::token_major(block, dtype, d.tokens_per_block, d.heads, d.dim);
    const uint64_t first = i * d.tokens_per_block;
    const uint64_t valid = d.tokens - first < d.tokens_per_block ? d.tokens - first : d.tokens_per_block;
    float lo, hi;
    elem::digest_element(keys, valid, head, element, &lo, &hi);
    float *row = d.out + (i * d.heads + head) * 2 * d.dim;
    row[element] = lo;
    row[d.dim + element] = hi;
}

int digest(const sg_cuda_digest_t *d, void *stream, char *msg, size_t cap) {
    const uint64_t threads = d->num_blocks * d->heads * d->dim;
    if (!threads) return 0;
    digest_kernel<<<unsigned((threads + kThreads - 1) / kThreads), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(*d);
    return launched("digest kernel", msg, cap);
}

// The View of listed block i of a quantization's region, and the valid tokens of that block.
__device__ View quant_block(const sg_cuda_quant_t &q, uint64_t i, uint64_t *valid) {
    const DType dtype = static_cast<DType>(q.dtype);
    void *block = static_cast<uint8_t *>(q.region) + uint64_t(q.blocks[i]) * q.block_stride;
    const uint64_t first = i * q.tokens_per_block;
    *valid = q.tokens - first < q.tokens_per_block ? q.tokens - first : q.tokens_per_block;
    return q.head_major ? sg::kernels::head_major(block, dtype, *valid, q.heads, q.dim, q.tokens_per_block)
                        : sg::kernels::token_major(block, dtype, *valid, q.heads, q.dim);
}

// One thread per (block, head): the head's scale.
__global__ void quant_scales_kernel(sg_cuda_quant_t q) {
    const uint64_t e = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (e >= q.num_blocks * q.heads) return;
    uint64_t valid;
    const View block = quant_block(q, e / q.heads, &valid);
    const auto code = static_cast<sg::kernels::QuantCode>(q.code);
    q.scales[e] = sg::kernels::quant_scale(elem::head_absmax(block, valid, uint32_t(e % q.heads)), code);
}

// One thread per element of the listed blocks' valid tokens: quantize (codes from the region) or
// dequantize (the region from codes).
template <bool Quantize>
__global__ void quant_kernel(sg_cuda_quant_t q) {
    const uint64_t per_token = uint64_t(q.heads) * q.dim;
    const uint64_t per_block = per_token * q.tokens_per_block;
    const uint64_t e = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (e >= q.num_blocks * per_block) return;
    const uint64_t i = e / per_block;
    const uint64_t t = (e % per_block) / per_token;
    const uint32_t head = uint32_t((e % per_token) / q.dim), d = uint32_t(e % q.dim);
    uint64_t valid;
    const View block = quant_block(q, i, &valid);
    if (t >= valid) return;
    const auto code = static_cast<sg::kernels::QuantCode>(q.code);
    const uint64_t at = t * block.token_stride + uint64_t(head) * block.head_stride + d;
    uint8_t *codes = q.codes + i * per_block;
    const float scale = q.scales[i * q.heads + head];
    if (Quantize) {
        codes[at] = elem::quantize_element(block, t, head, d, sg::kernels::quant_inv_scale(scale), code);
        return;
    }
    const float v = sg::kernels::dequantize_value(codes[at], scale, code);
    auto *out = static_cast<uint8_t *>(const_cast<void *>(block.data));
    if (block.dtype == DType::fp32) reinterpret_cast<float *>(out)[at] = v;
    else if (block.dtype == DType::fp16) reinterpret_cast<uint16_t *>(out)[at] = sg::kernels::float_to_fp16(v);
    else reinterpret_cast<uint16_t *>(out)[at] = sg::kernels::float_to_bf16(v);
}

template <bool Quantize>
int quant(const sg_cuda_quant_t *q, void *stream, char *msg, size_t cap) {
    const uint64_t elements = q->num_blocks * q->tokens_per_block * q->heads * q->dim;
    if (!elements) return 0;
    auto *s = static_cast<cudaStream_t>(stream);
    if (Quantize) {
        const uint64_t heads = q->num_blocks * q->heads;
        quant_scales_kernel<<<unsigned((heads + kThreads - 1) / kThreads), kThreads, 0, s>>>(*q);
        if (const int rc = launched("quantization scales kernel", msg, cap)) return rc;
    }
    quant_kernel<Quantize><<<unsigned((elements + kThreads - 1) / kThreads), kThreads, 0, s>>>(*q);
    return launched(Quantize ? "quantize kernel" : "dequantize kernel", msg, cap);
}

// One thread per (block, KV head).
__global__ void quest_kernel(sg_cuda_quest_t q) {
    const uint64_t e = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (e >= q.num_blocks * q.kv_heads) return;
    const View query = sg::kernels::token_major(q.query, static_cast<DType>(q.dtype), 1, q.q_heads, q.dim);
    q.out[e] = elem::quest_score_element(q.digest, q.kv_heads, query, static_cast<sg::kernels::Combine>(q.combine),
                                         e / q.kv_heads, uint32_t(e % q.kv_heads));
}

int quest(const sg_cuda_quest_t *q, void *stream, char *msg, size_t cap) {
    const uint64_t threads = q->num_blocks * q->kv_heads;
    if (!threads) return 0;
    quest_kernel<<<unsigned((threads + kThreads - 1) / kThreads), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(*q);
    return launched("quest kernel", msg, cap);
}

int device_count(char *msg, size_t cap) {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) return fail_with(e, "cudaGetDeviceCount", msg, cap);
    return n;
}

// ---- top-k ----

// Ranks [row][block] from scores [block][row] (elements.hpp: one integer whose descending order is
// the CPU twin's), and the segment offsets of the rows.
__global__ void topk_ranks_kernel(sg_cuda_topk_t t, uint64_t *ranks, int *offsets) {
    const uint64_t e = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (e <= t.rows) offsets[e] = int(e * t.num_blocks);
    if (e >= t.num_blocks * t.rows) return;
    const uint64_t row = e / t.num_blocks, block = e % t.num_blocks;
    ranks[e] = elem::topk_rank(t.scores[block * t.rows + row], uint32_t(block));
}

__global__ void topk_take_kernel(sg_cuda_topk_t t, const uint64_t *sorted) {
    const uint64_t e = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (e >= uint64_t(t.rows) * t.k) return;
    const uint64_t row = e / t.k, j = e % t.k;
    t.out[e] = elem::topk_index(sorted[row * t.num_blocks + j]);
}

int topk(const sg_cuda_topk_t *t, void *stream, char *msg, size_t cap) {
    const uint64_t n = t->num_blocks * t->rows;
    if (!n || !t->k) return 0;
    if (t->k > t->num_blocks || n > uint64_t(INT32_MAX)) {
        if (msg && cap) std::snprintf(msg, cap, "top-k: k %u of %llu blocks x %u rows is out of range", t->k,
                                      (unsigned long long)t->num_blocks, t->rows);
        return -1;
    }
    auto *s = static_cast<cudaStream_t>(stream);
    uint64_t *ranks = nullptr, *sorted = nullptr;
    int *offsets = nullptr;
    void *temp = nullptr;
    size_t temp_bytes = 0;
    cudaError_t e = cub::DeviceSegmentedRadixSort::SortKeysDescending(
        nullptr, temp_bytes, ranks, sorted, int(n), int(t->rows), offsets, offsets + 1, 0, 64, s);
    if (e == cudaSuccess) e = cudaMallocAsync(&ranks, n * sizeof(uint64_t), s);
    if (e == cudaSuccess) e = cudaMallocAsync(&sorted, n * sizeof(uint64_t), s);
    if (e == cudaSuccess) e = cudaMallocAsync(&offsets, (t->rows + 1) * sizeof(int), s);
    if (e == cudaSuccess) e = cudaMallocAsync(&temp, temp_bytes, s);
    if (e == cudaSuccess) {
        const uint64_t threads = n > t->rows ? n : uint64_t(t->rows) + 1;
        topk_ranks_kernel<<<unsigned((threads + kThreads - 1) / kThreads), kThreads, 0, s>>>(*t, ranks, offsets);
        e = cudaGetLastError();
    }
    if (e == cudaSuccess)
        e = cub::DeviceSegmentedRadixSort::SortKeysDescending(temp, temp_bytes, ranks, sorted, int(n), int(t->rows),
                                                               offsets, offsets + 1, 0, 64, s);
    if (e == cudaSuccess) {
        const uint64_t threads = uint64_t(t->rows) * t->k;
        topk_take_kernel<<<unsigned((threads + kThreads - 1) / kThreads), kThreads, 0, s>>>(*t, sorted);
        e = cudaGetLastError();
    }
    for (void *p : {static_cast<void *>(ranks), static_cast<void *>(sorted), static_cast<void *>(offsets), temp})
        if (p) cudaFreeAsync(p, s);
    return e == cudaSuccess ? 0 : fail_with(e, "top-k", msg, cap);
}

// ---- SnapKV through cuBLASLt ----

// K gathered from the pages: keys[head][token][dim] in fp32.
__global__ void snapkv_keys_kernel(sg_cuda_snapkv_t s, float *keys) {
    const uint64_t e = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (e >= uint64_t(s.heads) * s.tokens * s.dim) return;
    const uint32_t d = uint32_t(e % s.dim);
    const uint64_t t = (e / s.dim) % s.tokens;
    const uint32_t h = uint32_t(e / (uint64_t(s.dim) * s.tokens));
    const DType dtype = static_cast<DType>(s.dtype);
    const void *block = static_cast<const uint8_t *>(s.keys) + uint64_t(s.blocks[t / s.tokens_per_block]) * s.block_stride;
    const View v = s.head_major ? sg::kernels::head_major(block, dtype, s.tokens_per_block, s.heads, s.dim, s.tokens_per_block)
                                : sg::kernels::token_major(block, dtype, s.tokens_per_block, s.heads, s.dim);
    keys[e] = elem::key_element(v, t % s.tokens_per_block, h, d);
}

// Queries regrouped per KV head: q[head][g][w][dim] (g: the head's query heads), scaled by 1/sqrt(dim)
// as the CPU twin scales them before its dot products.
__global__ void snapkv_queries_kernel(sg_cuda_snapkv_t s, float *q) {
    const uint64_t e = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    const uint64_t n = uint64_t(s.num_queries) * s.q_heads * s.dim;
    if (e >= n) return;
    const uint32_t group = s.q_heads / s.heads;
    const uint32_t d = uint32_t(e % s.dim);
    const uint32_t w = uint32_t((e / s.dim) % s.num_queries);
    const uint32_t qh = uint32_t(e / (uint64_t(s.dim) * s.num_queries));  // = head * group + g
    (void)group;
    q[e] = s.queries[(uint64_t(w) * s.q_heads + qh) * s.dim + d] * (1.0f / sqrtf(float(s.dim)));
}

// One CUDA block per logits row (head, g, w): the causal softmax of the row, in place (masked 0).
__global__ void snapkv_softmax_kernel(sg_cuda_snapkv_t s, float *logits) {
    const uint64_t row = blockIdx.x;
    const uint32_t w = uint32_t(row % s.num_queries);
    float *l = logits + row * s.tokens;
    const uint64_t pos = s.first_query_pos + w + 1;
    const uint64_t visible = pos < s.tokens ? pos : s.tokens;
    __shared__ float red[kThreads];
    float m = -INFINITY;
    for (uint64_t t = threadIdx.x; t < visible; t += blockDim.x) m = fmaxf(m, l[t]);
    red[threadIdx.x] = m;
    __syncthreads();
    for (unsigned o = blockDim.x / 2; o; o /= 2) {
        if (threadIdx.x < o) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + o]);
        __syncthreads();
    }
    m = red[0];
    __syncthreads();
    float z = 0.0f;
    for (uint64_t t = threadIdx.x; t < visible; t += blockDim.x) z += expf(l[t] - m);
    red[threadIdx.x] = z;
    __syncthreads();
    for (unsigned o = blockDim.x / 2; o; o /= 2) {
        if (threadIdx.x < o) red[threadIdx.x] += red[threadIdx.x + o];
        __syncthreads();
    }
    const float inv = 1.0f / red[0];
    for (uint64_t t = threadIdx.x; t < s.tokens; t += blockDim.x) l[t] = t < visible ? expf(l[t] - m) * inv : 0.0f;
}

// Per (head, token): the window's sum per query head, the group combined (max or sum).
__global__ void snapkv_tokens_kernel(sg_cuda_snapkv_t s, const float *probs, float *token_scores) {
    const uint64_t e = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (e >= uint64_t(s.heads) * s.tokens) return;
    const uint64_t t = e % s.tokens;
    const uint32_t h = uint32_t(e / s.tokens);
    const uint32_t group = s.q_heads / s.heads;
    float acc = 0.0f;
    for (uint32_t g = 0; g < group; ++g) {
        float sum = 0.0f;
        for (uint32_t w = 0; w < s.num_queries; ++w)
            sum += probs[((uint64_t(h) * group + g) * s.num_queries + w) * s.tokens + t];
        acc = g == 0 ? sum : s.combine == 0 ? fmaxf(acc, sum) : acc + sum;
    }
    token_scores[e] = acc;
}

// Per (block, head): the max-pooled token scores summed over the block's valid tokens.
__global__ void snapkv_blocks_kernel(sg_cuda_snapkv_t s, const float *token_scores) {
    const uint64_t e = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (e >= s.num_blocks * s.heads) return;
    const uint64_t b = e / s.heads;
    const uint32_t h = uint32_t(e % s.heads);
    const float *x = token_scores + uint64_t(h) * s.tokens;
    const uint64_t r = s.pool / 2, first = b * s.tokens_per_block;
    const uint64_t end = first + s.tokens_per_block < s.tokens ? first + s.tokens_per_block : s.tokens;
    float total = 0.0f;
    for (uint64_t t = first; t < end; ++t) {
        const uint64_t lo = t >= r ? t - r : 0, hi = t + r < s.tokens ? t + r : s.tokens - 1;
        float m = x[lo];
        for (uint64_t u = lo + 1; u <= hi; ++u) m = fmaxf(m, x[u]);
        total += m;
    }
    s.out[b * s.heads + h] = total;
}

// cuBLASLt is opened when SnapKV first runs, not linked: the toolkit ships it as a shared library
// only, and the plugin's package must not depend on what Debian does not have. Without it SnapKV
// fails naming the library; everything else works.
struct Lt {
    decltype(&cublasLtCreate) create = nullptr;
    decltype(&cublasLtMatmulDescCreate) desc_create = nullptr;
    decltype(&cublasLtMatmulDescSetAttribute) desc_set = nullptr;
    decltype(&cublasLtMatmulDescDestroy) desc_destroy = nullptr;
    decltype(&cublasLtMatrixLayoutCreate) layout_create = nullptr;
    decltype(&cublasLtMatrixLayoutSetAttribute) layout_set = nullptr;
    decltype(&cublasLtMatrixLayoutDestroy) layout_destroy = nullptr;
    decltype(&cublasLtMatmul) matmul = nullptr;
    char why[200] = {};
};

const Lt &lt() {
    static Lt l = [] {
        Lt x;
        void *h = dlopen("libcublasLt.so.13", RTLD_NOW | RTLD_LOCAL);
        if (!h) h = dlopen("libcublasLt.so", RTLD_NOW | RTLD_LOCAL);
        if (!h) {
            std::snprintf(x.why, sizeof x.why, "SnapKV on the device needs cuBLASLt: %s", dlerror());
            return x;
        }
        x.create = reinterpret_cast<decltype(x.create)>(dlsym(h, "cublasLtCreate"));
        x.desc_create = reinterpret_cast<decltype(x.desc_create)>(dlsym(h, "cublasLtMatmulDescCreate"));
        x.desc_set = reinterpret_cast<decltype(x.desc_set)>(dlsym(h, "cublasLtMatmulDescSetAttribute"));
        x.desc_destroy = reinterpret_cast<decltype(x.desc_destroy)>(dlsym(h, "cublasLtMatmulDescDestroy"));
        x.layout_create = reinterpret_cast<decltype(x.layout_create)>(dlsym(h, "cublasLtMatrixLayoutCreate"));
        x.layout_set = reinterpret_cast<decltype(x.layout_set)>(dlsym(h, "cublasLtMatrixLayoutSetAttribute"));
        x.layout_destroy = reinterpret_cast<decltype(x.layout_destroy)>(dlsym(h, "cublasLtMatrixLayoutDestroy"));
        x.matmul = reinterpret_cast<decltype(x.matmul)>(dlsym(h, "cublasLtMatmul"));
        if (!x.create || !x.desc_create || !x.desc_set || !x.desc_destroy || !x.layout_create || !x.layout_set ||
            !x.layout_destroy || !x.matmul) {
            std::snprintf(x.why, sizeof x.why, "SnapKV on the device: this cuBLASLt lacks a function it needs");
            x.create = nullptr;
        }
        return x;
    }();
    return l;
}

int blas_failed(cublasStatus_t st, const char *what, char *msg, size_t cap) {
    if (msg && cap) std::snprintf(msg, cap, "%s: cuBLASLt status %d", what, int(st));
    return -int(st ? st : 1);
}

// C_h (GW x T, row-major) = Q_h (GW x D) K_h^T for every KV head h, as cuBLASLt's column-major
// C_cm (T x GW) = K_cm^T (T x D) Q_cm (D x GW), batched over the heads.
int snapkv_gemm(const sg_cuda_snapkv_t &s, const float *q, const float *k, float *c, cudaStream_t stream, char *msg,
                size_t cap) {
    const Lt &L = lt();
    if (!L.create) {
        if (msg && cap) std::snprintf(msg, cap, "%s", L.why);
        return -1;
    }
    static cublasLtHandle_t handle = nullptr;
    static std::mutex mu;
    std::lock_guard lock(mu);
    cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
    if (!handle && (st = L.create(&handle)) != CUBLAS_STATUS_SUCCESS) return blas_failed(st, "cublasLtCreate", msg, cap);
    const uint64_t T = s.tokens, D = s.dim, GW = uint64_t(s.q_heads / s.heads) * s.num_queries;
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    const int32_t batch = int32_t(s.heads);
    const int64_t stride_a = int64_t(T * D), stride_b = int64_t(GW * D), stride_c = int64_t(GW * T);
    const float alpha = 1.0f, beta = 0.0f;
    auto ok = [&](cublasStatus_t x) { return (st = x) == CUBLAS_STATUS_SUCCESS; };
    const bool built =
        ok(L.desc_create(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F)) &&
        ok(L.desc_set(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta)) &&
        ok(L.desc_set(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb)) &&
        ok(L.layout_create(&la, CUDA_R_32F, D, T, D)) &&  // K_cm: D x T, ld D
        ok(L.layout_create(&lb, CUDA_R_32F, D, GW, D)) && // Q_cm: D x GW, ld D
        ok(L.layout_create(&lc, CUDA_R_32F, T, GW, T)) &&
        ok(L.layout_set(la, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof batch)) &&
        ok(L.layout_set(la, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride_a, sizeof stride_a)) &&
        ok(L.layout_set(lb, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof batch)) &&
        ok(L.layout_set(lb, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride_b, sizeof stride_b)) &&
        ok(L.layout_set(lc, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof batch)) &&
        ok(L.layout_set(lc, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride_c, sizeof stride_c));
    if (built)
        st = L.matmul(handle, op, &alpha, k, la, q, lb, &beta, c, lc, c, lc, nullptr, nullptr, 0, stream);
    if (lc) L.layout_destroy(lc);
    if (lb) L.layout_destroy(lb);
    if (la) L.layout_destroy(la);
    if (op) L.desc_destroy(op);
    return st == CUBLAS_STATUS_SUCCESS ? 0 : blas_failed(st, "cublasLtMatmul (SnapKV logits)", msg, cap);
}

int snapkv(const sg_cuda_snapkv_t *s, void *stream, char *msg, size_t cap) {
    if (!s->tokens || !s->heads || !s->num_queries) return 0;
    if (s->q_heads % s->heads || s->pool % 2 == 0 || !s->tokens_per_block) {
        if (msg && cap) std::snprintf(msg, cap, "snapkv: q_heads not a multiple of heads, an even pool or no tokens_per_block");
        return -1;
    }
    auto *st = static_cast<cudaStream_t>(stream);
    const uint64_t T = s->tokens, keys_n = uint64_t(s->heads) * T * s->dim;
    const uint64_t q_n = uint64_t(s->num_queries) * s->q_heads * s->dim;
    const uint64_t logits_n = uint64_t(s->q_heads) * s->num_queries * T;
    float *keys = nullptr, *q = nullptr, *logits = nullptr, *tokens = nullptr;
    cudaError_t e = cudaMallocAsync(&keys, keys_n * sizeof(float), st);
    if (e == cudaSuccess) e = cudaMallocAsync(&q, q_n * sizeof(float), st);
    if (e == cudaSuccess) e = cudaMallocAsync(&logits, logits_n * sizeof(float), st);
    if (e == cudaSuccess) e = cudaMallocAsync(&tokens, uint64_t(s->heads) * T * sizeof(float), st);
    int rc = 0;
    if (e == cudaSuccess) {
        snapkv_keys_kernel<<<unsigned((keys_n + kThreads - 1) / kThreads), kThreads, 0, st>>>(*s, keys);
        snapkv_queries_kernel<<<unsigned((q_n + kThreads - 1) / kThreads), kThreads, 0, st>>>(*s, q);
        e = cudaGetLastError();
    }
    if (e == cudaSuccess) rc = snapkv_gemm(*s, q, keys, logits, st, msg, cap);
    if (e == cudaSuccess && rc == 0) {
        snapkv_softmax_kernel<<<unsigned(uint64_t(s->q_heads) * s->num_queries), kThreads, 0, st>>>(*s, logits);
        const uint64_t nt = uint64_t(s->heads) * T, nb = s->num_blocks * s->heads;
        snapkv_tokens_kernel<<<unsigned((nt + kThreads - 1) / kThreads), kThreads, 0, st>>>(*s, logits, tokens);
        snapkv_blocks_kernel<<<unsigned((nb + kThreads - 1) / kThreads), kThreads, 0, st>>>(*s, tokens);
        e = cudaGetLastError();
    }
    for (float *p : {keys, q, logits, tokens})
        if (p) cudaFreeAsync(p, st);
    if (rc) return rc;
    return e == cudaSuccess ? 0 : fail_with(e, "snapkv", msg, cap);
}

// ---- the staged path's device side ----

// One piece of a batched copy as the kernel reads it: where it is on the device, its bytes, and
// where it sits in the packed buffer.
struct Segment {
    uint64_t addr, bytes, offset;
};

// One CUDA block per piece; its threads stride over the piece in 16-byte units when both sides are
// 16-byte aligned (the common case: whole rows of a block), else byte by byte.
template <bool Gather>
__global__ void batch_copy_kernel(const Segment *segments, uint8_t *packed) {
    const Segment s = segments[blockIdx.x];
    uint8_t *dev = reinterpret_cast<uint8_t *>(s.addr);
    uint8_t *buf = packed + s.offset;
    uint8_t *dst = Gather ? buf : dev;
    const uint8_t *src = Gather ? dev : buf;
    if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | s.bytes) & 15u) == 0) {
        for (uint64_t i = threadIdx.x; i < s.bytes / 16; i += blockDim.x)
            reinterpret_cast<uint4 *>(dst)[i] = reinterpret_cast<const uint4 *>(src)[i];
    } else {
        for (uint64_t i = threadIdx.x; i < s.bytes; i += blockDim.x) dst[i] = src[i];
    }
}

// Grows a device buffer of the plugin's (the old contents are dropped).
template <class T> int ensure_capacity(T *&buf, size_t &cap, size_t count, const char *what, char *msg, size_t msg_cap) {
    if (count <= cap) return 0;
    cudaFree(buf);
    buf = nullptr;
    cap = 0;
    if (const cudaError_t e = cudaMalloc(&buf, count * sizeof(T)); e != cudaSuccess) return fail_with(e, what, msg, msg_cap);
    cap = count;
    return 0;
}

// Per device: the plugin's own stream (the engine's streams are never used for this), a device
// buffer the pieces are packed into, and the segment table; one staged copy at a time per device.
struct DeviceState {
    std::mutex mu;
    cudaStream_t stream = nullptr;
    uint8_t *packed = nullptr;
    size_t packed_bytes = 0;
    Segment *segments = nullptr;
    size_t segments_cap = 0;
    std::vector<Segment> host_segments;
    uint32_t *blocks = nullptr;  // digest_to_host's block list and digests
    size_t blocks_cap = 0;
    float *digests = nullptr;
    size_t digests_cap = 0;
};

constexpr int kMaxDevices = 64;

DeviceState &device_state(int32_t device) {
    static DeviceState states[kMaxDevices];
    return states[device];
}

// The device's state, locked, with the device current and the plugin's stream on it made; null with
// rc and msg set when the device cannot be used.
DeviceState *use_device(int32_t device, std::unique_lock<std::mutex> &lock, int &rc, char *msg, size_t cap) {
    if (device < 0 || device >= kMaxDevices) {
        if (msg && cap) std::snprintf(msg, cap, "device %d is out of the plugin's range", int(device));
        rc = -1;
        return nullptr;
    }
    DeviceState &st = device_state(device);
    lock = std::unique_lock<std::mutex>(st.mu);
    cudaError_t e = cudaSetDevice(device);
    if (e == cudaSuccess && !st.stream) e = cudaStreamCreateWithFlags(&st.stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        rc = fail_with(e, st.stream ? "cudaSetDevice" : "cudaSetDevice / cudaStreamCreateWithFlags", msg, cap);
        return nullptr;
    }
    return &st;
}

template <bool Gather>
int stage(int32_t device, const sg_cuda_piece_t *pieces, uint64_t count, void *host, char *msg, size_t cap) {
    if (!count) return 0;
    std::unique_lock<std::mutex> lock;
    int rc = 0;
    DeviceState *state = use_device(device, lock, rc, msg, cap);
    if (!state) return rc;
    DeviceState &st = *state;
    cudaError_t e;
    st.host_segments.resize(count);
    uint64_t total = 0;
    for (uint64_t i = 0; i < count; ++i) {
        st.host_segments[i] = {pieces[i].device_addr, pieces[i].bytes, total};
        total += pieces[i].bytes;
    }
    if (total > st.packed_bytes) {
        cudaFree(st.packed);
        st.packed = nullptr;
        st.packed_bytes = 0;
        if ((e = cudaMalloc(&st.packed, total)) != cudaSuccess) return fail_with(e, "cudaMalloc (staging)", msg, cap);
        st.packed_bytes = total;
    }
    if (const int rc = ensure_capacity(st.segments, st.segments_cap, count, "cudaMalloc (segments)", msg, cap)) return rc;
    if ((e = cudaMemcpyAsync(st.segments, st.host_segments.data(), count * sizeof(Segment), cudaMemcpyHostToDevice,
                             st.stream)) != cudaSuccess)
        return fail_with(e, "cudaMemcpyAsync (segments)", msg, cap);
    if (!Gather && (e = cudaMemcpyAsync(st.packed, host, total, cudaMemcpyHostToDevice, st.stream)) != cudaSuccess)
        return fail_with(e, "cudaMemcpyAsync (to the device)", msg, cap);
    batch_copy_kernel<Gather><<<unsigned(count), kThreads, 0, st.stream>>>(st.segments, st.packed);
    if (const int rc = launched(Gather ? "gather kernel" : "scatter kernel", msg, cap)) return rc;
    if (Gather && (e = cudaMemcpyAsync(host, st.packed, total, cudaMemcpyDeviceToHost, st.stream)) != cudaSuccess)
        return fail_with(e, "cudaMemcpyAsync (to the host)", msg, cap);
    if ((e = cudaStreamSynchronize(st.stream)) != cudaSuccess) return fail_with(e, "cudaStreamSynchronize", msg, cap);
    return 0;
}

int stage_out(int32_t device, const sg_cuda_piece_t *pieces, uint64_t count, void *host, char *msg, size_t cap) {
    return stage<true>(device, pieces, count, host, msg, cap);
}

int stage_in(int32_t device, const sg_cuda_piece_t *pieces, uint64_t count, const void *host, char *msg, size_t cap) {
    return stage<false>(device, pieces, count, const_cast<void *>(host), msg, cap);
}

int digest_to_host(int32_t device, const sg_cuda_digest_t *d, char *msg, size_t cap) {
    if (!d->num_blocks) return 0;
    std::unique_lock<std::mutex> lock;
    int rc = 0;
    DeviceState *state = use_device(device, lock, rc, msg, cap);
    if (!state) return rc;
    DeviceState &st = *state;
    cudaError_t e;
    const size_t floats = size_t(d->num_blocks) * d->heads * 2 * d->dim;
    if (const int rc = ensure_capacity(st.blocks, st.blocks_cap, d->num_blocks, "cudaMalloc (block list)", msg, cap))
        return rc;
    if (const int rc = ensure_capacity(st.digests, st.digests_cap, floats, "cudaMalloc (digests)", msg, cap)) return rc;
    if ((e = cudaMemcpyAsync(st.blocks, d->blocks, d->num_blocks * sizeof(uint32_t), cudaMemcpyHostToDevice,
                             st.stream)) != cudaSuccess)
        return fail_with(e, "cudaMemcpyAsync (block list)", msg, cap);
    sg_cuda_digest_t on_device = *d;
    on_device.blocks = st.blocks;
    on_device.out = st.digests;
    if (const int rc = digest(&on_device, st.stream, msg, cap)) return rc;
    if ((e = cudaMemcpyAsync(d->out, st.digests, floats * sizeof(float), cudaMemcpyDeviceToHost, st.stream)) !=
        cudaSuccess)
        return fail_with(e, "cudaMemcpyAsync (digests)", msg, cap);
    if ((e = cudaStreamSynchronize(st.stream)) != cudaSuccess) return fail_with(e, "cudaStreamSynchronize", msg, cap);
    return 0;
}

int device_of(const void *ptr, int32_t *device, char *msg, size_t cap) {
    cudaPointerAttributes a{};
    const cudaError_t e = cudaPointerGetAttributes(&a, ptr);
    if (e != cudaSuccess) return fail_with(e, "cudaPointerGetAttributes", msg, cap);
    if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged) {
        if (msg && cap) std::snprintf(msg, cap, "%p is not device memory of any CUDA device", ptr);
        return -1;
    }
    *device = a.device;
    return 0;
}

int event_record(int32_t device, void *stream, void **event, char *msg, size_t cap) {
    cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess) return fail_with(e, "cudaSetDevice", msg, cap);
    cudaEvent_t ev = nullptr;
    if ((e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming)) != cudaSuccess)
        return fail_with(e, "cudaEventCreateWithFlags", msg, cap);
    if ((e = cudaEventRecord(ev, static_cast<cudaStream_t>(stream))) != cudaSuccess) {
        cudaEventDestroy(ev);
        return fail_with(e, "cudaEventRecord", msg, cap);
    }
    *event = ev;
    return 0;
}

int event_query(void *event, char *msg, size_t cap) {
    const cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(event));
    if (e == cudaSuccess) return 0;
    if (e == cudaErrorNotReady) {
        (void)cudaGetLastError();  // not an error: clear it
        return 1;
    }
    return fail_with(e, "cudaEventQuery", msg, cap);
}

void event_destroy(void *event) { cudaEventDestroy(static_cast<cudaEvent_t>(event)); }

const sg_cuda_plugin_t kPlugin = {sizeof(sg_cuda_plugin_t), SG_CUDA_PLUGIN_ABI, 0, device_count, pack<true>,
                                  pack<false>, digest, quant<true>, quant<false>, quest,
                                  device_of, stage_out, stage_in, event_record, event_query, event_destroy, topk,
                                  snapkv, digest_to_host};

}  // namespace

extern "C" __attribute__((visibility("default"))) const sg_cuda_plugin_t *sg_cuda_plugin_v1(void) { return &kPlugin; }
