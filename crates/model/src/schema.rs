//! The JSON Schema of a configuration file (`serve --config`, `ctl apply
//! -f`, `tidegate validate`), for editors: a declarative document or a
//! change set. Generated from the same types the files are read into.

use schemars::generate::SchemaSettings;
use serde_json::{json, Value};

use crate::{ChangeSet, Document};

/// The schema (JSON Schema 2020-12), as JSON.
pub fn config_file_schema() -> Value {
    let mut g = SchemaSettings::draft2020_12().into_generator();
    let document = g.subschema_for::<Document>();
    let changes = g.subschema_for::<ChangeSet>();
    json!({
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "Tidegate configuration file",
        "description": "A declarative document (`services`, `routes`, `certificates`: the whole desired \
            configuration) or a change set (`ops`, applied in order). YAML or JSON. Generated from \
            Tidegate's own types (`tidegate schema`); rules across fields (a route's service must exist, \
            `min` at most `max`) are checked by `tidegate validate`.",
        "anyOf": [document, changes],
        "$defs": g.take_definitions(true),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_schema_names_the_documents_parts() {
        let s = config_file_schema();
        let defs = s["$defs"].as_object().unwrap();
        for name in ["Document", "ChangeSet", "ServiceSpec", "RouteSpec", "PolicySpec", "Op"] {
            assert!(defs.contains_key(name), "no {name} in {:?}", defs.keys());
        }
        assert_eq!(defs["Document"]["additionalProperties"], false, "unknown keys are errors, as when reading");
    }
}
