//! The error type, and the two ways a failing call's message is captured: the per-call
//! sg_error_info_t of the calls that take one, and, for the others, the thread-local
//! sg_last_error_message read inside the same wrapper function, before anything else can run on
//! this thread and replace it.

use std::ffi::CStr;
use std::fmt;
use std::os::raw::c_char;

use smartgen_sys as sys;

use crate::status::{Status, StatusClass};

/// A failed SmartGen call: its status and the library's sentence about it.
#[derive(Clone, PartialEq, Eq)]
pub struct Error {
    status: Status,
    message: String,
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn new(status: Status, message: impl Into<String>) -> Error {
        Error {
            status,
            message: message.into(),
        }
    }

    pub fn status(&self) -> Status {
        self.status
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    pub fn class(&self) -> StatusClass {
        self.status.class()
    }

    /// The wait's own timeout passed; the object is as it was and the wait may be repeated.
    pub fn is_timeout(&self) -> bool {
        self.status == Status::TIMEOUT
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.message.is_empty() {
            write!(f, "{}", self.status.name())
        } else {
            write!(f, "{}: {}", self.status.name(), self.message)
        }
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Error({}, {:?})", self.status, self.message)
    }
}

impl std::error::Error for Error {}

/// Ok for SG_OK; otherwise the error with this thread's last error message. Call it on the status
/// of the FFI call just made, with nothing in between.
pub(crate) fn check(status: sys::sg_status_t) -> Result<()> {
    if status == sys::SG_OK {
        Ok(())
    } else {
        Err(last_error(status))
    }
}

pub(crate) fn last_error(status: sys::sg_status_t) -> Error {
    // SAFETY: the pointer is valid until this thread's next failing call, and is copied at once.
    let message = unsafe { text(sys::sg_last_error_message()) };
    Error::new(Status(status), message)
}

/// An sg_error_info_t for one call.
pub(crate) struct ErrorInfo(sys::sg_error_info_t);

impl ErrorInfo {
    pub(crate) fn new() -> ErrorInfo {
        // SAFETY: a zeroed sg_error_info_t is valid; init sets struct_size.
        let mut info: sys::sg_error_info_t = unsafe { std::mem::zeroed() };
        unsafe { sys::sg_error_info_init_sized(&mut info, std::mem::size_of::<sys::sg_error_info_t>()) };
        ErrorInfo(info)
    }

    pub(crate) fn as_mut_ptr(&mut self) -> *mut sys::sg_error_info_t {
        &mut self.0
    }

    /// Ok for SG_OK; otherwise the error with the message the call wrote (or, should it have left
    /// the struct empty, the thread's last error message, which the same call set).
    pub(crate) fn check(&self, status: sys::sg_status_t) -> Result<()> {
        if status == sys::SG_OK {
            return Ok(());
        }
        let message = char_array_text(&self.0.message);
        if message.is_empty() {
            return Err(last_error(status));
        }
        Err(Error::new(Status(status), message))
    }
}

/// Text of a NUL-terminated C string, lossily UTF-8; "" for NULL.
///
/// # Safety
/// `ptr` is NULL or points to a NUL-terminated string valid for the call.
pub(crate) unsafe fn text(ptr: *const c_char) -> String {
    if ptr.is_null() {
        return String::new();
    }
    CStr::from_ptr(ptr).to_string_lossy().into_owned()
}

/// Text of a char array the library filled, up to its first NUL (or the whole array).
pub(crate) fn char_array_text(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// A C string of a caller's text; text with a NUL byte cannot cross the ABI and is refused as the
/// library refuses a malformed argument.
pub(crate) fn c_string(what: &str, value: &str) -> Result<std::ffi::CString> {
    std::ffi::CString::new(value)
        .map_err(|_| Error::new(Status::INVALID_ARGUMENT, format!("{} contains a NUL byte", what)))
}
