//! Selectors: a profile applied to one request without a transfer, for the decode side's own
//! per-step selection. Not thread-safe per object (header): `Send`, not `Sync`.

use std::cell::Cell;
use std::marker::PhantomData;
use std::ptr;

use smartgen_sys as sys;

use crate::error::{check, Error, ErrorInfo, Result};
use crate::pool::{Pool, PoolLayout};
use crate::profile::Profile;
use crate::status::Status;

/// What a policy reads to select a layer's blocks; fields a policy does not need stay None.
#[derive(Clone, Copy, Default)]
pub struct SelectorInput<'a> {
    /// fp32 `[num_queries][num_q_heads][head_dim]`, after RoPE.
    pub queries: Option<&'a [f32]>,
    pub num_queries: u32,
    /// A multiple of num_kv_heads (grouped-query attention).
    pub num_q_heads: u32,
    /// Quest: the layer's digests (`Selector::digest` or a transfer's).
    pub digests: Option<&'a [f32]>,
    /// SnapKV: the keys, through a pool and the request's block table.
    pub keys: Option<(&'a Pool, &'a [u32])>,
    /// H2O: accumulated attention, fp32 `[num_kv_heads][num_tokens]`.
    pub accumulated: Option<&'a [f32]>,
}

pub struct Selector {
    raw: sys::sg_selector_t,
    shape: PoolLayout,
    num_tokens: u64,
    digest_floats: usize,
    // Cell makes the type !Sync: one selector must not be used from two threads at once.
    _not_sync: PhantomData<Cell<()>>,
}

// SAFETY: a selector may move between threads; it is only not to be used by two at once (!Sync).
unsafe impl Send for Selector {}

impl Drop for Selector {
    fn drop(&mut self) {
        unsafe { sys::sg_selector_destroy(self.raw) };
    }
}

fn too_short(what: &str, have: usize, need: usize) -> Error {
    Error::new(
        Status::INVALID_ARGUMENT,
        format!("{} holds {} floats; {} are needed", what, have, need),
    )
}

impl Selector {
    /// The library's handle, for calls this crate does not wrap (through `smartgen::sys`). It stays
    /// owned by this object: do not destroy or release it, and do not use it after this is dropped.
    pub fn as_raw(&self) -> sys::sg_selector_t {
        self.raw
    }

    /// A selector for a request of `num_tokens` tokens of KV shaped as `shape` (which must match
    /// the profile's shape: LAYOUT_MISMATCH otherwise).
    pub fn new(profile: &Profile, shape: &PoolLayout, num_tokens: u64) -> Result<Selector> {
        let layout = shape.raw();
        let mut raw: sys::sg_selector_t = ptr::null_mut();
        let mut err = ErrorInfo::new();
        let status = unsafe { sys::sg_selector_create(profile.raw(), &layout, num_tokens, &mut raw, err.as_mut_ptr()) };
        err.check(status)?;
        let mut selector = Selector {
            raw,
            shape: *shape,
            num_tokens,
            digest_floats: 0,
            _not_sync: PhantomData,
        };
        check(unsafe { sys::sg_selector_digest_floats(raw, &mut selector.digest_floats) })?;
        Ok(selector)
    }

    /// Floats of one layer's digests.
    pub fn digest_floats(&self) -> usize {
        self.digest_floats
    }

    /// Page digests of one layer (per block and KV head, min then max of each key element), read
    /// from `pool` through the request's block table.
    pub fn digest(&self, pool: &Pool, layer: u32, block_ids: &[u32]) -> Result<Vec<f32>> {
        let mut out = vec![0f32; self.digest_floats];
        let status = pool.with_raw_layout(|layout| unsafe {
            sys::sg_selector_digest(
                self.raw,
                layout,
                layer,
                block_ids.as_ptr(),
                block_ids.len(),
                out.as_mut_ptr(),
                out.len(),
            )
        });
        check(status)?;
        Ok(out)
    }

    /// The layer's budget in blocks (per KV head, sinks and recent included).
    pub fn budget_blocks(&self, layer: u32) -> Result<u64> {
        let mut blocks = 0u64;
        check(unsafe { sys::sg_selector_budget_blocks(self.raw, layer, &mut blocks) })?;
        Ok(blocks)
    }

    /// The essential blocks of one layer, as sorted logical block indices.
    pub fn select(&self, layer: u32, input: &SelectorInput<'_>) -> Result<Vec<u32>> {
        // The library reads these arrays by the sizes the shape implies: short slices are refused
        // here, before a pointer crosses.
        let mut raw: sys::sg_selector_input_t = unsafe { std::mem::zeroed() };
        unsafe { sys::sg_selector_input_init_sized(&mut raw, std::mem::size_of::<sys::sg_selector_input_t>()) };
        if let Some(queries) = input.queries {
            let need = input.num_queries as usize * input.num_q_heads as usize * self.shape.head_dim as usize;
            if queries.len() < need {
                return Err(too_short("queries", queries.len(), need));
            }
            raw.queries = queries.as_ptr();
        }
        raw.num_queries = input.num_queries;
        raw.num_q_heads = input.num_q_heads;
        if let Some(digests) = input.digests {
            if digests.len() < self.digest_floats {
                return Err(too_short("digests", digests.len(), self.digest_floats));
            }
            raw.digests = digests.as_ptr();
        }
        if let Some(accumulated) = input.accumulated {
            let need = self.shape.num_kv_heads as usize * self.num_tokens as usize;
            if accumulated.len() < need {
                return Err(too_short("accumulated", accumulated.len(), need));
            }
            raw.accumulated = accumulated.as_ptr();
        }
        let run = |raw: &mut sys::sg_selector_input_t| -> Result<Vec<u32>> {
            let selector = self.raw;
            let mut count = 0usize;
            check(unsafe { sys::sg_selector_select(selector, layer, raw, ptr::null_mut(), 0, &mut count) })?;
            let mut blocks = vec![0u32; count];
            check(unsafe {
                sys::sg_selector_select(selector, layer, raw, blocks.as_mut_ptr(), blocks.len(), &mut count)
            })?;
            blocks.truncate(count);
            Ok(blocks)
        };
        match input.keys {
            Some((pool, block_ids)) => pool.with_raw_layout(|layout| {
                raw.keys_layout = layout;
                raw.block_ids = block_ids.as_ptr();
                raw.num_block_ids = block_ids.len();
                run(&mut raw)
            }),
            None => run(&mut raw),
        }
    }
}
