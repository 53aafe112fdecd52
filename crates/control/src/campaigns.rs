//! The cluster roles an instance campaigns for, kept in step with what the
//! configuration asks for: one role per service to scale (`autoscale/NAME`),
//! per managed certificate (`acme/NAME`).

use std::collections::BTreeSet;

use crate::Control;

/// Roles asked for, by key (a service's name, a certificate's name).
#[derive(Debug)]
pub struct Campaigns<K> {
    asked: BTreeSet<K>,
    role: fn(&K) -> String,
}

impl<K: Ord + Clone> Campaigns<K> {
    /// No role asked for yet; `role` names the role of a key.
    pub fn new(role: fn(&K) -> String) -> Campaigns<K> {
        Campaigns { asked: BTreeSet::new(), role }
    }

    /// Campaigns for the role of each of `wanted` not asked for yet, and
    /// resigns the roles of keys no longer wanted.
    pub fn follow<'a>(&mut self, control: &Control, wanted: impl IntoIterator<Item = &'a K>)
    where
        K: 'a,
    {
        let wanted: BTreeSet<&K> = wanted.into_iter().collect();
        for key in &wanted {
            if self.asked.insert((*key).clone()) {
                control.campaign(&(self.role)(key));
            }
        }
        let role = self.role;
        self.asked.retain(|key| {
            let keep = wanted.contains(key);
            if !keep {
                control.resign(&role(key));
            }
            keep
        });
    }

    /// Whether the role of `key` was asked for.
    pub fn contains(&self, key: &K) -> bool {
        self.asked.contains(key)
    }
}
