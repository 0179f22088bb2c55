//! A pool over memory the host owns (a serving engine's KV cache): fused K+V with a padded block
//! stride, registered from raw addresses. A transfer lands in it byte for byte, the padding stays
//! as the engine left it, and dropping the handle leaves the memory to its owner.

mod common;

use std::alloc::{alloc, dealloc, Layout};

use common::*;
use smartgen::{Context, KvHandle, Packing, Plane, Pool, RawMemory, Status, TransferFlags, TransferOptions};

const BLOCKS: [u32; 3] = [3, 17, 8];

#[test]
fn a_pool_over_engine_owned_fused_padded_memory() {
    let key = random_key();
    let prefill_ctx = Context::new(&options(&key)).unwrap();
    let decode_ctx = Context::new(&options(&key)).unwrap();
    let (prefill, decode) = connect(&prefill_ctx, &decode_ctx);
    let mut src = register(&prefill_ctx, SMALL);
    fill(&mut src, &BLOCKS);

    // The engine's allocation: one fused region per layer, each block K, V, then 128 bytes of pad.
    let plane = SMALL.plane_bytes().unwrap() as usize;
    let stride = 2 * plane + 128;
    let region = stride * SMALL.num_blocks as usize;
    let engine_layout = Layout::from_size_align(region, 4096).unwrap();
    let regions: Vec<*mut u8> = (0..SMALL.num_layers)
        .map(|_| unsafe {
            let p = alloc(engine_layout);
            assert!(!p.is_null());
            std::ptr::write_bytes(p, 0xEE, region);
            p
        })
        .collect();
    let raw = RawMemory::fused(regions.clone()).with_block_stride(stride as u64);
    // SAFETY: each region is `region` bytes, freed below only after the handle is dropped.
    let pool = unsafe { Pool::from_raw(SMALL, raw) }.unwrap();
    assert_eq!(pool.packing(), Packing::Fused);
    assert_eq!(pool.region_bytes(), region);
    let dst = KvHandle::register(&decode_ctx, pool).expect("register the engine's memory");
    prefill.export_kv(&src).unwrap();
    decode.export_kv(&dst).unwrap();

    let expected = decode
        .expect("engine-memory", &dst, &BLOCKS, 48, &TransferOptions::default())
        .unwrap();
    let all = TransferOptions::default().with_flags(TransferFlags::ALL_LAYERS_WRITTEN);
    let posted = prefill.post("engine-memory", &src, &BLOCKS, 48, &all).unwrap();
    expected.wait(TIMEOUT).unwrap();
    posted.wait(TIMEOUT).unwrap();
    drop(expected);
    drop(posted);
    // The views follow the fused, padded layout: every byte as fill wrote it, padding untouched.
    assert_eq!(mismatches(&dst, &BLOCKS), 0);
    for layer in 0..SMALL.num_layers {
        let bytes = unsafe { std::slice::from_raw_parts(regions[layer as usize], region) };
        for &b in &BLOCKS {
            let at = b as usize * stride;
            assert_eq!(&bytes[at..at + plane], dst.pool().block(layer, Plane::K, b));
            assert!(bytes[at + 2 * plane..at + stride].iter().all(|&c| c == 0xEE), "padding written");
        }
    }
    drop(dst);
    for p in regions {
        unsafe {
            *p = 1; // still the engine's: dropping the handle freed nothing
            dealloc(p, engine_layout);
        }
    }
}

#[test]
fn raw_memory_with_the_wrong_number_of_addresses_is_refused() {
    let mut one = [0u8; 64];
    let raw = RawMemory::new(vec![one.as_mut_ptr()], Vec::new());
    let err = unsafe { Pool::from_raw(SMALL, raw) }.err().expect("refused");
    assert_eq!(err.status(), Status::INVALID_ARGUMENT);
}
