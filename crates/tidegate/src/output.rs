//! How `ctl` prints answers: JSON (the API's own), YAML, or tables for
//! people. Tables exist for the lists an operator reads (status, services,
//! routes, rule sets, listeners, certificates, events); any other answer
//! prints as YAML in table mode.

use clap::ValueEnum;
use serde_json::Value;

/// `ctl -o FORMAT`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// Aligned columns (YAML for answers that are not lists).
    Table,
    /// The API's JSON, pretty-printed.
    Json,
    /// YAML.
    Yaml,
}

impl Output {
    /// Tables on a terminal, JSON for scripts and pipes.
    pub fn default_for_stdout() -> Output {
        if std::io::IsTerminal::is_terminal(&std::io::stdout()) {
            Output::Table
        } else {
            Output::Json
        }
    }
}

/// What an answer is, for its table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum View {
    /// `/v1/status`.
    Status,
    /// `/v1/services`.
    Services,
    /// `/v1/routes`.
    Routes,
    /// `/v1/certificates`.
    Certificates,
    /// `/v1/rules`.
    Rules,
    /// `/v1/listeners`.
    Listeners,
    /// `/v1/events`.
    Events,
    /// Anything else.
    Other,
}

/// Renders an answer.
pub fn render(value: &Value, view: View, format: Output) -> String {
    match format {
        Output::Json => serde_json::to_string_pretty(value).unwrap_or_default(),
        Output::Yaml => yaml(value),
        Output::Table => match table(value, view) {
            Some(t) => t,
            None => yaml(value),
        },
    }
}

fn yaml(value: &Value) -> String {
    serde_norway::to_string(value).map(|s| s.trim_end().to_string()).unwrap_or_default()
}

/// A value as a table cell.
fn cell(v: &Value) -> String {
    match v {
        Value::Null => "-".to_string(),
        Value::String(s) => s.clone(),
        Value::Number(n) => match n.as_f64() {
            Some(f) if n.is_f64() => format!("{f:.2}"),
            _ => n.to_string(),
        },
        other => other.to_string(),
    }
}

/// Aligned columns with a header row.
fn columns(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let padded: Vec<String> = cells.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        padded.join("  ").trim_end().to_string()
    };
    let mut out = vec![line(header.to_vec())];
    out.extend(rows.iter().map(|r| line(r.iter().map(String::as_str).collect())));
    out.join("\n")
}

fn entries<'a>(value: &'a Value, key: &str) -> Vec<(&'a String, &'a Value)> {
    value[key].as_object().map(|m| m.iter().collect()).unwrap_or_default()
}

fn table(value: &Value, view: View) -> Option<String> {
    let revision = format!("revision {}", cell(&value["revision"]));
    let body = match view {
        View::Status => {
            let mut rows = Vec::new();
            for (name, s) in entries(value, "services") {
                let policy = cell(&s["policy"]["kind"]);
                for b in s["backends"].as_array().into_iter().flatten() {
                    rows.push(vec![
                        name.clone(),
                        policy.clone(),
                        cell(&b["id"]),
                        cell(&b["addr"]),
                        cell(&b["health"]),
                        cell(&b["weight"]),
                        cell(&b["in_flight"]),
                        cell(&b["requests"]),
                        cell(&b["failures"]),
                        cell(&b["latency_ewma_ms"]),
                    ]);
                }
                if s["backends"].as_array().is_none_or(Vec::is_empty) {
                    rows.push(vec![name.clone(), policy, "-".into(), "(no backends)".into()]);
                }
            }
            let header = [
                "SERVICE",
                "POLICY",
                "BACKEND",
                "ADDR",
                "HEALTH",
                "WEIGHT",
                "IN FLIGHT",
                "REQUESTS",
                "FAILURES",
                "LATENCY MS",
            ];
            let mut out = format!("{revision}, {} route(s)\n{}", cell(&value["routes"]), columns(&header, &rows));
            let mut rules = Vec::new();
            for (route, steps) in entries(value, "rules") {
                for st in steps.as_array().into_iter().flatten() {
                    rules.push(vec![
                        route.clone(),
                        format!("{}[{}]", cell(&st["rule_set"]), cell(&st["step"])),
                        cell(&st["kind"]),
                        cell(&st["answered"]),
                        cell(&st["changed"]),
                    ]);
                }
            }
            if !rules.is_empty() {
                out.push_str("\n\n");
                out.push_str(&columns(&["ROUTE", "RULE", "KIND", "ANSWERED", "CHANGED"], &rules));
            }
            for c in value["certificates_expiring"].as_array().into_iter().flatten() {
                out.push_str(&format!(
                    "\ncertificate {} expires at {} (Unix time)",
                    cell(&c["name"]),
                    cell(&c["not_after"])
                ));
            }
            out.push_str(&cluster(&value["store"]));
            return Some(out);
        }
        View::Services => {
            let rows: Vec<Vec<String>> = entries(value, "services")
                .into_iter()
                .map(|(name, s)| {
                    let upstream = &s["upstream"];
                    let tls = if upstream["tls"].is_object() { "+tls" } else { "" };
                    vec![
                        name.clone(),
                        cell(&s["policy"]["kind"]),
                        s["backends"].as_array().map_or(0, Vec::len).to_string(),
                        format!("{}{tls}", cell(&upstream["protocol"])),
                        if s["autoscale"].is_object() { "yes" } else { "no" }.to_string(),
                    ]
                })
                .collect();
            columns(&["SERVICE", "POLICY", "BACKENDS", "UPSTREAM", "AUTOSCALE"], &rows)
        }
        View::Routes => {
            let rows: Vec<Vec<String>> = entries(value, "routes")
                .into_iter()
                .map(|(name, r)| {
                    let m = &r["match"];
                    let path = m["path_prefix"].as_str().map(|p| format!("{p}*")).unwrap_or_else(|| cell(&m["path"]));
                    let target = match r["service"].as_str() {
                        Some(s) => s.to_string(),
                        None => format!("static {}", cell(&r["static"]["root"])),
                    };
                    let rules: Vec<String> = r["rules"].as_array().into_iter().flatten().map(cell).collect();
                    let rules = if rules.is_empty() { "-".to_string() } else { rules.join(",") };
                    vec![name.clone(), cell(&m["host"]), path, target, cell(&r["priority"]), rules]
                })
                .collect();
            columns(&["ROUTE", "HOST", "PATH", "TARGET", "PRIORITY", "RULES"], &rows)
        }
        View::Rules => {
            let rows: Vec<Vec<String>> = entries(value, "rules")
                .into_iter()
                .map(|(name, r)| {
                    let steps = r["steps"].as_array().map_or(&[][..], Vec::as_slice);
                    let kinds: Vec<String> = steps.iter().map(|s| cell(&s["kind"])).collect();
                    vec![name.clone(), steps.len().to_string(), kinds.join(",")]
                })
                .collect();
            columns(&["RULES", "STEPS", "KINDS"], &rows)
        }
        View::Listeners => {
            let rows: Vec<Vec<String>> = entries(value, "listeners")
                .into_iter()
                .map(|(name, l)| {
                    let trusted: Vec<String> =
                        l["proxy_protocol"]["trusted"].as_array().into_iter().flatten().map(cell).collect();
                    let proxy = if trusted.is_empty() { "-".to_string() } else { trusted.join(",") };
                    let tls = if l["tls"].as_bool() == Some(true) { "yes" } else { "no" };
                    vec![name.clone(), cell(&l["addr"]), tls.to_string(), proxy]
                })
                .collect();
            columns(&["LISTENER", "ADDR", "TLS", "PROXY PROTOCOL FROM"], &rows)
        }
        View::Certificates => {
            let rows: Vec<Vec<String>> = entries(value, "certificates")
                .into_iter()
                .map(|(name, c)| {
                    let names: Vec<String> = c["names"].as_array().into_iter().flatten().map(cell).collect();
                    let acme = &c["acme"];
                    let (status, renew, error) = match acme.is_object() {
                        true => (cell(&acme["status"]), cell(&acme["renew_at"]), cell(&acme["last_error"])),
                        false => ("uploaded".to_string(), "-".to_string(), "-".to_string()),
                    };
                    let client_auth = c["client_auth"]["mode"].as_str().unwrap_or("-").to_string();
                    let issuer = c["issuer"].as_str().map_or_else(|| "-".to_string(), str::to_string);
                    vec![
                        name.clone(),
                        names.join(","),
                        issuer,
                        cell(&c["not_after"]),
                        cell(&c["default"]),
                        client_auth,
                        status,
                        renew,
                        error,
                    ]
                })
                .collect();
            columns(
                &[
                    "CERTIFICATE",
                    "NAMES",
                    "ISSUER",
                    "NOT AFTER (UNIX)",
                    "DEFAULT",
                    "CLIENT AUTH",
                    "ACME",
                    "RENEW AT (UNIX)",
                    "LAST ERROR",
                ],
                &rows,
            )
        }
        View::Events => {
            let rows: Vec<Vec<String>> = value["events"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|e| {
                    vec![
                        cell(&e["seq"]),
                        cell(&e["at_unix_ms"]),
                        cell(&e["service"]),
                        cell(&e["kind"]),
                        cell(&e["instance"]),
                        cell(&e["detail"]),
                    ]
                })
                .collect();
            return Some(columns(&["SEQ", "AT (UNIX MS)", "SERVICE", "KIND", "INSTANCE", "DETAIL"], &rows));
        }
        View::Other => return None,
    };
    Some(format!("{revision}\n{body}"))
}

/// Cluster mode's part of the status: the store's state and every
/// instance's progress (nothing for the embedded store).
fn cluster(store: &Value) -> String {
    if store["kind"] != "etcd" {
        return String::new();
    }
    let state = if store["connected"] == true {
        "connected".to_string()
    } else {
        format!("UNREACHABLE ({}): serving the last configuration", cell(&store["last_error"]))
    };
    let mut out = format!("\n\nstore {} {state}, lag {}", cell(&store["location"]), cell(&store["lag"]));
    let rows: Vec<Vec<String>> = store["instances"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|i| vec![cell(&i["name"]), cell(&i["admin"]), cell(&i["applied_revision"]), cell(&i["lag"])])
        .collect();
    if !rows.is_empty() {
        out.push('\n');
        out.push_str(&columns(&["INSTANCE", "ADMIN", "APPLIED", "LAG"], &rows));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn status_is_a_table_of_services_and_backends() {
        let status = json!({
            "revision": 7, "routes": 2, "certificates_expiring": [],
            "services": { "web": { "policy": { "kind": "round_robin" }, "backends": [
                { "id": "a", "addr": "127.0.0.1:8001", "health": "up", "weight": 1, "in_flight": 0,
                  "requests": 12, "failures": 0, "latency_ewma_ms": 1.25 }
            ] }, "empty": { "policy": { "kind": "random" }, "backends": [] } }
        });
        let t = render(&status, View::Status, Output::Table);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines[0], "revision 7, 2 route(s)");
        assert!(lines[1].starts_with("SERVICE  POLICY"), "{t}");
        let web: Vec<&str> = lines.iter().find(|l| l.starts_with("web")).unwrap().split_whitespace().collect();
        assert_eq!(web, ["web", "round_robin", "a", "127.0.0.1:8001", "up", "1", "0", "12", "0", "1.25"], "{t}");
        assert!(t.contains("(no backends)"), "{t}");
        assert!(!t.contains("ANSWERED"), "no rules, no rules table: {t}");
        let mut ruled = status.clone();
        ruled["rules"] = json!({ "api": [
            { "rule_set": "api", "step": 0, "kind": "strip_prefix", "answered": 0, "changed": 12 },
            { "rule_set": "api", "step": 1, "kind": "rate_limit", "answered": 3, "changed": 0 },
        ] });
        let t = render(&ruled, View::Status, Output::Table);
        let row: Vec<&str> = t.lines().find(|l| l.contains("rate_limit")).unwrap().split_whitespace().collect();
        assert_eq!(row, ["api", "api[1]", "rate_limit", "3", "0"], "{t}");
        let header = lines[1];
        assert_eq!(header.find("ADDR"), lines[2].find("(no backends)"), "columns line up: {t}");
    }

    #[test]
    fn status_in_cluster_mode_lists_the_store_and_the_instances() {
        let status = json!({
            "revision": 9, "routes": 0, "services": {},
            "store": { "kind": "etcd", "location": "etcd://127.0.0.1:2379/tg", "connected": false,
                       "last_error": "refused", "lag": 2,
                       "instances": [{ "name": "a", "admin": "10.0.0.1:9900", "applied_revision": 9, "lag": 2 }] }
        });
        let t = render(&status, View::Status, Output::Table);
        assert!(
            t.contains("store etcd://127.0.0.1:2379/tg UNREACHABLE (refused): serving the last configuration, lag 2"),
            "{t}"
        );
        let a: Vec<&str> = t.lines().find(|l| l.starts_with("a ")).expect("a row").split_whitespace().collect();
        assert_eq!(a, ["a", "10.0.0.1:9900", "9", "2"], "{t}");
        let embedded = json!({ "revision": 1, "routes": 0, "services": {}, "store": { "kind": "embedded" } });
        assert!(!render(&embedded, View::Status, Output::Table).contains("store"));
    }

    #[test]
    fn listeners_are_a_table_of_addresses_tls_and_trusted_networks() {
        let v = serde_json::json!({"revision": 4, "listeners": {
            "internal": {"addr": "127.0.0.1:8081", "tls": false, "proxy_protocol": {"trusted": ["10.0.0.0/8", "127.0.0.1/32"]}},
            "public": {"addr": "[::]:8443", "tls": true}}});
        let t = render(&v, View::Listeners, Output::Table);
        let line = |first: &str| t.lines().find(|l| l.starts_with(first)).unwrap_or_default();
        assert!(line("LISTENER").contains("PROXY PROTOCOL FROM"), "{t}");
        let internal = line("internal");
        assert!(internal.contains("127.0.0.1:8081") && internal.contains(" no "), "{t}");
        assert!(internal.ends_with("10.0.0.0/8,127.0.0.1/32"), "{t}");
        let public = line("public");
        assert!(public.contains("[::]:8443") && public.contains("yes") && public.trim_end().ends_with('-'), "{t}");
        assert_eq!(line("revision"), "revision 4", "{t}");
    }

    #[test]
    fn answers_without_a_table_print_as_yaml_and_json_stays_json() {
        let v = json!({ "revision": 3 });
        assert_eq!(render(&v, View::Other, Output::Table), "revision: 3");
        assert_eq!(serde_json::from_str::<Value>(&render(&v, View::Other, Output::Json)).unwrap(), v);
    }
}
