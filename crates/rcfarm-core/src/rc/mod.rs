//! Replication controllers: the record P2 stores, its validation, and the store over
//! `replication_controllers/<uuid>` with its locks.

pub mod manifest;
pub mod model;

pub use manifest::{Manifest, ManifestError, RESTART_CONFIG_KEY, RestartError};
pub use model::{
    AllocationStrategy, CHANGE_MARKER, DesiredState, InvalidRc, POD_ID_LABEL, RC_ID_LABEL,
    RC_LOCK_PREFIX, RC_PREFIX, RETIRE_MARKER, RawRc, Rc, RcId, RcProblem,
};
pub mod records;
pub mod store;

pub use records::{RcKeys, RcKeysWatch, RcRecords};

pub use store::{
    ListedRc, LockHolders, LockView, LockWatch, Mutation, NewRc, RcListing, RcStore, RcStoreError,
    Written, parse_listing, parse_locks,
};
