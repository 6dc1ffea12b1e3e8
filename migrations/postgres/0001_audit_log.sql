-- rcfarm audit log (PostgreSQL). Timestamps are Unix nanoseconds (UTC).
CREATE TABLE audit_events (
    seq            BIGSERIAL PRIMARY KEY,
    id             TEXT    NOT NULL UNIQUE,   -- the uuid of audit_logs/<uuid>
    event_type     TEXT    NOT NULL,
    ts             BIGINT  NOT NULL,          -- when the event happened
    rc_id          TEXT,
    pod_id         TEXT,
    farm_id        TEXT,
    details        TEXT    NOT NULL,          -- event_details, JSON
    schema_version INTEGER NOT NULL,
    shipped_at     BIGINT  NOT NULL,
    shipped_by     TEXT
);
-- Every query is "newest first" with a keyset cursor on (ts, seq).
CREATE INDEX audit_events_by_ts   ON audit_events (ts DESC, seq DESC);
CREATE INDEX audit_events_by_rc   ON audit_events (rc_id, ts DESC, seq DESC);
CREATE INDEX audit_events_by_type ON audit_events (event_type, ts DESC, seq DESC);
CREATE INDEX audit_events_by_pod  ON audit_events (pod_id, ts DESC, seq DESC);
CREATE INDEX audit_events_by_farm ON audit_events (farm_id, ts DESC, seq DESC);

-- The nodes an event names (a retarget's full node set, a transfer's old and new node).
CREATE TABLE audit_event_nodes (
    node      TEXT   NOT NULL,
    ts        BIGINT NOT NULL,
    event_seq BIGINT NOT NULL,
    PRIMARY KEY (node, ts, event_seq)
);
CREATE INDEX audit_event_nodes_by_event ON audit_event_nodes (event_seq);

-- Records that could not be parsed: kept verbatim, never dropped.
CREATE TABLE audit_dead_letters (
    key        TEXT   PRIMARY KEY,
    value      BYTEA,
    reason     TEXT   NOT NULL,
    shipped_at BIGINT NOT NULL
);
