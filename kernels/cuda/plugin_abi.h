/* The interface between libsmartgen and its CUDA plugin, libsmartgen-cuda.so.0 (kernels/cuda). The
 * host library links no CUDA library: it dlopens the plugin the first time a CUDA pool is used and
 * looks up sg_cuda_plugin_v1, which returns this table. Plain C, so the two sides agree whatever
 * compiled them; the table only grows (struct_size), and abi changes when a signature does.
 * Functions return 0 on success, else a negative value with the CUDA error's text in msg. */
#ifndef SMARTGEN_CUDA_PLUGIN_ABI_H
#define SMARTGEN_CUDA_PLUGIN_ABI_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SG_CUDA_PLUGIN_ABI 2

/* A gather (regions -> packed) or scatter (packed -> regions) of a layer's listed blocks. Device
 * pointers; k_region and v_region are the layer's regions (v_region NULL when K and V are fused). */
typedef struct sg_cuda_pack {
    const uint32_t *blocks; /* device array of num_blocks physical block ids */
    uint64_t num_blocks;
    uint64_t plane_bytes;
    uint64_t block_stride;
    uint32_t fused;
    uint32_t reserved;
    void *k_region;
    void *v_region;
    void *packed; /* num_blocks * 2 * plane_bytes bytes */
} sg_cuda_pack_t;

/* Page digests of one block table: for each listed block, per KV head, the min row then the max row
 * of its keys (as kernels::page_digest). Device pointers. */
typedef struct sg_cuda_digest {
    const void *keys;       /* the layer's K region */
    const uint32_t *blocks; /* device array */
    uint64_t num_blocks;
    uint64_t tokens;        /* valid tokens of the request (the last block may be partial) */
    uint64_t block_stride;  /* bytes */
    uint32_t dtype;         /* 0 fp32, 1 fp16, 2 bf16 (kernels::DType) */
    uint32_t heads;
    uint32_t dim;
    uint32_t tokens_per_block;
    uint32_t head_major; /* 0: [token][head][dim] blocks, 1: [head][token][dim] */
    uint32_t reserved;
    float *out; /* num_blocks * heads * 2 * dim floats */
} sg_cuda_digest_t;

/* In-flight quantization of one plane (K or V) of a layer's listed blocks: per block and KV head a
 * scale, per element a one-byte code (kernels::quantize_block). codes: num_blocks * tokens_per_block
 * * heads * dim bytes, block i's codes at i times that, laid out as the block's elements; scales:
 * num_blocks * heads floats. Dequantization writes region's listed blocks back in its dtype. */
typedef struct sg_cuda_quant {
    void *region;           /* the layer's plane region: read by quantize, written by dequantize */
    const uint32_t *blocks; /* device array */
    uint64_t num_blocks;
    uint64_t tokens;        /* valid tokens of the request (the last block may be partial) */
    uint64_t block_stride;  /* bytes */
    uint32_t dtype;         /* 0 fp32, 1 fp16, 2 bf16 */
    uint32_t heads;
    uint32_t dim;
    uint32_t tokens_per_block;
    uint32_t head_major;
    uint32_t code; /* 0 int8, 1 fp8 E4M3 (kernels::QuantCode) */
    uint8_t *codes;
    float *scales;
} sg_cuda_quant_t;

/* Quest scores of a layer: out[block][kv_head] from its digests (as sg_cuda_digest_t writes them) and
 * the step's query row (kernels::quest_scores). Device pointers. */
typedef struct sg_cuda_quest {
    const float *digest;
    uint64_t num_blocks;
    const void *query; /* [q_head][dim], dtype below */
    uint32_t dtype;
    uint32_t q_heads;
    uint32_t kv_heads;
    uint32_t dim;
    uint32_t combine; /* 0 max, 1 sum (kernels::Combine) */
    uint32_t reserved;
    float *out;
} sg_cuda_quest_t;

/* Top-k of each row of a layer's scores (Quest's or SnapKV's, [block][row], rows = KV heads): the k
 * best block indices per row, best first, in kernels::top_k's order (higher score, NaN as -inf,
 * ties to the lower index). Device pointers. */
typedef struct sg_cuda_topk {
    const float *scores; /* [num_blocks][rows] */
    uint64_t num_blocks;
    uint32_t rows;
    uint32_t k;          /* 1 <= k <= num_blocks */
    uint32_t *out;       /* [rows][k] */
} sg_cuda_topk_t;

/* SnapKV's block scores of one layer (kernels::snapkv_scores): the window queries' causal softmax
 * attention over the request's keys, summed over the window, the query heads of a KV head combined,
 * max-pooled over `pool` tokens and summed per block. The keys are read through the block table
 * (paged, as sg_cuda_digest_t); the q.k products run as one batched GEMM per layer through
 * cuBLASLt. Device pointers. */
typedef struct sg_cuda_snapkv {
    const void *keys;       /* the layer's K region */
    const uint32_t *blocks; /* device array */
    uint64_t num_blocks;
    uint64_t tokens;        /* valid tokens of the request */
    uint64_t block_stride;  /* bytes */
    uint32_t dtype;         /* keys: 0 fp32, 1 fp16, 2 bf16 */
    uint32_t heads;         /* KV heads */
    uint32_t dim;
    uint32_t tokens_per_block;
    uint32_t head_major;
    uint32_t q_heads;       /* a multiple of heads */
    const float *queries;   /* fp32 [num_queries][q_heads][dim], after RoPE */
    uint32_t num_queries;
    uint32_t combine;       /* 0 max, 1 sum */
    uint64_t first_query_pos; /* position of query 0 (causal: query w sees keys 0..first + w) */
    uint32_t pool;          /* odd; 1 = none */
    uint32_t reserved;
    float *out;             /* [num_blocks][heads] */
} sg_cuda_snapkv_t;

/* A piece of device memory for the staged path: device address and bytes. */
typedef struct sg_cuda_piece {
    uint64_t device_addr;
    uint64_t bytes;
} sg_cuda_piece_t;

typedef struct sg_cuda_plugin {
    size_t struct_size;
    uint32_t abi; /* SG_CUDA_PLUGIN_ABI */
    uint32_t reserved;
    /* CUDA devices visible, or a negative value with the reason (no driver, driver too old, ...). */
    int (*device_count)(char *msg, size_t cap);
    /* Queued on stream (a cudaStream_t; NULL: the legacy default stream); they do not wait. */
    int (*gather)(const sg_cuda_pack_t *pack, void *stream, char *msg, size_t cap);
    int (*scatter)(const sg_cuda_pack_t *pack, void *stream, char *msg, size_t cap);
    int (*digest)(const sg_cuda_digest_t *digest, void *stream, char *msg, size_t cap);
    int (*quantize)(const sg_cuda_quant_t *quant, void *stream, char *msg, size_t cap);
    int (*dequantize)(const sg_cuda_quant_t *quant, void *stream, char *msg, size_t cap);
    int (*quest)(const sg_cuda_quest_t *quest, void *stream, char *msg, size_t cap);
    /* Since interface 2: the staged path's device side. Each call is synchronous: when it returns,
     * the bytes are where they go, and it ran on the plugin's own stream of that device (never the
     * engine's). */
    /* The device holding `ptr`: 0 with *device set, or negative when ptr is not device memory. */
    int (*device_of)(const void *ptr, int32_t *device, char *msg, size_t cap);
    /* Gathers the pieces (host array, device addresses on `device`), back to back, into host (any
     * host memory; pinned is faster): one batched copy kernel into a device buffer, one copy out. */
    int (*stage_out)(int32_t device, const sg_cuda_piece_t *pieces, uint64_t count, void *host, char *msg,
                     size_t cap);
    /* The reverse: host's bytes, back to back, into the pieces. */
    int (*stage_in)(int32_t device, const sg_cuda_piece_t *pieces, uint64_t count, const void *host, char *msg,
                    size_t cap);
    /* An event recorded on the engine's stream (a cudaStream_t): *event receives it. */
    int (*event_record)(int32_t device, void *stream, void **event, char *msg, size_t cap);
    /* 0 the work before the event has finished, 1 not yet, negative an error. */
    int (*event_query)(void *event, char *msg, size_t cap);
    void (*event_destroy)(void *event);
    /* Queued on stream; allocates its scratch on the stream (stream-ordered). */
    int (*topk)(const sg_cuda_topk_t *topk, void *stream, char *msg, size_t cap);
    /* Queued on stream; allocates its scratch on the stream. */
    int (*snapkv)(const sg_cuda_snapkv_t *snapkv, void *stream, char *msg, size_t cap);
    /* Grown within interface 2 (present when struct_size covers it): page digests into host memory,
     * synchronous, on the plugin's own stream of `device`. Here digest->blocks and digest->out are
     * HOST arrays (the plugin copies the block list in and the digests out); keys is the device
     * region. So a selection reads num_blocks * heads * 2 * dim floats off the device, not the keys. */
    int (*digest_to_host)(int32_t device, const sg_cuda_digest_t *digest, char *msg, size_t cap);
} sg_cuda_plugin_t;

/* The one symbol the plugin exports. */
const sg_cuda_plugin_t *sg_cuda_plugin_v1(void);

#ifdef __cplusplus
}
#endif

#endif
