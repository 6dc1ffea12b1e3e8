//! `/v1/status/leader` and `/v1/status/peers`: the cluster status a client asks before
//! trusting a server. A single node is its own leader and only peer; these endpoints need no
//! ACL token, as in Consul.

use axum::http::StatusCode;
use axum::response::Response;

use super::{Answer, Params, json_body, parse_read_opts};
use crate::Shared;

pub(super) fn status(shared: &Shared, p: &Params, leader: bool) -> Result<Response, Answer> {
    let opts = parse_read_opts(p)?;
    if leader {
        Ok(json_body(StatusCode::OK, &shared.leader, opts.pretty))
    } else {
        Ok(json_body(StatusCode::OK, &[&shared.leader], opts.pretty))
    }
}
