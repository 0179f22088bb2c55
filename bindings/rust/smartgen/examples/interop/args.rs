//! The interop program's command line (docs/bindings.md), checked as the C reference checks it.

use crate::failure::Failure;

pub const BLOCK_TOKENS: u32 = 16;
/// Logical block i lives at physical block (i * STRIDE + OFFSET) % blocks, differently per side.
pub const PREFILL_STRIDE: u32 = 37;
pub const PREFILL_OFFSET: u32 = 11;
pub const DECODE_STRIDE: u32 = 29;
pub const DECODE_OFFSET: u32 = 5;

const DEFAULT_LAYERS: u32 = 8;
const DEFAULT_TOKENS: u32 = 1024;
const DEFAULT_BLOCKS: u32 = 80;
const DEFAULT_TIMEOUT_S: u32 = 60;

pub struct Config {
    pub role: &'static str,
    pub prefill: bool,
    pub listen: bool,
    pub addr: String,
    pub port: u16,
    pub layers: u32,
    pub tokens: u32,
    pub blocks: u32,
    pub selective: bool,
    pub calls: u64,
    pub timeout_s: u32,
}

impl Config {
    /// Blocks of the request.
    pub fn n(&self) -> u32 {
        self.tokens / BLOCK_TOKENS
    }
}

pub fn usage(argv0: &str) -> String {
    format!(
        "usage: {} --role prefill|decode (--listen ADDR:PORT | --peer ADDR:PORT)\n\
         \x20         [--layers N] [--tokens N] [--blocks N] [--no-selective] [--calls N] [--timeout-s N]\n\
         \x20 One side of the SmartGen interop transfer (docs/bindings.md). The session key comes from\n\
         \x20 the file named by SG_AUTH_KEY_FILE. Defaults: --layers {} --tokens {} --blocks {}\n\
         \x20 --timeout-s {}. Prints one result line on stdout; exit status 0 on success, 1 otherwise.",
        argv0, DEFAULT_LAYERS, DEFAULT_TOKENS, DEFAULT_BLOCKS, DEFAULT_TIMEOUT_S
    )
}

fn invalid(detail: String) -> Failure {
    Failure::new("SG_ERR_INVALID_ARGUMENT", detail)
}

/// "ADDR:PORT", ADDR an IPv4 literal or a bracketed IPv6 one ("[::1]:5000").
fn endpoint(value: &str) -> Option<(String, u16)> {
    let colon = value.rfind(':')?;
    let port = value[colon + 1..].parse::<u16>().ok()?;
    let mut addr = &value[..colon];
    if addr.len() >= 2 && addr.starts_with('[') && addr.ends_with(']') {
        addr = &addr[1..addr.len() - 1];
    }
    if addr.is_empty() {
        return None;
    }
    Some((addr.to_string(), port))
}

fn gcd(mut a: u32, mut b: u32) -> u32 {
    while b != 0 {
        let t = a % b;
        a = b;
        b = t;
    }
    a
}

/// The configuration; Ok(None) for --help; the role is "unknown" in a failure before --role.
pub fn parse(args: &[String]) -> Result<Option<Config>, Failure> {
    let mut role: Option<&'static str> = None;
    let mut endpoint_arg: Option<(bool, String, u16)> = None;
    let (mut layers, mut tokens, mut blocks, mut timeout_s) =
        (DEFAULT_LAYERS, DEFAULT_TOKENS, DEFAULT_BLOCKS, DEFAULT_TIMEOUT_S);
    let (mut selective, mut calls) = (true, 0u64);
    let mut i = 1;
    while i < args.len() {
        let arg = args[i].as_str();
        match arg {
            "--help" | "-h" => {
                println!("{}", usage(&args[0]));
                return Ok(None);
            }
            "--no-selective" => {
                selective = false;
                i += 1;
                continue;
            }
            _ => {}
        }
        let value = match args.get(i + 1) {
            Some(value) => value.as_str(),
            None => {
                eprintln!("{}", usage(&args[0]));
                return Err(invalid(format!("{} needs a value (or is unknown)", arg)));
            }
        };
        i += 2;
        match arg {
            "--role" => {
                role = match value {
                    "prefill" => Some("prefill"),
                    "decode" => Some("decode"),
                    _ => return Err(invalid(format!("--role must be prefill or decode, not '{}'", value))),
                }
            }
            "--listen" | "--peer" => {
                if endpoint_arg.is_some() {
                    return Err(invalid("give one of --listen and --peer, once".into()));
                }
                let (addr, port) =
                    endpoint(value).ok_or_else(|| invalid(format!("{} '{}' is not ADDR:PORT", arg, value)))?;
                endpoint_arg = Some((arg == "--listen", addr, port));
            }
            "--layers" | "--tokens" | "--blocks" | "--timeout-s" => {
                let number =
                    value.parse::<u32>().ok().filter(|&v| v > 0).ok_or_else(|| {
                        invalid(format!("{} '{}' is not a number from 1 to {}", arg, value, u32::MAX))
                    })?;
                match arg {
                    "--layers" => layers = number,
                    "--tokens" => tokens = number,
                    "--blocks" => blocks = number,
                    _ => timeout_s = number,
                }
            }
            "--calls" => {
                calls = value
                    .parse::<u64>()
                    .map_err(|_| invalid(format!("--calls '{}' is not a number", value)))?;
            }
            _ => {
                eprintln!("{}", usage(&args[0]));
                return Err(invalid(format!("unknown option {}", arg)));
            }
        }
    }
    let (role, (listen, addr, port)) = match (role, endpoint_arg) {
        (Some(role), Some(endpoint)) => (role, endpoint),
        _ => {
            eprintln!("{}", usage(&args[0]));
            return Err(invalid("--role and one of --listen / --peer are required".into()));
        }
    };
    if !listen && port == 0 {
        return Err(invalid("--peer needs a port other than 0".into()));
    }
    if tokens % BLOCK_TOKENS != 0 {
        return Err(invalid(format!(
            "--tokens {} is not a multiple of {}",
            tokens, BLOCK_TOKENS
        )));
    }
    let n = tokens / BLOCK_TOKENS;
    // Coprime strides make both tables permutations, so no block is named twice.
    if blocks < n || gcd(blocks, PREFILL_STRIDE) != 1 || gcd(blocks, DECODE_STRIDE) != 1 {
        return Err(invalid(format!(
            "--blocks {} must be at least {} (the request's blocks) and coprime to {} and {}",
            blocks, n, PREFILL_STRIDE, DECODE_STRIDE
        )));
    }
    // The on-demand fetch names logical blocks 1, n/2 and n-2.
    if selective && n < 2 {
        return Err(invalid("the selective transfer needs at least 32 tokens".into()));
    }
    Ok(Some(Config {
        role,
        prefill: role == "prefill",
        listen,
        addr,
        port,
        layers,
        tokens,
        blocks,
        selective,
        calls,
        timeout_s,
    }))
}

/// The role named on the command line, for a failure line printed before parsing finished.
pub fn role_hint(args: &[String]) -> &'static str {
    match args
        .iter()
        .position(|a| a == "--role")
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
    {
        Some("prefill") => "prefill",
        Some("decode") => "decode",
        _ => "unknown",
    }
}
