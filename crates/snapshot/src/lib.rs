//! Tidegate's immutable data-plane snapshot: routes and per-service selectors, rebuilt incrementally.
