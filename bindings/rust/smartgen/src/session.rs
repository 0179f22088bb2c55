//! Listeners and sessions. A session made from a context keeps it alive; transfers keep their
//! session alive, so dropping a `Session` while its transfers run does not cancel them.

use std::os::raw::{c_char, c_void};
use std::ptr;
use std::sync::Arc;
use std::time::Duration;

use smartgen_sys as sys;

use crate::context::{Context, ContextInner};
use crate::error::{c_string, char_array_text, check, Error, ErrorInfo, Result};
use crate::kv::KvHandle;
use crate::status::Status;
use crate::transfer::{Transfer, TransferOptions};

pub(crate) fn nanos(timeout: Duration) -> u64 {
    u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX)
}

/// A bootstrap listener; established sessions outlive it. Send and Sync.
pub struct Listener {
    raw: sys::sg_listener_t,
    context: Arc<ContextInner>,
}

// SAFETY: every sg_listener_* / sg_session_accept call is thread-safe (header, Conventions).
unsafe impl Send for Listener {}
unsafe impl Sync for Listener {}

impl Listener {
    /// The library's handle, for calls this crate does not wrap (through `smartgen::sys`). It stays
    /// owned by this object: do not destroy or release it, and do not use it after this is dropped.
    pub fn as_raw(&self) -> sys::sg_listener_t {
        self.raw
    }

    /// Listens on addr:port (an address literal; port 0 picks a free one, see `port`).
    pub fn bind(context: &Context, addr: &str, port: u16) -> Result<Listener> {
        let addr = c_string("addr", addr)?;
        let mut raw: sys::sg_listener_t = ptr::null_mut();
        let mut err = ErrorInfo::new();
        let status =
            unsafe { sys::sg_listener_create(context.inner.raw, addr.as_ptr(), port, &mut raw, err.as_mut_ptr()) };
        err.check(status)?;
        Ok(Listener {
            raw,
            context: context.inner.clone(),
        })
    }

    pub fn port(&self) -> Result<u16> {
        let mut port = 0u16;
        check(unsafe { sys::sg_listener_port(self.raw, &mut port) })?;
        Ok(port)
    }

    /// Accepts one authenticated session; TIMEOUT when none finished its handshake in time (a
    /// handshake under way goes on in the next call).
    pub fn accept(&self, timeout: Duration) -> Result<Session> {
        let mut raw: sys::sg_session_t = ptr::null_mut();
        let mut err = ErrorInfo::new();
        let status =
            unsafe { sys::sg_session_accept(self.raw, ptr::null(), nanos(timeout), &mut raw, err.as_mut_ptr()) };
        err.check(status)?;
        Ok(Session::wrap(raw, &self.context))
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        unsafe { sys::sg_listener_destroy(self.raw) };
    }
}

pub(crate) struct SessionInner {
    pub(crate) raw: sys::sg_session_t,
    _context: Arc<ContextInner>,
}

// SAFETY: every sg_session_* call is thread-safe (header, Conventions).
unsafe impl Send for SessionInner {}
unsafe impl Sync for SessionInner {}

impl Drop for SessionInner {
    fn drop(&mut self) {
        unsafe { sys::sg_session_destroy(self.raw) };
    }
}

/// An authenticated link to one peer context. Send and Sync.
pub struct Session {
    pub(crate) inner: Arc<SessionInner>,
}

impl Session {
    /// The library's handle, for calls this crate does not wrap (through `smartgen::sys`). It stays
    /// owned by this object: do not destroy or release it, and do not use it after this is dropped.
    pub fn as_raw(&self) -> sys::sg_session_t {
        self.inner.raw
    }

    pub(crate) fn wrap(raw: sys::sg_session_t, context: &Arc<ContextInner>) -> Session {
        Session {
            inner: Arc::new(SessionInner {
                raw,
                _context: context.clone(),
            }),
        }
    }

    /// Connects to a listener at addr:port and runs the bootstrap and key exchange.
    pub fn connect(context: &Context, addr: &str, port: u16, timeout: Duration) -> Result<Session> {
        let addr = c_string("addr", addr)?;
        let mut raw: sys::sg_session_t = ptr::null_mut();
        let mut err = ErrorInfo::new();
        let status = unsafe {
            sys::sg_session_connect(
                context.inner.raw,
                addr.as_ptr(),
                port,
                ptr::null(),
                nanos(timeout),
                &mut raw,
                err.as_mut_ptr(),
            )
        };
        err.check(status)?;
        Ok(Session::wrap(raw, &context.inner))
    }

    /// Registers the pool for this session and sends its descriptor to the peer; the decode side
    /// exports its destination pool before expecting into it. Exporting twice does nothing.
    pub fn export_kv(&self, kv: &KvHandle) -> Result<()> {
        check(unsafe { sys::sg_session_export_kv(self.inner.raw, kv.inner.raw) })
    }

    /// Decode side: expect request `request_id` into `kv` at `block_ids` (covering `num_tokens`).
    pub fn expect(
        &self,
        request_id: &str,
        kv: &KvHandle,
        block_ids: &[u32],
        num_tokens: u64,
        options: &TransferOptions,
    ) -> Result<Transfer> {
        Transfer::start(true, self, request_id, kv, block_ids, num_tokens, options)
    }

    /// Prefill side: post request `request_id` from `kv` at `block_ids` (covering `num_tokens`).
    pub fn post(
        &self,
        request_id: &str,
        kv: &KvHandle,
        block_ids: &[u32],
        num_tokens: u64,
        options: &TransferOptions,
    ) -> Result<Transfer> {
        Transfer::start(false, self, request_id, kv, block_ids, num_tokens, options)
    }

    /// Sends a small message (1..=4096 bytes) to the peer, in order with the session's traffic.
    pub fn notify(&self, data: &[u8]) -> Result<()> {
        check(unsafe { sys::sg_session_notify(self.inner.raw, data.as_ptr() as *const c_void, data.len()) })
    }

    /// Takes the oldest notification that arrived, or None when none is waiting.
    pub fn next_notification(&self) -> Result<Option<Vec<u8>>> {
        let raw = self.inner.raw;
        let result = crate::buffer::read_sized(
            |buf, cap, len| unsafe { sys::sg_session_next_notification(raw, buf as *mut c_void, cap, len) },
            0,
        );
        match result {
            Ok(data) => Ok(Some(data)),
            Err(e) if e.status() == Status::AGAIN => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// None while the session is usable, else why it is not (PEER_LOST, ...).
    pub fn error(&self) -> Result<Option<Error>> {
        let mut status: sys::sg_status_t = sys::SG_OK;
        let mut msg = [0 as c_char; sys::SG_ERROR_MESSAGE_MAX as usize];
        check(unsafe { sys::sg_session_error(self.inner.raw, &mut status, msg.as_mut_ptr(), msg.len()) })?;
        if status == sys::SG_OK {
            return Ok(None);
        }
        Ok(Some(Error::new(Status(status), char_array_text(&msg))))
    }

    /// Provider the session runs on.
    pub fn provider(&self) -> Result<String> {
        let mut buf = [0 as c_char; 256];
        check(unsafe { sys::sg_session_provider(self.inner.raw, buf.as_mut_ptr(), buf.len()) })?;
        Ok(char_array_text(&buf))
    }

    /// Graceful close: no new transfers; waits up to `timeout` for the session's transfers to
    /// finish and for the peer to answer. TIMEOUT leaves it draining (call again). The handle is
    /// destroyed when the last of the session and its transfers is dropped.
    pub fn close(&self, timeout: Duration) -> Result<()> {
        check(unsafe { sys::sg_session_close(self.inner.raw, nanos(timeout)) })
    }
}
