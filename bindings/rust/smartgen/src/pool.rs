//! KV pool memory owned by Rust: one zeroed allocation per layer and plane (K, V), shaped by a
//! `PoolLayout`, read and written as byte slices. A `KvHandle` takes the pool when it registers it,
//! so the memory outlives the registration and every transfer that uses it.

use std::alloc::{self, Layout};
use std::os::raw::c_void;
use std::ptr::NonNull;

use smartgen_sys as sys;

use crate::error::{Error, Result};
use crate::status::Status;
use crate::values::{BlockOrder, Dtype};

/// Page alignment: a region shares no page with other heap data, which fabric memory
/// registration (pinned per page) needs to stay exact.
const REGION_ALIGN: usize = 4096;

/// The shape of a paged KV pool with K and V in separate regions, packed (block b of a layer
/// starts at b × plane bytes). Fields mean the value written, 0 included: a bad shape is refused
/// by the library when the pool is registered (INVALID_LAYOUT, naming the field).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolLayout {
    pub num_layers: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
    pub tokens_per_block: u32,
    /// Blocks in the pool, per layer.
    pub num_blocks: u64,
    pub dtype: Dtype,
    pub block_order: BlockOrder,
}

impl PoolLayout {
    /// Bytes of one K (or V) plane of one block; 0 for an unknown dtype.
    pub fn plane_bytes(&self) -> Option<u64> {
        // SAFETY: sg_dtype_size takes any value.
        let elem = unsafe { sys::sg_dtype_size(self.dtype.0) } as u64;
        u64::from(self.tokens_per_block)
            .checked_mul(u64::from(self.num_kv_heads))?
            .checked_mul(u64::from(self.head_dim))?
            .checked_mul(elem)
    }

    /// The sg_kv_layout_t of this shape (K and V separate, host memory, packed) without memory.
    pub(crate) fn raw(&self) -> sys::sg_kv_layout_t {
        // SAFETY: zero is valid for every field; init sets struct_size and the defaults.
        let mut raw: sys::sg_kv_layout_t = unsafe { std::mem::zeroed() };
        unsafe { sys::sg_kv_layout_init_sized(&mut raw, std::mem::size_of::<sys::sg_kv_layout_t>()) };
        raw.num_layers = self.num_layers;
        raw.num_kv_heads = self.num_kv_heads;
        raw.head_dim = self.head_dim;
        raw.tokens_per_block = self.tokens_per_block;
        raw.num_blocks = self.num_blocks;
        raw.dtype = self.dtype.0;
        raw.packing = sys::SG_KV_SEPARATE;
        raw.block_order = self.block_order.0;
        raw.mem_kind = sys::SG_MEM_HOST;
        raw.block_stride_bytes = 0;
        raw
    }

    /// Bytes of one layer's K (or V) region: num_blocks planes.
    pub fn region_bytes(&self) -> Option<u64> {
        self.plane_bytes()?.checked_mul(self.num_blocks)
    }
}

/// K or V.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Plane {
    K = 0,
    V = 1,
}

struct Region {
    ptr: NonNull<u8>,
    len: usize,
}

/// Host memory of a KV pool: per layer, a K region and a V region of `region_bytes` each,
/// page-aligned and zeroed.
pub struct Pool {
    layout: PoolLayout,
    plane_bytes: usize,
    // Index: layer * 2 + plane.
    regions: Vec<Region>,
}

// SAFETY: Pool owns its regions exclusively; &Pool only reads and &mut Pool writes them.
unsafe impl Send for Pool {}
unsafe impl Sync for Pool {}

impl Pool {
    /// Allocates the pool. NO_MEMORY when a region cannot be allocated or its size does not fit
    /// the address space.
    pub fn new(layout: PoolLayout) -> Result<Pool> {
        let too_big = || Error::new(Status::NO_MEMORY, "KV pool size overflows the address space");
        let plane_bytes = usize::try_from(layout.plane_bytes().ok_or_else(too_big)?).map_err(|_| too_big())?;
        let region_bytes = usize::try_from(layout.region_bytes().ok_or_else(too_big)?).map_err(|_| too_big())?;
        let mut pool = Pool {
            layout,
            plane_bytes,
            regions: Vec::new(),
        };
        for _ in 0..u64::from(layout.num_layers) * 2 {
            pool.regions.push(Region::zeroed(region_bytes)?);
        }
        Ok(pool)
    }

    pub fn layout(&self) -> &PoolLayout {
        &self.layout
    }

    pub fn plane_bytes(&self) -> usize {
        self.plane_bytes
    }

    /// One layer's whole K or V region. Panics for a layer past the pool.
    pub fn region(&self, layer: u32, plane: Plane) -> &[u8] {
        let region = &self.regions[Self::index(layer, plane)];
        // SAFETY: the region is `len` initialised bytes owned by self, borrowed shared here.
        unsafe { std::slice::from_raw_parts(region.ptr.as_ptr(), region.len) }
    }

    pub fn region_mut(&mut self, layer: u32, plane: Plane) -> &mut [u8] {
        let region = &self.regions[Self::index(layer, plane)];
        // SAFETY: as region(), borrowed exclusively through &mut self.
        unsafe { std::slice::from_raw_parts_mut(region.ptr.as_ptr(), region.len) }
    }

    /// The plane of one block. Panics for a layer or block past the pool.
    pub fn block(&self, layer: u32, plane: Plane, block: u32) -> &[u8] {
        let start = block as usize * self.plane_bytes;
        &self.region(layer, plane)[start..start + self.plane_bytes]
    }

    pub fn block_mut(&mut self, layer: u32, plane: Plane, block: u32) -> &mut [u8] {
        let (start, len) = (block as usize * self.plane_bytes, self.plane_bytes);
        &mut self.region_mut(layer, plane)[start..start + len]
    }

    /// Calls `f` with the sg_kv_layout_t that describes this pool's memory (valid during `f`).
    pub(crate) fn with_raw_layout<R>(&self, f: impl FnOnce(&sys::sg_kv_layout_t) -> R) -> R {
        let base = |i: usize| self.regions[i].ptr.as_ptr() as *mut c_void;
        let layers = self.regions.len() / 2;
        let k_bases: Vec<*mut c_void> = (0..layers).map(|l| base(l * 2)).collect();
        let v_bases: Vec<*mut c_void> = (0..layers).map(|l| base(l * 2 + 1)).collect();
        let mut raw = self.layout.raw();
        raw.layer_k_base = k_bases.as_ptr();
        raw.layer_v_base = v_bases.as_ptr();
        raw.layer_base_count = layers;
        f(&raw)
    }

    fn index(layer: u32, plane: Plane) -> usize {
        layer as usize * 2 + plane as usize
    }
}

impl Region {
    fn zeroed(len: usize) -> Result<Region> {
        if len == 0 {
            // Nothing to allocate; the library refuses the shape that led here at registration.
            return Ok(Region {
                ptr: NonNull::dangling(),
                len: 0,
            });
        }
        let layout = Layout::from_size_align(len, REGION_ALIGN)
            .map_err(|_| Error::new(Status::NO_MEMORY, "KV region too large"))?;
        // SAFETY: layout has a non-zero size.
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        NonNull::new(ptr)
            .map(|ptr| Region { ptr, len })
            .ok_or_else(|| Error::new(Status::NO_MEMORY, format!("cannot allocate {} bytes", len)))
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if self.len != 0 {
            // SAFETY: allocated in zeroed() with this size and alignment.
            unsafe {
                alloc::dealloc(
                    self.ptr.as_ptr(),
                    Layout::from_size_align_unchecked(self.len, REGION_ALIGN),
                )
            };
        }
    }
}
