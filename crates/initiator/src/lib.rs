//! initiator (in progress).
