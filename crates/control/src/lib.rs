//! Tidegate's configuration writer: the change queue, adaptive group commit, snapshot publication and the watch feed.
