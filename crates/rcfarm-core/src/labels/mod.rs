//! Labels: Kubernetes label selectors, and the label store P2 keeps in Consul
//! (`labels/<type>/<id>`), with a watched in-memory cache answering selector queries.

pub mod cache;
pub mod compact;
pub mod selector;
pub mod store;

pub use cache::{Keep, LabelCache, LabelChange, LabelChanges};
pub use compact::CompactLabels;
pub use selector::{LabelLookup, Requirement, Selector, SelectorError};
pub use store::{
    LabelSet, LabelStore, LabelType, Labeled, LabelsError, encode_labels, parse_labels,
    pod_label_id, split_pod_label_id, validate_labels,
};
