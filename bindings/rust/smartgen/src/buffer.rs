//! The header's caller-buffer rule in one place: ask for the size with (NULL, 0), allocate, fill,
//! and ask again when the value grew in between (SG_ERR_BUFFER_TOO_SMALL).

use smartgen_sys as sys;

use crate::error::{last_error, Result};

/// Runs `call(buf, cap, &mut len)` by the rule; `extra` is the room past `len` the buffer needs
/// (1 for text, whose NUL the size excludes). Returns the `len` bytes.
pub(crate) fn read_sized<F>(mut call: F, extra: usize) -> Result<Vec<u8>>
where
    F: FnMut(*mut u8, usize, *mut usize) -> sys::sg_status_t,
{
    let mut len = 0usize;
    let status = call(std::ptr::null_mut(), 0, &mut len);
    if status != sys::SG_OK {
        return Err(last_error(status));
    }
    loop {
        let mut buf = vec![0u8; len + extra];
        let status = call(buf.as_mut_ptr(), buf.len(), &mut len);
        if status == sys::SG_OK {
            buf.truncate(len);
            return Ok(buf);
        }
        if status != sys::SG_ERR_BUFFER_TOO_SMALL {
            return Err(last_error(status));
        }
    }
}
