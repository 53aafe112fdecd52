//! The DNS-01 hook: a command that sets or removes a TXT record.

use std::process::Stdio;
use std::time::Duration;

use tidegate_model::DnsHook;

/// Most of the hook's output kept for an error message.
const OUTPUT_KEPT: usize = 512;

/// Runs `hook` with `action` (`set` or `clear`), the record's name and
/// its value; `Err` names the exit status or timeout, with the start of
/// what the command wrote to its standard error.
pub(crate) async fn run(hook: &DnsHook, action: &str, record: &str, value: &str) -> Result<(), String> {
    let (program, args) = hook.command.split_first().ok_or("no command")?;
    let child = tokio::process::Command::new(program)
        .args(args)
        .args([action, record, value])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("{program}: {e}"))?;
    let out = tokio::time::timeout(Duration::from_secs(hook.timeout_s.into()), child.wait_with_output())
        .await
        .map_err(|_| format!("{program} {action} did not finish within {} s", hook.timeout_s))?
        .map_err(|e| format!("{program}: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&out.stderr[..out.stderr.len().min(OUTPUT_KEPT)]).trim().to_string();
    Err(format!(
        "{program} {action} {record} failed ({}){}",
        out.status,
        if stderr.is_empty() { String::new() } else { format!(": {stderr}") }
    ))
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
        let err = run(&hook(&["/nonexistent/hook"]), "set", "r.", "v").await.unwrap_err();
        assert!(err.starts_with("/nonexistent/hook:"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
