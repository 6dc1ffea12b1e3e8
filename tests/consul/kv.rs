//! KV: get, list, keys, put, cas, acquire, release, delete, delete-tree, delete-cas.

use rcfarm::consul::{ConsulError, QueryOptions, SessionBehavior, SessionRequest};

use crate::common::{client, server};

fn q() -> QueryOptions {
    QueryOptions::default()
}

#[tokio::test]
async fn put_get_round_trips_raw_bytes_and_flags() {
    let s = server().await;
    let c = client(&s);
    let value: Vec<u8> = (0u8..=255).collect();
    assert!(c.kv_put("bin/a", &value, Some(42)).await.unwrap());
    let (got, meta) = c.kv_get("bin/a", &q()).await.unwrap();
    let got = got.expect("key exists");
    assert_eq!(got.value_bytes(), value.as_slice());
    assert_eq!(got.flags, 42);
    assert_eq!(got.create_index, got.modify_index);
    assert_eq!(
        meta.index, got.modify_index,
        "a single key's index is its ModifyIndex"
    );
    assert!(meta.known_leader);

    // An empty value reads back as null.
    assert!(c.kv_put("empty", b"", None).await.unwrap());
    let (e, _) = c.kv_get("empty", &q()).await.unwrap();
    assert_eq!(e.unwrap().value, None);
}

#[tokio::test]
async fn missing_key_is_none_with_an_index() {
    let s = server().await;
    let c = client(&s);
    let (none, meta) = c.kv_get("nope", &q()).await.unwrap();
    assert!(none.is_none());
    assert!(meta.index >= 1, "X-Consul-Index is never 0");
    c.kv_put("other", b"x", None).await.unwrap();
    let (_, meta) = c.kv_get("nope", &q()).await.unwrap();
    c.kv_put("another", b"x", None).await.unwrap();
    let (_, meta2) = c.kv_get("nope", &q()).await.unwrap();
    assert!(
        meta2.index > meta.index,
        "a missing key reports the KV table's index"
    );
}

#[tokio::test]
async fn list_matches_by_string_prefix_sorted() {
    let s = server().await;
    let c = client(&s);
    for k in ["foo/b", "foo/a", "foobar", "fo", "zzz"] {
        c.kv_put(k, k.as_bytes(), None).await.unwrap();
    }
    let (list, meta) = c.kv_list("foo", &q()).await.unwrap();
    let keys: Vec<_> = list.iter().map(|e| e.key.as_str()).collect();
    assert_eq!(keys, ["foo/a", "foo/b", "foobar"]);
    assert_eq!(
        meta.index,
        list.iter().map(|e| e.modify_index).max().unwrap()
    );
    let (empty, _) = c.kv_list("nothing/", &q()).await.unwrap();
    assert!(
        empty.is_empty(),
        "an empty tree is an empty list, not an error"
    );
    let (all, _) = c.kv_list("", &q()).await.unwrap();
    assert_eq!(all.len(), 5);
}

#[tokio::test]
async fn keys_cut_after_separator_and_deduplicate() {
    let s = server().await;
    let c = client(&s);
    for k in [
        "labels/node/n1",
        "labels/node/n2",
        "labels/pod/n1/p",
        "labels/pod/n2/p",
        "labels/x",
    ] {
        c.kv_put(k, b"{}", None).await.unwrap();
    }
    let (keys, _) = c.kv_keys("labels/", Some("/"), &q()).await.unwrap();
    assert_eq!(keys, ["labels/node/", "labels/pod/", "labels/x"]);
    let (keys, _) = c.kv_keys("labels/pod/", None, &q()).await.unwrap();
    assert_eq!(keys, ["labels/pod/n1/p", "labels/pod/n2/p"]);
    let (none, _) = c.kv_keys("absent/", Some("/"), &q()).await.unwrap();
    assert!(none.is_empty());
}

#[tokio::test]
async fn cas_creates_only_when_absent_and_updates_only_at_the_index() {
    let s = server().await;
    let c = client(&s);
    assert!(c.kv_cas("k", b"1", 0, None).await.unwrap(), "cas=0 creates");
    assert!(
        !c.kv_cas("k", b"2", 0, None).await.unwrap(),
        "cas=0 refuses an existing key"
    );
    let (e, _) = c.kv_get("k", &q()).await.unwrap();
    let idx = e.unwrap().modify_index;
    assert!(!c.kv_cas("k", b"2", idx + 100, None).await.unwrap());
    assert!(c.kv_cas("k", b"2", idx, None).await.unwrap());
    assert!(
        !c.kv_cas("k", b"3", idx, None).await.unwrap(),
        "the index moved on"
    );
    assert!(
        !c.kv_cas("missing", b"x", 7, None).await.unwrap(),
        "cas=N on a missing key fails"
    );
    let (e, _) = c.kv_get("k", &q()).await.unwrap();
    assert_eq!(e.unwrap().value_bytes(), b"2");
}

async fn session(c: &rcfarm::consul::Consul) -> String {
    c.session_create(&SessionRequest {
        name: Some("t".into()),
        ..Default::default()
    })
    .await
    .unwrap()
}

#[tokio::test]
async fn acquire_and_release_follow_consul() {
    let s = server().await;
    let c = client(&s);
    let a = session(&c).await;
    let b = session(&c).await;

    assert!(c.kv_acquire("lock", b"a1", &a, None).await.unwrap());
    let e = c.kv_get("lock", &q()).await.unwrap().0.unwrap();
    assert_eq!(
        (e.lock_index, e.session.as_deref(), e.value_bytes()),
        (1, Some(a.as_str()), &b"a1"[..])
    );

    // Held by the same session: value updated, LockIndex unchanged.
    assert!(c.kv_acquire("lock", b"a2", &a, None).await.unwrap());
    let e = c.kv_get("lock", &q()).await.unwrap().0.unwrap();
    assert_eq!((e.lock_index, e.value_bytes()), (1, &b"a2"[..]));

    // Held by another session.
    assert!(!c.kv_acquire("lock", b"b", &b, None).await.unwrap());
    assert!(
        !c.kv_release("lock", b"b", &b, None).await.unwrap(),
        "only the holder releases"
    );

    // Release: Session cleared, LockIndex kept, value replaced by the body.
    assert!(c.kv_release("lock", b"released", &a, None).await.unwrap());
    let e = c.kv_get("lock", &q()).await.unwrap().0.unwrap();
    assert_eq!(
        (e.lock_index, e.session.as_deref(), e.value_bytes()),
        (1, None, &b"released"[..])
    );

    // An explicit release sets no lock-delay: b takes it at once, LockIndex increments.
    assert!(c.kv_acquire("lock", b"b", &b, None).await.unwrap());
    let e = c.kv_get("lock", &q()).await.unwrap().0.unwrap();
    assert_eq!((e.lock_index, e.session.as_deref()), (2, Some(b.as_str())));

    // A release with an empty body leaves Value null.
    assert!(c.kv_release("lock", b"", &b, None).await.unwrap());
    assert_eq!(c.kv_get("lock", &q()).await.unwrap().0.unwrap().value, None);
}

#[tokio::test]
async fn acquire_with_an_unknown_session_is_an_error() {
    let s = server().await;
    let c = client(&s);
    let err = c
        .kv_acquire("k", b"", "00000000-0000-0000-0000-000000000000", None)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, ConsulError::InvalidSession(id) if id == "00000000-0000-0000-0000-000000000000"),
        "{err:?}"
    );
}

#[tokio::test]
async fn plain_put_on_a_held_key_keeps_the_session_and_zeroes_lock_index() {
    let s = server().await;
    let c = client(&s);
    let a = session(&c).await;
    assert!(c.kv_acquire("held", b"x", &a, None).await.unwrap());
    assert!(c.kv_put("held", b"y", None).await.unwrap());
    let e = c.kv_get("held", &q()).await.unwrap().0.unwrap();
    assert_eq!(e.session.as_deref(), Some(a.as_str()));
    assert_eq!(e.lock_index, 0);
    assert!(c.kv_cas("held", b"z", e.modify_index, None).await.unwrap());
    let e = c.kv_get("held", &q()).await.unwrap().0.unwrap();
    assert_eq!(
        e.session.as_deref(),
        Some(a.as_str()),
        "CAS keeps the session too"
    );
}

#[tokio::test]
async fn identical_write_keeps_modify_index() {
    let s = server().await;
    let c = client(&s);
    c.kv_put("same", b"v", Some(1)).await.unwrap();
    let before = c
        .kv_get("same", &q())
        .await
        .unwrap()
        .0
        .unwrap()
        .modify_index;
    assert!(c.kv_put("same", b"v", Some(1)).await.unwrap());
    let after = c
        .kv_get("same", &q())
        .await
        .unwrap()
        .0
        .unwrap()
        .modify_index;
    assert_eq!(before, after);
    c.kv_put("same", b"v", Some(2)).await.unwrap();
    assert!(
        c.kv_get("same", &q())
            .await
            .unwrap()
            .0
            .unwrap()
            .modify_index
            > before,
        "flags count"
    );
}

#[tokio::test]
async fn deletes_single_tree_and_cas() {
    let s = server().await;
    let c = client(&s);
    for k in ["d/a", "d/b", "d/c/x", "dd"] {
        c.kv_put(k, b"x", None).await.unwrap();
    }
    c.kv_delete("d/a").await.unwrap();
    c.kv_delete("d/never-existed").await.unwrap();
    assert!(c.kv_get("d/a", &q()).await.unwrap().0.is_none());

    let e = c.kv_get("d/b", &q()).await.unwrap().0.unwrap();
    assert!(!c.kv_delete_cas("d/b", e.modify_index + 1).await.unwrap());
    assert!(c.kv_delete_cas("d/b", e.modify_index).await.unwrap());
    assert!(
        c.kv_delete_cas("d/b", 12345).await.unwrap(),
        "delete-cas of an absent key is true"
    );

    c.kv_delete_tree("d/").await.unwrap();
    let (left, _) = c.kv_list("d", &q()).await.unwrap();
    assert_eq!(
        left.iter().map(|e| e.key.as_str()).collect::<Vec<_>>(),
        ["dd"]
    );
}

#[tokio::test]
async fn keys_with_special_characters_round_trip() {
    let s = server().await;
    let c = client(&s);
    for k in ["a b/c+d", "ü/ñ", "q?x=1&y", "pct%41", "semi;colon#hash"] {
        assert!(c.kv_put(k, k.as_bytes(), None).await.unwrap(), "{k}");
        let e = c
            .kv_get(k, &q())
            .await
            .unwrap()
            .0
            .unwrap_or_else(|| panic!("{k} readable"));
        assert_eq!(e.key, k);
        assert_eq!(e.value_bytes(), k.as_bytes());
    }
}

#[tokio::test]
async fn delete_behavior_session_deletes_keys_on_destroy() {
    let s = server().await;
    let c = client(&s);
    let id = c
        .session_create(&SessionRequest {
            behavior: Some(SessionBehavior::Delete),
            lock_delay: Some(std::time::Duration::ZERO),
            ..Default::default()
        })
        .await
        .unwrap();
    c.kv_acquire("eph/1", b"x", &id, None).await.unwrap();
    c.kv_acquire("eph/2", b"y", &id, None).await.unwrap();
    c.session_destroy(&id).await.unwrap();
    let (left, _) = c.kv_list("eph/", &q()).await.unwrap();
    assert!(left.is_empty(), "{left:?}");
}
