# syntax=docker/dockerfile:1
#
# usher: one static-ish binary (`usher server`, `usher proxy`) on a minimal,
# non-root runtime image.
#
#   docker build -t usher:0.1.0 .
#   docker run --rm -p 15100:15100 usher:0.1.0 server --admin-listen 0.0.0.0:15180
#
# The builder is Debian bookworm and so is the runtime (distroless cc-debian12),
# so the binary's glibc matches. No system protoc is needed: build.rs compiles
# proto/ with protox, a pure-Rust protobuf compiler.

ARG RUST_VERSION=1.95

# ---- build ------------------------------------------------------------------
FROM rust:${RUST_VERSION}-slim-bookworm AS build
WORKDIR /src

# Dependency layer: build every dependency against placeholder sources, so this
# layer is rebuilt only when Cargo.toml, Cargo.lock, build.rs or the proto change,
# not on every source edit. Cargo refuses a manifest whose targets are missing,
# hence the empty main, lib and benches.
COPY Cargo.toml Cargo.lock build.rs ./
COPY proto ./proto
RUN mkdir -p src benches \
    && echo 'fn main() {}' > src/main.rs \
    && touch src/lib.rs \
    && for b in algorithm server_load; do echo 'fn main() {}' > "benches/$b.rs"; done \
    && cargo build --locked --release \
    && rm -rf src benches

# The real sources. COPY keeps the files' own timestamps, which can be older than
# the placeholder build: touch the crate roots so cargo rebuilds usher itself.
COPY src ./src
COPY benches ./benches
RUN touch src/main.rs src/lib.rs \
    && cargo build --locked --release \
    && ./target/release/usher --version

# ---- runtime ----------------------------------------------------------------
# glibc + libgcc + CA certificates, no shell, no package manager; runs as
# uid/gid 65532 ("nonroot").
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/usher /usr/local/bin/usher
USER 65532:65532
ENV USHER_LOG=info
# 15100 gRPC (server), 15180 admin (server),
# 15001 proxy listener and 15000 admin (sidecar).
EXPOSE 15100 15180 15001 15000
ENTRYPOINT ["/usr/local/bin/usher"]
CMD ["server"]
