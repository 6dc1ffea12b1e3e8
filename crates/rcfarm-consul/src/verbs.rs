//! The Consul calls rcfarm makes, one method each, with typed answers and typed errors: KV,
//! sessions, transactions and status.

use std::sync::atomic::Ordering;

use reqwest::Method;

use super::client::{Consul, Permit};
use super::error::{ConsulError, Result};
use super::kvlist::KvList;
use super::transport::{Body, Lane, Raw, Retry, Write, truncate};
use super::txn::{MAX_TXN_OPS, TxnOp, TxnResponse, WireTxnResponse};
use super::types::{KvPair, QueryMeta, QueryOptions, SessionEntry, SessionRequest};

impl Consul {
    // ---- KV ---------------------------------------------------------------------------------

    /// `GET /v1/kv/<path>` with `extra` parameters: the answer, `None` where Consul says the
    /// key or tree does not exist (404); any other refusal is an error.
    async fn kv_read(
        &self,
        path: &str,
        extra: &[(&str, &str)],
        opts: &QueryOptions,
    ) -> Result<(Option<Raw>, QueryMeta)> {
        let raw = self.read("kv", self.kv_url(path), extra, opts).await?;
        let meta = raw.meta();
        match raw.status.as_u16() {
            200 => Ok((Some(raw), meta)),
            404 => Ok((None, meta)),
            status => Err(ConsulError::Rejected {
                status,
                body: raw.text(),
            }),
        }
    }

    /// `GET /v1/kv/<key>`: the entry, or `None` if the key does not exist.
    pub async fn kv_get(
        &self,
        key: &str,
        opts: &QueryOptions,
    ) -> Result<(Option<KvPair>, QueryMeta)> {
        let (raw, meta) = self.kv_read(key, &[], opts).await?;
        let entry = match raw {
            Some(raw) => raw.json::<Vec<KvPair>>()?.pop(),
            None => None,
        };
        Ok((entry, meta))
    }

    /// `GET /v1/kv/<prefix>?recurse`: every entry whose key starts with `prefix` (sorted by key).
    /// An empty tree is an empty list.
    pub async fn kv_list(
        &self,
        prefix: &str,
        opts: &QueryOptions,
    ) -> Result<(Vec<KvPair>, QueryMeta)> {
        let (raw, meta) = self.kv_read(prefix, &[("recurse", "")], opts).await?;
        Ok((raw.map(|r| r.json()).transpose()?.unwrap_or_default(), meta))
    }

    /// `GET /v1/kv/<prefix>?recurse`, kept as sent (see [`KvList`]): for watches of big trees.
    pub async fn kv_listing(
        &self,
        prefix: &str,
        opts: &QueryOptions,
    ) -> Result<(KvList, QueryMeta)> {
        let (raw, meta) = self.kv_read(prefix, &[("recurse", "")], opts).await?;
        Ok((
            raw.map(|r| r.kv_list()).transpose()?.unwrap_or_default(),
            meta,
        ))
    }

    /// `GET /v1/kv/<prefix>?keys[&separator=…]`: the keys under `prefix`, cut after the separator.
    pub async fn kv_keys(
        &self,
        prefix: &str,
        separator: Option<&str>,
        opts: &QueryOptions,
    ) -> Result<(Vec<String>, QueryMeta)> {
        let mut extra = vec![("keys", "")];
        if let Some(sep) = separator {
            extra.push(("separator", sep));
        }
        let (raw, meta) = self.kv_read(prefix, &extra, opts).await?;
        Ok((raw.map(|r| r.json()).transpose()?.unwrap_or_default(), meta))
    }

    /// `PUT /v1/kv/<key>`: an unconditional write (idempotent, so retried).
    pub async fn kv_put(&self, key: &str, value: &[u8], flags: Option<u64>) -> Result<bool> {
        let mut w = self.kv_write(key, Method::PUT, flags_query(flags));
        w.body = Some(Body::Bytes(value.to_vec()));
        let raw = self.write(w).await?;
        self.bool_answer(&raw)
    }

    /// `PUT /v1/kv/<key>?cas=N`: write only if `ModifyIndex == N` (0: only if absent).
    pub async fn kv_cas(
        &self,
        key: &str,
        value: &[u8],
        index: u64,
        flags: Option<u64>,
    ) -> Result<bool> {
        let mut query = flags_query(flags);
        query.push(("cas", index.to_string()));
        let mut w = self.kv_write(key, Method::PUT, query);
        w.body = Some(Body::Bytes(value.to_vec()));
        w.retry = Retry::ConnectOnly;
        let raw = self.write(w).await?;
        self.bool_answer(&raw)
    }

    /// `PUT /v1/kv/<key>?acquire=<session>`: take the key's lock. Repeating it with the same
    /// session is harmless, so it is retried.
    pub async fn kv_acquire(
        &self,
        key: &str,
        value: &[u8],
        session: &str,
        flags: Option<u64>,
    ) -> Result<bool> {
        let mut query = flags_query(flags);
        query.push(("acquire", session.to_string()));
        let mut w = self.kv_write(key, Method::PUT, query);
        w.body = Some(Body::Bytes(value.to_vec()));
        let raw = self.write(w).await?;
        self.bool_answer(&raw)
    }

    /// `PUT /v1/kv/<key>?release=<session>`: give the lock up (no lock-delay applies).
    pub async fn kv_release(
        &self,
        key: &str,
        value: &[u8],
        session: &str,
        flags: Option<u64>,
    ) -> Result<bool> {
        let mut query = flags_query(flags);
        query.push(("release", session.to_string()));
        let mut w = self.kv_write(key, Method::PUT, query);
        w.body = Some(Body::Bytes(value.to_vec()));
        w.retry = Retry::ConnectOnly;
        let raw = self.write(w).await?;
        self.bool_answer(&raw)
    }

    /// Reads many keys, some perhaps missing, in batched read-only transactions: `get-tree` on
    /// each exact key never fails for a missing one and exists in every Consul version (unlike
    /// `get-or-empty`). The entries found, by key.
    pub async fn read_keys(
        &self,
        keys: &[String],
    ) -> Result<std::collections::HashMap<String, KvPair>> {
        self.read_keys_counted(keys, None).await
    }

    /// [`Consul::read_keys`], the answers' bytes counted under `label` (as a watch's are).
    async fn read_keys_counted(
        &self,
        keys: &[String],
        label: Option<&str>,
    ) -> Result<std::collections::HashMap<String, KvPair>> {
        let mut found = std::collections::HashMap::with_capacity(keys.len());
        for chunk in keys.chunks(MAX_TXN_OPS) {
            let ops: Vec<TxnOp> = chunk.iter().map(|k| TxnOp::get_tree(k.clone())).collect();
            let resp = self.txn(&ops).await?;
            if let Some(label) = label {
                metrics::counter!("rcfarm_consul_watch_answers_total", "watch" => label.to_string())
                    .increment(1);
                metrics::counter!("rcfarm_consul_watch_answer_bytes_total", "watch" => label.to_string())
                    .increment(resp.body_len as u64);
            }
            for kv in resp.results {
                // A prefix read also returns longer keys (`a/web` finds `a/web2`).
                if chunk.contains(&kv.key) {
                    found.insert(kv.key.clone(), kv);
                }
            }
        }
        Ok(found)
    }

    /// [`Consul::read_keys`] with up to `concurrency` transactions in flight: for reads of
    /// thousands of keys (a farm's records of the RCs it owns), where one transaction at a time
    /// is a round trip per 64 keys.
    /// The answers' bytes count as `rcfarm_consul_watch_answer_bytes_total{watch=label}`: such
    /// reads stand in for the values a prefix watch would have brought.
    pub async fn read_keys_concurrently(
        &self,
        keys: &[String],
        concurrency: usize,
        label: &str,
    ) -> Result<std::collections::HashMap<String, KvPair>> {
        use futures::{StreamExt, TryStreamExt};
        let batches: Vec<std::collections::HashMap<String, KvPair>> =
            futures::stream::iter(keys.chunks(MAX_TXN_OPS))
                .map(|chunk| self.read_keys_counted(chunk, Some(label)))
                .buffer_unordered(concurrency.max(1))
                .try_collect()
                .await?;
        let mut found = std::collections::HashMap::with_capacity(keys.len());
        for b in batches {
            found.extend(b);
        }
        Ok(found)
    }

    /// Gives a lock up by deleting its key, only if `session` holds it (as P2's unlock does):
    /// no lock-delay applies, so another session can take it at once. `Ok(false)` if the
    /// session did not hold it.
    pub async fn release_lock(&self, key: &str, session: &str) -> Result<bool> {
        match self
            .txn(&[TxnOp::check_session(key, session), TxnOp::delete(key)])
            .await
        {
            Ok(_) => Ok(true),
            Err(e)
                if e.txn_failures().any(|(_, f)| {
                    matches!(
                        f,
                        super::txn::TxnFailure::SessionMismatch
                            | super::txn::TxnFailure::KeyMissing
                    )
                }) =>
            {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// `DELETE /v1/kv/<key>`.
    pub async fn kv_delete(&self, key: &str) -> Result<()> {
        let raw = self
            .write(self.kv_write(key, Method::DELETE, vec![]))
            .await?;
        self.bool_answer(&raw).map(|_| ())
    }

    /// `DELETE /v1/kv/<prefix>?recurse`.
    pub async fn kv_delete_tree(&self, prefix: &str) -> Result<()> {
        let w = self.kv_write(prefix, Method::DELETE, vec![("recurse", String::new())]);
        let raw = self.write(w).await?;
        self.bool_answer(&raw).map(|_| ())
    }

    /// `DELETE /v1/kv/<key>?cas=N`: true if deleted at that index, or already absent.
    pub async fn kv_delete_cas(&self, key: &str, index: u64) -> Result<bool> {
        let mut w = self.kv_write(key, Method::DELETE, vec![("cas", index.to_string())]);
        w.retry = Retry::ConnectOnly;
        let raw = self.write(w).await?;
        self.bool_answer(&raw)
    }

    // ---- Sessions ---------------------------------------------------------------------------

    /// `PUT /v1/session/create`: the new session's id.
    pub async fn session_create(&self, req: &SessionRequest) -> Result<String> {
        let body = serde_json::to_vec(req).map_err(|e| ConsulError::BadResponse(e.to_string()))?;
        let raw = self
            .write(Write {
                endpoint: "session",
                method: Method::PUT,
                url: self.url("/v1/session/create"),
                query: vec![],
                body: Some(Body::Bytes(body)),
                retry: Retry::ConnectOnly,
                lane: Lane::Session,
            })
            .await?;
        match raw.status.as_u16() {
            200 => {
                #[derive(serde::Deserialize)]
                struct Created {
                    #[serde(rename = "ID")]
                    id: String,
                }
                Ok(raw.json::<Created>()?.id)
            }
            status => Err(ConsulError::Rejected {
                status,
                body: raw.text(),
            }),
        }
    }

    /// `PUT /v1/session/renew/<id>`. A session Consul no longer has is `NotFound`.
    pub async fn session_renew(&self, id: &str) -> Result<SessionEntry> {
        let raw = self
            .write(Write {
                endpoint: "session",
                method: Method::PUT,
                url: self.url(&format!("/v1/session/renew/{id}")),
                query: vec![],
                body: None,
                retry: Retry::Idempotent,
                lane: Lane::Session,
            })
            .await?;
        match raw.status.as_u16() {
            200 => raw
                .json::<Vec<SessionEntry>>()?
                .pop()
                .ok_or_else(|| ConsulError::NotFound(format!("session {id}"))),
            404 => Err(ConsulError::NotFound(format!("session {id}"))),
            status => Err(ConsulError::Rejected {
                status,
                body: raw.text(),
            }),
        }
    }

    /// `PUT /v1/session/destroy/<id>`: releases or deletes every key the session holds.
    pub async fn session_destroy(&self, id: &str) -> Result<()> {
        let raw = self
            .write(Write {
                endpoint: "session",
                method: Method::PUT,
                url: self.url(&format!("/v1/session/destroy/{id}")),
                query: vec![],
                body: None,
                retry: Retry::Idempotent,
                lane: Lane::Session,
            })
            .await?;
        self.bool_answer(&raw).map(|_| ())
    }

    /// `GET /v1/session/info/<id>`: the session, or `None` if it does not exist.
    pub async fn session_info(
        &self,
        id: &str,
        opts: &QueryOptions,
    ) -> Result<(Option<SessionEntry>, QueryMeta)> {
        let raw = self
            .read(
                "session",
                self.url(&format!("/v1/session/info/{id}")),
                &[],
                opts,
            )
            .await?;
        let meta = raw.meta();
        match raw.status.as_u16() {
            // Consul answers `null` for an unknown session in some versions, `[]` in others.
            200 => Ok((
                raw.json::<Option<Vec<SessionEntry>>>()?
                    .and_then(|mut v| v.pop()),
                meta,
            )),
            404 => Ok((None, meta)),
            status => Err(ConsulError::Rejected {
                status,
                body: raw.text(),
            }),
        }
    }

    /// `GET /v1/session/list`.
    pub async fn session_list(
        &self,
        opts: &QueryOptions,
    ) -> Result<(Vec<SessionEntry>, QueryMeta)> {
        let raw = self
            .read("session", self.url("/v1/session/list"), &[], opts)
            .await?;
        let meta = raw.meta();
        match raw.status.as_u16() {
            200 => Ok((
                raw.json::<Option<Vec<SessionEntry>>>()?.unwrap_or_default(),
                meta,
            )),
            status => Err(ConsulError::Rejected {
                status,
                body: raw.text(),
            }),
        }
    }

    // ---- Transactions -----------------------------------------------------------------------

    /// Commits `ops` all or nothing, as [`Consul::txn`] does, possibly in one transaction with
    /// other callers' ops (see [`super::coalesce`]). Returns the index it committed at (0 if
    /// nothing in it yields a result, as for `txn`).
    ///
    /// A caller dropped before its ops were sent never sends them; once sent, they may apply
    /// whatever becomes of the caller, like any request in flight.
    pub async fn txn_coalesced(&self, ops: Vec<TxnOp>) -> Result<super::Committed> {
        super::coalesce::txn(self, ops).await
    }

    /// `PUT /v1/txn`: all ops or none. A rollback is [`ConsulError::Conflict`] naming each
    /// failed op. More than [`MAX_TXN_OPS`] ops is refused before anything is sent.
    pub async fn txn(&self, ops: &[TxnOp]) -> Result<TxnResponse> {
        self.txn_held(ops, None).await
    }

    /// [`Consul::txn`] with a permit the caller already holds.
    pub(crate) async fn txn_held(
        &self,
        ops: &[TxnOp],
        held: Option<Permit>,
    ) -> Result<TxnResponse> {
        super::txn::check_op_count(ops.len())?;
        let read_only = ops.iter().all(|op| op.verb.is_read());
        self.inner.stats.txns.fetch_add(1, Ordering::Relaxed);
        let raw = self
            .write_held(
                Write {
                    endpoint: "txn",
                    // PUT, never POST: Consul 0.7 answers POST with 405.
                    method: Method::PUT,
                    url: self.url("/v1/txn"),
                    query: vec![],
                    body: Some(Body::Txn(ops)),
                    retry: if read_only {
                        Retry::Idempotent
                    } else {
                        Retry::ConnectOnly
                    },
                    lane: Lane::Shared,
                },
                held,
            )
            .await;
        let raw = match raw {
            Ok(r) => r,
            Err(e) => {
                metrics::counter!("rcfarm_consul_txn_total", "outcome" => e.reason_label())
                    .increment(1);
                return Err(e);
            }
        };
        let index = raw
            .headers
            .get("x-consul-index")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok());
        let result = match raw.status.as_u16() {
            200 => {
                let body_len = raw.meta().body_len;
                let wire: WireTxnResponse = raw.json()?;
                let results = wire
                    .results
                    .unwrap_or_default()
                    .into_iter()
                    .filter_map(|r| r.kv)
                    .collect();
                Ok(TxnResponse {
                    results,
                    index,
                    body_len,
                })
            }
            409 => {
                let wire: WireTxnResponse = raw.json()?;
                match wire.errors {
                    Some(errs) if !errs.is_empty() => Err(ConsulError::Conflict(errs)),
                    _ => Err(ConsulError::BadResponse(format!(
                        "409 without Errors: {}",
                        truncate(&raw.text(), 200)
                    ))),
                }
            }
            status => Err(ConsulError::Rejected {
                status,
                body: raw.text(),
            }),
        };
        let outcome = match &result {
            Ok(_) => "committed",
            Err(e) => e.reason_label(),
        };
        metrics::counter!("rcfarm_consul_txn_total", "outcome" => outcome).increment(1);
        result
    }

    // ---- Status -----------------------------------------------------------------------------

    /// `GET /v1/status/leader`: the leader's address, empty if the cluster has none.
    pub async fn leader(&self) -> Result<String> {
        let raw = self
            .read(
                "status",
                self.url("/v1/status/leader"),
                &[],
                &QueryOptions::default(),
            )
            .await?;
        match raw.status.as_u16() {
            200 => raw.json(),
            status => Err(ConsulError::Rejected {
                status,
                body: raw.text(),
            }),
        }
    }

    /// `GET /v1/status/peers`.
    pub async fn peers(&self) -> Result<Vec<String>> {
        let raw = self
            .read(
                "status",
                self.url("/v1/status/peers"),
                &[],
                &QueryOptions::default(),
            )
            .await?;
        match raw.status.as_u16() {
            200 => raw.json(),
            status => Err(ConsulError::Rejected {
                status,
                body: raw.text(),
            }),
        }
    }
}

fn flags_query(flags: Option<u64>) -> Vec<(&'static str, String)> {
    flags
        .map(|f| vec![("flags", f.to_string())])
        .unwrap_or_default()
}

impl super::coalesce::Sender for Consul {
    type Permit = Permit;

    fn queue(&self) -> &super::coalesce::TxnQueue {
        &self.inner.txn_queue
    }

    fn address(&self) -> &str {
        Consul::address(self)
    }

    async fn permit(&self) -> Result<Permit> {
        Consul::permit(self).await
    }

    async fn send(&self, ops: &[TxnOp], held: Option<Permit>) -> Result<TxnResponse> {
        self.txn_held(ops, held).await
    }
}
