//! Timers across ranks (Megatron's min/max reporting): every rank's per-step timer map is
//! gathered on rank 0 and reduced to mean, min and max per name. A timer a rank did not run
//! counts as 0 ms there.

use super::comm::Comm;
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

/// Gathers `local` from every rank of `comm`; the statistics on rank 0, `None` elsewhere.
pub fn gather(comm: &dyn Comm, local: &BTreeMap<String, f64>) -> Option<TimerStats> {
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
}
