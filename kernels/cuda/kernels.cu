// The CUDA plugin, libsmartgen-cuda.so.0: gather and scatter of a layer's listed blocks between the
// paged regions and a packed staging buffer (the staged path), page digests, Quest scores, and in-flight
// quantization (int8 / fp8 E4M3 codes with a scale per block and KV head) on the device. Each
// thread's work is the shared per-element code of elements.hpp, which the host harness checks
// against the CPU twins on machines without a GPU. libsmartgen loads this library with dlopen the
// first time a CUDA pool is used (runtime/core/cuda_plugin.cpp); nothing else links it.
#include <cuda_runtime.h>

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
};

constexpr int kMaxDevices = 64;

DeviceState &device_state(int32_t device) {
    static DeviceState states[kMaxDevices];
    return states[device];
}

template <bool Gather>
int stage(int32_t device, const sg_cuda_piece_t *pieces, uint64_t count, void *host, char *msg, size_t cap) {
    if (device < 0 || device >= kMaxDevices) {
        if (msg && cap) std::snprintf(msg, cap, "device %d is out of the plugin's range", int(device));
        return -1;
    }
    if (!count) return 0;
    DeviceState &st = device_state(device);
    std::lock_guard lock(st.mu);
    cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess) return fail_with(e, "cudaSetDevice", msg, cap);
    if (!st.stream && (e = cudaStreamCreateWithFlags(&st.stream, cudaStreamNonBlocking)) != cudaSuccess)
        return fail_with(e, "cudaStreamCreateWithFlags", msg, cap);
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
    if (count > st.segments_cap) {
        cudaFree(st.segments);
        st.segments = nullptr;
        st.segments_cap = 0;
        if ((e = cudaMalloc(&st.segments, count * sizeof(Segment))) != cudaSuccess)
            return fail_with(e, "cudaMalloc (segments)", msg, cap);
        st.segments_cap = count;
    }
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
                                  device_of, stage_out, stage_in, event_record, event_query, event_destroy};

}  // namespace

extern "C" __attribute__((visibility("default"))) const sg_cuda_plugin_t *sg_cuda_plugin_v1(void) { return &kPlugin; }
