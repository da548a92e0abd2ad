//! Timers across ranks (Megatron's min/max reporting): every rank's per-step timer map is
//! reduced to mean, min and max per name on rank 0 (all-reduces when every rank has the same
//! names, a gather otherwise). A timer a rank did not run counts as 0 ms there.

use crate::comm::{Comm, ReduceOp};
use std::collections::BTreeMap;

/// Per-name statistics over ranks, in milliseconds.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TimerStats {
    pub mean: BTreeMap<String, f64>,
    pub min: BTreeMap<String, f64>,
    pub max: BTreeMap<String, f64>,
}

/// Reduces per-rank maps (all ranks, in any order) to statistics.
pub fn reduce(maps: &[BTreeMap<String, f64>]) -> TimerStats {
    let mut st = TimerStats::default();
    let names: std::collections::BTreeSet<&String> = maps.iter().flat_map(|m| m.keys()).collect();
    for name in names {
        let vals: Vec<f64> = maps
            .iter()
            .map(|m| m.get(name).copied().unwrap_or(0.0))
            .collect();
        let n = vals.len().max(1) as f64;
        st.mean.insert(name.clone(), vals.iter().sum::<f64>() / n);
        st.min.insert(
            name.clone(),
            vals.iter().copied().fold(f64::INFINITY, f64::min),
        );
        st.max.insert(
            name.clone(),
            vals.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        );
    }
    st
}

/// FNV-1a over the sorted timer names (a stable hash: std's is randomised per process).
fn names_hash(local: &BTreeMap<String, f64>) -> u64 {
    local
        .keys()
        .flat_map(|k| k.bytes().chain([0]))
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
        })
}

/// The statistics of `local` over every rank of `comm`, on rank 0 (`None` elsewhere).
///
/// The usual case, every rank with the same timer names, costs four small all-reduces (the
/// names' hash, then sum, min and max of the values in name order), so it stays cheap on
/// thousands of ranks. Only when the names differ are the maps gathered on rank 0.
pub fn gather(comm: &dyn Comm, local: &BTreeMap<String, f64>) -> Option<TimerStats> {
    let h = names_hash(local);
    let (hi, lo) = ((h >> 32) as f64, (h & 0xffff_ffff) as f64);
    // max(x) together with max(-x) = -min(x): all equal iff max == min for both halves.
    let mut hv = [hi, lo, -hi, -lo];
    comm.allreduce_f64(&mut hv, ReduceOp::Max);
    if hv[0] == -hv[2] && hv[1] == -hv[3] {
        let vals: Vec<f64> = local.values().copied().collect();
        let mut sum = vals.clone();
        let mut min = vals.clone();
        let mut max = vals;
        comm.allreduce_f64(&mut sum, ReduceOp::Sum);
        comm.allreduce_f64(&mut min, ReduceOp::Min);
        comm.allreduce_f64(&mut max, ReduceOp::Max);
        if comm.rank() != 0 {
            return None;
        }
        let n = comm.size() as f64;
        let zip = |v: Vec<f64>, scale: f64| -> BTreeMap<String, f64> {
            local
                .keys()
                .cloned()
                .zip(v.into_iter().map(|x| x * scale))
                .collect()
        };
        return Some(TimerStats {
            mean: zip(sum, 1.0 / n),
            min: zip(min, 1.0),
            max: zip(max, 1.0),
        });
    }
    gather_maps(comm, local)
}

/// The general path of [`gather`]: every rank's map on rank 0.
fn gather_maps(comm: &dyn Comm, local: &BTreeMap<String, f64>) -> Option<TimerStats> {
    let bytes = serde_json::to_vec(local).expect("a map of floats serialises");
    let all = comm.gather_bytes(&bytes)?;
    let maps: Vec<BTreeMap<String, f64>> = all
        .iter()
        .map(|b| serde_json::from_slice(b).unwrap_or_default())
        .collect();
    Some(reduce(&maps))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn min_mean_max_with_missing_names() {
        let a = BTreeMap::from([("f".to_string(), 2.0), ("ckpt".to_string(), 9.0)]);
        let b = BTreeMap::from([("f".to_string(), 4.0)]);
        let st = reduce(&[a, b]);
        assert_eq!(st.mean["f"], 3.0);
        assert_eq!(st.min["f"], 2.0);
        assert_eq!(st.max["f"], 4.0);
        assert_eq!(st.min["ckpt"], 0.0);
        assert_eq!(st.max["ckpt"], 9.0);
    }

    #[test]
    fn one_rank_statistics_are_its_own_values() {
        let a = BTreeMap::from([("f".to_string(), 2.5), ("b".to_string(), 1.0)]);
        let st = gather(&crate::parallel::SerialComm::new(), &a).unwrap();
        assert_eq!(st.mean, a);
        assert_eq!(st.min, a);
        assert_eq!(st.max, a);
    }
}
