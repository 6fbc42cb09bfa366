//! The layer table: per op, one row per layer, merged over queues and namespaces,
//! and the merge of an initiator's table with a server's into the full path.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::hist::HistSnapshot;
use crate::snapshot::QueueSnapshot;
use crate::{LAYERS, TOTAL};

/// Who measured a row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Side {
    Initiator,
    Server,
    /// Derived: what the initiator saw minus what the server measured (doorbell
    /// and completion travel, polling delays). Mean only.
    Transport,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerRow {
    pub layer: String,
    pub side: Side,
    pub count: u64,
    pub mean_ns: f64,
    pub p50_ns: u64,
    pub p99_ns: u64,
    pub p99_9_ns: u64,
    pub max_ns: u64,
}

impl LayerRow {
    pub fn from_hist(layer: &str, side: Side, h: &HistSnapshot) -> LayerRow {
        LayerRow {
            layer: layer.to_string(),
            side,
            count: h.count,
            mean_ns: h.mean,
            p50_ns: h.p50,
            p99_ns: h.p99,
            p99_9_ns: h.p99_9,
            max_ns: h.max,
        }
    }
}

/// Rows of one op ("read", "write"); layers in request order, `total` last.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OpBreakdown {
    pub op: String,
    pub rows: Vec<LayerRow>,
}

impl OpBreakdown {
    pub fn row(&self, layer: &str) -> Option<&LayerRow> {
        self.rows.iter().find(|r| r.layer == layer)
    }
}

/// What `udrive trace` prints and `trace_read` returns.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Breakdown {
    pub ops: Vec<OpBreakdown>,
}

impl Breakdown {
    /// Merges the layer histograms of `queues` (any devices, namespaces) per op.
    /// Ops without traced requests are left out.
    pub fn from_queues<'a>(queues: impl IntoIterator<Item = &'a QueueSnapshot>) -> Breakdown {
        let queues: Vec<&QueueSnapshot> = queues.into_iter().collect();
        let mut ops = Vec::new();
        for op in ["read", "write"] {
            let names = LAYERS.iter().chain(std::iter::once(&TOTAL));
            let rows: Vec<LayerRow> = names
                .map(|name| {
                    let parts = queues
                        .iter()
                        .flat_map(|q| q.namespaces.iter())
                        .flat_map(|ns| ns.layers.iter())
                        .filter(|l| l.op == op)
                        .flat_map(|l| l.layers.iter())
                        .filter(|(n, _)| n == name)
                        .map(|(_, h)| h);
                    LayerRow::from_hist(name, Side::Server, &HistSnapshot::merge(parts))
                })
                .collect();
            if rows.last().is_some_and(|r| r.count > 0) {
                ops.push(OpBreakdown {
                    op: op.to_string(),
                    rows,
                });
            }
        }
        Breakdown { ops }
    }

    pub fn op(&self, op: &str) -> Option<&OpBreakdown> {
        self.ops.iter().find(|o| o.op == op)
    }

    /// The full path of one initiator against one server: the initiator's rows
    /// before and after its `device` row, the server's layers in between, and a
    /// `transport` row for the rest of the initiator's `device` time. Ops the server
    /// did not trace keep the initiator's rows unchanged.
    pub fn full_path(initiator: &Breakdown, server: &Breakdown) -> Breakdown {
        let ops = initiator
            .ops
            .iter()
            .map(|io| {
                let (Some(so), Some(dev)) = (server.op(&io.op), io.row(DEVICE)) else {
                    return io.clone();
                };
                let server_total = so.row(TOTAL).map_or(0.0, |r| r.mean_ns);
                let mut rows = Vec::new();
                for r in &io.rows {
                    if r.layer == DEVICE {
                        rows.extend(so.rows.iter().filter(|r| r.layer != TOTAL).cloned());
                        rows.push(LayerRow {
                            layer: "transport".into(),
                            side: Side::Transport,
                            count: dev.count,
                            mean_ns: dev.mean_ns - server_total,
                            p50_ns: 0,
                            p99_ns: 0,
                            p99_9_ns: 0,
                            max_ns: 0,
                        });
                    } else {
                        rows.push(r.clone());
                    }
                }
                OpBreakdown {
                    op: io.op.clone(),
                    rows,
                }
            })
            .collect();
        Breakdown { ops }
    }
}

/// The initiator row that the server's layers replace in [`Breakdown::full_path`].
pub const DEVICE: &str = "device";

fn us(ns: u64) -> f64 {
    ns as f64 / 1000.0
}

impl fmt::Display for Breakdown {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.ops.is_empty() {
            return writeln!(f, "no traced reads or writes");
        }
        for o in &self.ops {
            writeln!(
                f,
                "{:<6} {:<10} {:<9} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}",
                o.op, "layer", "side", "count", "mean µs", "p50 µs", "p99 µs", "p99.9 µs", "max µs"
            )?;
            for r in &o.rows {
                let side = match r.side {
                    Side::Initiator => "initiator",
                    Side::Server => "server",
                    Side::Transport => "transport",
                };
                if r.side == Side::Transport {
                    writeln!(
                        f,
                        "{:<6} {:<10} {:<9} {:>10} {:>10.2} {:>10} {:>10} {:>10} {:>10}",
                        "",
                        r.layer,
                        side,
                        r.count,
                        r.mean_ns / 1000.0,
                        "-",
                        "-",
                        "-",
                        "-"
                    )?;
                } else {
                    writeln!(
                        f,
                        "{:<6} {:<10} {:<9} {:>10} {:>10.2} {:>10.2} {:>10.2} {:>10.2} {:>10.2}",
                        "",
                        r.layer,
                        side,
                        r.count,
                        r.mean_ns / 1000.0,
                        us(r.p50_ns),
                        us(r.p99_ns),
                        us(r.p99_9_ns),
                        us(r.max_ns)
                    )?;
                }
            }
        }
        Ok(())
    }
}
