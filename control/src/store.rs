//! The durable Raft store: log entries, hard state, membership and the applied state machine
//! (which doubles as the snapshot) in one redb database, every write one fsync'd transaction.
//! raft-rs reads through [`raft::Storage`] from an in-memory mirror that is only updated after
//! the transaction that made the same change durable has committed, so what Raft sees is always
//! on disk.
//!
//! Tables: `entries` (index → protobuf `Entry`) and `meta` (`hard`, `conf`, `truncated`,
//! `applied`, `format`). `applied` is a protobuf `Snapshot` whose metadata is the last applied
//! index, its term and the membership at that index, and whose data is the encoded
//! [`ClusterState`]: the state machine and its applied index are written in one transaction, so a
//! restart never re-applies or skips a command. The log is compacted only up to the applied
//! index, so a follower too far behind is always sent a snapshot at or after the point where
//! the leader's log starts.

use std::path::Path;
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use raft::prelude::{ConfState, Entry, HardState, Snapshot, SnapshotMetadata};
use raft::{GetEntriesContext, RaftState, StorageError};
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

use crate::state::ClusterState;

const ENTRIES: TableDefinition<u64, &[u8]> = TableDefinition::new("entries");
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");

/// Version of the store's layout (key `format`).
pub const STORE_FORMAT: u32 = 1;

/// Errors of the durable store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("raft store: {0}")]
    Db(String),
    #[error("raft store: corrupt {what}: {msg}")]
    Corrupt { what: &'static str, msg: String },
    #[error("raft store: {0}")]
    Invalid(String),
}

fn db_err(e: impl std::fmt::Display) -> StoreError {
    StoreError::Db(e.to_string())
}

impl From<StoreError> for raft::Error {
    fn from(e: StoreError) -> Self {
        raft::Error::Store(StorageError::Other(Box::new(e)))
    }
}

/// What is held in memory, equal to the last committed transaction.
#[derive(Default)]
struct Mirror {
    hard: HardState,
    conf: ConfState,
    /// Index and term of the last entry removed from the log (0, 0 when none).
    truncated: (u64, u64),
    /// Entries `truncated.0 + 1 ..`.
    entries: Vec<Entry>,
    /// The applied state machine as a snapshot.
    applied: Snapshot,
}

impl Mirror {
    fn first_index(&self) -> u64 {
        self.truncated.0 + 1
    }

    fn last_index(&self) -> u64 {
        self.truncated.0 + self.entries.len() as u64
    }
}

/// A handle on the store; clones share it (raft-rs owns one, the replica driver another).
#[derive(Clone)]
pub struct RaftStore {
    db: Arc<Database>,
    mirror: Arc<RwLock<Mirror>>,
}

fn pb_bytes(m: &impl protobuf::Message) -> Vec<u8> {
    // Encoding a well-formed in-memory message does not fail.
    m.write_to_bytes().unwrap_or_default()
}

fn pb_parse<M: protobuf::Message>(b: &[u8], what: &'static str) -> Result<M, StoreError> {
    M::parse_from_bytes(b).map_err(|e| StoreError::Corrupt {
        what,
        msg: e.to_string(),
    })
}

impl RaftStore {
    /// Opens (or creates) the store in a file.
    pub fn open(path: &Path) -> Result<RaftStore, StoreError> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)
                .map_err(|e| StoreError::Db(format!("{}: {e}", dir.display())))?;
        }
        let db = Database::create(path).map_err(|e| db_err(format!("{}: {e}", path.display())))?;
        RaftStore::from_db(Arc::new(db))
    }

    /// A store in memory (simulation tests: the same code, no disk). Reopen it with
    /// [`RaftStore::from_db`] on [`RaftStore::database`] to model a restart.
    pub fn in_memory() -> Result<RaftStore, StoreError> {
        let db = Database::builder()
            .create_with_backend(redb::backends::InMemoryBackend::new())
            .map_err(db_err)?;
        RaftStore::from_db(Arc::new(db))
    }

    /// The database, to reopen the store after a simulated crash.
    pub fn database(&self) -> Arc<Database> {
        self.db.clone()
    }

    /// Loads the mirror from what is committed in `db`.
    pub fn from_db(db: Arc<Database>) -> Result<RaftStore, StoreError> {
        let txn = db.begin_write().map_err(db_err)?;
        {
            let mut meta = txn.open_table(META).map_err(db_err)?;
            txn.open_table(ENTRIES).map_err(db_err)?;
            let format = meta
                .get("format")
                .map_err(db_err)?
                .map(|v| v.value().to_vec());
            match format {
                None => {
                    meta.insert("format", STORE_FORMAT.to_le_bytes().as_slice())
                        .map_err(db_err)?;
                }
                Some(v) if v == STORE_FORMAT.to_le_bytes() => {}
                Some(v) => {
                    return Err(StoreError::Invalid(format!(
                        "store format {v:?}, this build reads {STORE_FORMAT}: upgrade ternfleet"
                    )))
                }
            }
        }
        txn.commit().map_err(db_err)?;
        let mut m = Mirror::default();
        let txn = db.begin_read().map_err(db_err)?;
        let meta = txn.open_table(META).map_err(db_err)?;
        let get = |k: &str| -> Result<Option<Vec<u8>>, StoreError> {
            Ok(meta.get(k).map_err(db_err)?.map(|v| v.value().to_vec()))
        };
        if let Some(b) = get("hard")? {
            m.hard = pb_parse(&b, "hard state")?;
        }
        if let Some(b) = get("conf")? {
            m.conf = pb_parse(&b, "membership")?;
        }
        if let Some(b) = get("truncated")? {
            let (i, t) = b
                .split_first_chunk::<8>()
                .and_then(|(i, t)| Some((*i, t.first_chunk::<8>().copied()?)))
                .ok_or_else(|| StoreError::Corrupt {
                    what: "truncated",
                    msg: format!("{} bytes", b.len()),
                })?;
            m.truncated = (u64::from_le_bytes(i), u64::from_le_bytes(t));
        }
        if let Some(b) = get("applied")? {
            m.applied = pb_parse(&b, "applied state")?;
        }
        let entries = txn.open_table(ENTRIES).map_err(db_err)?;
        let first = m.first_index();
        for (next, kv) in (first..).zip(entries.range(first..).map_err(db_err)?) {
            let (k, v) = kv.map_err(db_err)?;
            let e: Entry = pb_parse(v.value(), "log entry")?;
            if k.value() != next || e.index != next {
                return Err(StoreError::Corrupt {
                    what: "log",
                    msg: format!("expected entry {next}, found {} ({})", k.value(), e.index),
                });
            }
            m.entries.push(e);
        }
        Ok(RaftStore {
            db,
            mirror: Arc::new(RwLock::new(m)),
        })
    }

    fn rl(&self) -> RwLockReadGuard<'_, Mirror> {
        // A panic while holding the lock cannot leave the mirror half-written: it is only
        // assigned after a transaction committed.
        self.mirror.read().unwrap_or_else(|p| p.into_inner())
    }

    fn wl(&self) -> RwLockWriteGuard<'_, Mirror> {
        self.mirror.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the store holds a membership (a fresh store of a joining member does not).
    pub fn initialized(&self) -> bool {
        let m = self.rl();
        !m.conf.voters.is_empty() || m.last_index() > 0
    }

    /// Writes the first membership of a new group (the `--init-cluster` member, or every
    /// member of a fixed group) as an applied snapshot at index 1, term 1 (as TiKV starts a
    /// region at a non-zero index): the log then starts at 2, so a member that joins later
    /// with an empty log is always sent a snapshot, which carries the membership. (Replaying
    /// the log from index 1 would give it only the changes made after the bootstrap, never
    /// the first voters.)
    pub fn bootstrap(&self, conf: ConfState) -> Result<(), StoreError> {
        if self.initialized() {
            return Err(StoreError::Invalid(
                "the store already holds a cluster: remove --init-cluster to restart it".into(),
            ));
        }
        let snap = snapshot_at(1, 1, &conf, &ClusterState::default());
        let hard = HardState {
            term: 1,
            commit: 1,
            ..Default::default()
        };
        let txn = self.db.begin_write().map_err(db_err)?;
        {
            let mut meta = txn.open_table(META).map_err(db_err)?;
            meta.insert("conf", pb_bytes(&conf).as_slice())
                .map_err(db_err)?;
            meta.insert("applied", pb_bytes(&snap).as_slice())
                .map_err(db_err)?;
            meta.insert("truncated", trunc_bytes((1, 1)).as_slice())
                .map_err(db_err)?;
            meta.insert("hard", pb_bytes(&hard).as_slice())
                .map_err(db_err)?;
        }
        txn.commit().map_err(db_err)?;
        let mut m = self.wl();
        m.conf = conf;
        m.applied = snap;
        m.truncated = (1, 1);
        m.hard = hard;
        Ok(())
    }

    /// Persists a `Ready`'s snapshot (a follower restoring the leader's state), entries and hard
    /// state in one transaction.
    pub fn persist(
        &self,
        snapshot: Option<&Snapshot>,
        entries: &[Entry],
        hard: Option<&HardState>,
    ) -> Result<(), StoreError> {
        if snapshot.is_none() && entries.is_empty() && hard.is_none() {
            return Ok(());
        }
        let mut m = self.wl();
        let mut next = Mirror {
            hard: hard.cloned().unwrap_or_else(|| m.hard.clone()),
            conf: m.conf.clone(),
            truncated: m.truncated,
            entries: Vec::new(),
            applied: m.applied.clone(),
        };
        let txn = self.db.begin_write().map_err(db_err)?;
        {
            let mut meta = txn.open_table(META).map_err(db_err)?;
            let mut log = txn.open_table(ENTRIES).map_err(db_err)?;
            let mut keep = m.entries.len();
            if let Some(s) = snapshot {
                let md = s.get_metadata();
                // The snapshot replaces the state machine and the whole log.
                ClusterState::decode(&s.data).map_err(|msg| StoreError::Corrupt {
                    what: "snapshot from the leader",
                    msg,
                })?;
                if md.index < m.applied.get_metadata().index {
                    return Err(StoreError::Invalid(format!(
                        "snapshot at {} is older than the applied index {}",
                        md.index,
                        m.applied.get_metadata().index
                    )));
                }
                log.retain(|_, _| false).map_err(db_err)?;
                keep = 0;
                next.truncated = (md.index, md.term);
                next.conf = md.get_conf_state().clone();
                next.applied = s.clone();
                next.hard.commit = next.hard.commit.max(md.index);
                next.hard.term = next.hard.term.max(md.term);
                meta.insert("truncated", trunc_bytes(next.truncated).as_slice())
                    .map_err(db_err)?;
                meta.insert("conf", pb_bytes(&next.conf).as_slice())
                    .map_err(db_err)?;
                meta.insert("applied", pb_bytes(s).as_slice())
                    .map_err(db_err)?;
            }
            if let Some(first) = entries.first() {
                if first.index < next.truncated.0 + 1 {
                    return Err(StoreError::Invalid(format!(
                        "append at {} overwrites compacted entries (log starts at {})",
                        first.index,
                        next.truncated.0 + 1
                    )));
                }
                let have = next.truncated.0 + keep as u64;
                if first.index > have + 1 {
                    return Err(StoreError::Invalid(format!(
                        "append at {} leaves a gap after {have}",
                        first.index
                    )));
                }
                // Entries from first.index on are replaced.
                keep = (first.index - next.truncated.0 - 1) as usize;
                log.retain_in(first.index.., |_, _| false).map_err(db_err)?;
                for e in entries {
                    log.insert(e.index, pb_bytes(e).as_slice())
                        .map_err(db_err)?;
                }
            }
            if snapshot.is_some() || hard.is_some() {
                meta.insert("hard", pb_bytes(&next.hard).as_slice())
                    .map_err(db_err)?;
            }
            next.entries = m.entries[..keep.min(m.entries.len())].to_vec();
            next.entries.extend_from_slice(entries);
        }
        txn.commit().map_err(db_err)?;
        *m = next;
        Ok(())
    }

    /// Persists a newer commit index (a `LightReady`'s), before the entries it commits are
    /// applied.
    pub fn set_commit(&self, commit: u64) -> Result<(), StoreError> {
        let mut m = self.wl();
        if commit <= m.hard.commit {
            return Ok(());
        }
        let mut hard = m.hard.clone();
        hard.commit = commit;
        let txn = self.db.begin_write().map_err(db_err)?;
        {
            let mut meta = txn.open_table(META).map_err(db_err)?;
            meta.insert("hard", pb_bytes(&hard).as_slice())
                .map_err(db_err)?;
        }
        txn.commit().map_err(db_err)?;
        m.hard = hard;
        Ok(())
    }

    /// Persists the state machine after applying entries up to `index` (of `term`), with the
    /// membership in force there.
    pub fn save_applied(
        &self,
        index: u64,
        term: u64,
        conf: &ConfState,
        state: &ClusterState,
    ) -> Result<(), StoreError> {
        let mut m = self.wl();
        let snap = snapshot_at(index, term, conf, state);
        let conf_changed = *conf != m.conf;
        let txn = self.db.begin_write().map_err(db_err)?;
        {
            let mut meta = txn.open_table(META).map_err(db_err)?;
            meta.insert("applied", pb_bytes(&snap).as_slice())
                .map_err(db_err)?;
            if conf_changed {
                meta.insert("conf", pb_bytes(conf).as_slice())
                    .map_err(db_err)?;
            }
        }
        txn.commit().map_err(db_err)?;
        m.applied = snap;
        if conf_changed {
            m.conf = conf.clone();
        }
        Ok(())
    }

    /// Drops log entries up to `index` (at most the applied index).
    pub fn compact(&self, index: u64) -> Result<(), StoreError> {
        let mut m = self.wl();
        let applied = m.applied.get_metadata().index;
        if index > applied {
            return Err(StoreError::Invalid(format!(
                "compact to {index} past the applied index {applied}"
            )));
        }
        if index <= m.truncated.0 {
            return Ok(());
        }
        let k = (index - m.truncated.0) as usize;
        let term = m
            .entries
            .get(k - 1)
            .map(|e| e.term)
            .ok_or_else(|| StoreError::Invalid(format!("compact to {index}: no such entry")))?;
        let txn = self.db.begin_write().map_err(db_err)?;
        {
            let mut log = txn.open_table(ENTRIES).map_err(db_err)?;
            log.retain_in(..=index, |_, _| false).map_err(db_err)?;
            let mut meta = txn.open_table(META).map_err(db_err)?;
            meta.insert("truncated", trunc_bytes((index, term)).as_slice())
                .map_err(db_err)?;
        }
        txn.commit().map_err(db_err)?;
        m.truncated = (index, term);
        m.entries.drain(..k);
        Ok(())
    }

    /// The applied state machine and its index, term and membership.
    pub fn applied(&self) -> Result<(ClusterState, u64, u64, ConfState), StoreError> {
        let m = self.rl();
        let md = m.applied.get_metadata();
        let state = if m.applied.data.is_empty() {
            ClusterState::default()
        } else {
            ClusterState::decode(&m.applied.data).map_err(|msg| StoreError::Corrupt {
                what: "applied state",
                msg,
            })?
        };
        let conf = if md.index == 0 {
            m.conf.clone()
        } else {
            md.get_conf_state().clone()
        };
        Ok((state, md.index, md.term, conf))
    }

    /// The persisted hard state.
    pub fn hard_state(&self) -> HardState {
        self.rl().hard.clone()
    }

    /// First and last log index held.
    pub fn bounds(&self) -> (u64, u64) {
        let m = self.rl();
        (m.first_index(), m.last_index())
    }

    /// Copies of the log entries in `lo..hi` still held (for invariant checks).
    pub fn log_slice(&self, lo: u64, hi: u64) -> Vec<Entry> {
        let m = self.rl();
        let lo = lo.max(m.first_index());
        let hi = hi.min(m.last_index() + 1);
        if lo >= hi {
            return Vec::new();
        }
        let off = m.first_index();
        m.entries[(lo - off) as usize..(hi - off) as usize].to_vec()
    }
}

/// The state machine at `index` (of `term`, membership `conf`) as a Raft snapshot.
fn snapshot_at(index: u64, term: u64, conf: &ConfState, state: &ClusterState) -> Snapshot {
    let mut snap = Snapshot {
        data: state.encode().into(),
        ..Default::default()
    };
    snap.set_metadata(SnapshotMetadata {
        index,
        term,
        ..Default::default()
    });
    snap.mut_metadata().set_conf_state(conf.clone());
    snap
}

fn trunc_bytes((i, t): (u64, u64)) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&i.to_le_bytes());
    b[8..].copy_from_slice(&t.to_le_bytes());
    b
}

impl raft::Storage for RaftStore {
    fn initial_state(&self) -> raft::Result<RaftState> {
        let m = self.rl();
        Ok(RaftState::new(m.hard.clone(), m.conf.clone()))
    }

    fn entries(
        &self,
        low: u64,
        high: u64,
        max_size: impl Into<Option<u64>>,
        _context: GetEntriesContext,
    ) -> raft::Result<Vec<Entry>> {
        let m = self.rl();
        if low < m.first_index() {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        if high > m.last_index() + 1 || low > high {
            return Err(raft::Error::Store(StorageError::Unavailable));
        }
        let off = m.first_index();
        let mut ents = m.entries[(low - off) as usize..(high - off) as usize].to_vec();
        raft::util::limit_size(&mut ents, max_size.into());
        Ok(ents)
    }

    fn term(&self, idx: u64) -> raft::Result<u64> {
        let m = self.rl();
        if idx == m.truncated.0 {
            return Ok(m.truncated.1);
        }
        if idx < m.first_index() {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        if idx > m.last_index() {
            return Err(raft::Error::Store(StorageError::Unavailable));
        }
        Ok(m.entries[(idx - m.first_index()) as usize].term)
    }

    fn first_index(&self) -> raft::Result<u64> {
        Ok(self.rl().first_index())
    }

    fn last_index(&self) -> raft::Result<u64> {
        Ok(self.rl().last_index())
    }

    fn snapshot(&self, request_index: u64, _to: u64) -> raft::Result<Snapshot> {
        let m = self.rl();
        if m.applied.get_metadata().index < request_index || m.applied.data.is_empty() {
            return Err(raft::Error::Store(
                StorageError::SnapshotTemporarilyUnavailable,
            ));
        }
        Ok(m.applied.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use raft::Storage;

    fn entry(index: u64, term: u64) -> Entry {
        Entry {
            index,
            term,
            data: vec![index as u8; 3].into(),
            ..Default::default()
        }
    }

    #[test]
    fn survives_reopen_truncates_conflicts_and_compacts() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("raft.redb");
        let s = RaftStore::open(&path).unwrap();
        s.bootstrap(ConfState::from((vec![1, 2, 3], vec![])))
            .unwrap();
        // The bootstrap is an applied snapshot at 1: the log starts at 2.
        assert_eq!(s.bounds(), (2, 1));
        assert_eq!(s.snapshot(0, 2).unwrap().get_metadata().index, 1);
        assert!(
            s.persist(None, &[entry(1, 1)], None).is_err(),
            "entry 1 is inside the bootstrap snapshot"
        );
        let hs = HardState {
            term: 2,
            vote: 1,
            commit: 3,
            ..Default::default()
        };
        s.persist(
            None,
            &(2..=6).map(|i| entry(i, 1)).collect::<Vec<_>>(),
            Some(&hs),
        )
        .unwrap();
        // A new leader overwrites 5..: the old 5 and 6 go.
        s.persist(None, &[entry(5, 2)], None).unwrap();
        assert_eq!(s.bounds(), (2, 5));
        let st = ClusterState {
            placement_version: 7,
            ..Default::default()
        };
        s.save_applied(4, 1, &ConfState::from((vec![1, 2, 3], vec![])), &st)
            .unwrap();
        s.compact(3).unwrap();
        assert!(s.compact(5).is_err(), "past the applied index");
        drop(s);

        let s = RaftStore::open(&path).unwrap();
        assert_eq!(s.bounds(), (4, 5));
        assert_eq!(s.term(3).unwrap(), 1);
        assert_eq!(s.term(5).unwrap(), 2);
        assert!(matches!(
            s.term(2),
            Err(raft::Error::Store(StorageError::Compacted))
        ));
        let rs = s.initial_state().unwrap();
        assert_eq!(rs.hard_state, hs);
        assert_eq!(rs.conf_state.voters, vec![1, 2, 3]);
        let (state, idx, term, _) = s.applied().unwrap();
        assert_eq!((state.placement_version, idx, term), (7, 4, 1));
        let snap = s.snapshot(0, 2).unwrap();
        assert_eq!(snap.get_metadata().index, 4);
        assert_eq!(
            s.entries(4, 6, None, GetEntriesContext::empty(false))
                .unwrap()
                .len(),
            2
        );
        assert!(s.bootstrap(ConfState::default()).is_err());
    }

    #[test]
    fn a_snapshot_replaces_the_log_and_a_bad_one_changes_nothing() {
        let s = RaftStore::in_memory().unwrap();
        s.persist(
            None,
            &(1..=3).map(|i| entry(i, 1)).collect::<Vec<_>>(),
            None,
        )
        .unwrap();
        let mut bad = Snapshot::default();
        bad.mut_metadata().index = 10;
        bad.data = b"not a state".to_vec().into();
        assert!(s.persist(Some(&bad), &[], None).is_err());
        assert_eq!(s.bounds(), (1, 3));
        let mut snap = Snapshot::default();
        snap.mut_metadata().index = 10;
        snap.mut_metadata().term = 4;
        snap.data = ClusterState::default().encode().into();
        s.persist(Some(&snap), &[], None).unwrap();
        assert_eq!(s.bounds(), (11, 10));
        assert_eq!(s.term(10).unwrap(), 4);
        assert_eq!(s.hard_state().commit, 10);
        let again = RaftStore::from_db(s.database()).unwrap();
        assert_eq!(again.bounds(), (11, 10));
    }
}
