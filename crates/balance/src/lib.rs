//! Tidegate's load balancing: backends, live per-backend statistics, and the policies that pick a backend per request.
