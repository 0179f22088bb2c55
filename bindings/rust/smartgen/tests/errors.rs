//! Errors carry the library's status and its sentence, captured in the failing call.

mod common;

use std::time::Duration;

use common::*;
use smartgen::{Context, ContextOptions, Dtype, KvHandle, Pool, Profile, Status, StatusClass, TransferOptions};

#[test]
fn bad_layout_names_the_field() {
    let ctx = Context::new(&options(&random_key())).unwrap();
    let pool = Pool::new(smartgen::PoolLayout {
        num_kv_heads: 0,
        ..SMALL
    })
    .unwrap();
    let err = KvHandle::register(&ctx, pool)
        .err()
        .expect("a layout without KV heads is refused");
    assert_eq!(err.status(), Status::INVALID_LAYOUT);
    assert_eq!(err.class(), StatusClass::Caller);
    assert!(err.message().contains("num_kv_heads"), "message: {}", err.message());

    let pool = Pool::new(smartgen::PoolLayout {
        dtype: Dtype(42),
        ..SMALL
    })
    .unwrap();
    let err = KvHandle::register(&ctx, pool)
        .err()
        .expect("an unknown dtype is refused");
    assert_eq!(err.status(), Status::INVALID_LAYOUT);
    assert!(err.message().contains("dtype"), "message: {}", err.message());
    assert!(err.to_string().starts_with("SG_ERR_INVALID_LAYOUT: "), "{}", err);
}

#[test]
fn bad_context_options_name_the_field() {
    let empty_provider = options(&random_key()).with_provider(Some(String::new()));
    let err = Context::new(&empty_provider).err().expect("provider \"\" is refused");
    assert_eq!(err.status(), Status::INVALID_ARGUMENT);
    assert!(err.message().contains("provider"), "message: {}", err.message());

    let host_name = options(&random_key()).with_local_addr(Some("localhost".into()));
    let err = Context::new(&host_name)
        .err()
        .expect("a host name is not an address literal");
    assert!(err.message().contains("local_addr"), "message: {}", err.message());

    let nul = ContextOptions::default().with_provider(Some("tc\0p".into()));
    assert_eq!(Context::new(&nul).err().unwrap().status(), Status::INVALID_ARGUMENT);
}

#[test]
fn calls_without_error_struct_still_carry_the_message() {
    let key = random_key();
    let a = Context::new(&options(&key)).unwrap();
    let b = Context::new(&options(&key)).unwrap();
    let (_prefill, decode) = connect(&a, &b);
    let dst = register(&b, SMALL);
    decode.export_kv(&dst).unwrap();

    // Block 32 is past a 32-block pool: refused before anything moves.
    let err = decode
        .expect("r", &dst, &[32], 16, &TransferOptions::default())
        .err()
        .unwrap();
    assert_eq!(err.status(), Status::OUT_OF_RANGE);
    assert!(!err.message().is_empty());

    let expected = decode.expect("r", &dst, &[3], 16, &TransferOptions::default()).unwrap();
    let dup = decode
        .expect("r", &dst, &[4], 16, &TransferOptions::default())
        .err()
        .unwrap();
    assert_eq!(dup.status(), Status::DUPLICATE);

    // sg_transfer_layer_written takes no error struct: the thread's message is read in the call.
    let err = expected.layer_written(0).unwrap_err();
    assert_eq!(err.status(), Status::INVALID_STATE);
    assert!(!err.message().is_empty(), "{:?}", err);
    assert_eq!(expected.layer_state(99).unwrap_err().status(), Status::OUT_OF_RANGE);

    let timeout = expected.wait(Duration::from_millis(1)).unwrap_err();
    assert!(timeout.is_timeout());
    assert_eq!(timeout.class(), StatusClass::Resource);
    assert!(!expected.test().unwrap());
}

#[test]
fn profile_errors_name_the_field() {
    let err = Profile::parse(r#"{"version":1,"model":"m","num_layers":0}"#).unwrap_err();
    assert_eq!(err.status(), Status::INVALID_ARGUMENT);
    assert!(!err.message().is_empty());
    let missing = Profile::load(std::path::Path::new("/nonexistent/profile.json")).unwrap_err();
    assert_eq!(missing.status(), Status::NOT_FOUND);
}

#[test]
fn unknown_status_codes_keep_their_number_and_range() {
    let newer = Status(-150);
    assert_eq!(newer.name(), "SG_STATUS_UNKNOWN");
    assert_eq!(newer.class(), StatusClass::Resource);
    assert_eq!(newer.to_string(), "SG_STATUS_UNKNOWN (-150)");
    assert_eq!(Status(-250).class(), StatusClass::Peer);
    assert_eq!(Status(-42).class(), StatusClass::Caller);
    assert_eq!(Status(-350).class(), StatusClass::Unsupported);
    assert_eq!(Status::INTERNAL.class(), StatusClass::Internal);
    assert_eq!(Status(-1000).class(), StatusClass::Internal);
    assert_eq!(Status(7).class(), StatusClass::Internal);
    assert_eq!(Status::TIMEOUT.name(), "SG_ERR_TIMEOUT");
}

#[test]
fn version_matches_the_header_major() {
    assert_eq!(smartgen::version_number() / 10000, smartgen::HEADER_VERSION / 10000);
    assert!(smartgen::version().starts_with("0."));
}

/// `as_raw` hands the library's handle to calls the crate does not wrap, and options are built with
/// `with_*` (the structs are `#[non_exhaustive]`, so an appended field is not a breaking release).
#[test]
fn raw_handles_reach_the_sys_layer_and_options_build_with_with() {
    let ctx = Context::new(&options(&random_key()).with_peer_timeout_ms(3000)).unwrap();
    let mut fd: i32 = -1;
    // SAFETY: a live context's handle and a valid out-pointer.
    let status = unsafe { smartgen::sys::sg_context_event_fd(ctx.as_raw(), &mut fd) };
    assert_eq!(status, smartgen::sys::SG_OK);
    assert!(fd >= 0);
    let kv = register(&ctx, SMALL);
    assert!(!kv.as_raw().is_null());
}
