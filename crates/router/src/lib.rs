//! Tidegate's route table: matches a request to a route in time independent of the number of routes.
