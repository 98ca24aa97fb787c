//! The expert store's policy: which experts are resident, which to read, which to evict.
//!
//! Pure logic, no I/O and no clock: the caller passes the time in and performs the reads the
//! policy asks for, then reports them done ([`Policy::read_done`]). That keeps every rule here
//! testable without a disk, and lets `ternfleet routing` replay a routing trace through the
//! same policy to estimate hit rates.
//!
//! Rules:
//! - The bytes of resident and in-flight experts never exceed the budget. An expert that
//!   compute holds ([`Policy::demand`] pins it until [`Policy::release`]) or that is being
//!   read is never evicted; of the others, [`Evict::Lru`] drops the least recently used
//!   first (the baseline), [`Evict::Lfu`] the least frequently demanded (ties: least
//!   recently used), with every count halved each `16 ×` (experts seen) demands so the
//!   counts follow the routing as it drifts. Decode visits a layer's experts in a cycle
//!   longer than any budget below the model, which is LRU's worst case: at 25 % resident
//!   it can evict every expert just before its next use.
//! - A demand for an expert that is resident is a hit; for one being read (a prefetch still
//!   in flight) the caller waits for that read, nothing is read twice; otherwise it is a miss
//!   and the caller reads it.
//! - A hint ([`Policy::hint`]) reads an expert ahead of time only if it is neither resident
//!   nor being read, room can be made without touching pinned experts, and hinted experts
//!   stay within half the budget (so demands always find room once reads land); a
//!   prefetched expert that is evicted before any demand counts as wasted.
//! - A hinted expert (read ahead, or already resident while protected bytes stay within half
//!   the budget) is **protected** until it is demanded
//!   or its layer has run ([`Policy::layer_ran`]): never evicted meanwhile, so the demands of
//!   the layers in between cannot throw out what was read for the next one (under LFU a
//!   prefetched expert, demanded zero times, would otherwise go first). Protection never
//!   blocks a demand: when nothing else can make room, every protection is lifted. A hinted
//!   read still queued when its layer runs without it is cancelled ([`Policy::cancel`]).
//! - A failed read removes the entry: the demand that waited on it gets the error (for that
//!   request only) and the next demand reads again.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

pub use ternfleet_shared::expert::StoreStats;

/// One expert of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExpertId {
    pub layer: u32,
    pub expert: u32,
}

impl std::fmt::Display for ExpertId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "layer {} expert {}", self.layer, self.expert)
    }
}

/// What the caller of [`Policy::demand`] must do.
#[derive(Debug, PartialEq, Eq)]
pub enum Demand {
    /// Resident: use it.
    Hit,
    /// Being read (a prefetch): wait for that read.
    Wait,
    /// Not resident: read it (after dropping `evict`).
    Read { evict: Vec<ExpertId> },
}

/// Which resident expert goes first when room is needed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Evict {
    /// Least recently used (the baseline).
    Lru,
    /// Least frequently demanded (decayed counts), then least recently used: the default,
    /// better on real routing (docs/moe-scale.md).
    #[default]
    Lfu,
}

impl std::str::FromStr for Evict {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "lru" => Ok(Evict::Lru),
            "lfu" => Ok(Evict::Lfu),
            _ => Err(format!("eviction policy {s:?}: expected lru or lfu")),
        }
    }
}

/// Low bits of an order key that hold the logical time (the rest: the LFU count).
const TICK_BITS: u32 = 40;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Resident,
    Reading { since: Instant },
}

#[derive(Debug)]
struct Entry {
    bytes: u64,
    state: State,
    /// Eviction order key (smallest goes first): the logical time of the last demand or
    /// hint, above it the demand count under [`Evict::Lfu`].
    last: u64,
    pins: u32,
    /// Read by a hint and not demanded since.
    prefetched: bool,
    /// Hinted, not demanded since, its layer not run: not evictable, counted in `held`.
    protected: bool,
}

/// Errors of the policy.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PolicyError {
    #[error("{id} needs {bytes} bytes but the store's budget is {budget} bytes")]
    TooBig {
        id: ExpertId,
        bytes: u64,
        budget: u64,
    },
    #[error("{id}: no room within the budget ({budget} bytes): {pinned} bytes are held by compute and {reading} bytes are being read")]
    Full {
        id: ExpertId,
        budget: u64,
        pinned: u64,
        reading: u64,
    },
}

/// The residency policy of one store (LFU or LRU within a byte budget).
#[derive(Debug)]
pub struct Policy {
    budget: u64,
    used: u64,
    /// Bytes of protected (hinted) experts, being read or resident.
    held: u64,
    /// The protected experts, by layer.
    protected: BTreeSet<ExpertId>,
    /// Hinted reads in flight that no demand has pinned, by layer (protected or not).
    hinted_reading: BTreeSet<ExpertId>,
    tick: u64,
    entries: HashMap<ExpertId, Entry>,
    /// Evictable candidates: (order key, id) of resident, unpinned entries.
    lru: BTreeSet<(u64, ExpertId)>,
    evict: Evict,
    /// Demands per expert (LFU), halved every `16 × freq.len()` demands.
    freq: HashMap<ExpertId, u64>,
    demands: u64,
    stats: StoreStats,
}

impl Policy {
    /// An empty LRU store that may hold `budget` bytes of experts.
    pub fn new(budget: u64) -> Policy {
        Policy::with_eviction(budget, Evict::Lru)
    }

    /// An empty store that may hold `budget` bytes of experts, evicting by `evict`.
    pub fn with_eviction(budget: u64, evict: Evict) -> Policy {
        Policy {
            budget,
            used: 0,
            held: 0,
            protected: BTreeSet::new(),
            hinted_reading: BTreeSet::new(),
            tick: 0,
            entries: HashMap::new(),
            lru: BTreeSet::new(),
            evict,
            freq: HashMap::new(),
            demands: 0,
            stats: StoreStats::default(),
        }
    }

    /// The order key of `id` at logical time `tick`.
    fn key(&self, id: ExpertId, tick: u64) -> u64 {
        let t = tick & ((1 << TICK_BITS) - 1);
        match self.evict {
            Evict::Lru => t,
            Evict::Lfu => {
                let f = self.freq.get(&id).copied().unwrap_or(0).min((1 << 23) - 1);
                (f << TICK_BITS) | t
            }
        }
    }

    /// LFU: counts one demand of `id`, and halves every count (re-keying the evictable
    /// entries) once per `16 ×` experts seen demands.
    fn count(&mut self, id: ExpertId) {
        if self.evict != Evict::Lfu {
            return;
        }
        *self.freq.entry(id).or_insert(0) += 1;
        self.demands += 1;
        if self.demands < 16 * self.freq.len() as u64 {
            return;
        }
        self.demands = 0;
        self.freq.values_mut().for_each(|f| *f /= 2);
        let listed: Vec<(u64, ExpertId)> = std::mem::take(&mut self.lru).into_iter().collect();
        for (old, x) in listed {
            let k = self.key(x, old);
            if let Some(e) = self.entries.get_mut(&x) {
                e.last = k;
            }
            self.lru.insert((k, x));
        }
    }

    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Bytes of resident and in-flight experts.
    pub fn used(&self) -> u64 {
        self.used
    }

    pub fn stats(&self) -> &StoreStats {
        &self.stats
    }

    /// Whether `id` is resident (not merely being read).
    pub fn is_resident(&self, id: ExpertId) -> bool {
        matches!(self.entries.get(&id), Some(e) if e.state == State::Resident)
    }

    /// Resident experts.
    pub fn resident(&self) -> usize {
        self.entries
            .values()
            .filter(|e| e.state == State::Resident)
            .count()
    }

    fn touch(&mut self, id: ExpertId) {
        self.tick += 1;
        let key = self.key(id, self.tick);
        if let Some(e) = self.entries.get_mut(&id) {
            if e.state == State::Resident && e.pins == 0 && !e.protected {
                self.lru.remove(&(e.last, id));
                self.lru.insert((key, id));
            }
            e.last = key;
        }
    }

    /// The least recently used evictable experts whose removal makes room for `bytes`, or
    /// `None` when even evicting all of them would not.
    fn victims(&self, bytes: u64) -> Option<Vec<ExpertId>> {
        let mut free = self.budget - self.used;
        let mut out = Vec::new();
        for &(_, id) in &self.lru {
            if free >= bytes {
                break;
            }
            free += self.entries[&id].bytes;
            out.push(id);
        }
        (free >= bytes).then_some(out)
    }

    fn evict(&mut self, victims: &[ExpertId]) {
        for id in victims {
            if let Some(e) = self.entries.remove(id) {
                self.lru.remove(&(e.last, *id));
                self.used -= e.bytes;
                self.stats.evictions += 1;
                if e.prefetched {
                    self.stats.prefetch_wasted += 1;
                }
            }
        }
    }

    fn full(&self, id: ExpertId) -> PolicyError {
        let (mut pinned, mut reading) = (0, 0);
        for e in self.entries.values() {
            match e.state {
                State::Reading { .. } => reading += e.bytes,
                State::Resident if e.pins > 0 || e.protected => pinned += e.bytes,
                State::Resident => {}
            }
        }
        PolicyError::Full {
            id,
            budget: self.budget,
            pinned,
            reading,
        }
    }

    fn insert_reading(&mut self, id: ExpertId, bytes: u64, now: Instant, pins: u32) {
        self.tick += 1;
        let last = self.key(id, self.tick);
        self.used += bytes;
        self.entries.insert(
            id,
            Entry {
                bytes,
                state: State::Reading { since: now },
                last,
                pins,
                prefetched: pins == 0,
                protected: pins == 0,
            },
        );
        if pins == 0 {
            self.held += bytes;
            self.protected.insert(id);
            self.hinted_reading.insert(id);
        }
    }

    /// Ends `id`'s protection (demanded, or its layer ran): evictable again once unpinned and
    /// resident.
    fn unprotect(&mut self, id: ExpertId) {
        let Some(e) = self.entries.get_mut(&id) else {
            return;
        };
        if !std::mem::take(&mut e.protected) {
            return;
        }
        self.held -= e.bytes;
        self.protected.remove(&id);
        if e.pins == 0 && e.state == State::Resident {
            self.lru.insert((e.last, id));
        }
    }

    /// Layer `layer` has demanded what it needs: its hinted experts that were not demanded
    /// lose their protection (under LFU, with no demands counted, they go first). Returns
    /// its hinted reads still in flight that no demand wants, for the caller to cancel if it
    /// has not started them ([`Policy::cancel`]).
    pub fn layer_ran(&mut self, layer: u32) -> Vec<ExpertId> {
        let lo = ExpertId { layer, expert: 0 };
        let hi = ExpertId {
            layer,
            expert: u32::MAX,
        };
        let ids: Vec<ExpertId> = self.protected.range(lo..=hi).copied().collect();
        for id in ids {
            self.unprotect(id);
        }
        self.hinted_reading.range(lo..=hi).copied().collect()
    }

    /// Whether the policy holds an entry for `id` (resident or being read).
    pub fn is_known(&self, id: ExpertId) -> bool {
        self.entries.contains_key(&id)
    }

    /// A hinted read that was never started and is no longer wanted (its layer ran without
    /// it): forgotten, its bytes free, counted as wasted; `true`. Nothing happens to an
    /// expert that is resident, demanded or not being read (`false`): its read must go on.
    pub fn cancel(&mut self, id: ExpertId) -> bool {
        let Some(e) = self.entries.get(&id) else {
            return false;
        };
        if e.pins > 0 || e.state == State::Resident {
            return false;
        }
        self.unprotect(id);
        self.hinted_reading.remove(&id);
        if let Some(e) = self.entries.remove(&id) {
            self.used -= e.bytes;
            if e.prefetched {
                self.stats.prefetch_wasted += 1;
            }
        }
        true
    }

    /// Lifts every protection (a demand found no other room).
    fn unprotect_all(&mut self) {
        let ids: Vec<ExpertId> = self.protected.iter().copied().collect();
        for id in ids {
            self.unprotect(id);
        }
    }

    /// Compute needs `id` (`bytes` long) now. Pins it until [`Policy::release`]; on
    /// [`Demand::Read`] the caller evicts the listed experts, reads `id` and calls
    /// [`Policy::read_done`].
    pub fn demand(
        &mut self,
        id: ExpertId,
        bytes: u64,
        now: Instant,
    ) -> Result<Demand, PolicyError> {
        if let Some(e) = self.entries.get(&id) {
            // Off the evictable list before its key changes with the count.
            if e.pins == 0 && e.state == State::Resident {
                self.lru.remove(&(e.last, id));
            }
        }
        self.count(id);
        if let Some(e) = self.entries.get_mut(&id) {
            let was_prefetch = std::mem::take(&mut e.prefetched);
            if was_prefetch {
                self.stats.prefetch_used += 1;
            }
            let was_protected = e.protected;
            let out = match e.state {
                State::Resident => {
                    self.stats.hits += 1;
                    Demand::Hit
                }
                State::Reading { .. } => {
                    // A late prefetch still saved part of the read; a second demand for a
                    // demand read in flight saved nothing: a miss again.
                    if was_prefetch {
                        self.stats.waits += 1;
                    } else {
                        self.stats.misses += 1;
                    }
                    Demand::Wait
                }
            };
            e.pins += 1;
            if was_protected {
                self.unprotect(id);
            }
            self.hinted_reading.remove(&id);
            self.touch(id);
            return Ok(out);
        }
        if bytes > self.budget {
            return Err(PolicyError::TooBig {
                id,
                bytes,
                budget: self.budget,
            });
        }
        let evict = match self.victims(bytes) {
            Some(v) => v,
            None if !self.protected.is_empty() => {
                self.unprotect_all();
                self.victims(bytes).ok_or_else(|| self.full(id))?
            }
            None => return Err(self.full(id)),
        };
        self.evict(&evict);
        self.stats.misses += 1;
        self.insert_reading(id, bytes, now, 1);
        Ok(Demand::Read { evict })
    }

    /// A hint that `id` will be needed soon. `Some(evict)`: read it ahead (after dropping
    /// `evict`) and call [`Policy::read_done`]; `None`: nothing to do.
    pub fn hint(&mut self, id: ExpertId, bytes: u64, now: Instant) -> Option<Vec<ExpertId>> {
        if let Some(e) = self.entries.get(&id) {
            // Resident or in flight: refresh its place in the order and, if resident and
            // unpinned, protect it until its layer runs; read nothing.
            let (b, protect) = (
                e.bytes,
                e.state == State::Resident && e.pins == 0 && !e.protected,
            );
            self.touch(id);
            if protect && self.held + b <= self.budget / 2 {
                if let Some(e) = self.entries.get_mut(&id) {
                    self.lru.remove(&(e.last, id));
                    e.protected = true;
                    self.held += b;
                    self.protected.insert(id);
                }
            }
            self.stats.hints_skipped += 1;
            return None;
        }
        let Some(evict) = (self.held + bytes <= self.budget / 2)
            .then(|| self.victims(bytes))
            .flatten()
        else {
            self.stats.hints_skipped += 1;
            return None;
        };
        self.evict(&evict);
        self.stats.prefetches += 1;
        self.insert_reading(id, bytes, now, 0);
        Some(evict)
    }

    /// The read of `id` finished at `now` (`ok`: its bytes are in memory). A failed read
    /// forgets the entry (waiters get the error; the next demand reads again).
    pub fn read_done(&mut self, id: ExpertId, ok: bool, now: Instant) {
        let Some(e) = self.entries.get_mut(&id) else {
            return;
        };
        let State::Reading { since } = e.state else {
            return;
        };
        self.hinted_reading.remove(&id);
        if !ok {
            self.stats.read_errors += 1;
            if e.prefetched {
                self.stats.prefetch_wasted += 1;
            }
            self.unprotect(id);
            if let Some(e) = self.entries.remove(&id) {
                self.used -= e.bytes;
            }
            return;
        }
        let ns = now.saturating_duration_since(since).as_nanos() as u64;
        self.stats.reads += 1;
        self.stats.read_ns += ns;
        self.stats.read_ns_max = self.stats.read_ns_max.max(ns);
        self.stats.bytes_read += e.bytes;
        e.state = State::Resident;
        if e.pins == 0 && !e.protected {
            self.lru.insert((e.last, id));
        }
    }

    /// Compute is done with `id` (one [`Policy::demand`]); it becomes evictable when no
    /// demand holds it.
    pub fn release(&mut self, id: ExpertId) {
        if let Some(e) = self.entries.get_mut(&id) {
            e.pins = e.pins.saturating_sub(1);
            if e.pins == 0 && e.state == State::Resident && !e.protected {
                self.lru.insert((e.last, id));
            }
        }
    }

    /// Mean read latency.
    pub fn mean_read(&self) -> Duration {
        Duration::from_nanos(self.stats.read_ns / self.stats.reads.max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(layer: u32, expert: u32) -> ExpertId {
        ExpertId { layer, expert }
    }

    /// Demands and immediately completes the read (a synchronous miss), then releases.
    fn use_now(p: &mut Policy, x: ExpertId, bytes: u64, t: Instant) -> Demand {
        let d = p.demand(x, bytes, t).expect("room");
        if matches!(d, Demand::Read { .. }) {
            p.read_done(x, true, t);
        }
        p.release(x);
        d
    }

    #[test]
    fn evicts_least_recently_used_first_and_never_exceeds_the_budget() {
        let t = Instant::now();
        let mut p = Policy::new(300);
        for e in 0..3 {
            assert_eq!(
                use_now(&mut p, id(0, e), 100, t),
                Demand::Read { evict: vec![] }
            );
        }
        // Touch expert 0: expert 1 is now the least recently used.
        assert_eq!(use_now(&mut p, id(0, 0), 100, t), Demand::Hit);
        assert_eq!(
            use_now(&mut p, id(0, 3), 100, t),
            Demand::Read {
                evict: vec![id(0, 1)]
            }
        );
        assert_eq!(
            use_now(&mut p, id(0, 4), 150, t),
            Demand::Read {
                evict: vec![id(0, 2), id(0, 0)]
            }
        );
        assert!(p.used() <= p.budget());
        assert_eq!(p.used(), 250);
        let s = p.stats();
        assert_eq!((s.hits, s.misses, s.evictions), (1, 5, 3));
        assert!(p.is_resident(id(0, 3)) && p.is_resident(id(0, 4)));
        assert!(!p.is_resident(id(0, 1)));
    }

    #[test]
    fn lfu_keeps_the_frequently_demanded_expert_that_lru_would_evict() {
        let t = Instant::now();
        for (evict, want) in [(Evict::Lru, id(0, 0)), (Evict::Lfu, id(0, 1))] {
            let mut p = Policy::with_eviction(200, evict);
            use_now(&mut p, id(0, 0), 100, t);
            for _ in 0..3 {
                use_now(&mut p, id(0, 1), 100, t);
            }
            // Expert 1 demanded three times, expert 0 twice but last: LRU drops expert 1,
            // LFU expert 0.
            use_now(&mut p, id(0, 0), 100, t);
            let victim = match use_now(&mut p, id(0, 2), 100, t) {
                Demand::Read { evict } => evict,
                d => panic!("{d:?}"),
            };
            let other = if want == id(0, 0) { id(0, 1) } else { id(0, 0) };
            assert_eq!(victim, vec![other], "{evict:?}");
        }
        assert_eq!("lfu".parse::<Evict>(), Ok(Evict::Lfu));
        assert!("mru".parse::<Evict>().unwrap_err().contains("lru or lfu"));
    }

    #[test]
    fn pinned_and_in_flight_experts_are_never_evicted() {
        let t = Instant::now();
        let mut p = Policy::new(200);
        assert!(matches!(
            p.demand(id(1, 0), 100, t),
            Ok(Demand::Read { .. })
        ));
        p.read_done(id(1, 0), true, t);
        // Expert 1 is being read by a hint.
        assert_eq!(p.hint(id(1, 1), 100, t), Some(vec![]));
        // Both held: no room for a third.
        let err = p.demand(id(1, 2), 100, t).unwrap_err();
        assert_eq!(
            err,
            PolicyError::Full {
                id: id(1, 2),
                budget: 200,
                pinned: 100,
                reading: 100
            }
        );
        assert!(err.to_string().contains("held by compute"));
        // A hint never evicts them either.
        assert_eq!(p.hint(id(1, 3), 100, t), None);
        // Released and read: now evictable, the pinned-longest first.
        p.release(id(1, 0));
        p.read_done(id(1, 1), true, t);
        assert_eq!(
            p.demand(id(1, 2), 100, t),
            Ok(Demand::Read {
                evict: vec![id(1, 0)]
            })
        );
        assert_eq!(
            p.demand(id(1, 9), 500, t),
            Err(PolicyError::TooBig {
                id: id(1, 9),
                bytes: 500,
                budget: 200
            })
        );
    }

    #[test]
    fn a_prefetch_in_flight_is_not_issued_twice_and_a_demand_waits_for_it() {
        let t0 = Instant::now();
        let mut p = Policy::new(1000);
        assert_eq!(p.hint(id(2, 5), 100, t0), Some(vec![]));
        assert_eq!(p.hint(id(2, 5), 100, t0), None);
        assert_eq!(p.stats().prefetches, 1);
        assert_eq!(p.demand(id(2, 5), 100, t0), Ok(Demand::Wait));
        p.read_done(id(2, 5), true, t0 + Duration::from_millis(3));
        p.release(id(2, 5));
        let s = p.stats();
        assert_eq!((s.waits, s.prefetch_used, s.misses), (1, 1, 0));
        assert_eq!(s.bytes_read, 100);
        assert_eq!(p.mean_read(), Duration::from_millis(3));
        assert_eq!(s.hit_rate(), 1.0);
        // Resident now: a demand is a hit and a hint reads nothing.
        assert_eq!(p.hint(id(2, 5), 100, t0), None);
        assert_eq!(use_now(&mut p, id(2, 5), 100, t0), Demand::Hit);
    }

    #[test]
    fn prefetches_stay_within_half_the_budget() {
        let t = Instant::now();
        let mut p = Policy::new(400);
        assert!(p.hint(id(1, 0), 100, t).is_some());
        assert!(p.hint(id(1, 1), 100, t).is_some());
        // A third would pass half the budget: skipped, room left for demands.
        assert_eq!(p.hint(id(1, 2), 100, t), None);
        assert!(matches!(
            p.demand(id(0, 3), 200, t),
            Ok(Demand::Read { .. })
        ));
        // Landed but still protected (layer 1 has not run): no room for another.
        p.read_done(id(1, 0), true, t);
        assert_eq!(p.hint(id(1, 2), 100, t), None);
        // Layer 1 runs without them: their protection ends, the read in flight is reported
        // for cancelling, and a new prefetch may evict the landed, unused one.
        assert_eq!(p.layer_ran(1), vec![id(1, 1)]);
        assert!(p.cancel(id(1, 1)));
        assert_eq!(p.used(), 300);
        assert_eq!(p.hint(id(2, 2), 100, t), Some(vec![])); // room: 400 - 300
        assert!(p.entries.contains_key(&id(2, 2)));
        assert_eq!(p.hint(id(2, 4), 100, t), Some(vec![id(1, 0)]));
        assert_eq!(p.stats().prefetch_wasted, 2);
    }

    #[test]
    fn a_hinted_expert_survives_lfu_until_its_layer_runs() {
        let t = Instant::now();
        let mut p = Policy::with_eviction(400, Evict::Lfu);
        // Two often-used experts of layer 0, then a prefetch for layer 1 (count 0).
        for _ in 0..3 {
            use_now(&mut p, id(0, 0), 100, t);
            use_now(&mut p, id(0, 1), 100, t);
        }
        assert_eq!(p.hint(id(1, 5), 100, t), Some(vec![]));
        p.read_done(id(1, 5), true, t);
        use_now(&mut p, id(0, 2), 100, t);
        // Layer 0 needs room: without protection the prefetch (count 0) would go first.
        assert_eq!(
            use_now(&mut p, id(0, 3), 100, t),
            Demand::Read {
                evict: vec![id(0, 2)]
            }
        );
        assert_eq!(use_now(&mut p, id(1, 5), 100, t), Demand::Hit);
        assert_eq!(use_now(&mut p, id(1, 5), 100, t), Demand::Hit);
        assert_eq!(p.stats().prefetch_used, 1);
        // A hint for a resident expert protects it too: (0, 3), demanded once, would go
        // before (1, 5), demanded twice.
        assert_eq!(p.hint(id(0, 3), 100, t), None);
        assert_eq!(
            use_now(&mut p, id(2, 0), 100, t),
            Demand::Read {
                evict: vec![id(1, 5)]
            }
        );
        // Once its layer has run it is evictable by the usual order, and goes first.
        assert!(p.layer_ran(0).is_empty());
        assert_eq!(
            use_now(&mut p, id(2, 1), 100, t),
            Demand::Read {
                evict: vec![id(0, 3)]
            }
        );
    }

    #[test]
    fn a_layer_ending_lifts_only_its_own_protections() {
        let t = Instant::now();
        let mut p = Policy::new(800);
        for l in [1, 2] {
            prefetched(&mut p, l, 0..1, t);
        }
        assert!(p.layer_ran(1).is_empty());
        assert!(p.protected.contains(&id(2, 0)) && !p.protected.contains(&id(1, 0)));
        for e in 1..7 {
            assert_eq!(
                use_now(&mut p, id(0, e), 100, t),
                Demand::Read { evict: vec![] }
            );
        }
        // Full: the oldest unprotected expert goes, (1, 0); then (0, 1), never (2, 0).
        for (e, gone) in [(7, id(1, 0)), (8, id(0, 1))] {
            assert_eq!(
                use_now(&mut p, id(0, e), 100, t),
                Demand::Read { evict: vec![gone] }
            );
        }
        assert!(p.is_resident(id(2, 0)));
    }

    /// Hints experts `es` of `layer` (100 bytes each) and lands their reads.
    fn prefetched(p: &mut Policy, layer: u32, es: std::ops::Range<u32>, t: Instant) {
        for e in es {
            assert!(p.hint(id(layer, e), 100, t).is_some());
            p.read_done(id(layer, e), true, t);
        }
    }

    #[test]
    fn protection_never_blocks_a_demand() {
        let t = Instant::now();
        let mut p = Policy::new(400);
        prefetched(&mut p, 1, 0..2, t);
        // 200 bytes pinned by compute, 200 protected: a demand lifts the protections.
        assert!(matches!(
            p.demand(id(0, 0), 100, t),
            Ok(Demand::Read { .. })
        ));
        assert!(matches!(
            p.demand(id(0, 1), 100, t),
            Ok(Demand::Read { .. })
        ));
        assert_eq!((p.protected.len(), p.held), (2, 200));
        assert_eq!(
            p.demand(id(0, 2), 100, t),
            Ok(Demand::Read {
                evict: vec![id(1, 0)]
            })
        );
        assert!(p.protected.is_empty());
        assert_eq!(p.held, 0);
    }

    #[test]
    fn a_demand_for_a_queued_hint_waits_for_it_and_cancel_leaves_it_alone() {
        let t = Instant::now();
        let mut p = Policy::new(400);
        assert!(p.hint(id(1, 0), 100, t).is_some());
        assert_eq!(p.demand(id(1, 0), 100, t), Ok(Demand::Wait));
        assert!(p.layer_ran(1).is_empty());
        assert!(!p.cancel(id(1, 0))); // demanded: not cancelled
        assert!(p.entries.contains_key(&id(1, 0)));
        p.read_done(id(1, 0), true, t);
        p.release(id(1, 0));
        assert!(!p.cancel(id(1, 0))); // resident: not cancelled
        assert!(p.is_resident(id(1, 0)));
        assert_eq!(p.stats().prefetch_wasted, 0);
    }

    #[test]
    fn unused_prefetches_count_as_wasted_when_evicted() {
        let t = Instant::now();
        let mut p = Policy::new(400);
        prefetched(&mut p, 0, 0..2, t);
        assert_eq!(use_now(&mut p, id(0, 0), 100, t), Demand::Hit);
        // Layer 0 ran without expert 1: no longer protected (and no read of it in flight).
        assert!(p.layer_ran(0).is_empty());
        for e in 2..4 {
            use_now(&mut p, id(0, e), 100, t);
        }
        // Expert 1 (never used) is the LRU one.
        assert_eq!(
            use_now(&mut p, id(0, 4), 100, t),
            Demand::Read {
                evict: vec![id(0, 1)]
            }
        );
        let s = p.stats();
        assert_eq!((s.prefetch_used, s.prefetch_wasted), (1, 1));
    }

    #[test]
    fn a_failed_read_is_forgotten_and_read_again_on_the_next_demand() {
        let t = Instant::now();
        let mut p = Policy::new(200);
        assert!(matches!(
            p.demand(id(3, 1), 100, t),
            Ok(Demand::Read { .. })
        ));
        p.read_done(id(3, 1), false, t);
        assert_eq!(p.used(), 0);
        assert!(!p.is_resident(id(3, 1)));
        p.release(id(3, 1)); // the failed request lets go; harmless
        assert!(matches!(
            p.demand(id(3, 1), 100, t),
            Ok(Demand::Read { .. })
        ));
        p.read_done(id(3, 1), true, t);
        assert!(p.is_resident(id(3, 1)));
        assert_eq!(p.stats().read_errors, 1);
        // Other experts were never affected.
        assert_eq!(
            use_now(&mut p, id(3, 2), 100, t),
            Demand::Read { evict: vec![] }
        );
    }

    #[test]
    fn random_traces_keep_every_invariant() {
        random_trace(Evict::Lru);
        random_trace(Evict::Lfu);
    }

    fn random_trace(evict: Evict) {
        // A seeded random mix of demands, hints, completions and releases.
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = move |n: u64| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s % n
        };
        let t = Instant::now();
        let mut p = Policy::with_eviction(1000, evict);
        let mut held: Vec<ExpertId> = Vec::new();
        let mut reading: Vec<ExpertId> = Vec::new();
        for _ in 0..20_000 {
            let x = id(rnd(4) as u32, rnd(16) as u32);
            let bytes = 50 + 10 * (x.expert as u64 % 5);
            match rnd(4) {
                0 => {
                    if let Ok(d) = p.demand(x, bytes, t) {
                        if matches!(d, Demand::Read { .. }) {
                            reading.push(x);
                        }
                        held.push(x);
                    }
                }
                1 if p.hint(x, bytes, t).is_some() => reading.push(x),
                1 if rnd(3) == 0 => {
                    for y in p.layer_ran(x.layer) {
                        if rnd(2) == 0 && p.cancel(y) {
                            reading.retain(|&r| r != y);
                        }
                    }
                }
                2 if !reading.is_empty() => {
                    let i = rnd(reading.len() as u64) as usize;
                    let x = reading.swap_remove(i);
                    p.read_done(x, rnd(10) != 0, t);
                }
                _ if !held.is_empty() => {
                    let i = rnd(held.len() as u64) as usize;
                    p.release(held.swap_remove(i));
                }
                _ => {}
            }
            assert!(p.used() <= p.budget());
            let sum: u64 = p.entries.values().map(|e| e.bytes).sum();
            assert_eq!(sum, p.used());
            for &(k, x) in &p.lru {
                let e = &p.entries[&x];
                assert!(e.pins == 0 && e.state == State::Resident && e.last == k);
                assert!(!e.protected);
            }
            let listed = p
                .entries
                .values()
                .filter(|e| e.pins == 0 && e.state == State::Resident && !e.protected)
                .count();
            assert_eq!(listed, p.lru.len());
            let held: u64 = p.protected.iter().map(|x| p.entries[x].bytes).sum();
            assert_eq!(held, p.held);
            assert!(p.held <= p.budget / 2);
            let flagged = p.entries.values().filter(|e| e.protected).count();
            assert_eq!(flagged, p.protected.len());
            for x in &p.hinted_reading {
                let e = &p.entries[x];
                assert!(e.pins == 0 && e.prefetched && matches!(e.state, State::Reading { .. }));
            }
        }
    }
}
