//! NVMe controller model (in progress).
