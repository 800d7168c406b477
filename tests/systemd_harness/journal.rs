//! Journal entries as `journalctl -o json` gives them: the message, its syslog priority, and
//! the process that wrote it.

/// One journal entry.
#[derive(Debug, Clone)]
pub struct Entry {
    pub message: String,
    /// Syslog priority: 3 error, 4 warning, 6 info, 7 debug.
    pub priority: u8,
    /// `_PID`: the process that wrote it (absent for some of systemd's own lines).
    pub pid: Option<u32>,
    /// `_SYSTEMD_UNIT`, or `UNIT` for the manager's lines about a unit.
    pub unit: Option<String>,
}

impl std::fmt::Display for Entry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "<{}> {}", self.priority, self.message)
    }
}

/// The entries of `journalctl -o json` output, one JSON object per line. A field that is not
/// valid UTF-8 comes as an array of bytes.
pub fn parse(output: &str) -> Vec<Entry> {
    output
        .lines()
        .filter(|line| !line.trim().is_empty())
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .map(|value| Entry {
            message: text(&value["MESSAGE"]).unwrap_or_default(),
            priority: text(&value["PRIORITY"])
                .and_then(|p| p.parse().ok())
                .unwrap_or(6),
            pid: text(&value["_PID"]).and_then(|p| p.parse().ok()),
            unit: text(&value["_SYSTEMD_UNIT"]).or_else(|| text(&value["UNIT"])),
        })
        .collect()
}

fn text(value: &serde_json::Value) -> Option<String> {
    match value {
        serde_json::Value::String(text) => Some(text.clone()),
        serde_json::Value::Array(bytes) => {
            let bytes: Vec<u8> = bytes
                .iter()
                .filter_map(|b| b.as_u64().map(|b| b as u8))
                .collect();
            Some(String::from_utf8_lossy(&bytes).into_owned())
        }
        _ => None,
    }
}

/// The entries as lines, for failure messages.
pub fn render(entries: &[Entry]) -> String {
    entries
        .iter()
        .map(Entry::to_string)
        .collect::<Vec<_>>()
        .join("\n")
}
