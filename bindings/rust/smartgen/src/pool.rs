//! KV pool memory: either owned by Rust (`Pool::new`: one zeroed allocation per layer and plane, K
//! and V separate and packed) or the host's own (`Pool::from_raw`: a serving engine's KV cache,
//! host or CUDA memory, K and V separate or fused, any block stride), read and written as byte
//! slices where it is host memory. A `KvHandle` takes the pool when it registers it, so the pool
//! outlives the registration and every transfer that uses it.

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

/// Where K and V of one block live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Packing {
    /// K and V in their own region per layer, at the same block offsets.
    Separate,
    /// One region per layer; each block holds its K plane, then its V plane.
    Fused,
}

/// Where a pool's memory is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Memory {
    Host,
    /// Device memory of this CUDA device (the library's CUDA plugin moves it).
    Cuda { device: i32 },
}

/// Memory the host owns, described in full for `Pool::from_raw`. Build it with `RawMemory::new`
/// and the `with_*` methods: fields are added over releases without breaking callers.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct RawMemory {
    pub packing: Packing,
    /// Bytes from one block to the next in a region; 0 = packed (one plane, or two when fused).
    pub block_stride_bytes: u64,
    pub memory: Memory,
    /// Per layer, the K region's address (the fused region's with `Packing::Fused`).
    pub k: Vec<*mut u8>,
    /// Per layer, the V region's address; empty with `Packing::Fused`.
    pub v: Vec<*mut u8>,
}

impl RawMemory {
    /// K and V separate, packed, host memory, at these per-layer addresses.
    pub fn new(k: Vec<*mut u8>, v: Vec<*mut u8>) -> RawMemory {
        RawMemory {
            packing: Packing::Separate,
            block_stride_bytes: 0,
            memory: Memory::Host,
            k,
            v,
        }
    }

    /// One fused region per layer (K then V in each block).
    pub fn fused(k: Vec<*mut u8>) -> RawMemory {
        RawMemory {
            packing: Packing::Fused,
            ..RawMemory::new(k, Vec::new())
        }
    }

    pub fn with_block_stride(mut self, bytes: u64) -> RawMemory {
        self.block_stride_bytes = bytes;
        self
    }

    pub fn with_memory(mut self, memory: Memory) -> RawMemory {
        self.memory = memory;
        self
    }
}

struct Region {
    ptr: NonNull<u8>,
    len: usize,
    owned: bool, // allocated by Pool::new; the host's (from_raw) is never freed here
}

/// Memory of a KV pool: per layer a K region and a V region (one fused region with
/// `Packing::Fused`), `region_bytes` each.
pub struct Pool {
    layout: PoolLayout,
    plane_bytes: usize,
    packing: Packing,
    stride: usize, // bytes from one block to the next in a region
    memory: Memory,
    // Index: layer * 2 + plane (Separate); layer (Fused).
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
            packing: Packing::Separate,
            stride: plane_bytes,
            memory: Memory::Host,
            regions: Vec::new(),
        };
        for _ in 0..u64::from(layout.num_layers) * 2 {
            pool.regions.push(Region::zeroed(region_bytes)?);
        }
        Ok(pool)
    }

    /// A pool over memory the host owns (an engine's KV cache), registered as it is: nothing is
    /// copied, allocated or freed. The library checks the whole layout at registration
    /// (INVALID_LAYOUT naming the field); here only the address counts are checked
    /// (INVALID_ARGUMENT).
    ///
    /// # Safety
    /// Every address must be the start of a region of `region_bytes()` bytes (host memory, or
    /// device memory of the CUDA device named) that stays valid, unmoved and unfreed until the
    /// `KvHandle` that registers this pool and every `Transfer` made with it are dropped. The
    /// fabric reads and writes those bytes while transfers run, outside Rust's view; host memory is
    /// also read and written through this pool's slices, so nothing else may hold a Rust reference
    /// to it meanwhile.
    pub unsafe fn from_raw(layout: PoolLayout, raw: RawMemory) -> Result<Pool> {
        let invalid = |m: &str| Error::new(Status::INVALID_ARGUMENT, m.to_string());
        let layers = layout.num_layers as usize;
        if raw.k.len() != layers || raw.k.iter().any(|p| p.is_null()) {
            return Err(invalid("RawMemory.k must hold num_layers non-null addresses"));
        }
        match raw.packing {
            Packing::Separate if raw.v.len() != layers || raw.v.iter().any(|p| p.is_null()) => {
                return Err(invalid("RawMemory.v must hold num_layers non-null addresses (Packing::Separate)"))
            }
            Packing::Fused if !raw.v.is_empty() => return Err(invalid("RawMemory.v must be empty with Packing::Fused")),
            _ => {}
        }
        let too_big = || Error::new(Status::OUT_OF_RANGE, "KV pool size overflows the address space");
        let plane_bytes = usize::try_from(layout.plane_bytes().ok_or_else(too_big)?).map_err(|_| too_big())?;
        let packed = if raw.packing == Packing::Fused { 2 * plane_bytes } else { plane_bytes };
        let stride = if raw.block_stride_bytes == 0 {
            packed
        } else {
            usize::try_from(raw.block_stride_bytes).map_err(|_| too_big())?
        };
        let len = stride.checked_mul(usize::try_from(layout.num_blocks).map_err(|_| too_big())?).ok_or_else(too_big)?;
        let mut regions = Vec::new();
        for l in 0..layers {
            regions.push(Region { ptr: NonNull::new_unchecked(raw.k[l]), len, owned: false });
            if raw.packing == Packing::Separate {
                regions.push(Region { ptr: NonNull::new_unchecked(raw.v[l]), len, owned: false });
            }
        }
        Ok(Pool {
            layout,
            plane_bytes,
            packing: raw.packing,
            stride,
            memory: raw.memory,
            regions,
        })
    }

    pub fn packing(&self) -> Packing {
        self.packing
    }

    pub fn memory(&self) -> Memory {
        self.memory
    }

    /// Bytes of one layer's region (K, V or fused).
    pub fn region_bytes(&self) -> usize {
        self.regions.first().map_or(0, |r| r.len)
    }

    pub fn layout(&self) -> &PoolLayout {
        &self.layout
    }

    pub fn plane_bytes(&self) -> usize {
        self.plane_bytes
    }

    /// One layer's whole K or V region (the fused region for either plane with `Packing::Fused`).
    /// Panics for a layer past the pool, and for device memory, which has no host view.
    pub fn region(&self, layer: u32, plane: Plane) -> &[u8] {
        let region = &self.regions[self.index(layer, plane)];
        // SAFETY: the region is `len` initialised bytes owned by self, borrowed shared here.
        unsafe { std::slice::from_raw_parts(region.ptr.as_ptr(), region.len) }
    }

    pub fn region_mut(&mut self, layer: u32, plane: Plane) -> &mut [u8] {
        let region = &self.regions[self.index(layer, plane)];
        // SAFETY: as region(), borrowed exclusively through &mut self.
        unsafe { std::slice::from_raw_parts_mut(region.ptr.as_ptr(), region.len) }
    }

    /// The plane of one block. Panics for a layer or block past the pool.
    pub fn block(&self, layer: u32, plane: Plane, block: u32) -> &[u8] {
        let start = self.block_offset(plane, block);
        &self.region(layer, plane)[start..start + self.plane_bytes]
    }

    pub fn block_mut(&mut self, layer: u32, plane: Plane, block: u32) -> &mut [u8] {
        let (start, len) = (self.block_offset(plane, block), self.plane_bytes);
        &mut self.region_mut(layer, plane)[start..start + len]
    }

    fn block_offset(&self, plane: Plane, block: u32) -> usize {
        let in_block = if self.packing == Packing::Fused && plane == Plane::V { self.plane_bytes } else { 0 };
        block as usize * self.stride + in_block
    }

    /// Calls `f` with the sg_kv_layout_t that describes this pool's memory (valid during `f`).
    pub(crate) fn with_raw_layout<R>(&self, f: impl FnOnce(&sys::sg_kv_layout_t) -> R) -> R {
        let base = |i: usize| self.regions[i].ptr.as_ptr() as *mut c_void;
        let layers = self.layout.num_layers as usize;
        let mut raw = self.layout.raw();
        let (k_bases, v_bases): (Vec<*mut c_void>, Vec<*mut c_void>) = match self.packing {
            Packing::Separate => ((0..layers).map(|l| base(l * 2)).collect(), (0..layers).map(|l| base(l * 2 + 1)).collect()),
            Packing::Fused => ((0..layers).map(base).collect(), Vec::new()),
        };
        raw.layer_k_base = k_bases.as_ptr();
        raw.layer_v_base = if v_bases.is_empty() { std::ptr::null() } else { v_bases.as_ptr() };
        raw.layer_base_count = layers;
        if self.packing == Packing::Fused {
            raw.packing = sys::SG_KV_FUSED;
        }
        let packed = if self.packing == Packing::Fused { 2 * self.plane_bytes } else { self.plane_bytes };
        raw.block_stride_bytes = if self.stride == packed { 0 } else { self.stride as u64 };
        if let Memory::Cuda { device } = self.memory {
            raw.mem_kind = sys::SG_MEM_CUDA;
            raw.device = device;
        }
        f(&raw)
    }

    fn index(&self, layer: u32, plane: Plane) -> usize {
        assert!(self.memory == Memory::Host, "a pool in device memory has no host view of its bytes");
        match self.packing {
            Packing::Separate => layer as usize * 2 + plane as usize,
            Packing::Fused => layer as usize,
        }
    }
}

impl Region {
    fn zeroed(len: usize) -> Result<Region> {
        if len == 0 {
            // Nothing to allocate; the library refuses the shape that led here at registration.
            return Ok(Region {
                ptr: NonNull::dangling(),
                len: 0,
                owned: true,
            });
        }
        let layout = Layout::from_size_align(len, REGION_ALIGN)
            .map_err(|_| Error::new(Status::NO_MEMORY, "KV region too large"))?;
        // SAFETY: layout has a non-zero size.
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        NonNull::new(ptr)
            .map(|ptr| Region { ptr, len, owned: true })
            .ok_or_else(|| Error::new(Status::NO_MEMORY, format!("cannot allocate {} bytes", len)))
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if self.owned && self.len != 0 {
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
