//! The Rust interop program (docs/bindings.md, "The interop program"): one side of a transfer that
//! any other language's program can be the other side of. It follows examples/interop/interop.c,
//! the reference, step by step:
//!
//!   decode                                         prefill
//!   expect "interop-full"  ->  notify "ready interop-full"  ->  post (all layers written)
//!   wait, check every byte                         wait (completes on decode's confirmation)
//!   expect "interop-selective"  ->  notify  ->     refill with request 1's bytes, post with profile
//!   wait ESSENTIAL per layer, fetch 3 blocks,      wait
//!   wait (speculative brings the rest), check
//!   --calls: layer_state loop on request 0's live transfer
//!   graceful session close on both sides; everything else is released by Drop
//!
//! One line goes to stdout at the end; progress goes to stderr.

mod args;
mod bytes;
mod failure;

use std::process::exit;
use std::thread::sleep;
use std::time::{Duration, Instant};

use smartgen::{
    Context, ContextOptions, KvHandle, LayerState, Listener, Paths, Profile, Session, Status, Transfer,
    TransferFlags, TransferOptions,
};

use args::Config;
use bytes::{Pattern, REQUEST_IDS, REQ_FULL, REQ_SELECTIVE};
use failure::Failure;

/// Between connects refused while the peer's listener starts, and between notification polls.
const CONNECT_RETRY: Duration = Duration::from_millis(50);
const NOTIFY_POLL: Duration = Duration::from_micros(200);

const PROFILE_BEFORE_LAYERS: &str = r#"{"version":1,"model":"interop","num_layers":"#;
const PROFILE_AFTER_LAYERS: &str = r#","num_kv_heads":8,"block_tokens":16,"defaults":{"policy":"sinks_recent","budget":{"fraction":0.125},"sinks":16,"recent":64}}"#;

struct Outcome {
    bytes: u64,
    full_s: f64,
    calls_ns: f64,
}

struct Run<'a> {
    cfg: &'a Config,
    timeout: Duration,
    table: Vec<u32>,
    pattern: Pattern,
    session: Session,
    kv: KvHandle,
    bytes: u64,
}

fn progress(role: &str, line: &str) {
    eprintln!("[rust {}] {}", role, line);
}

fn open_session(cfg: &Config, ctx: &Context, timeout: Duration) -> Result<Session, Failure> {
    if cfg.listen {
        let listener = Listener::bind(ctx, &cfg.addr, cfg.port).map_err(Failure::call("sg_listener_create"))?;
        let port = listener.port().map_err(Failure::call("sg_listener_port"))?;
        progress(cfg.role, &format!("listening on {}:{}", cfg.addr, port));
        // One peer is all this program takes; the session outlives its listener.
        return listener.accept(timeout).map_err(Failure::call("sg_session_accept"));
    }
    // The programs start independently: a refused connect is retried until --timeout-s.
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match Session::connect(ctx, &cfg.addr, cfg.port, left) {
            Err(e) if e.status() == Status::CONNECT && Instant::now() + CONNECT_RETRY < deadline => {
                sleep(CONNECT_RETRY)
            }
            result => return result.map_err(Failure::call("sg_session_connect")),
        }
    }
}

impl<'a> Run<'a> {
    fn request_bytes(&self) -> u64 {
        bytes::request_bytes(self.cfg)
    }

    fn wait_failure(&self, call: &'a str, request: usize) -> impl FnOnce(smartgen::Error) -> Failure + 'a {
        Failure::wait(call, REQUEST_IDS[request], self.timeout)
    }

    /// Prefill: polls for "ready <id>", looking at the session's health in between.
    fn await_ready(&self, request: usize) -> Result<(), Failure> {
        let want = format!("ready {}", REQUEST_IDS[request]);
        let deadline = Instant::now() + self.timeout;
        loop {
            if let Some(mut note) = self
                .session
                .next_notification()
                .map_err(Failure::call("sg_session_next_notification"))?
            {
                // A peer that sends a trailing NUL is read as one that does not.
                if note.last() == Some(&0) {
                    note.pop();
                }
                if note == want.as_bytes() {
                    return Ok(());
                }
                let got = String::from_utf8_lossy(&note).chars().take(200).collect::<String>();
                return Err(Failure::new(
                    "SG_ERR_PROTOCOL",
                    format!("expected the notification '{}', got '{}'", want, got),
                ));
            }
            if let Some(lost) = self.session.error().map_err(Failure::call("sg_session_error"))? {
                return Err(Failure::new(
                    lost.status().name(),
                    format!("session lost while waiting for '{}': {}", want, lost.message()),
                ));
            }
            if Instant::now() >= deadline {
                return Err(Failure::new(
                    "SG_ERR_TIMEOUT",
                    format!("no '{}' notification within --timeout-s {}", want, self.cfg.timeout_s),
                ));
            }
            sleep(NOTIFY_POLL);
        }
    }

    /// Prefill: waits for the decode side's ready, posts, waits for the confirmation, releases.
    /// Returns the seconds from the post to the completion.
    fn post(&mut self, request: usize, profile: Option<Profile>) -> Result<f64, Failure> {
        self.await_ready(request)?;
        let paths = if profile.is_some() {
            Paths::PROACTIVE | Paths::ON_DEMAND | Paths::SPECULATIVE
        } else {
            Paths::FULL
        };
        let options = TransferOptions::default()
            .with_paths(paths)
            .with_flags(TransferFlags::ALL_LAYERS_WRITTEN)
            .with_profile(profile);
        let start = Instant::now();
        let transfer = self
            .session
            .post(
                REQUEST_IDS[request],
                &self.kv,
                &self.table,
                u64::from(self.cfg.tokens),
                &options,
            )
            .map_err(Failure::call("sg_transfer_post"))?;
        transfer
            .wait(self.timeout)
            .map_err(self.wait_failure("sg_transfer_wait", request))?;
        let seconds = start.elapsed().as_secs_f64();
        self.bytes += self.request_bytes();
        progress(
            self.cfg.role,
            &format!("{} delivered and confirmed", REQUEST_IDS[request]),
        );
        // Released at once: the blocks are refilled for the next request.
        transfer.release().map_err(Failure::call("sg_transfer_release"))?;
        Ok(seconds)
    }

    fn run_prefill(&mut self) -> Result<Outcome, Failure> {
        // Request 0's bytes were written before the session was made (see run).
        let full_s = self.post(REQ_FULL, None)?;
        if self.cfg.selective {
            self.pattern.fill(self.kv.pool_mut().expect("no transfer holds the pool"), &self.table, REQ_SELECTIVE);
            let json = format!("{}{}{}", PROFILE_BEFORE_LAYERS, self.cfg.layers, PROFILE_AFTER_LAYERS);
            let profile = Profile::parse(&json).map_err(Failure::call("sg_profile_parse"))?;
            self.post(REQ_SELECTIVE, Some(profile))?;
        }
        Ok(Outcome {
            bytes: self.bytes,
            full_s,
            calls_ns: 0.0,
        })
    }

    /// Decode: clears the destination, expects, then tells the prefill side it may post.
    fn expect(&mut self, request: usize) -> Result<(Transfer, Instant), Failure> {
        Pattern::clear(self.kv.pool_mut().expect("no transfer holds the pool"), &self.table);
        // Default options: the decode side follows the paths of the post, learned at the match.
        let start = Instant::now();
        let transfer = self
            .session
            .expect(
                REQUEST_IDS[request],
                &self.kv,
                &self.table,
                u64::from(self.cfg.tokens),
                &TransferOptions::default(),
            )
            .map_err(Failure::call("sg_transfer_expect"))?;
        let ready = format!("ready {}", REQUEST_IDS[request]);
        self.session
            .notify(ready.as_bytes())
            .map_err(Failure::call("sg_session_notify"))?;
        Ok((transfer, start))
    }

    fn verify(&mut self, request: usize) -> Result<(), Failure> {
        self.pattern.verify(self.kv.pool(), &self.table, request)?;
        self.bytes += self.request_bytes();
        Ok(())
    }

    fn receive_selective(&mut self) -> Result<(), Failure> {
        let (x, start) = self.expect(REQ_SELECTIVE)?;
        for layer in 0..self.cfg.layers {
            x.wait_layer_state(layer, LayerState::ESSENTIAL, self.timeout)
                .map_err(self.wait_failure("sg_transfer_wait_layer_state(SG_LAYER_ESSENTIAL)", REQ_SELECTIVE))?;
        }
        let n = self.cfg.n();
        let fetch = [1, n / 2, n - 2];
        x.fetch(0, &fetch).map_err(Failure::call("sg_transfer_fetch"))?;
        x.wait_blocks(0, &fetch, self.timeout)
            .map_err(self.wait_failure("sg_transfer_wait_blocks", REQ_SELECTIVE))?;
        // The speculative path brings whatever the proactive path and the fetch did not.
        x.wait(self.timeout)
            .map_err(self.wait_failure("sg_transfer_wait", REQ_SELECTIVE))?;
        self.verify(REQ_SELECTIVE)?;
        let stats = x.stats().map_err(Failure::call("sg_transfer_stats"))?;
        progress(
            self.cfg.role,
            &format!(
                "{}: every byte checked ({:.3} s); bytes proactive {}, on demand {}, speculative {}; {} fetch requests",
                REQUEST_IDS[REQ_SELECTIVE],
                start.elapsed().as_secs_f64(),
                stats.bytes_proactive,
                stats.bytes_on_demand,
                stats.bytes_speculative,
                stats.fetch_requests
            ),
        );
        x.release().map_err(Failure::call("sg_transfer_release"))
    }

    /// The cost of one call through the binding: a non-blocking query on a live, completed transfer.
    fn measure_calls(&self, x: &Transfer) -> Result<f64, Failure> {
        let start = Instant::now();
        let mut state = LayerState::default();
        for _ in 0..self.cfg.calls {
            state = x.layer_state(0).map_err(Failure::call("sg_transfer_layer_state"))?;
        }
        let ns = start.elapsed().as_secs_f64() * 1e9 / self.cfg.calls as f64;
        if !state.contains(LayerState::READY) {
            return Err(Failure::new(
                "SG_ERR_INVALID_STATE",
                format!("layer 0 of a completed transfer reads state 0x{:x}", state.bits()),
            ));
        }
        progress(
            self.cfg.role,
            &format!("{} calls of layer_state: {:.1} ns each", self.cfg.calls, ns),
        );
        Ok(ns)
    }

    fn run_decode(&mut self) -> Result<Outcome, Failure> {
        let (full, start) = self.expect(REQ_FULL)?;
        full.wait(self.timeout)
            .map_err(self.wait_failure("sg_transfer_wait", REQ_FULL))?;
        let full_s = start.elapsed().as_secs_f64();
        self.verify(REQ_FULL)?;
        progress(
            self.cfg.role,
            &format!("{}: every byte checked ({:.3} s)", REQUEST_IDS[REQ_FULL], full_s),
        );
        let calls_ns = if self.cfg.calls > 0 {
            self.measure_calls(&full)?
        } else {
            0.0
        };
        // Released before the selective request clears the pool: pool_mut refuses while a
        // transfer holds it.
        full.release().map_err(Failure::call("sg_transfer_release"))?;
        if self.cfg.selective {
            self.receive_selective()?;
        }
        Ok(Outcome {
            bytes: self.bytes,
            full_s,
            calls_ns,
        })
    }
}

fn run(cfg: &Config) -> Result<Outcome, Failure> {
    let timeout = Duration::from_secs(u64::from(cfg.timeout_s));
    let table = bytes::table(cfg);
    let pattern = Pattern::new();
    // Declared before the KvHandle and the Run, so dropped after them: the memory outlives its use.
    let memory = bytes::HostMemory::new(cfg)?;
    let mut pool = memory.pool(cfg).map_err(Failure::call("sg_kv_layout_validate"))?;
    // The prefill side writes request 0 before it has a session, so the decode side's full_s (from
    // its expect) counts the transfer and the ready round trip, not the time the peer took to write.
    if cfg.prefill {
        pattern.fill(&mut pool, &table, REQ_FULL);
    }
    // Provider tcp;ofi_rxm on 127.0.0.1; no auth_key: the library reads SG_AUTH_KEY_FILE.
    let options = ContextOptions::default().with_provider(Some("tcp".into()));
    let ctx = Context::new(&options).map_err(Failure::call("sg_context_create"))?;
    let kv = KvHandle::register(&ctx, pool).map_err(Failure::call("sg_kv_register"))?;
    let session = open_session(cfg, &ctx, timeout)?;
    // Right after the session is made, as the spec says: the peer can address our pool from now on.
    session.export_kv(&kv).map_err(Failure::call("sg_session_export_kv"))?;
    let provider = session.provider().map_err(Failure::call("sg_session_provider"))?;
    progress(
        cfg.role,
        &format!("session with {}:{} over {}", cfg.addr, cfg.port, provider),
    );
    let mut run = Run {
        cfg,
        timeout,
        table,
        pattern,
        session,
        kv,
        bytes: 0,
    };
    let outcome = if cfg.prefill {
        run.run_prefill()?
    } else {
        run.run_decode()?
    };
    // Graceful: returns once the peer has read everything this side sent.
    run.session.close(timeout).map_err(Failure::call("sg_session_close"))?;
    Ok(outcome)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let result = args::parse(&args).and_then(|cfg| match cfg {
        Some(cfg) => run(&cfg).map(|outcome| Some((cfg, outcome))),
        None => Ok(None),
    });
    match result {
        Ok(None) => {}
        Ok(Some((cfg, outcome))) => {
            let gbps = if outcome.full_s > 0.0 {
                bytes::request_bytes(&cfg) as f64 / outcome.full_s / 1e9
            } else {
                0.0
            };
            println!(
                "interop lang=rust role={} result=ok full=ok selective={} bytes={} full_s={:.6} full_gbps={:.3} calls_ns={:.1}",
                cfg.role,
                if cfg.selective { "ok" } else { "skipped" },
                outcome.bytes,
                outcome.full_s,
                gbps,
                outcome.calls_ns
            );
        }
        Err(failure) => {
            let role = args::role_hint(&args);
            progress(role, &failure.line());
            // The reason is quoted: its own quotes and line breaks are replaced.
            let reason: String = failure
                .line()
                .chars()
                .map(|c| match c {
                    '"' => '\'',
                    '\n' | '\r' => ' ',
                    c => c,
                })
                .collect();
            println!("interop lang=rust role={} result=FAILED reason=\"{}\"", role, reason);
            exit(1);
        }
    }
}
