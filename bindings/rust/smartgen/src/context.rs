//! The context: one per engine process. Every object made from it holds an `Arc` of it, so
//! sg_context_destroy runs only after the last of them is gone: the header forbids destroying a
//! context while calls on its objects may run, and in Rust no call can run on an object that no
//! longer exists.

use std::os::raw::c_void;
use std::ptr;
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex};

use smartgen_sys as sys;

use crate::error::{c_string, check, ErrorInfo, Result};
use crate::event::{self, Event, EventHandler};
use crate::values::LogLevel;

/// Options of a context. Every field left at its `Default` (zero, None, false) means the
/// library's default, as the header's option structs define.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct ContextOptions {
    /// Fabric provider: None or "auto" ranks what is present; "tcp" (tcp;ofi_rxm); "shm".
    pub provider: Option<String>,
    /// Address literal(s) the data endpoint binds to; None is 127.0.0.1. Several, comma-separated,
    /// name several NICs (lanes).
    pub local_addr: Option<String>,
    /// The host drives progress with `Context::progress` instead of a library thread.
    pub manual_progress: bool,
    /// Microseconds the progress thread spins before it blocks; 0 = default (50).
    pub progress_spin_us: u32,
    /// RMA operations in flight per context; 0 = default (64).
    pub max_ops_in_flight: u32,
    pub log_level: LogLevel,
    /// Silence after which a peer is lost, milliseconds; 0 = default (2000).
    pub peer_timeout_ms: u32,
    /// Payload bytes in flight per context and per session; 0 = defaults (64 MiB, 32 MiB).
    pub max_bytes_in_flight: u64,
    pub max_session_bytes_in_flight: u64,
    /// Unfinished transfers a session accepts before post/expect answer AGAIN; 0 = default (1024).
    pub max_transfers_per_session: u32,
    /// The pre-shared session key (32 to 4096 bytes). None: the file named by SG_AUTH_KEY_FILE.
    pub auth_key: Option<Vec<u8>>,
    /// Run without a key (only on a trusted network).
    pub allow_unauthenticated: bool,
    /// Lanes (endpoints a session's writes are striped over); 0 = default.
    pub lanes: u32,
}


/// Built from `Default` with one `with_*` call per field: the struct is `#[non_exhaustive]` so
/// that a field a later header appends is a minor release of this crate, not a breaking one.
impl ContextOptions {
    pub fn with_provider(mut self, provider: Option<String>) -> Self {
        self.provider = provider;
        self
    }

    pub fn with_local_addr(mut self, local_addr: Option<String>) -> Self {
        self.local_addr = local_addr;
        self
    }

    pub fn with_manual_progress(mut self, manual_progress: bool) -> Self {
        self.manual_progress = manual_progress;
        self
    }

    pub fn with_progress_spin_us(mut self, progress_spin_us: u32) -> Self {
        self.progress_spin_us = progress_spin_us;
        self
    }

    pub fn with_max_ops_in_flight(mut self, max_ops_in_flight: u32) -> Self {
        self.max_ops_in_flight = max_ops_in_flight;
        self
    }

    pub fn with_log_level(mut self, log_level: LogLevel) -> Self {
        self.log_level = log_level;
        self
    }

    pub fn with_peer_timeout_ms(mut self, peer_timeout_ms: u32) -> Self {
        self.peer_timeout_ms = peer_timeout_ms;
        self
    }

    pub fn with_max_bytes_in_flight(mut self, max_bytes_in_flight: u64) -> Self {
        self.max_bytes_in_flight = max_bytes_in_flight;
        self
    }

    pub fn with_max_session_bytes_in_flight(mut self, max_session_bytes_in_flight: u64) -> Self {
        self.max_session_bytes_in_flight = max_session_bytes_in_flight;
        self
    }

    pub fn with_max_transfers_per_session(mut self, max_transfers_per_session: u32) -> Self {
        self.max_transfers_per_session = max_transfers_per_session;
        self
    }

    pub fn with_auth_key(mut self, auth_key: Option<Vec<u8>>) -> Self {
        self.auth_key = auth_key;
        self
    }

    pub fn with_allow_unauthenticated(mut self, allow_unauthenticated: bool) -> Self {
        self.allow_unauthenticated = allow_unauthenticated;
        self
    }

    pub fn with_lanes(mut self, lanes: u32) -> Self {
        self.lanes = lanes;
        self
    }
}

pub(crate) struct ContextInner {
    pub(crate) raw: sys::sg_context_t,
    // Boxed twice so that the C side holds a thin pointer; freed only after sg_context_destroy,
    // which stops the thread that calls it.
    handler: Option<Box<EventHandler>>,
}

// SAFETY: every sg_* function may be called from any thread (header, Conventions); the one
// exception, sg_context_destroy, runs in Drop, when no other reference to the context is left.
unsafe impl Send for ContextInner {}
unsafe impl Sync for ContextInner {}

impl Drop for ContextInner {
    fn drop(&mut self) {
        // SAFETY: the last reference; every object of the context has been dropped already.
        unsafe { sys::sg_context_destroy(self.raw) };
        self.handler.take();
    }
}

/// A SmartGen context (fabric, progress thread, registries). Cheap to clone: clones share it, and
/// it lives until the last clone and the last object made from it are dropped. Send and Sync.
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

impl Context {
    /// The library's handle, for calls this crate does not wrap (through `smartgen::sys`). It stays
    /// owned by this object: do not destroy or release it, and do not use it after this is dropped.
    pub fn as_raw(&self) -> sys::sg_context_t {
        self.inner.raw
    }

    pub fn new(options: &ContextOptions) -> Result<Context> {
        Context::create(options, None)
    }

    /// A context whose transfer events go to `handler`, on the library's progress thread. The
    /// handler must not block; it may call the non-blocking methods of the transfer it is given
    /// (see `Event::transfer`). A panic in it is caught and the event dropped. The handler lives as
    /// long as the context: one that holds this context's objects keeps the context alive.
    pub fn with_event_handler<F>(options: &ContextOptions, handler: F) -> Result<Context>
    where
        F: Fn(&Event) + Send + Sync + 'static,
    {
        Context::create(options, Some(Box::new(Box::new(handler))))
    }

    /// A context whose transfer events arrive, as owned copies, on the returned channel.
    pub fn with_event_channel(options: &ContextOptions) -> Result<(Context, Receiver<Event>)> {
        let (sender, receiver) = mpsc::channel();
        // Sender is not Sync before Rust 1.72; the handler must be.
        let sender = Mutex::new(sender);
        let context = Context::with_event_handler(options, move |event: &Event| {
            let sender = sender.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            // A dropped receiver only means nobody listens any more.
            let _ = sender.send(event.clone());
        })?;
        Ok((context, receiver))
    }

    fn create(options: &ContextOptions, handler: Option<Box<EventHandler>>) -> Result<Context> {
        let provider = options
            .provider
            .as_deref()
            .map(|p| c_string("provider", p))
            .transpose()?;
        let local_addr = options
            .local_addr
            .as_deref()
            .map(|a| c_string("local_addr", a))
            .transpose()?;
        // A zeroed struct is the library's defaults; struct_size and header_version say which
        // header this binding was generated from, so a library of another major can refuse it.
        // SAFETY: all-zero is a valid sg_context_options_t (integers, NULL pointers, None).
        let mut raw: sys::sg_context_options_t = unsafe { std::mem::zeroed() };
        raw.struct_size = std::mem::size_of::<sys::sg_context_options_t>();
        raw.header_version = sys::SG_VERSION_NUMBER;
        raw.provider = provider.as_ref().map_or(ptr::null(), |p| p.as_ptr());
        raw.local_addr = local_addr.as_ref().map_or(ptr::null(), |a| a.as_ptr());
        raw.manual_progress = options.manual_progress as u32;
        raw.progress_spin_us = options.progress_spin_us;
        raw.max_ops_in_flight = options.max_ops_in_flight;
        raw.log_level = options.log_level.0;
        raw.peer_timeout_ms = options.peer_timeout_ms;
        raw.max_bytes_in_flight = options.max_bytes_in_flight;
        raw.max_session_bytes_in_flight = options.max_session_bytes_in_flight;
        raw.max_transfers_per_session = options.max_transfers_per_session;
        if let Some(key) = &options.auth_key {
            raw.auth_key = key.as_ptr() as *const c_void;
            raw.auth_key_len = key.len();
        }
        raw.allow_unauthenticated = options.allow_unauthenticated as u32;
        raw.lanes = options.lanes;
        if let Some(handler) = &handler {
            raw.event_fn = Some(event::trampoline);
            raw.event_user = &**handler as *const EventHandler as *mut c_void;
        }
        let mut ctx: sys::sg_context_t = ptr::null_mut();
        let mut err = ErrorInfo::new();
        // SAFETY: raw and the strings and key it points to outlive the call (they are copied);
        // the handler box outlives the context (ContextInner::drop).
        let status = unsafe { sys::sg_context_create(&raw, &mut ctx, err.as_mut_ptr()) };
        err.check(status)?;
        Ok(Context {
            inner: Arc::new(ContextInner { raw: ctx, handler }),
        })
    }

    /// Drives progress once; needed only with `manual_progress`.
    pub fn progress(&self) -> Result<()> {
        check(unsafe { sys::sg_context_progress(self.inner.raw) })
    }

    /// Name of the provider the context runs on ("tcp;ofi_rxm", "shm", ...).
    pub fn provider(&self) -> Result<String> {
        let mut buf = [0 as std::os::raw::c_char; 256];
        check(unsafe { sys::sg_context_provider(self.inner.raw, buf.as_mut_ptr(), buf.len()) })?;
        Ok(crate::error::char_array_text(&buf))
    }

    /// The context's counters in the Prometheus text format.
    pub fn metrics_text(&self) -> Result<String> {
        let raw = self.inner.raw;
        let bytes = crate::buffer::read_sized(
            |buf, cap, len| unsafe { sys::sg_context_metrics_text(raw, buf as *mut std::os::raw::c_char, cap, len) },
            1,
        )?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
}
