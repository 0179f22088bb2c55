//! Selection profiles (JSON, docs/profiles.md): immutable once made and safe to share.

use std::os::raw::c_char;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::ptr;
use std::sync::Arc;

use smartgen_sys as sys;

use crate::error::{Error, ErrorInfo, Result};
use crate::status::Status;

struct ProfileInner {
    raw: sys::sg_profile_t,
}

// SAFETY: a profile is immutable and thread-safe to share (header).
unsafe impl Send for ProfileInner {}
unsafe impl Sync for ProfileInner {}

impl Drop for ProfileInner {
    fn drop(&mut self) {
        unsafe { sys::sg_profile_destroy(self.raw) };
    }
}

/// A selection profile. Clones share it. Send and Sync.
#[derive(Clone)]
pub struct Profile {
    inner: Arc<ProfileInner>,
}

impl std::fmt::Debug for Profile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Profile({:p})", self.inner.raw)
    }
}

impl Profile {
    /// The library's handle, for calls this crate does not wrap (through `smartgen::sys`). It stays
    /// owned by this object: do not destroy or release it, and do not use it after this is dropped.
    pub fn as_raw(&self) -> sys::sg_profile_t {
        self.inner.raw
    }

    /// Parses JSON text. INVALID_ARGUMENT names the bad field ("defaults.budget: ...").
    pub fn parse(json: &str) -> Result<Profile> {
        let mut raw: sys::sg_profile_t = ptr::null_mut();
        let mut err = ErrorInfo::new();
        let status =
            unsafe { sys::sg_profile_parse(json.as_ptr() as *const c_char, json.len(), &mut raw, err.as_mut_ptr()) };
        err.check(status)?;
        Ok(Profile {
            inner: Arc::new(ProfileInner { raw }),
        })
    }

    /// Reads and parses a profile file (NOT_FOUND when it cannot be read).
    pub fn load(path: &Path) -> Result<Profile> {
        let path = std::ffi::CString::new(path.as_os_str().as_bytes())
            .map_err(|_| Error::new(Status::INVALID_ARGUMENT, "path contains a NUL byte"))?;
        let mut raw: sys::sg_profile_t = ptr::null_mut();
        let mut err = ErrorInfo::new();
        let status = unsafe { sys::sg_profile_load(path.as_ptr(), &mut raw, err.as_mut_ptr()) };
        err.check(status)?;
        Ok(Profile {
            inner: Arc::new(ProfileInner { raw }),
        })
    }

    /// The profile in canonical JSON.
    pub fn to_json(&self) -> Result<String> {
        let raw = self.inner.raw;
        let bytes = crate::buffer::read_sized(
            |buf, cap, len| unsafe { sys::sg_profile_to_json(raw, buf as *mut c_char, cap, len) },
            1,
        )?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    pub(crate) fn raw(&self) -> sys::sg_profile_t {
        self.inner.raw
    }
}
