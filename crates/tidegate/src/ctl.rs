//! `tidegate ctl`: a thin client of the admin API.

use std::path::Path;
use std::process::ExitCode;

use anyhow::{bail, Context};
use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};

use crate::cli::{
    BackendCommand, CertCommand, CtlArgs, CtlCommand, ListenerCommand, RouteCommand, RulesCommand, ServiceCommand,
};
use crate::config_file;
use crate::output::{render, Output, View};

struct Admin {
    base: String,
    token: String,
    output: Output,
    /// `-o` as given: `diff` and `apply --prune` print their plan as lines
    /// unless JSON or YAML is asked for.
    asked: Option<Output>,
    client: Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
}

pub fn run(args: CtlArgs) -> anyhow::Result<ExitCode> {
    let token = match args.token {
        Some(t) => t.trim().to_string(),
        None => std::fs::read_to_string(args.data_dir.join("admin-token"))
            .with_context(|| {
                format!(
                    "no token: set TIDEGATE_ADMIN_TOKEN or pass --token, or --data-dir pointing at the server's data dir ({} has no admin-token)",
                    args.data_dir.display()
                )
            })?
            .trim()
            .to_string(),
    };
    let admin = Admin {
        base: format!("http://{}", args.admin),
        token,
        output: args.output.unwrap_or_else(Output::default_for_stdout),
        asked: args.output,
        client: Client::builder(TokioExecutor::new()).build_http(),
    };
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(admin.dispatch(args.command))
}

/// Reads one spec from a file, checked against its type here (errors name
/// the file's line and column), as the JSON the API takes.
fn spec_file<T: serde::de::DeserializeOwned + serde::Serialize>(file: &Path) -> anyhow::Result<Value> {
    let spec: T = config_file::read_spec(file)?;
    Ok(serde_json::to_value(spec)?)
}

/// Reads a declarative document (for `--prune` and `diff`) as the JSON
/// `PUT /v1/config` takes.
fn document_file(file: &Path) -> anyhow::Result<Value> {
    match config_file::read(file)? {
        config_file::ConfigFile::Document(doc) => Ok(serde_json::to_value(doc)?),
        config_file::ConfigFile::Changes(_) => {
            bail!("{}: a change set (`ops`) says what to do, not what should be: --prune and diff need a declarative document (`services`, `routes`, `certificates`)", file.display())
        }
    }
}

impl Admin {
    async fn dispatch(&self, cmd: CtlCommand) -> anyhow::Result<ExitCode> {
        use Method as M;
        let view = match &cmd {
            CtlCommand::Status => View::Status,
            CtlCommand::Events { .. } => View::Events,
            CtlCommand::Service(ServiceCommand::List) => View::Services,
            CtlCommand::Route(RouteCommand::List) => View::Routes,
            CtlCommand::Cert(CertCommand::List) => View::Certificates,
            CtlCommand::Rules(RulesCommand::List) => View::Rules,
            CtlCommand::Listener(ListenerCommand::List) => View::Listeners,
            _ => View::Other,
        };
        let (method, path, body) = match cmd {
            CtlCommand::Apply { file, if_revision, prune: false } => {
                let mut cs = config_file::read(&file)?.into_change_set();
                cs.if_revision = if_revision.or(cs.if_revision);
                (M::POST, "/v1/changes".to_string(), Some(serde_json::to_value(cs)?))
            }
            CtlCommand::Apply { file, prune: true, .. } => {
                return self.converge(&file, false).await;
            }
            CtlCommand::Diff { file } => return self.converge(&file, true).await,
            CtlCommand::Config => (M::GET, "/v1/config".into(), None),
            CtlCommand::Events { after } => (M::GET, format!("/v1/events?after={after}"), None),
            CtlCommand::Scale { service, pin, unpin, pause, resume } => {
                let mut o = serde_json::Map::new();
                if let Some(n) = pin {
                    o.insert("pinned".into(), json!(n));
                }
                if unpin {
                    o.insert("pinned".into(), Value::Null);
                }
                if pause || resume {
                    o.insert("paused".into(), json!(pause));
                }
                if o.is_empty() {
                    bail!("scale needs --pin N, --unpin, --pause or --resume");
                }
                (M::POST, format!("/v1/services/{service}/autoscale"), Some(Value::Object(o)))
            }
            CtlCommand::Status => (M::GET, "/v1/status".into(), None),
            CtlCommand::Metrics => return self.print_raw("/metrics").await,
            CtlCommand::Watch { from } => {
                let q = from.map(|f| format!("?from={f}")).unwrap_or_default();
                return self.print_raw(&format!("/v1/watch{q}")).await;
            }
            CtlCommand::Service(c) => match c {
                ServiceCommand::List => (M::GET, "/v1/services".into(), None),
                ServiceCommand::Get { name } => (M::GET, format!("/v1/services/{name}"), None),
                ServiceCommand::Delete { name } => (M::DELETE, format!("/v1/services/{name}"), None),
                ServiceCommand::Put { name, file, policy, backend } => {
                    let spec = match file {
                        Some(f) => spec_file::<tidegate_model::ServiceSpec>(&f)?,
                        None => service_from_flags(policy, &backend)?,
                    };
                    (M::PUT, format!("/v1/services/{name}"), Some(spec))
                }
            },
            CtlCommand::Backend(c) => match c {
                BackendCommand::Get { service, id } => (M::GET, format!("/v1/services/{service}/backends/{id}"), None),
                BackendCommand::Delete { service, id } => {
                    (M::DELETE, format!("/v1/services/{service}/backends/{id}"), None)
                }
                BackendCommand::Set { service, id, addr, weight, backup, max_conns, no_max_conns } => {
                    let mut patch = serde_json::Map::new();
                    if let Some(a) = addr {
                        patch.insert("addr".into(), json!(a));
                    }
                    if let Some(w) = weight {
                        patch.insert("weight".into(), json!(w));
                    }
                    if let Some(b) = backup {
                        patch.insert("backup".into(), json!(b));
                    }
                    if let Some(m) = max_conns {
                        patch.insert("max_conns".into(), json!(m));
                    }
                    if no_max_conns {
                        patch.insert("max_conns".into(), Value::Null);
                    }
                    if patch.is_empty() {
                        bail!("set needs at least one of --addr, --weight, --backup, --max-conns, --no-max-conns");
                    }
                    (M::PATCH, format!("/v1/services/{service}/backends/{id}"), Some(Value::Object(patch)))
                }
                BackendCommand::Put { service, id, addr, weight, backup, max_conns } => {
                    let mut spec = json!({ "addr": addr, "weight": weight, "backup": backup });
                    if let Some(m) = max_conns {
                        spec["max_conns"] = json!(m);
                    }
                    (M::PUT, format!("/v1/services/{service}/backends/{id}"), Some(spec))
                }
            },
            CtlCommand::Cert(c) => match c {
                CertCommand::List => (M::GET, "/v1/certificates".into(), None),
                CertCommand::Get { name } => (M::GET, format!("/v1/certificates/{name}"), None),
                CertCommand::Delete { name } => (M::DELETE, format!("/v1/certificates/{name}"), None),
                CertCommand::Renew { name } => (M::POST, format!("/v1/certificates/{name}/renew"), None),
                CertCommand::Acme { name, hosts, directory, challenge, contact, dns_hook, directory_ca, default } => {
                    let mut acme = json!({ "hosts": hosts, "directory": directory, "challenge": challenge });
                    if let Some(contact) = contact {
                        acme["contact"] = json!(contact);
                    }
                    if !dns_hook.is_empty() {
                        acme["dns_hook"] = json!({ "command": dns_hook });
                    }
                    if let Some(path) = directory_ca {
                        let pem =
                            std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
                        acme["directory_ca_pem"] = json!(pem);
                    }
                    (M::PUT, format!("/v1/certificates/{name}"), Some(json!({ "acme": acme, "default": default })))
                }
                CertCommand::Put { name, cert, key, default, client_ca, client_auth, client_crl } => {
                    let read = |p: &std::path::Path| {
                        std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))
                    };
                    let key_pem = match key {
                        Some(key) => read(&key)?,
                        None => tidegate_model::REDACTED.to_string(),
                    };
                    let mut spec = json!({ "cert_pem": read(&cert)?, "key_pem": key_pem, "default": default });
                    if let Some(ca) = client_ca {
                        let mode = match client_auth {
                            crate::cli::ClientAuthArg::Required => "required",
                            crate::cli::ClientAuthArg::Optional => "optional",
                        };
                        spec["client_auth"] = json!({ "ca_pem": read(&ca)?, "mode": mode });
                        if let Some(crl) = client_crl {
                            spec["client_auth"]["crl_pem"] = json!(read(&crl)?);
                        }
                    }
                    (M::PUT, format!("/v1/certificates/{name}"), Some(spec))
                }
            },
            CtlCommand::Rules(c) => match c {
                RulesCommand::List => (M::GET, "/v1/rules".into(), None),
                RulesCommand::Get { name } => (M::GET, format!("/v1/rules/{name}"), None),
                RulesCommand::Delete { name } => (M::DELETE, format!("/v1/rules/{name}"), None),
                RulesCommand::Put { name, file } => {
                    (M::PUT, format!("/v1/rules/{name}"), Some(spec_file::<tidegate_model::RuleSetSpec>(&file)?))
                }
            },
            CtlCommand::Listener(c) => match c {
                ListenerCommand::List => (M::GET, "/v1/listeners".into(), None),
                ListenerCommand::Get { name } => (M::GET, format!("/v1/listeners/{name}"), None),
                ListenerCommand::Delete { name } => (M::DELETE, format!("/v1/listeners/{name}"), None),
                ListenerCommand::Put { name, file, addr, tls, proxy_protocol_from } => {
                    let spec = match file {
                        Some(f) => spec_file::<tidegate_model::ListenerSpec>(&f)?,
                        None => {
                            let Some(addr) = addr else {
                                bail!("listener put needs --addr (or -f FILE)");
                            };
                            let mut spec = json!({ "addr": addr, "tls": tls });
                            if !proxy_protocol_from.is_empty() {
                                spec["proxy_protocol"] = json!({ "trusted": proxy_protocol_from });
                            }
                            spec
                        }
                    };
                    (M::PUT, format!("/v1/listeners/{name}"), Some(spec))
                }
            },
            CtlCommand::Route(c) => match c {
                RouteCommand::List => (M::GET, "/v1/routes".into(), None),
                RouteCommand::Get { name } => (M::GET, format!("/v1/routes/{name}"), None),
                RouteCommand::Delete { name } => (M::DELETE, format!("/v1/routes/{name}"), None),
                RouteCommand::Put { name, file, service, host, path_prefix, path, priority, rules } => {
                    let spec = match file {
                        Some(f) => spec_file::<tidegate_model::RouteSpec>(&f)?,
                        None => {
                            let Some(service) = service else {
                                bail!("route put needs --service (or -f FILE)");
                            };
                            let mut m = serde_json::Map::new();
                            for (k, v) in [("host", host), ("path_prefix", path_prefix), ("path", path)] {
                                if let Some(v) = v {
                                    m.insert(k.into(), json!(v));
                                }
                            }
                            json!({ "match": m, "service": service, "priority": priority.unwrap_or(0), "rules": rules })
                        }
                    };
                    (M::PUT, format!("/v1/routes/{name}"), Some(spec))
                }
            },
        };
        let (status, value) = self.call(method, &path, body).await?;
        // An error prints as the API's document (status, message, field).
        let view = if status.is_success() { view } else { View::Other };
        print_out(&render(&value, view, self.output));
        Ok(if status.is_success() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
    }

    /// `apply --prune` and `diff`: `PUT /v1/config` (with `dry_run` for a
    /// diff), then the changes, one per line.
    async fn converge(&self, file: &Path, dry_run: bool) -> anyhow::Result<ExitCode> {
        let doc = document_file(file)?;
        let path = if dry_run { "/v1/config?dry_run=true" } else { "/v1/config" };
        let (status, value) = self.call(Method::PUT, path, Some(doc)).await?;
        if !status.is_success() {
            print_out(&render(&value, View::Other, self.output));
            return Ok(ExitCode::FAILURE);
        }
        if let Some(format @ (Output::Json | Output::Yaml)) = self.asked {
            print_out(&render(&value, View::Other, format));
            return Ok(ExitCode::SUCCESS);
        }
        let changes = value["changes"].as_array().cloned().unwrap_or_default();
        let mut out = String::new();
        for c in &changes {
            let sign = match c["action"].as_str() {
                Some("create") => '+',
                Some("update") => '~',
                _ => '-',
            };
            out.push_str(&format!(
                "{sign} {} {}",
                c["kind"].as_str().unwrap_or("?"),
                c["name"].as_str().unwrap_or("?")
            ));
            if let Some(fields) = c["fields"].as_array().filter(|f| !f.is_empty()) {
                let names: Vec<&str> = fields.iter().filter_map(Value::as_str).collect();
                out.push_str(&format!(": {}", names.join(", ")));
            }
            out.push('\n');
        }
        let revision = &value["revision"];
        out.push_str(&match (dry_run, changes.is_empty()) {
            (_, true) => format!("no changes (revision {revision})"),
            (true, false) => format!("{} change(s) against revision {revision}; nothing applied", changes.len()),
            (false, false) => format!("{} change(s) applied: revision {revision}", changes.len()),
        });
        print_out(&out);
        Ok(ExitCode::SUCCESS)
    }

    fn request(&self, method: Method, path: &str, body: Option<Value>) -> anyhow::Result<Request<Full<Bytes>>> {
        let bytes = match body {
            Some(v) => Bytes::from(serde_json::to_vec(&v)?),
            None => Bytes::new(),
        };
        Ok(Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .header("authorization", format!("Bearer {}", self.token))
            .header("content-type", "application/json")
            .body(Full::new(bytes))?)
    }

    async fn call(&self, method: Method, path: &str, body: Option<Value>) -> anyhow::Result<(StatusCode, Value)> {
        let resp = self
            .client
            .request(self.request(method, path, body)?)
            .await
            .with_context(|| format!("cannot reach the admin API at {}", self.base))?;
        let status = resp.status();
        let bytes = resp.into_body().collect().await?.to_bytes();
        let value = serde_json::from_slice(&bytes).unwrap_or_else(|_| json!(String::from_utf8_lossy(&bytes)));
        Ok((status, value))
    }

    /// Streams a response body to stdout as it arrives.
    async fn print_raw(&self, path: &str) -> anyhow::Result<ExitCode> {
        use std::io::Write;
        let resp = self
            .client
            .request(self.request(Method::GET, path, None)?)
            .await
            .with_context(|| format!("cannot reach the admin API at {}", self.base))?;
        let ok = resp.status().is_success();
        let mut body = resp.into_body();
        let mut out = std::io::stdout();
        while let Some(frame) = body.frame().await {
            if let Some(data) = frame?.data_ref() {
                if out.write_all(data).and_then(|()| out.flush()).is_err() {
                    break; // the reader went away
                }
            }
        }
        Ok(if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
    }
}

/// Prints to stdout; a closed pipe (`| head`) ends output quietly.
fn print_out(text: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{text}").and_then(|()| out.flush());
}

fn service_from_flags(policy: Option<String>, backends: &[String]) -> anyhow::Result<Value> {
    let mut list = Vec::new();
    for b in backends {
        let Some((id, rest)) = b.split_once('=') else {
            bail!("--backend {b:?}: expected ID=HOST:PORT[@WEIGHT]");
        };
        let (addr, weight) = match rest.rsplit_once('@') {
            Some((a, w)) => (a, w.parse::<u32>().with_context(|| format!("--backend {b:?}: bad weight"))?),
            None => (rest, 1),
        };
        list.push(json!({ "id": id, "addr": addr, "weight": weight }));
    }
    let mut spec = json!({ "backends": list });
    if let Some(kind) = policy {
        spec["policy"] = json!({ "kind": kind });
    }
    Ok(spec)
}
