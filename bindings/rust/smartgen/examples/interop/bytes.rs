//! The pool, block tables and byte pattern of docs/bindings.md.
//!
//! The byte at offset o of a plane is (base + 7 o) mod 256, base = (l*131 + p*71 + i*29 + r*13) mod
//! 256. 7 is odd, so with k = base * 7^-1 mod 256 (7^-1 = 183) that is 7 (o + k) mod 256 = ramp[o + k]:
//! every plane is a slice of one precomputed ramp, written with a copy and checked with a compare.

use smartgen::{BlockOrder, Dtype, Plane, Pool, PoolLayout};

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
