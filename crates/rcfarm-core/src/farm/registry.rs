//! How farms see each other: each registers `rcfarm/farms/<session-id>`, acquired with its
//! session (behavior delete), so the key lives exactly as long as the farm's session.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::claims::{FarmView, Rule};
use crate::consul::{Fence, KvPair, Session, SessionId};
use crate::labels::Selector;

pub const FARMS_PREFIX: &str = "rcfarm/farms/";

/// What a farm says about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FarmInfo {
    pub farm_id: String,
    pub hostname: String,
    pub session: SessionId,
    pub session_name: String,
    pub rc_selector: String,
    pub pid: u32,
    pub started_at: DateTime<Utc>,
    #[serde(default)]
    pub http: Option<String>,
    pub version: String,
    /// `false` when the farm runs with `--audit-shipping off` (older farms: shipping).
    #[serde(default = "shipping_by_default")]
    pub audit_shipping: bool,
    /// The newest assignment rule this farm computes ([`Rule`]; it computes every older one
    /// too). Older releases publish none: rule 1. The live farms use [`agreed_rule`].
    #[serde(default = "first_rule")]
    pub assignment_rule: u32,
}

fn first_rule() -> u32 {
    Rule::HoldersFirst.number()
}

fn shipping_by_default() -> bool {
    true
}

impl FarmInfo {
    pub fn key(&self) -> String {
        registration_key(&self.session)
    }
}

/// The registry key of the farm holding `session`.
fn registration_key(session: &SessionId) -> String {
    format!("{FARMS_PREFIX}{session}")
}

/// A write fenced by the farm's registration: it commits only while `session` holds it (what
/// the farm's own records, such as its count in the removal window, are written under).
pub fn registration_fence(session: &Session) -> Fence {
    Fence::new(registration_key(session.id()), session.id())
}

/// Live farms from the registry tree: entries still held by a session and readable.
pub fn live_farms(entries: &[KvPair]) -> Vec<FarmInfo> {
    let mut out: Vec<FarmInfo> = entries
        .iter()
        .filter(|e| e.session.is_some())
        .filter_map(|e| serde_json::from_slice::<FarmInfo>(e.value_bytes()).ok())
        .collect();
    out.sort_by(|a, b| {
        a.farm_id
            .cmp(&b.farm_id)
            .then_with(|| a.session.cmp(&b.session))
    });
    out
}

/// Farm id → the session its registration holds, of `farms`.
pub fn sessions_by_farm(farms: &[FarmInfo]) -> BTreeMap<String, String> {
    farms
        .iter()
        .map(|f| (f.farm_id.clone(), f.session.to_string()))
        .collect()
}

/// Live farms, counting `me` even before its own registration shows in the view.
pub fn live_farms_with(entries: &[KvPair], me: &FarmInfo) -> Vec<FarmInfo> {
    let mut farms = live_farms(entries);
    if !farms.iter().any(|f| f.session == me.session) {
        farms.push(me.clone());
    }
    farms
}

/// The assignment rule of `farms` (the live ones, counting this one): the oldest of their
/// newest. While a farm of an older release is live, every farm computes what it computes; the
/// last one gone, all of them move to the newer rule on their next view of the registry. Two
/// farms whose registry views differ (a farm joining or leaving) may compute different rules for
/// that moment, as they compute different assignments from different farm lists under any one
/// rule: the locks keep one holder per RC, and the grace rule takes what both leave.
pub fn agreed_rule(farms: &[FarmInfo]) -> Rule {
    farms
        .iter()
        .map(|f| Rule::from_published(f.assignment_rule))
        .min()
        .unwrap_or(Rule::DEFAULT)
}

/// The views the claim assignment needs. A farm whose selector does not parse serves nothing.
pub fn views(farms: &[FarmInfo]) -> Vec<FarmView> {
    farms
        .iter()
        .filter_map(|f| {
            Selector::parse(&f.rc_selector)
                .ok()
                .map(|rc_selector| FarmView {
                    farm_id: f.farm_id.clone(),
                    rc_selector,
                })
        })
        .collect()
}
