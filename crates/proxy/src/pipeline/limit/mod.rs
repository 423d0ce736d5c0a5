//! The limit stage, the innermost before the engine's own forward: admits a
//! request by its route's plan ([`usher_limit::admit`]: every key or none,
//! at once or after a wait for capacity), decides the plan's shadow
//! resources, then forwards it. A refusal is a typed
//! [`Refused`](usher_limit::admit::Refused) that the respond stage answers.

mod future;
mod layer;
mod service;

pub use future::LimitFuture;
pub use layer::LimitLayer;
pub use service::Limit;
