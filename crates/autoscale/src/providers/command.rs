//! The `command` provider: user scripts start, stop and list instances
//! (VMs, Nomad jobs, a cloud CLI...) and answer in JSON on stdout.
//!
//! - `start` runs the `start` argv with `{service}` and `{id}` replaced; it
//!   must exit 0 and print `{"addr": "host:port", "handle": "..."}` (the
//!   handle optional, a string or a number).
//! - `stop` runs the `stop` argv with `{service}`, `{id}`, `{addr}` and
//!   `{handle}` (empty when there is none) replaced; it must exit 0.
//! - `list` runs the `list` argv, if configured, with `{service}` replaced;
//!   it must print `[{"id": ..., "addr": ..., "handle": ...}]`. Without one,
//!   the provider knows of no instances.
//! - `alive` cannot tell: `None`.
//! - After a `start` that timed out, the autoscaler runs `stop` for that id
//!   with `{addr}` and `{handle}` empty: the script may have started it.
//!
//! The same values are in the scripts' environment as `TIDEGATE_SERVICE`,
//! `TIDEGATE_ID`, `TIDEGATE_ADDR` and `TIDEGATE_HANDLE`. Each run is bounded
//! by [`RUN_TIMEOUT`]: past it the script's process group is killed. Failures
//! carry the first line of the script's stderr. A script may leave a daemon
//! behind; if that daemon keeps stdout open, the provider stops reading
//! [`PIPE_GRACE`] after the script itself exits.

use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::time::Instant;

use super::unix::signal_group;
use super::{fill, first_line, parse_list, parse_started};
use crate::provider::{BoxFuture, Instance, Provider, ProviderError, ProviderErrorKind, StartRequest};

/// The longest a script may run.
pub const RUN_TIMEOUT: Duration = Duration::from_secs(60);

/// How long output is still read after the script exits.
pub const PIPE_GRACE: Duration = Duration::from_secs(1);

/// At most this much of a script's stdout, and of its stderr, is kept.
const MAX_OUTPUT: usize = 1024 * 1024;

/// User scripts that speak JSON.
pub struct CommandProvider {
    service: String,
    start: Vec<String>,
    stop: Vec<String>,
    list: Option<Vec<String>>,
    timeout: Duration,
}

/// What a script did.
struct Output {
    status: ExitStatus,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
}

impl CommandProvider {
    /// A provider for `service` with the three argv templates.
    pub fn new(service: &str, start: Vec<String>, stop: Vec<String>, list: Option<Vec<String>>) -> Self {
        CommandProvider { service: service.to_string(), start, stop, list, timeout: RUN_TIMEOUT }
    }

    /// Runs `template` with `vars` replaced (and in the environment); fails
    /// on a non-zero exit.
    async fn run(&self, what: &str, template: &[String], vars: &[(&str, &str)]) -> Result<Vec<u8>, ProviderError> {
        let err = |kind: ProviderErrorKind| ProviderError::new(format!("{what} script for {}", self.service), kind);
        let argv: Vec<String> = template.iter().map(|arg| fill(arg, vars)).collect();
        let Some((program, args)) = argv.split_first().filter(|(p, _)| !p.is_empty()) else {
            return Err(err(ProviderErrorKind::NotConfigured("program")));
        };
        let mut command = tokio::process::Command::new(program);
        command.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        command.process_group(0).kill_on_drop(true);
        super::clean_env(&mut command);
        for (name, value) in vars {
            command.env(format!("TIDEGATE_{}", name.to_ascii_uppercase()), value);
        }
        let child = command
            .spawn()
            .map_err(|source| err(ProviderErrorKind::Spawn { doing: "running", program: program.clone(), source }))?;
        let out = run_to_end(child, program, self.timeout).await.map_err(err)?;
        if !out.status.success() {
            let (program, stderr) = (program.clone(), first_line(&out.stderr));
            return Err(err(ProviderErrorKind::Exited { program, status: out.status, stderr }));
        }
        if !out.stderr.is_empty() {
            tracing::debug!(service = %self.service, what, stderr = %first_line(&out.stderr), "script wrote to stderr");
        }
        Ok(out.stdout)
    }
}

/// Waits for `child` and collects its output, for at most `timeout`; on a
/// timeout, kills its process group.
async fn run_to_end(
    mut child: tokio::process::Child,
    program: &str,
    timeout: Duration,
) -> Result<Output, ProviderErrorKind> {
    let pid = child.id().and_then(|p| i32::try_from(p).ok());
    let (stdout_pipe, stderr_pipe) = (child.stdout.take(), child.stderr.take());
    let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
    let deadline = Instant::now() + timeout;
    let status = {
        let mut reading = std::pin::pin!(async {
            tokio::join!(collect(stdout_pipe, &mut stdout), collect(stderr_pipe, &mut stderr));
        });
        let mut read_all = false;
        let status = loop {
            tokio::select! {
                () = &mut reading, if !read_all => read_all = true,
                status = child.wait() => break Some(status),
                () = tokio::time::sleep_until(deadline) => break None,
            }
        };
        if status.is_some() && !read_all {
            let limit = PIPE_GRACE.min(deadline.saturating_duration_since(Instant::now()));
            let _ = tokio::time::timeout(limit, &mut reading).await;
        }
        status
    };
    match status {
        Some(Ok(status)) => Ok(Output { status, stdout, stderr }),
        Some(Err(source)) => Err(ProviderErrorKind::Wait { program: program.to_string(), source }),
        None => {
            if let Some(pid) = pid {
                let _ = signal_group(pid, Signal::SIGKILL);
            }
            Err(ProviderErrorKind::TimedOut {
                program: program.to_string(),
                after: timeout,
                stderr: first_line(&stderr),
            })
        }
    }
}

/// Reads a pipe to its end, keeping the first [`MAX_OUTPUT`] bytes.
async fn collect(pipe: Option<impl AsyncRead + Unpin>, into: &mut Vec<u8>) {
    let Some(mut pipe) = pipe else { return };
    let mut chunk = [0u8; 8192];
    loop {
        match pipe.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                let room = MAX_OUTPUT.saturating_sub(into.len());
                into.extend_from_slice(&chunk[..n.min(room)]);
            }
        }
    }
}

impl Provider for CommandProvider {
    fn start(&self, req: StartRequest) -> BoxFuture<'_, Result<Instance, ProviderError>> {
        Box::pin(async move {
            let vars = [("service", self.service.as_str()), ("id", req.id.as_str())];
            let stdout = self.run("start", &self.start, &vars).await?;
            parse_started(&req.id, &stdout).map_err(|error| {
                let kind = ProviderErrorKind::BadAnswer { what: "bad output", error };
                ProviderError::new(format!("start script for {}", self.service), kind)
            })
        })
    }

    fn stop<'a>(&'a self, instance: &'a Instance) -> BoxFuture<'a, Result<(), ProviderError>> {
        Box::pin(async move {
            let handle = instance.handle.as_deref().unwrap_or("");
            let vars = [
                ("service", self.service.as_str()),
                ("id", instance.id.as_str()),
                ("addr", instance.addr.as_str()),
                ("handle", handle),
            ];
            self.run("stop", &self.stop, &vars).await.map(|_| ())
        })
    }

    fn list(&self) -> BoxFuture<'_, Result<Vec<Instance>, ProviderError>> {
        Box::pin(async move {
            let Some(list) = &self.list else { return Ok(Vec::new()) };
            let stdout = self.run("list", list, &[("service", self.service.as_str())]).await?;
            parse_list(&stdout).map_err(|error| {
                let kind = ProviderErrorKind::BadAnswer { what: "bad output", error };
                ProviderError::new(format!("list script for {}", self.service), kind)
            })
        })
    }

    fn alive<'a>(&'a self, _instance: &'a Instance) -> BoxFuture<'a, Option<bool>> {
        Box::pin(async { None })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> Vec<String> {
        vec!["sh".into(), "-c".into(), script.into(), "sh".into()]
    }

    fn with_args(script: &str, args: &[&str]) -> Vec<String> {
        let mut argv = sh(script);
        argv.extend(args.iter().map(|a| a.to_string()));
        argv
    }

    fn req(id: &str) -> StartRequest {
        StartRequest { service: "web".into(), id: id.into() }
    }

    #[tokio::test]
    async fn start_stop_and_list_speak_json() {
        let dir = tempfile::tempdir().unwrap();
        let stopped = dir.path().join("stopped");
        let start = with_args(r#"printf '{"addr": "10.0.0.%s:80", "handle": "vm-%s"}' "$2" "$1""#, &["{id}", "7"]);
        let stop = with_args(
            r#"echo "$1 $2 $3 $4 $TIDEGATE_ADDR" > "$5""#,
            &["{service}", "{id}", "{addr}", "{handle}", stopped.to_str().unwrap()],
        );
        let list = sh(r#"echo '[{"id": "a", "addr": "h:1"}, {"id": "b", "addr": "h:2", "handle": 3}]'"#);
        let p = CommandProvider::new("web", start, stop, Some(list));
        let i = p.start(req("i1")).await.unwrap();
        assert_eq!(i, Instance { id: "i1".into(), addr: "10.0.0.7:80".into(), handle: Some("vm-i1".into()) });
        p.stop(&i).await.unwrap();
        assert_eq!(std::fs::read_to_string(&stopped).unwrap(), "web i1 10.0.0.7:80 vm-i1 10.0.0.7:80\n");
        let listed = p.list().await.unwrap();
        assert_eq!(listed.len(), 2);
        assert_eq!(listed[1].handle.as_deref(), Some("3"));
        assert_eq!(p.alive(&i).await, None);
        let no_list = CommandProvider::new("web", sh("true"), sh("true"), None);
        assert!(no_list.list().await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn failures_carry_the_first_line_of_stderr() {
        let failing = sh("echo '' >&2; echo 'quota exceeded' >&2; echo second >&2; exit 3");
        let p = CommandProvider::new("web", failing.clone(), failing.clone(), Some(failing));
        let e = p.start(req("i1")).await.unwrap_err();
        match &e.kind {
            ProviderErrorKind::Exited { status, stderr, .. } => {
                assert_eq!((status.code(), stderr.as_str()), (Some(3), "quota exceeded"));
            }
            other => panic!("{other:?}"),
        }
        assert!(!e.may_have_started(), "a refusal started nothing");
        let e = e.to_string();
        assert!(e.starts_with("start script for web: ") && e.contains("exit status: 3"), "{e}");
        let i = Instance { id: "i1".into(), addr: "h:1".into(), handle: None };
        assert!(p.stop(&i).await.unwrap_err().to_string().contains("quota exceeded"));
        assert!(p.list().await.unwrap_err().to_string().contains("quota exceeded"));

        let bad_json = CommandProvider::new("web", sh("echo starting; echo oops >&2"), sh("true"), Some(sh("echo {}")));
        let e = bad_json.start(req("i1")).await.unwrap_err();
        assert!(matches!(e.kind, ProviderErrorKind::BadAnswer { what: "bad output", .. }), "{e:?}");
        assert!(bad_json.list().await.is_err());
        let bad_addr = CommandProvider::new("web", sh(r#"echo '{"addr": "nowhere"}'"#), sh("true"), None);
        match bad_addr.start(req("i1")).await.unwrap_err().kind {
            ProviderErrorKind::BadAnswer { error, .. } => assert_eq!(error.field(), "addr"),
            other => panic!("{other:?}"),
        }

        let missing = CommandProvider::new("web", vec!["/nonexistent/tidegate-script".into()], vec![], None);
        let e = missing.start(req("i1")).await.unwrap_err();
        assert!(
            matches!(&e.kind, ProviderErrorKind::Spawn { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
        );
        assert!(e.to_string().contains("nonexistent"), "{e}");
        let e = missing.stop(&i).await.unwrap_err();
        assert!(matches!(e.kind, ProviderErrorKind::NotConfigured("program")), "{e:?}");
        assert_eq!(e.to_string(), "stop script for web: no program configured");
    }

    #[tokio::test]
    async fn runs_are_bounded() {
        let mut p = CommandProvider::new("web", sh("echo slow >&2; sleep 30"), sh("true"), None);
        p.timeout = Duration::from_millis(300);
        let began = std::time::Instant::now();
        let e = p.start(req("i1")).await.unwrap_err();
        assert!(matches!(&e.kind, ProviderErrorKind::TimedOut { stderr, .. } if stderr == "slow"), "{e:?}");
        assert!(e.may_have_started(), "a script cut short may have started something");
        let e = e.to_string();
        assert!(e.contains("timed out") && e.contains("slow"), "{e}");
        assert!(began.elapsed() < Duration::from_secs(3));

        // A script that leaves a daemon holding stdout still finishes.
        let daemon = sh(r#"echo '{"addr": "h:1"}'; sleep 5 & echo "$!" > "$0.pid""#);
        let dir = tempfile::tempdir().unwrap();
        let mut argv = daemon;
        argv[3] = dir.path().join("d").to_str().unwrap().to_string();
        let p = CommandProvider::new("web", argv, sh("true"), None);
        let began = std::time::Instant::now();
        assert_eq!(p.start(req("i1")).await.unwrap().addr, "h:1");
        assert!(began.elapsed() < Duration::from_secs(3));
        let pid: i32 = std::fs::read_to_string(dir.path().join("d.pid")).unwrap().trim().parse().unwrap();
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), Signal::SIGKILL);
    }
}
