//! The pool, block tables and byte pattern of docs/bindings.md.
//!
//! The byte at offset o of a plane is (base + 7 o) mod 256, base = (l*131 + p*71 + i*29 + r*13) mod
//! 256. 7 is odd, so with k = base * 7^-1 mod 256 (7^-1 = 183) that is 7 (o + k) mod 256 = ramp[o + k]:
//! every plane is a slice of one precomputed ramp, written with a copy and checked with a compare.

use std::alloc::{alloc_zeroed, dealloc, Layout};

use smartgen::{BlockOrder, Dtype, Plane, Pool, PoolLayout, RawMemory};

use crate::args::{Config, BLOCK_TOKENS, DECODE_OFFSET, DECODE_STRIDE, PREFILL_OFFSET, PREFILL_STRIDE};
use crate::failure::Failure;

pub const KV_HEADS: u32 = 8;
pub const HEAD_DIM: u32 = 128;
/// fp16: 16 tokens × 8 heads × 128 × 2 bytes = 32,768 bytes per K or V plane.
pub const PLANE_BYTES: usize = (BLOCK_TOKENS * KV_HEADS * HEAD_DIM * 2) as usize;
const INV7_MOD_256: usize = 183;

pub const REQUEST_IDS: [&str; 2] = ["interop-full", "interop-selective"];
pub const REQ_FULL: usize = 0;
pub const REQ_SELECTIVE: usize = 1;

pub fn pool_layout(cfg: &Config) -> PoolLayout {
    PoolLayout {
        num_layers: cfg.layers,
        num_kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
        tokens_per_block: BLOCK_TOKENS,
        num_blocks: u64::from(cfg.blocks),
        dtype: Dtype::FP16,
        block_order: BlockOrder::TOKEN_MAJOR,
    }
}

/// The pool's memory, allocated by this program as a serving engine owns its KV cache (one K and
/// one V region per layer, page-aligned) and freed on drop. It must outlive the `KvHandle` that
/// registers a pool over it and every transfer made with that.
pub struct HostMemory {
    regions: Vec<*mut u8>,
    layout: Layout,
}

impl HostMemory {
    pub fn new(cfg: &Config) -> Result<HostMemory, Failure> {
        let bytes = PLANE_BYTES * cfg.blocks as usize;
        let layout = Layout::from_size_align(bytes, 4096)
            .map_err(|e| Failure::new("SG_ERR_INVALID_ARGUMENT", format!("a {bytes}-byte region: {e}")))?;
        let mut memory = HostMemory { regions: Vec::new(), layout };
        for _ in 0..2 * cfg.layers {
            // SAFETY: the layout's size is non-zero (blocks >= 1 and PLANE_BYTES > 0).
            let p = unsafe { alloc_zeroed(layout) };
            if p.is_null() {
                return Err(Failure::new("SG_ERR_NO_MEMORY", format!("allocating a {bytes}-byte region")));
            }
            memory.regions.push(p);
        }
        Ok(memory)
    }

    /// A pool over this memory: K of layer l is region 2l, V region 2l + 1.
    pub fn pool(&self, cfg: &Config) -> smartgen::Result<Pool> {
        let k = self.regions.iter().step_by(2).copied().collect();
        let v = self.regions.iter().skip(1).step_by(2).copied().collect();
        // SAFETY: each region is PLANE_BYTES × blocks = region_bytes() long, touched only through
        // the pool, and freed only when `self` drops, which run() orders after the KvHandle.
        unsafe { Pool::from_raw(pool_layout(cfg), RawMemory::new(k, v)) }
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        for &p in &self.regions {
            // SAFETY: allocated in new() with this layout, freed once.
            unsafe { dealloc(p, self.layout) };
        }
    }
}

/// This side's block table.
pub fn table(cfg: &Config) -> Vec<u32> {
    let (stride, offset) = if cfg.prefill {
        (PREFILL_STRIDE, PREFILL_OFFSET)
    } else {
        (DECODE_STRIDE, DECODE_OFFSET)
    };
    (0..u64::from(cfg.n()))
        .map(|i| ((i * u64::from(stride) + u64::from(offset)) % u64::from(cfg.blocks)) as u32)
        .collect()
}

/// Payload bytes of one request: every plane of every logical block of every layer.
pub fn request_bytes(cfg: &Config) -> u64 {
    u64::from(cfg.layers) * 2 * u64::from(cfg.n()) * PLANE_BYTES as u64
}

pub struct Pattern {
    ramp: Vec<u8>,
}

const PLANES: [Plane; 2] = [Plane::K, Plane::V];

impl Pattern {
    pub fn new() -> Pattern {
        Pattern {
            ramp: (0..PLANE_BYTES + 256).map(|j| (j * 7) as u8).collect(),
        }
    }

    fn plane(&self, layer: u32, plane: Plane, logical: usize, request: usize) -> &[u8] {
        let base = (layer as usize * 131 + plane as usize * 71 + logical * 29 + request * 13) & 0xFF;
        let k = (base * INV7_MOD_256) & 0xFF;
        &self.ramp[k..k + PLANE_BYTES]
    }

    pub fn fill(&self, pool: &mut Pool, table: &[u32], request: usize) {
        for layer in 0..pool.layout().num_layers {
            for plane in PLANES {
                for (i, &block) in table.iter().enumerate() {
                    pool.block_mut(layer, plane, block)
                        .copy_from_slice(self.plane(layer, plane, i, request));
                }
            }
        }
    }

    pub fn clear(pool: &mut Pool, table: &[u32]) {
        for layer in 0..pool.layout().num_layers {
            for plane in PLANES {
                for &block in table {
                    pool.block_mut(layer, plane, block).fill(0);
                }
            }
        }
    }

    /// Checks every byte of every logical block; the first difference is the failure.
    pub fn verify(&self, pool: &Pool, table: &[u32], request: usize) -> Result<(), Failure> {
        for layer in 0..pool.layout().num_layers {
            for plane in PLANES {
                for (i, &block) in table.iter().enumerate() {
                    let got = pool.block(layer, plane, block);
                    let want = self.plane(layer, plane, i, request);
                    if got == want {
                        continue;
                    }
                    let o = got.iter().zip(want).position(|(g, w)| g != w).unwrap_or(0);
                    return Err(Failure::new(
                        "MISMATCH",
                        format!(
                            "{}: layer {} {} logical block {} (physical {}) offset {}: got 0x{:02x}, want 0x{:02x}",
                            REQUEST_IDS[request],
                            layer,
                            if plane == Plane::K { "K" } else { "V" },
                            i,
                            block,
                            o,
                            got[o],
                            want[o]
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}
