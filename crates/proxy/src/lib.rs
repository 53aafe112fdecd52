//! Tidegate's data plane: the hyper-based HTTP proxy, static files, retries and timeouts.
