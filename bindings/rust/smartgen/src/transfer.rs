//! Transfers: one request's KV, expected on the decode side and posted on the prefill side.

use std::ops::Deref;
use std::os::raw::c_char;
use std::ptr;
use std::sync::Arc;
use std::time::Duration;

use smartgen_sys as sys;

use crate::error::{c_string, char_array_text, check, last_error, Error, ErrorInfo, Result};
use crate::kv::{KvHandle, KvInner};
use crate::profile::Profile;
use crate::session::{nanos, Session, SessionInner};
use crate::status::Status;
use crate::values::{LayerState, Paths, TransferFlags, WireQuant};

/// Options of an expect or a post. `Default` is the library's defaults (full path, no flags,
/// priority 0, layers in order, no deadline, no profile, no lease).
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct TransferOptions {
    /// Empty means FULL. The decode side learns the paths from the post.
    pub paths: Paths,
    pub flags: TransferFlags,
    /// Higher first among this context's transfers.
    pub priority: i32,
    /// Post side: the order layers are sent in, a permutation of 0..num_layers.
    pub layer_order: Option<Vec<u32>>,
    /// Time from the call by which the transfer must complete (else it fails with DEADLINE).
    pub deadline: Option<Duration>,
    /// Post side with PROACTIVE: decides each layer's essential blocks (copied at the call).
    pub profile: Option<Profile>,
    /// Post side, selective paths: how long after the last layer is written the blocks stay
    /// available for on-demand and speculative traffic. None: until the decode side releases.
    pub lease: Option<Duration>,
    /// In-flight quantization; both sides must give the same (fp32/fp16/bf16 pools, since 0.3).
    pub wire_quant: WireQuant,
}


/// Built from `Default` with one `with_*` call per field: the struct is `#[non_exhaustive]` so
/// that a field a later header appends is a minor release of this crate, not a breaking one.
impl TransferOptions {
    pub fn with_paths(mut self, paths: Paths) -> Self {
        self.paths = paths;
        self
    }

    pub fn with_flags(mut self, flags: TransferFlags) -> Self {
        self.flags = flags;
        self
    }

    pub fn with_priority(mut self, priority: i32) -> Self {
        self.priority = priority;
        self
    }

    pub fn with_layer_order(mut self, layer_order: Option<Vec<u32>>) -> Self {
        self.layer_order = layer_order;
        self
    }

    pub fn with_deadline(mut self, deadline: Option<Duration>) -> Self {
        self.deadline = deadline;
        self
    }

    pub fn with_profile(mut self, profile: Option<Profile>) -> Self {
        self.profile = profile;
        self
    }

    pub fn with_lease(mut self, lease: Option<Duration>) -> Self {
        self.lease = lease;
        self
    }

    pub fn with_wire_quant(mut self, wire_quant: WireQuant) -> Self {
        self.wire_quant = wire_quant;
        self
    }
}

/// Counters of one transfer (sg_transfer_stats_t).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TransferStats {
    pub bytes: u64,
    pub rma_ops: u64,
    pub segments: u64,
    pub staged_bytes: u64,
    pub staging_copies: u64,
    pub layers_ready: u64,
    /// CLOCK_MONOTONIC nanoseconds when matched, and when complete (0 while in progress).
    pub start_ns: u64,
    pub end_ns: u64,
    pub bytes_full: u64,
    pub bytes_proactive: u64,
    pub bytes_on_demand: u64,
    pub bytes_speculative: u64,
    pub digest_bytes: u64,
    pub fetch_requests: u64,
    pub fetch_blocks: u64,
    /// With wire_quant: the pool bytes that travelled quantized, and their bytes on the wire.
    pub quantized_bytes: u64,
    pub quantized_wire_bytes: u64,
}

/// The calls on a transfer that never block: reached through a `Transfer` (by Deref) or, inside
/// an event handler, through `Event::transfer`.
pub struct TransferRef {
    // The handle as a number: handles are opaque values, and a number keeps Event Send.
    handle: usize,
}

impl TransferRef {
    /// The library's handle, for calls this crate does not wrap (through `smartgen::sys`). It stays
    /// owned by this object: do not destroy or release it, and do not use it after this is dropped.
    pub fn as_raw(&self) -> sys::sg_transfer_t {
        self.raw()
    }

    pub(crate) fn new(raw: sys::sg_transfer_t) -> TransferRef {
        TransferRef { handle: raw as usize }
    }

    pub(crate) fn raw(&self) -> sys::sg_transfer_t {
        self.handle as sys::sg_transfer_t
    }

    /// The transfer's identity (matches `Event::transfer_id`).
    pub fn id(&self) -> u64 {
        self.handle as u64
    }

    /// Prefill side: the engine finished writing `layer`; the runtime may send it.
    pub fn layer_written(&self, layer: u32) -> Result<()> {
        check(unsafe { sys::sg_transfer_layer_written(self.raw(), layer, ptr::null_mut()) })
    }

    /// Current readiness bits of one layer.
    pub fn layer_state(&self, layer: u32) -> Result<LayerState> {
        let mut state = 0u32;
        check(unsafe { sys::sg_transfer_layer_state(self.raw(), layer, &mut state) })?;
        Ok(LayerState(state))
    }

    /// True once complete (decode: every byte in place; prefill: the decode side confirmed it);
    /// false while in progress; the transfer's error otherwise.
    pub fn test(&self) -> Result<bool> {
        let status = unsafe { sys::sg_transfer_test(self.raw()) };
        match status {
            sys::SG_OK => Ok(true),
            sys::SG_IN_PROGRESS => Ok(false),
            _ => Err(self.failure(status)),
        }
    }

    /// The transfer's status (OK, IN_PROGRESS or its error) and the detail of an error that
    /// happened in the background.
    pub fn status(&self) -> Result<(Status, String)> {
        let mut status: sys::sg_status_t = sys::SG_OK;
        let mut msg = [0 as c_char; sys::SG_ERROR_MESSAGE_MAX as usize];
        check(unsafe { sys::sg_transfer_status(self.raw(), &mut status, msg.as_mut_ptr(), msg.len()) })?;
        Ok((Status(status), char_array_text(&msg)))
    }

    /// Decode side, on-demand path: asks for logical blocks of a layer; returns at once.
    pub fn fetch(&self, layer: u32, blocks: &[u32]) -> Result<()> {
        check(unsafe { sys::sg_transfer_fetch(self.raw(), layer, blocks.as_ptr(), blocks.len()) })
    }

    /// Cancels on this side and tells the peer; the blocks may be reused once quiesced.
    pub fn cancel(&self) -> Result<()> {
        check(unsafe { sys::sg_transfer_cancel(self.raw()) })
    }

    pub fn stats(&self) -> Result<TransferStats> {
        // SAFETY: zero is valid for the struct; struct_size says how much this binding reads.
        let mut raw: sys::sg_transfer_stats_t = unsafe { std::mem::zeroed() };
        raw.struct_size = std::mem::size_of::<sys::sg_transfer_stats_t>();
        check(unsafe { sys::sg_transfer_stats(self.raw(), &mut raw) })?;
        Ok(TransferStats {
            bytes: raw.bytes,
            rma_ops: raw.rma_ops,
            segments: raw.segments,
            staged_bytes: raw.staged_bytes,
            staging_copies: raw.staging_copies,
            layers_ready: raw.layers_ready,
            start_ns: raw.start_ns,
            end_ns: raw.end_ns,
            bytes_full: raw.bytes_full,
            bytes_proactive: raw.bytes_proactive,
            bytes_on_demand: raw.bytes_on_demand,
            bytes_speculative: raw.bytes_speculative,
            digest_bytes: raw.digest_bytes,
            fetch_requests: raw.fetch_requests,
            fetch_blocks: raw.fetch_blocks,
            quantized_bytes: raw.quantized_bytes,
            quantized_wire_bytes: raw.quantized_wire_bytes,
        })
    }

    /// Decode side, proactive path: the layer's page digests as received (the layout of
    /// `Selector::digest`). INVALID_STATE before the layer is ESSENTIAL.
    pub fn digests(&self, layer: u32) -> Result<Vec<f32>> {
        let mut count = 0usize;
        check(unsafe { sys::sg_transfer_digests(self.raw(), layer, ptr::null_mut(), 0, &mut count) })?;
        loop {
            let mut out = vec![0f32; count];
            let status =
                unsafe { sys::sg_transfer_digests(self.raw(), layer, out.as_mut_ptr(), out.len(), &mut count) };
            if status == sys::SG_OK {
                out.truncate(count);
                return Ok(out);
            }
            if status != sys::SG_ERR_BUFFER_TOO_SMALL {
                return Err(last_error(status));
            }
        }
    }

    /// Time until the layer became ready (zero while it is not).
    pub fn layer_time(&self, layer: u32) -> Result<Duration> {
        let mut ns = 0u64;
        check(unsafe { sys::sg_transfer_layer_time(self.raw(), layer, &mut ns) })?;
        Ok(Duration::from_nanos(ns))
    }

    /// Which of this side's blocks of a layer are in place (decode) or delivered (prefill), in
    /// block-table order.
    pub fn residency(&self, layer: u32) -> Result<Vec<bool>> {
        let mut bits = 0usize;
        check(unsafe { sys::sg_transfer_residency(self.raw(), layer, ptr::null_mut(), 0, &mut bits) })?;
        loop {
            let mut bitmap = vec![0u8; (bits + 7) / 8];
            let status =
                unsafe { sys::sg_transfer_residency(self.raw(), layer, bitmap.as_mut_ptr(), bitmap.len(), &mut bits) };
            if status == sys::SG_OK {
                return Ok((0..bits).map(|i| bitmap[i / 8] & (1 << (i % 8)) != 0).collect());
            }
            if status != sys::SG_ERR_BUFFER_TOO_SMALL {
                return Err(last_error(status));
            }
        }
    }

    /// The error of a failed test or wait. A transfer's own error is described by
    /// sg_transfer_status when the thread's message does not say more.
    fn failure(&self, status: sys::sg_status_t) -> Error {
        let error = last_error(status);
        if !error.message().is_empty() || status == sys::SG_ERR_TIMEOUT {
            return error;
        }
        match self.status() {
            Ok((own, message)) if own.code() == status && !message.is_empty() => Error::new(Status(status), message),
            _ => error,
        }
    }

    fn wait_result(&self, status: sys::sg_status_t) -> Result<()> {
        if status == sys::SG_OK {
            Ok(())
        } else {
            Err(self.failure(status))
        }
    }
}

/// A transfer handle. Send and Sync. Dropping it releases it (canceling an incomplete transfer
/// and waiting until it is quiesced); `release` does the same and returns the status. It keeps
/// its session, pool and context alive.
pub struct Transfer {
    view: TransferRef,
    released: bool,
    // Dropped after the release in Drop: the pool's memory outlives every operation on it.
    kv: Arc<KvInner>,
    _session: Arc<SessionInner>,
}

impl Deref for Transfer {
    type Target = TransferRef;
    fn deref(&self) -> &TransferRef {
        &self.view
    }
}

impl Transfer {
    pub(crate) fn start(
        expect: bool,
        session: &Session,
        request_id: &str,
        kv: &KvHandle,
        block_ids: &[u32],
        num_tokens: u64,
        options: &TransferOptions,
    ) -> Result<Transfer> {
        let request_id = c_string("request_id", request_id)?;
        // SAFETY: zero is valid for every field (the defaults); set struct_size.
        let mut raw_opts: sys::sg_transfer_options_t = unsafe { std::mem::zeroed() };
        raw_opts.struct_size = std::mem::size_of::<sys::sg_transfer_options_t>();
        raw_opts.paths = options.paths.bits();
        raw_opts.flags = options.flags.bits();
        raw_opts.priority = options.priority;
        if let Some(order) = &options.layer_order {
            raw_opts.layer_order = order.as_ptr();
            raw_opts.layer_order_count = order.len();
        }
        raw_opts.deadline_ns = options.deadline.map_or(0, nanos);
        raw_opts.profile = options.profile.as_ref().map_or(ptr::null_mut(), |p| p.raw());
        raw_opts.lease_ns = options.lease.map_or(0, nanos);
        raw_opts.wire_quant = options.wire_quant.0;
        let start = if expect {
            sys::sg_transfer_expect
        } else {
            sys::sg_transfer_post
        };
        let mut raw: sys::sg_transfer_t = ptr::null_mut();
        let mut err = ErrorInfo::new();
        // SAFETY: every pointer is valid for the call; the library copies the table, the options
        // and the profile.
        let status = unsafe {
            start(
                session.inner.raw,
                request_id.as_ptr(),
                kv.inner.raw,
                block_ids.as_ptr(),
                block_ids.len(),
                num_tokens,
                &raw_opts,
                &mut raw,
                err.as_mut_ptr(),
            )
        };
        err.check(status)?;
        Ok(Transfer {
            view: TransferRef::new(raw),
            released: false,
            kv: kv.inner.clone(),
            _session: session.inner.clone(),
        })
    }

    /// Prefill side: as `layer_written`, with the layer's last prompt queries (fp32
    /// `[num_queries][num_q_heads][head_dim]`, after RoPE) for query-aware selection on the proactive
    /// path. The layer's keys must stay as they are until the transfer is released.
    pub fn layer_written_with_queries(
        &self,
        layer: u32,
        queries: &[f32],
        num_queries: u32,
        num_q_heads: u32,
    ) -> Result<()> {
        // The library reads num_queries × num_q_heads × head_dim floats: a shorter slice stops here.
        let need = num_queries as usize * num_q_heads as usize * self.kv.layout.head_dim as usize;
        if queries.len() < need {
            let message = format!("queries holds {} floats; {} are needed", queries.len(), need);
            return Err(Error::new(Status::INVALID_ARGUMENT, message));
        }
        check(unsafe {
            sys::sg_transfer_layer_written_q(self.raw(), layer, queries.as_ptr(), num_queries, num_q_heads)
        })
    }

    /// Waits up to `timeout` for completion; TIMEOUT leaves the transfer going.
    pub fn wait(&self, timeout: Duration) -> Result<()> {
        self.wait_result(unsafe { sys::sg_transfer_wait(self.raw(), nanos(timeout)) })
    }

    /// Waits for one layer to be ready (decode: every byte of it in place).
    pub fn wait_layer(&self, layer: u32, timeout: Duration) -> Result<()> {
        self.wait_result(unsafe { sys::sg_transfer_wait_layer(self.raw(), layer, nanos(timeout)) })
    }

    /// Waits until every bit of `bits` is set for the layer.
    pub fn wait_layer_state(&self, layer: u32, bits: LayerState, timeout: Duration) -> Result<()> {
        self.wait_result(unsafe { sys::sg_transfer_wait_layer_state(self.raw(), layer, bits.bits(), nanos(timeout)) })
    }

    /// Decode side: waits until the given logical blocks of a layer are in place.
    pub fn wait_blocks(&self, layer: u32, blocks: &[u32], timeout: Duration) -> Result<()> {
        self.wait_result(unsafe {
            sys::sg_transfer_wait_blocks(self.raw(), layer, blocks.as_ptr(), blocks.len(), nanos(timeout))
        })
    }

    /// Waits until the transfer is quiesced: its blocks may then be reused.
    pub fn wait_quiesced(&self, timeout: Duration) -> Result<()> {
        self.wait_result(unsafe { sys::sg_transfer_wait_quiesced(self.raw(), nanos(timeout)) })
    }

    /// Releases the handle (an incomplete transfer is canceled first, then waited for until
    /// quiesced) and returns the release's status.
    pub fn release(mut self) -> Result<()> {
        self.released = true;
        check(unsafe { sys::sg_transfer_release(self.raw()) })
    }
}

impl Drop for Transfer {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        // SAFETY: the handle is this Transfer's, released once.
        let status = unsafe { sys::sg_transfer_release(self.raw()) };
        if status == sys::SG_ERR_INVALID_STATE {
            // Dropped inside an event handler, where the library refuses to release (it would block
            // the progress thread). Release it on a thread of its own instead of leaking it, keeping
            // the pool's and the session's references until the release has returned, so the pool
            // is never deregistered while the transfer still holds it.
            let handle = self.view.handle;
            let kv = self.kv.clone();
            let session = self._session.clone();
            std::thread::spawn(move || {
                // SAFETY: as above; nothing else holds this handle any more.
                unsafe { sys::sg_transfer_release(handle as sys::sg_transfer_t) };
                drop((kv, session));
            });
        }
    }
}
