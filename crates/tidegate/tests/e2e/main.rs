//! End-to-end tests: the real `tidegate` binary and real backend processes
//! (the `tidegate-emulator` dev binary), all on 127.0.0.1 ports chosen by
//! the OS. One test binary with modules, to link the dependency tree once.

mod support;

mod acme;
mod admin;
mod autoscale;
mod balancing;
mod client_certs;
mod cluster;
mod config;
mod contract;
mod dns;
mod durability;
mod engines;
mod external;
mod hostile;
mod http3;
mod hygiene;
mod listeners;
mod observability;
mod operator;
mod packaging;
mod proxy_protocol;
mod proxying;
mod rules;
mod slow_clients;
mod sources;
mod takeover;
mod tls;
mod traces;
mod upgrade;
mod upstream;
mod upstream_tls;
