//! What the sidecar tells its operators: the access log and the status pages.

pub mod access_log;
pub(crate) mod status;
