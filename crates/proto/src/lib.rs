//! The Doorman wire types and gRPC service, generated from `proto/doorman.proto`.

#![allow(clippy::all, missing_docs)]

tonic::include_proto!("doorman");
