//! The state a controller hands over, as plain data (serde), and why each step of a
//! handover can refuse.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The [`ControllerState::version`] this build writes and reads.
pub const STATE_VERSION: u32 = 1;

/// Everything a controller in another process needs to take a running client
/// over ([`crate::Controller::save`], [`crate::Controller::restore`]).
/// Plain data (serde, e.g. JSON); validated on restore like guest input.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ControllerState {
    /// [`STATE_VERSION`]; a restore refuses any other.
    pub version: u32,
    /// The configuration it was saved from; must equal the restoring one's.
    pub limits: StateLimits,
    pub regs: RegsState,
    /// CSTS.CFS set by the I/O path (a hostile doorbell, a lost ring).
    pub fatal: bool,
    /// The client has the doorbell page mapped (its doorbell writes land silently:
    /// queues poll busily in every mode).
    pub doorbells_mapped: bool,
    /// The admin queue (`None`: controller not enabled).
    pub admin: Option<AdminQueueState>,
    /// I/O completion queues.
    pub cqs: Vec<CqState>,
    /// I/O submission queues, in the order their groups poll them.
    pub sqs: Vec<SqState>,
    /// Doorbell Buffer Config: shadow doorbell and EventIdx buffers.
    pub shadow: Option<ShadowState>,
    pub features: FeaturesState,
    /// CIDs of outstanding Asynchronous Event Requests, oldest first.
    pub aer_cids: Vec<u16>,
    /// Events (completion dword 0) waiting for an Asynchronous Event Request.
    pub events: Vec<u32>,
    /// Changed Namespace List (log page 04h) not read by the host yet.
    pub changed_ns: Vec<u32>,
    /// A Namespace Attribute Changed event is out and the host has not read the
    /// log yet (further changes only extend the list).
    pub ns_event_masked: bool,
    /// Admin commands that finished but whose entries found no room in the admin
    /// CQ yet, as (CID, status): posted by the new controller.
    pub admin_done: Vec<(u16, u16)>,
    /// Active namespaces and their LBA size as the host formatted it.
    pub namespaces: Vec<NamespaceState>,
    pub error_log: ErrorLogState,
    /// Request counters (SMART log, statistics), carried on as a base.
    pub counters: CountersState,
    /// Admin commands executed.
    pub admin_commands: u64,
}

/// The controller configuration a state belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StateLimits {
    pub max_io_queues: u16,
    pub max_queue_entries: u16,
    pub msix_vectors: u16,
    pub max_namespaces: u32,
}

/// BAR0 registers the host programs or reads (CAP and VS follow the config).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegsState {
    pub cc: u32,
    pub aqa: u32,
    pub asq: u64,
    pub acq: u64,
    /// Interrupt Mask Set/Clear (INTMS).
    pub intms: u32,
    /// CSTS.RDY.
    pub rdy: bool,
    /// CSTS.CFS from the control path (an invalid enable).
    pub cfs: bool,
    /// CSTS.SHST.
    pub shst: u32,
}

/// The admin queue pair's positions (base and size are ASQ/ACQ/AQA).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminQueueState {
    pub sq_head: u16,
    /// The host's CQ head as last read from its doorbell.
    pub cq_head: u16,
    pub cq_tail: u16,
    pub cq_phase: bool,
}

/// One I/O completion queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CqState {
    pub qid: u16,
    pub base: u64,
    pub size: u16,
    pub vector: u16,
    /// Interrupts enabled.
    pub ien: bool,
    /// The host's head as last read from its doorbell.
    pub head: u16,
    pub tail: u16,
    pub phase: bool,
}

/// One I/O submission queue. Its priority is not kept: udrive arbitrates round
/// robin only (CAP.AMS = 0), so QPRIO never mattered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SqState {
    pub qid: u16,
    pub base: u64,
    pub size: u16,
    pub cqid: u16,
    pub head: u16,
}

/// Doorbell Buffer Config addresses (guest IOVAs, page aligned).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShadowState {
    pub doorbells: u64,
    pub event_idx: u64,
}

/// Set Features values (NVMe 1.4 §5.21.1).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FeaturesState {
    pub arbitration: u32,
    pub power_state: u32,
    pub temp_over: u16,
    pub temp_under: u16,
    pub vwc_present: bool,
    pub volatile_write_cache: bool,
    /// Number of Queues granted (NSQA | NCQA << 16, 0's based).
    pub queues: u32,
    pub coalescing: u32,
    /// Interrupt Vector Configuration: Coalescing Disable per vector.
    pub no_coalesce: Vec<bool>,
    pub async_event_config: u32,
    /// Keep Alive Timeout in ms (the timer restarts in full after the handover).
    pub keep_alive_ms: u32,
    pub error_recovery: u32,
    pub write_atomicity: u32,
    /// Host Behavior Support: ACRE.
    pub host_behavior_acre: bool,
}

/// An active namespace as the host formatted it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamespaceState {
    pub nsid: u32,
    pub block_size: u32,
}

/// The Error Information log.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ErrorLogState {
    /// Entries ever logged.
    pub count: u64,
    /// The most recent ones, oldest first.
    pub entries: Vec<ErrorEntryState>,
}

/// One Error Information log entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ErrorEntryState {
    pub count: u64,
    pub sqid: u16,
    pub cid: u16,
    pub status: u16,
    pub lba: u64,
    pub nsid: u32,
}

/// Request counters summed over all queues (the SMART log reports them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CountersState {
    pub ops: trace::OpCounts,
    pub bytes: trace::OpCounts,
    pub errors: u64,
    pub shadow_doorbell_reads: u64,
}

/// Why [`crate::Controller::pause`] failed; the controller runs on as before.
#[derive(Debug, thiserror::Error)]
pub enum PauseError {
    #[error(
        "the client's memory moves by DMA messages (not shared): its controller cannot be \
         handed over"
    )]
    DmaMessages,
    #[error("a Format NVM is still erasing after {0:?}; try again when it has finished")]
    FormatInProgress(Duration),
    #[error("{requests} requests still at the backend after {timeout:?}")]
    Timeout { requests: u64, timeout: Duration },
}

/// Why [`crate::Controller::save`] refused.
#[derive(Debug, thiserror::Error)]
pub enum SaveError {
    #[error("the controller is not paused")]
    NotPaused,
    #[error(
        "the client's memory moves by DMA messages (not shared): its controller cannot be \
         handed over"
    )]
    DmaMessages,
    #[error("queue group {0} was lost (its reactor stopped)")]
    LostGroup(u16),
}

/// Why [`crate::Controller::restore`] refused; the controller stays fresh.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error("state version {0} is not {STATE_VERSION}")]
    Version(u32),
    #[error("the controller is not fresh (enabled, or it has queues)")]
    NotFresh,
    #[error("the state is for another configuration: {0}")]
    Config(&'static str),
    #[error("invalid state: {0}")]
    Invalid(String),
    #[error("{what} at {base:#x} ({len} bytes) is not mapped for the controller")]
    Unmapped {
        what: &'static str,
        base: u64,
        len: u64,
    },
    #[error("namespace {nsid} cannot take LBA size {block_size}")]
    Namespace { nsid: u32, block_size: u32 },
    #[error("cannot open backend channels")]
    Backend(#[source] std::io::Error),
    #[error("cannot start queue group {0} on a reactor")]
    Reactor(u16),
}

pub(super) fn invalid(msg: impl Into<String>) -> RestoreError {
    RestoreError::Invalid(msg.into())
}
