//! Transfer events: the C callback (a trampoline on the library's progress thread) copies each
//! sg_event_t into an owned `Event` and hands it to the context's handler. Nothing may unwind into
//! C, so the handler runs under catch_unwind.

use std::os::raw::c_void;
use std::panic::{self, AssertUnwindSafe};

use smartgen_sys as sys;

use crate::error::text;
use crate::status::Status;
use crate::transfer::TransferRef;
use crate::values::EventKind;

pub(crate) type EventHandler = Box<dyn Fn(&Event) + Send + Sync>;

/// One transfer event, owned.
pub struct Event {
    pub kind: EventKind,
    /// The layer, for the per-layer kinds; 0 otherwise.
    pub layer: u32,
    /// OK, or how the transfer (FINISHED, QUIESCED) or fetch (BLOCKS_READY) ended.
    pub status: Status,
    pub request_id: String,
    /// BLOCKS_READY: the logical blocks of the fetch; empty otherwise.
    pub blocks: Vec<u32>,
    transfer: TransferRef,
    // True only for the event the handler is given during the callback: the transfer handle is
    // then known to be unreleased (the library delivers no event of a released transfer).
    in_callback: bool,
}

impl Clone for Event {
    /// A copy, e.g. to keep or send elsewhere; `transfer()` is None on it.
    fn clone(&self) -> Event {
        Event {
            kind: self.kind,
            layer: self.layer,
            status: self.status,
            request_id: self.request_id.clone(),
            blocks: self.blocks.clone(),
            transfer: TransferRef::new(self.transfer.raw()),
            in_callback: false,
        }
    }
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Event")
            .field("kind", &self.kind)
            .field("layer", &self.layer)
            .field("status", &self.status)
            .field("request_id", &self.request_id)
            .field("blocks", &self.blocks)
            .field("transfer_id", &self.transfer_id())
            .finish()
    }
}

impl Event {
    /// The transfer's identity, equal to `Transfer::id()` of the handle it is about.
    pub fn transfer_id(&self) -> u64 {
        self.transfer.id()
    }

    /// Inside the handler: the transfer, for its non-blocking calls (layer_state, status, fetch,
    /// cancel, ...). None on a copy of the event.
    pub fn transfer(&self) -> Option<&TransferRef> {
        if self.in_callback {
            Some(&self.transfer)
        } else {
            None
        }
    }

    /// # Safety
    /// `raw` is an event the library passed to the callback (its pointers valid for the call).
    unsafe fn from_raw(raw: &sys::sg_event_t) -> Event {
        // Every field read here exists since sg_event_t itself (0.2); a newer library only
        // appends fields, which this copy ignores.
        let blocks = if raw.blocks.is_null() || raw.num_blocks == 0 {
            Vec::new()
        } else {
            std::slice::from_raw_parts(raw.blocks, raw.num_blocks).to_vec()
        };
        Event {
            kind: EventKind(raw.kind),
            layer: raw.layer,
            status: Status(raw.status),
            request_id: text(raw.request_id),
            blocks,
            transfer: TransferRef::new(raw.transfer),
            in_callback: true,
        }
    }
}

/// The sg_event_fn of every context with a handler; `user` is the context's `EventHandler`.
pub(crate) unsafe extern "C" fn trampoline(user: *mut c_void, raw: *const sys::sg_event_t) {
    if user.is_null() || raw.is_null() {
        return;
    }
    // A panic in the handler must not unwind into the library's thread: the event is dropped.
    let _ = panic::catch_unwind(AssertUnwindSafe(|| {
        let handler = &*(user as *const EventHandler);
        let event = Event::from_raw(&*raw);
        handler(&event);
    }));
}
