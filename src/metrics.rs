//! Counters and gauges, rendered as Prometheus text at `GET /metrics` (SPEC §5.6).
//!
//! A [`Registry`] hands out `Arc`-shared atomics keyed by family name and labels; hot paths keep
//! the handle they got instead of looking it up per event. Gauges whose value lives elsewhere
//! (pool size, mode, dead-man state) are registered as sampling functions and read at render
//! time.

use crate::carry::process::SeriesRecord;
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

/// A histogram with fixed upper bounds (`le`), cumulative as Prometheus renders it. Observing
/// is a few relaxed atomic adds.
#[derive(Clone, Debug)]
pub struct Histogram(Arc<HistogramInner>);

#[derive(Debug)]
struct HistogramInner {
    bounds: Vec<u64>,
    /// One count per bound (not cumulative), then the overflow (+Inf).
    buckets: Vec<AtomicU64>,
    sum: AtomicU64,
}

impl Histogram {
    fn new(bounds: &[u64]) -> Histogram {
        Histogram(Arc::new(HistogramInner {
            bounds: bounds.to_vec(),
            buckets: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum: AtomicU64::new(0),
        }))
    }

    pub fn observe(&self, value: u64) {
        let index = self
            .0
            .bounds
            .iter()
            .position(|bound| value <= *bound)
            .unwrap_or(self.0.bounds.len());
        self.0.buckets[index].fetch_add(1, Ordering::Relaxed);
        self.0.sum.fetch_add(value, Ordering::Relaxed);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.0
            .buckets
            .iter()
            .map(|bucket| bucket.load(Ordering::Relaxed))
            .sum()
    }

    /// Observations above `bound` (which must be one of the bounds, or it counts from the
    /// next one up).
    pub fn count_above(&self, bound: u64) -> u64 {
        self.0
            .bounds
            .iter()
            .zip(&self.0.buckets)
            .filter(|(b, _)| **b > bound)
            .map(|(_, bucket)| bucket.load(Ordering::Relaxed))
            .sum::<u64>()
            + self.0.buckets[self.0.bounds.len()].load(Ordering::Relaxed)
    }
}

#[derive(Default)]
struct Family {
    help: String,
    kind: &'static str,
    counters: BTreeMap<Labels, Counter>,
    gauges: BTreeMap<Labels, Gauge>,
    histograms: BTreeMap<Labels, Histogram>,
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

    /// The histogram of `name` with these labels and upper bounds, created empty on first use
    /// (later calls get the first one's bounds).
    pub fn histogram(
        &self,
        name: &str,
        help: &str,
        label_pairs: &[(&str, &str)],
        bounds: &[u64],
    ) -> Histogram {
        self.with_family(name, help, "histogram", |family| {
            family
                .histograms
                .entry(labels(label_pairs))
                .or_insert_with(|| Histogram::new(bounds))
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

    /// A counter family whose values are sampled at render time (counted elsewhere, in
    /// atomics of their own).
    pub fn sampled_counter(
        &self,
        name: &str,
        help: &str,
        sampler: impl Fn() -> Vec<(Vec<(String, String)>, f64)> + Send + Sync + 'static,
    ) {
        self.with_family(name, help, "counter", |f| {
            f.samplers.push(Box::new(sampler))
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
            for (labels, histogram) in &family.histograms {
                let mut cumulative = 0;
                let inner = &histogram.0;
                for (bound, bucket) in inner.bounds.iter().zip(&inner.buckets) {
                    cumulative += bucket.load(Ordering::Relaxed);
                    let mut with_le = labels.clone();
                    with_le.push(("le".to_string(), bound.to_string()));
                    let _ = writeln!(out, "{name}_bucket{} {cumulative}", render_labels(&with_le));
                }
                let mut with_le = labels.clone();
                with_le.push(("le".to_string(), "+Inf".to_string()));
                let _ = writeln!(
                    out,
                    "{name}_bucket{} {}",
                    render_labels(&with_le),
                    histogram.count()
                );
                let _ = writeln!(
                    out,
                    "{name}_sum{} {}",
                    render_labels(labels),
                    inner.sum.load(Ordering::Relaxed)
                );
                let _ = writeln!(
                    out,
                    "{name}_count{} {}",
                    render_labels(labels),
                    histogram.count()
                );
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

impl Registry {
    /// Every counter and histogram (gauges are recomputed by the next process).
    pub fn record(&self) -> Vec<SeriesRecord> {
        let families = self.families.lock().unwrap_or_else(|e| e.into_inner());
        let mut records = Vec::new();
        for (name, family) in families.iter() {
            for (labels, counter) in &family.counters {
                records.push(SeriesRecord {
                    name: name.clone(),
                    help: family.help.clone(),
                    labels: labels.clone(),
                    value: counter.get(),
                    bounds: Vec::new(),
                    buckets: Vec::new(),
                });
            }
            for (labels, histogram) in &family.histograms {
                let inner = &histogram.0;
                records.push(SeriesRecord {
                    name: name.clone(),
                    help: family.help.clone(),
                    labels: labels.clone(),
                    value: inner.sum.load(Ordering::Relaxed),
                    bounds: inner.bounds.clone(),
                    buckets: inner
                        .buckets
                        .iter()
                        .map(|bucket| bucket.load(Ordering::Relaxed))
                        .collect(),
                });
            }
        }
        records
    }

    /// Adds a handover's totals to this registry's series (created if need be).
    pub fn restore(&self, records: &[SeriesRecord]) {
        for record in records {
            let pairs: Vec<(&str, &str)> = record
                .labels
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            if record.bounds.is_empty() {
                self.counter(&record.name, &record.help, &pairs)
                    .add(record.value);
                continue;
            }
            let histogram = self.histogram(&record.name, &record.help, &pairs, &record.bounds);
            let inner = &histogram.0;
            if inner.bounds != record.bounds || inner.buckets.len() != record.buckets.len() {
                // Other bounds in this build: the totals do not map bucket by bucket.
                continue;
            }
            for (bucket, count) in inner.buckets.iter().zip(&record.buckets) {
                bucket.fetch_add(*count, Ordering::Relaxed);
            }
            inner.sum.fetch_add(record.value, Ordering::Relaxed);
        }
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

    #[test]
    fn histograms_render_cumulative_buckets_sum_and_count() {
        let registry = Registry::new();
        let h = registry.histogram("x_ms", "x.", &[], &[100, 1_000]);
        for value in [50, 100, 101, 5_000] {
            h.observe(value);
        }
        assert_eq!(h.count(), 4);
        assert_eq!(h.count_above(100), 2);
        assert_eq!(h.count_above(1_000), 1);
        let text = registry.render();
        assert!(text.contains("# TYPE x_ms histogram"), "{text}");
        assert!(text.contains("x_ms_bucket{le=\"100\"} 2"), "{text}");
        assert!(text.contains("x_ms_bucket{le=\"1000\"} 3"), "{text}");
        assert!(text.contains("x_ms_bucket{le=\"+Inf\"} 4"), "{text}");
        assert!(text.contains("x_ms_sum 5251"), "{text}");
        assert!(text.contains("x_ms_count 4"), "{text}");
    }
}
