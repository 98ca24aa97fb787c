//! raft-rs logs through `slog`; this drain forwards its records to `tracing` (target `raft`),
//! key-value pairs rendered into the message.

use std::fmt::Write as _;

use slog::{Drain, Level, OwnedKVList, Record, KV};

/// A `slog` drain that emits `tracing` events.
pub struct TracingDrain;

struct Kv(String);

impl slog::Serializer for Kv {
    fn emit_arguments(&mut self, key: slog::Key, val: &std::fmt::Arguments) -> slog::Result {
        let _ = write!(self.0, " {key}={val}");
        Ok(())
    }
}

impl Drain for TracingDrain {
    type Ok = ();
    type Err = slog::Never;

    fn log(&self, record: &Record, values: &OwnedKVList) -> Result<(), slog::Never> {
        let mut kv = Kv(String::new());
        let _ = record.kv().serialize(record, &mut kv);
        let _ = values.serialize(record, &mut kv);
        let msg = record.msg();
        match record.level() {
            Level::Critical | Level::Error => tracing::error!(target: "raft", "{msg}{}", kv.0),
            Level::Warning => tracing::warn!(target: "raft", "{msg}{}", kv.0),
            Level::Info => tracing::info!(target: "raft", "{msg}{}", kv.0),
            Level::Debug => tracing::debug!(target: "raft", "{msg}{}", kv.0),
            Level::Trace => tracing::trace!(target: "raft", "{msg}{}", kv.0),
        }
        Ok(())
    }
}

/// A logger for raft-rs that writes to `tracing`, tagged with the member's Raft id.
pub fn logger(raft_id: u64) -> slog::Logger {
    slog::Logger::root(TracingDrain.fuse(), slog::o!("raft_id" => raft_id))
}
