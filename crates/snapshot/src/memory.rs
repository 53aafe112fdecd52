//! What the data plane has learned about every backend of a snapshot, to
//! hand to a successor process ([`Snapshot::memory`], [`Snapshot::recall`]).

use serde::{Deserialize, Serialize};
use tidegate_balance::{clock, BackendMemory, MemoryError};

use crate::Snapshot;

/// Every backend's learned state, by service.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Memory {
    /// The services, each with its backends'.
    pub services: Vec<ServiceMemory>,
}

/// One service's backends' learned state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServiceMemory {
    /// The service's name.
    pub name: String,
    /// Its backends'.
    pub backends: Vec<RememberedBackend>,
}

/// One backend's learned state, and which backend it is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RememberedBackend {
    /// Its id in the service.
    pub id: String,
    /// Its address: a backend whose id now names another address is a
    /// new backend, and learns from scratch.
    pub addr: String,
    /// What was learned.
    pub memory: BackendMemory,
}

/// What [`Snapshot::recall`] did.
#[derive(Debug, Default)]
pub struct Recalled {
    /// Backends that took their memory over.
    pub backends: usize,
    /// Remembered backends this snapshot does not have (removed, or with
    /// another address).
    pub unknown: usize,
    /// Memories refused, with the backend and why.
    pub refused: Vec<(String, String, MemoryError)>,
}

impl Snapshot {
    /// What every backend of this snapshot has learned, read now.
    pub fn memory(&self) -> Memory {
        let (now_ms, now_ns) = (clock::now_ms(), clock::now_ns());
        let services = self
            .services()
            .map(|s| ServiceMemory {
                name: s.name.to_string(),
                backends: s
                    .selector
                    .backends()
                    .iter()
                    .map(|b| RememberedBackend {
                        id: b.id.to_string(),
                        addr: b.addr.to_string(),
                        memory: b.stats.memory(now_ms, now_ns),
                    })
                    .collect(),
            })
            .collect();
        Memory { services }
    }

    /// Gives this snapshot's backends what a predecessor learned about
    /// them: each backend with the same service, id and address takes its
    /// memory over. The statistics are shared with the snapshots built
    /// after this one.
    pub fn recall(&self, memory: &Memory) -> Recalled {
        let (now_ms, now_ns) = (clock::now_ms(), clock::now_ns());
        let mut recalled = Recalled::default();
        for service in &memory.services {
            let Some(runtime) = self.service(&service.name) else {
                recalled.unknown += service.backends.len();
                continue;
            };
            let backends = runtime.selector.backends();
            for remembered in &service.backends {
                let found = backends
                    .binary_search_by(|b| b.id.as_str().cmp(remembered.id.as_str()))
                    .ok()
                    .map(|i| &backends[i])
                    .filter(|b| b.addr.as_str() == remembered.addr);
                let Some(backend) = found else {
                    recalled.unknown += 1;
                    continue;
                };
                match backend.stats.recall(&remembered.memory, now_ms, now_ns) {
                    Ok(()) => recalled.backends += 1,
                    Err(e) => recalled.refused.push((service.name.clone(), remembered.id.clone(), e)),
                }
            }
        }
        recalled
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidegate_model::ConfigState;

    fn state(addr_b: &str) -> ConfigState {
        let ops = format!(
            r#"{{"ops":[{{"op":"put_service","name":"api","spec":{{"backends":[
                {{"id":"a","addr":"127.0.0.1:9001"}},{{"id":"b","addr":"{addr_b}"}}]}}}}]}}"#
        );
        let changes = tidegate_model::parse_change_set(ops.as_bytes()).expect("a valid change set");
        ConfigState::default().apply(&changes, 0).expect("applies").0
    }

    #[test]
    fn a_successor_snapshot_takes_over_what_was_learned_about_the_same_backends() {
        let old = Snapshot::from_state(&state("127.0.0.1:9002"), 1);
        let api = old.service("api").expect("api");
        let a = &api.selector.backends()[0];
        a.stats.record_probe(false, 1, 1, clock::now_ms());
        let memory: Memory =
            serde_json::from_str(&serde_json::to_string(&old.memory()).expect("encodes")).expect("decodes");

        // b moved to another address: a new backend, nothing recalled.
        let new = Snapshot::from_state(&state("127.0.0.1:9003"), 1);
        let recalled = new.recall(&memory);
        assert_eq!((recalled.backends, recalled.unknown, recalled.refused.len()), (1, 1, 0));
        let api = new.service("api").expect("api");
        assert_eq!(api.selector.backends()[0].stats.active_state(), tidegate_balance::ActiveState::Down);

        let mut broken = memory.clone();
        broken.services[0].backends[0].memory.peak_ewma_ns = -1.0;
        broken.services.push(ServiceMemory { name: "gone".into(), backends: memory.services[0].backends.clone() });
        let recalled = Snapshot::from_state(&state("127.0.0.1:9002"), 1).recall(&broken);
        assert_eq!((recalled.backends, recalled.unknown), (1, 2));
        assert_eq!(recalled.refused.len(), 1);
        assert_eq!(recalled.refused[0].2.field, "peak_ewma_ns");
    }
}
