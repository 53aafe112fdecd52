//! Tidegate's durable configuration store: the Store trait and its embedded (redb) implementation.
