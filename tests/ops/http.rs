//! The farm's HTTP API.

use std::time::Duration;

use rcfarm::labels::{LabelSet, LabelStore, LabelType};
use serde_json::Value;

use crate::common::{eventually, http};
use crate::{rcctl, setup};

async fn get(url: &str) -> (u16, Value, String) {
    let r = http().get(url).send().await.unwrap();
    let status = r.status().as_u16();
    let ct = r
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let text = r.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
        ct,
    )
}

#[tokio::test]
async fn health_metrics_and_json_api() {
    let s = setup(&[]).await;
    let (st, body, _) = get(&format!("{}/health/live", s.http)).await;
    assert_eq!((st, body["status"].as_str()), (200, Some("alive")));
    let h = s.http.clone();
    eventually(Duration::from_secs(20), "ready", || {
        let h = h.clone();
        async move { (get(&format!("{h}/health/ready")).await.0 == 200).then_some(()) }
    })
    .await;

    // An RC created through rcctl shows in the API with its owner.
    let consul = crate::common::client(&s.server);
    for n in ["n1", "n2"] {
        let l: LabelSet = [("env".to_string(), "prod".to_string())].into();
        LabelStore::new(consul.clone())
            .set(LabelType::Node, n, &l)
            .await
            .unwrap();
    }
    let manifest = s.dir.path().join("m.yaml");
    std::fs::write(&manifest, "id: api-test\n").unwrap();
    let (code, id, err) = rcctl(
        &s,
        &[
            "rc",
            "create",
            "-f",
            manifest.to_str().unwrap(),
            "--node-selector",
            "env=prod",
            "--replicas",
            "2",
            "--rc-label",
            "team=ops",
        ],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    let id = id.trim().to_string();
    let (h, idc) = (s.http.clone(), id.clone());
    eventually(Duration::from_secs(20), "converged in /v1/rcs", || {
        let (h, id) = (h.clone(), idc.clone());
        async move {
            let (_, body, _) = get(&format!("{h}/v1/rcs")).await;
            body["rcs"]
                .as_array()
                .and_then(|a| a.iter().find(|r| r["id"] == id.as_str()))
                .filter(|r| r["current"] == 2 && r["owner_farm"] == "ops")
                .map(|_| ())
        }
    })
    .await;
    let (st, body, ct) = get(&format!("{}/v1/rcs/{id}", s.http)).await;
    assert_eq!(st, 200);
    assert!(ct.starts_with("application/json"));
    assert_eq!(body["rc"]["pod_id"], "api-test");
    assert_eq!(
        body["local_status"]["desired"], 2,
        "the owning farm adds its own view"
    );
    let (_, body, _) = get(&format!("{}/v1/rcs?selector=team%3Dops", s.http)).await;
    assert_eq!(body["rcs"].as_array().unwrap().len(), 1);
    let (_, body, _) = get(&format!("{}/v1/rcs?selector=team%3Dnone", s.http)).await;
    assert_eq!(body["rcs"].as_array().unwrap().len(), 0);

    // Errors are JSON with a message.
    let (st, body, _) = get(&format!("{}/v1/rcs/not-a-uuid", s.http)).await;
    assert_eq!(st, 400);
    assert!(body["error"].as_str().unwrap().contains("not a UUID"));
    let (st, body, _) = get(&format!(
        "{}/v1/rcs/6ba7b810-9dad-11d1-80b4-00c04fd430c8",
        s.http
    ))
    .await;
    assert_eq!(st, 404);
    assert!(body["error"].as_str().unwrap().contains("does not exist"));
    let (st, body, _) = get(&format!("{}/v1/rcs?selector=a%20in", s.http)).await;
    assert_eq!(st, 400, "{body}");
    let (st, _, _) = get(&format!("{}/v1/nothing", s.http)).await;
    assert_eq!(st, 404);

    // Farms.
    let (_, body, _) = get(&format!("{}/v1/farms", s.http)).await;
    assert_eq!(body["farms"][0]["farm_id"], "ops");
    assert_eq!(body["this_farm"]["owned"], 1);
    assert!(
        body["farms"][0]["http"]
            .as_str()
            .unwrap()
            .starts_with("http://127.0.0.1:")
    );

    // Audit, once shipped.
    let (h, idc) = (s.http.clone(), id.clone());
    eventually(Duration::from_secs(30), "audit events via the API", || {
        let (h, id) = (h.clone(), idc.clone());
        async move {
            let (st, body, _) = get(&format!(
                "{h}/v1/audit?rc={id}&type=REPLICATION_CONTROLLER_RETARGET"
            ))
            .await;
            (st == 200 && body["records"].as_array().is_some_and(|a| !a.is_empty())).then_some(())
        }
    })
    .await;
    let (st, body, _) = get(&format!("{}/v1/audit?cursor=garbage", s.http)).await;
    assert_eq!(st, 400, "{body}");
    let (st, body, _) = get(&format!("{}/v1/audit?since=yesterday", s.http)).await;
    assert_eq!(st, 400);
    assert!(body["error"].as_str().unwrap().contains("RFC 3339"));

    // Prometheus text with the farm's figures.
    let (st, body, ct) = get(&format!("{}/metrics", s.http)).await;
    assert_eq!(st, 200);
    assert!(ct.starts_with("text/plain"));
    let text = body.as_str().unwrap().to_string();
    for m in [
        "rcfarm_owned_rcs 1",
        "rcfarm_pods_desired 2",
        "rcfarm_pods_current 2",
        "rcfarm_converge_passes_total",
        "rcfarm_converge_pass_seconds_bucket",
        "rcfarm_consul_txn_total",
        "rcfarm_session_renewals_total",
        "rcfarm_audit_backlog",
        "rcfarm_consul_requests_total",
        "rcfarm_owned_rolls 0",
        "rcfarm_rolls 0",
        "rcfarm_rolls_stalled 0",
        "rcfarm_roll_steps_total",
    ] {
        assert!(text.contains(m), "/metrics lacks {m}:\n{text}");
    }

    // Rolling updates: none, and clear errors for a bad or unknown id.
    let (st, body, _) = get(&format!("{}/v1/rolls", s.http)).await;
    assert_eq!(st, 200);
    assert_eq!(body["rolls"], serde_json::json!([]));
    let (st, body, _) = get(&format!("{}/v1/rolls/nope", s.http)).await;
    assert_eq!(st, 400);
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("rolling update id")
    );
    let (st, body, _) = get(&format!(
        "{}/v1/rolls/6ba7b810-9dad-11d1-80b4-00c04fd430c8",
        s.http
    ))
    .await;
    assert_eq!(st, 404);
    assert!(body["error"].as_str().unwrap().contains("does not exist"));
}
