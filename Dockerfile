# rcfarm: build the two binaries, ship them on a slim Debian.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src src
COPY crates crates
COPY bin bin
COPY migrations migrations
RUN cargo build --release --locked --bin rcfarm --bin rcctl

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --home /var/lib/rcfarm --create-home rcfarm
COPY --from=build /src/target/release/rcfarm /src/target/release/rcctl /usr/local/bin/
USER rcfarm
WORKDIR /var/lib/rcfarm
EXPOSE 8791
# Readiness: a session held and the first sync done.
HEALTHCHECK --interval=5s --timeout=3s --start-period=10s --retries=5 \
  CMD curl -fsS http://127.0.0.1:8791/health/ready || exit 1
ENTRYPOINT ["rcfarm"]
CMD ["serve", "--http", "0.0.0.0:8791"]
