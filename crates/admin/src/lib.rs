//! Tidegate's admin API: resources, atomic change sets, watch, status and metrics over HTTP+JSON.
