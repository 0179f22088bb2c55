//! The cluster directory from Rust, against a one-member etcd started for the test: two contexts
//! that know only the endpoint and a name make a session and move every byte.

mod common;

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use smartgen::{Context, Directory, DirectoryOptions, Status, TransferFlags, TransferOptions};

struct Etcd(Child, std::path::PathBuf);

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
        let _ = std::fs::remove_dir_all(&self.1);
    }
}

/// A port that binds now, below the kernel's ephemeral range: one the kernel handed out and took
/// back could go to another process's socket before etcd binds it.
fn free_port() -> u16 {
    let mut x = std::process::id() as u64 ^ std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    for _ in 0..200 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let port = 20000 + (x % 12000) as u16;
        if let Ok(l) = TcpListener::bind(("127.0.0.1", port)) {
            return l.local_addr().unwrap().port();
        }
    }
    panic!("no free port in 20000-31999");
}

#[test]
fn publish_connect_accept_transfer() {
    if !std::path::Path::new("/usr/bin/etcd").exists() {
        eprintln!("skipped: needs etcd (Debian's etcd-server; scripts/setup-deps.sh installs it)");
        return;
    }
    let client = format!("http://127.0.0.1:{}", free_port());
    let peer = format!("http://127.0.0.1:{}", free_port());
    let dir = std::env::temp_dir().join(format!("etcd-rust-{}", std::process::id()));
    let child = Command::new("/usr/bin/etcd")
        .args(["--name", "m0", "--data-dir", dir.to_str().unwrap(), "--listen-client-urls", &client])
        .args(["--advertise-client-urls", &client, "--listen-peer-urls", &peer])
        .args(["--initial-advertise-peer-urls", &peer, "--initial-cluster", &format!("m0={}", peer)])
        .args(["--log-level", "error", "--logger", "zap"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start etcd");
    let _etcd = Etcd(child, dir);
    let key = random_key();
    let prefill_ctx = Context::new(&options(&key)).unwrap();
    let decode_ctx = Context::new(&options(&key)).unwrap();
    let opts = DirectoryOptions::new(&client).with_lease_ttl(Some(Duration::from_secs(2)));
    let start = Instant::now();
    let (published, by_name) = loop {
        // The member elects itself first.
        let attempt = Directory::open(&prefill_ctx, &opts).and_then(|d| d.publish("prefill/rust-0", TIMEOUT).map(|_| d));
        match attempt {
            Ok(d) => break (d, Directory::open(&decode_ctx, &opts).unwrap()),
            Err(e) if start.elapsed() < Duration::from_secs(20) => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => panic!("etcd never answered: {:?}", e),
        }
    };
    assert!(!by_name.lookup("prefill/rust-0", TIMEOUT).unwrap().is_empty());
    assert_eq!(by_name.lookup("prefill/none", TIMEOUT).err().map(|e| e.status()), Some(Status::NOT_FOUND));
    let (decode, prefill) = std::thread::scope(|scope| {
        let acceptor = scope.spawn(|| published.accept(TIMEOUT));
        let decode = by_name.connect("prefill/rust-0", TIMEOUT).expect("connect by name");
        (decode, acceptor.join().unwrap().expect("accept"))
    });
    let mut src = register(&prefill_ctx, SMALL);
    fill(&mut src, &[0, 1]);
    let dst = register(&decode_ctx, SMALL);
    prefill.export_kv(&src).unwrap();
    decode.export_kv(&dst).unwrap();
    let expected = decode.expect("by-name", &dst, &[0, 1], 32, &TransferOptions::default()).unwrap();
    let all = TransferOptions::default().with_flags(TransferFlags::ALL_LAYERS_WRITTEN);
    let posted = prefill.post("by-name", &src, &[0, 1], 32, &all).unwrap();
    expected.wait(TIMEOUT).unwrap();
    posted.wait(TIMEOUT).unwrap();
    drop((expected, posted));
    assert_eq!(mismatches(&dst, &[0, 1]), 0);
    published.unpublish("prefill/rust-0", TIMEOUT).unwrap();
    assert_eq!(by_name.lookup("prefill/rust-0", TIMEOUT).err().map(|e| e.status()), Some(Status::NOT_FOUND));
}
