//! A registered KV pool. The handle owns the `Pool`; transfers that use it hold a reference to
//! the registration, so the memory is deregistered and freed only after the last of them is
//! released.

use std::cell::UnsafeCell;
use std::ptr;
use std::sync::Arc;

use smartgen_sys as sys;

use crate::context::{Context, ContextInner};
use crate::error::{Error, ErrorInfo, Result};
use crate::status::Status;
use crate::pool::{Pool, PoolLayout};

pub(crate) struct KvInner {
    pub(crate) raw: sys::sg_kv_handle_t,
    // Only the owning KvHandle reads or writes the bytes (through &self / &mut self); transfers
    // and the fabric reach them through the registration, outside Rust's view.
    pool: UnsafeCell<Pool>,
    /// The pool's shape, kept apart for transfers (which must not reach into `pool`).
    pub(crate) layout: PoolLayout,
    _context: Arc<ContextInner>,
}

// SAFETY: the sg_kv_* calls are thread-safe; the pool's bytes are reached only as described above.
unsafe impl Send for KvInner {}
unsafe impl Sync for KvInner {}

impl Drop for KvInner {
    fn drop(&mut self) {
        // SAFETY: no transfer of this pool is left (each holds this Arc), so deregistration
        // succeeds; the pool's memory is freed after it (field drop order).
        unsafe { sys::sg_kv_deregister(self.raw) };
    }
}

/// A KV pool registered with a context. Send and Sync.
///
/// The bytes of blocks that a running transfer writes (decode side) or reads (prefill side) may
/// change or be read under a borrow: read the destination after the transfer, layer or blocks are
/// ready, and leave the source as it is until the transfer completes.
pub struct KvHandle {
    pub(crate) inner: Arc<KvInner>,
}

impl KvHandle {
    /// The library's handle, for calls this crate does not wrap (through `smartgen::sys`). It stays
    /// owned by this object: do not destroy or release it, and do not use it after this is dropped.
    pub fn as_raw(&self) -> sys::sg_kv_handle_t {
        self.inner.raw
    }

    /// Registers `pool` with the context. INVALID_LAYOUT (the message names the field) for a bad
    /// shape; the pool is dropped with the error.
    pub fn register(context: &Context, pool: Pool) -> Result<KvHandle> {
        let mut raw: sys::sg_kv_handle_t = ptr::null_mut();
        let mut err = ErrorInfo::new();
        // SAFETY: the layout and its base arrays live for the call (the library copies them); the
        // regions they point to move with `pool` into the handle, which deregisters before
        // freeing them.
        let status = pool.with_raw_layout(|layout| unsafe {
            sys::sg_kv_register(context.inner.raw, layout, &mut raw, err.as_mut_ptr())
        });
        err.check(status)?;
        Ok(KvHandle {
            inner: Arc::new(KvInner {
                raw,
                layout: *pool.layout(),
                pool: UnsafeCell::new(pool),
                _context: context.inner.clone(),
            }),
        })
    }

    pub fn pool(&self) -> &Pool {
        // SAFETY: see KvInner::pool; a shared borrow of the one KvHandle.
        unsafe { &*self.inner.pool.get() }
    }

    /// The pool's bytes for writing, while no transfer holds the pool: a `Transfer` made with this
    /// handle may have the fabric reading or writing them until it is released (dropped), so while
    /// one lives this answers `INVALID_STATE` instead of handing safe code a `&mut` the fabric may
    /// be writing.
    pub fn pool_mut(&mut self) -> Result<&mut Pool> {
        // Every Transfer holds a clone of the Arc until its release has returned (Drop).
        if Arc::strong_count(&self.inner) > 1 {
            return Err(Error::new(
                Status::INVALID_STATE,
                "the pool is held by a transfer that is not released: drop it (or release it) first",
            ));
        }
        // SAFETY: &mut self is the only access to the bytes from Rust (KvHandle is not Clone), and
        // no transfer holds the registration, so the fabric touches none of them.
        Ok(unsafe { &mut *self.inner.pool.get() })
    }
}
