//! What unit tests share.

use std::time::Duration;

use crate::consul::{Consul, ConsulConfig, Session, SessionConfig};
use crate::server::{EmbeddedServer, ServerConfig};

/// An embedded server, a client, and two sessions on it: ours and another farm's.
pub(crate) async fn two_sessions() -> (EmbeddedServer, Consul, Session, Session) {
    let server = EmbeddedServer::start(ServerConfig::ephemeral())
        .await
        .unwrap();
    let consul = Consul::new(ConsulConfig::new(server.url())).unwrap();
    let config = |name: &str| SessionConfig {
        name: name.into(),
        ttl: Duration::from_secs(30),
        lock_delay: Duration::ZERO,
        behavior: Default::default(),
    };
    let ours = Session::create(&consul, &config("ours")).await.unwrap();
    let theirs = Session::create(&consul, &config("theirs")).await.unwrap();
    (server, consul, ours, theirs)
}
