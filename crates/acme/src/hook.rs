//! The DNS-01 hook: a command that sets or removes a TXT record.

use std::process::Stdio;
use std::time::Duration;

use tidegate_model::DnsHook;
use tokio::io::AsyncReadExt;

/// Most of the hook's output kept for an error message.
const OUTPUT_KEPT: usize = 512;

/// Runs `hook` with `action` (`set` or `clear`), the record's name and
/// its value; `Err` names the exit status or timeout, with the start of
/// what the command wrote to its standard error.
pub(crate) async fn run(hook: &DnsHook, action: &str, record: &str, value: &str) -> Result<(), String> {
    let (program, args) = hook.command.split_first().ok_or("no command")?;
    let mut child = tokio::process::Command::new(program)
        .args(args)
        .args([action, record, value])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("{program}: {e}"))?;
    // Its standard error is read to the end (so the command never blocks
    // on a full pipe) and its start kept: a command that writes without
    // end costs no memory.
    let stderr = child.stderr.take();
    let kept = async move {
        let mut kept = Vec::new();
        if let Some(mut stderr) = stderr {
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = stderr.read(&mut buf).await {
                let room = OUTPUT_KEPT.saturating_sub(kept.len());
                kept.extend_from_slice(&buf[..n.min(room)]);
            }
        }
        kept
    };
    let limit = Duration::from_secs(hook.timeout_s.into());
    let (status, kept) = tokio::time::timeout(limit, async { tokio::join!(child.wait(), kept) })
        .await
        .map_err(|_| format!("{program} {action} did not finish within {} s", hook.timeout_s))?;
    let status = status.map_err(|e| format!("{program}: {e}"))?;
    if status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&kept).trim().to_string();
    let said = if stderr.is_empty() { String::new() } else { format!(": {stderr}") };
    Err(format!("{program} {action} {record} failed ({status}){said}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hook(command: &[&str]) -> DnsHook {
        serde_json::from_value(serde_json::json!({ "command": command, "timeout_s": 5 })).unwrap()
    }

    #[tokio::test]
    async fn the_hook_gets_its_arguments_and_its_failures_are_told() {
        let dir = std::env::temp_dir().join(format!("tidegate-hook-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join("args");
        let script = format!("echo \"$@\" > {}", out.display());
        run(&hook(&["sh", "-c", &script, "hook"]), "set", "_acme-challenge.a.example.", "v4lue").await.unwrap();
        assert_eq!(std::fs::read_to_string(&out).unwrap().trim(), "set _acme-challenge.a.example. v4lue");
        let err = run(&hook(&["sh", "-c", "echo nope >&2; exit 3"]), "set", "r.", "v").await.unwrap_err();
        assert!(err.contains("exit status: 3") && err.ends_with("nope"), "{err}");
        // Endless output: the start is kept, the rest read and dropped.
        let flood = "head -c 5000000 /dev/zero | tr '\\0' x >&2; exit 1";
        let err = run(&hook(&["sh", "-c", flood]), "set", "r.", "v").await.unwrap_err();
        assert!(err.len() < OUTPUT_KEPT + 200 && err.ends_with("xxxx"), "{}", &err[..err.len().min(300)]);
        let err = run(&hook(&["/nonexistent/hook"]), "set", "r.", "v").await.unwrap_err();
        assert!(err.starts_with("/nonexistent/hook:"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
