//! Configuration files: YAML or JSON, either a change set (`ops`) or a
//! declarative document (`services`, `routes`) that becomes one.

use std::path::Path;

use anyhow::{bail, Context};
use serde_json::{json, Map, Value};
use tidegate_model::{parse_change_set, ChangeSet};

/// Reads a file (or standard input for `-`) as a JSON value; YAML is a superset.
pub fn read_value(path: &Path) -> anyhow::Result<Value> {
    let text = if path == Path::new("-") {
        std::io::read_to_string(std::io::stdin()).context("reading standard input")?
    } else {
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?
    };
    let value: Value =
        serde_yaml::from_str(&text).with_context(|| format!("{} is neither valid YAML nor JSON", path.display()))?;
    Ok(value)
}

/// Turns a document into the equivalent change set's JSON: `ops` as is, or
/// `services` then `routes` as put operations.
pub fn to_change_set_json(doc: Value, if_revision: Option<u64>) -> anyhow::Result<Value> {
    let Value::Object(mut doc) = doc else {
        bail!("the file must hold a mapping with `ops`, or with `services` and/or `routes`");
    };
    if doc.contains_key("ops") {
        if let Some(rev) = if_revision {
            doc.insert("if_revision".into(), json!(rev));
        }
        return Ok(Value::Object(doc));
    }
    let mut ops = Vec::new();
    let take = |doc: &mut Map<String, Value>, key: &str| -> anyhow::Result<Map<String, Value>> {
        match doc.remove(key) {
            None | Some(Value::Null) => Ok(Map::new()),
            Some(Value::Object(m)) => Ok(m),
            Some(_) => bail!("`{key}` must be a mapping from name to spec"),
        }
    };
    // `ctl config` output carries its revision; applying it back is fine.
    doc.remove("revision");
    let services = take(&mut doc, "services")?;
    let routes = take(&mut doc, "routes")?;
    if let Some(extra) = doc.keys().next() {
        bail!("unknown top-level key `{extra}`; expected `ops`, or `services` and `routes`");
    }
    for (name, spec) in services {
        ops.push(json!({ "op": "put_service", "name": name, "spec": spec }));
    }
    for (name, spec) in routes {
        ops.push(json!({ "op": "put_route", "name": name, "spec": spec }));
    }
    let mut cs = json!({ "ops": ops });
    if let Some(rev) = if_revision {
        cs["if_revision"] = json!(rev);
    }
    Ok(cs)
}

/// Reads and validates a file as a change set.
pub fn load_change_set(path: &Path) -> anyhow::Result<ChangeSet> {
    let value = to_change_set_json(read_value(path)?, None)?;
    let bytes = serde_json::to_vec(&value)?;
    parse_change_set(&bytes).map_err(|e| anyhow::anyhow!("{}: {}: {}", path.display(), e.field, e.message))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn declarative_documents_become_put_ops() {
        let doc: Value = serde_yaml::from_str(
            "services:\n  web:\n    backends: [{id: a, addr: '127.0.0.1:1'}]\nroutes:\n  r:\n    service: web\n",
        )
        .unwrap();
        let cs = to_change_set_json(doc, Some(4)).unwrap();
        let cs = parse_change_set(&serde_json::to_vec(&cs).unwrap()).unwrap();
        assert_eq!(cs.ops.len(), 2);
        assert_eq!(cs.if_revision, Some(4));
        assert!(to_change_set_json(json!({"servces": {}}), None).is_err());
        assert!(to_change_set_json(json!([1]), None).is_err());
    }
}
