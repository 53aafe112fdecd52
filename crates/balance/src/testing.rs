//! Helpers for the policies' tests.

use std::sync::Arc;

use http::HeaderMap;
use tidegate_model::{BackendAddr, BackendId, BackendSpec, Weight};

use crate::{Backend, Pool, RequestCtx, Selector};

/// A pool of backends `b0..bn` with these weights.
pub fn pool(weights: &[u32]) -> Arc<Pool> {
    Arc::new(Pool::new(
        weights
            .iter()
            .enumerate()
            .map(|(i, &w)| {
                let spec = BackendSpec {
                    addr: BackendAddr::new(&format!("127.0.0.1:{}", 1000 + i)).unwrap(),
                    weight: Weight::try_from(w).unwrap(),
                    backup: false,
                    max_conns: None,
                    autoscaled: false,
                    dns: false,
                };
                Arc::new(Backend::new(BackendId::new(&format!("b{i}")).unwrap(), &spec, None))
            })
            .collect(),
    ))
}

/// How many of `draws` selections went to each of `n` backends.
pub fn counts(sel: &dyn Selector, n: usize, draws: usize, accept: &mut dyn FnMut(&Backend) -> bool) -> Vec<usize> {
    let headers = HeaderMap::new();
    let ctx = RequestCtx::new(None, "/", &headers);
    let mut c = vec![0; n];
    for _ in 0..draws {
        if let Some(b) = sel.select(&ctx, accept) {
            let i: usize = b.id.as_str()[1..].parse().unwrap();
            c[i] += 1;
        }
    }
    c
}
