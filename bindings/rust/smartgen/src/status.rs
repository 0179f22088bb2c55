//! Statuses: the library's int32_t codes, kept as numbers so that a code a newer library adds
//! survives the trip (a Rust enum could not hold it).

use std::ffi::CStr;
use std::fmt;

use smartgen_sys as sys;

/// A SmartGen status code (`sg_status_t`). The constants name the codes this binding was generated
/// with; any other value is still a valid `Status` and is understood by its [`class`](Status::class).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Status(pub i32);

/// What the caller should do about a status: the pinned ranges of the header's Conventions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StatusClass {
    Ok,
    InProgress,
    /// -1..-99: the call was wrong; fix it.
    Caller,
    /// -100..-199: out of resources or not yet; retry later or with less.
    Resource,
    /// -200..-299: the peer, the network or a deadline.
    Peer,
    /// -300..-399: not supported by this build, provider or memory kind.
    Unsupported,
    /// Any other value (SG_ERR_INTERNAL, or a code outside every range).
    Internal,
}

impl Status {
    pub const OK: Status = Status(sys::SG_OK);
    pub const IN_PROGRESS: Status = Status(sys::SG_IN_PROGRESS);
    pub const INVALID_ARGUMENT: Status = Status(sys::SG_ERR_INVALID_ARGUMENT);
    pub const INVALID_HANDLE: Status = Status(sys::SG_ERR_INVALID_HANDLE);
    pub const INVALID_LAYOUT: Status = Status(sys::SG_ERR_INVALID_LAYOUT);
    pub const LAYOUT_MISMATCH: Status = Status(sys::SG_ERR_LAYOUT_MISMATCH);
    pub const OUT_OF_RANGE: Status = Status(sys::SG_ERR_OUT_OF_RANGE);
    pub const BUFFER_TOO_SMALL: Status = Status(sys::SG_ERR_BUFFER_TOO_SMALL);
    pub const INVALID_STATE: Status = Status(sys::SG_ERR_INVALID_STATE);
    pub const DUPLICATE: Status = Status(sys::SG_ERR_DUPLICATE);
    pub const VERSION_MISMATCH: Status = Status(sys::SG_ERR_VERSION_MISMATCH);
    pub const NOT_FOUND: Status = Status(sys::SG_ERR_NOT_FOUND);
    pub const NO_MEMORY: Status = Status(sys::SG_ERR_NO_MEMORY);
    pub const AGAIN: Status = Status(sys::SG_ERR_AGAIN);
    pub const TIMEOUT: Status = Status(sys::SG_ERR_TIMEOUT);
    pub const CANCELED: Status = Status(sys::SG_ERR_CANCELED);
    pub const TRANSPORT: Status = Status(sys::SG_ERR_TRANSPORT);
    pub const PEER_LOST: Status = Status(sys::SG_ERR_PEER_LOST);
    pub const PROTOCOL: Status = Status(sys::SG_ERR_PROTOCOL);
    pub const DEADLINE: Status = Status(sys::SG_ERR_DEADLINE);
    pub const CONNECT: Status = Status(sys::SG_ERR_CONNECT);
    pub const REMOTE: Status = Status(sys::SG_ERR_REMOTE);
    pub const AUTH_FAILED: Status = Status(sys::SG_ERR_AUTH_FAILED);
    pub const AUTH_REQUIRED: Status = Status(sys::SG_ERR_AUTH_REQUIRED);
    pub const LEASE_EXPIRED: Status = Status(sys::SG_ERR_LEASE_EXPIRED);
    pub const UNSUPPORTED: Status = Status(sys::SG_ERR_UNSUPPORTED);
    pub const NO_PROVIDER: Status = Status(sys::SG_ERR_NO_PROVIDER);
    pub const INTERNAL: Status = Status(sys::SG_ERR_INTERNAL);

    pub fn code(self) -> i32 {
        self.0
    }

    pub fn is_ok(self) -> bool {
        self.0 == sys::SG_OK
    }

    /// The library's name of the code ("SG_ERR_TIMEOUT"); "SG_STATUS_UNKNOWN" for a code the
    /// loaded library does not know.
    pub fn name(self) -> &'static str {
        // SAFETY: sg_status_str returns a static NUL-terminated string for every value.
        let name = unsafe { CStr::from_ptr(sys::sg_status_str(self.0)) };
        name.to_str().unwrap_or("SG_STATUS_UNKNOWN")
    }

    pub fn class(self) -> StatusClass {
        match self.0 {
            0 => StatusClass::Ok,
            1 => StatusClass::InProgress,
            -99..=-1 => StatusClass::Caller,
            -199..=-100 => StatusClass::Resource,
            -299..=-200 => StatusClass::Peer,
            // SG_ERR_INTERNAL sits at the end of the unsupported range but is not "unsupported".
            -399..=-300 if self.0 != sys::SG_ERR_INTERNAL => StatusClass::Unsupported,
            _ => StatusClass::Internal,
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name(), self.0)
    }
}

impl fmt::Debug for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Status({}, {})", self.name(), self.0)
    }
}
