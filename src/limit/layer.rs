//! The error type the request path's services share. (The tower layer that
//! admits requests by a resource lives in [`crate::embed`], for services
//! that enforce usher's leases in-process; the sidecar's own admission is a
//! stage of its request pipeline, `crate::proxy::pipeline`.)

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
