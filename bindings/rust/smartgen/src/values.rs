//! The header's named constants as newtypes over their fixed-width integers. Like Status, they are
//! not Rust enums: the library may hand back a value this binding does not name (a new event kind,
//! say), and such a value must stay representable.

use std::fmt;
use std::ops::{BitOr, BitOrAssign};

use smartgen_sys as sys;

macro_rules! value_type {
    ($(#[$doc:meta])* $name:ident { $($(#[$cdoc:meta])* $konst:ident = $value:expr,)* }) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
        pub struct $name(pub u32);

        impl $name {
            $($(#[$cdoc])* pub const $konst: $name = $name($value);)*

            /// The constant's name, or None for a value this binding does not name.
            pub fn name(self) -> Option<&'static str> {
                match self {
                    $($name::$konst => Some(stringify!($konst)),)*
                    _ => None,
                }
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                match self.name() {
                    Some(name) => write!(f, "{}::{}", stringify!($name), name),
                    None => write!(f, "{}({})", stringify!($name), self.0),
                }
            }
        }
    };
}

macro_rules! bits_type {
    ($(#[$doc:meta])* $name:ident { $($(#[$cdoc:meta])* $konst:ident = $value:expr,)* }) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, Default, Debug)]
        pub struct $name(pub u32);

        impl $name {
            $($(#[$cdoc])* pub const $konst: $name = $name($value);)*

            pub fn bits(self) -> u32 {
                self.0
            }

            /// Every bit of `other` is set in `self`.
            pub fn contains(self, other: $name) -> bool {
                self.0 & other.0 == other.0
            }
        }

        impl BitOr for $name {
            type Output = $name;
            fn bitor(self, other: $name) -> $name {
                $name(self.0 | other.0)
            }
        }

        impl BitOrAssign for $name {
            fn bitor_assign(&mut self, other: $name) {
                self.0 |= other.0;
            }
        }
    };
}

value_type! {
    /// Element type of the KV cache (`sg_dtype_t`).
    Dtype {
        FP32 = sys::SG_DTYPE_FP32,
        FP16 = sys::SG_DTYPE_FP16,
        BF16 = sys::SG_DTYPE_BF16,
        FP8_E4M3 = sys::SG_DTYPE_FP8_E4M3,
    }
}

value_type! {
    /// How a transfer's KV travels (`sg_wire_quant_t`, since 0.3): as the pools hold it, or as
    /// one-byte codes with a scale per block, plane and KV head (lossy; both sides the same).
    WireQuant {
        NONE = sys::SG_WIRE_QUANT_NONE,
        INT8 = sys::SG_WIRE_QUANT_INT8,
        FP8_E4M3 = sys::SG_WIRE_QUANT_FP8_E4M3,
    }
}

value_type! {
    /// Order of the elements inside one K or V plane of a block (`sg_block_order_t`).
    BlockOrder {
        /// `[token][kv_head][head_dim]`, as vLLM lays it out.
        TOKEN_MAJOR = sys::SG_BLOCK_TOKEN_MAJOR,
        /// `[kv_head][token][head_dim]`.
        HEAD_MAJOR = sys::SG_BLOCK_HEAD_MAJOR,
    }
}

value_type! {
    /// Kind of a transfer event (`sg_event_kind_t`); ignore the kinds you do not know.
    EventKind {
        LAYER_READY = sys::SG_EVENT_LAYER_READY,
        FINISHED = sys::SG_EVENT_FINISHED,
        QUIESCED = sys::SG_EVENT_QUIESCED,
        ESSENTIAL_READY = sys::SG_EVENT_ESSENTIAL_READY,
        BLOCKS_READY = sys::SG_EVENT_BLOCKS_READY,
        LEASE_EXPIRED = sys::SG_EVENT_LEASE_EXPIRED,
    }
}

value_type! {
    /// Log level of a context (`sg_log_level_t`); DEFAULT means WARN.
    LogLevel {
        DEFAULT = sys::SG_LOG_DEFAULT,
        OFF = sys::SG_LOG_OFF,
        ERROR = sys::SG_LOG_ERROR,
        WARN = sys::SG_LOG_WARN,
        INFO = sys::SG_LOG_INFO,
        DEBUG = sys::SG_LOG_DEBUG,
    }
}

bits_type! {
    /// Paths a transfer uses (SG_PATH_*); empty means FULL.
    Paths {
        /// Every block, layer by layer as layers are written. Excludes the others.
        FULL = sys::SG_PATH_FULL,
        /// Each layer's essential blocks (by the profile) and page digests, as it is written.
        PROACTIVE = sys::SG_PATH_PROACTIVE,
        /// The decode side fetches the blocks it lacks (Transfer::fetch).
        ON_DEMAND = sys::SG_PATH_ON_DEMAND,
        /// Whatever was not sent goes in the background at the lowest priority.
        SPECULATIVE = sys::SG_PATH_SPECULATIVE,
    }
}

bits_type! {
    /// Flags of a transfer (SG_TRANSFER_*).
    TransferFlags {
        /// Post side: every layer is already written; send at once.
        ALL_LAYERS_WRITTEN = sys::SG_TRANSFER_ALL_LAYERS_WRITTEN,
    }
}

bits_type! {
    /// Readiness bits of one layer of a transfer (SG_LAYER_*).
    LayerState {
        /// Prefill side: the engine marked the layer written.
        WRITTEN = sys::SG_LAYER_WRITTEN,
        /// Prefill: all its bytes delivered; decode: all its bytes in place.
        READY = sys::SG_LAYER_READY,
        /// Proactive path: the layer's essential blocks and digests delivered or in place.
        ESSENTIAL = sys::SG_LAYER_ESSENTIAL,
    }
}
