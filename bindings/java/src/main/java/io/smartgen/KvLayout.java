package io.smartgen;

import io.smartgen.internal.sg_block_order;
import io.smartgen.internal.sg_dtype;
import io.smartgen.internal.sg_kv_layout_t;
import io.smartgen.internal.sg_kv_packing;
import io.smartgen.internal.smartgen;

/**
 * The shape of a paged KV pool in host memory (the memory itself is the {@link Pool}'s). Values are
 * taken as written, 0 included: the library checks them when the pool is registered and names the
 * field it refuses (SG_ERR_INVALID_LAYOUT). Immutable; the with* methods return a copy.
 */
public final class KvLayout {
    public static final int FP32 = sg_dtype.SG_DTYPE_FP32;
    public static final int FP16 = sg_dtype.SG_DTYPE_FP16;
    public static final int BF16 = sg_dtype.SG_DTYPE_BF16;
    public static final int FP8_E4M3 = sg_dtype.SG_DTYPE_FP8_E4M3;
    /** K in one region per layer, V in another, same block ids. */
    public static final int SEPARATE = sg_kv_packing.SG_KV_SEPARATE;
    /** One region per layer: each block holds its K plane then its V plane. */
    public static final int FUSED = sg_kv_packing.SG_KV_FUSED;
    /** [token][kv_head][head_dim] inside a plane. */
    public static final int TOKEN_MAJOR = sg_block_order.SG_BLOCK_TOKEN_MAJOR;
    /** [kv_head][token][head_dim] inside a plane. */
    public static final int HEAD_MAJOR = sg_block_order.SG_BLOCK_HEAD_MAJOR;

    private final int numLayers;
    private final int numKvHeads;
    private final int headDim;
    private final int tokensPerBlock;
    private final long numBlocks;
    private final int dtype;
    private final int packing;
    private final int blockOrder;
    private final long blockStrideBytes;

    private KvLayout(int numLayers, int numKvHeads, int headDim, int tokensPerBlock, long numBlocks, int dtype,
                     int packing, int blockOrder, long blockStrideBytes) {
        this.numLayers = numLayers;
        this.numKvHeads = numKvHeads;
        this.headDim = headDim;
        this.tokensPerBlock = tokensPerBlock;
        this.numBlocks = numBlocks;
        this.dtype = dtype;
        this.packing = packing;
        this.blockOrder = blockOrder;
        this.blockStrideBytes = blockStrideBytes;
    }

    /**
     * fp16, K and V separate, token-major, packed: what C's {@code sg_kv_layout_init} fills. (A
     * zeroed C layout, like Go's zero {@code Layout}, is fp32: the dtype value 0. Say the dtype with
     * {@link #withDtype} when it matters.)
     */
    public static KvLayout of(int numLayers, int numKvHeads, int headDim, int tokensPerBlock, long numBlocks) {
        return new KvLayout(numLayers, numKvHeads, headDim, tokensPerBlock, numBlocks, FP16, SEPARATE, TOKEN_MAJOR, 0);
    }

    public KvLayout withDtype(int dtype) {
        return new KvLayout(numLayers, numKvHeads, headDim, tokensPerBlock, numBlocks, dtype, packing, blockOrder,
                blockStrideBytes);
    }

    public KvLayout withPacking(int packing) {
        return new KvLayout(numLayers, numKvHeads, headDim, tokensPerBlock, numBlocks, dtype, packing, blockOrder,
                blockStrideBytes);
    }

    public KvLayout withBlockOrder(int blockOrder) {
        return new KvLayout(numLayers, numKvHeads, headDim, tokensPerBlock, numBlocks, dtype, packing, blockOrder,
                blockStrideBytes);
    }

    /** Bytes from one block to the next within a layer; 0 = packed. */
    public KvLayout withBlockStrideBytes(long blockStrideBytes) {
        return new KvLayout(numLayers, numKvHeads, headDim, tokensPerBlock, numBlocks, dtype, packing, blockOrder,
                blockStrideBytes);
    }

    public int numLayers() {
        return numLayers;
    }

    public int numKvHeads() {
        return numKvHeads;
    }

    public int headDim() {
        return headDim;
    }

    public int tokensPerBlock() {
        return tokensPerBlock;
    }

    public long numBlocks() {
        return numBlocks;
    }

    public int dtype() {
        return dtype;
    }

    public int packing() {
        return packing;
    }

    public int blockOrder() {
        return blockOrder;
    }

    public long blockStrideBytes() {
        return blockStrideBytes;
    }

    /** Bytes of one K (or V) plane of one block; 0 for a shape the library will refuse. */
    public long planeBytes() {
        try {
            long element = smartgen.sg_dtype_size(dtype);
            return Math.multiplyExact(Math.multiplyExact((long) tokensPerBlock, (long) numKvHeads),
                    Math.multiplyExact((long) headDim, element));
        } catch (ArithmeticException e) {
            return 0;
        }
    }

    /** Bytes from one block to the next: the stride, or the block's own size when packed. */
    public long blockBytes() {
        if (blockStrideBytes != 0) {
            return blockStrideBytes;
        }
        long plane = planeBytes();
        return packing == FUSED ? 2 * plane : plane;
    }

    /** Bytes of one layer's region (K, V, or fused K+V); 0 for a shape the library will refuse. */
    public long regionBytes() {
        try {
            return Math.multiplyExact(numBlocks, blockBytes());
        } catch (ArithmeticException e) {
            return 0;
        }
    }

    sg_kv_layout_t toNative() {
        sg_kv_layout_t l = new sg_kv_layout_t();
        smartgen.sg_kv_layout_init(l);
        l.setNum_layers(numLayers);
        l.setNum_kv_heads(numKvHeads);
        l.setHead_dim(headDim);
        l.setTokens_per_block(tokensPerBlock);
        l.setNum_blocks(numBlocks);
        l.setDtype(dtype);
        l.setPacking(packing);
        l.setBlock_order(blockOrder);
        l.setBlock_stride_bytes(blockStrideBytes);
        return l;
    }
}
