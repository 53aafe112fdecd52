//! Encoding families of labelled samples: a descriptor (name, help, type)
//! followed by one sample per label set.

use std::fmt::Result;

use prometheus_client::encoding::{DescriptorEncoder, EncodeCounterValue, EncodeGaugeValue, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;

use crate::histogram::{HistogramSnapshot, BOUNDS_S};

/// The label pairs of one sample (`[("service", "web"), ("backend", "a")]`);
/// empty for a metric without labels.
pub trait Labels<'a>: AsRef<[(&'a str, &'a str)]> {}
impl<'a, T: AsRef<[(&'a str, &'a str)]>> Labels<'a> for T {}

/// Writes one sample through `write`, with its labels if it has any.
fn sample<'a>(
    m: &mut MetricEncoder<'_>,
    labels: &[(&'a str, &'a str)],
    write: impl FnOnce(&mut MetricEncoder<'_>) -> Result,
) -> Result {
    if labels.is_empty() {
        write(m)
    } else {
        write(&mut m.encode_family(&labels)?)
    }
}

/// A counter family (`name` without `_total`: the encoder appends it).
pub fn counter<'a, L: Labels<'a>, V: EncodeCounterValue>(
    enc: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    samples: impl IntoIterator<Item = (L, V)>,
) -> Result {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (labels, v) in samples {
        sample(&mut m, labels.as_ref(), |m| m.encode_counter::<NoLabelSet, V, u64>(&v, None))?;
    }
    Ok(())
}

/// A gauge family.
pub fn gauge<'a, L: Labels<'a>, V: EncodeGaugeValue>(
    enc: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    samples: impl IntoIterator<Item = (L, V)>,
) -> Result {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, v) in samples {
        sample(&mut m, labels.as_ref(), |m| m.encode_gauge(&v))?;
    }
    Ok(())
}

/// A histogram family, in seconds ([`BOUNDS_S`]).
pub fn histogram<'a, L: Labels<'a>>(
    enc: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    samples: impl IntoIterator<Item = (L, HistogramSnapshot)>,
) -> Result {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Histogram)?;
    for (labels, h) in samples {
        let mut buckets: Vec<(f64, u64)> = BOUNDS_S.iter().copied().zip(h.buckets.iter().copied()).collect();
        buckets.push((f64::MAX, h.buckets[BOUNDS_S.len()]));
        sample(&mut m, labels.as_ref(), |m| m.encode_histogram::<NoLabelSet>(h.sum_s, h.count(), &buckets, None))?;
    }
    Ok(())
}

/// An info metric: `name_info{labels} 1`.
pub fn info(enc: &mut DescriptorEncoder<'_>, name: &str, help: &str, labels: &[(&str, &str)]) -> Result {
    enc.encode_descriptor(name, help, None, MetricType::Info)?.encode_info(&labels)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{encode, Collector, Histogram, Registry};

    #[derive(Debug)]
    struct Sample;

    impl Collector for Sample {
        fn encode(&self, mut enc: DescriptorEncoder<'_>) -> Result {
            counter(&mut enc, "t_requests", "Requests.", [([("class", "2xx")], 3u64), ([("class", "5xx")], 1)])?;
            gauge(&mut enc, "t_revision", "Revision.", [([], 7u64)])?;
            let h = Histogram::default();
            h.observe_ns(2_000_000);
            histogram(&mut enc, "t_duration_seconds", "Duration.", [([("route", "r")], h.snapshot())])?;
            info(&mut enc, "t_build", "Build.", &[("version", "1.2.3")])
        }
    }

    #[test]
    fn families_encode_as_openmetrics_text() {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(Sample));
        let text = encode(&registry);
        for line in [
            "# TYPE t_requests counter",
            "t_requests_total{class=\"2xx\"} 3",
            "t_requests_total{class=\"5xx\"} 1",
            "t_revision 7",
            "# TYPE t_duration_seconds histogram",
            "t_duration_seconds_bucket{le=\"0.001\",route=\"r\"} 0",
            "t_duration_seconds_bucket{le=\"0.0025\",route=\"r\"} 1",
            "t_duration_seconds_bucket{le=\"+Inf\",route=\"r\"} 1",
            "t_duration_seconds_count{route=\"r\"} 1",
            "t_build_info{version=\"1.2.3\"} 1",
            "# EOF",
        ] {
            assert!(text.lines().any(|l| l == line), "no line {line:?} in\n{text}");
        }
    }
}
