//! Counters and gauges, rendered as Prometheus text at `GET /metrics` (SPEC §5.6).
//!
//! A [`Registry`] hands out `Arc`-shared atomics keyed by family name and labels; hot paths keep
//! the handle they got instead of looking it up per event. Gauges whose value lives elsewhere
//! (pool size, mode, dead-man state) are registered as sampling functions and read at render
//! time.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

type Labels = Vec<(String, String)>;
type Sampler = Box<dyn Fn() -> Vec<(Labels, f64)> + Send + Sync>;

#[derive(Clone, Default, Debug)]
pub struct Counter(Arc<AtomicU64>);

impl Counter {
    pub fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

#[derive(Clone, Default, Debug)]
pub struct Gauge(Arc<AtomicI64>);

impl Gauge {
    pub fn set(&self, v: i64) {
        self.0.store(v, Ordering::Relaxed);
    }
    pub fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
    pub fn dec(&self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
    pub fn get(&self) -> i64 {
        self.0.load(Ordering::Relaxed)
    }
}

#[derive(Default)]
struct Family {
    help: String,
    kind: &'static str,
    counters: BTreeMap<Labels, Counter>,
    gauges: BTreeMap<Labels, Gauge>,
    samplers: Vec<Sampler>,
}

/// The process's metric families.
#[derive(Default, Clone)]
pub struct Registry {
    families: Arc<Mutex<BTreeMap<String, Family>>>,
}

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

impl Registry {
    pub fn new() -> Self {
        Self::default()
    }

    fn with_family<R>(
        &self,
        name: &str,
        help: &str,
        kind: &'static str,
        f: impl FnOnce(&mut Family) -> R,
    ) -> R {
        let mut families = self.families.lock().unwrap_or_else(|e| e.into_inner());
        let family = families.entry(name.to_string()).or_insert_with(|| Family {
            help: help.to_string(),
            kind,
            ..Family::default()
        });
        f(family)
    }

    /// The counter of `name` with these labels, created at zero on first use.
    pub fn counter(&self, name: &str, help: &str, label_pairs: &[(&str, &str)]) -> Counter {
        self.with_family(name, help, "counter", |family| {
            family
                .counters
                .entry(labels(label_pairs))
                .or_default()
                .clone()
        })
    }

    /// The gauge of `name` with these labels, created at zero on first use.
    pub fn gauge(&self, name: &str, help: &str, label_pairs: &[(&str, &str)]) -> Gauge {
        self.with_family(name, help, "gauge", |family| {
            family
                .gauges
                .entry(labels(label_pairs))
                .or_default()
                .clone()
        })
    }

    /// A gauge family whose values are sampled at render time.
    pub fn sampled_gauge(
        &self,
        name: &str,
        help: &str,
        sampler: impl Fn() -> Vec<(Vec<(String, String)>, f64)> + Send + Sync + 'static,
    ) {
        self.with_family(name, help, "gauge", |family| {
            family.samplers.push(Box::new(sampler))
        });
    }

    /// Prometheus text exposition format, version 0.0.4.
    pub fn render(&self) -> String {
        // Samplers may read other locks; collect them without holding the registry lock long
        // enough to matter (they are cheap reads of atomics and short mutexes).
        let families = self.families.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = String::new();
        for (name, family) in families.iter() {
            let _ = writeln!(out, "# HELP {name} {}", family.help);
            let _ = writeln!(out, "# TYPE {name} {}", family.kind);
            for (labels, counter) in &family.counters {
                let _ = writeln!(out, "{name}{} {}", render_labels(labels), counter.get());
            }
            for (labels, gauge) in &family.gauges {
                let _ = writeln!(out, "{name}{} {}", render_labels(labels), gauge.get());
            }
            for sampler in &family.samplers {
                for (labels, value) in sampler() {
                    let _ = writeln!(out, "{name}{} {value}", render_labels(&labels));
                }
            }
        }
        out
    }
}

fn render_labels(labels: &Labels) -> String {
    if labels.is_empty() {
        return String::new();
    }
    let inner: Vec<String> = labels
        .iter()
        .map(|(k, v)| {
            let escaped = v
                .replace('\\', "\\\\")
                .replace('"', "\\\"")
                .replace('\n', "\\n");
            format!("{k}=\"{escaped}\"")
        })
        .collect();
    format!("{{{}}}", inner.join(","))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_gauges_and_samplers() {
        let registry = Registry::new();
        registry
            .counter(
                "orca_relay_closes_total",
                "Closes by code.",
                &[("code", "4401")],
            )
            .add(3);
        registry
            .gauge(
                "orca_relay_connections",
                "Open connections.",
                &[("kind", "control")],
            )
            .set(2);
        registry.sampled_gauge("orca_relay_pool_waiters", "Pool waiters.", || {
            vec![(vec![], 4.0)]
        });
        let text = registry.render();
        assert!(text.contains("# TYPE orca_relay_closes_total counter"));
        assert!(text.contains("orca_relay_closes_total{code=\"4401\"} 3"));
        assert!(text.contains("orca_relay_connections{kind=\"control\"} 2"));
        assert!(text.contains("orca_relay_pool_waiters 4"));
    }

    #[test]
    fn the_same_key_gives_the_same_counter() {
        let registry = Registry::new();
        registry.counter("x_total", "x", &[("a", "1")]).inc();
        registry.counter("x_total", "x", &[("a", "1")]).inc();
        assert_eq!(registry.counter("x_total", "x", &[("a", "1")]).get(), 2);
    }
}
