//! The cluster directory (docs/directory.md): engines publish themselves under a name in an etcd
//! cluster and open sessions to each other by name. A `Directory` keeps its context alive; dropping
//! it withdraws its names at once.

use std::ptr;
use std::sync::Arc;
use std::time::Duration;

use smartgen_sys as sys;

use crate::context::{Context, ContextInner};
use crate::error::{c_string, check, ErrorInfo, Result};
use crate::session::{nanos, Session};

/// Options of `Directory::open`. Build from `Default` with the `with_*` methods (the struct is
/// `#[non_exhaustive]`); zero values are the library's defaults.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct DirectoryOptions {
    /// "http://10.0.0.1:2379,http://10.0.0.2:2379" (required).
    pub endpoints: String,
    /// Key prefix; None = "/smartgen/".
    pub prefix: Option<String>,
    /// Lease TTL, whole seconds; None = 5 s.
    pub lease_ttl: Option<Duration>,
    /// One request to one member; None = 1 s.
    pub request_timeout: Option<Duration>,
}

impl DirectoryOptions {
    pub fn new(endpoints: &str) -> DirectoryOptions {
        DirectoryOptions {
            endpoints: endpoints.to_string(),
            ..Default::default()
        }
    }

    pub fn with_prefix(mut self, prefix: Option<String>) -> Self {
        self.prefix = prefix;
        self
    }

    pub fn with_lease_ttl(mut self, ttl: Option<Duration>) -> Self {
        self.lease_ttl = ttl;
        self
    }

    pub fn with_request_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.request_timeout = timeout;
        self
    }
}

/// A handle on the cluster directory. Send and Sync.
pub struct Directory {
    raw: sys::sg_directory_t,
    context: Arc<ContextInner>,
}

// SAFETY: every sg_directory_* call is thread-safe (header, Conventions).
unsafe impl Send for Directory {}
unsafe impl Sync for Directory {}

fn millis(d: Option<Duration>) -> u32 {
    d.map_or(0, |d| u32::try_from(d.as_millis()).unwrap_or(u32::MAX))
}

impl Directory {
    /// Opens the directory for `context`; a member must answer (CONNECT names each one's reason).
    pub fn open(context: &Context, options: &DirectoryOptions) -> Result<Directory> {
        let endpoints = c_string("endpoints", &options.endpoints)?;
        let prefix = options.prefix.as_deref().map(|p| c_string("prefix", p)).transpose()?;
        // SAFETY: zero is valid for every field; init sets struct_size and the defaults.
        let mut raw_options: sys::sg_directory_options_t = unsafe { std::mem::zeroed() };
        unsafe {
            sys::sg_directory_options_init_sized(&mut raw_options, std::mem::size_of::<sys::sg_directory_options_t>())
        };
        raw_options.endpoints = endpoints.as_ptr();
        raw_options.prefix = prefix.as_ref().map_or(ptr::null(), |p| p.as_ptr());
        raw_options.lease_ttl_ms = millis(options.lease_ttl);
        raw_options.request_timeout_ms = millis(options.request_timeout);
        let mut raw: sys::sg_directory_t = ptr::null_mut();
        let mut err = ErrorInfo::new();
        // SAFETY: the strings live for the call, which copies them.
        let status = unsafe { sys::sg_directory_open(context.inner.raw, &raw_options, &mut raw, err.as_mut_ptr()) };
        err.check(status)?;
        Ok(Directory {
            raw,
            context: context.inner.clone(),
        })
    }

    /// The library's handle, for calls this crate does not wrap (through `smartgen::sys`). It stays
    /// owned by this object: do not destroy it, and do not use it after this is dropped.
    pub fn as_raw(&self) -> sys::sg_directory_t {
        self.raw
    }

    /// Publishes the context's signed metadata under `name` (AUTH_FAILED when an engine of another
    /// key holds it).
    pub fn publish(&self, name: &str, timeout: Duration) -> Result<()> {
        let name = c_string("name", name)?;
        check(unsafe { sys::sg_directory_publish(self.raw, name.as_ptr(), nanos(timeout)) })
    }

    /// Removes a name this handle published.
    pub fn unpublish(&self, name: &str, timeout: Duration) -> Result<()> {
        let name = c_string("name", name)?;
        check(unsafe { sys::sg_directory_unpublish(self.raw, name.as_ptr(), nanos(timeout)) })
    }

    /// The metadata blob published under `name` (NOT_FOUND when none).
    pub fn lookup(&self, name: &str, timeout: Duration) -> Result<Vec<u8>> {
        let name = c_string("name", name)?;
        loop {
            let mut len: usize = 0;
            check(unsafe {
                sys::sg_directory_lookup(self.raw, name.as_ptr(), nanos(timeout), ptr::null_mut(), 0, &mut len)
            })?;
            let mut blob = vec![0u8; len + 1];
            let status = unsafe {
                sys::sg_directory_lookup(self.raw, name.as_ptr(), nanos(timeout), blob.as_mut_ptr().cast(), blob.len(), &mut len)
            };
            if status == sys::SG_ERR_BUFFER_TOO_SMALL {
                continue; // republished larger between the two calls
            }
            check(status)?;
            blob.truncate(len);
            return Ok(blob);
        }
    }

    /// A session to the engine published as `name` (its entry must verify under the key).
    pub fn connect(&self, name: &str, timeout: Duration) -> Result<Session> {
        let name = c_string("name", name)?;
        let mut raw: sys::sg_session_t = ptr::null_mut();
        let mut err = ErrorInfo::new();
        let status = unsafe {
            sys::sg_directory_connect(self.raw, name.as_ptr(), ptr::null(), nanos(timeout), &mut raw, err.as_mut_ptr())
        };
        err.check(status)?;
        Ok(Session::wrap(raw, &self.context))
    }

    /// The next session an engine opened to one of this handle's names.
    pub fn accept(&self, timeout: Duration) -> Result<Session> {
        let mut raw: sys::sg_session_t = ptr::null_mut();
        let mut err = ErrorInfo::new();
        let status = unsafe { sys::sg_directory_accept(self.raw, nanos(timeout), &mut raw, err.as_mut_ptr()) };
        err.check(status)?;
        Ok(Session::wrap(raw, &self.context))
    }
}

impl Drop for Directory {
    fn drop(&mut self) {
        // SAFETY: our handle, destroyed once; its context is alive (self.context).
        unsafe { sys::sg_directory_destroy(self.raw) };
    }
}
