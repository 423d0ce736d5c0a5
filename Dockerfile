# syntax=docker/dockerfile:1
#
# usher: one static-ish binary (`usher server`, `usher proxy`) on a minimal,
# non-root runtime image.
#
#   DOCKER_BUILDKIT=1 docker build -t usher:0.1.0 .
#   docker run --rm -p 15100:15100 usher:0.1.0 server --admin-listen 0.0.0.0:15180
#
# The builder is Debian bookworm and so is the runtime (distroless cc-debian12),
# so the binary's glibc matches. No system protoc is needed: build.rs (the
# usher-proto crate's build script) compiles proto/ with protox, a pure-Rust
# protobuf compiler.

ARG RUST_VERSION=1.95

# ---- build ------------------------------------------------------------------
FROM rust:${RUST_VERSION}-slim-bookworm AS build
WORKDIR /src

# BuildKit cache mounts keep the cargo registry and the target directory from
# one build to the next, so a source edit recompiles only usher itself: no
# placeholder sources to keep in step with Cargo.toml's targets. The context
# holds every file a target or an `include_str!` reads (deploy/examples: the
# embedded sim scenarios); .ci/image-check.sh runs these steps as written, on
# a copy of exactly this context, so a missing file fails CI, not a release.
COPY Cargo.toml Cargo.lock build.rs ./
COPY proto ./proto
COPY crates ./crates
COPY src ./src
COPY benches ./benches
COPY deploy/examples ./deploy/examples
# The binary leaves the cache mount for the runtime stage to copy it.
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    --mount=type=cache,target=/src/target,sharing=locked \
    cargo build --locked --release --bin usher \
    && install -D target/release/usher out/usher \
    && out/usher --version

# ---- runtime ----------------------------------------------------------------
# glibc + libgcc + CA certificates, no shell, no package manager; runs as
# uid/gid 65532 ("nonroot").
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/out/usher /usr/local/bin/usher
USER 65532:65532
ENV USHER_LOG=info
# 15100 gRPC (server), 15180 admin (server),
# 15001 proxy listener and 15000 admin (sidecar).
EXPOSE 15100 15180 15001 15000
ENTRYPOINT ["/usr/local/bin/usher"]
CMD ["server"]
