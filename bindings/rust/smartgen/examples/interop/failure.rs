//! The first failure of a run: the status name and the detail printed in the result line.

use std::time::Duration;

use smartgen::Error;

pub struct Failure {
    pub name: String,
    pub detail: String,
}

impl Failure {
    pub fn new(name: &str, detail: String) -> Failure {
        Failure {
            name: name.to_string(),
            detail,
        }
    }

    /// "<status name>: <call>: <library message>", as the C program words it.
    pub fn call(call: &str) -> impl FnOnce(Error) -> Failure + '_ {
        move |error: Error| {
            let message = if error.message().is_empty() {
                "(no detail)"
            } else {
                error.message()
            };
            Failure::new(error.status().name(), format!("{}: {}", call, message))
        }
    }

    /// A transfer wait: TIMEOUT is this program's --timeout-s, said as such.
    pub fn wait<'a>(call: &'a str, request: &'a str, timeout: Duration) -> impl FnOnce(Error) -> Failure + 'a {
        move |error: Error| {
            let detail = if error.is_timeout() {
                format!("not done within --timeout-s {}", timeout.as_secs())
            } else if error.message().is_empty() {
                "(no detail)".to_string()
            } else {
                error.message().to_string()
            };
            Failure::new(error.status().name(), format!("{}({}): {}", call, request, detail))
        }
    }

    pub fn line(&self) -> String {
        format!("{}: {}", self.name, self.detail)
    }
}
