//! How many sessions read at once, decided by what they deliver.
//!
//! A lazily loaded volume serves some number of cold fetches at once, each with some latency, under
//! the volume's IOPS and throughput caps and the instance's EBS bandwidth; none of these is
//! documented for the lazy fetch, and they change (a burst allowance runs out). So the number of
//! sessions is measured, not assumed: [`Controller`] watches the bytes read per window and climbs
//! while throughput keeps growing, settles at the best level when it stops, and probes upward again
//! from time to time, within a ceiling (the user's `--max-sessions`, capped by the server's free
//! connection slots).
//!
//! Pure: it sees throughputs and returns levels, so its behaviour is unit-tested against synthetic
//! volumes below; [`crate::warm`] feeds it and applies its levels.

use serde::{Deserialize, Serialize};

/// Sessions to start with: enough to see whether more help, few enough to be cheap where they do not.
/// 16, not 8: on the benchmark's shallowest volumes (4 and 8 fetches at once) 16 was already the best
/// fixed count, and on deep ones it saves a step of the climb (docs/benchmark.md, the matrix).
pub const START: usize = 16;
/// Throughput must grow by this fraction for a level to count as better.
pub const GAIN: f64 = 0.10;
/// Windows spent at the best level before probing one step higher again: a volume whose burst ran out
/// mid-climb (the level above measured no gain only because the volume slowed) is re-tried soon.
pub const PROBE_EVERY: u32 = 4;

/// One decision, for the report and the progress line.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct Level {
    /// Seconds since warming started.
    pub at_seconds: f64,
    /// Sessions reading from then on.
    pub sessions: usize,
    /// Throughput measured in the window that led to the decision, MiB/s.
    pub mib_per_second: f64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Phase {
    /// Climbing: each window at a new level; stays while throughput grows by more than GAIN.
    Climb,
    /// At the best level found; counts windows until the next probe.
    Hold(u32),
    /// One step above the best level, for one window.
    Probe,
}

#[derive(Debug, Clone)]
pub struct Controller {
    ceiling: usize,
    level: usize,
    best_level: usize,
    /// Throughput at `best_level`, bytes per second (tracked while holding, so that a volume that
    /// slows down, say when its burst runs out, is compared with what it does now).
    best_rate: f64,
    phase: Phase,
}

impl Controller {
    pub fn new(ceiling: usize) -> Controller {
        Controller::starting_at(ceiling, START)
    }

    /// A controller that starts at `start` sessions (within 1..=ceiling) instead of [`START`]: a call
    /// that goes on where an earlier one left off starts at the level it found.
    pub fn starting_at(ceiling: usize, start: usize) -> Controller {
        let ceiling = ceiling.max(1);
        let level = start.clamp(1, ceiling);
        Controller { ceiling, level, best_level: level, best_rate: 0.0, phase: Phase::Climb }
    }

    pub fn level(&self) -> usize {
        self.level
    }

    fn up(&self, from: usize) -> usize {
        (from * 2).max(from + 1).min(self.ceiling)
    }

    /// The work changed kind (steps of a large relation gave way to thousands of one-block forks, or
    /// back): what the levels measured on the old kind says nothing about the new one, so the climb
    /// starts again from the current level. Returns the level for the next window (the current one).
    pub fn new_regime(&mut self) -> usize {
        self.best_level = self.level;
        self.best_rate = 0.0;
        self.phase = Phase::Climb;
        self.level
    }

    /// Takes the throughput (bytes per second) of the window just ended at the current level and
    /// returns the level for the next window.
    pub fn observe(&mut self, rate: f64) -> usize {
        match self.phase {
            Phase::Climb | Phase::Probe if rate > self.best_rate * (1.0 + GAIN) => {
                self.best_rate = rate;
                self.best_level = self.level;
                if self.level < self.ceiling {
                    self.level = self.up(self.level);
                    self.phase = Phase::Climb;
                } else {
                    self.phase = Phase::Hold(0);
                }
            }
            Phase::Climb | Phase::Probe => {
                // No gain worth its sessions: back to the best level.
                self.level = self.best_level;
                self.phase = Phase::Hold(0);
            }
            Phase::Hold(n) => {
                // What the best level does now (a smoothed reading).
                self.best_rate = 0.5 * self.best_rate + 0.5 * rate;
                if n + 1 >= PROBE_EVERY && self.level < self.ceiling {
                    self.level = self.up(self.level);
                    self.phase = Phase::Probe;
                } else {
                    self.phase = Phase::Hold(n + 1);
                }
            }
        }
        self.level
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A volume serving `depth` fetches at once at `per_session` bytes/s each: throughput grows
    /// with sessions up to the depth, then stays flat (a little lower: queueing).
    fn volume(depth: usize, per_session: f64) -> impl Fn(usize) -> f64 {
        move |n| if n <= depth { n as f64 * per_session } else { depth as f64 * per_session * 0.98 }
    }

    fn settle(c: &mut Controller, v: &dyn Fn(usize) -> f64, windows: usize) -> Vec<usize> {
        (0..windows).map(|_| c.observe(v(c.level()))).collect()
    }

    #[test]
    fn it_climbs_to_the_volumes_depth_and_stays_there() {
        for depth in [4, 8, 32, 64] {
            let mut c = Controller::new(64);
            let levels = settle(&mut c, &volume(depth, 10e6), 40);
            // Doubling from START: the level it holds serves the whole depth without more than twice it.
            let held = *levels.last().unwrap();
            assert!(held >= depth.min(64) && held <= (2 * depth).clamp(START, 64), "depth {depth}: {levels:?}");
            // It gets there within a handful of windows.
            let first = levels.iter().position(|&l| l == held).unwrap();
            assert!(first <= 5, "depth {depth}: {levels:?}");
        }
    }

    #[test]
    fn a_controller_started_low_climbs_and_one_started_high_stays_within_the_ceiling() {
        let mut c = Controller::starting_at(64, 1);
        assert_eq!(c.level(), 1);
        let levels = settle(&mut c, &volume(32, 10e6), 40);
        assert!(*levels.last().unwrap() >= 32, "{levels:?}");
        assert_eq!(Controller::starting_at(8, 64).level(), 8);
        assert_eq!(Controller::starting_at(8, 0).level(), 1);
    }

    #[test]
    fn it_never_exceeds_the_ceiling() {
        let mut c = Controller::new(12);
        let levels = settle(&mut c, &volume(64, 10e6), 40);
        assert!(levels.iter().all(|&l| l <= 12), "{levels:?}");
        assert_eq!(*levels.last().unwrap(), 12);
        let mut one = Controller::new(1);
        assert!(settle(&mut one, &volume(64, 10e6), 10).iter().all(|&l| l == 1));
    }

    #[test]
    fn it_probes_again_and_follows_a_volume_that_gets_deeper() {
        let mut c = Controller::new(64);
        settle(&mut c, &volume(8, 10e6), 20);
        let before = c.level();
        assert!(before <= 16, "{before}");
        // The volume now serves 32 at once (another stripe, a quieter neighbour): a probe finds it.
        let levels = settle(&mut c, &volume(32, 10e6), 40);
        assert!(*levels.last().unwrap() >= 32, "{levels:?}");
    }

    #[test]
    fn a_new_kind_of_work_climbs_again_at_once() {
        // Steps of a large relation: 16 sessions already get all the volume gives (readahead keeps
        // two fetches in flight per session), so the probe to 32 fails and it holds 16.
        let mut c = Controller::new(64);
        settle(&mut c, &|n: usize| n.min(16) as f64 * 10e6, 3);
        assert_eq!(c.level(), 16);
        // One-block forks: one fetch in flight per session, so 32 sessions do twice what 16 do. Held
        // at 16, the next probe would be PROBE_EVERY windows away; a new regime climbs in the next.
        let forks = |n: usize| n.min(32) as f64 * 5e6;
        assert_eq!(c.new_regime(), 16);
        assert_eq!(c.observe(forks(c.level())), 32);
        // 64 gives nothing more, so it settles at 32 (until the next probe).
        let levels = settle(&mut c, &forks, 5);
        assert_eq!(levels, [64, 32, 32, 32, 32]);
    }

    #[test]
    fn a_volume_that_slows_down_is_held_at_its_best_level_not_chased_down() {
        let mut c = Controller::new(64);
        settle(&mut c, &volume(16, 10e6), 20);
        let held = c.level();
        // The burst runs out: everything is a third as fast; more sessions still do not help.
        let levels = settle(&mut c, &volume(16, 3e6), 40);
        let after = *levels.last().unwrap();
        assert!(after >= 16 && after <= held, "{held} -> {levels:?}");
    }
}
