//! The routing history: how often each (layer, expert) was picked, saved on shutdown (and
//! periodically by the server) and loaded at start to warm the tiers. Versioned and bound to
//! the model fingerprint, so a history from another model is ignored with a warning.

use serde::{Deserialize, Serialize};
use std::path::Path;

pub const HISTORY_VERSION: u32 = 1;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RoutingHistory {
    pub version: u32,
    pub fingerprint: String,
    pub experts: usize,
    /// `[layer][expert]` pick counts; empty rows for dense layers.
    pub counts: Vec<Vec<u64>>,
}

impl RoutingHistory {
    /// Loads `path` when it exists and belongs to this model; otherwise `None` with a reason
    /// logged (a missing file is the normal first start).
    pub fn load(
        path: &Path,
        fingerprint: &str,
        layers: usize,
        experts: usize,
    ) -> Option<RoutingHistory> {
        let text = std::fs::read_to_string(path).ok()?;
        let history: RoutingHistory = match serde_json::from_str(&text) {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "routing history unreadable; starting cold");
                return None;
            }
        };
        let problem = if history.version != HISTORY_VERSION {
            Some(format!(
                "version {} (this build writes {HISTORY_VERSION})",
                history.version
            ))
        } else if history.fingerprint != fingerprint {
            Some(format!(
                "model fingerprint {} is not this model's {fingerprint}",
                history.fingerprint
            ))
        } else if history.counts.len() != layers || history.experts != experts {
            Some(format!(
                "shape {}x{} is not {layers}x{experts}",
                history.counts.len(),
                history.experts
            ))
        } else {
            None
        };
        match problem {
            Some(why) => {
                tracing::warn!(path = %path.display(), %why, "routing history ignored; starting cold");
                None
            }
            None => Some(history),
        }
    }

    /// Writes atomically (temp file + rename) so a crash never leaves half a history.
    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        let tmp = path.with_extension("tmp");
        std::fs::write(
            &tmp,
            serde_json::to_vec(self).map_err(std::io::Error::other)?,
        )?;
        std::fs::rename(&tmp, path)
    }

    /// Layer `layer`'s experts, most picked first (ties to the lower id).
    pub fn ranked(&self, layer: usize) -> Vec<usize> {
        let row = &self.counts[layer];
        let mut ids: Vec<usize> = (0..row.len()).collect();
        ids.sort_by(|&a, &b| row[b].cmp(&row[a]).then(a.cmp(&b)));
        ids.retain(|&e| row[e] > 0);
        ids
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_refusals() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("history.json");
        let h = RoutingHistory {
            version: HISTORY_VERSION,
            fingerprint: "abc".into(),
            experts: 4,
            counts: vec![vec![], vec![5, 0, 9, 5]],
        };
        h.save(&path).unwrap();
        assert_eq!(RoutingHistory::load(&path, "abc", 2, 4), Some(h.clone()));
        assert_eq!(h.ranked(1), vec![2, 0, 3]);
        assert_eq!(RoutingHistory::load(&path, "other", 2, 4), None);
        assert_eq!(RoutingHistory::load(&path, "abc", 3, 4), None);
        assert_eq!(
            RoutingHistory::load(&dir.path().join("missing"), "abc", 2, 4),
            None
        );
        std::fs::write(&path, "{not json").unwrap();
        assert_eq!(RoutingHistory::load(&path, "abc", 2, 4), None);
    }
}
