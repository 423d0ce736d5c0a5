//! The two engines that serve the app's HTTP/1.1: [`native`], usher's own
//! request loop for everyday requests, and [`hyper`], for everything else
//! (HTTP/2, CONNECT, upgrades, chunked or large bodies). Both reach the
//! same request pipeline.

pub(crate) mod hyper;
pub(crate) mod native;

#[cfg(test)]
mod tests;
