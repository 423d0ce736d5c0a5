//! The account stage: accounts for every request that passed the guard,
//! whatever its outcome. An upstream's answer is counted by route and
//! resource, fed to pushback and to the quota and settle rules, and logged;
//! what the request holds until the answer's body ends goes into the reply
//! ([`Held`](super::Held)). A failure is counted and logged by its kind
//! (refused, client timeout, upstream error, no route). What it writes to
//! is [`Accounts`], shared by every snapshot.

mod accounts;
mod future;
mod layer;
mod service;

pub use accounts::Accounts;
pub use future::AccountFuture;
pub use layer::AccountLayer;
pub use service::Account;
