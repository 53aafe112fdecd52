//! Sets of networks, matched by binary search over merged address ranges.

use std::net::IpAddr;

use tidegate_model::rules::Cidr;

/// A set of networks.
#[derive(Debug, Clone, Default)]
pub struct CidrSet {
    v4: Vec<(u32, u32)>,
    v6: Vec<(u128, u128)>,
}

fn merge<T: Ord + Copy>(mut ranges: Vec<(T, T)>, next: impl Fn(T) -> Option<T>) -> Vec<(T, T)> {
    ranges.sort();
    let mut out: Vec<(T, T)> = Vec::with_capacity(ranges.len());
    for (lo, hi) in ranges {
        match out.last_mut() {
            Some(last) if next(last.1).is_none_or(|n| lo <= n) => last.1 = last.1.max(hi),
            _ => out.push((lo, hi)),
        }
    }
    out
}

fn find<T: Ord + Copy>(ranges: &[(T, T)], ip: T) -> bool {
    let i = ranges.partition_point(|(lo, _)| *lo <= ip);
    i > 0 && ranges[i - 1].1 >= ip
}

impl CidrSet {
    /// The set of `cidrs`.
    pub fn new(cidrs: &[Cidr]) -> CidrSet {
        let mut v4 = Vec::new();
        let mut v6 = Vec::new();
        for c in cidrs {
            match c.addr {
                IpAddr::V4(a) => {
                    let lo = u32::from(a);
                    let span =
                        if c.len == 0 { u32::MAX } else { (1u32 << (32 - u32::from(c.len.min(32)))).wrapping_sub(1) };
                    v4.push((lo, lo | span));
                }
                IpAddr::V6(a) => {
                    let lo = u128::from(a);
                    let span = if c.len == 0 {
                        u128::MAX
                    } else {
                        (1u128 << (128 - u32::from(c.len.min(128)))).wrapping_sub(1)
                    };
                    v6.push((lo, lo | span));
                }
            }
        }
        CidrSet { v4: merge(v4, |x: u32| x.checked_add(1)), v6: merge(v6, |x: u128| x.checked_add(1)) }
    }

    /// Whether `ip` is in one of the networks (an IPv4-mapped IPv6
    /// address as the IPv4 address it maps).
    pub fn contains(&self, ip: IpAddr) -> bool {
        match ip {
            IpAddr::V4(a) => find(&self.v4, u32::from(a)),
            IpAddr::V6(a) => match a.to_ipv4_mapped() {
                Some(v4) => find(&self.v4, u32::from(v4)),
                None => find(&self.v6, u128::from(a)),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cidr(addr: IpAddr, len: u8) -> Cidr {
        let masked = match addr {
            IpAddr::V4(a) => {
                let m = if len == 0 { 0 } else { u32::MAX << (32 - u32::from(len)) };
                IpAddr::V4((u32::from(a) & m).into())
            }
            IpAddr::V6(a) => {
                let m = if len == 0 { 0 } else { u128::MAX << (128 - u32::from(len)) };
                IpAddr::V6((u128::from(a) & m).into())
            }
        };
        Cidr::try_from(format!("{masked}/{len}")).unwrap()
    }

    proptest! {
        /// The set says what checking each network in turn says.
        #[test]
        fn the_set_matches_as_its_networks_do(
            nets in proptest::collection::vec((any::<u32>(), 0u8..=32), 0..20),
            nets6 in proptest::collection::vec((any::<u128>(), 0u8..=128), 0..5),
            probes in proptest::collection::vec(any::<u32>(), 1..50),
        ) {
            let mut cidrs: Vec<Cidr> = nets.iter().map(|(a, l)| cidr(IpAddr::V4((*a).into()), *l)).collect();
            cidrs.extend(nets6.iter().map(|(a, l)| cidr(IpAddr::V6((*a).into()), *l)));
            let set = CidrSet::new(&cidrs);
            for p in probes.iter().copied().chain(nets.iter().map(|(a, _)| *a)) {
                let ip = IpAddr::V4(p.into());
                prop_assert_eq!(set.contains(ip), cidrs.iter().any(|c| c.contains(ip)), "{}", ip);
            }
            for (a, _) in &nets6 {
                let ip = IpAddr::V6((*a).into());
                prop_assert_eq!(set.contains(ip), cidrs.iter().any(|c| c.contains(ip)), "{}", ip);
            }
        }
    }
}
